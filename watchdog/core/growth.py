"""Growth: the readings of a watchdog over steps, and what they say: the rate and the leak sites.

Readings are points ``(step, buffers, epoch)``. An *epoch* is one set of live caches: a jump
between two epochs (a request joined, a cache died) is not growth, so slopes pair points of one
epoch only (``forecast.epoch_slope``). Each site (``Class.attribute``) has its own series; in fix
mode, short probes (the fix waits 1-3 steps) measure what the fix cuts at each site.

A leak is long-run growth. A program that evaluates its cache state every N steps (mlx-vlm's
``BatchGenerator`` every 50) leaves chains that grow and are cut, over and over: a sawtooth. Each
array is followed from reading to reading by its path in its cache (a *chain*); once a reading sees
what one retains fall, the program cuts it, and what it retains is bounded: that part is taken out
of every reading before the slope is fitted, at every phase alike. So the rate is the growth of
what is never cut, exact whatever phase of the sawtooth each reading falls on (readings far apart
fall at random phases: a peak read at one is no line), and a site with cut chains whose remainder
does not grow is *bounded*, no leak; one whose remainder grows is a leak, named. Until a cut is
seen, a growing chain is a leak, read as fast as any other. The schedule walks at steps counted
from the decode's start (``schedule.BEAT_RATIO``), so a sawtooth of period P is seen cut within
1.5 P steps on any machine.

A server's kept caches (``caches.py``) grow across epochs, not within one: a request's caches join
the kept ones when it ends, one more per request, each no longer growing. Their buffers and their
sites are read by a long-run slope across epochs (``KeptSeries``).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

from . import forecast as fc
from .caches import kept_site
from .reading import Reading, SiteTally

if TYPE_CHECKING:
    from .fix import Probe

SAMPLE_WINDOW = 64  # readings kept for the growth-rate fit
PROBE_WINDOW = 16  # fix-mode probes kept per site
LEAK_THRESHOLD = 1e-3  # buffers/step below which a site is not reported as leaking
# What a chain retains falling by CUT_BUFFERS or more, and by half or more, between two readings
# that walked it: the program cut it (it starts again from nothing). A leak's chains only grow; a
# buffer that several share may be counted with one or another from one walk to the next, a small
# wobble. (A chain a reading does not walk is an estimate from its site's gain: no cut is read.)
CUT_BUFFERS = 2.0
CUT_SHARE = 0.25
# At a site whose chains the program cuts, a chain not seen cut yet (a request's cache that joined
# a busy batch) is presumed cut like the others until it has gone YOUNG times the longest tooth
# seen there without a cut, or retains YOUNG times the highest peak seen there: then it grows for
# good, a leak beside a sawtooth at one site.
YOUNG = 2
# A tooth this many times longer than any seen and a chain this many times its peak, over
# OVERDUE_READINGS readings at least: the program no longer cuts it.
OVERDUE = 4
OVERDUE_READINGS = 4


@dataclasses.dataclass(slots=True)
class Chain:
    """One array of a site across readings (its path in its cache). A fall of what it retains
    between two readings is a cut by the program: from then on, what it retains is bounded (it
    comes back to its peak, no higher), until a tooth goes on ``OVERDUE`` times longer than any
    seen, to ``OVERDUE`` times its peak: the program no longer cuts it."""

    ref: Any  # the cache's weak reference (None: not followed; the key alone names it)
    retained: float  # at the last reading
    step: int  # of the last reading
    start: int  # of the first reading, then of the last cut seen
    top: float = 0.0  # the most it retained since the last cut seen
    peak: float = 0.0  # the most it retained before a cut
    cuts: int = 0
    longest: int = 1  # steps between two cuts seen, at most
    readings: int = 0  # since the last cut seen
    # What it retained at its last walk (None: never walked). A sampled reading walks a site's
    # chains in turn and estimates the others from their last walk and the gains of the site's
    # longest chain, walked at every reading. A cut is read between two walks of the chain, or
    # where its estimate fell: the longest chain of its site was seen cut (the program cuts the
    # site's chains; one it leaves alone stays the longest, and its gains hold no fall).
    last_walk: float | None = None
    survived: bool = False  # walked before and after a cut of others of its site, and not cut
    history: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> retained

    def read(self, step: int, retained: float, walked: bool) -> bool:
        """One reading; True when it sees a cut."""
        before = self.last_walk if walked else self.retained
        fall = 0.0 if before is None else before - retained
        cut = fall >= CUT_BUFFERS and fall >= CUT_SHARE * (before or 0.0)
        if cut:
            self.cuts += 1
            self.peak = max(self.peak, self.top)
            self.longest = max(self.longest, step - self.start)
            self.start, self.top, self.readings, self.survived = step, 0.0, 0, False
            self.last_walk = None  # (a later walk is read against walks after this cut)
        elif self.cuts and self.overdue(step, retained):
            self.cuts, self.peak = 0, 0.0  # a leak again: its readings count from here on
        self.retained, self.step = retained, step
        if walked:
            self.last_walk = retained
        self.top = max(self.top, retained)
        self.readings += 1
        if retained:  # (none: what it retained at a step not in it)
            self.history[step] = retained
        return cut

    def overdue(self, step: int, retained: float) -> bool:
        # Steps since the last cut *seen* alone are no evidence: readings at the phase of the cuts
        # miss them. What the chain retains grows with its age: past OVERDUE times its peak, no
        # cut came.
        return (
            self.readings >= OVERDUE_READINGS
            and step - self.start > OVERDUE * self.longest
            and retained > OVERDUE * max(self.peak, CUT_BUFFERS)
        )

    @property
    def excess(self) -> float:
        """What it will retain again at its peak, beyond what it retains now."""
        return max(0.0, max(self.peak, self.top) - self.retained)


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
        self.chains: dict[tuple, Chain] = {}  # by key: the site's arrays, followed across readings
        self.longest = 0  # steps between two cuts seen at the site, at most (0: no cut seen)
        self.peak = 0.0  # the most a chain of the site retained before a cut

    def read_chains(self, step: int, tally: SiteTally, since: int) -> None:
        """One reading (not fixing): each array's chain, a cut where what it retains fell.
        ``since``: the oldest step the growth window still holds (older history is dropped)."""
        chains = self.chains
        uncut: list[Chain] = []  # read before, and grown since
        cut = False
        for key, ref, retained, walked in tally.chains:
            chain = chains.get(key)
            if chain is None or chain.ref is not ref:  # a new array, or another cache at that id
                if chain is not None:  # its readings stay subtracted while the window holds them
                    chains[("gone", id(chain))] = chains.pop(key)
                if not retained:  # an evaluated array (most of them): no chain to follow yet
                    chains.pop(key, None)
                    continue
                chains[key] = chain = Chain(ref, retained, step, step)
                chain.read(step, retained, walked)
                continue
            before = chain.retained
            if chain.read(step, retained, walked):
                cut = True
                self.longest = max(self.longest, chain.longest)
                self.peak = max(self.peak, chain.peak)
            elif walked and retained > before:
                uncut.append(chain)
        if cut:  # the program cut some of the site's chains while these grew: it does not cut them
            for chain in uncut:
                chain.survived = True
        for key in [key for key, chain in chains.items() if chain.step < since]:
            del chains[key]  # gone before the window: no reading of it is fitted any more
        for chain in chains.values():
            history = chain.history  # in the order of the steps
            while history and (oldest := next(iter(history))) < since:
                del history[oldest]

    def forget_chains(self) -> None:
        """The fix cuts the chains now: a cut is no longer the program's."""
        self.chains.clear()
        self.longest, self.peak = 0, 0.0

    def cut_chains(self) -> list[Chain]:
        """The chains the program cuts, and those too young to tell at a site where it cuts some."""
        if not self.longest:
            return []
        young, high = YOUNG * self.longest, YOUNG * self.peak
        return [
            chain
            for chain in self.chains.values()
            if chain.cuts
            or (not chain.survived and chain.step - chain.start <= young and chain.retained <= high)
        ]

    def bounded_at(self, step: int, cut: list[Chain]) -> float:
        """What the chains the program cuts retained at the reading of ``step``."""
        return sum(chain.history.get(step, 0.0) for chain in cut)

    def remainder(self, cut: list[Chain]) -> list[tuple[int, float, int]]:
        """The site's readings less what its cut chains retained then: its long-run growth."""
        return [(at, round(b - self.bounded_at(at, cut), 6), e) for at, b, e in self.total]

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

    def record(self, reading: Reading, epoch: int, probe: Probe | None, fixing: bool = False) -> None:
        """One reading (``reading.py``), of ``epoch``. Its ``sample``: the buffers to fit the rate on
        (None: no sample, e.g. an empty cache). ``probe``: the fix-mode probe this reading ends (its
        growth per site). ``fixing``: the fix cuts chains now, so a cut is no longer the program's.
        Its ``kept``: the buffers of kept caches (None: no sample); ``kept_since``: the last forward
        of the newest of them."""
        step, sites, sample = reading.step, reading.by_site, reading.sample
        kept, kept_since = reading.kept, reading.kept_since
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
                    series.forget_chains()
                elif not kept_site(site):  # kept caches no longer step: no chain of theirs grows
                    since = min(series.total[0][0], self.samples[0][0] if self.samples else step)
                    series.read_chains(step, tally, since)
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
        """The slope of the samples, less what the chains the program cuts retained at each: a
        sawtooth read at random phases is no line, what is never cut is."""
        cut = [(series, chains) for series in self.sites.values() if (chains := series.cut_chains())]
        if not cut:
            return fc.epoch_slope(self.samples)
        rest = [
            (at, round(y - sum(series.bounded_at(at, chains) for series, chains in cut), 6), e)
            for at, y, e in self.samples
        ]
        return fc.epoch_slope(rest)

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
            chains = series.cut_chains() if not fixing else []
            if chains:
                # The program cuts some of its chains: what they retain comes back to their peaks,
                # no higher; the rest of the site says whether it grows.
                excess += sum(chain.excess for chain in chains)
                site_rate = fc.epoch_slope(series.remainder(chains)) or 0.0
                if site_rate > LEAK_THRESHOLD:
                    leaks.append(
                        fc.Leak(site, series.paths, site_rate, int(round(series.buffers)), sawtooth=True)
                    )
                else:
                    peak = series.buffers + sum(chain.excess for chain in chains)
                    cuts = max(chain.cuts for chain in chains)
                    bounded.append(
                        fc.Bounded(site, series.paths, int(round(peak)), int(round(series.buffers)), cuts)
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
