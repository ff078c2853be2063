"""growth.py: the rate, the leak sites and the bounded ones, read from readings made here.

Every reading is built from a program whose truth is known by construction, never from the
watchdog's own numbers: a chain that grows k buffers a step (rate k), a sawtooth whose program
evaluates its chains every P steps (no long-run growth, a peak of P - 1 per chain, one cut per P
steps), both at one site (the rate of the chain never cut), a jump between two sets of caches (no
growth), a staircase of kept caches (B buffers per request of W steps: B / W a step), fix-mode
probes of a site growing k a step. A reading walks at steps like the schedule's (dense, then
farther apart) or at a stride that drifts through the sawtooth's phases.
"""

from __future__ import annotations

import pytest

from mlx_watchdog.core.caches import KEPT_MARK
from mlx_watchdog.core.fix import Probe
from mlx_watchdog.core.growth import (
    CUT_BUFFERS,
    OVERDUE,
    OVERDUE_READINGS,
    SAMPLE_WINDOW,
    Chain,
    Growth,
    KeptSeries,
)
from mlx_watchdog.core.reading import Reading, SiteTally

SITE = "ArraysCache.left_padding"
OTHER = "KVCache.keys"
HELD = 10  # evaluated arrays at a site: a buffer each, flat
PARAMETERS = 1_000  # the model's: in every sample, flat
SCHEDULE = [0, 1, 2, 4, 8, 16, 32, 64, 96, 144, 216, 324, 486]  # dense walks, then beats


def tally(chains: dict[str, float], held: float = HELD, walked: bool = True) -> SiteTally:
    """A site's reading: ``held`` evaluated arrays and pending arrays retaining ``chains``."""
    return SiteTally(
        held=int(held),
        retained=float(sum(chains.values())),
        paths=tuple(f"[{key}].left_padding" for key in chains),
        arrays=int(held) + len(chains),
        chains=tuple(
            ((("item", key), ("attr", "left_padding")), None, float(r), walked) for key, r in chains.items()
        ),
    )


def record(
    growth: Growth,
    step: int,
    epoch: int,
    sites: dict[str, SiteTally],
    sample: float | None,
    probe: Probe | None,
    fixing: bool = False,
    kept: float | None = None,
    kept_since: int | None = None,
) -> None:
    """A reading of ``sites`` at ``step`` into ``growth``, as ``read()`` would make it."""
    reading = Reading(step=step, by_site=sites, sample=sample, kept=kept, kept_since=kept_since)
    growth.record(reading, epoch, probe, fixing)


def read(growth: Growth, step: int, sites: dict[str, SiteTally], epoch: int = 0) -> None:
    """One reading, as the watchdog makes it: the sample is everything resident."""
    sample = PARAMETERS + sum(t.held + t.retained for t in sites.values())
    record(growth, step, epoch, sites, sample, None)
    growth.update_leaks(False)


def sawtooth(step: int, period: int) -> int:
    """What a chain the program evaluates every ``period`` steps retains: one buffer a step."""
    return step % period


# --------------------------------------------------------------------------- a leak


def test_a_chain_growing_k_a_step_reads_k_at_its_site():
    growth = Growth()
    for step in SCHEDULE:
        read(growth, step, {SITE: tally({"0": 3 * step}), OTHER: tally({}, held=40)})
    assert growth.known
    assert growth.rate == pytest.approx(3.0)
    (leak,) = growth.leaks
    assert (leak.site, leak.buffers, leak.sawtooth, leak.cut) == (SITE, HELD + 3 * 486, False, False)
    assert leak.buffers_per_step == pytest.approx(3.0)
    assert growth.bounded == ()
    assert growth.site_buffers() == {SITE: HELD + 3 * 486, OTHER: 40}


def test_growth_in_evaluated_arrays_is_a_leak_too():
    # A program keeping one more evaluated array a step (a list of tokens): no chain, held grows.
    growth = Growth()
    for step in SCHEDULE:
        read(growth, step, {SITE: tally({}, held=HELD + 2 * step)})
    assert growth.rate == pytest.approx(2.0)
    assert [(leak.site, leak.buffers_per_step) for leak in growth.leaks] == [(SITE, pytest.approx(2.0))]


def test_nothing_growing_reads_zero_and_no_site():
    growth = Growth()
    for step in SCHEDULE:
        read(growth, step, {SITE: tally({"0": 5}), OTHER: tally({}, held=40)})
    assert growth.known and growth.rate == 0.0
    assert growth.leaks == () and growth.bounded == ()


def test_a_jump_between_two_sets_of_caches_is_no_growth():
    # Within each set of caches the site grows 3 a step; a request joining adds 500 at once.
    growth = Growth()
    for step in range(0, 400, 10):
        epoch = int(step >= 200)
        read(growth, step, {SITE: tally({"0": 3 * step}, held=HELD + 500 * epoch)}, epoch)
    assert growth.rate == pytest.approx(3.0)
    assert growth.leaks[0].buffers_per_step == pytest.approx(3.0)


