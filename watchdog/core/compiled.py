"""Compiled functions: the cache entries ``mx.compile`` keeps, per function and per input signature.

MLX keeps one cache entry per *input signature* of a compiled function, for as long as the
compiled function lives: the shapes and dtypes of its array arguments (with ``shapeless=True``
their number of dimensions and dtypes), the values of its other arguments (ints, floats, strings,
None), the structure of its argument tree, and the shapes and dtypes of the arrays it captures
(``inputs=``). Each entry keeps the constants of its traced graph (scalars of the computation,
merged by value), a buffer each. A function fed ever new shapes (a training step fed every
length of a dataset) keeps more buffers at every new shape while MLX's active memory stays nearly
flat: tiny scalars, many of them.

This module is the registry: ``mlx_watchdog.attach.compiled`` wraps ``mx.compile`` and records
here, for each compiled function, every trace MLX runs (a cache miss) and its signature. A
watchdog reads the registry at each walk (``tallies``): a site ``compiled:<module>.<function>``
per function, holding its entries times the buffers one entry keeps (``CompiledFunction.buffers``).
The compile cache is process-wide, so every watchdog of the process counts it, as it counts
MLX's memory. The fix never touches it: evaluating arrays cuts no cache entry.

Buffers per entry are measured, not assumed: on a call that traces, the lazy outputs MLX returns
are the entry's tape replayed on the real inputs, so the evaluated arrays reachable from the
outputs and not from the inputs are the entry's constants (``measure_entry``: two exports of the
graph, the outputs with the inputs and the inputs alone). The first ``MEASURED_TRACES`` traces
of a function are measured, then one in each doubling of its traces.

This module imports the standard library only; MLX and the graph walk come in when a trace is
recorded or measured (the program has imported MLX then): ``mlx-watchdog run`` instruments a
process before the program imports MLX.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .forecast import Leak

PREFIX = "compiled:"  # the site of a compiled function: "compiled:mlx_lm.tuner.trainer.step"
MEASURED_TRACES = 3  # traces measured first; then one in each doubling of the traces
MEASUREMENTS_KEPT = 16
MAX_FLAT_ARRAYS = 1_000_000  # arrays of one argument tree looked at, at most
ADVICE = (
    "each new input signature (shapes, dtypes, other arguments) of a compiled function keeps a "
    "cache entry for as long as the function lives, and the fix cannot cut it: compile it with "
    "mx.compile(..., shapeless=True) where the function allows, or pad its inputs to a few "
    "lengths (buckets)"
)

# What MLX puts in a signature for the structure of the argument tree and for None.
_LIST = "list"
_DICT = "dict"
_NONE = "none"
_SOURCE = '{ rank=source; "'  # an evaluated array (or a source of the graph) in export_to_dot's text


def is_compiled_site(site: str) -> bool:
    """Is ``site`` a compiled function's (``compiled:...``)?"""
    return site.startswith(PREFIX)


