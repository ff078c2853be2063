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
import re
from typing import Sequence

import mlx.core as mx


# An array line: `{ rank=source; "A"; }` evaluated, `{ "A"; }` or `{ rank=sink; "A"; }` pending.
_ARRAY = re.compile(r'^\{ (?:rank=(source|sink); )?"([^"]+)"; \}$', re.M)
_PRIMITIVE = "shape=rectangle]; }"


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

    MLX writes the graph in post-order, output by output: every node is written after its
    inputs, and a node already written is not written again. So the evaluated buffers written
    between two of our arrays belong to the graph of the second one: one linear pass attributes
    them, and the per-array counts add up to the total."""
    if not arrays:
        return GraphReading(0, 0, 0, 0, [], [], 0)
    text = export_dot(arrays)
    retained_by_array = [0] * len(arrays)
    is_done = [False] * len(arrays)
    since_last_root = 0
    for rank, name in _ARRAY.findall(text):
        if name[0] == "n" and name[1:].isdigit():  # one of ours (MLX's own names are capitals)
            i = int(name[1:])
            is_done[i] = rank == "source"
            retained_by_array[i] += since_last_root
            since_last_root = 0
        elif rank == "source":
            since_last_root += 1
    return GraphReading(
        evaluated_arrays=sum(is_done),
        pending_arrays=len(arrays) - sum(is_done),
        pending_nodes=text.count(_PRIMITIVE),
        retained_buffers=sum(retained_by_array),
        retained_by_array=retained_by_array,
        evaluated_by_array=is_done,
        dot_bytes=len(text),
    )


def graph_size(arrays: Sequence[mx.array]) -> tuple[int, int]:
    """(pending nodes, distinct evaluated buffers) of the lazy graph behind ``arrays``:
    what evaluating them would run and read. Used to size a prefill chunk before it runs."""
    text = export_dot(arrays)
    return text.count(_PRIMITIVE), text.count("{ rank=source; ")
