"""The census (``mlx_watchdog.core.census``): the program's own objects that hold pending arrays
outside the caches, named as sites and read at their rate. Checked against the exact live-buffer
count (tests/exact_buffers.py), never the watchdog's own numbers alone.

The program is what Rapid-MLX's scheduler did (its #2834: the per-step outputs ``_next_tokens``,
``_next_logprobs`` kept as lazy chains, 757 crashes): beside a leak-free decode, an object keeps
each step's token as ``self.history = mx.concatenate([self.history, token])`` and a running
``self.score = self.score + logprobs.max()``, never evaluated. Each chain holds one more buffer a
step; the walk of the caches reads ``+0/step``. The census names both, at their rate; a leak-free
decode under load names nothing; a chain the program evaluates every N steps is bounded, no leak.

The watchdog runs on the fake clock (conftest's ``fake_clock``): a step takes ``STEP_SECONDS``
and a census ``CENSUS_SECONDS`` of the watchdog's time, so when it runs within its budget is
the same on any machine. The census is off in this suite unless a test asks (tests/conftest.py).
"""

from __future__ import annotations

import gc
import inspect
import math
import re
import statistics

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from support import Scheduler

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.core import census, graph, process_count
from mlx_watchdog.exporters.prometheus import WatchdogCollector
from mlx_watchdog.tiny import build_model, tiny_prompts

pytestmark = pytest.mark.mlx_lm_neutral  # the garbage collector's view and generate_step: alike on both

STEPS = 400
STEP_SECONDS = 1 / 61  # a decode step on the watchdog's clock: a walk every ~31 steps after the dense ones
CENSUS_SECONDS = 0.03  # what one census costs on that clock (~100,000 objects here: 20-60 ms)
READ_FROM = 64  # the forecasts checked: from the end of the dense walks on
# The process count measures its growth from readings spanning OUTSIDE_SPAN steps after its first
# (the readings of the first steps left out): by this step at the latest, at walks 0.5 s apart.
MEASURED_BY = 2 * process_count.OUTSIDE_SPAN + 32
PROMPT = mx.array(list(range(1, 17)))


@pytest.fixture
def clock(fake_clock, monkeypatch):
    """The watchdog's time (conftest's fake clock): each observe() STEP_SECONDS after the last, each
    census CENSUS_SECONDS of its own work, walks free."""
    fake_clock.step_each_observe(monkeypatch, STEP_SECONDS)
    real = census.Census.discover

    def charged(self, found):
        fake_clock.work(CENSUS_SECONDS)
        return real(self, found)

    monkeypatch.setattr(census.Census, "discover", charged)
    return fake_clock


def drop_on_eval(counter, array: mx.array) -> int:
    """The buffers evaluating ``array`` frees (exact count): what its pending graph retained, less
    the one buffer its result holds."""
    before = counter.live(collect=True)  # garbage freed meanwhile is no part of the chain
    mx.eval(array)
    return before - counter.live(collect=True)


