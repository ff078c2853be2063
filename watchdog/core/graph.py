"""Graph accounting: how many pending nodes, and how many evaluated buffers they keep alive.

MLX has no public walk of its lazy graph other than ``mx.export_to_dot``. It walks everything
reachable from the arrays it is given (in C++), builds the whole DOT text and hands it to
``file.write`` in one call, so we read the counts out of that text:

* ``{ rank=source; "X"; }``  an evaluated array: it owns (or shares) a buffer and has no inputs
* ``{ "X"; }`` / ``{ rank=sink; "X"; }``  a pending array
* ``{ 1234 [label ="Add", shape=rectangle]; }``  a pending primitive (a graph node)
* ``"X" -> 1234``  X is an input of primitive 1234; ``1234 -> "X"``  1234 produces X

Our arrays are passed by keyword (``n0``, ``n1``, ...) so they keep those names in the text;
MLX names the others with capital letters, so the two cannot collide. One call for all arrays
means a buffer shared by two pending chains is counted once.

``export_to_dot`` recurses once per node: a deep enough chain overflows the 8 MB stack of a main
thread and kills the process. Big walks therefore run on one worker thread of ours with
a large stack, while the calling thread waits (MLX's graph is not safe to read while the
program changes it, so the walk never runs beside the program).
"""

from __future__ import annotations

import dataclasses
import queue
import re
import threading
from collections.abc import Callable, Sequence

import mlx.core as mx

from . import clock, descriptor

# One array line of ours ends `"n3"; }` (an edge reads `"n3" -> 12`): found by its literal start,
# which the regex engine searches for fast; a pattern anchored at each line start tried every line,
# and took as long as the export itself.
_OURS = re.compile(r'"n(\d+)"; \}')
# What starts that line: evaluated, or pending (`{ "n3"; }` / `{ rank=sink; "n3"; }`).
_EVALUATED_HEAD = "{ rank=source; "
_PENDING_HEADS = ("{ ", "{ rank=sink; ")
_SOURCE = '{ rank=source; "'
_PRIMITIVE = "shape=rectangle]; }"

MAX_KEYWORDS = 1000  # nanobind passes at most 1,024 keyword arguments to export_to_dot
# Without the big-stack worker, only walks this small run on the calling thread: well within 8 MB.
INLINE_NODES = 20_000
WORKER_STACK_BYTES = 1 << 30  # virtual: only the pages a deep walk touches are ever used
BYTES_PER_LEVEL = 256  # twice the stack one node of recursion takes, to be safe


@dataclasses.dataclass
class GraphReading:
    """Counts for one walk. ``retained_by_array[i]`` and ``nodes_by_array[i]`` belong to ``arrays[i]``."""

    evaluated_arrays: int  # walked arrays that are evaluated (own a buffer)
    pending_arrays: int  # walked arrays that are still lazy
    pending_nodes: int  # pending primitives reachable from the walked arrays
    retained_buffers: int  # evaluated buffers kept alive only by pending graphs
    retained_by_array: list[int]
    evaluated_by_array: list[bool]
    dot_bytes: int
    nodes_by_array: list[int] = dataclasses.field(default_factory=list)


