"""The process-wide buffer count (``mlx_watchdog.core.process_count``), against the exact count.

The truth is ``exact_buffers`` (tests/exact_buffers.c: its own hook on MLX's allocator, a set of
live pointers, read after ``mx.synchronize()``), never the product's own numbers. The promises:
both counts grow alike; a leak outside the caches (a server's own per-step outputs, kept lazily)
is read at its rate, as growth no named site explains, where the walk alone reads none; a
leak-free decode reads none; a failed self-check turns the count off, says why once, and the
watchdog works on without it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from support import Scheduler

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.core import process_count
from mlx_watchdog.core.forecast import UNATTRIBUTED_THRESHOLD
from mlx_watchdog.exporters.prometheus import WatchdogCollector
from mlx_watchdog.tiny import build_model

pytestmark = pytest.mark.mlx_lm_neutral  # MLX's allocator and a generate_step decode, alike on both

STEPS = 400
# The growth outside the caches is read from readings spanning OUTSIDE_SPAN steps, two in each half
# of them; the walks of a decode's first steps are dense (schedule.py: steps 1, 2, 3, 5, ..., 65).
READ_FROM = 2 * process_count.OUTSIDE_SPAN + 32
PROMPT = mx.array(list(range(1, 17)))
UNATTRIBUTED_METRIC = "mlx_watchdog_unattributed_buffers_per_step"


class Offset:
    """A cache whose offset is rebound each step and never evaluated: a buffer a step."""

    def __init__(self):
        self.offset = mx.array(0)
        mx.eval(self.offset)

    def advance(self) -> None:
        self.offset = self.offset + 1


def decode(counter, wd: Watchdog, leak: bool, scrape=None) -> tuple[float, list]:
    """A tiny llama (leak-free: its KV cache is evaluated every step) decoded by ``generate_step``
    under ``watch_model``, with the scheduler's two chains beside it when ``leak``. Returns the
    exact count's growth per step (between the decode's fifth and last steps) and the forecasts
    once the rate was known; ``scrape()`` is called at the last step."""
    model = build_model("llama", layers=4)
    watch_model(model, wd)
    scheduler = Scheduler()
    marks, forecasts = [], []
    try:
        cache = make_prompt_cache(model)
        for i, (token, logprobs) in enumerate(
            generate_step(PROMPT, model, prompt_cache=cache, max_tokens=STEPS)
        ):
            if leak:
                scheduler.step(token, logprobs)
            if i in (STEPS // 5, STEPS - 2):
                marks.append((wd.steps, counter.live()))
            f = wd.forecast()
            if f.rate_known and f.step >= READ_FROM:
                forecasts.append(f)
            if i == STEPS - 2 and scrape is not None:
                scrape()
    finally:
        unwatch_model(model)
    (s0, n0), (s1, n1) = marks
    return (n1 - n0) / (s1 - s0), forecasts


def metric(wd: Watchdog, name: str) -> float:
    [family] = [family for family in WatchdogCollector([wd]).collect() if family.name == name]
    [sample] = family.samples
    return sample.value


def test_the_count_grows_as_the_exact_count_does(counter):
    reader, why = process_count.counter(True)
    assert reader is not None, why
    mx.synchronize()
    start, truth = reader.raw(), counter.live()
    kept = []
    for i in range(50):  # evaluated arrays, lazy chains, an empty array, temporaries freed
        a = mx.arange(i + 1, dtype=mx.float32) * 2
        if i % 3 == 0:
            mx.eval(a)
        kept.append(a)
    kept.append(mx.zeros((0,)))
    mx.eval(kept[::2])
    mx.synchronize()
    grown = counter.live() - truth
    assert grown >= 50
    assert reader.raw() - start == grown
    del kept, a
    mx.synchronize()
    assert reader.raw() - start == counter.live() - truth


def test_a_leak_outside_the_caches_is_read_at_its_rate_as_unattributed(counter):
    # Readings every 0.1 s of decode (0.5 s by default): on a busy machine a good share of them
    # carry a step still computing, and the floor the rate is read from needs clean ones around it.
    wd = Watchdog(limit=200_000, export=False, process_count=True, walk_interval=0.1)
    scraped = []
    true_rate, forecasts = decode(
        counter, wd, leak=True, scrape=lambda: scraped.append(metric(wd, UNATTRIBUTED_METRIC))
    )
    assert true_rate == pytest.approx(2.0, abs=0.05)  # the two chains, a buffer each a step
    assert len(forecasts) > STEPS // 2, "the rate was known late, or never"
    for f in forecasts:
        assert f.source == "process" and f.process_count_off is None
        assert f.buffers_per_step == pytest.approx(true_rate, rel=0.15), f
        assert f.leaks == ()  # no named site: the cache is evaluated every step
        assert f.unattributed_buffers_per_step == pytest.approx(true_rate, rel=0.15), f
    assert "unattributed +" in forecasts[-1].describe()
    assert scraped and scraped[0] == pytest.approx(true_rate, rel=0.15)


def test_between_walks_the_resident_count_moves_as_the_exact_count_does(counter, fake_clock):
    """A busy server's caches change between walks (a request's caches join, finished ones die):
    with the count, the resident count follows at each step, not at the next walk. Before, it was
    the last reading plus the growth read (a busy serve --fix: 112-372 under the exact count, a
    request's caches made after the walk and the finished ones' subtracted)."""
    cache = Offset()
    wd = Watchdog(limit=200_000, export=False, process_count=True, walk_interval=1000)
    held: list[mx.array] = []  # what the program holds outside the cache: never walked
    rows = []  # (step, resident, exact, walked at this step)
    for n in range(1, 96):
        fake_clock.now += 1 / 61
        walks = wd.walks
        wd.observe(cache)  # the entry of a step: read there, as the count stood then
        rows.append((n, wd.forecast().resident_buffers, counter.live(), wd.walks > walks))
        cache.advance()
        if n == 70:  # a request joins: its arrays
            held = [mx.arange(i + 1) for i in range(30)]
            mx.eval(held)
        if n == 80:  # two thirds of them die
            del held[10:]
    last_walk = max(n for n, *_, walked in rows if walked)
    assert last_walk < 70  # the changes came between walks (the dense ones end at step 65)
    (at, resident0, exact0, _) = rows[last_walk - 1]
    moved = [(n, resident - resident0, exact - exact0) for n, resident, exact, _ in rows[last_walk:]]
    assert [n for n, read, true in moved if abs(read - true) > 1] == [], moved
    assert moved[-1][2] >= 10  # the truth moved: +30, then -20, beside the cache's own growth


def test_the_unattributed_rate_is_not_a_number_until_the_count_has_measured_it(counter, fake_clock):
    """The walk's rate is known within a few steps; the process count's needs readings spanning
    OUTSIDE_SPAN steps. Between the two, the unattributed rate read 0: "no leak outside the
    caches", before anything was measured (a leak there was first alerted on minutes late)."""
    cache = Offset()
    wd = Watchdog(limit=200_000, export=False, process_count=True)
    read = []  # (step, rate known, unattributed, exported)
    for n in range(1, 200):
        fake_clock.now += 1 / 61
        wd.observe(cache)
        cache.advance()
        f = wd.forecast()
        if f.rate_known:
            read.append((n, f.unattributed_buffers_per_step, metric(wd, UNATTRIBUTED_METRIC)))
    assert read, "the walk's rate was never known"
    early = [(n, u, m) for n, u, m in read if n < process_count.OUTSIDE_SPAN]
    late = [(n, u, m) for n, u, m in read if n > 2 * process_count.OUTSIDE_SPAN + 32]
    assert early and all(math.isnan(u) and math.isnan(m) for _, u, m in early), early
    assert late and all(u == 0.0 and m == 0.0 for _, u, m in late), late  # measured: nothing outside
    assert "unattributed" not in wd.forecast().describe()