def decode(counter, wd: Watchdog, scheduler: Scheduler | None, steps: int = STEPS, on_step=None):
    """A tiny llama (leak-free: its KV cache is evaluated every step) decoded by ``generate_step``
    under ``watch_model``, the scheduler's two chains beside it. Returns the exact count's growth
    per step (between the decode's fifth and last steps) and the forecasts from READ_FROM on."""
    model = build_model("llama", layers=4)
    watch_model(model, wd)
    marks, forecasts = [], []
    try:
        cache = make_prompt_cache(model)
        for i, (token, logprobs) in enumerate(
            generate_step(PROMPT, model, prompt_cache=cache, max_tokens=steps)
        ):
            if scheduler is not None:
                scheduler.step(token, logprobs)
            if on_step is not None:
                on_step(i)
            if i in (steps // 5, steps - 2):
                marks.append((wd.steps, counter.live()))
            f = wd.forecast()
            if f.step >= READ_FROM:
                forecasts.append(f)
    finally:
        unwatch_model(model)
    (s0, n0), (s1, n1) = marks
    return (n1 - n0) / (s1 - s0), forecasts


def _line_of(function, text: str) -> int:
    """The line of ``function``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def leak_sites(f) -> dict[str, float]:
    return {leak.site: leak.buffers_per_step for leak in f.leaks}


def named(f, attribute: str) -> list:
    return [
        leak
        for leak in f.leaks
        if census.is_outside_site(leak.site) and leak.site.endswith(f"Scheduler.{attribute}")
    ]


@pytest.mark.parametrize("process_count", [False, True], ids=["walk", "process-count"])
def test_a_scheduler_s_lazy_chains_are_named_at_their_rate(counter, clock, process_count):
    wd = Watchdog(limit=200_000, export=False, census=True, process_count=process_count)
    scheduler = Scheduler()
    true_rate, forecasts = decode(counter, wd, scheduler)
    assert true_rate == pytest.approx(2.0, abs=0.05)  # the truth: the two chains, a buffer each a step
    # Each chain's own truth: what evaluating it frees, per step it was grown.
    per_chain = {
        name: drop_on_eval(counter, getattr(scheduler, name)) / scheduler.steps
        for name in ("history", "score")
    }
    assert per_chain == pytest.approx({"history": 1.0, "score": 1.0}, abs=0.01)
    assert len(forecasts) >= STEPS - READ_FROM - 10
    for f in forecasts:
        for name, truth in per_chain.items():
            [leak] = named(f, name)
            assert leak.buffers_per_step == pytest.approx(truth, rel=0.15), f.describe()
            assert (
                not leak.cut
                and leak.paths
                and all(re.fullmatch(rf"<Scheduler#\d+>\.{name}", p) for p in leak.paths)
            )
        assert f.buffers_per_step == pytest.approx(true_rate, rel=0.15), f.describe()
        # Named: nothing left unexplained (NaN while the process count has not measured it yet).
        unattributed = f.unattributed_buffers_per_step
        assert unattributed == 0.0 or (math.isnan(unattributed) and f.step < MEASURED_BY), f.describe()
        assert "outside:" in f.describe()
    # Where the program rebinds each one: the line of Scheduler.step that does (tests/support.py),
    # found by a one-step probe of its class, which gives the class back as it was.
    lines = {name: _line_of(Scheduler.step, f"self.{name} = ") for name in per_chain}
    for name, line in lines.items():
        [leak] = named(forecasts[-1], name)
        assert leak.source == f"support.py:{line} Scheduler.step", forecasts[-1].describe()
    assert "__setattr__" not in vars(Scheduler)
    # Found by the census at the first walk it was due (step 8 on), within its share of the budget.
    assert 1 <= wd.census.runs <= 3 and wd.census.off is None
    assert wd.census.seconds <= census.SHARE * max(0.01 * wd.steps * STEP_SECONDS, 0.25) + 1e-9
    assert wd.internal_errors == 0 and wd.census.errors == 0


def test_the_sites_are_exported_and_advised_and_never_fixed(counter, clock, caplog):
    wd = Watchdog(limit=200_000, export=False, census=True, fix=True, warn_within=1e9)
    scheduler = Scheduler()
    with caplog.at_level("WARNING", logger="mlx_watchdog"):
        true_rate, forecasts = decode(counter, wd, scheduler)
    f = forecasts[-1]
    sites = {leak.site for leak in f.leaks}
    assert len(sites) == 2 and all(census.is_outside_site(s) for s in sites), f.describe()
    # The fix cuts caches only: the program's chains are still pending, grown every step, and the
    # forecast reads them as growth the fix does not cut.
    assert not graph.is_evaluated(scheduler.history) and not graph.is_evaluated(scheduler.score)
    assert all(not leak.cut for leak in f.leaks)
    assert f.buffers_per_step == pytest.approx(true_rate, rel=0.15)
    families = {family.name: family for family in WatchdogCollector([wd]).collect()}
    exported = {s.labels["site"]: s.value for s in families["mlx_watchdog_leak_buffers_per_step"].samples}
    assert set(exported) == sites and all(v == pytest.approx(1.0, rel=0.15) for v in exported.values())
    warned = [r.getMessage() for r in caplog.records if "resource limit forecast" in r.getMessage()]
    assert warned and all(s in warned[-1] for s in sites) and "evaluate it where" in warned[-1]
    assert census.advice(f.leaks).startswith(f.leaks[0].site)


def test_without_the_census_the_same_chains_read_no_growth(counter, clock):
    """The blind spot the census is for (the process count off, as by default in this suite)."""
    wd = Watchdog(limit=200_000, export=False, census=False)
    true_rate, forecasts = decode(counter, wd, Scheduler(), steps=200)
    assert true_rate == pytest.approx(2.0, abs=0.05)
    assert forecasts and all(f.buffers_per_step == 0.0 and f.leaks == () for f in forecasts)
    assert wd.census.runs == 0 and wd.census.off == "off (census=False)"


class Server:
    """A leak-free server's own state: each request's last log-probabilities, evaluated, in a dict;
    its running total of tokens, evaluated every step; and a lazy value rebound every step to a
    maximum of the step's log-probabilities (one buffer behind it, never more)."""

    def __init__(self):
        self.last = {}
        self.tokens = mx.array(0)
        self.peak = mx.array(0.0)
        mx.eval(self.tokens, self.peak)

    def step(self, responses) -> None:
        for r in responses:
            mx.eval(r.logprobs)
            self.last[r.uid] = r.logprobs
            if r.finish_reason is not None:
                del self.last[r.uid]
        self.tokens = self.tokens + len(responses)
        mx.eval(self.tokens)
        self.peak = responses[0].logprobs.max()


def test_a_leak_free_server_under_load_names_no_outside_site(counter, clock):
    """Overlapping generations (BatchGenerator: requests join as others finish, the batch never
    empties) on a leak-free llama, and the server's own arrays: evaluated ones, and a lazy value
    that does not grow. The exact count is flat; no outside site is named a leak."""
    model = build_model("llama", layers=4)
    wd = Watchdog(limit=200_000, export=False, census=True)
    watch_model(model, wd)
    server = Server()
    prompts = tiny_prompts(16, 6, 256, seed=3)
    lengths = [60, 90, 75, 120, 50, 80, 110, 70, 95, 65, 85, 100, 55, 105, 90, 70]
    gen = BatchGenerator(model, max_tokens=200)
    gen.insert(prompts[:4], max_tokens=lengths[:4])
    joined, steps, forecasts, live = 4, 0, [], []
    try:
        while responses := gen.next_generated():
            server.step(responses)
            steps += 1
            finished = sum(r.finish_reason is not None for r in responses)
            if finished and joined < len(prompts):
                gen.insert(
                    prompts[joined : joined + finished], max_tokens=lengths[joined : joined + finished]
                )
                joined += finished
            f = wd.forecast()
            if f.step >= READ_FROM and joined < len(prompts):  # the batch under load, not draining
                forecasts.append(f)
                if steps % 5 == 0:
                    live.append((f.step, counter.live(collect=True)))
    finally:
        gen.close()
        unwatch_model(model)
    assert steps >= 250 and len(forecasts) >= 100
    # The truth: the exact count does not grow over the busy part (its requests come and go).
    # The truth: the exact count does not grow over the busy part (its requests come and go, and
    # its level with them): the median slope between its readings.
    slopes = [(b - a) / (t - s) for i, (s, a) in enumerate(live) for t, b in live[i + 1 :] if t - s >= 50]
    assert abs(statistics.median(slopes)) < 0.05, live
    assert wd.census.runs >= 1 and wd.census.errors == 0
    for f in forecasts:
        assert not any(census.is_outside_site(leak.site) for leak in f.leaks), f.describe()
        assert "outside:" not in f.describe()
        assert f.buffers_per_step == 0.0 and f.leaks == (), f.describe()
    # It did look: the server's lazy value is followed (a site that does not grow), no leak.
    assert any(site.endswith("Server.peak") for site in wd.census.sites), wd.census.sites


WALK_STEPS = 31  # steps between two walks once the dense ones are done (0.5 s of decode)


@pytest.mark.parametrize("interval", [8, 50])
def test_an_outside_chain_evaluated_every_n_steps_is_bounded_not_a_leak(counter, clock, interval):
    """The program evaluates its chains every ``interval`` steps: a sawtooth, no leak. Read as a
    cache's is (tests/test_sawtooth.py): until a cut is seen a growing chain may be a leak; from
    two walks after the first cut on, no growth is read, and the site is bounded."""
    wd = Watchdog(limit=200_000, export=False, census=True)
    scheduler = Scheduler()
    teeth, troughs = [], []
    settled = 64 + interval + 2 * WALK_STEPS  # the first cut, and two walks after it

    def evaluate_now_and_then(i):
        if scheduler.steps % interval == 0:
            teeth.append(drop_on_eval(counter, scheduler.history) + drop_on_eval(counter, scheduler.score))
            troughs.append(counter.live())
        f = wd.forecast()
        if f.step >= settled:
            assert f.buffers_per_step == 0 and f.leaks == (), (f.step, f.describe())
            assert math.isinf(f.steps_to_limit), (f.step, f.describe())

    decode(counter, wd, scheduler, steps=max(600, 8 * interval), on_step=evaluate_now_and_then)
    # The truth: each tooth as high as the last (a buffer a step on each chain; the step's own
    # log-probabilities stay alive in the decode loop), the troughs flat.
    assert set(teeth) == {2 * interval - 1} and max(troughs[1:]) - min(troughs[1:]) <= 2, (teeth, troughs)
    f = wd.forecast()
    bounded = {site.site for site in f.bounded}
    assert any(s.endswith("Scheduler.history") for s in bounded), f.describe()
    assert any(s.endswith("Scheduler.score") for s in bounded), f.describe()
    assert wd.stops["forecast"] == 0


CLASS_CALLS: list[str] = []  # what ran of HostileMeta's code
WATCHING = [False]  # while the test's watchdog runs (pytest itself reads the class's attributes)


class HostileMeta(type):
    """Comparing, hashing or asking about its classes runs code that raises; reading an attribute
    of one runs code too, noted while the watchdog runs (the census reads classes as type does; so
    does the probe of the class that looks for the line that rebinds the leak, attribution.py)."""

    def __getattribute__(cls, name):
        if WATCHING[0]:
            CLASS_CALLS.append(name)
        return type.__getattribute__(cls, name)

    def __eq__(cls, other):
        CLASS_CALLS.append("__eq__")
        raise RuntimeError("the census compared a class")

    def __hash__(cls):
        CLASS_CALLS.append("__hash__")
        raise RuntimeError("the census hashed a class")

    def __instancecheck__(cls, instance):
        CLASS_CALLS.append("__instancecheck__")
        raise RuntimeError("the census ran isinstance")


class Hostile(metaclass=HostileMeta):
    """A holder whose every hook raises: the census must read it without calling any of them."""

    __slots__ = ("__weakref__", "chain", "calls")

    def __init__(self):
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "chain", mx.array(1.0))

    def __getattribute__(self, name):
        object.__getattribute__(self, "calls").append(name)
        raise RuntimeError(f"the census ran {name}")

    def __getattr__(self, name):
        raise RuntimeError("the census ran __getattr__")

    def __eq__(self, other):
        raise RuntimeError("the census ran __eq__")

    def __hash__(self):
        raise RuntimeError("the census ran __hash__")

    @property
    def __class__(self):
        raise RuntimeError("the census ran __class__")


