"""Attachment points: the ``@watch`` decorator, ``watch_model`` / ``unwatch_model``,
``watch_step``, and reading forecasts from another thread while a decode runs.

Tiny random-weight models from ``mlx_watchdog.tiny``; no downloads."""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import pickle
import threading
import types
import urllib.request

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate, generate_step, stream_generate
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from support import batched_tokens
from transformers import PreTrainedTokenizerFast

from mlx_watchdog import Watchdog, tiny, watch, watch_step
from mlx_watchdog.attach.model import unwatch_model, watch_model, watched_state
from mlx_watchdog.core.graph import account, is_evaluated

mlx_lm_generate = importlib.import_module(
    "mlx_lm.generate"
)  # the module (mlx_lm.generate is also a function)

# 8 tokens: generate_step runs one prefill forward of 7 tokens, one of the last prompt token,
# then one forward ahead of each token it yields.
PROMPT = tiny.tiny_prompts(1, 8, seed=1)[0]
FORWARDS_BEFORE_FIRST_TOKEN = 2


@pytest.fixture(autouse=True)
def watchdog_time(monkeypatch, fake_clock):
    """Every test here runs the watchdog on the fake clock (conftest), each observe() 10 ms after
    the last, walks free: when it walks is the schedule's, the same on any machine."""
    fake_clock.step_each_observe(monkeypatch, 0.01)
    return fake_clock


def no_eos(tokens, logits):
    # Random weights may pick the EOS; without it every decode runs to max_tokens.
    return mx.where(mx.arange(logits.shape[-1]) == tiny.EOS_ID, -mx.inf, logits)


@pytest.fixture(scope="module")
def tokenizer():
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tiny.build_tokenizer(tiny.VOCAB_SIZE), eos_token=tiny.EOS_TOKEN
    )
    return TokenizerWrapper(fast)


def _model(model_type, layers, **overrides):
    model = tiny.build_model(model_type, layers=layers, **overrides)
    return model, type(model)


@pytest.fixture
def llama():
    model, cls = _model("llama", 2)
    yield model
    unwatch_model(model)


def _greedy(model, n, **kwargs):
    steps = generate_step(mx.array(PROMPT), model, max_tokens=n, logits_processors=[no_eos], **kwargs)
    return [token for token, _ in steps]


# --------------------------------------------------------------------------- @watch


def test_watch_keeps_name_docstring_and_signature():
    def run(model, tokenizer, prompt, prompt_cache=None, max_tokens=4):
        """Generate greedily."""

    wrapped = watch(export=False)(run)
    assert wrapped.__name__ == "run" and wrapped.__doc__ == "Generate greedily."
    assert wrapped.__wrapped__ is run
    assert inspect.signature(wrapped) == inspect.signature(run)
    assert isinstance(wrapped.watchdog, Watchdog) and wrapped.metrics_server is None

    bare = watch(run)  # @watch without parentheses
    assert bare.__name__ == "run" and bare.watchdog is not wrapped.watchdog

    for fn in (generate, stream_generate, generate_step):
        w = watch(fn, export=False)
        assert (w.__name__, w.__qualname__, w.__doc__, w.__module__) == (
            fn.__name__,
            fn.__qualname__,
            fn.__doc__,
            fn.__module__,
        )
        assert inspect.signature(w) == inspect.signature(fn)
        assert inspect.isgeneratorfunction(w) == inspect.isgeneratorfunction(fn)


