"""How much of the graph one reading walks: all of it when that is quick, a sample when not.

A walk costs ~3 us per pending node on these CPUs (measured: 47 chains of 10,000 nodes took
3.1 s in one export) and cannot be cut short once started. So before a reading the size of
each site's pending graphs is predicted from the last readings. When the prediction fits in
``STALL_SECONDS``, one export of every array reads them exactly. When it does not, the reading
exports every evaluated array and, of each site's pending arrays, only as many as fit, in turn
from one reading to the next. Each other pending array of a site is counted as its own last
walked size, grown since as the walked ones of its site grew (the arrays of one site are one
attribute of layers built by the same code, so their chains grow alike, though not from the same
size: mlx-lm's first layer's left_padding stays short, and a walk attributes a part two chains
share to the first of them). The walked ones rotate, so none goes unread for long.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence

from . import forecast, graph
from .graph import TooDeep, account, deep_walker, is_evaluated
from .introspect import Found

STALL_SECONDS = 0.04  # CPU time one reading may block the decode for, when it can be kept to it
INITIAL_SECONDS_PER_NODE = 4e-6  # until measured on this machine


@dataclasses.dataclass
class Reading:
    """One reading of the arrays found by a walk; per-array values may be estimates."""

    found: list[Found]
    evaluated: list[bool]
    retained: list[float]  # evaluated buffers kept alive by each array's pending graph
    nodes: list[float]
    walked: int  # pending arrays whose graphs were walked (the rest are estimated)
    seconds: float  # wall time of the reading
    walked_indices: Optional[set] = None  # which of them, when not all

    cpu_seconds: float = 0.0  # its CPU time (graph.cpu_clock): what sizes the next readings

    @property
    def pending_arrays(self) -> int:
        return len(self.found) - sum(self.evaluated)

    @property
    def evaluated_arrays(self) -> int:
        return sum(self.evaluated)

    @property
    def retained_buffers(self) -> float:
        return sum(self.retained)

    @property
    def pending_nodes(self) -> float:
        return sum(self.nodes)

    @property
    def sampled(self) -> bool:
        return self.walked < self.pending_arrays


@dataclasses.dataclass
class _SiteSize:
    """One site's pending arrays at the last reading, per array, and how fast they grew."""

    nodes: float
    retained: float
    step: int
    nodes_growth: float  # per step
    retained_growth: float
    pending: int  # how many of its arrays were pending

    def at(self, step: int) -> tuple[float, float]:
        """(nodes, retained) per pending array expected at ``step``."""
        ahead = max(0, step - self.step)
        return self.nodes + self.nodes_growth * ahead, self.retained + self.retained_growth * ahead