def test_a_hostile_holder_is_read_without_its_code_and_not_kept_alive(counter):
    hostile = Hostile()
    walk = Watchdog(limit=200_000, export=False, census=True, walk_interval=0, overhead_budget=1.0)

    class Cache:  # a cache that does not grow, for the watchdog to follow
        def __init__(self):
            self.keys = mx.zeros((2, 2))
            mx.eval(self.keys)

    cache = Cache()
    WATCHING[0] = True
    try:
        for _ in range(40):
            walk.observe(cache)
            object.__setattr__(hostile, "chain", object.__getattribute__(hostile, "chain") + 1)
    finally:
        WATCHING[0] = False
    assert object.__getattribute__(hostile, "calls") == [] and CLASS_CALLS == []
    assert "__setattr__" not in type.__dict__["__dict__"].__get__(Hostile)  # the probe gave it back
    assert any(s.endswith("Hostile.chain") for s in walk.census.sites), walk.census.sites
    assert walk.census.last.pending == 1
    # Followed by weak reference: dropping the holder frees its chain, and the census lets it go.
    mx.synchronize()
    before = counter.live()
    del hostile
    gc.collect()
    assert counter.live() < before
    walk.observe(cache)
    assert walk.census.sites == [] and walk.census.last.arrays == 0
    assert walk.internal_errors == 0 and walk.census.errors == 0