@pytest.mark.parametrize(
    "model_type, max_kv_size, expected",
    [
        ("qwen3", 16, RotatingKVCache),  # no make_cache of its own: max_kv_size rotates
        ("llama", None, KVCache),
        ("qwen3_next", None, (ArraysCache, KVCache)),  # the model's own make_cache: a hybrid list
    ],
)
def test_watch_builds_the_cache_with_the_models_own_rules(model_type, max_kv_size, expected):
    model, cls = _model(model_type, 4)
    plain = _greedy(model, 6)
    received = []

    @watch(export=False)
    def run(model, tokenizer, prompt, prompt_cache=None, max_kv_size=None, max_tokens=6):
        received.append(prompt_cache)
        assert type(model) is not cls and isinstance(model, cls)  # watched during the call
        steps = generate_step(
            mx.array(prompt),
            model,
            prompt_cache=prompt_cache,
            max_tokens=max_tokens,
            logits_processors=[no_eos],
        )
        return [token for token, _ in steps]

    tokens = run(model, None, PROMPT, max_kv_size=max_kv_size)
    [cache] = received
    reference = make_prompt_cache(model, max_kv_size=max_kv_size)
    assert cache is not None and len(cache) == len(model.layers)
    assert [type(c) for c in cache] == [type(c) for c in reference]
    assert all(isinstance(c, expected) for c in cache)
    assert {type(c) for c in cache} == ({expected} if isinstance(expected, type) else set(expected))
    if max_kv_size is not None:
        assert all(c.max_size == max_kv_size for c in cache)
    # The built cache is the one the decode used, and it saw every forward pass.
    attention = [c for c in cache if isinstance(c, (KVCache, RotatingKVCache))]
    assert attention and all(c.offset == len(PROMPT) + 6 for c in attention)
    assert run.watchdog.steps == 6 + FORWARDS_BEFORE_FIRST_TOKEN
    assert run.watchdog.name == model_type
    assert tokens == plain  # watching changes no token
    assert type(model) is cls and watched_state(model) is None


def test_watch_on_mlx_lm_generate_builds_the_cache_it_observes(llama, tokenizer, monkeypatch):
    cls = type(llama)
    plain = generate(llama, tokenizer, PROMPT, max_tokens=10, logits_processors=[no_eos])

    def refuse(*args, **kwargs):
        raise AssertionError("generate_step built its own cache: the decorator did not pass one")

    # generate_step's own cache: mlx-lm 0.32 calls the name it imported, 0.31 cache.make_prompt_cache.
    if hasattr(mlx_lm_generate, "make_prompt_cache"):
        monkeypatch.setattr(mlx_lm_generate, "make_prompt_cache", refuse)
    else:
        cache_module = mlx_lm_generate.cache  # the decorator imports the real one from it
        monkeypatch.setattr(
            mlx_lm_generate,
            "cache",
            types.SimpleNamespace(**{**vars(cache_module), "make_prompt_cache": refuse}),
        )
    watched = watch(generate, export=False)
    text = watched(llama, tokenizer, PROMPT, max_tokens=10, logits_processors=[no_eos])
    assert text == plain
    assert watched.watchdog.steps == 10 + FORWARDS_BEFORE_FIRST_TOKEN
    assert type(llama) is cls and watched_state(llama) is None


def test_watch_uses_the_callers_cache(llama, tokenizer):
    # Through **kwargs (generate -> stream_generate -> generate_step) ...
    watched = watch(generate, export=False)
    mine = make_prompt_cache(llama)
    watched(llama, tokenizer, PROMPT, max_tokens=5, prompt_cache=mine, logits_processors=[no_eos])
    assert all(c.offset == len(PROMPT) + 5 for c in mine)

    # ... by keyword, and positionally (None positionally means: build one).
    received = []

    @watch(export=False)
    def run(model, prompt, prompt_cache=None):
        received.append(prompt_cache)
        return model(mx.array([prompt[:1]]), cache=prompt_cache)  # one decode-shaped forward

    mine = make_prompt_cache(llama)
    run(llama, PROMPT, prompt_cache=mine)
    run(llama, PROMPT, mine)
    run(llama, PROMPT, None)
    assert received[0] is mine and received[1] is mine
    assert received[2] is not None and received[2] is not mine
    assert run.watchdog.steps == 3


@pytest.mark.parametrize("which", ["generate_step", "stream_generate"])
def test_watched_generator_steps_as_items_are_consumed_and_detaches_on_close(llama, tokenizer, which):
    cls = type(llama)
    if which == "generate_step":
        wrapped = watch(generate_step, export=False)
        items = wrapped(mx.array(PROMPT), llama, max_tokens=100, logits_processors=[no_eos])
    else:
        wrapped = watch(stream_generate, export=False)
        items = wrapped(llama, tokenizer, PROMPT, max_tokens=100, logits_processors=[no_eos])
    wd = wrapped.watchdog
    assert wd.steps == 0 and type(llama) is cls  # nothing runs before the first item
    for k in range(1, 8):
        next(items)
        assert wd.steps == k + FORWARDS_BEFORE_FIRST_TOKEN
        assert watched_state(llama).watchdog is wd
    items.close()
    assert type(llama) is cls and watched_state(llama) is None
    llama(mx.array([[1]]), cache=make_prompt_cache(llama))  # no longer observed
    assert wd.steps == 7 + FORWARDS_BEFORE_FIRST_TOKEN


