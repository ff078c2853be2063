"""Growth: the readings of a watchdog over steps, and what they say: the rate and the leak sites.

Readings are points ``(step, buffers, epoch)``. An *epoch* is one set of live caches: a jump
between two epochs (a request joined, a cache died) is not growth, so slopes pair points of one
epoch only (``forecast.epoch_slope``). Each site (``Class.attribute``) has its own series; in fix
mode, short probes (the fix waits 1-3 steps) measure what the fix cuts at each site.

A leak is long-run growth. A program that evaluates its cache state every N steps (mlx-vlm's
``BatchGenerator`` every 50) leaves chains that grow and are cut, over and over: a sawtooth. A site
is read as one once a reading of an epoch sees its retained buffers drop (``Teeth``): from then on
it grows as its peaks grow, and peaks that do not grow make it *bounded*, no leak. Until a cut is
seen, a growing chain is a leak, read as fast as any other.

A server's kept caches (``caches.py``) grow across epochs, not within one: a request's caches join
the kept ones when it ends, one more per request, each no longer growing. Their buffers and their
sites are read by a long-run slope across epochs (``KeptSeries``).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING

from . import forecast as fc
from .caches import kept_site

if TYPE_CHECKING:
    from .fix import Probe

SAMPLE_WINDOW = 64  # readings kept for the growth-rate fit
PROBE_WINDOW = 16  # fix-mode probes kept per site
LEAK_THRESHOLD = 1e-3  # buffers/step below which a site is not reported as leaking
# A site's retained buffers falling by CUT_BUFFERS or more between two readings of one epoch, its
# arrays as many or more: the program cut its chains. A leak's chains only grow. A reading that
# samples them reads high, not low, by a buffer an array that several share (sampling.py): after
# one, a cut must be more than CUT_PER_ARRAY a pending array. A cut of part of a site's chains
# (the program evaluates some of its caches) may be a small share of a long leak.
CUT_BUFFERS = 2.0
CUT_PER_ARRAY = 2.0
TEETH_KEPT = 16  # the last cuts' peaks and troughs kept per site
# A tooth this many times longer than any seen, over OVERDUE_READINGS readings at least (far
# apart, they see a cut at random phases: 8 rising in a row is a chance of 1 in 40,320): the
# program no longer cuts the site.
OVERDUE = 4
OVERDUE_READINGS = 8


@dataclasses.dataclass(slots=True)
class SiteTally:
    """One site's arrays in one reading."""

    held: int = 0  # evaluated arrays: a buffer each
    retained: float = 0.0  # buffers the graphs of its pending arrays keep alive
    paths: list[str] = dataclasses.field(default_factory=list)  # some of those pending arrays
    arrays: int = 0


class Teeth:
    """One site's sawtooth: the highest reading before each cut seen (a peak: the true one lies
    between it and the reading after the cut) and the reading after it (a trough). Readings far
    apart see a cut now and then, at random phases; readings every step see every peak.

    Caches that join or leave a busy batch move the site's level (a new epoch): the program goes
    on cutting the caches that stay, so the site stays a sawtooth, but peaks of two epochs are no
    line. A tooth that goes on ``OVERDUE`` times longer than any seen ends it: the program no
    longer cuts this site, and what grows then is a leak."""

    def __init__(self, epoch: int, start: int) -> None:
        self.epoch = epoch
        self.cuts = 0
        # (step, buffers, epoch)
        self.peaks: collections.deque[tuple[int, float, int]] = collections.deque(maxlen=TEETH_KEPT)
        self.troughs: collections.deque[tuple[int, float, int]] = collections.deque(maxlen=TEETH_KEPT)
        self.top: tuple[int, float] | None = None  # the highest reading since the last cut
        self.growth = 0.0  # of the peaks, per step; 0 until it stands out of the sawtooth
        self.tooth_start = start  # the step of the last cut seen (or the epoch's first reading)
        self.longest = 1  # steps between two cuts seen, at most
        self.readings = 0  # since the last cut

    def new_epoch(self, epoch: int, step: int, buffers: float) -> None:
        self.epoch, self.top, self.growth = epoch, (step, buffers), 0.0

    def overdue(self, step: int) -> bool:
        return self.readings >= OVERDUE_READINGS and step - self.tooth_start > OVERDUE * self.longest

    def read(self, step: int, buffers: float, cut: bool) -> None:
        if cut and self.top is not None:
            self.cuts += 1
            self.peaks.append((*self.top, self.epoch))
            self.troughs.append((step, buffers, self.epoch))
            self.longest = max(self.longest, step - self.tooth_start)
            self.tooth_start, self.top, self.readings = step, None, 0
        self.readings += 1
        if self.top is None or buffers >= self.top[1]:
            self.top = (step, buffers)
        self.growth = self._growth()

    @property
    def peak(self) -> float:
        """The most the site was read to hold (its peak, as far as the readings saw it; a peak of
        an epoch before counts too, until TEETH_KEPT cuts later)."""
        return max([b for _, b, _ in self.peaks] + ([self.top[1]] if self.top else []))

    def _growth(self) -> float:
        """The peaks' slope (Theil-Sen) in this epoch, once it stands out of the sawtooth: the line
        must rise over the peaks' span by more than the peaks and troughs spread about it. A peak
        read at a random phase is noise of up to the sawtooth's height; a chain cut once that then
        grows for good rises past every peak (the highest reading since the last cut joins the
        peaks when it is their highest)."""
        peaks = [(at, b) for at, b, epoch in self.peaks if epoch == self.epoch]
        if not peaks:
            return 0.0
        if self.top is not None and self.top[1] > max(b for _, b in peaks):
            peaks.append(self.top)
        if len(peaks) < 2:
            return 0.0
        rate = fc.robust_slope(peaks)
        if rate <= LEAK_THRESHOLD:
            return 0.0
        troughs = [(at, b) for at, b, epoch in self.troughs if epoch == self.epoch]
        residuals = [b - rate * at for at, b in peaks + troughs]
        spread = max(residuals) - min(residuals)
        return rate if rate * (peaks[-1][0] - peaks[0][0]) > spread else 0.0


