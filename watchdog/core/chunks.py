"""Prefill chunks: how many buffers evaluating a chunk of n tokens may hold at once.

One walk of a chunk's lazy graph (before anyone evaluates it) gives its pending nodes (each
primitive output may allocate a buffer) and the distinct evaluated buffers it reads. Both grow
about linearly with the chunk's length, so a line fitted over a few measured lengths predicts
the others, and the largest chunk under a budget follows (``attach/prefill.py`` uses it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import clock
from .arrays import find_arrays
from .graph import graph_size

FLAT_SPREAD = 0.05  # nodes within 5% of each other over all lengths: a flat graph, also trusted
# Reported as the safe size when the graph does not grow with the chunk length.
UNBOUNDED_TOKENS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One walked chunk: ``tokens`` per sequence, its pending graph nodes and the distinct
    evaluated buffers the graph reads, and how long the walk took."""

    tokens: int
    nodes: int
    buffers: int
    seconds: float
    live: bool = True  # a chunk the program ran; False: built on a fresh cache to calibrate

    @property
    def predicted_buffers(self) -> int:
        return self.nodes + self.buffers


@dataclasses.dataclass(frozen=True)
class LineFit:
    """``intercept + slope * tokens``; ``r2`` of the least-squares line (nan with one length).
    ``flat``: the sizes did not grow with the length, so the line is their maximum."""

    intercept: float
    slope: float
    r2: float
    points: int
    flat: bool = False

    def at(self, tokens: float) -> float:
        return self.intercept + self.slope * tokens


def fit_line(points: Sequence[tuple[float, float]], flat_spread: float = FLAT_SPREAD) -> LineFit:
    """Least squares through ``(tokens, size)`` points; with one distinct length, proportional
    (through the origin).

    A flat series is replaced by its largest size (slope 0): a falling line (a chunk graph does
    not shrink as the chunk grows: extrapolating a fall would under-predict), and sizes within
    ``flat_spread`` of each other over lengths at least a factor 2 apart (a forward vectorized
    over tokens whose op count steps once, e.g. an MoE that sorts its routing above a size,
    would otherwise extrapolate that step as growth)."""
    data = np.asarray(list(points), dtype=np.float64)
    if data.ndim != 2 or data.shape[0] == 0 or data.shape[1] != 2:
        raise ValueError(f"fit_line needs a non-empty list of (tokens, size) pairs, got {points!r}")
    x, y = data[:, 0], data[:, 1]
    if not np.all(np.isfinite(data)) or np.any(x <= 0):
        raise ValueError(f"fit_line needs finite sizes and tokens > 0, got {points!r}")
    if np.unique(x).size == 1:
        return LineFit(0.0, float(y.mean() / x[0]), math.nan, len(x))
    slope, intercept = np.polyfit(x, y, 1)
    residual = float(np.sum((y - (intercept + slope * x)) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    if total > 0:
        r2 = 1.0 - residual / total
    else:  # every size equal: the line is exact
        r2 = 1.0 if residual <= 1e-9 * max(1.0, float(np.abs(y).max())) else 0.0
    spread = float(y.max() - y.min()) <= flat_spread * float(np.abs(y).max())
    if slope < 0 or (spread and x.max() >= 2 * x.min()):
        return LineFit(float(y.max()), 0.0, float(r2), len(x), flat=True)
    return LineFit(float(intercept), float(slope), float(r2), len(x))


def largest_safe_chunk(
    nodes: LineFit, buffers: LineFit, budget: float, ceiling: int = UNBOUNDED_TOKENS
) -> int:
    """The largest ``n`` in [0, ceiling] with ``nodes.at(n) + buffers.at(n) <= budget``."""
    intercept = nodes.intercept + buffers.intercept
    slope = nodes.slope + buffers.slope
    if slope <= 1e-12:
        return ceiling if intercept + slope <= budget else 0
    n = math.floor((budget - intercept) / slope)
    n = max(0, min(ceiling, n))
    while n > 0 and intercept + slope * n > budget:  # float rounding at the boundary
        n -= 1
    return n


def measure_chunk(tokens: int, output: Any, cache: Any = None) -> Measurement:
    """Walk the lazy graph of a chunk's ``output`` and ``cache`` (not evaluated) once.

    The output reaches the whole forward, but some cache updates are not on its path (the last
    layer's recurrent state, for example); walking both counts each node and buffer once."""
    arrays = [a for _, a in find_arrays((output, cache))]
    if not arrays:
        raise ValueError("the chunk's output and cache hold no mx.array to measure")
    start = clock.wall()
    nodes, buffers = graph_size(arrays)
    return Measurement(int(tokens), nodes, buffers, clock.wall() - start)
