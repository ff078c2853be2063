"""Fix mode and the actions before the limit.

``Watchdog(fix=True)`` materializes the cache arrays a step left pending. It must not change
outputs (greedy decode token for token and logprob for logprob, plain and batched paths, the
cache kinds mlx-lm has), must cut mlx-lm's live batched leak, must never compute what the
program would not have, must not stall the decode pipeline, and must swallow its own errors.
``warn_within``, ``on_forecast`` and ``stop_within`` act before the limit.
"""

import logging
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.models.cache import ArraysCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache
from support import needs_model_type

from mlx_watchdog import Forecast, ResourceLimitForecast, Watchdog, find_arrays, tiny
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.core import actions
from mlx_watchdog.core import fix as fix_module
from mlx_watchdog.core import watchdog as core
from mlx_watchdog.core.graph import account, is_evaluated

LEAK_LAYERS = 4  # qwen3_next, full attention every 4th layer: 3 linear-attention layers
LEAK_RATE = LEAK_LAYERS - LEAK_LAYERS // 4 - 1  # (linear layers - 1) buffers per batched step
LEAK_SITE = "ArraysCache.left_padding"
STEP_SECONDS = 0.01  # a decode step on the watchdog's clock


@pytest.fixture(autouse=True)
def watchdog_time(monkeypatch, fake_clock):
    """Every test here runs the watchdog on the fake clock (conftest), a step STEP_SECONDS after
    the last; walks and fixes take none of it unless a test charges them. When the watchdog
    walks, fixes and warns is then the same on any machine, at any load."""
    fake_clock.step_each_observe(monkeypatch, STEP_SECONDS)
    return fake_clock


# ----------------------------------------------------------------------------- helpers

_models: dict = {}


def model(model_type: str, layers: int = 2):
    """Tiny random-weight models, built once per test module (they are never modified;
    every test that watches one unwatches it again)."""
    key = (model_type, layers)
    if key not in _models:
        _models[key] = tiny.build_model(model_type, layers=layers)
    return _models[key]


@pytest.fixture
def watching():
    """watch_model(model, watchdog) for the test, unwatched again whatever happens."""
    watched = []

    def attach(m, wd):
        watched.append(m)
        return watch_model(m, wd)

    yield attach
    for m in watched:
        unwatch_model(m)


def _tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tiny.build_tokenizer(512), eos_token=tiny.EOS_TOKEN)
    return TokenizerWrapper(fast)


TOKENIZER = _tokenizer()


def plain_decode(m, prompt, n, **kwargs):
    """Greedy stream_generate: (tokens, logprobs)."""
    tokens, logprobs = [], []
    for r in stream_generate(m, TOKENIZER, prompt, max_tokens=n, **kwargs):
        tokens.append(r.token)
        logprobs.append(r.logprobs)
    return tokens, logprobs


def batched_decode(m, prompts, n, *, on_step=None, **kwargs):
    """Greedy BatchGenerator decode of ``n`` steps: (tokens per prompt, logprobs per prompt).
    ``on_step(step, generator)`` runs after each step."""
    gen = BatchGenerator(m, max_tokens=n + 8, **kwargs)
    try:
        uids = gen.insert(prompts)
        tokens = {u: [] for u in uids}
        logprobs = {u: [] for u in uids}
        for step in range(1, n + 1):
            for r in gen.next_generated():
                tokens[r.uid].append(r.token)
                logprobs[r.uid].append(r.logprobs)
            if on_step is not None:
                on_step(step, gen)
    finally:
        gen.close()
    return [tokens[u] for u in uids], [logprobs[u] for u in uids]


def assert_identical(expected, got):
    (tokens_a, logprobs_a), (tokens_b, logprobs_b) = expected, got
    assert tokens_b == tokens_a
    flat_a = [x for seq in logprobs_a for x in (seq if isinstance(seq, list) else [seq])]
    flat_b = [x for seq in logprobs_b for x in (seq if isinstance(seq, list) else [seq])]
    assert len(flat_a) == len(flat_b) > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(flat_a, flat_b)), "logprobs differ bit for bit"


def spy_roots(wd):
    """Record the roots every observe() receives (to check which cache kind a decode used)."""
    seen = []
    observe = wd.observe

    def spy(roots, **kwargs):
        seen.append(roots)
        return observe(roots, **kwargs)

    wd.observe = spy
    return seen


class Proxy(types.ModuleType):
    """Stands in for a module (``mlx.core``, ``time``) inside one of our modules only: overrides
    what the test replaces and forwards the rest, so everyone else's calls are untouched."""

    def __init__(self, module, **overrides):
        super().__init__(f"{module.__name__}_proxy")
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