def test_watched_generator_detaches_when_exhausted_or_failing(llama):
    cls = type(llama)
    wrapped = watch(generate_step, export=False)
    tokens = [t for t, _ in wrapped(mx.array(PROMPT), llama, max_tokens=5, logits_processors=[no_eos])]
    assert len(tokens) == 5 and wrapped.watchdog.steps == 5 + FORWARDS_BEFORE_FIRST_TOKEN
    assert type(llama) is cls

    @watch(export=False)
    def failing(model, prompt, prompt_cache=None):
        yield model(mx.array([prompt]), cache=prompt_cache)
        raise RuntimeError("boom")

    items = failing(llama, PROMPT)
    next(items)
    assert type(llama) is not cls
    with pytest.raises(RuntimeError, match="boom"):
        next(items)
    assert type(llama) is cls and watched_state(llama) is None


def test_shared_watchdog_and_nesting_inside_watch_model(llama, tokenizer):
    wd = Watchdog(export=False)
    step_fn = watch(generate_step, watchdog=wd)
    stream_fn = watch(stream_generate, watchdog=wd)
    assert step_fn.watchdog is wd and stream_fn.watchdog is wd
    list(step_fn(mx.array(PROMPT), llama, max_tokens=3, logits_processors=[no_eos]))
    list(stream_fn(llama, tokenizer, PROMPT, max_tokens=4, logits_processors=[no_eos]))
    # The second call's prompt forward runs on a new cache while the watchdog still follows the
    # first decode: only decode steps count then (a prompt beside a batch is no step either).
    assert wd.steps == (3 + FORWARDS_BEFORE_FIRST_TOKEN) + (4 + FORWARDS_BEFORE_FIRST_TOKEN - 1)

    # A model already watched keeps its own watchdog after a decorated call.
    outer = Watchdog(export=False)
    watch_model(llama, outer)
    subclass = type(llama)
    list(step_fn(mx.array(PROMPT), llama, max_tokens=2, logits_processors=[no_eos]))
    assert wd.steps == 3 + 4 + 2 + 3 * FORWARDS_BEFORE_FIRST_TOKEN - 2 and outer.steps == 0
    assert type(llama) is subclass and watched_state(llama).watchdog is outer


def test_speculative_decoding_is_observed_and_unchanged(tokenizer):
    model, cls = _model("llama", 2, seed=0)
    draft, _ = _model("llama", 2, seed=1)

    def tokens(fn):
        return [
            r.token
            for r in fn(model, tokenizer, PROMPT, max_tokens=12, draft_model=draft, num_draft_tokens=3)
        ]

    plain = tokens(stream_generate)
    decorated = watch(stream_generate, export=False)
    assert tokens(decorated) == plain  # the built cache holds the draft model's layers too
    assert decorated.watchdog.steps > 0 and type(model) is cls

    wd = Watchdog(export=False)
    watch_model(model, wd)
    assert tokens(stream_generate) == plain
    assert wd.steps > 0
    unwatch_model(model)


def test_option_errors_name_the_option(llama):
    cls = type(llama)
    for make in (
        lambda **o: watch(**o),
        lambda **o: watch(lambda model: None, **o),
        lambda **o: watch_model(llama, **o),
        lambda **o: watch_step(lambda: None, [], **o),
    ):
        with pytest.raises(ValueError, match="limit"):
            make(limit=0)
        with pytest.raises(ValueError, match="fix_every"):
            make(fix_every=0)
        with pytest.raises(ValueError, match="overhead_budget"):
            make(overhead_budget=2)
        with pytest.raises(ValueError, match="walk_interval"):
            make(walk_interval=-0.5)
        with pytest.raises(ValueError, match="watchdog="):
            make(watchdog=Watchdog(export=False), fix=True)
    assert type(llama) is cls  # a refused watch leaves the model alone

    with pytest.raises(TypeError, match="watch_step"):
        watch_model(lambda inputs, cache=None: inputs)
    with pytest.raises(TypeError, match="callable"):
        watch_step(42, cache=[])
    with pytest.raises(TypeError, match="without a model"):
        watch(generate, export=False)(None, None, PROMPT)