class SiteSeries:
    """Measurements of one site across readings."""

    def __init__(self) -> None:
        self.total: collections.deque[tuple[int, float, int]] = collections.deque(
            maxlen=SAMPLE_WINDOW
        )  # (step, held + retained, epoch)
        # (step, arrays at the site, evaluated or not, epoch): more buffers held in evaluated arrays
        # can only come from more arrays, while a lazy chain grows behind a fixed number of them.
        # So its slope is the part of a site's growth the fix cannot cut.
        self.arrays: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=SAMPLE_WINDOW)
        # buffers/step seen by fix-mode probes (signed)
        self.growth: collections.deque[float] = collections.deque(maxlen=PROBE_WINDOW)
        self.paths: tuple[str, ...] = ()
        self.buffers = 0.0
        self.retained = 0.0
        self.epoch: int | None = None  # of the last reading (probes aside)
        self.epoch_start = 0  # the step of its first reading in that epoch
        self.sampled = False  # its last reading walked a sample of the graphs
        self.last_step = 0
        self.teeth: Teeth | None = None  # once the program was seen to cut it (until it stops)

    def read_cuts(self, step: int, buffers: float, tally: SiteTally, epoch: int, sampled: bool) -> None:
        """One reading (not fixing): a cut when the retained buffers fell since the last reading
        of this epoch. Another epoch (caches joined or died) is a jump, no cut."""
        teeth, retained = self.teeth, tally.retained
        fewer = bool(self.arrays) and tally.arrays < self.arrays[-1][1]  # removed, not cut
        sampling = sampled or self.sampled
        drop = max(CUT_BUFFERS, CUT_PER_ARRAY * tally.arrays) if sampling else CUT_BUFFERS
        self.sampled = sampled
        if epoch != self.epoch:
            self.epoch_start = step
            if teeth is not None:
                teeth.new_epoch(epoch, step, buffers)
        elif self.retained - retained >= drop and not fewer:
            if teeth is None:
                teeth = self.teeth = Teeth(epoch, self.epoch_start)
                teeth.read(self.last_step, self.buffers, cut=False)  # the reading before it
            teeth.read(step, buffers, cut=True)
        elif teeth is not None:
            if teeth.overdue(step):
                self.teeth = None  # read from its readings again, as any site
            else:
                teeth.read(step, buffers, cut=False)
        self.epoch, self.last_step = epoch, step

    def probed_rate(self) -> float | None:
        """What the fix cuts at this site per step, from the probes; None before the first probe.

        A leak only grows while the fix waits; a chain the program drains itself (a
        compressed-attention cache's pending rows) is sometimes seen shrinking: that one is no
        leak, however fast it grows between its drains."""
        if not self.growth:
            return None
        if min(self.growth) < 0:
            return 0.0
        return statistics.median(self.growth)