def MxProxy(**overrides):
    return Proxy(mx, **overrides)


def live_cache_arrays(gen):
    return [a for _, a in find_arrays(gen._generation_batch.prompt_cache)]


PROMPT = tiny.tiny_prompts(1, 8, seed=3)[0]  # no early EOS from any of the tiny models
PROMPTS = tiny.tiny_prompts(2, 8, seed=2)  # equal lengths: BatchGenerator keeps left_padding


# ----------------------------------------------------------------------------- outputs unchanged

PLAIN_CASES = {
    "llama": ("llama", 2, {}, None),
    "qwen3_next": ("qwen3_next", LEAK_LAYERS, {}, ArraysCache),
    "deepseek_v41": ("deepseek_v41", 4, {}, None),
    # qwen3 has no make_cache, so max_kv_size gives it RotatingKVCache (llama's make_cache wins).
    "rotating": ("qwen3", 2, {"max_kv_size": 16}, RotatingKVCache),
    "quantized": ("llama", 2, {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}, QuantizedKVCache),
}


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=needs_model_type(PLAIN_CASES[case][0])) for case in PLAIN_CASES]
)
def test_plain_decode_is_identical_with_fix(case, watching):
    model_type, layers, kwargs, cache_kind = PLAIN_CASES[case]
    m = model(model_type, layers)
    n = 40  # with 8 prompt tokens, past the rotating window of 16
    expected = plain_decode(m, PROMPT, n, **kwargs)
    assert len(expected[0]) == n
    wd = Watchdog(fix=True, fix_every=1, export=False)  # the fix at every step
    seen = spy_roots(wd)
    watching(m, wd)
    got = plain_decode(m, PROMPT, n, **kwargs)
    assert_identical(expected, got)
    assert wd.steps >= len(expected[0]) and wd.internal_errors == 0
    if cache_kind is not None:
        assert any(isinstance(c, cache_kind) for c in seen[-1]), (
            f"the decode did not use {cache_kind.__name__}"
        )
    if model_type in ("qwen3_next", "deepseek_v41"):
        # Their caches keep arrays pending between steps: the fix really ran.
        assert wd.materialized_arrays > 0
    if case in ("llama", "qwen3_next", "deepseek_v41"):
        # Nothing leaks on this path: fix mode must not report what it cut as a leak.
        assert wd.forecast().leaks == () and wd.forecast().buffers_per_step < 0.01


@needs_model_type("deepseek_v41")
def test_a_chain_the_model_drains_itself_is_no_leak_in_fix_mode(watching):
    """deepseek_v41's LayerCache keeps pending rows that grow for a few steps and are drained
    by the model at each compression: bounded, no leak, with or without the fix. Walking every
    step (walk, probe, walk, probe...), one-step probes once kept the drain's phase and never
    saw it, and reported the growth between drains as a leak."""
    m = model("deepseek_v41", 4)
    for fix in (False, True):
        wd = Watchdog(fix=fix, export=False, overhead_budget=1.0, walk_interval=0)
        watching(m, wd)
        plain_decode(m, PROMPT, 300)
        unwatch_model(m)
        f = wd.forecast()
        assert wd.walks > 150
        assert f.leaks == () and f.buffers_per_step < 0.01, (fix, f.describe())
    growth = wd._growth.sites["LayerCache.pending_kv"].growth
    assert max(growth) > 0 > min(growth)  # the probes saw it grow and drain


BATCHED_CASES = {
    "llama": ("llama", 2, {}, None),
    "qwen3_next": ("qwen3_next", LEAK_LAYERS, {}, ArraysCache),
    "rotating": ("qwen3", 2, {"max_kv_size": 16}, None),
}


@pytest.mark.parametrize("case", list(BATCHED_CASES))
def test_batched_decode_is_identical_with_fix(case, watching):
    model_type, layers, kwargs, _ = BATCHED_CASES[case]
    m = model(model_type, layers)
    n = 40
    expected = batched_decode(m, PROMPTS, n, **kwargs)
    wd = Watchdog(fix=True, fix_every=1, export=False)  # the fix at every step
    seen = spy_roots(wd)
    watching(m, wd)
    got = batched_decode(m, PROMPTS, n, **kwargs)
    assert_identical(expected, got)
    assert wd.steps >= n and wd.internal_errors == 0
    if case == "rotating":
        assert any("Rotating" in type(c).__name__ for c in seen[-1])
    if case == "qwen3_next":  # ArraysCache.left_padding grows while pending: the fix cut it
        assert wd.materialized_arrays > 0
    else:  # BatchKVCache.offset stays pending between steps but never grows: left to the model
        assert wd.forecast().leaks == ()