def test_without_the_count_the_same_leak_reads_no_growth(counter):
    """The blind spot the count is for: the walk reads the caches, and they do not grow."""
    wd = Watchdog(limit=200_000, export=False, process_count=False)
    true_rate, forecasts = decode(counter, wd, leak=True)
    assert true_rate == pytest.approx(2.0, abs=0.05)
    assert forecasts and all(f.buffers_per_step == 0.0 for f in forecasts)
    assert all(f.source == "estimate" and f.unattributed_buffers_per_step == 0.0 for f in forecasts)
    assert forecasts[-1].process_count_off == "off (process_count=False)"


def test_a_leak_free_decode_reads_no_growth(counter, monkeypatch):
    monkeypatch.setenv(process_count.ENV, "auto")  # the default outside this suite (conftest.py)
    wd = Watchdog(limit=200_000, export=False)  # default: on where its self-check passes
    true_rate, forecasts = decode(counter, wd, leak=False)
    assert true_rate == pytest.approx(0.0, abs=0.01)
    assert forecasts and forecasts[0].source == "process"
    for f in forecasts:
        assert f.buffers_per_step < UNATTRIBUTED_THRESHOLD and f.unattributed_buffers_per_step == 0.0, f
    assert "unattributed" not in forecasts[-1].describe()