class CompiledFunction:
    """One compiled function (one ``mx.compile`` call): its traces, the signatures of its live
    cache entries and the buffers one entry keeps. Thread-safe."""

    def __init__(self, name: str, shapeless: bool = False):
        self.name = name
        self.site = PREFIX + name
        self.shapeless = bool(shapeless)
        self.traces = 0  # traces MLX ran: a new cache entry each
        self.retraces = 0  # of which of a signature traced before (its entry was not kept)
        self.alive = True  # False once the compiled function died: MLX erased its entries
        self.measurements = 0
        self.errors = 0  # failures of the bookkeeping, caught (the program's call goes on)
        self._signatures: set[tuple] = set()
        self._arguments: set[tuple] = set()  # the signatures' argument part
        self._measured: collections.deque[int] = collections.deque(maxlen=MEASUREMENTS_KEPT)
        self._next_measure = 0  # the trace count from which the next trace is measured
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CompiledFunction({self.name!r}, entries={self.entries}, traces={self.traces})"

    @property
    def entries(self) -> int:
        """Cache entries MLX keeps now: the distinct signatures traced while it lives."""
        return len(self._signatures) if self.alive else 0

    @property
    def entry_buffers(self) -> float | None:
        """Buffers one cache entry keeps (the median of the measurements); None before one."""
        measured = list(self._measured)
        return float(statistics.median(measured)) if measured else None

    @property
    def buffers(self) -> int:
        """Buffers its cache entries keep, estimated: entries x buffers per entry."""
        per_entry = self.entry_buffers
        return int(round(self.entries * per_entry)) if per_entry is not None else 0

    def knows(self, arguments: tuple) -> bool:
        """Has a live entry this argument signature (a call with it does not trace)?"""
        return arguments in self._arguments

    def traced(self, arguments: tuple, captured: int) -> bool:
        """MLX traced the function for these signatures (arguments, captured arrays). Returns
        whether a trace from now on should be measured."""
        with self._lock:
            self.traces += 1
            signature = (arguments, captured)
            if signature in self._signatures:
                self.retraces += 1
            else:
                self._signatures.add(signature)
                self._arguments.add(arguments)
            return self._wants_measure(self.traces + 1)

    def wants_measure(self) -> bool:
        """Should the next trace be measured?"""
        with self._lock:
            return self._wants_measure(self.traces + 1)

    def _wants_measure(self, trace: int) -> bool:
        return self.measurements < MEASURED_TRACES or trace >= self._next_measure

    def measured(self, buffers: int) -> None:
        """One entry was measured to keep ``buffers`` buffers."""
        with self._lock:
            self._measured.append(max(0, int(buffers)))
            self.measurements += 1
            if self.measurements >= MEASURED_TRACES:
                self._next_measure = 2 * max(1, self.traces)

    def erased(self) -> None:
        """The compiled function died: MLX erased its cache entries."""
        with self._lock:
            self.alive = False
            self._signatures.clear()
            self._arguments.clear()


# --------------------------------------------------------------------------- the registry

_lock = threading.Lock()
_functions: dict[int, CompiledFunction] = {}


def register(function: CompiledFunction) -> None:
    """A compiled function that lives: the watchdogs count its entries from now on."""
    with _lock:
        _functions[id(function)] = function


def unregister(function: CompiledFunction) -> None:
    """It died (its entries went with it): no longer counted."""
    function.erased()
    with _lock:
        _functions.pop(id(function), None)


def functions() -> list[CompiledFunction]:
    """The compiled functions alive, in the order they were compiled."""
    with _lock:
        return list(_functions.values())


def tallies() -> dict[str, tuple[int, int]]:
    """Site -> (buffers, cache entries) of the compiled functions alive that keep an entry.
    Functions of the same name share a site."""
    sites: dict[str, tuple[int, int]] = {}
    for function in functions():
        entries = function.entries
        if entries:
            buffers, before = sites.get(function.site, (0, 0))
            sites[function.site] = (buffers + function.buffers, before + entries)
    return sites


def signatures_by_site() -> dict[str, int]:
    """Site -> the cache entries (input signatures) its compiled functions keep now."""
    return {site: entries for site, (_, entries) in tallies().items()}


def annotate(leaks: Sequence[Leak]) -> tuple[Leak, ...]:
    """The leaks, those of compiled functions with their signature count."""
    if not any(is_compiled_site(leak.site) for leak in leaks):
        return tuple(leaks)
    counts = signatures_by_site()
    return tuple(
        dataclasses.replace(leak, signatures=counts.get(leak.site, 0))
        if is_compiled_site(leak.site)
        else leak
        for leak in leaks
    )


def advice(leaks: Iterable[Leak]) -> str | None:
    """What to do about the compiled functions among the leaks (biggest first), or None."""
    sites = [leak.site for leak in leaks if is_compiled_site(leak.site)]
    if not sites:
        return None
    return f"{', '.join(dict.fromkeys(sites))}: {ADVICE}"


# --------------------------------------------------------------------------- signatures


def _array_type() -> type | None:
    module = sys.modules.get("mlx.core")
    return getattr(module, "array", None) if module is not None else None


