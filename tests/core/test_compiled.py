"""Compiled functions (``mx.compile``): one cache entry per input signature, kept for the function's
life. The instrumentor counts traces and signatures, measures the buffers an entry keeps, and a
watchdog reads a function fed ever new shapes as a leak site named after it; training steps are
watched per step and a stop saves the adapters first.

The truth is MLX itself: the exact live-buffer count (``exact_buffers``) for the growth, and the
function's own body (it runs only when MLX traces) for the traces."""

from __future__ import annotations

import gc
import logging
import random
import subprocess
import sys
import textwrap
import types
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog import ResourceLimitForecast, Watchdog, watch_step
from mlx_watchdog.attach import compiled, training
from mlx_watchdog.core import compiled as registry
from mlx_watchdog.exporters.prometheus import WatchdogCollector

pytestmark = pytest.mark.mlx_lm_neutral  # MLX alone: nothing differs between mlx-lm versions

PATCHED = ("compile", "disable_compile", "enable_compile", "grad", "value_and_grad", "vmap", "vjp", "jvp")
STEPS = 40  # steps of a training loop; its growth is read from WARM on
WARM = 5  # the first steps also make the optimizer's state
TOLERANCE = 0.15


@pytest.fixture
def instrumented():
    originals = {name: getattr(mx, name) for name in PATCHED}
    gc.collect()  # the compiled functions of a test before are gone, and their entries with them
    assert compiled.instrument()
    yield compiled
    gc.collect()
    training.uninstrument()
    compiled.uninstrument()
    assert {name: getattr(mx, name) for name in PATCHED} == originals


def loss_fn(model, x):
    return nn.losses.cross_entropy(model(x[:, :-1]), x[:, 1:]).mean()


def training_step(seed: int = 0):
    """A small model, Adam, and its training step compiled as MLX's examples and mlx-lm do."""
    mx.random.seed(seed)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64))
    mx.eval(model.parameters())
    optimizer = optim.Adam(1e-3)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state, mx.random.state]
    traces: list = []

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x):
        traces.append(x.shape)  # its body runs only when MLX traces
        loss, grads = loss_and_grad(model, x)
        optimizer.update(model, grads)
        return loss

    train_step.traces = traces  # type: ignore[attr-defined]
    return model, optimizer, state, train_step


def batch(length: int) -> mx.array:
    x = mx.random.randint(0, 64, (2, length))
    mx.eval(x)
    return x


def run_loop(step, state, lengths, counter) -> list[int]:
    """One call per length, the state evaluated after each (as a trainer does); the exact live
    buffers after each step."""
    live = []
    for n in lengths:
        x = batch(n)
        loss = step(x)
        mx.eval(state, loss)
        del x, loss
        live.append(counter.live())
    return live


def growth(live: list[int]) -> float:
    """The exact growth per step from step WARM on."""
    return (live[-1] - live[WARM]) / (len(live) - 1 - WARM)


# --------------------------------------------------------------------------- instrumenting


