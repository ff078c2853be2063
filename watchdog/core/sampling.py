"""How much of the graph one reading walks: all of it when that is quick, a sample when not.

A walk's CPU time grows with the pending nodes it passes, and a walk cannot be cut short once
started. So before a reading the size of each site's pending graphs is predicted from the last
readings. When the prediction fits in ``STALL_SECONDS``, one export of every array reads them
exactly. When it does not, the reading exports every evaluated array and, of each site's pending
arrays, only as many as fit, in turn from one reading to the next, so none goes unread for long.

Each array not walked is read as its own last walk plus what its site gained since
(``_SiteClock``). The arrays of a site are one attribute of layers built by the same code, so
between readings they gain alike: a node a step, and at once the gather or concatenation of a
batch that changes (a request leaving, one joining). A gain, unlike a rate, carries a batch's
change to arrays walked at other steps. The clock is the site's longest chain, walked at every
reading; gains of arrays walked at other readings would carry those readings' errors along.
Some arrays take no steps: qwen3_next's mask evaluates the first layer's left_padding each step.
One seen to gain less than a quarter of its site over 16 steps is read as it was. Arrays never
walked (a new request's caches) are like those of their own cache walked now; one that joined a
site already read (a cache added to the observed ones) holds what its site gained since.

A reading never walks more than fits in ``STALL_SECONDS``, beyond each site's reference (one
chain: the least a reading can walk) and a small allowance that keeps short chains in turn
(``SHORT_CHAIN_NODES``). At the crash scale (47 chains of 10,000 nodes) that is one chain a
reading: the others are read from their last walk and the reference's gain.

A buffer that several arrays' graphs share (the index array of a gather over all layers) is
counted once by a walk of all of them, but by each array walked alone: samples read high by
that, not low.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

from . import clock, forecast, graph
from .arrays import Found
from .graph import TooDeep, account, deep_walker, is_evaluated
from .objects import array_shape

STALL_SECONDS = 0.04  # CPU time one reading may block the decode for, when it can be kept to it
INITIAL_SECONDS_PER_NODE = 4e-6  # until learnt on this machine
STILL_SHARE = 0.25  # an array that gained less than this share of its site's gain is still...
STILL_TELL_STEPS = 16  # ...over at least these steps between two of its walks
MIN_SITE_GAIN = 2.0  # ...and at least this gain of its site
SHORT_CHAIN_NODES = 2_000  # nodes a reading may walk beyond its budget: short chains in turn (a few ms)


@dataclasses.dataclass
class Reading:
    """One reading of the arrays found by a walk; per-array values may be estimates."""

    found: list[Found]
    evaluated: list[bool]
    retained: list[float]  # evaluated buffers kept alive by each array's pending graph
    nodes: list[float]
    walked: int  # pending arrays whose graphs were walked (the rest are estimated)
    seconds: float  # wall time of the reading
    walked_indices: set | None = None  # which of them, when not all

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
    """One site's pending arrays at the last reading, per array, and how fast they grow."""

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


class _SiteClock:
    """What a pending array of one site has gained by each reading's step: (retained, nodes),
    read off the site's reference chain, walked at every reading (see the module's docstring);
    no estimate feeds it."""

    RATE_MARKS = 8  # the recent marks whose slopes give the rate

    def __init__(self) -> None:
        self.marks: dict[int, tuple[float, float]] = {}  # step -> gained by then

    def gained(self, step: int) -> tuple[float, float] | None:
        return self.marks.get(step)

    def advance(self, step: int, mark: tuple[float, float] | None) -> tuple[float, float]:
        """Mark ``step`` (None: no reference was walked, so as fast as it went)."""
        if mark is None:
            last = max(self.marks, default=None)
            before = (0.0, 0.0) if last is None else self.marks[last]
            rate = self.rate()
            ahead = 0 if last is None else step - last
            mark = (before[0] + rate[0] * ahead, before[1] + rate[1] * ahead)
        self.marks[step] = mark
        return mark

    def rate(self) -> tuple[float, float]:
        """Per step, the median slope between the recent marks (a batch change's jump is one)."""
        steps = sorted(self.marks)[-self.RATE_MARKS :]
        slopes = [
            ((self.marks[b][0] - self.marks[a][0]) / (b - a), (self.marks[b][1] - self.marks[a][1]) / (b - a))
            for a, b in zip(steps, steps[1:])
        ]
        if not slopes:
            return 0.0, 0.0
        return (
            max(0.0, statistics.median(r for r, _ in slopes)),
            max(0.0, statistics.median(n for _, n in slopes)),
        )

    def since(self, then: int, now: int) -> tuple[float, float]:
        """What the site gained from ``then`` to ``now`` (both marked)."""
        a, b = self.marks[then], self.marks[now]
        return b[0] - a[0], b[1] - a[1]

    def prune(self, keep: set) -> None:
        recent = set(sorted(self.marks)[-self.RATE_MARKS :])
        self.marks = {step: mark for step, mark in self.marks.items() if step in keep or step in recent}