def test_the_fix_cuts_growing_sites_and_leaves_bounded_ones_to_the_model(watching, monkeypatch):
    """Once probed, the fix schedules only the pending arrays of the sites that grow (here
    left_padding, one per linear-attention layer); a full sweep every FULL_SWEEP_FIXES fixes
    still schedules every pending array (BatchKVCache.offset, which the next forward evaluates
    anyway, too). Outputs are unchanged either way (test_batched_decode_is_identical_with_fix)."""
    m = model("qwen3_next", LEAK_LAYERS)
    wd = Watchdog(fix=True, fix_every=1, export=False)
    scheduled = []

    def recording_async_eval(arrays):
        scheduled.append(len(arrays))
        return mx.async_eval(arrays)

    def on_step(step, gen):
        if step == 30:  # probed by now
            assert wd._growth.growing == {LEAK_SITE}
            monkeypatch.setattr(core, "mx", MxProxy(async_eval=recording_async_eval))

    watching(m, wd)
    batched_decode(m, PROMPTS, 30 + 3 * fix_module.FULL_SWEEP_FIXES, on_step=on_step)
    linear_layers = LEAK_LAYERS - LEAK_LAYERS // 4
    assert scheduled and min(scheduled) == linear_layers  # the left_padding arrays only
    assert max(scheduled) > linear_layers  # the sweeps: everything pending
    assert wd.forecast().leaks[0].site == LEAK_SITE


@needs_model_type("deepseek_v41")
def test_deepseek_v41_cannot_be_batched_watched_or_not(watching):
    """mlx-lm 0.32.2's BatchGenerator cannot merge deepseek_v41's LayerCache, so its fix is
    tested on the plain path only; the watchdog does not change that error."""
    m = model("deepseek_v41", 4)
    for wd in (None, Watchdog(fix=True, export=False)):
        if wd is not None:
            watching(m, wd)
        gen = BatchGenerator(m, max_tokens=4)
        gen.insert(PROMPTS)
        with pytest.raises(ValueError, match="does not yet support batching"):
            gen.next_generated()
        gen.close()


# ----------------------------------------------------------------------------- the live leak


def test_a_walk_that_sees_nothing_pending_starts_no_probe(watching):
    """A probe is a second walk 1-3 steps after a walk, to measure what pending graphs gain. On
    a decode whose caches are evaluated every step there is nothing to measure (every probe of a
    leak-free 4-layer llama read 0), and on the H200 a walk costs ~1-2 ms of host time."""
    from mlx_lm.generate import generate_step

    m = model("llama", 4)
    wd = Watchdog(fix=True, export=False)
    watching(m, wd)
    cache = make_prompt_cache(m)
    for _ in zip(range(400), generate_step(mx.array([1, 2, 3]), m, max_tokens=400, prompt_cache=cache)):
        pass
    assert wd.walks >= 5 and wd._fixer.probes == 0 and wd.materialized_arrays == 0
    leaking = Watchdog(fix=True, export=False)
    watching(model("qwen3_next", LEAK_LAYERS), leaking)
    batched_decode(model("qwen3_next", LEAK_LAYERS), PROMPTS, 200)
    assert leaking._fixer.probes >= 3 and leaking.materialized_arrays > 0


def test_fix_cuts_the_live_batched_leak(watching):
    m = model("qwen3_next", LEAK_LAYERS)
    # Baseline, fix off: the leak is there (rate and retained buffers grow).
    base = Watchdog(export=False)
    watching(m, base)
    retained_base = []
    base_tokens, _ = batched_decode(
        m,
        PROMPTS,
        300,
        on_step=lambda s, g: (
            s == 300 and retained_base.append(account(live_cache_arrays(g)).retained_buffers)
        ),
    )
    assert base.forecast().buffers_per_step == pytest.approx(LEAK_RATE, rel=0.05)
    assert retained_base[0] >= 0.9 * LEAK_RATE * 300

    wd = Watchdog(fix=True, export=False)
    watching(m, wd)
    steps = 2000
    retained = []
    tokens, _ = batched_decode(
        m,
        PROMPTS,
        steps,
        on_step=lambda s, g: s % 500 == 0 and retained.append(account(live_cache_arrays(g)).retained_buffers),
    )
    forecast = wd.forecast()
    assert forecast.step >= steps
    assert forecast.buffers_per_step < 0.01
    # The chains really are cut: what the cache's pending graphs keep (at most fix_every steps'
    # worth) stays flat, far below what the leak held after only 300 steps.
    chain = (wd.fix_every + 1) * LEAK_RATE
    assert max(retained) - min(retained) <= chain + LEAK_LAYERS, retained
    assert max(retained) < retained_base[0] / 5, retained
    # The site is still named, with the growth the fix reclaims.
    assert forecast.leaks and forecast.leaks[0].site == LEAK_SITE
    assert forecast.leaks[0].buffers_per_step == pytest.approx(LEAK_RATE, rel=0.05)
    assert wd.materialized_arrays >= steps // (2 * wd.fix_every)
    assert wd.reclaimed_buffers == pytest.approx(LEAK_RATE * steps, rel=0.1)
    assert wd.internal_errors == 0
    assert [t[:300] for t in tokens] == base_tokens