class KeptSeries:
    """Buffers of kept caches over steps. They change only when one more cache is kept (a request
    ended) or one is dropped: a staircase. A cache is known to be kept some steps after its last
    forward, so each rise is placed at that forward (``since``), and the slope is read from stair
    to stair: the buffers each request left over the steps it took, whatever the readings between
    (a window of readings may span less than one request of a busy server). When no cache is
    kept for longer than a stair's typical width, the slope falls with the steps."""

    def __init__(self) -> None:
        self.changes: collections.deque[tuple[int, float]] = collections.deque(maxlen=SAMPLE_WINDOW)
        self.step = 0  # of the last reading

    def add(self, step: int, buffers: float, since: int | None = None) -> None:
        """A reading at ``step``; ``since``: the last forward of the newest kept cache."""
        if not self.changes or round(buffers) != round(self.changes[-1][1]):
            rise = bool(self.changes) and buffers > self.changes[-1][1]
            at = since if rise and since is not None else step  # a drop: when it was seen
            self.changes.append((max(at, self.changes[-1][0] + 1) if self.changes else at, buffers))
        self.step = step

    def slope(self) -> float:
        """Buffers per step, 0 before a change."""
        changes = list(self.changes)
        if len(changes) >= 3:  # from the first change on: whole stairs (when the first began is unknown)
            changes = changes[1:]
        n = len(changes)
        if n < 2:
            return 0.0
        (s0, b0), (s1, b1) = changes[0], changes[-1]
        end = max(s1, self.step - (s1 - s0) / (n - 1))
        return (b1 - b0) / (end - s0)

    def clear(self) -> None:
        self.changes.clear()