class _Walked(NamedTuple):
    """One array's last walk."""

    retained: float
    nodes: float
    step: int
    still: bool  # seen not to take its site's steps (the program evaluates it)
    base: tuple[float, int]  # (retained, step) of the walk its stillness is told from
    shape: tuple[int, ...]  # a batch change (a gather, a concatenation) changes it


class _Probe(NamedTuple):
    """The first reading's walk of one pending array per site (``Sampler._probe``)."""

    evaluated: list[bool]  # per array found
    by_site: dict[str, list[int]]  # the pending arrays' indices, by site (the first one walked)
    walked: dict[str, tuple[float, float]]  # the walked one's (retained, nodes), by site


_Group = tuple[str, int | None]  # pending arrays walked before by site; never walked, by site and root


class _InTurn(NamedTuple):
    """A pending array a sample may walk in turn, if it fits."""

    i: int  # in the arrays found
    nodes: float  # expected
    first: bool  # the first of its group: walked from the allowance for short chains if need be


def _position(path: str) -> str:
    """Where in a list or dict of its attribute an array sits: the bracketed steps that end its
    path (``[0].state[1]``: ``[1]``; "" for an attribute's own array). Read from the path's text:
    the program's keys are never hashed or compared (that would run their code)."""
    start = len(path)
    while start and path[start - 1] == "]":
        opening = path.rfind("[", 0, start)
        if opening < 0:
            break
        start = opening
    return path[start:]


def kinds(found: Sequence[Found], evaluated: Sequence[bool]) -> dict[int, str]:
    """Each pending array's kind, by ``id``: the pending arrays of one kind gain alike between readings
    (a reading estimates one from another's gains). The kind is the array's site; where a site's
    arrays sit at a few positions of a list, each position found in two caches or more (an
    ``ArraysCache``'s [conv, ssm] state; a chain the program cuts beside a counter it never
    evaluates), it is the site and the position: such arrays are not alike. (One position per
    cache, a list of layers in one object, stays one kind: a clock per array would walk them all.)"""
    pending = [(f, _position(f.path)) for f, done in zip(found, evaluated) if not done]
    positions: dict[str, dict[str, int]] = {}
    for f, at in pending:
        counts = positions.setdefault(f.site, {})
        counts[at] = counts.get(at, 0) + 1
    split = {site for site, counts in positions.items() if len(counts) > 1 and min(counts.values()) > 1}
    return {id(f): f.site + at if f.site in split else f.site for f, at in pending}