# --------------------------------------------------------------------------- sawtooths

PERIOD = 50
STRIDE = 7  # readings every 7 steps: the phase drifts through every tooth
STEPS = range(0, STRIDE * SAMPLE_WINDOW, STRIDE)  # 0 .. 441: the window holds them all
FIRST_CUT_SEEN = 56  # the first reading after the program's first evaluation (step 50)


def test_a_sawtooth_is_bounded_with_its_peak_and_no_rate():
    growth = Growth()
    for step in STEPS:
        read(growth, step, {SITE: tally({"0": sawtooth(step, PERIOD), "1": sawtooth(step, PERIOD)})})
        if step < FIRST_CUT_SEEN:  # no cut seen yet: growing chains are a leak
            assert growth.rate == pytest.approx(2.0 if step else 0.0), step
        else:
            assert (growth.rate, growth.leaks) == (0.0, ()), step
            assert [b.site for b in growth.bounded] == [SITE]
    (bounded,) = growth.bounded
    last = STEPS[-1]
    # The readings fall at every phase: one at phase 49 (step 49, 399), the top of a tooth.
    assert bounded.peak_buffers == HELD + 2 * (PERIOD - 1)
    assert bounded.buffers == HELD + 2 * sawtooth(last, PERIOD)
    assert bounded.cuts == last // PERIOD  # every evaluation the program made: one fall each
    assert growth.peak_excess == 2 * (PERIOD - 1 - sawtooth(last, PERIOD))


def test_a_leak_beside_a_sawtooth_at_one_site_reads_the_chain_never_cut():
    growth = Growth()
    for step in STEPS:
        chains = {"0": sawtooth(step, PERIOD), "1": sawtooth(step, PERIOD), "2": step}
        read(growth, step, {SITE: tally(chains)})
        if step >= FIRST_CUT_SEEN:
            assert growth.rate == pytest.approx(1.0), step
    (leak,) = growth.leaks
    assert (leak.site, leak.sawtooth) == (SITE, True)
    assert leak.buffers_per_step == pytest.approx(1.0)
    assert growth.bounded == ()