class Growth:
    """The growth measured since the last reset (a new decode, or the first step after idle)."""

    def __init__(self) -> None:
        self.samples: collections.deque = collections.deque(maxlen=SAMPLE_WINDOW)
        self.kept = KeptSeries()  # every kept cache's buffers
        self.kept_sites: dict[str, KeptSeries] = {}
        self.live_rate = 0.0  # the growth of the caches that step, from the epochs' slopes
        self.sites: dict[str, SiteSeries] = {}
        self.leaks: tuple[fc.Leak, ...] = ()
        self.bounded: tuple[fc.Bounded, ...] = ()  # sites the program cuts, whose peaks do not grow
        self.peak_excess = 0.0  # what those sites hold at their peaks beyond the last reading
        self.rate = 0.0
        self.known = False  # two readings of one epoch have measured the rate
        self.probed: float | None = None  # what the fix cuts per step, over all sites
        self.growing: set[str] | None = None  # sites the probes saw grow; None: not probed yet

    def record(
        self,
        step: int,
        epoch: int,
        sites: dict[str, SiteTally],
        sample: float | None,
        probe: Probe | None,
        fixing: bool = False,
        sampled: bool = False,
        kept: float | None = None,
        kept_since: int | None = None,
    ) -> None:
        """One reading. ``sample``: the buffers to fit the rate on (None: no sample, e.g. an empty
        cache). ``probe``: the fix-mode probe this reading ends (its growth per site). ``fixing``:
        the fix cuts chains now, so a cut is no longer the program's. ``sampled``: the reading
        walked a sample of the graphs. ``kept``: the buffers of kept caches (None: no sample);
        ``kept_since``: the last forward of the newest of them."""
        for site, tally in sites.items():
            if probe is None and kept is not None and kept_site(site):
                at_site = self.kept_sites.get(site)
                if at_site is None:
                    at_site = self.kept_sites[site] = KeptSeries()
                    if self.kept.changes:  # none of it at the last reading
                        at_site.add(self.kept.step, 0.0)
                at_site.add(step, tally.held + tally.retained, kept_since)
            series = self.sites.get(site) or self.sites.setdefault(site, SiteSeries())
            buffers = tally.held + tally.retained
            if probe is not None:
                before = probe.buffers_by_site.get(site, 0)
                series.growth.append((buffers - before) / max(1, step - probe.start))
            else:
                series.total.append((step, buffers, epoch))
                if fixing:
                    series.teeth = None
                else:
                    series.read_cuts(step, buffers, tally, epoch, sampled)
            series.arrays.append((step, tally.arrays, epoch))
            series.buffers, series.retained = buffers, tally.retained
            if tally.paths:
                series.paths = tuple(tally.paths)
        if probe is None and sample is not None:
            self.samples.append((step, sample, epoch))
            rate = fc.epoch_slope(self.samples) if fixing else self._long_run_rate()
            if rate is not None:
                self.live_rate, self.known = rate, True
        if probe is None and kept is not None:
            self.kept.add(step, kept, kept_since)
            for site, at_site in self.kept_sites.items():
                if site not in sites:  # its caches were dropped, or are stepped again
                    at_site.add(step, 0.0)
        self._combine()

    def _combine(self) -> None:
        """The rate: the caches that step grow, and so does the number of kept ones. A kept cache
        stepped first, so the growth it brings was read first as theirs: the larger of the two
        is the long-run growth, not their sum."""
        self.rate = max(self.live_rate, self.kept.slope())

    def _long_run_rate(self) -> float | None:
        """The slope of the samples, with each site the program cuts counted by its peaks' growth
        instead of its readings (a sawtooth read at random phases is no line)."""
        cut = [series for series in self.sites.values() if series.teeth is not None]
        if not cut:
            return fc.epoch_slope(self.samples)
        held = [{at: b for at, b, _ in series.total} for series in cut]
        rest = [(at, round(y - sum(h.get(at, 0.0) for h in held), 6), e) for at, y, e in self.samples]
        rate = fc.epoch_slope(rest)
        if rate is None:
            return None
        return rate + sum(series.teeth.growth for series in cut if series.teeth is not None)

    def site_buffers(self) -> dict[str, float]:
        return {site: s.buffers for site, s in self.sites.items()}

    def fixed(self) -> None:
        """The first fix ran: the readings so far counted what it now cuts. From here on the growth
        is what it leaves, known at once from the probes (the total less what they saw it cut)."""
        self.samples.clear()
        self.kept.clear()  # the fix cuts the kept chains too: their growth is measured afresh
        for series in self.kept_sites.values():
            series.clear()
        if self.probed is not None:
            self.live_rate = max(0.0, self.live_rate - self.probed)
        self._combine()

    def update_leaks(self, fixing: bool) -> None:
        """Per-site rates, once per reading (not per step or per scrape)."""
        leaks, probed, growing, bounded = [], [], set(), []
        excess = 0.0
        for site, series in self.sites.items():
            if kept_site(site):  # no probe sees them grow: they grow by one more kept cache
                kept_rate = self.kept_sites[site].slope() if site in self.kept_sites else 0.0
                if kept_rate > LEAK_THRESHOLD:
                    leaks.append(fc.Leak(site, series.paths, kept_rate, int(round(series.buffers))))
                continue
            site_probed = series.probed_rate()
            grows = site_probed is not None and site_probed > LEAK_THRESHOLD
            if site_probed is not None:
                probed.append(site_probed)
                if grows:
                    growing.add(site)
            teeth = series.teeth
            if teeth is not None and not fixing:
                # The program cuts it: its peaks say whether it grows; either way the limit is
                # counted from its peak.
                excess += max(0.0, teeth.peak - series.buffers)
                if teeth.growth > LEAK_THRESHOLD:
                    leaks.append(
                        fc.Leak(site, series.paths, teeth.growth, int(round(series.buffers)), sawtooth=True)
                    )
                else:
                    bounded.append(
                        fc.Bounded(
                            site, series.paths, int(round(teeth.peak)), int(round(series.buffers)), teeth.cuts
                        )
                    )
                continue
            if fixing and site_probed is not None:
                # The fix cuts the chains, so the series stays flat; the probes saw the growth it cuts.
                site_rate = site_probed
            else:
                site_rate = fc.epoch_slope(series.total) or 0.0
            if fixing and grows and series.retained > 0:
                # The fix schedules this site's pending arrays: it cuts their chains, not the
                # growth in the number of arrays (that part stays a leak).
                uncut = min(site_rate, max(0.0, fc.epoch_slope(series.arrays) or 0.0))
                for rate, cut in ((site_rate - uncut, True), (uncut, False)):
                    if rate > LEAK_THRESHOLD:
                        leaks.append(fc.Leak(site, series.paths, rate, int(round(series.buffers)), cut=cut))
            elif site_rate > LEAK_THRESHOLD:
                leaks.append(fc.Leak(site, series.paths, site_rate, int(round(series.buffers))))
        leaks.sort(key=lambda leak: leak.buffers_per_step, reverse=True)
        bounded.sort(key=lambda site: site.peak_buffers, reverse=True)
        self.leaks = tuple(leaks)
        self.bounded = tuple(bounded)
        self.peak_excess = excess
        self.probed = sum(probed) if probed else None
        self.growing = growing if probed else None