class _Capture:
    """A file-like object for ``export_to_dot``: keeps the single string it is given."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


class _DeepWalker:
    """One daemon thread with a large stack that runs exports for any caller, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], str], list]] = queue.Queue()
        self.stack_bytes = 0
        self.cpu_seconds = 0.0  # this thread's CPU time in jobs (see cpu_clock)
        previous = threading.stack_size()
        for size in (WORKER_STACK_BYTES, WORKER_STACK_BYTES // 4, 64 << 20):
            try:
                threading.stack_size(size)
                thread = threading.Thread(target=self._run, name="mlx-watchdog-walk", daemon=True)
                thread.start()
            except (ValueError, RuntimeError, MemoryError):
                continue
            finally:
                threading.stack_size(previous)
            self.stack_bytes = size
            break

    @property
    def max_depth(self) -> int:
        return self.stack_bytes // BYTES_PER_LEVEL

    def _run(self) -> None:
        while True:
            job, box = self._jobs.get()
            started = clock.cpu()
            result: tuple[bool, str | BaseException]
            try:
                result = (True, job())
            except BaseException as exc:  # handed back to the caller, which raises it
                result = (False, exc)
            # The job holds the arrays it walked. Dropped only after the caller woke, they would stay
            # alive while this thread waits for a core, after the program dropped them.
            del job
            self.cpu_seconds += clock.cpu() - started  # before the caller wakes
            done = box[0]
            box.append(result)
            del box, result
            done.set()

    def run(self, job: Callable[[], str]) -> str:
        done = threading.Event()
        box: list = [done]
        self._jobs.put((job, box))
        done.wait()
        ok, value = box[1]
        if not ok:
            raise value
        return value


_walker: _DeepWalker | None = None
_walker_lock = threading.Lock()


def cpu_clock() -> float:
    """CPU seconds spent by the calling thread and by the walker thread: the walks' own work.

    A walk's wall time on a loaded machine includes the time it waited for a core; sized by it,
    walks would shrink to samples that misread a batch that just changed. CPU time is what the
    graph costs to walk."""
    walker = _walker
    return clock.cpu() + (walker.cpu_seconds if walker is not None else 0.0)


def deep_walker() -> _DeepWalker:
    global _walker
    with _walker_lock:
        if _walker is None:
            _walker = _DeepWalker()
        return _walker


class TooDeep(RuntimeError):
    """A graph that may be deeper than any stack we have would hold: not walked."""


def export_dot(arrays: Sequence[mx.array], *, nodes_hint: int | None = None) -> str:
    """The DOT text of the graphs behind ``arrays`` (at most ``MAX_KEYWORDS`` of them).

    ``nodes_hint``: how many nodes the caller expects (None: unknown). Every walk runs on the
    big-stack worker (its hand-off is small beside a walk), so a chain deeper than predicted
    cannot overflow the caller's stack."""

    def job() -> str:
        capture = _Capture()
        mx.export_to_dot(capture, **{f"n{i}": a for i, a in enumerate(arrays)})
        return capture.text

    walker = deep_walker()
    if walker.stack_bytes == 0:
        if nodes_hint is not None and nodes_hint <= INLINE_NODES:
            return job()
        raise TooDeep("no thread with a large stack could be started")
    if nodes_hint is not None and nodes_hint > walker.max_depth:
        raise TooDeep(f"a graph of ~{nodes_hint} nodes may be deeper than the walker's stack holds")
    return walker.run(job)


def is_evaluated(array: mx.array) -> bool:
    """True when the array holds a buffer (evaluated, or scheduled by ``async_eval``), in O(1),
    unlike a graph walk (see ``evaluated_check``)."""
    tell = _tell if _tell is not None else _choose_check(None)
    return tell(array)


def _buffer_size_tells(array: mx.array) -> bool:
    try:
        mx.get_array_buffer_size(array)  # refuses an unevaluated array
        return True
    except ValueError:
        return False


def _export_tells(array: mx.array) -> bool:
    """The slow way, where nothing else can tell: the array's whole graph exported."""
    try:
        return '{ rank=source; "n0"; }' in export_dot([array])
    except TooDeep:  # only a pending array has a graph
        return False


def _descriptor_tells() -> Callable[[mx.array], bool] | None:
    read = descriptor.reader()
    if read is None:
        return None

    def tell(array: mx.array) -> bool:
        evaluated = read(array)
        return _export_tells(array) if evaluated is None else evaluated

    return tell


EVALUATED_CHECKS = ("buffer size", "descriptor", "export")
_tell: Callable[[mx.array], bool] | None = None
_check = ""


def evaluated_check() -> str:
    """How ``is_evaluated`` tells arrays here: ``"buffer size"`` (``mx.get_array_buffer_size``,
    mlx 0.32.4 and later), ``"descriptor"`` (the status field of the array's C++ descriptor, read
    from memory: earlier MLX, see ``descriptor``) or ``"export"`` (an export of the array's graph,
    where neither can: as right, and as slow as a walk)."""
    if _tell is None:
        _choose_check(None)
    return _check


def use_evaluated_check(name: str | None) -> str:
    """Tell arrays one of ``EVALUATED_CHECKS`` ways from now on (tests, benchmarks); None: the
    first that works here. Returns the one in use; ValueError where it does not work here."""
    _choose_check(name)
    return _check


def _choose_check(name: str | None) -> Callable[[mx.array], bool]:
    global _tell, _check
    if name not in (None, *EVALUATED_CHECKS):
        raise ValueError(f"no evaluated check {name!r}: one of {EVALUATED_CHECKS}")
    tell: Callable[[mx.array], bool] | None = None
    for check in EVALUATED_CHECKS if name is None else (name,):
        if check == "buffer size":
            tell = _buffer_size_tells if hasattr(mx, "get_array_buffer_size") else None
        elif check == "descriptor":
            tell = _descriptor_tells()
        else:
            tell = _export_tells
        if tell is not None:
            _tell, _check = tell, check
            return tell
    raise ValueError(f"the evaluated check {name!r} does not work with this MLX")


def account(arrays: Sequence[mx.array], *, nodes_hint: int | None = None) -> GraphReading:
    """Walk the lazy graphs of ``arrays`` and attribute every retained buffer and node.

    MLX writes the graph in post-order, output by output: every node is written after its
    inputs, and a node already written is not written again. So what is written between two of
    our arrays belongs to the graph of the second one: counted slice by slice, the per-array
    counts add up to the total. More than ``MAX_KEYWORDS`` arrays are walked in batches (a
    buffer shared across two batches is then counted in both)."""
    n = len(arrays)
    retained = [0] * n
    nodes = [0] * n
    done = [False] * n
    dot_bytes = 0
    for first in range(0, n, MAX_KEYWORDS):
        batch = arrays[first : first + MAX_KEYWORDS]
        text = export_dot(batch, nodes_hint=nodes_hint)
        dot_bytes += len(text)
        since = 0
        for match in _OURS.finditer(text):
            start = text.rfind("\n", 0, match.start()) + 1
            head = text[start : match.start()]
            if head != _EVALUATED_HEAD and head not in _PENDING_HEADS:
                continue
            i = first + int(match.group(1))
            retained[i] += text.count(_SOURCE, since, start)
            nodes[i] += text.count(_PRIMITIVE, since, start)
            done[i] = head == _EVALUATED_HEAD
            since = match.end()
        del text
    evaluated = sum(done)
    return GraphReading(
        evaluated_arrays=evaluated,
        pending_arrays=n - evaluated,
        pending_nodes=sum(nodes),
        retained_buffers=sum(retained),
        retained_by_array=retained,
        evaluated_by_array=done,
        dot_bytes=dot_bytes,
        nodes_by_array=nodes,
    )


def graph_size(arrays: Sequence[mx.array]) -> tuple[int, int]:
    """(pending nodes, distinct evaluated buffers) of the lazy graph behind ``arrays``:
    what evaluating them would run and read. Used to size a prefill chunk before it runs."""
    text = export_dot(arrays)
    return text.count(_PRIMITIVE), text.count(_SOURCE)
