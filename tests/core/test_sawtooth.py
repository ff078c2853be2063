"""A sawtooth is no leak: a program that evaluates its cache state every N steps leaves chains that
grow and are cut, over and over. Its peaks decide: peaks that do not grow read 0/step, no leak site,
the site marked bounded, the headroom counted from the peak and no stop; peaks that grow read their
growth. Checked against the exact live-buffer count.

The program here is mlx-vlm 0.7.10's ``BatchGenerator`` cadence (``mlx_vlm/generate/ar.py``,
``BatchGenerator._next``): after each decode step, every ``MLX_VLM_BATCH_CACHE_EVAL_INTERVAL``
(default 50) steps, ``mx.eval([c.state for c in prompt_cache])`` then ``mx.clear_cache()``. Its
caches are mlx-lm's own ``ArraysCache``, whose ``advance`` rebinds ``left_padding`` to a pending
array each step (the attribute ``state`` returns, so the eval cuts it). The watchdog runs with its
default options on a clock where a decode step takes 1/61 s (a walk every ~31 steps once the
dense walks are done, at phases that drift through the sawtooth, as on a real decode). Where
mlx-vlm 0.7.10 is installed (the peer servers' environment under ``~/.cache/mlx-watchdog/peers``),
its source is read to check that this is its cadence.
"""

from __future__ import annotations

import ast
import math
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache
from support import cpu_load

from mlx_watchdog import Watchdog
from mlx_watchdog.core import sampling

SITE = "ArraysCache.left_padding"
STEP_SECONDS = 1 / 61  # a decode step on the watchdog's clock: 0.5 s of decode is ~31 steps
WALK_STEPS = 31  # steps between two walks once the dense ones are done
LIMIT = 100_000


def make_caches(n):
    caches = [ArraysCache(2, left_padding=[1, 0]) for _ in range(n)]
    for c in caches:
        c[0] = mx.zeros((2, 4))
    mx.eval([c.state for c in caches])
    return caches


def decode(wd, clock, counter, caches, evaluated, interval, steps, on_step=None):
    """``steps`` decode steps of mlx-vlm's BatchGenerator over ``caches``: each advances every
    cache, and every ``interval`` steps the state of ``evaluated`` is evaluated and MLX's cache
    cleared. Returns the exact live count after each step, from before the caches were made."""
    live = []
    for n in range(1, steps + 1):
        clock.now += STEP_SECONDS
        wd.observe(caches)
        for c in caches:
            c.advance(1)
        if n % interval == 0:
            mx.eval([c.state for c in evaluated])
            mx.clear_cache()
        live.append(counter.live())
        if on_step is not None:
            on_step(n)
    return live


def exact_peaks(live):
    """(step, count) of each peak of the exact count: the last step before it drops."""
    return [(n, live[n - 1]) for n in range(1, len(live)) if live[n] < live[n - 1]]


def peak_growth(peaks):
    """Per step, the growth of the peaks (Theil-Sen, as the truth needs no robustness: exact)."""
    slopes = [(b - a) / (t - s) for i, (s, a) in enumerate(peaks) for t, b in peaks[i + 1 :]]
    return statistics.median(slopes)


@pytest.fixture
def clock(fake_clock):
    """All the watchdog's time (conftest's fake_clock): a decode step takes STEP_SECONDS, and
    walks take no time of it, on any machine."""
    return fake_clock


@pytest.mark.parametrize("interval", [8, 50, 256])
def test_a_bounded_sawtooth_reads_no_leak_and_its_peak(counter, clock, interval):
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    caches = make_caches(2)
    wd = Watchdog(limit=LIMIT)
    seen = {}

    def check(n):
        f = wd.forecast()
        if not seen and f.bounded:
            seen["bounded"] = n
            wd.stop_within = 1e12  # from here any growth read at all would stop it
        if seen:
            assert f.buffers_per_step == 0 and f.leaks == (), (n, f.describe())
            assert math.isinf(f.steps_to_limit), (n, f.describe())

    live = decode(wd, clock, counter, caches, caches, interval, max(1500, 12 * interval), check)
    live = [x - base for x in live]
    peaks = exact_peaks(live)
    assert len({count for _, count in peaks}) == 1  # the truth: the peaks do not grow
    f = wd.forecast()
    (site,) = f.bounded
    assert site.site == SITE and site.cuts >= 1
    assert seen["bounded"] <= 64 + interval + 2 * WALK_STEPS  # the first cut read, within two walks after it
    assert wd.stops["forecast"] == 0
    # The headroom is counted from the peak: what the readings saw of it, within one walk's rise
    # (two buffers a step) below the exact peak.
    peak = peaks[0][1]
    assert peak - 2 * WALK_STEPS <= f.peak_resident_buffers <= peak
    assert f.peak_resident_buffers >= f.resident_buffers
    assert "bounded: " + SITE in f.describe()