# ----------------------------------------------------------------------------- actions


def _resident_at_start(m, watching) -> int:
    """The watchdog's resident estimate a few steps into the batched decode (parameters +
    cache), to place a small limit just above it."""
    wd = Watchdog(export=False)
    watching(m, wd)
    batched_decode(m, PROMPTS, 8)
    return wd.forecast().resident_buffers


def test_warn_within_logs_once_a_minute_naming_the_top_site(watching, caplog, fake_clock):
    # On the fake clock (watchdog_time), "within the minute" is the test's, not the machine's.
    m = model("qwen3_next", LEAK_LAYERS)
    limit = _resident_at_start(m, watching) + 100_000
    received = []
    # A large walk budget: this test is about the warning, not about sampling.
    wd = Watchdog(
        limit,
        warn_within=1_000_000,
        on_forecast=received.append,
        overhead_budget=1.0,
        walk_interval=0,
        export=False,
    )
    watching(m, wd)
    caplog.set_level(logging.WARNING, logger="mlx_watchdog")

    def warnings():
        return [
            r
            for r in caplog.records
            if r.name == "mlx_watchdog" and "resource limit forecast" in r.getMessage()
        ]

    batched_decode(m, PROMPTS, 60)
    assert len(warnings()) == 1
    record = warnings()[0]
    assert record.levelno == logging.WARNING and LEAK_SITE in record.getMessage()
    assert "(fix: Watchdog(fix=True) or `mlx-watchdog serve --fix`)" in record.getMessage()  # the remedy
    # on_forecast gets a Forecast after each walk.
    assert len(received) == wd.walks > 1
    assert all(isinstance(f, Forecast) for f in received)
    assert received[-1].leaks[0].site == LEAK_SITE and received[-1].buffers_per_step > 0

    # A second crossing within the minute (the forecast is reset, then crosses again): no new record.
    wd.reset()
    assert wd.forecast().steps_to_limit == float("inf")
    batched_decode(m, PROMPTS, 30)
    assert wd.forecast().steps_to_limit < 1_000_000
    assert len(warnings()) == 1
    # A minute later it warns again.
    fake_clock.now += actions.WARN_INTERVAL_SECONDS
    batched_decode(m, PROMPTS, 5)
    assert len(warnings()) == 2


def test_stop_within_raises_before_the_limit_and_fix_prevents_it(watching):
    m = model("qwen3_next", LEAK_LAYERS)
    limit = _resident_at_start(m, watching) + 200 * LEAK_RATE  # reached after ~200 leaking steps
    wd = Watchdog(limit, stop_within=50, export=False)
    watching(m, wd)
    state = {}

    def at_step(step, gen):
        state["step"] = step
        state["arrays"] = live_cache_arrays(gen)

    with pytest.raises(ResourceLimitForecast) as info:
        batched_decode(m, PROMPTS, 400, on_step=at_step)
    exc = info.value
    assert isinstance(exc, RuntimeError) and exc.reason == "forecast"
    assert exc.forecast.steps_to_limit <= 50
    assert exc.forecast.resident_buffers < limit
    assert exc.forecast.leaks[0].site == LEAK_SITE
    assert wd.stops["forecast"] == 1
    assert 100 < state["step"] < 200
    # Independently of the forecast: what was really resident when it stopped was below the limit.
    reading = account(state["arrays"])
    assert wd.forecast().parameter_buffers + reading.evaluated_arrays + reading.retained_buffers < limit
    # The process and the device are healthy: the next decode runs.
    unwatch_model(m)
    assert len(batched_decode(m, PROMPTS, 3)[0][0]) == 3

    # Same limit with the fix: 400 steps (twice what the leak needed to reach it), no stop.
    fixed = Watchdog(limit, stop_within=50, fix=True, export=False)
    watching(m, fixed)
    batched_decode(m, PROMPTS, 400)
    assert fixed.stops["forecast"] == 0 and fixed.steps >= 400
    assert fixed.forecast().resident_buffers < limit


