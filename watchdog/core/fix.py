"""The fix: schedule evaluation (``mx.async_eval``) of the pending cache arrays that leak.

MLX detaches a scheduled graph at once, so the chains are cut when the call returns; the
device work runs later, and the program waits on nothing it did not wait on before.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any

import mlx.core as mx

from .arrays import Found, find_arrays, resolve, scan
from .graph import is_evaluated

PROBE_STEPS = (1, 2, 3)  # lengths of the fix-mode probes, in turn
# A probe costs a second walk. What the fix cuts per site changes when the program does, not every
# step: a new series is probed at its first walks, then every PROBE_EVERY-th walk.
PROBES_FIRST = 8  # the dense walks of a new series (schedule.DENSE_OFFSETS) all probe
PROBE_EVERY = 4
FULL_SWEEP_FIXES = 16  # between walks, every 16th fix re-reads every cache array, not only the pending ones
# A fix that meets long chains (the first after a long decode unfixed), cut all at once, stalls a
# step for seconds: it cuts them a share a step, about this many nodes, in steps that walk nothing.
# A chain is cut whole: one longer than this is a step's share alone.
FIX_NODES = 5000


def materialize(obj: Any) -> int:
    """Schedule evaluation of every pending array reachable from ``obj``; how many were scheduled.

    Evaluated arrays are left alone. Never raises: an array that cannot be evaluated here (one
    made on another thread's stream) is left as it is, and the others are still scheduled."""
    try:
        pending = [a for _, a in find_arrays(obj) if not _evaluated(a)]
        return len(pending) - schedule_evaluation(pending)
    except Exception:  # nothing of ours may reach the program
        return 0


def schedule_evaluation(arrays: list[mx.array], async_eval: Callable = mx.async_eval) -> int:
    """``async_eval(arrays)``; where MLX refuses a group, each half of it again, so that a bad
    array costs only itself (and a few calls: ~2 log2(n) for one among n). Returns how many
    arrays could not be scheduled. ``async_eval``: the caller's (tests watch core's calls)."""
    if not arrays:
        return 0
    try:
        async_eval(arrays)
        return 0
    except Exception:
        if len(arrays) == 1:
            return 1
    half = len(arrays) // 2
    return schedule_evaluation(arrays[:half], async_eval) + schedule_evaluation(arrays[half:], async_eval)


def _evaluated(array: mx.array) -> bool:
    try:
        return is_evaluated(array)
    except Exception:  # unknown: scheduling it is harmless, or fails alone
        return False


def evaluated_output(output: Any) -> bool:
    """Has the program evaluated or scheduled its last output? (True when unknown.) The fix runs
    only then, so the watchdog never computes what the program itself would not have."""
    # Exact types only: isinstance() reads __class__ and iterating a subclass runs its code.
    kind = type(output)
    if output is None:
        return True
    if issubclass(kind, mx.array):
        return is_evaluated(output)
    if kind is list or kind is tuple:
        for item in output:
            if issubclass(type(item), mx.array):
                return is_evaluated(item)
    return True


def resolvable(steps: tuple) -> bool:
    """Can ``resolve`` find this path again? (Not through a set: sets have no order to follow.)"""
    return all(kind != "set" for kind, _ in steps)


@dataclasses.dataclass(frozen=True)
class Probe:
    """A fix-mode probe: the fix waits from ``start`` to ``end``; the walk at ``end`` reads what
    each site gained over ``buffers_by_site`` (the growth the fix cuts)."""

    start: int
    buffers_by_site: dict[str, float]
    end: int


class Fixer:
    """When the fix runs and what it schedules.

    In fix mode a walk starts a probe: the fix waits 1-3 steps, a second walk sees what those
    steps add to each site (the growth the fix cuts), then the fix runs every ``every`` steps.
    The probe's length varies so that its steps do not keep the phase of a chain the program
    drains every few steps."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.fixes = 0
        self.probes = 0
        self.series_probes = 0  # probes since the series began
        self.walks_unprobed = 0  # walks since the last probe
        self.probe: Probe | None = None
        self.last_step = 0
        self.series_start = 0  # the step the series began at (reset): its chains grow from there
        self.fixed_once = False
        self.backlog = False  # a fix of long chains is under way, a share a step
        self._backlog_take = 1  # arrays a share (about FIX_NODES nodes, as the walk saw them)
        self._backlog_next = 0  # where its next share starts, in the list of pending arrays
        self._backlog_until = 0  # the last step its shares may take
        self._paths: list[tuple] | None = None  # every array's access steps, from the last walk
        self._pending_paths: list[tuple] | None = None  # (site, steps) of its pending arrays
        # Kept caches already cut: id -> (weak reference, its last forward's step). A kept cache
        # does not change until a forward uses it again, so each is cut once.
        self._cut: dict[int, tuple[weakref.ref, int]] = {}
        # id of a pending array of a cache not among the roots -> what the last walk saw it hold
        self._kept_retained: dict[int, float] = {}

    def reset(self, step: int) -> None:
        self.probe = None
        self.backlog = False
        # A new series is fixed at its first chance: the readings before its first fix measure
        # another growth (the chains still growing) and are cleared then, so the fix comes before
        # the walks that measure its rate (at 16 and 32 steps, schedule.py), not between them.
        self.last_step = step - self.every
        self.series_start = step
        self.fixed_once = False
        self.series_probes = self.walks_unprobed = 0

    def ran(self, step: int) -> bool:
        """A fix ran at ``step``; returns whether it was the series' first."""
        self.last_step = step
        first, self.fixed_once = not self.fixed_once, True
        return first

    def remember_paths(self, found: Sequence[Found], pending: Sequence[Found]) -> None:
        """The paths of a walk of the roots (root 0): where the fix re-reads between walks."""
        self._paths = [f.steps for f in found if f.root == 0 and resolvable(f.steps)]
        self._pending_paths = [(f.site, f.steps) for f in pending if resolvable(f.steps)]

    def remember_kept(self, retained: dict[int, float]) -> None:
        """What the last walk saw each pending array of caches other than the roots' hold (by the
        array's id): what cutting it frees once its cache is kept."""
        self._kept_retained = retained

    def kept_pending(
        self, kept: Sequence[tuple[Any, int]], leaking: Collection[str], max_objects: int, max_depth: int
    ) -> tuple[list[mx.array], dict[int, float]]:
        """The pending arrays of the kept caches not cut yet (``kept``: (cache, its last
        forward's step), ``caches.Scope.kept_caches``) at sites seen leaking while caches stepped
        (``leaking``: site names), and by cache (its id) the buffers that cutting them frees, as
        the last walk saw them (what their graphs held, less the buffer each array keeps).

        Only chains the program built and left: those of the sites the fix cuts in the caches
        that step (never a forward it did not evaluate). Found by a walk of the objects alone
        (no graph walk): a cache is cut at the first fix after it is kept, walked or not."""
        if not leaking:  # nothing known to leak yet: no cache is cut, or marked as cut
            return [], {}
        cut = self._cut
        if len(cut) > 2 * len(kept) + 64:  # the dead ones go
            self._cut = cut = {key: entry for key, entry in cut.items() if entry[0]() is not None}
        arrays: list[mx.array] = []
        freed: dict[int, float] = {}
        for cache, used in kept:
            key = id(cache)
            entry = cut.get(key)
            if entry is not None and entry[0]() is cache and entry[1] == used:
                continue
            try:
                cut[key] = (weakref.ref(cache), used)
            except TypeError:  # takes no weak reference: the scope does not keep such caches
                continue
            for f in scan(cache, max_objects=max_objects, max_depth=max_depth).found:
                if f.site in leaking and not _evaluated(f.array):
                    arrays.append(f.array)
                    held = self._kept_retained.get(id(f.array), 0.0)
                    if held > 1:
                        freed[key] = freed.get(key, 0.0) + held - 1
        return arrays, freed

    def forget_paths(self) -> None:
        """Other roots: the paths of the last walk lead elsewhere now."""
        self._paths = self._pending_paths = None

    def wants_probe(self) -> bool:
        """Should the walk just taken start a probe?"""
        self.walks_unprobed += 1
        return self.series_probes < PROBES_FIRST or self.walks_unprobed >= PROBE_EVERY

    def start_probe(self, step: int, buffers_by_site: dict[str, float]) -> None:
        self.probes += 1
        self.series_probes += 1
        self.walks_unprobed = 0
        self.probe = Probe(step, buffers_by_site, step + PROBE_STEPS[self.probes % len(PROBE_STEPS)])

    def end_probe(self, step: int) -> Probe | None:
        """The probe that ends at ``step``, if one does."""
        if self.probe is not None and step >= self.probe.end:
            probe, self.probe = self.probe, None
            return probe
        return None

    def cancel_probe(self) -> None:
        self.probe = None

    def due(self, step: int, last_output: Any, affordable: Callable[[], bool], stretch: int) -> bool:
        """Is a fix due at ``step``? Every ``every`` steps, once the program has evaluated its
        last output; one the budget cannot pay for (``affordable()``) waits, up to ``stretch``
        times ``every`` steps. The first of a series does not wait: the readings wait for it."""
        if self.backlog:
            if step <= self._backlog_until:
                return self.probe is None and evaluated_output(last_output)
            self.backlog = False  # the shares could not run (no evaluated output): the walks go on
        gap = step - self.last_step
        if self.probe is not None or gap < self.every:
            return False
        if self.fixed_once and gap < stretch * self.every and not affordable():
            return False
        return evaluated_output(last_output)

    def share(
        self, pending: list[mx.array], nodes_per_array: float | None, walked: bool, step: int
    ) -> list[mx.array]:
        """This step's share of the fix: all of ``pending``, unless its chains are long
        (``nodes_per_array``: as the last walk saw them, None when a fix ran since). Then about
        FIX_NODES nodes of it, the next arrays in ``pending``'s order, in a step that took no
        walk (none in this one); ``backlog`` says whether more are left for the next steps."""
        if not self.backlog:
            if nodes_per_array is None or nodes_per_array * len(pending) <= FIX_NODES:
                return pending
            take = max(1, int(FIX_NODES // max(nodes_per_array, 1.0)))
            self.backlog, self._backlog_take, self._backlog_next = True, take, 0
            # The walks wait for the shares, at most twice the steps they need (and a probe's).
            self._backlog_until = step + 2 * -(-len(pending) // take) + 2 * max(PROBE_STEPS)
        if walked:
            return []
        # In the order the paths give them, a share after the other (a chain cut in an earlier
        # share is pending again by now, one step long: telling it from a long one needs a walk).
        first = self._backlog_next
        self._backlog_next = last = first + self._backlog_take
        self.backlog = last < len(pending)
        return pending[first:last]

    def pending(
        self,
        roots: Any,
        walked_pending: list | None,
        growing: set | None,
        sweep: bool,
        max_objects: int,
        max_depth: int,
    ) -> list[mx.array]:
        """The arrays to schedule now.

        Once the probes have measured the sites, those of the sites that grow: a pending array
        that does not grow (a counter the next forward evaluates, rows the model drains itself) is
        work the program does anyway, and evaluating it early costs device time. Between walks it
        re-reads only the paths the last walk saw pending and schedules them unchecked: telling a
        pending array costs more than scheduling an evaluated one. Every FULL_SWEEP_FIXES-th fix
        sweeps every path and every pending array, so a site that starts leaking after the last
        walk is cut within that many fixes."""
        self.fixes += 1
        sweep = sweep or self.fixes % FULL_SWEEP_FIXES == 0

        def wanted(site):
            return growing is None or site in growing

        if walked_pending is not None and not sweep:
            return [a for site, a in walked_pending if wanted(site)]
        if self._pending_paths is not None and not sweep:
            return self._resolve(roots, [steps for site, steps in self._pending_paths if wanted(site)])
        if self._paths is None:
            result = scan(roots, max_objects=max_objects, max_depth=max_depth)
            self._paths = [f.steps for f in result.found if resolvable(f.steps)]
        return [a for a in self._resolve(roots, self._paths) if not is_evaluated(a)]

    @staticmethod
    def _resolve(roots: Any, paths: list[tuple]) -> list[mx.array]:
        """The arrays at ``paths``, re-read without a walk."""
        arrays = []
        for steps in paths:
            try:
                value = resolve(roots, steps)
            except Exception:  # the structure changed: the next walk will see the new one
                continue
            if isinstance(value, mx.array):
                arrays.append(value)
        return arrays