class Sampler:
    """Reads found arrays exactly or by sample, and learns what a node costs here."""

    def __init__(self, stall_seconds: float = STALL_SECONDS) -> None:
        self.stall_seconds = stall_seconds
        self.seconds_per_node = INITIAL_SECONDS_PER_NODE
        self._sizes: dict[str, _SiteSize] = {}
        self._turn = 0  # rotates the sampled arrays of each site
        self._walked: dict[tuple, tuple[float, float, int]] = {}  # key -> (retained, nodes, step) of its last walk
        self._root_keys: list = []

    @property
    def max_nodes(self) -> int:
        return max(1, int(self.stall_seconds / self.seconds_per_node))

    def predicted_nodes(self, step: int) -> Optional[float]:
        """Nodes the pending graphs will have at ``step``; None before any reading."""
        if not self._sizes:
            return None
        return sum(s.pending * s.at(step)[0] for s in self._sizes.values())

    def read(self, found: Sequence[Found], step: int, root_keys: Sequence[Any] = ()) -> Reading:
        """``root_keys[f.root]`` names each root while it lives (an array's path is relative to it)."""
        started, cpu_started = time.perf_counter(), graph.cpu_clock()
        self._root_keys = list(root_keys)
        limit = self.max_nodes
        predicted = self.predicted_nodes(step)
        probe = None
        if predicted is None:
            probe = self._probe(found, step)
            predicted = self.predicted_nodes(step) if probe is not None else None
        if predicted is None or predicted <= limit:
            reading = self._read_all(found, predicted)
        elif probe is not None:  # the probe was the sample: walking one array a site again would double the stall
            reading = self._read_probe(found, probe)
        else:
            reading = self._read_sample(found, step, predicted, limit)
        reading.seconds = time.perf_counter() - started
        reading.cpu_seconds = graph.cpu_clock() - cpu_started
        self._learn(reading, step)
        return reading

    def _probe(self, found: Sequence[Found], step: int) -> Optional[tuple]:
        """Nothing read yet (a watchdog attached to caches that may already hold deep chains):
        walk one pending array per site first, and predict the rest from it. Returns
        (evaluated flags, pending indices by site, the walked one's (retained, nodes) by site);
        None: none pending."""
        evaluated = [is_evaluated(f.array) for f in found]
        by_site: dict[str, list[int]] = {}
        for i, done in enumerate(evaluated):
            if not done:
                by_site.setdefault(found[i].site, []).append(i)
        if not by_site:
            return None
        graph = account([found[indices[0]].array for indices in by_site.values()])
        walked = {}
        for (site, indices), nodes, retained in zip(by_site.items(), graph.nodes_by_array, graph.retained_by_array):
            self._sizes[site] = _SiteSize(float(nodes), float(retained), step, 0.0, 0.0, len(indices))
            walked[site] = (float(retained), float(nodes))
        return evaluated, by_site, walked

    def _read_probe(self, found: Sequence[Found], probe: tuple) -> Reading:
        evaluated, by_site, walked = probe
        retained = [0.0] * len(found)
        nodes = [0.0] * len(found)
        for site, indices in by_site.items():
            for i in indices:  # each like the one walked of its site
                retained[i], nodes[i] = walked[site]
        firsts = {indices[0] for indices in by_site.values()}
        return Reading(list(found), evaluated, retained, nodes, len(firsts), 0.0, firsts)

    def forget(self) -> None:
        self._sizes.clear()
        self._walked.clear()

    # ------------------------------------------------------------------ readings

    def _read_all(self, found: Sequence[Found], predicted: Optional[float]) -> Reading:
        graph = account([f.array for f in found], nodes_hint=None if predicted is None else int(predicted))
        return Reading(list(found), graph.evaluated_by_array, [float(r) for r in graph.retained_by_array],
                       [float(n) for n in graph.nodes_by_array], graph.pending_arrays, 0.0)

    def _read_sample(self, found: Sequence[Found], step: int, predicted: float, limit: int) -> Reading:
        evaluated = [is_evaluated(f.array) for f in found]
        by_site: dict[str, list[int]] = {}  # pending arrays of sites whose size is known, per site
        chosen: list[int] = []  # pending arrays of a site never walked: walked now, nothing else tells
        for i, done in enumerate(evaluated):
            if not done:
                if found[i].site in self._sizes or self._key(found[i]) in self._walked:
                    by_site.setdefault(found[i].site, []).append(i)
                else:
                    chosen.append(i)
        share = limit / predicted  # of each site's pending arrays, this many walk
        self._turn += 1
        for site, indices in by_site.items():
            k = min(len(indices), max(1, int(len(indices) * share)))
            start = (self._turn * k) % len(indices)
            chosen.extend(indices[(start + j) % len(indices)] for j in range(k))
        walked_set = set(chosen)
        # Evaluated arrays go in too (one line each): a pending graph that reads one of them
        # then names it as ours, and it is not counted twice.
        order = [i for i, done in enumerate(evaluated) if done] + chosen
        deepest = max((self._sizes[site].at(step)[0] for site in by_site if site in self._sizes), default=0.0)
        try:
            graph = account([found[i].array for i in order], nodes_hint=int(deepest))
        except TooDeep:  # a single chain deeper than any stack here: leave it to the estimate
            graph = account([found[i].array for i in order if evaluated[i]])
            order = [i for i in order if evaluated[i]]
            walked_set = set()
        retained = [0.0] * len(found)
        nodes = [0.0] * len(found)
        for position, i in enumerate(order):
            retained[i] = float(graph.retained_by_array[position])
            nodes[i] = float(graph.nodes_by_array[position])
        for site, indices in by_site.items():
            walked = [i for i in indices if i in walked_set]
            size = self._sizes.get(site)
            if walked:
                mean = (sum(retained[i] for i in walked) / len(walked), sum(nodes[i] for i in walked) / len(walked))
            else:  # nothing of it could be walked: its last size, grown as it was growing
                mean = (0.0, 0.0) if size is None else size.at(step)[::-1]
            # How the walked ones grew since their own last walks, per step.
            grown = [g for g in (self._growth(found[i], retained[i], nodes[i], step) for i in walked) if g is not None]
            if grown:
                growth = (sum(g[0] for g in grown) / len(grown), sum(g[1] for g in grown) / len(grown))
            else:
                growth = (0.0, 0.0) if size is None else (size.retained_growth, size.nodes_growth)
            for i in indices:
                if i in walked_set:
                    continue
                last = self._walked.get(self._key(found[i]))
                if last is None:  # never walked: like the walked ones of its site
                    retained[i], nodes[i] = mean
                else:  # its own last walk, grown as the walked ones grew
                    ahead = step - last[2]
                    retained[i] = max(0.0, last[0] + growth[0] * ahead)
                    nodes[i] = max(0.0, last[1] + growth[1] * ahead)
        return Reading(list(found), evaluated, retained, nodes, len(walked_set), 0.0, walked_set)

    def _key(self, f: Found) -> tuple:
        """An array's name across readings: its root (by identity, while it lives) and its path."""
        return (self._root_keys[f.root] if f.root < len(self._root_keys) else f.root, f.path)

    def _growth(self, f: Found, retained: float, nodes: float, step: int) -> Optional[tuple[float, float]]:
        last = self._walked.get(self._key(f))
        if last is None or step <= last[2]:
            return None
        return (retained - last[0]) / (step - last[2]), (nodes - last[1]) / (step - last[2])

    def _learn(self, reading: Reading, step: int) -> None:
        walked = reading.walked_indices
        history = {}  # only the arrays found now: the others' roots or paths are gone
        for i, (f, done) in enumerate(zip(reading.found, reading.evaluated)):
            if done:
                continue
            key = self._key(f)
            if walked is None or i in walked:
                history[key] = (reading.retained[i], reading.nodes[i], step)
            elif key in self._walked:
                history[key] = self._walked[key]
        self._walked = history
        per_site: dict[str, list[tuple[float, float]]] = {}
        for f, done, n, r in zip(reading.found, reading.evaluated, reading.nodes, reading.retained):
            if not done:
                per_site.setdefault(f.site, []).append((n, r))
        sizes = {}
        for site, values in per_site.items():
            nodes = sum(n for n, _ in values) / len(values)
            retained = sum(r for _, r in values) / len(values)
            before = self._sizes.get(site)
            nodes_growth = retained_growth = 0.0
            if before is not None and step > before.step:
                nodes_growth = max(0.0, (nodes - before.nodes) / (step - before.step))
                retained_growth = max(0.0, (retained - before.retained) / (step - before.step))
            sizes[site] = _SiteSize(nodes, retained, step, nodes_growth, retained_growth, len(values))
        self._sizes = sizes
        walked_nodes = reading.pending_nodes if walked is None else sum(reading.nodes[i] for i in walked)
        work = walked_nodes + len(reading.found)
        # CPU time, not wall time: a walk that waited for a core on a loaded machine would
        # shrink the next ones to samples, which misread a batch that just changed (graph.cpu_clock).
        if work >= 1000 and reading.cpu_seconds > 0:  # small walks are dominated by fixed costs
            measured = reading.cpu_seconds / work
            self.seconds_per_node = 0.5 * self.seconds_per_node + 0.5 * measured


_warm = False


def warm_up() -> None:
    """Pay the one-off costs of a first reading now, once per process: the walker thread, MLX's
    first export, and numpy's first median (it imports numpy.ma: 11-38 ms measured)."""
    global _warm
    if _warm:
        return
    deep_walker()
    import mlx.core as mx

    a = mx.array(0)
    graph.account([a, a + 1])
    forecast.epoch_slope([(0, 0.0, 0), (1, 1.0, 0), (2, 3.0, 0)])
    _warm = True