def test_where_the_collector_cannot_list_the_arrays_alone_every_object_is_read(monkeypatch):
    """The census lists the arrays through the collector's view of their class (an instance of a
    heap type refers to it); checked once, and where that fails it reads every object instead."""
    scheduler = Scheduler()
    for i in range(8):
        scheduler.step(i, mx.arange(4, dtype=mx.float32))
    for listed in (None, False):
        monkeypatch.setattr(census, "_referrers_list_arrays", listed)
        c = census.Census(True)
        assert c.discover([]) == 2
        assert sorted(site.rsplit(".", 1)[-1] for site in c.sites) == ["history", "score"]
        assert c.arrays >= 2
        assert census._referrers_list_arrays is (listed is None)  # checked: it works here
    assert census._referrers_list_arrays is False  # left as the test set it


def test_census_takes_true_false_or_auto_and_auto_follows_the_environment(monkeypatch):
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(ValueError, match="census"):
            Watchdog(export=False, census=bad)
    assert Watchdog(export=False, census=False).census.off == "off (census=False)"
    monkeypatch.setenv(census.ENV, "off")
    assert Watchdog(export=False).census.off == f"off ({census.ENV}=off)"
    assert Watchdog(export=False, census=True).census.off is None  # asked for: on
    monkeypatch.setenv(census.ENV, "auto")
    assert Watchdog(export=False).census.off is None  # the default outside this suite: on
    monkeypatch.delenv(census.ENV)
    assert Watchdog(export=False).census.off is None


def test_a_site_is_named_by_code_names_only():
    ns = {}
    exec("class Odd:\n    pass\n", {"__name__": "a.b-c"}, ns)  # a module name that is no identifier
    assert census.outside_site(ns["Odd"], "x") == "outside:<module>.Odd.x"
    assert census.outside_site(Scheduler, "history").endswith(".Scheduler.history")
    long = type("Holder", (), {"__module__": ".".join(["package"] * 30)})
    site = census.outside_site(long, "attribute")
    assert len(site) <= census.MAX_SITE_LEN and site.endswith("package.Holder.attribute")