def test_metrics_port_serves_the_decorators_watchdog(llama):
    wrapped = watch(generate_step, metrics_port=0, name="attach-metrics-test")
    server = wrapped.metrics_server
    try:
        assert server.addr == "127.0.0.1" and server.port > 0
        list(wrapped(mx.array(PROMPT), llama, max_tokens=3, logits_processors=[no_eos]))
        with urllib.request.urlopen(server.url, timeout=10) as response:
            text = response.read().decode()
        line = next(
            row
            for row in text.splitlines()
            if row.startswith("mlx_watchdog_steps_total{") and 'watchdog="attach-metrics-test"' in row
        )
        assert float(line.rsplit(" ", 1)[1]) == 3 + FORWARDS_BEFORE_FIRST_TOKEN
    finally:
        server.close()


# --------------------------------------------------------------------------- watch_model


def test_watch_model_is_still_the_same_module():
    model, cls = _model("qwen3_next", 4)
    params = tree_flatten(model.parameters())
    keys, children, attributes = set(model.keys()), set(model.children()), set(vars(model))
    layers = model.layers
    cache_types = [type(c) for c in model.make_cache()]
    weights = dict(params)
    sanitized = model.sanitize(dict(weights))

    wd = Watchdog(export=False)
    assert watch_model(model, wd) is model
    assert isinstance(model, cls) and isinstance(model, nn.Module)
    assert type(model) is not cls and type(model).__bases__ == (cls,)
    assert (type(model).__name__, type(model).__qualname__, type(model).__module__) == (
        cls.__name__,
        cls.__qualname__,
        cls.__module__,
    )
    # No watchdog state in the module: same keys, children, attributes and parameter arrays.
    assert set(model.keys()) == keys and set(model.children()) == children
    assert set(vars(model)) == attributes
    after = tree_flatten(model.parameters())
    assert [k for k, _ in after] == [k for k, _ in params]
    assert all(a is b for (_, a), (_, b) in zip(after, params))
    assert len(tree_flatten(model.trainable_parameters())) == len(params)
    assert len(model.layers) == len(layers) and all(a is b for a, b in zip(model.layers, layers))
    assert [type(c) for c in model.make_cache()] == cache_types
    resanitized = model.sanitize(dict(weights))
    assert resanitized.keys() == sanitized.keys()
    assert all(mx.array_equal(resanitized[k], sanitized[k]).item() for k in sanitized)
    model.load_weights(list(weights.items()))  # nn.Module methods still work
    assert wd.name == "qwen3_next" and wd.forecast().parameter_buffers == len(params)

    assert unwatch_model(model) is model
    assert type(model) is cls and watched_state(model) is None
    assert unwatch_model(model) is model  # unwatching twice is harmless