@pytest.mark.parametrize("interval", [8, 50, 256])
def test_a_sawtooth_whose_peaks_grow_reads_their_growth(counter, clock, interval):
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    caches = make_caches(3)
    wd = Watchdog(limit=LIMIT)
    # The program evaluates two of the three caches: its peaks grow a buffer a step.
    live = decode(wd, clock, counter, caches, caches[:2], interval, max(1500, 10 * interval))
    live = [x - base for x in live]
    truth = peak_growth(exact_peaks(live)[-8:])
    assert truth == pytest.approx(1.0, abs=0.05)
    f = wd.forecast()
    assert f.bounded == ()
    (leak,) = f.leaks
    assert leak.site == SITE
    if 2 * interval > WALK_STEPS:
        # The readings see the cuts: between two of them the uncut chain adds less than a cut
        # takes. (Every 8 steps, 2 x 8 buffers cut against 31 added, no reading sees a drop: a leak.)
        assert leak.sawtooth
    assert leak.buffers_per_step == pytest.approx(truth, rel=0.15)
    assert f.buffers_per_step == pytest.approx(truth, rel=0.15)
    assert math.isfinite(f.steps_to_limit)


def test_a_leak_the_program_never_cuts_is_read_as_fast_as_before(counter, clock):
    """No cut, no sawtooth: a chain that only grows is a leak from its first readings."""
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    caches = make_caches(2)
    wd = Watchdog(limit=LIMIT)
    read = {}

    def check(n):
        f = wd.forecast()
        if "at" not in read and f.leaks:
            read["at"] = n

    live = decode(wd, clock, counter, caches, [], 10**9, 200, check)
    assert read["at"] <= 4  # the dense walks at steps 2 and 3 read it
    f = wd.forecast()
    assert f.bounded == () and not f.leaks[0].sawtooth
    truth = (live[-1] - live[99]) / 100
    assert f.buffers_per_step == pytest.approx(truth, rel=0.02)
    del base


def test_a_bounded_sawtooth_stays_bounded_while_requests_come_and_go(counter, clock):
    """A busy batch: every 37 steps a request leaves and another joins (a new epoch each time:
    the level moves). The program goes on cutting the caches that stay: no leak is read."""
    caches = make_caches(3)
    wd = Watchdog(limit=LIMIT)
    after = []

    def check(n):
        if n % 37 == 0:
            caches[:] = caches[1:] + make_caches(1)
        f = wd.forecast()
        if f.bounded or after:
            after.append(bool(f.leaks) or f.buffers_per_step > 0)

    live = decode(wd, clock, counter, caches, caches, 50, 1500, check)
    del live
    assert len(after) > 1300 and not any(after)  # bounded from its first cuts on, through 40 joins
    assert wd.forecast().bounded[0].site == SITE


def test_a_sawtooth_the_program_stops_cutting_is_a_leak_again(counter, clock):
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    caches = make_caches(2)
    wd = Watchdog(limit=LIMIT)
    read = {}

    def check(n):
        f = wd.forecast()
        if f.bounded and "bounded" not in read:
            read["bounded"] = n
        if n > 600 and f.leaks and "leak" not in read:
            read["leak"] = n

    evaluated = list(caches)

    def stop_cutting(n):
        check(n)
        if n == 600:
            evaluated.clear()  # the program evaluates nothing from here on

    live = decode(wd, clock, counter, caches, evaluated, 50, 2500, stop_cutting)
    live = [x - base for x in live]
    assert read["bounded"] <= 64 + 50 + 2 * WALK_STEPS
    # Read again as a leak once a tooth has gone on 4 times longer than any seen, over 8 readings.
    assert read["leak"] <= 600 + 4 * 2 * 50 + 8 * WALK_STEPS
    truth = (live[-1] - live[-501]) / 500
    assert truth == pytest.approx(2.0)
    f = wd.forecast()
    assert f.bounded == () and f.leaks[0].site == SITE and not f.leaks[0].sawtooth
    assert f.buffers_per_step == pytest.approx(truth, rel=0.1)


# --------------------------------------------------------------------------- mlx-vlm's own cadence


def installed_mlx_vlm_batch_generator() -> Path | None:
    """mlx-vlm's ``generate/ar.py`` in the peer servers' environment, where it was built."""
    root = Path(
        os.environ.get("MLX_WATCHDOG_PEERS_CACHE") or Path.home() / ".cache" / "mlx-watchdog" / "peers"
    )
    found = sorted(root.glob("*/lib/python*/site-packages/mlx_vlm/generate/ar.py"))
    return found[-1] if found else None