class Sampler:
    """Reads found arrays exactly or by sample, and learns what a node costs here."""

    def __init__(self, stall_seconds: float | None = None) -> None:
        self.stall_seconds = STALL_SECONDS if stall_seconds is None else stall_seconds
        self.seconds_per_node = INITIAL_SECONDS_PER_NODE
        self._sizes: dict[str, _SiteSize] = {}
        self._clocks: dict[str, _SiteClock] = {}
        self._turn = 0  # rotates the sampled arrays of each site
        self._walked: dict[tuple, _Walked] = {}  # key -> its last walk
        # key -> the step an array never walked joined a site already read (a request's caches
        # added to the observed ones): its chain holds what its site gained since.
        self._joined: dict[tuple, int] = {}
        self._present: set[tuple] = set()  # every array's key at the last reading
        self._root_keys: list = []
        self._keys: dict[int, tuple] = {}  # id(Found) -> its name, for the reading under way
        # id(Found) -> its kind (``kinds``), for the reading under way (None: not noted yet)
        self._kinds: dict[int, str] | None = None

    def _pending_by_kind(self, found: Sequence[Found], evaluated: Sequence[bool]) -> dict[str, list[int]]:
        """The pending arrays' indices by kind (``kinds``)."""
        noted = self._note_kinds(found, evaluated)
        by_kind: dict[str, list[int]] = {}
        for i, done in enumerate(evaluated):
            if not done:
                by_kind.setdefault(noted[id(found[i])], []).append(i)
        return by_kind

    def _note_kinds(self, found: Sequence[Found], evaluated: Sequence[bool]) -> dict[int, str]:
        """The kinds of the reading under way, worked out once it knows which arrays are pending."""
        if self._kinds is None:
            self._kinds = kinds(found, evaluated)
        return self._kinds

    def _kind(self, f: Found) -> str:
        return f.site if self._kinds is None else self._kinds.get(id(f), f.site)

    @property
    def max_nodes(self) -> int:
        return max(1, int(self.stall_seconds / self.seconds_per_node))

    def predicted_nodes(self, step: int) -> float | None:
        """Nodes the pending graphs will have at ``step``; None before any reading."""
        if not self._sizes:
            return None
        return sum(s.pending * s.at(step)[0] for s in self._sizes.values())

    def read(
        self,
        found: Sequence[Found],
        step: int,
        root_keys: Sequence[Any] = (),
        keys: Sequence[tuple] | None = None,
    ) -> Reading:
        """``root_keys[f.root]`` names each root while it lives (an array's path is relative to it);
        ``keys``, where given, name each array across readings instead (one per array found)."""
        started, cpu_started = clock.wall(), graph.cpu_clock()
        self._root_keys = list(root_keys)
        self._keys = {} if keys is None else {id(f): key for f, key in zip(found, keys)}
        self._kinds = None  # (noted once the reading knows which arrays are pending)
        limit = self.max_nodes
        predicted = self.predicted_nodes(step)
        probe = None
        if predicted is None:
            probe = self._probe(found, step)
            predicted = self.predicted_nodes(step) if probe is not None else None
        if predicted is None:
            # The probe found nothing pending: no graph holds a buffer, so an export (dearer than
            # telling each array) adds nothing. Evaluated or scheduled, as samples tell them.
            n = len(found)
            reading = Reading(list(found), [True] * n, [0.0] * n, [0.0] * n, 0, 0.0)
        elif predicted <= limit:
            reading = self._read_all(found, predicted)
        elif probe is not None:
            # The probe was the sample: walking one array a site again would double the stall.
            reading = self._read_probe(found, probe)
        else:
            reading = self._read_sample(found, step, predicted, limit)
        reading.seconds = clock.wall() - started
        reading.cpu_seconds = graph.cpu_clock() - cpu_started
        self._learn(reading, step)
        return reading

    def _probe(self, found: Sequence[Found], step: int) -> _Probe | None:
        """Nothing read yet (a watchdog attached to caches that may already hold deep chains):
        walk one pending array per site first, and predict the rest from it. None: none pending."""
        evaluated = [is_evaluated(f.array) for f in found]
        by_site = self._pending_by_kind(found, evaluated)
        if not by_site:
            return None
        counts = account([found[indices[0]].array for indices in by_site.values()])
        walked = {}
        for (site, indices), nodes, retained in zip(
            by_site.items(), counts.nodes_by_array, counts.retained_by_array
        ):
            self._sizes[site] = _SiteSize(float(nodes), float(retained), step, 0.0, 0.0, len(indices))
            walked[site] = (float(retained), float(nodes))
        return _Probe(evaluated, by_site, walked)

    def _read_probe(self, found: Sequence[Found], probe: _Probe) -> Reading:
        retained = [0.0] * len(found)
        nodes = [0.0] * len(found)
        for site, indices in probe.by_site.items():
            for i in indices:  # each like the one walked of its site
                retained[i], nodes[i] = probe.walked[site]
        firsts = {indices[0] for indices in probe.by_site.values()}
        return Reading(list(found), probe.evaluated, retained, nodes, len(firsts), 0.0, firsts)

    def forget(self) -> None:
        """Another decode: what was walked before names other arrays now."""
        self._sizes.clear()
        self._clocks.clear()
        self._walked.clear()
        self._joined.clear()
        self._present = set()

    # ------------------------------------------------------------------ readings

    def _read_all(self, found: Sequence[Found], predicted: float | None) -> Reading:
        counts = account([f.array for f in found], nodes_hint=None if predicted is None else int(predicted))
        return Reading(
            list(found),
            counts.evaluated_by_array,
            [float(r) for r in counts.retained_by_array],
            [float(n) for n in counts.nodes_by_array],
            counts.pending_arrays,
            0.0,
        )

    def _read_sample(self, found: Sequence[Found], step: int, predicted: float, limit: int) -> Reading:
        """Walk what the stall budget allows, every site's reference first, and read the others from
        their last walk and their site's gain since, or like those walked (the module's docstring)."""
        evaluated = [is_evaluated(f.array) for f in found]
        self._note_kinds(found, evaluated)
        groups, moved = self._group_pending(found, evaluated, step)
        references, always, in_turn = self._take_turns(found, step, groups, share=limit / predicted)
        chosen = moved + always
        chosen += self._within_budget(found, step, chosen, in_turn, limit)
        deepest = max(
            (self._sizes[site].at(step)[0] for site, _ in groups if site in self._sizes), default=0.0
        )
        retained, nodes, walked = self._walk(found, evaluated, chosen, deepest)
        self._estimate_the_rest(found, evaluated, step, references, walked, retained, nodes)
        return Reading(list(found), evaluated, retained, nodes, len(walked), 0.0, walked)

    def _group_pending(
        self, found: Sequence[Found], evaluated: Sequence[bool], step: int
    ) -> tuple[dict[_Group, list[int]], list[int]]:
        """The pending arrays by site, to walk in turn; those never walked (a request's new caches,
        a site never seen) by site and root: their sizes are not their site's, and a root's are
        alike. Returns the groups, and the still arrays a batch change moved: to walk whatever they
        cost. Notes the arrays that joined a site already read."""
        groups: dict[_Group, list[int]] = {}
        moved: list[int] = []
        read_before = {
            self._kind(f) for f, done in zip(found, evaluated) if not done and self._history(f) is not None
        }
        for i, done in enumerate(evaluated):
            if not done:
                site, last = self._kind(found[i]), self._history(found[i])
                key = self._key(found[i])
                if last is None and key not in self._present and site in read_before and site in self._clocks:
                    self._joined.setdefault(key, step)
                if last is not None and last.still and last.shape != array_shape(found[i].array):
                    # A batch change moves a still array too, and no clock carries it there: its
                    # chain is short (the program cuts it), so walk it.
                    moved.append(i)
                else:
                    groups.setdefault((site, None if last is not None else found[i].root), []).append(i)
        return groups, moved

    def _take_turns(
        self,
        found: Sequence[Found],
        step: int,
        groups: dict[_Group, list[int]],
        share: float,
    ) -> tuple[dict[str, int], list[int], list[_InTurn]]:
        """What each group walks whatever it costs: the reference of a site walked before (its
        clock), one array of a site never seen; and ``share`` of its other arrays, this reading's
        turn of them, to walk if they fit. Returns the references by site, the arrays walked
        whatever they cost, and those in turn."""
        references: dict[str, int] = {}
        always: list[int] = []
        in_turn: list[_InTurn] = []
        self._turn += 1
        for (site, root), indices in groups.items():
            quota = int(len(indices) * share)
            if root is None:  # walked before: its site's reference every time, the others in turn
                reference = references[site] = self._reference(found, indices)
                always.append(reference)
                indices = [i for i in indices if i != reference]
                quota -= 1
                if not indices:
                    continue
            elif site not in self._sizes:  # a site never seen: one of it, whatever it costs
                always.append(indices[0])
                indices = indices[1:]
                if not indices:
                    continue
            k = min(len(indices), max(1, quota))
            start = (self._turn * k) % len(indices)
            for j in range(k):
                i = indices[(start + j) % len(indices)]
                in_turn.append(_InTurn(i, self._expected_nodes(found[i], step), j == 0))
        return references, always, in_turn

    def _within_budget(
        self, found: Sequence[Found], step: int, chosen: list[int], in_turn: list[_InTurn], limit: int
    ) -> list[int]:
        """Of the arrays in turn, those the stall budget leaves room for beyond ``chosen``, and the
        first of each group from a small allowance besides, so that short chains keep rotating
        however low the budget. Those left out are read from their last walk and their site's
        gain, or like their site."""
        room = limit - sum(self._expected_nodes(found[i], step) for i in chosen)
        allowance = float(SHORT_CHAIN_NODES)
        fits = []
        for candidate in in_turn:
            if candidate.nodes <= room:
                room -= candidate.nodes
            elif candidate.first and candidate.nodes <= allowance:
                allowance -= candidate.nodes
            else:
                continue
            fits.append(candidate.i)
        return fits

    def _walk(
        self, found: Sequence[Found], evaluated: list[bool], chosen: list[int], deepest: float
    ) -> tuple[list[float], list[float], set[int]]:
        """Walk the chosen arrays: (retained, nodes) per array, 0 for those not walked, and the
        pending ones walked."""
        walked = set(chosen)
        # Evaluated arrays go in too (one line each): a pending graph that reads one of them
        # then names it as ours, and it is not counted twice.
        order = [i for i, done in enumerate(evaluated) if done] + sorted(chosen)
        try:
            counts = account([found[i].array for i in order], nodes_hint=int(deepest))
        except TooDeep:  # a single chain deeper than any stack here: leave it to the estimate
            counts = account([found[i].array for i in order if evaluated[i]])
            order = [i for i in order if evaluated[i]]
            walked = set()
        retained = [0.0] * len(found)
        nodes = [0.0] * len(found)
        for position, i in enumerate(order):
            retained[i] = float(counts.retained_by_array[position])
            nodes[i] = float(counts.nodes_by_array[position])
        return retained, nodes, walked

    def _estimate_the_rest(
        self,
        found: Sequence[Found],
        evaluated: list[bool],
        step: int,
        references: dict[str, int],
        walked: set[int],
        retained: list[float],
        nodes: list[float],
    ) -> None:
        """Move each site's clock to ``step``, and fill in ``retained`` and ``nodes`` of the pending
        arrays not walked."""
        for site, indices in self._pending_by_kind(found, evaluated).items():
            walked_here = [i for i in indices if i in walked]
            walked_new = [i for i in walked_here if self._history(found[i]) is None]
            # Marks this step: the gains below are read from it.
            self._tick(site, step, found, references.get(site), retained, nodes)
            for i in indices:
                if i in walked:
                    continue
                estimate = self._since_read(found[i], step)
                if estimate is None:
                    # Never walked: another cache (a request's new one) like those of its own
                    # walked now. The observed roots' own caches mix old chains not walked yet with
                    # a joining request's short ones: like those walked before (high, not low), or
                    # else like its site.
                    like = [j for j in walked_new if found[j].root == found[i].root] if found[i].root else []
                    like = like or [j for j in walked_here if j not in walked_new] or walked_here
                    estimate = self._like_walked(found[i], step, like, retained, nodes)
                retained[i], nodes[i] = estimate

    def _since_read(self, f: Found, step: int) -> tuple[float, float] | None:
        """(retained, nodes) of an array read before: its own last walk and what its site gained
        since (still: nothing); or, joined the site since the site was read, what the site gained
        since (its own chain from before, a prompt's, is not known: low by that). None: neither."""
        clock = self._clocks[self._kind(f)]
        last = self._history(f)
        if last is not None:
            gain = (0.0, 0.0) if last.still else clock.since(last.step, step)
            return max(0.0, last.retained + gain[0]), max(0.0, last.nodes + gain[1])
        joined = self._joined.get(self._key(f))
        if joined is not None and clock.gained(joined) is not None:
            return clock.since(joined, step)
        return None

    def _like_walked(
        self, f: Found, step: int, like: list[int], retained: list[float], nodes: list[float]
    ) -> tuple[float, float]:
        """(retained, nodes) of an array never read: the mean of those ``like`` it, walked now, or
        else its site's size (nothing, for a site never seen)."""
        if like:
            return sum(retained[j] for j in like) / len(like), sum(nodes[j] for j in like) / len(like)
        size = self._sizes.get(self._kind(f))
        if size is None:
            return 0.0, 0.0
        site_nodes, site_retained = size.at(step)
        return site_retained, site_nodes

    def _expected_nodes(self, f: Found, step: int) -> float:
        """The nodes ``f``'s graph is expected to have at ``step``: its last walk and its site's
        growth since; never walked, its site's size (0 for a site never seen)."""
        size = self._sizes.get(self._kind(f))
        last = self._history(f)
        if last is None:
            joined = self._joined.get(self._key(f))
            if size is None:
                return 0.0
            if joined is not None:
                return size.nodes_growth * max(0, step - joined)
            return size.at(step)[0]
        if last.still or size is None:
            return last.nodes
        return last.nodes + size.nodes_growth * max(0, step - last.step)

    def _key(self, f: Found) -> tuple:
        """An array's name across readings: the key given for it, or its root (by identity, while
        it lives) and its path."""
        key = self._keys.get(id(f))
        if key is not None:
            return key
        return (self._root_keys[f.root] if f.root < len(self._root_keys) else f.root, f.path)

    def _history(self, f: Found) -> _Walked | None:
        """Its last walk, when its site's clock has a mark then (and at its base)."""
        last = self._walked.get(self._key(f))
        clock = self._clocks.get(self._kind(f))
        if (
            last is None
            or clock is None
            or clock.gained(last.step) is None
            or clock.gained(last.base[1]) is None
        ):
            return None
        return last

    def _reference(self, found: Sequence[Found], indices: list[int]) -> int:
        """The site's longest chain at the last walks: walked at every reading, it is the site's
        clock. (A layer the program evaluates stays short: its gains are not the site's.)"""

        def length(i: int) -> tuple[bool, float]:
            last = self._walked[self._key(found[i])]
            return not last.still, last.retained

        return max(indices, key=length)

    def _tick(
        self,
        site: str,
        step: int,
        found: Sequence[Found],
        reference: int | None,
        retained: list[float],
        nodes: list[float],
    ) -> tuple[float, float]:
        """Move the site's clock to ``step`` by what its reference gained since its last walk;
        returns the mark. (Gains of arrays walked at other readings would carry the errors of
        those readings' marks along, for good.)"""
        clock = self._clocks.setdefault(site, _SiteClock())
        marked = clock.gained(step)
        if marked is not None:
            return marked
        mark = None
        if reference is not None:
            last = self._history(found[reference])
            then = None if last is None else clock.gained(last.step)  # marked: _history checks it
            if last is not None and then is not None and last.step < step:
                mark = (
                    then[0] + retained[reference] - last.retained,
                    then[1] + nodes[reference] - last.nodes,
                )
        return clock.advance(step, mark)

    def _learn(self, reading: Reading, step: int) -> None:
        walked = reading.walked_indices
        per_site = self._pending_by_kind(reading.found, reading.evaluated)
        for site, indices in per_site.items():  # readings of every array tick here (samples did already)
            known = [i for i in indices if self._history(reading.found[i]) is not None]
            reference = self._reference(reading.found, known) if known and walked is None else None
            self._tick(site, step, reading.found, reference, reading.retained, reading.nodes)
        history = {}  # only the arrays found now: the others' roots or paths are gone
        for site, indices in per_site.items():
            clock = self._clocks[site]
            for i in indices:
                key = self._key(reading.found[i])
                if walked is None or i in walked:
                    last = self._history(reading.found[i])
                    still, base = (
                        (False, (reading.retained[i], step)) if last is None else (last.still, last.base)
                    )
                    # Told over many steps, where the steps' gain outweighs a batch change's (that
                    # one moves every array of the site, still ones too): from a base walk that
                    # many steps back, kept while walks come closer together.
                    if last is not None and step - base[1] >= STILL_TELL_STEPS:
                        site_gain = clock.since(base[1], step)[0]
                        if site_gain >= MIN_SITE_GAIN:
                            still = reading.retained[i] - base[0] < STILL_SHARE * site_gain
                        base = (reading.retained[i], step)
                    history[key] = _Walked(
                        reading.retained[i],
                        reading.nodes[i],
                        step,
                        still,
                        base,
                        array_shape(reading.found[i].array),
                    )
                elif key in self._walked:
                    history[key] = self._walked[key]
        self._walked = history
        present = self._present = {self._key(f) for f in reading.found}
        self._joined = {
            key: joined for key, joined in self._joined.items() if key not in history and key in present
        }
        used = {last.step for last in history.values()} | {last.base[1] for last in history.values()}
        used |= set(self._joined.values())
        self._clocks = {site: clock for site, clock in self._clocks.items() if site in per_site}
        sizes = {}
        for site, indices in per_site.items():
            clock = self._clocks[site]
            clock.prune(used)
            retained_growth, nodes_growth = clock.rate()
            nodes = sum(reading.nodes[i] for i in indices) / len(indices)
            retained = sum(reading.retained[i] for i in indices) / len(indices)
            sizes[site] = _SiteSize(nodes, retained, step, nodes_growth, retained_growth, len(indices))
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
    first export, and numpy's first median (it imports numpy.ma)."""
    global _warm
    if _warm:
        return
    deep_walker()
    import mlx.core as mx

    a = mx.array(0)
    graph.account([a, a + 1])
    forecast.epoch_slope([(0, 0.0, 0), (1, 1.0, 0), (2, 3.0, 0)])
    _warm = True
