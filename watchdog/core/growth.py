"""Growth: the readings of a watchdog over steps, and what they say: the rate and the leak sites.

Readings are points ``(step, buffers, epoch)``. An *epoch* is one set of live caches: a jump
between two epochs (a request joined, a cache died) is not growth, so slopes pair points of one
epoch only (``forecast.epoch_slope``). Each site (``Class.attribute``) has its own series; in fix
mode, short probes (the fix waits 1-3 steps) measure what the fix cuts at each site.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING

from . import forecast as fc

if TYPE_CHECKING:
    from .fix import Probe

SAMPLE_WINDOW = 64  # readings kept for the growth-rate fit
PROBE_WINDOW = 16  # fix-mode probes kept per site
LEAK_THRESHOLD = 1e-3  # buffers/step below which a site is not reported as leaking


@dataclasses.dataclass(slots=True)
class SiteTally:
    """One site's arrays in one reading."""

    held: int = 0  # evaluated arrays: a buffer each
    retained: float = 0.0  # buffers the graphs of its pending arrays keep alive
    paths: list[str] = dataclasses.field(default_factory=list)  # some of those pending arrays
    arrays: int = 0


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


class Growth:
    """The growth measured since the last reset (a new decode, or the first step after idle)."""

    def __init__(self) -> None:
        self.samples: collections.deque = collections.deque(maxlen=SAMPLE_WINDOW)
        self.sites: dict[str, SiteSeries] = {}
        self.leaks: tuple[fc.Leak, ...] = ()
        self.rate = 0.0
        self.known = False  # two readings of one epoch have measured the rate
        self.probed: float | None = None  # what the fix cuts per step, over all sites
        self.growing: set[str] | None = None  # sites the probes saw grow; None: not probed yet

    def record(
        self, step: int, epoch: int, sites: dict[str, SiteTally], sample: float | None, probe: Probe | None
    ) -> None:
        """One reading. ``sample``: the buffers to fit the rate on (None: no sample, e.g. an empty
        cache). ``probe``: the fix-mode probe this reading ends (its growth per site)."""
        for site, tally in sites.items():
            series = self.sites.get(site) or self.sites.setdefault(site, SiteSeries())
            buffers = tally.held + tally.retained
            series.arrays.append((step, tally.arrays, epoch))
            if probe is not None:
                before = probe.buffers_by_site.get(site, 0)
                series.growth.append((buffers - before) / max(1, step - probe.start))
            else:
                series.total.append((step, buffers, epoch))
            series.buffers, series.retained = buffers, tally.retained
            if tally.paths:
                series.paths = tuple(tally.paths)
        if probe is None and sample is not None:
            self.samples.append((step, sample, epoch))
            rate = fc.epoch_slope(self.samples)
            if rate is not None:
                self.rate, self.known = rate, True

    def site_buffers(self) -> dict[str, float]:
        return {site: s.buffers for site, s in self.sites.items()}

    def fixed(self) -> None:
        """The first fix ran: the readings so far counted what it now cuts. From here on the growth
        is what it leaves, known at once from the probes (the total less what they saw it cut)."""
        self.samples.clear()
        if self.probed is not None:
            self.rate = max(0.0, self.rate - self.probed)

    def update_leaks(self, fixing: bool) -> None:
        """Per-site rates, once per reading (not per step or per scrape)."""
        leaks, probed, growing = [], [], set()
        for site, series in self.sites.items():
            site_probed = series.probed_rate()
            grows = site_probed is not None and site_probed > LEAK_THRESHOLD
            if site_probed is not None:
                probed.append(site_probed)
                if grows:
                    growing.add(site)
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
        self.leaks = tuple(leaks)
        self.probed = sum(probed) if probed else None
        self.growing = growing if probed else None