def test_peaks_that_grow_are_a_leak():
    # The program evaluates its chain every 50 steps and keeps one more evaluated array each
    # time: every tooth starts 1 buffer higher, 1 / 50 a step over the long run.
    growth = Growth()
    for step in STEPS:
        read(growth, step, {SITE: tally({"0": sawtooth(step, PERIOD)}, held=HELD + step // PERIOD)})
    # A staircase of one step in 50, read at a stride of 7: its Theil-Sen slope is within 2%.
    assert growth.rate == pytest.approx(1 / PERIOD, rel=0.02)
    (leak,) = growth.leaks
    assert leak.sawtooth and leak.buffers_per_step == pytest.approx(1 / PERIOD, rel=0.02)


# --------------------------------------------------------------------------- one chain


def chain_reading(readings: list[tuple[int, float, bool]]) -> tuple[Chain, list[bool]]:
    (step, retained, walked), *rest = readings
    chain = Chain(None, retained, step, step)
    cuts = [chain.read(step, retained, walked)]
    cuts += [chain.read(*reading) for reading in rest]
    return chain, cuts


def test_a_cut_is_a_fall_between_two_walks():
    chain, cuts = chain_reading(
        [
            (0, 10, True),
            (5, 20, True),
            (6, 20 - (CUT_BUFFERS - 1), True),  # a wobble: a buffer shared with another chain
            (7, 22, False),  # an estimate from its site's gains
            (8, 25, True),
            (9, 3, True),  # walked both times, fell by more than a quarter: the program cut it
        ]
    )
    assert cuts == [False, False, False, False, False, True]
    assert (chain.cuts, chain.peak, chain.longest, chain.start) == (1, 25, 9, 9)
    assert chain.excess == 25 - 3


def test_a_walk_is_read_against_the_chains_last_walk_whatever_the_estimates_between():
    # A sampled reading walks a site's chains in turn: the walk before this one was readings ago.
    chain, cuts = chain_reading([(0, 10, True), (5, 30, True), (6, 33, False), (7, 36, False), (8, 12, True)])
    assert cuts == [False, False, False, False, True]
    assert (chain.cuts, chain.peak, chain.start) == (1, 36, 8)


def test_an_estimate_that_falls_is_a_cut():
    # Estimated from its site's longest chain, walked at every reading: that chain was seen cut.
    chain, cuts = chain_reading([(0, 10, True), (5, 30, True), (6, 5, False), (7, 6, True)])
    assert cuts == [False, False, True, False]  # the walk after it: against walks since the cut
    assert (chain.cuts, chain.peak, chain.start) == (1, 30, 6)


def test_a_chain_no_longer_cut_is_a_leak_again():
    # Cut every 10 steps up to step 30 (peak 9), then never again: 1 buffer a step from there on.
    readings = [(step, float(step % 10), True) for step in range(1, 31)]
    chain, _ = chain_reading(readings)
    assert (chain.cuts, chain.peak, chain.longest) == (3, 9, 10)
    overdue_at = None
    for step in range(31, 300):
        chain.read(step, float(step - 30), True)
        if not chain.cuts:
            overdue_at = step
            break
    # Overdue at the first step whose tooth is longer than OVERDUE times the longest (10 steps:
    # past step 70) and whose chain retains more than OVERDUE times the peak (9: past step 66).
    assert OVERDUE == 4 and overdue_at == 71
    assert chain.readings >= OVERDUE_READINGS


# --------------------------------------------------------------------------- kept caches

WIDTH = 40  # steps a request takes
LEFT = 100  # buffers each finished request's kept caches hold
KEPT_STEPS = 16  # a cache is known kept this many steps after its last forward


def kept_at(step: int, requests: int) -> tuple[int, int | None]:
    """Buffers kept at ``step``, and the last forward of the newest kept cache."""
    known = [k for k in range(1, requests + 1) if WIDTH * k + KEPT_STEPS <= step]
    return LEFT * len(known), (WIDTH * known[-1] if known else None)


def test_kept_caches_read_the_buffers_each_request_left_over_its_steps():
    # Readings every 24 steps: a request's caches are seen kept 16 to 39 steps after its last
    # forward, each rise is placed at that forward.
    series = KeptSeries()
    readings = range(0, 16 * WIDTH, 24)
    rates = {}
    for step in readings:
        buffers, since = kept_at(step, requests=6)
        series.add(step, buffers, since)
        rates[step] = series.slope()
    # The reading at which each request from the third on is first seen kept.
    seen = [min(s for s in readings if s >= WIDTH * k + KEPT_STEPS) for k in range(3, 7)]
    assert len(set(s - WIDTH * k for s, k in zip(seen, range(3, 7)))) > 1  # delays that differ
    for step in seen:
        assert rates[step] == pytest.approx(LEFT / WIDTH), step
    after = [rates[step] for step in rates if step > seen[-1] + WIDTH]
    assert after and all(b < a for a, b in zip(after, after[1:]))  # nothing more kept: it falls
    assert after[-1] < LEFT / WIDTH / 2


def test_kept_caches_are_a_leak_site_and_the_rate():
    growth = Growth()
    kept = SITE + KEPT_MARK
    for step in range(0, 7 * WIDTH + KEPT_STEPS + 1, 8):
        buffers, since = kept_at(step, requests=7)
        sites = {SITE: tally({}), kept: tally({}, held=buffers)} if buffers else {SITE: tally({})}
        record(growth, step, step // WIDTH, sites, PARAMETERS + HELD, None, kept=buffers, kept_since=since)
        growth.update_leaks(False)
    assert growth.rate == pytest.approx(LEFT / WIDTH)
    assert [(leak.site, leak.buffers) for leak in growth.leaks] == [(kept, 7 * LEFT)]
    # The site's own series places its first stair after its reading of nothing (step 48), not at
    # the request's last forward (step 40): within 5% after 7 stairs.
    assert growth.leaks[0].buffers_per_step == pytest.approx(LEFT / WIDTH, rel=0.05)


# --------------------------------------------------------------------------- fix mode


def test_fix_mode_probes_read_what_the_fix_cuts():
    # The fix evaluates the site's chains, so its readings stay flat; each probe waits 2 steps,
    # in which the site grows 8 a step.
    growth = Growth()
    for start in range(0, 200, 20):
        before = {SITE: HELD + 5.0}
        record(growth, start, 0, {SITE: tally({"0": 5})}, PARAMETERS + HELD + 5, None, fixing=True)
        probe = Probe(start, before, start + 2)
        record(growth, start + 2, 0, {SITE: tally({"0": 5 + 16})}, None, probe, fixing=True)
        growth.update_leaks(True)
    assert growth.probed == pytest.approx(8.0)
    assert growth.growing == {SITE}
    (leak,) = growth.leaks
    assert (leak.site, leak.cut) == (SITE, True)
    assert leak.buffers_per_step == pytest.approx(8.0)
    assert growth.rate == 0.0  # what stays resident under the fix: flat


def test_a_site_the_program_drains_is_no_leak_under_the_fix():
    growth = Growth()
    for i, start in enumerate(range(0, 200, 20)):
        gained = -6 if i == 3 else 16  # once seen shrinking: it drains itself
        record(growth, start, 0, {SITE: tally({"0": 20})}, PARAMETERS + HELD + 20, None, fixing=True)
        probe = Probe(start, {SITE: HELD + 20.0}, start + 2)
        record(growth, start + 2, 0, {SITE: tally({"0": 20 + gained})}, None, probe, fixing=True)
        growth.update_leaks(True)
    assert growth.sites[SITE].probed_rate() == 0.0
    assert growth.leaks == () and growth.growing == set()