def test_a_failing_on_forecast_callback_is_counted_not_raised():
    def broken(forecast):
        raise ValueError("user callback bug")

    wd = Watchdog(on_forecast=broken, export=False)
    cache = ScalarChain()
    for _ in range(20):
        wd.observe(cache)
        cache.step()
    assert wd.walks > 0 and wd.internal_errors == wd.walks
    assert wd.forecast().buffers_per_step == pytest.approx(1.0, rel=0.05)


class GrowingList:
    """Real growth the fix cannot cut: one more evaluated buffer held every step."""

    def __init__(self):
        self.blocks = []

    def step(self):
        self.blocks.append(mx.array([len(self.blocks)]))
        mx.eval(self.blocks[-1])


class GrowingListWithChains:
    """One site, two kinds of growth: ``chains`` lazy chains the fix cuts (``blocks[i]`` rebound to
    ``x + 1``) and ``appended`` more evaluated blocks each step, which no fix can cut."""

    def __init__(self, chains: int, appended: int):
        self.chains, self.appended = chains, appended
        self.blocks = [mx.array(0) for _ in range(max(1, chains))]
        mx.eval(self.blocks)

    def step(self):
        for i in range(self.chains):
            self.blocks[i] = self.blocks[i] + 1
        for _ in range(self.appended):
            self.blocks.append(mx.array([len(self.blocks)]))
            mx.eval(self.blocks[-1])


@settings(max_examples=12, deadline=None)
@given(chains=st.integers(0, 3), appended=st.integers(0, 2))
def test_what_the_fix_cuts_and_what_it_cannot_are_reported_apart(chains, appended):
    wd = Watchdog(10**6, fix=True, fix_every=1, export=False, overhead_budget=1.0, walk_interval=0)
    cache = GrowingListWithChains(chains, appended)
    for _ in range(80):
        wd.observe(cache)
        cache.step()
    rates = {
        cut: leak.buffers_per_step for cut in (True, False) for leak in wd.forecast().leaks if leak.cut == cut
    }
    assert {leak.site for leak in wd.forecast().leaks} <= {"GrowingListWithChains.blocks"}
    assert rates.get(True, 0.0) == pytest.approx(chains, abs=0.1)  # the chains, cut
    assert rates.get(False, 0.0) == pytest.approx(appended, abs=0.1)  # the blocks, still growing
    assert wd.forecast().buffers_per_step == pytest.approx(appended, abs=0.1)
    assert ("(cut by the fix)" in wd.forecast().describe()) == (chains > 0)


def test_stop_within_with_fix_still_stops_when_materializing_does_not_help():
    wd = Watchdog(300, stop_within=50, fix=True, export=False)
    cache = GrowingList()
    with pytest.raises(ResourceLimitForecast) as info:
        for _ in range(300):
            wd.observe(cache)
            cache.step()
    assert info.value.forecast.buffers_per_step == pytest.approx(1.0, rel=0.05)
    assert 200 < len(cache.blocks) < 300


# ----------------------------------------------------------------------------- safety


def test_mlx_error_while_materializing_is_counted_not_raised(watching, monkeypatch, caplog):
    m = model("qwen3_next", LEAK_LAYERS)
    expected = batched_decode(m, PROMPTS, 40)
    calls = []

    def failing_async_eval(*args):
        calls.append(args)
        raise RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")

    monkeypatch.setattr(core, "mx", MxProxy(async_eval=failing_async_eval))
    wd = Watchdog(fix=True, export=False)
    watching(m, wd)
    caplog.set_level(logging.WARNING, logger="mlx_watchdog")
    got = batched_decode(m, PROMPTS, 40)
    assert calls, "the fix never tried to materialize"
    # A refused group is retried by halves down to single arrays: each that fails is counted, none raised.
    assert wd.fix_failures == sum(len(args[0]) == 1 for args in calls) > 0
    assert wd.internal_errors == 0
    assert wd.materialized_arrays == 0
    assert any("could not schedule" in r.getMessage() for r in caplog.records if r.name == "mlx_watchdog")
    assert_identical(expected, got)
    # Nothing was fixed, and the forecast does not pretend otherwise.
    assert wd.forecast().buffers_per_step == pytest.approx(LEAK_RATE, rel=0.05)


