"""Forecast: a robust growth rate and the step and time at which the limit is reached."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Leak:
    """A site whose buffers grow: ``"ArraysCache.left_padding"`` over all layers."""

    site: str
    paths: tuple[str, ...]  # concrete paths from the root, e.g. "[7].left_padding"
    buffers_per_step: float  # for the whole site
    buffers: int  # buffers held at the site at the last measurement
    # Fix mode: the fix cuts this site's chains; buffers_per_step is what it would add without
    # the fix (what the probes saw), not what stays resident. A site that also grows in number
    # of arrays has a second, uncut, entry for that part.
    cut: bool = False
    # Where the program rebinds the attribute, found once by a short probe (attribution.py):
    # "mlx_lm/models/cache.py:685 ArraysCache.advance"; None until found (or not findable).
    source: str | None = None
    # The program itself cuts some of this site's chains now and then (a sawtooth), and the rest
    # grows: buffers_per_step is the growth of what it never cuts, not of a chain between two cuts.
    sawtooth: bool = False
    # A compiled function's site ("compiled:module.function", compiled.py): the input signatures
    # its cache keeps (an entry each); None for any other site.
    signatures: int | None = None


@dataclasses.dataclass(frozen=True)
class Bounded:
    """A site whose chains the program itself cuts now and then (it evaluates its cache state
    every N steps) and whose peaks do not grow: a sawtooth, no leak. It costs headroom, not
    steps: the forecast counts the limit from its peak."""

    site: str
    paths: tuple[str, ...]
    peak_buffers: int  # the most the site was read to hold, just before a cut
    buffers: int  # buffers held at the site at the last measurement
    cuts: int  # the program's cuts seen (readings far apart see fewer than there are)
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class Forecast:
    """What the watchdog knows after ``step`` observed steps."""

    step: int
    resident_buffers: int  # estimate of live buffer objects now
    limit: int
    buffers_per_step: float  # net growth of resident buffers (0 when flat)
    steps_to_limit: float  # math.inf when not growing
    seconds_to_limit: float  # math.inf when not growing
    leaks: tuple[Leak, ...] = ()  # biggest first
    step_rate: float = 0.0  # observed steps per second
    source: str = "estimate"  # "estimate", or the name of MLX's exact counter when one exists
    parameter_buffers: int = 0
    cache_buffers: int = 0
    retained_buffers: int = 0
    pending_graph_nodes: int = 0
    measured_step: int = 0  # the step of the last graph walk (later steps are extrapolated)
    prefill_graph_nodes: int | None = None
    max_safe_prefill_tokens: int | None = None
    rank: int = 0
    world_size: int = 1
    # False until two readings of one set of caches have measured the growth: buffers_per_step
    # then reads 0 and steps_to_limit +Inf, which mean "not measured", not "no leak".
    rate_known: bool = True
    # False while nothing steps (a generation ended, a server between requests): step_rate and
    # so seconds_to_limit then read 0 and +Inf; the rest is the last decode's.
    decoding: bool = True
    sampled: bool = False  # the last reading walked a sample of the pending graphs (too big to walk whole)
    # Buffers of the limit kept for what the count does not include (MLX's cached buffers, read
    # from MLX's counter; on Metal without one, a margin for buffers in flight): steps_to_limit
    # is (limit - resident_buffers - reserved_buffers) / buffers_per_step.
    reserved_buffers: int = 0
    # Sites the program cuts itself and whose peaks do not grow (biggest peak first): no leak.
    bounded: tuple[Bounded, ...] = ()
    # The resident count at the sawtooth's peaks (resident_buffers plus what each site the program
    # cuts holds at its peak beyond now): steps_to_limit counts the headroom from it.
    peak_resident_buffers: int = 0
    # With a count of the whole process (source "process", or MLX's own counter): the growth per
    # step that no named site explains (a program object outside the caches read, a compiled
    # function's cache), included in buffers_per_step. 0 without a count, or within the noise;
    # NaN while the process count's readings do not span enough steps to read it (48).
    unattributed_buffers_per_step: float = 0.0
    # Why the process-wide count is not read (None while it is): turned off, or its self-check failed.
    process_count_off: str | None = None

    @property
    def limit_step(self) -> float:
        """The step at which the estimate reaches the limit (math.inf when never)."""
        return self.step + self.steps_to_limit

    def describe(self) -> str:
        sites = [
            f"{leak.site} +{leak.buffers_per_step:.3g}/step"
            + (" (cut by the fix)" if leak.cut else "")
            + (" (its peaks; the program cuts it now and then)" if leak.sawtooth else "")
            + (f" ({leak.signatures} input signatures compiled)" if leak.signatures is not None else "")
            + (f" [{leak.source}]" if leak.source else "")
            for leak in self.leaks[:3]
        ]
        if self.unattributed_buffers_per_step > 0:
            sites.append(
                f"unattributed +{self.unattributed_buffers_per_step:.3g}/step "
                "(the process grows outside the caches read)"
            )
        top = ", ".join(sites) or "none"
        if not self.rate_known:
            return (
                f"step {self.step}: {self.resident_buffers} of {self.limit} buffers, growth not measured yet"
            )
        idle = "" if self.decoding else "; not decoding now"
        when = (
            "the limit is not approached"
            if math.isinf(self.steps_to_limit)
            else f"limit in {_fmt(self.steps_to_limit)} steps ({_fmt(self.seconds_to_limit)} s)"
        )
        bounded = "".join(
            f"; bounded: {site.site} (peak {site.peak_buffers} buffers, the program cuts it)"
            for site in self.bounded[:3]
        )
        peak = (
            f" (peak {self.peak_resident_buffers})"
            if self.peak_resident_buffers > self.resident_buffers
            else ""
        )
        return (
            f"step {self.step}: {self.resident_buffers}{peak} of {self.limit} buffers, "
            f"{self.buffers_per_step:+.3g}/step, {when}{idle}; leak sites: {top}{bounded}"
        )


# Growth the named sites leave unexplained is reported from this many buffers per step: below it,
# the difference of two robust slopes of the same readings is read as noise.
UNATTRIBUTED_THRESHOLD = 0.05


def unattributed_rate(rate: float, leaks: Sequence[Leak]) -> float:
    """The whole process's growth per step less what the named sites add (the fix's cut sites
    aside: the rate is what stays after the fix); 0 below ``UNATTRIBUTED_THRESHOLD``."""
    rest = max(0.0, rate) - sum(leak.buffers_per_step for leak in leaks if not leak.cut)
    return rest if rest >= UNATTRIBUTED_THRESHOLD else 0.0


def _fmt(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.0f}"


def robust_slope(points: Sequence[tuple[float, float]]) -> float:
    """Theil-Sen slope: the median of pairwise slopes.

    Robust to a chain that is drained now and then (one big drop among many small rises)
    and to bursty growth (a chain that grows for k steps and collapses): over a window of
    several bursts most pairs are far apart and see the long-run trend."""
    if len(points) < 2:
        return 0.0
    first = points[0][1]
    if all(y == first for _, y in points):  # flat (most sites, most of the time): no pairs needed
        return 0.0
    data = np.asarray(points, dtype=np.float64)
    x, y = data[:, 0], data[:, 1]
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    keep = dx > 0
    if not keep.any():
        return 0.0
    return float(np.median((y[j] - y[i])[keep] / dx[keep]))


RECENT_SPAN = 32  # steps the latest epoch must span to be read alone...
RECENT_POINTS = 5  # ...with at least this many readings


def epoch_slope(points: Sequence[tuple[float, float, int]]) -> float | None:
    """Theil-Sen slope over the pairs of ``(step, value, epoch)`` points of one epoch each.

    A reading of another set of caches (a request joined, a cache died) is a jump, not growth:
    pairs across two epochs would read it as a slope. Once the latest epoch spans
    ``RECENT_SPAN`` steps it is read alone, so the rate follows a change within that many steps;
    before, the epochs of the window are pooled. None when no epoch has two points."""
    n = len(points)
    if n < 2:
        return None
    first = points[0][1]
    if all(p[1] == first for p in points):  # flat (most sites, most readings): no pairs needed
        seen: dict = {}
        for at, _, label in points:
            if seen.setdefault(label, at) != at:
                return 0.0
        return None
    latest = points[-1][2]
    recent = [p for p in points if p[2] == latest]
    if len(recent) >= RECENT_POINTS and recent[-1][0] - recent[0][0] >= RECENT_SPAN:
        points, n = recent, len(recent)
    data = np.asarray(points, dtype=np.float64)
    x, y, epoch = data[:, 0], data[:, 1], _split_level_shifts(data[:, 1], data[:, 2])
    i, j = _pairs(n)
    dx = x[j] - x[i]
    keep = (dx > 0) & (epoch[i] == epoch[j])
    if not keep.any():
        return None
    dy = (y[j] - y[i])[keep]
    if not dy.any():
        return 0.0
    return float(np.median(dy / dx[keep]))


def _split_level_shifts(y: np.ndarray, epoch: np.ndarray) -> np.ndarray:
    """Epoch labels with each epoch cut at a level shift: one rise between two readings whose
    excess over the typical rise is at least half of all the excess, with two readings or more on
    each side. A batch that shrinks in place (``BatchGenerator`` filters the same caches when
    requests finish) moves the level once; in a window where half the pairs straddle that step,
    Theil-Sen reads it as growth. A steady leak read at any spacing has the same slope on both
    sides of a cut, so cutting it changes nothing."""
    labels = epoch.copy()
    for e in np.unique(epoch):
        members = np.flatnonzero(epoch == e)
        if len(members) < 4:
            continue
        rises = np.diff(y[members])
        typical = float(np.median(rises))  # what a step of steady growth adds, if any
        excess = rises - typical
        k = int(np.argmax(excess))
        if excess[k] > 0 and excess[k] >= 0.5 * excess.sum() and 2 <= k + 1 <= len(members) - 2:
            labels[members[k + 1 :]] = e + 0.5  # no epoch id is a half
    return labels


@functools.lru_cache(maxsize=8)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def steps_to_limit(resident: float, limit: int, rate: float) -> float:
    if resident >= limit:
        return 0.0
    if rate <= 1e-9:
        return math.inf
    return (limit - resident) / rate


def seconds_from_steps(steps: float, step_rate: float) -> float:
    if math.isinf(steps):
        return math.inf
    if step_rate <= 0:
        return math.inf if steps > 0 else 0.0
    return steps / step_rate