def test_watch_model_observes_a_custom_loop(llama):
    def decode(cache, n=20):
        logits = llama(mx.array([PROMPT]), cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        out = [y.item()]
        for _ in range(n):
            logits = llama(y[:, None], cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1)
            out.append(y.item())
        return out

    plain = decode(make_prompt_cache(llama))
    wd = Watchdog(export=False, overhead_budget=1.0, walk_interval=0)
    watch_model(llama, wd)
    prefills = []
    watched_state(llama).prefill_hooks.append(lambda w, inputs, output: prefills.append(inputs.shape))
    cache = make_prompt_cache(llama)
    assert decode(cache) == plain
    assert wd.steps == 21
    assert prefills == [(1, len(PROMPT))]  # multi-token forwards only
    llama(mx.array([PROMPT]))  # no cache: not a decode step
    assert wd.steps == 21
    llama(mx.array([[3]]), cache)  # the cache passed positionally
    assert wd.steps == 22
    f = wd.forecast()
    assert f.buffers_per_step < 0.01 and f.leaks == ()
    assert f.cache_buffers > 0 and f.step == 22


def test_double_watch_swaps_the_watchdog(llama):
    cls = type(llama)
    first, second = Watchdog(export=False), Watchdog(export=False)
    watch_model(llama, first)
    subclass = type(llama)
    cache = make_prompt_cache(llama)
    llama(mx.array([PROMPT]), cache=cache)
    watch_model(llama, second)
    assert type(llama) is subclass and type(llama).__bases__ == (cls,)  # not nested
    llama(mx.array([[1]]), cache=cache)
    llama(mx.array([[2]]), cache=cache)
    assert (first.steps, second.steps) == (1, 2)
    unwatch_model(llama)
    assert type(llama) is cls


def test_copies_and_pickles_of_a_watched_model_are_plain_models(llama):
    cls = type(llama)
    wd = Watchdog(export=False)
    watch_model(llama, wd)
    for clone in (copy.deepcopy(llama), pickle.loads(pickle.dumps(llama))):
        assert type(clone) is cls and watched_state(clone) is None
        ours, theirs = tree_flatten(llama.parameters()), tree_flatten(clone.parameters())
        assert [k for k, _ in ours] == [k for k, _ in theirs]
        assert all(a is not b and mx.array_equal(a, b).item() for (_, a), (_, b) in zip(ours, theirs))
        clone(mx.array([PROMPT]), cache=make_prompt_cache(clone))
    assert wd.steps == 0  # the clones are not observed
    assert watched_state(llama).watchdog is wd  # the original still is
    llama(mx.array([PROMPT]), cache=make_prompt_cache(llama))
    assert wd.steps == 1


def test_watch_model_counts_the_live_batched_leak_and_stream_generate_is_flat(hybrid, tokenizer):
    wd = Watchdog(limit=200_000, export=False)
    watch_model(hybrid, wd)
    tokens = batched_tokens(hybrid, 100, tiny.tiny_prompts(2, 6))  # equal lengths: left padding leaks
    assert len(tokens) == 100 and wd.steps >= 100
    f = wd.forecast()
    assert f.buffers_per_step == pytest.approx(8, rel=0.05)
    assert f.leaks[0].site == "ArraysCache.left_padding"
    assert f.leaks[0].buffers_per_step == pytest.approx(8, rel=0.05)
    assert math.isfinite(f.steps_to_limit)

    flat = Watchdog(limit=200_000, export=False)
    watch_model(hybrid, flat)  # the same model, another watchdog
    steps_before = wd.steps
    responses = list(stream_generate(hybrid, tokenizer, PROMPT, max_tokens=100, logits_processors=[no_eos]))
    assert len(responses) == 100
    assert wd.steps == steps_before and flat.steps == 100 + FORWARDS_BEFORE_FIRST_TOKEN
    f = flat.forecast()
    assert f.buffers_per_step < 0.01 and f.leaks == ()
    assert math.isinf(f.steps_to_limit)


# --------------------------------------------------------------------------- watch_step


class Countdown:
    """A cache whose ``value`` is rebound each step to a lazy ``value - 1``: one buffer per step."""

    def __init__(self):
        self.value = mx.array(1_000_000)
        mx.eval(self.value)


def test_watch_step_observes_the_cache_before_each_call():
    cache = Countdown()
    seen = []

    def step(k):
        """One step."""
        seen.append(k)
        cache.value = cache.value - 1

    watched = watch_step(step, cache=cache, limit=5000, overhead_budget=1.0, walk_interval=0, export=False)
    assert watched.__name__ == "step" and watched.__doc__ == "One step."
    assert inspect.signature(watched) == inspect.signature(step)
    for k in range(40):
        assert watched(k) is None
    assert seen == list(range(40)) and watched.watchdog.steps == 40
    f = watched.watchdog.forecast()
    assert f.buffers_per_step == pytest.approx(1.0)
    assert f.leaks[0].site == "Countdown.value"
    assert f.steps_to_limit == pytest.approx(5000 - f.resident_buffers, abs=1)  # one buffer a step
    assert not is_evaluated(cache.value)


def test_watch_step_fix_cuts_the_chain_and_shares_a_watchdog():
    cache = Countdown()
    wd = Watchdog(limit=5000, fix=True, fix_every=1, export=False)

    def step():
        cache.value = cache.value - 1

    watched = watch_step(step, cache, watchdog=wd)
    assert watched.watchdog is wd
    for _ in range(40):
        watched()
    assert wd.materialized_arrays > 0
    assert account([cache.value]).pending_nodes <= 2  # the chain was cut, not 40 long
    assert cache.value.item() == 1_000_000 - 40  # and the values are unchanged


def test_watch_step_around_a_model_step(llama):
    cls = type(llama)
    cache = make_prompt_cache(llama)
    forward = watch_step(lambda y: llama(y, cache=cache), cache=cache, export=False)
    logits = forward(mx.array([PROMPT]))
    for _ in range(10):
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)  # a real decode evaluates each token: the cache stays flat
        logits = forward(y[:, None])
    assert forward.watchdog.steps == 11
    f = forward.watchdog.forecast()
    assert f.cache_buffers > 0 and f.buffers_per_step < 0.01 and f.leaks == ()
    assert type(llama) is cls  # watch_step leaves the model alone