def test_graphs_the_program_never_evaluates_are_not_computed(watching):
    """Like mlx-lm's own model tests: forward passes whose outputs are never evaluated."""
    m = model("qwen3_next", LEAK_LAYERS)
    wd = Watchdog(fix=True, export=False)
    watching(m, wd)
    cache = make_prompt_cache(m)
    outputs = [m(mx.array([PROMPT]), cache=cache)]
    for token in range(5):
        outputs.append(m(mx.array([[token]]), cache=cache))
    arrays = [a for _, a in find_arrays(cache)]
    assert arrays and not any(is_evaluated(a) for a in arrays)
    assert not any(is_evaluated(o) for o in outputs)
    assert wd.materialized_arrays == 0 and wd.steps == 6

    # The contrast: the same loop evaluating each output lets the fix materialize what the
    # output left pending (the linear-attention states). They do not grow (the next forward
    # reads them), so only the fix's full sweep (every FULL_SWEEP_FIXES-th fix) takes them.
    wd2 = Watchdog(fix=True, fix_every=1, export=False)
    watching(m, wd2)
    cache = make_prompt_cache(m)
    mx.eval(m(mx.array([PROMPT]), cache=cache))
    for token in range(fix_module.FULL_SWEEP_FIXES + 8):
        mx.eval(m(mx.array([[token]]), cache=cache))
    assert wd2.materialized_arrays > 0