def argument_signature(args: tuple, kwargs: dict, shapeless: bool) -> tuple:
    """The argument part of a call's signature, as MLX keys its cache: the tree's structure, each
    array's shape (``shapeless``: its number of dimensions) and dtype, each other value. Read
    through the containers' own types (a subclass's methods never run)."""
    array = _array_type()
    out: list = []
    _signature(args, array, shapeless, out, 0)
    _signature(kwargs, array, shapeless, out, 0)
    return tuple(out)


def _signature(value: Any, array: type | None, shapeless: bool, out: list, depth: int) -> None:
    if depth > 256:
        out.append("deep")
        return
    if array is not None and isinstance(value, array):
        shape = tuple(array.shape.__get__(value))  # type: ignore[attr-defined]
        out.append((len(shape) if shapeless else shape, array.dtype.__get__(value)))  # type: ignore[attr-defined]
    elif isinstance(value, (list, tuple)):
        out.append(_LIST)  # MLX keys a tuple as a list
        items = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
        for item in items:
            _signature(item, array, shapeless, out, depth + 1)
    elif isinstance(value, dict):
        out.append(_DICT)
        for key, item in dict.items(value):
            # MLX hashes the key: a string or an int stands for itself, another key for its type
            out.append(key if type(key) in (str, int) else type(key).__name__)
            _signature(item, array, shapeless, out, depth + 1)
    elif value is None:
        out.append(_NONE)
    elif isinstance(value, bool):
        out.append(int(value))  # MLX reads a bool as the int it is
    elif isinstance(value, float):
        out.append(("f", struct.unpack("<Q", struct.pack("<d", value))[0]))  # its bits, as MLX
    elif isinstance(value, int):
        out.append(("i", int.__int__(value)))
    elif isinstance(value, str):
        out.append(("s", str.__str__(value)))
    else:
        out.append(("?", type(value).__name__))  # MLX refuses it; the call fails on its own


def captured_signature(tree: Any, shapeless: bool) -> int:
    """The captured arrays' part of a signature (``inputs=`` of ``mx.compile``): a hash of their
    shapes (or numbers of dimensions) and dtypes, in MLX's order."""
    array = _array_type()
    if tree is None or array is None:
        return 0
    shape_of, dtype_of = array.shape.__get__, array.dtype.__get__  # type: ignore[attr-defined]
    return hash(
        tuple(
            (len(shape) if shapeless else shape, dtype_of(a))
            for a in flat_arrays(tree)
            for shape in (tuple(shape_of(a)),)
        )
    )


def flat_arrays(tree: Any, limit: int = MAX_FLAT_ARRAYS) -> list:
    """The arrays of an argument tree (lists, tuples, dicts, ``nn.Module``: a dict), in MLX's
    order, at most ``limit``; read through the containers' own types."""
    array = _array_type()
    found: list = []
    if array is None:
        return found
    stack = [tree]
    seen = 0
    while stack and seen < limit:
        value = stack.pop()
        seen += 1
        if isinstance(value, array):
            found.append(value)
        elif isinstance(value, list):
            stack.extend(reversed(list(list.__iter__(value))))
        elif isinstance(value, tuple):
            stack.extend(reversed(list(tuple.__iter__(value))))
        elif isinstance(value, dict):
            stack.extend(reversed(list(dict.values(value))))
    return found


# --------------------------------------------------------------------------- measuring an entry


class _Capture:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


def measure_entry(inputs: Sequence[Any], outputs: Sequence[Any]) -> int | None:
    """The buffers a cache entry keeps, from a call that traced: its lazy outputs are the entry's
    tape replayed on ``inputs`` (every array argument and captured input of the call), so the
    evaluated arrays reachable from the outputs and not from the inputs are the entry's
    constants. Walks on the watchdog's big-stack thread; None when it cannot."""
    import mlx.core as mx

    from . import graph

    walker = graph.deep_walker()
    if walker.stack_bytes == 0:
        return None

    def sources(arrays: Sequence[Any]) -> int:
        capture = _Capture()
        mx.export_to_dot(capture, *arrays)  # positional: any number of arrays, one graph
        return capture.text.count(_SOURCE)

    inputs, outputs = list(inputs), list(outputs)
    both = walker.run(lambda: str(sources(inputs + outputs)))
    alone = walker.run(lambda: str(sources(inputs)))
    return max(0, int(both) - int(alone))