def test_importing_patches_nothing_and_uninstrument_restores_every_function_exactly():
    code = textwrap.dedent(
        f"""
        import sys
        from mlx_watchdog.attach import compiled, training
        import mlx_watchdog
        assert compiled.instrument()
        assert "mlx.core" not in sys.modules      # waits for the program to import it
        import mlx.core as mx
        assert mx.compile.__wrapped__ is not None  # ours, around MLX's
        compiled.uninstrument()
        assert not any(type(f).__module__ == "mlx_watchdog.attach.compiled" for f in sys.meta_path)
        names = {PATCHED!r}
        before = {{name: getattr(mx, name) for name in names}}
        import mlx_watchdog.attach.loaders, mlx_watchdog.core.compiled
        assert {{name: getattr(mx, name) for name in names}} == before   # importing patches nothing
        assert compiled.instrument() and not compiled.instrument()   # idempotent
        assert all(getattr(mx, name) is not before[name] for name in names)
        compiled.uninstrument()
        compiled.uninstrument()
        assert {{name: getattr(mx, name) for name in names}} == before
        assert all(type(getattr(mx, name)).__module__ == "nanobind" for name in names)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def test_a_function_wrapped_again_after_instrument_keeps_the_other_wrapper(caplog):
    original = mx.compile
    assert compiled.instrument()
    ours = mx.compile
    theirs = lambda *args, **kwargs: ours(*args, **kwargs)  # noqa: E731
    mx.compile = theirs
    try:
        with caplog.at_level(logging.WARNING, logger="mlx_watchdog"):
            compiled.uninstrument()
        assert mx.compile is theirs and "mx.compile was wrapped again" in caplog.text
        assert not hasattr(mx.grad, "__wrapped__") and not compiled.instrumented()
    finally:
        mx.compile = original


# --------------------------------------------------------------------------- traces and signatures


def test_entries_are_counted_as_mlx_keys_its_cache(instrumented):
    bodies = []

    @mx.compile
    def f(x, n, scale=1.0, extra=None, flags=None):
        bodies.append(1)  # runs only when MLX traces
        return x * scale + n

    calls = [
        ((mx.ones((2, 3)), 1), {}),
        ((mx.ones((2, 3)), 1), {}),  # same: a cache hit
        ((mx.ones((2, 4)), 1), {}),  # a new shape
        ((mx.ones((2, 3)), 2), {}),  # a new int
        ((mx.ones((2, 3), dtype=mx.float16), 1), {}),  # a new dtype
        ((mx.ones((2, 3)), 1), {"scale": 2.0}),  # a new float
        ((mx.ones((2, 3)), 1), {"scale": 2.0}),
        ((mx.ones((2, 3)), True), {}),  # True is MLX's 1: the entry of n=1
        ((mx.ones((2, 3)), 1), {"extra": None}),  # a keyword tree of its own
        ((mx.ones((2, 3)), 1), {"flags": {"a": 1}}),
        ((mx.ones((2, 3)), 1), {"flags": {"a": 1}}),
    ]
    for args, kwargs in calls:
        mx.eval(f(*args, **kwargs))
    record = compiled.compiled_function(f)
    assert record is not None and record.site == f"compiled:{__name__}.f"
    assert record.traces == len(bodies) and record.entries == len(bodies) and record.retraces == 0

    @partial(mx.compile, shapeless=True)
    def g(x):
        bodies.append(1)
        return x + 1

    before = len(bodies)
    for shape in ((2,), (3,), (4,), (2, 2), (3, 5)):
        mx.eval(g(mx.ones(shape)))
    assert len(bodies) - before == 2  # shapeless: its number of dimensions only
    assert compiled.compiled_function(g).entries == 2


def test_calls_inside_a_trace_a_transform_or_with_compile_off_keep_no_entry(instrumented):
    bodies = []

    @mx.compile
    def helper(x):
        bodies.append(1)
        return mx.sin(x) * 2

    @mx.compile
    def outer(x):
        return helper(x) + 1

    for n in (3, 4, 5):
        mx.eval(outer(mx.ones((n,))))  # helper runs inside outer's traces: no entry of its own
    mx.eval(mx.grad(lambda x: helper(x).sum())(mx.ones((6,))))  # under a transform: none either
    mx.eval(mx.vmap(helper)(mx.ones((2, 7))))
    mx.disable_compile()
    try:
        for n in (8, 9):
            mx.eval(helper(mx.ones((n,))))  # MLX keeps nothing while compile is off
    finally:
        mx.enable_compile()
    record = compiled.compiled_function(helper)
    assert len(bodies) == 7 and record.traces == 0 and record.entries == 0
    mx.eval(helper(mx.ones((10,))))  # at the top: a real trace
    assert record.traces == 1 and record.entries == 1


def test_a_compiled_function_that_dies_takes_its_entries_along(instrumented):
    f = mx.compile(lambda x: x * 3.0 + 1.0)
    for n in (2, 3, 4):
        mx.eval(f(mx.ones((n,))))
    record = compiled.compiled_function(f)
    assert record.entries == 3 and record in registry.functions()
    del f
    assert record.entries == 0 and record not in registry.functions() and not record.alive


def test_a_helper_fed_lazy_inputs_is_measured_on_a_replay_that_runs_none_of_its_code(instrumented, counter):
    bodies = []

    @mx.compile
    def helper(x, scale):
        bodies.append(x.shape)  # runs only when MLX traces
        return mx.exp(x * 0.5) * scale + 2.0

    live = []
    for n in range(3, 3 + 12):
        x = mx.ones((n,))
        for _ in range(50):  # a long lazy graph in front of it, as a model's forward is
            x = x + 1.0
        y = helper(x, 3.0)
        mx.eval(y)
        del x, y
        live.append(counter.live())
    record = compiled.compiled_function(helper)
    assert len(bodies) == record.traces == record.entries == 12  # the replays traced nothing
    per_entry = (live[-1] - live[2]) / (len(live) - 3)
    assert per_entry >= 1 and record.entry_buffers == per_entry


# --------------------------------------------------------------------------- the leak, read


@pytest.mark.parametrize("fix", [False, True], ids=["watch", "fix"])
def test_a_compiled_step_fed_new_shapes_is_read_as_a_leak_named_after_it(instrumented, counter, fix):
    model, optimizer, state, train_step = training_step()
    watchdog = Watchdog(walk_interval=0, export=False, fix=fix, fix_every=1)
    step = watch_step(train_step, [optimizer.state, mx.random.state], watchdog=watchdog)
    lengths = list(range(8, 8 + STEPS))
    random.Random(0).shuffle(lengths)  # every step a new length: a steady leak
    live = run_loop(step, state, lengths, counter)
    exact = growth(live)
    record = compiled.compiled_function(train_step)
    forecast = watchdog.forecast()

    assert exact > 1  # the leak is real: MLX keeps every entry's constants
    assert record.entries == len(train_step.traces) == STEPS
    assert record.entry_buffers == pytest.approx(exact, rel=TOLERANCE)
    assert forecast.rate_known and forecast.buffers_per_step == pytest.approx(exact, rel=TOLERANCE)
    top = forecast.leaks[0]
    assert top.site == f"compiled:{__name__}.train_step" == record.site
    assert top.buffers_per_step == pytest.approx(exact, rel=TOLERANCE)
    assert top.signatures == STEPS and not top.cut  # the fix cuts nothing of it
    assert f"{record.site} +" in forecast.describe() and f"({STEPS} input signatures" in forecast.describe()
    assert registry.advice(forecast.leaks).startswith(record.site) and "shapeless=True" in registry.ADVICE


def test_a_compiled_step_fed_four_lengths_reads_no_leak(instrumented, counter):
    model, optimizer, state, train_step = training_step(seed=1)
    watchdog = Watchdog(walk_interval=0, export=False)
    step = watch_step(train_step, [optimizer.state, mx.random.state], watchdog=watchdog)
    live = run_loop(step, state, [8, 9, 10, 11] * (STEPS // 4), counter)
    forecast = watchdog.forecast()
    assert growth(live) == 0
    # MLX traced each length once, and the first once more: its first entry was keyed on the
    # captured state before the optimizer made its moments.
    assert compiled.compiled_function(train_step).entries == len(train_step.traces) == 5
    assert forecast.rate_known and forecast.buffers_per_step == 0
    assert not any(registry.is_compiled_site(leak.site) for leak in forecast.leaks)


def test_the_exporter_names_the_function_and_its_signatures(instrumented, counter, caplog):
    model, optimizer, state, train_step = training_step(seed=2)
    watchdog = Watchdog(name="compiled-export", walk_interval=0, export=False, warn_within=10**9)
    step = watch_step(train_step, [optimizer.state, mx.random.state], watchdog=watchdog)
    with caplog.at_level(logging.WARNING, logger="mlx_watchdog"):
        run_loop(step, state, range(8, 8 + 20), counter)
    record = compiled.compiled_function(train_step)
    reg = CollectorRegistry()
    reg.register(WatchdogCollector([watchdog]))
    text = generate_latest(reg).decode()
    samples = {
        (s.name, s.labels.get("function") or s.labels.get("site")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    name = record.name
    assert samples[("mlx_watchdog_compiled_signatures", name)] == record.entries == 20
    assert samples[("mlx_watchdog_compiled_entry_buffers", name)] == record.entry_buffers > 0
    assert samples[("mlx_watchdog_leak_buffers_per_step", record.site)] == pytest.approx(
        record.entry_buffers, rel=TOLERANCE
    )
    # The warning near the limit says what to do about it: not the fix.
    assert "shapeless=True" in caplog.text and record.site in caplog.text


# --------------------------------------------------------------------------- training loops


def test_a_training_step_is_watched_per_step_and_a_stop_saves_the_adapters_first(instrumented, tmp_path):
    adapter_file = tmp_path / "adapters.safetensors"
    assert training.instrument(limit=300, stop_within=10, walk_interval=0)
    model, optimizer, state, train_step = training_step(seed=3)
    model.freeze()
    model.layers[2].unfreeze()  # the trainable parameters: what is saved
    reached = []

    def train(args):  # a trainer's loop: its args.adapter_file, its iteration count `it`
        rank = 0
        for it in range(1, 200):
            loss = train_step(batch(7 + it))
            mx.eval(state, loss)
            reached.append((it, rank))

    with pytest.raises(ResourceLimitForecast) as stopped:
        train(types.SimpleNamespace(adapter_file=str(adapter_file)))
    error = stopped.value
    assert isinstance(error, training.TrainingStopped) and error.adapter_file == str(adapter_file)
    last = reached[-1][0]
    assert 10 < last < 190 and f"before iteration {last + 1}" in str(error)
    assert error.forecast.leaks[0].site == f"compiled:{__name__}.train_step"
    assert "shapeless=True" in str(error) and str(adapter_file) in str(error)
    # Saved before the stop: the trainable parameters as the last step left them.
    saved = mx.load(str(adapter_file))
    trainable = dict(tree_flatten(model.trainable_parameters()))
    assert set(saved) == set(trainable) == {"layers.2.weight", "layers.2.bias"}
    for key, value in trainable.items():
        assert np.array_equal(np.array(saved[key]), np.array(value)), key
    (watchdog,) = [wd for wd in _live() if wd.name == "Sequential"]
    assert watchdog.steps == last + 1 and watchdog.stops["forecast"] == 1


def test_training_steps_seconds_apart_are_steps_not_pauses(instrumented, fake_clock):
    assert training.instrument(walk_interval=0)
    model, optimizer, state, train_step = training_step(seed=4)
    for n in range(8, 8 + 12):
        fake_clock.now += 5.0  # each step takes 5 s: more than the 3 s after which decode steps pause
        loss = train_step(batch(n))
        mx.eval(state, loss)
    (watchdog,) = [wd for wd in _live() if wd.name == "Sequential"]
    forecast = watchdog.forecast()
    assert watchdog.steps == 12 and forecast.decoding and forecast.rate_known
    assert forecast.step_rate == pytest.approx(1 / 5)
    assert forecast.seconds_to_limit == pytest.approx(5 * forecast.steps_to_limit)
    assert forecast.leaks[0].site == f"compiled:{__name__}.train_step"
    del train_step
    gc.collect()  # the step died: nothing steps now, and its pace is forgotten
    assert not watchdog.forecast().decoding and watchdog.min_idle_seconds == 0


def test_a_function_compiled_without_a_model_is_not_a_training_step(instrumented):
    training.instrument()
    before = set(_live())
    key = [mx.random.key(0)]
    sample = partial(mx.compile, inputs=key, outputs=key)(lambda x: x + mx.random.uniform(shape=x.shape))
    mx.eval(sample(mx.ones((3,))))
    record = compiled.compiled_function(sample)
    assert record is not None and record.entries == 1
    assert set(_live()) == before  # no watchdog was made for it: nothing steps


def _live():
    from mlx_watchdog import live_watchdogs

    return live_watchdogs(unexported=True)