def test_fix_does_not_stall_the_decode_pipeline(watching, monkeypatch):
    """No synchronous mx.eval / mx.synchronize from the watchdog while it fixes: MLX detaches
    the graph in async_eval, the device work overlaps the next step."""
    calls = {"watchdog": 0, "other": 0, "async": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            calls["watchdog" if caller.startswith("mlx_watchdog") else "other"] += 1
            return real(*args, **kwargs)

        return wrapper

    m = model("qwen3_next", LEAK_LAYERS)  # built first: building evaluates its weights
    monkeypatch.setattr(mx, "eval", counting("eval", mx.eval))
    monkeypatch.setattr(mx, "synchronize", counting("synchronize", mx.synchronize))
    real_async = mx.async_eval

    def counting_async(*args):
        calls["async"] += 1
        return real_async(*args)

    monkeypatch.setattr(core, "mx", MxProxy(async_eval=counting_async))
    wd = Watchdog(fix=True, export=False)
    watching(m, wd)
    batched_decode(m, PROMPTS, 40)
    plain_decode(m, PROMPT, 40)
    assert wd.materialized_arrays > 0 and calls["async"] > 0
    assert calls["other"] > 0  # the patch is live: mlx-lm's own evals went through it
    assert calls["watchdog"] == 0


class ScalarChain:
    """``x = x - 1`` each step: one more pending node (and one stranded buffer) per step."""

    def __init__(self):
        self.x = mx.array(0)
        mx.eval(self.x)

    def step(self):
        self.x = self.x - 1


@pytest.mark.parametrize("every", [1, 4, 16])
def test_fix_every_n_steps(every, monkeypatch):
    fixed_at = []
    wd = Watchdog(fix=True, fix_every=every, export=False)

    def recording_async_eval(*args):
        fixed_at.append(wd.steps)
        return mx.async_eval(*args)

    monkeypatch.setattr(core, "mx", MxProxy(async_eval=recording_async_eval))
    cache = ScalarChain()
    longest = 0
    steps = 400
    for _ in range(steps):
        wd.observe(cache)
        cache.step()
        longest = max(longest, account([cache.x]).pending_nodes)
    gaps = {b - a for a, b in zip(fixed_at, fixed_at[1:])}
    # Never more often than every N steps; a walk's probe may delay a fix by up to 3 steps.
    probe = max(fix_module.PROBE_STEPS)
    assert gaps and gaps <= set(range(every, every + probe + 1)), gaps
    assert steps / (every + probe) - 1 <= len(fixed_at) <= steps / every + 1
    assert longest <= every + probe + 1  # the chain is cut at least every N+3 steps
    # Unfixed this chain grows 1 buffer/step; cut every N steps it is a sawtooth of height N.
    assert wd.forecast().buffers_per_step < (0.01 if every == 1 else 0.05)


@pytest.mark.mlx_lm_neutral
def test_materializing_does_not_starve_the_walks(monkeypatch, watchdog_time):
    """Scheduling the cut chains moves work the decode does anyway (the CPU backend's
    async_eval of a hybrid model's states takes ~0.3 ms a step): it must not use up the walk
    budget, or fix mode goes blind after its first steps (no new forecast, so no stop).
    Two watchdogs side by side, one whose materializing is slow (20% of a step): it must
    keep walking like the other. Their walks are spaced by a set interval (0.2 s, 10 steps
    of two observes): by default the interval follows each walk's own CPU time."""
    clock = watchdog_time  # each observe() a step of STEP_SECONDS
    clock.charge_walks(monkeypatch, lambda reading: 2**-12)  # ~0.25 ms a walk (0.17-0.65 ms here)
    slow_cache, fast_cache = ScalarChain(), ScalarChain()

    def async_eval(*args):
        if any(a is slow_cache.x for a in args[0]):
            clock.work(0.4 * STEP_SECONDS)  # 20% of a step of both
        return mx.async_eval(*args)

    monkeypatch.setattr(core, "mx", MxProxy(async_eval=async_eval))
    slow, fast = (Watchdog(fix=True, fix_every=1, walk_interval=0.2, export=False) for _ in range(2))
    steps = 300
    pairs = [(slow, slow_cache), (fast, fast_cache)]
    for step in range(steps):
        for wd, cache in pairs if step % 2 else pairs[::-1]:  # alternate which one goes first
            wd.observe(cache)
            cache.step()
    assert slow.materialized_arrays >= steps // 3  # the fix ran (every other step while walks are dense)
    last_slow, last_fast = slow.forecast().measured_step, fast.forecast().measured_step
    assert last_fast > steps - 40  # walks went on to the end
    # Charged to the budget, the slow one's fix would spend the start-up credit by step ~120.
    assert last_slow >= last_fast - 20 and slow.walks >= fast.walks - 2, (
        last_slow,
        last_fast,
        slow.walks,
        fast.walks,
    )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_bad_fix_every_is_rejected(bad):
    with pytest.raises(ValueError, match="fix_every"):
        Watchdog(fix=True, fix_every=bad)


class LongChain:
    """A cache whose countdown holds a pending chain of ``depth`` nodes, one more each step."""

    def __init__(self, depth: int):
        self.countdown = mx.array(10**6)
        mx.eval(self.countdown)
        for _ in range(depth):
            self.countdown = self.countdown - 1

    def step(self):
        self.countdown = self.countdown - 1


def test_a_fix_that_meets_long_chains_cuts_them_a_share_a_step(counter, monkeypatch):
    # A decode watched late: 12 caches whose countdown holds a 2,000-node pending chain. One fix
    # of all of them would evaluate 24,000 nodes in one step (at the crash scale, 470,000 took 5 s).
    # The fix cuts about FIX_NODES nodes a step (2 chains), in steps that walk no graph, until all
    # are cut: the exact count falls by the chains' buffers, and stays flat under the fix.
    depth, chains = 2000, 12
    calls: list[tuple[int, int]] = []  # (step, long chains scheduled)
    real = core.schedule_evaluation

    def recording(arrays, async_eval):
        long_ones = {id(c.countdown) for c in caches if c.steps_since_fix >= 100}
        calls.append((wd.steps, sum(id(a) in long_ones for a in arrays)))
        for c in caches:
            if any(a is c.countdown for a in arrays):
                c.steps_since_fix = 0
        return real(arrays, async_eval)

    monkeypatch.setattr(core, "schedule_evaluation", recording)
    baseline = counter.live(collect=True)
    caches = [LongChain(depth) for _ in range(chains)]
    for c in caches:
        c.steps_since_fix = depth
    held = counter.live(collect=True) - baseline
    assert held >= chains * depth  # one buffer per pending scalar node at least
    wd = Watchdog(limit=10**7, export=False, fix=True, overhead_budget=1.0)
    walked = []
    for _ in range(60):
        before = wd.walks
        wd.observe(caches)
        if wd.walks > before:
            walked.append(wd.steps)
        for c in caches:
            c.step()
            c.steps_since_fix += 1
    per_call = [n for _, n in calls if n]
    share = max(1, fix_module.FIX_NODES // depth)
    assert per_call and max(per_call) <= share, calls  # never more than a share in one step
    assert sum(per_call) == chains, calls  # every chain cut, once
    assert not {step for step, n in calls if n} & set(walked), (calls, walked)  # not in a walk's step
    assert all(c.steps_since_fix < 60 for c in caches)
    left = counter.live(collect=True) - baseline
    assert left < held / 10, (left, held)  # the chains' buffers are gone


def test_shares_that_cannot_run_do_not_stop_the_walks(monkeypatch, watchdog_time):
    # The shares wait for the program's output, like every fix; a program that stops evaluating
    # it (here: its output stays lazy once the shares began) must not leave the walks waiting for
    # shares that never come: they go on within twice the steps the shares needed (and a probe's).
    # A step of STEP_SECONDS (watchdog_time) is the decode's own time, which pays for the walks;
    # a walk costs 3 us a node, as here.
    watchdog_time.charge_walks(monkeypatch, lambda reading: 3e-6 * (reading.pending_nodes + 100))
    caches = [LongChain(2000) for _ in range(12)]
    wd = Watchdog(limit=10**7, export=False, fix=True, overhead_budget=1.0, walk_interval=0)
    lazy = mx.array(1) + 1
    backlog_at, walks_after = None, []
    for _ in range(120):
        before = wd.walks
        wd.observe(caches, last_output=lazy if backlog_at is not None else None)
        if backlog_at is None and wd._fixer.backlog:
            backlog_at = wd.steps
        elif backlog_at is not None and wd.walks > before:
            walks_after.append(wd.steps)
        for c in caches:
            c.step()
    assert backlog_at is not None  # the shares began
    shares = -(-12 // (fix_module.FIX_NODES // 2000))
    deadline = backlog_at + 2 * shares + 2 * max(fix_module.PROBE_STEPS)
    # The step after the deadline drops the backlog; the walk it owes comes at the next.
    assert walks_after and walks_after[0] <= deadline + 2, (backlog_at, deadline, walks_after)
    assert walks_after[-1] > 60, walks_after  # and the schedule's walks go on, further apart as they age


@pytest.mark.parametrize("probes", [True, False], ids=["probed", "unprobed"])
def test_resident_between_walks_follows_the_fix_sawtooth(counter, probes, monkeypatch):
    # Fix mode, fixes 32 steps apart, walks far fewer (every 2 s of decode, 200 steps of
    # watchdog_time's): between two fixes the
    # chains the fix cuts grow back, 8 buffers a step here (up to 256 above the cut level). The
    # resident count read at any step, walked or not, follows the exact count within 5%.
    # Unprobed: before a probe has measured what the fix cuts (a new decode of a busy server,
    # whose probes a change of its batch cancels), the walks' own readings say it: a reading at
    # the sawtooth's peak once stayed there after the fix, 216 over the count.
    if not probes:
        monkeypatch.setattr(fix_module.Fixer, "wants_probe", lambda self: False)

    class Chain:
        def __init__(self):
            self.countdown = mx.array(10**6)
            mx.eval(self.countdown)

        def step(self):
            self.countdown = self.countdown - 1

    baseline = counter.live(collect=True)
    caches = [Chain() for _ in range(8)]
    wd = Watchdog(limit=10**7, export=False, fix=True, fix_every=32, walk_interval=2.0)
    misses = []
    for step in range(1, 401):
        wd.observe(caches)  # at the entry of the step: what the steps before left
        if step > 100:
            exact = counter.live() - baseline
            read = wd.forecast().resident_buffers
            if abs(read - exact) > 0.05 * exact + 2:
                misses.append((step, read, exact))
        for c in caches:
            c.step()
    assert wd.walks < 40 and wd.materialized_arrays > 0  # few walks, the fix ran
    assert not misses, misses[:10]


class BatchCache:
    """A batch's cache: keys the program evaluates every step, an offset per row it never does (a
    buffer a step), and a filter that rebuilds the batch shorter in place and evaluates it (a
    request ended: the chain is cut by the program, once)."""

    def __init__(self, rows: int):
        self.keys = mx.zeros((rows, 2, 4, 4))
        self.offset = mx.zeros((rows,))
        mx.eval(self.keys, self.offset)

    def step(self) -> None:
        self.keys = self.keys + 1
        mx.eval(self.keys)
        self.offset = self.offset + 1

    def filter(self, rows: int) -> None:
        self.keys, self.offset = self.keys[:rows], self.offset[:rows]
        mx.eval(self.keys, self.offset)


def test_a_probe_across_a_batch_filtered_in_place_still_reads_what_the_fix_cuts(counter):
    # The truth: what the offsets' chains grow a step, unwatched (the exact count).
    caches = [BatchCache(4) for _ in range(3)]
    before = counter.live(collect=True)
    for _ in range(20):
        for c in caches:
            c.step()
    truth = (counter.live() - before) / 20
    caches = [BatchCache(4) for _ in range(3)]
    wd = Watchdog(fix=True, export=False, walk_interval=0, overhead_budget=1.0)
    filtered_at = None
    for step in range(1, 241):
        wd.observe(caches)
        for c in caches:
            c.step()
        probe = wd._fixer.probe
        # The batch is filtered within a probe that ends before the rows are looked at again.
        if (
            filtered_at is None
            and step > 40
            and probe is not None
            and probe.start <= step < probe.end
            and all(s % core.ROWS_EVERY for s in range(step + 1, probe.end + 1))
        ):
            for c in caches:
                c.filter(3)
            filtered_at = step
        if filtered_at is not None and step > filtered_at:
            # Before: the probe read the cut as a drain (-45 a step), and the site no leak for
            # ~100 steps, while the fix still cut 3 buffers a step.
            [leak] = wd.forecast().leaks
            assert leak.site == "BatchCache.offset", wd.forecast().describe()
            assert leak.buffers_per_step == pytest.approx(truth, rel=0.15), (step, wd.forecast().describe())
    assert filtered_at is not None
    assert wd.forecast().leaks[0].cut and wd.materialized_arrays > 0
    assert wd.internal_errors == 0