def test_the_cadence_reproduced_is_mlx_vlm_s_own():
    """Read, not imported (importing mlx-vlm takes half a minute): its BatchGenerator evaluates the
    state of every cache of the batch every 50 steps, after the step, then clears MLX's cache."""
    source = installed_mlx_vlm_batch_generator()
    if source is None:
        message = (
            "mlx-vlm is not installed here (the peer servers' environment under "
            "~/.cache/mlx-watchdog/peers): its BatchGenerator's cadence is not checked against its source"
        )
        print(f"\n*** WARNING: {message} ***", file=sys.stderr)
        warnings.warn(message, stacklevel=1)
        pytest.skip(f"*** {message} ***")
    text = source.read_text(encoding="utf-8")
    tree = ast.parse(text)
    default = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["DEFAULT_CACHE_EVAL_INTERVAL"]
    )
    assert default == 50
    (generator,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BatchGenerator"]
    (step,) = [n for n in generator.body if isinstance(n, ast.FunctionDef) and n.name == "_next"]
    code = ast.get_source_segment(text, step)
    decoded = code.index("self._generation_batch.next()")
    due = re.search(r"self\._steps_counter % self\._cache_eval_interval == 0", code)
    assert due is not None and due.start() > decoded  # after the decode step
    evaluated = code.index("mx.eval(", due.end())
    assert "c.state for c in self._generation_batch.prompt_cache" in code[evaluated:]
    assert code.index("mx.clear_cache()", evaluated) > evaluated


# --------------------------------------------------------------------------- a leak beside a sawtooth


class Mixed:
    """One cache object: a chain the program evaluates every ``period`` steps (a sawtooth) and a
    counter rebound each step and never evaluated (a leak, a buffer a step). ``layout``
    "attributes": two attributes, two sites; "one site": both in one list attribute."""

    def __init__(self, layout):
        self.layout = layout
        self.rows, self.tick = mx.zeros((1, 4)), mx.array(0)
        mx.eval(self.rows, self.tick)
        if layout == "one site":
            self.state = [self.rows, self.tick]
            del self.rows, self.tick

    def advance(self):
        if self.layout == "one site":
            rows, tick = self.state
            self.state = [mx.concatenate([rows[:, -4:], mx.ones((1, 1))], axis=1), tick + 1]
        else:
            self.rows = mx.concatenate([self.rows[:, -4:], mx.ones((1, 1))], axis=1)
            self.tick = self.tick + 1

    def cut(self):
        mx.eval(self.state[0] if self.layout == "one site" else self.rows)


def decode_mixed(counter, clock, layout, period, steps, step_seconds, caches=1):
    """``steps`` steps over ``caches`` Mixed caches, the sawtooth cut every ``period``; a step
    takes ``step_seconds`` on the watchdog's clock (the fake one, or time.sleep where ``clock`` is
    None). Returns the watchdog, the exact live count after each step and the forecasts by step."""
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    mixed = [Mixed(layout) for _ in range(caches)]
    wd = Watchdog(limit=LIMIT, export=False)
    live, forecasts = [], {}
    for n in range(1, steps + 1):
        if clock is None:
            time.sleep(step_seconds)
        else:
            clock.now += step_seconds
        wd.observe(mixed)
        for c in mixed:
            c.advance()
        if n % period == 0:
            for c in mixed:
                c.cut()
        live.append(counter.live() - base)
        forecasts[n] = wd.forecast()
    return wd, live, forecasts


def verdicts(forecasts, first, last):
    """(rate, leak sites, bounded sites) at each step from ``first`` to ``last``."""
    return {
        n: (f.buffers_per_step, tuple(leak.site for leak in f.leaks), tuple(site.site for site in f.bounded))
        for n, f in forecasts.items()
        if first <= n <= last
    }


def assert_reads(forecasts, first, last, rate, leaks, bounded):
    """Every forecast from ``first`` to ``last``: the rate within 5%, those leak and bounded sites."""
    for n, (read, read_leaks, read_bounded) in verdicts(forecasts, first, last).items():
        assert read == pytest.approx(rate, rel=0.05, abs=1e-3), (n, forecasts[n].describe())
        assert (read_leaks, read_bounded) == (leaks, bounded), (n, forecasts[n].describe())


def expected(layout, caches):
    leak, cut = ("Mixed.tick", "Mixed.rows") if layout == "attributes" else ("Mixed.state", None)
    return float(caches), (leak,), (cut,) if cut else ()


@pytest.mark.mlx_lm_neutral
@pytest.mark.parametrize("layout", ["attributes", "one site"])
@pytest.mark.parametrize("period", [8, 50])
def test_a_leak_beside_a_sawtooth_in_one_object_reads_its_own_rate_and_site(counter, clock, layout, period):
    wd, live, forecasts = decode_mixed(counter, clock, layout, period, 1000, STEP_SECONDS)
    truth = (live[-1] - live[-1 - 10 * period]) / (10 * period)  # the exact count over whole periods
    assert truth == pytest.approx(1.0)
    # From two periods on (and past the dense walks), every forecast: the leak's own rate, the leak
    # named, the sawtooth never a leak.
    assert_reads(forecasts, max(2 * period, 65), 1000, *expected(layout, 1))


@pytest.mark.mlx_lm_neutral
@pytest.mark.parametrize("layout", ["attributes", "one site"])
@pytest.mark.parametrize("step_seconds", [1 / 61, 1 / 500])
def test_a_period_of_256_is_judged_within_two_periods_whatever_the_step_takes(
    counter, clock, layout, step_seconds
):
    """oMLX evaluates its caches' offset every 256 steps. Four caches, each with a counter beside
    it: judged by step 512 (two periods), the same verdict at a step of 16 ms and of 2 ms."""
    wd, live, forecasts = decode_mixed(counter, clock, layout, 256, 1000, step_seconds, caches=4)
    assert wd.internal_errors == 0
    assert (live[-1] - live[-513]) / 512 == pytest.approx(4.0)  # the truth, over two periods
    assert_reads(forecasts, 512, 1000, *expected(layout, 4))


@pytest.mark.mlx_lm_neutral
@pytest.mark.parametrize("step_seconds", [1 / 61, 1 / 500])
def test_a_bounded_period_of_256_is_never_a_leak(counter, clock, step_seconds):
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    caches = make_caches(4)
    wd = Watchdog(limit=LIMIT, export=False)
    forecasts = {}
    live = decode(
        wd, clock, counter, caches, caches, 256, 1000, lambda n: forecasts.setdefault(n, wd.forecast())
    )
    live = [x - base for x in live]
    assert len({count for _, count in exact_peaks(live)}) == 1  # the truth: the peaks do not grow
    assert_reads(forecasts, 512, 1000, 0.0, (), (SITE,))


@pytest.mark.mlx_lm_neutral
@pytest.mark.parametrize("layout", ["attributes", "one site"])
@pytest.mark.parametrize("step_seconds", [1 / 61, 1 / 500])
def test_a_period_of_256_read_by_samples_is_judged_within_two_periods(
    counter, clock, monkeypatch, layout, step_seconds
):
    """At the crash scale, or on a machine where a node costs more, a reading walks each kind of
    chain's longest one and the others in turn, and estimates the rest from that chain's gains. A
    stall bound of 1 ms makes every reading here a sample (at the first estimate of a node's cost:
    the fake clock measures none). Before, a cut was read only between two readings that both
    walked a chain: the sawtooth read as a leak (+5 to +7/step against the truth's 4) at most
    steps, and failed CI on the real clock where a loaded machine's walks were samples. With the
    chain and the counter in one list (one site), the chains were estimated from the counter's
    gains, never cut: 1/step against 4, or 0 and bounded; now each position of the list is a kind
    of its own (sampling.kinds), judged from the first walk after step 512."""
    monkeypatch.setattr(sampling, "STALL_SECONDS", 0.001)
    wd, live, forecasts = decode_mixed(counter, clock, layout, 256, 1000, step_seconds, caches=4)
    assert (live[-1] - live[-513]) / 512 == pytest.approx(4.0)  # the truth, over two periods
    assert all(forecasts[n].sampled for n in range(512, 1001))  # the readings were samples
    judged = 512 if layout == "attributes" else 520  # (one site: a walk after the cut at 512)
    assert_reads(forecasts, judged, 1000, *expected(layout, 4))


@pytest.mark.mlx_lm_neutral
def test_period_256_on_the_real_clock_beside_two_busy_processes(counter):
    """No fake clock: walks by decode time come when the machine allows, the walks at steps
    counted from the decode's start first in the budget. Judged before step 1,000."""
    with cpu_load():
        wd, live, forecasts = decode_mixed(counter, None, "attributes", 256, 1000, 0.002, caches=4)
    assert (live[-1] - live[-513]) / 512 == pytest.approx(4.0)
    assert wd.internal_errors == 0
    assert_reads(forecasts, 990, 1000, *expected("attributes", 4))