def test_a_compiled_function_s_entry_per_shape_is_read_as_unattributed(counter):
    """``mx.compile`` keeps one entry per input shape for the process's life, with the constants
    its trace made: a shape a step grows the process, outside any cache."""
    weights = mx.ones((8, 8))
    mx.eval(weights)
    compiled = mx.compile(lambda x: (x @ weights).sum() * 2 + 1)
    wd = Watchdog(limit=200_000, export=False, process_count=True, walk_interval=0, overhead_budget=1.0)

    class Cache:  # a cache that does not grow, for the watchdog to follow
        def __init__(self):
            self.keys = mx.zeros((2, 2))
            mx.eval(self.keys)

    cache, marks = Cache(), []
    for n in range(1, 121):
        wd.observe(cache)
        mx.eval(compiled(mx.ones((n, 8))))
        if n in (20, 119):
            marks.append((wd.steps, counter.live()))
    (s0, n0), (s1, n1) = marks
    true_rate = (n1 - n0) / (s1 - s0)
    f = wd.forecast()
    assert true_rate >= 1  # the entries are real
    assert f.rate_known and f.leaks == ()
    assert f.buffers_per_step == pytest.approx(true_rate, rel=0.15)
    assert f.unattributed_buffers_per_step == pytest.approx(true_rate, rel=0.15)


def test_process_count_takes_true_false_or_auto_and_auto_follows_the_environment(monkeypatch):
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(ValueError, match="process_count"):
            Watchdog(export=False, process_count=bad)
    off = Watchdog(export=False, process_count=False)
    assert off.process_count_off == "off (process_count=False)" and off.forecast().source == "estimate"
    monkeypatch.setenv(process_count.ENV, "off")
    assert Watchdog(export=False).process_count_off == f"off ({process_count.ENV}=off)"
    assert Watchdog(export=False, process_count=True).forecast().source == "process"  # asked for: on
    monkeypatch.setenv(process_count.ENV, "auto")
    assert Watchdog(export=False).forecast().source == "process"


FAILURE = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="LOG %(levelname)s %(message)s")
    import mlx.core as mx
    from mlx_watchdog import Watchdog
    from mlx_watchdog.core import process_count
    if sys.argv[1] == "typeinfo":  # the allocator's class is none the count was checked on
        process_count.ACCEPTED.clear()

    class Cache:
        def __init__(self):
            self.countdown = mx.array(1_000_000)
            mx.eval(self.countdown)

    first = Watchdog(limit=100_000, export=False, process_count=True, walk_interval=0, overhead_budget=1.0)
    second = Watchdog(limit=100_000, export=False)  # "auto": the same failure, not said again
    cache = Cache()
    for _ in range(40):
        first.observe(cache)
        cache.countdown = cache.countdown - 1  # one buffer a step, stranded in the cache
    f = first.forecast()
    print(json.dumps({
        "off": [first.process_count_off, second.process_count_off, f.process_count_off],
        "source": f.source, "rate": f.buffers_per_step, "sites": [leak.site for leak in f.leaks],
        "status": process_count.status(), "errors": first.internal_errors,
    }))
    """
)


@pytest.mark.parametrize(
    "how, reason",
    [
        ("typeinfo", "MLX's allocator is mlx::core::allocator::CommonAllocator"),
        ("compiler", "building the count failed"),
    ],
)
def test_a_failed_self_check_turns_the_count_off_says_why_once_and_the_watchdog_works(tmp_path, how, reason):
    # Nothing built yet; "auto" is auto (the suite's conftest.py turns it off).
    env = dict(os.environ, MLX_WATCHDOG_CACHE_DIR=str(tmp_path / "cache"), MLX_WATCHDOG_PROCESS_COUNT="auto")
    if how == "compiler":
        env["CC"] = "false"  # a compiler that fails
    proc = subprocess.run(
        [sys.executable, "-c", FAILURE, how], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second, in_forecast = result["off"]
    assert reason in first and first == second == in_forecast
    assert result["status"] == f"off: {first}"
    said = [line for line in proc.stderr.splitlines() if "process-wide buffer count is off" in line]
    assert len(said) == 1 and said[0].startswith("LOG WARNING") and reason in said[0], proc.stderr
    # The watchdog works on, from its walk of the caches.
    assert result["source"] == "estimate" and result["errors"] == 0
    assert result["rate"] == pytest.approx(1.0) and result["sites"] == ["Cache.countdown"]
