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
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import mlx.core as mx


@dataclasses.dataclass
class GraphReading:
    """Counts for one walk. ``retained_by_array[i]`` is attributed to ``arrays[i]``."""

    evaluated_arrays: int  # walked arrays that are evaluated (own a buffer)
    pending_arrays: int  # walked arrays that are still lazy
    pending_nodes: int  # pending primitives reachable from the walked arrays
    retained_buffers: int  # evaluated buffers kept alive only by pending graphs
    retained_by_array: list[int]
    evaluated_by_array: list[bool]
    dot_bytes: int


class _Capture:
    """A file-like object for ``export_to_dot``: keeps the single string it is given."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


def export_dot(arrays: Sequence[mx.array]) -> str:
    capture = _Capture()
    mx.export_to_dot(capture, **{f"n{i}": a for i, a in enumerate(arrays)})
    return capture.text


def is_evaluated(array: mx.array) -> bool:
    """True when the array holds a buffer (evaluated, or scheduled by ``async_eval``).

    ``get_array_buffer_size`` refuses unevaluated arrays in O(1), unlike a graph walk."""
    try:
        mx.get_array_buffer_size(array)
        return True
    except ValueError:
        return False


def account(arrays: Sequence[mx.array]) -> GraphReading:
    """Walk the lazy graphs of ``arrays`` once and attribute every retained buffer.

    A buffer reachable from several pending arrays goes to the first of them, so the
    per-array counts add up to the total."""
    if not arrays:
        return GraphReading(0, 0, 0, 0, [], [], 0)
    text = export_dot(arrays)
    evaluated: set[str] = set()
    pending_nodes = 0
    producer: dict[str, str] = {}  # array name -> primitive id that produces it
    inputs: dict[str, list[str]] = {}  # primitive id -> input array names
    for line in text.split("\n"):
        if line.startswith('{ rank=source; "'):
            evaluated.add(line[16:-4])
        elif line.startswith('"'):
            name, _, prim = line.partition('" -> ')
            inputs.setdefault(prim, []).append(name[1:])
        elif line.endswith('"'):
            prim, _, name = line.partition(' -> "')
            if name:
                producer[name[:-1]] = prim
        elif line.endswith("shape=rectangle]; }"):
            pending_nodes += 1

    names = [f"n{i}" for i in range(len(arrays))]
    ours = set(names)
    is_done = [n in evaluated for n in names]
    retained_by_array = [0] * len(arrays)
    visited_arrays: set[str] = set()
    visited_prims: set[str] = set()
    for i, name in enumerate(names):
        if is_done[i]:
            continue
        count = 0
        stack = [name]
        while stack:
            node = stack.pop()
            if node in visited_arrays:
                continue
            visited_arrays.add(node)
            if node in evaluated:
                if node not in ours:  # our own evaluated arrays are counted as cache buffers
                    count += 1
                continue
            prim = producer.get(node)
            if prim is None or prim in visited_prims:
                continue
            visited_prims.add(prim)
            stack.extend(inputs.get(prim, ()))
        retained_by_array[i] = count
    return GraphReading(
        evaluated_arrays=sum(is_done),
        pending_arrays=len(arrays) - sum(is_done),
        pending_nodes=pending_nodes,
        retained_buffers=sum(retained_by_array),
        retained_by_array=retained_by_array,
        evaluated_by_array=is_done,
        dot_bytes=len(text),
    )


def graph_size(arrays: Sequence[mx.array]) -> tuple[int, int]:
    """(pending nodes, distinct evaluated buffers) of the lazy graph behind ``arrays``:
    what evaluating them would run and read. Used to size a prefill chunk before it runs."""
    text = export_dot(arrays)
    return text.count("shape=rectangle]; }"), text.count("{ rank=source; ")