# --------------------------------------------------------------------------- threads


def test_forecast_from_another_thread_during_a_batched_decode(hybrid):
    wd = Watchdog(limit=200_000, overhead_budget=1.0, walk_interval=0, export=False)  # walk every step
    watch_model(hybrid, wd)
    errors, forecasts = [], []
    done = threading.Event()

    # The decode runs on this thread, as a program's does; an exporter's thread reads. (A thread
    # that decoded through mlx-lm's compiled functions aborts the process when it ends on mlx 0.31.)
    def read():
        try:
            while not done.is_set():
                f = wd.forecast()
                forecasts.append(f)
                f.describe()
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=read, name="reader")
    reader.start()
    try:
        batched_tokens(hybrid, 60, tiny.tiny_prompts(2, 6, seed=3))
    finally:
        done.set()
        reader.join(timeout=120)
    assert not reader.is_alive() and not errors
    assert len(forecasts) > 10 and wd.internal_errors == 0
    steps = [f.step for f in forecasts]
    assert steps == sorted(steps)  # never goes back
    for f in forecasts:
        assert f.measured_step <= f.step <= wd.steps
        assert f.resident_buffers >= f.parameter_buffers
        assert f.buffers_per_step >= 0
        assert (f.buffers_per_step <= 1e-9) == math.isinf(f.steps_to_limit)
        assert list(f.leaks) == sorted(f.leaks, key=lambda leak: -leak.buffers_per_step)
    assert forecasts[-1].step > forecasts[0].step
    assert wd.forecast().buffers_per_step == pytest.approx(8, rel=0.05)


def test_overlapping_decorated_calls_keep_the_model_watched_until_the_last_ends():
    import threading as _threading

    from mlx_watchdog import watch as _watch

    model = tiny.build_model("llama", layers=2)
    original = type(model)
    entered, release = _threading.Barrier(2), _threading.Event()

    @_watch(limit=10_000)
    def hold(model, tokenizer, prompt, prompt_cache=None):
        entered.wait(timeout=10)
        release.wait(timeout=10)
        return type(model) is not original

    results = []
    workers = [_threading.Thread(target=lambda: results.append(hold(model, None, None))) for _ in range(2)]
    for w in workers:
        w.start()
    release.set()
    for w in workers:
        w.join(timeout=30)
    assert results == [True, True]
    assert type(model) is original


@pytest.mark.parametrize("fix", [False, True])
def test_the_last_output_is_held_only_for_the_fix(llama, fix):
    """The fix waits until the program has evaluated its last output, so it holds that output for
    one step; without the fix nothing needs it, and a prefill chunk's logits (tokens x vocabulary)
    must not outlive the program's own reference."""
    watch_model(llama, Watchdog(export=False, fix=fix))
    try:
        cache = make_prompt_cache(llama)
        out = llama(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache)
        held = watched_state(llama).last_output
        assert (held is out) if fix else (held is None)
    finally:
        unwatch_model(llama)
