"""Prefill guard: chunk graphs measured before evaluation, the safe chunk, the stop, the adapted step."""

from __future__ import annotations

import argparse
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_watchdog import ResourceLimitForecast, Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model, watched_state
from mlx_watchdog.attach.prefill import PrefillGuard, install, installed_guard, safe_prefill_report
from mlx_watchdog.attach.server import ServerPrefillAdapter, adapt_server_prefill
from mlx_watchdog.core.arrays import find_arrays
from mlx_watchdog.core.chunks import UNBOUNDED_TOKENS, LineFit, fit_line, largest_safe_chunk, measure_chunk
from mlx_watchdog.core.graph import graph_size, is_evaluated
from mlx_watchdog.tiny import build_model

LENGTHS = (16, 32, 64, 128)
# dense, hybrid (linear attention every 3 of 4 layers), MoE with 32 experts; all float32
MODELS = {"llama": 2, "qwen3_next": 4, "qwen3_moe": 2}


@pytest.fixture(params=list(MODELS))
def model(request):
    m = build_model(request.param, layers=MODELS[request.param])
    yield m
    unwatch_model(m)


@pytest.fixture(params=["llama", "qwen3_moe"])
def flat_model(request):
    m = build_model(request.param, layers=MODELS[request.param])
    yield m
    unwatch_model(m)


@pytest.fixture
def hybrid4():
    """A 4-layer tiny qwen3_next (3 linear-attention layers), not conftest's 12-layer ``hybrid``."""
    m = build_model("qwen3_next", layers=4)
    yield m
    unwatch_model(m)


def tokens(n: int, batch: int = 1) -> mx.array:
    return mx.zeros((batch, n), dtype=mx.int32)


def run_chunk(model, cache, n: int):
    """One prefill chunk the way mlx-lm runs it: forward, then evaluate the output and cache."""
    out = model(tokens(n), cache=cache)
    mx.eval(out, [a for _, a in find_arrays(cache)])
    return out


def fitted_total(measurements) -> tuple[float, float]:
    """(intercept, slope) of nodes + buffers per chunk, fitted here independently of the guard."""
    x = np.array([m.tokens for m in measurements], dtype=float)
    nodes = np.array([m.nodes for m in measurements], dtype=float)
    buffers = np.array([m.buffers for m in measurements], dtype=float)
    n_slope, n_icpt = np.polyfit(x, nodes, 1)
    b_slope, b_icpt = np.polyfit(x, buffers, 1)
    return n_icpt + b_icpt, n_slope + b_slope


def limit_for(model, target_tokens: int, safety: float = 0.5) -> int:
    """A limit whose safe chunk is about ``target_tokens`` (from an unevaluated dry run)."""
    report = safe_prefill_report(model, lengths=LENGTHS)
    predicted = (
        report["nodes_intercept"]
        + report["buffers_intercept"]
        + target_tokens * (report["nodes_per_token"] + report["buffers_per_token"])
    )
    return int((report["resident_buffers"] + predicted) / safety)


# ------------------------------------------------------------------ fits


def test_fit_line_exact_proportional_and_falling():
    line = fit_line([(10, 120), (20, 220), (40, 420)])
    assert line.slope == pytest.approx(10) and line.intercept == pytest.approx(20)
    assert line.r2 == pytest.approx(1.0)
    one = fit_line([(32, 640)])
    assert one.slope == pytest.approx(20) and one.intercept == 0 and math.isnan(one.r2)
    falling = fit_line([(16, 800), (256, 600)])
    assert falling.flat and falling.slope == 0 and falling.intercept == 800  # never extrapolate a fall
    flat = fit_line([(16, 615), (64, 615), (128, 615)])
    assert flat.flat and flat.slope == 0 and flat.intercept == 615 and flat.r2 == 1.0
    step = fit_line([(16, 791), (32, 823), (64, 823), (128, 823)])  # a one-time step, not growth
    assert step.flat and step.intercept == 823 and step.r2 < 0.5
    close = fit_line([(16, 791), (24, 823)])  # lengths too close to call it flat
    assert not close.flat and close.slope == pytest.approx(4)
    for bad in ([], [(0, 5)], [(10, float("nan"))], [(1, 2, 3)]):
        with pytest.raises(ValueError):
            fit_line(bad)


@pytest.mark.parametrize(
    "intercept,slope,budget", [(100, 3.5, 1000), (0, 1, 7), (50, 0, 49), (50, 0, 50), (10, 2, 5)]
)
def test_largest_safe_chunk_is_the_last_size_under_the_budget(intercept, slope, budget):
    nodes = LineFit(intercept * 0.8, slope * 0.9, 1.0, 2)
    buffers = LineFit(intercept * 0.2, slope * 0.1, 1.0, 2)
    safe = largest_safe_chunk(nodes, buffers, budget, ceiling=10_000)
    total = lambda n: nodes.at(n) + buffers.at(n)  # noqa: E731
    brute = max([n for n in range(0, 10_001) if total(n) <= budget], default=0)
    if slope == 0:
        brute = 10_000 if total(1) <= budget else 0
    assert safe == brute


# ------------------------------------------------------------------ linear graphs


def test_graph_size_is_linear_in_chunk_length(model):
    report = safe_prefill_report(model, lengths=LENGTHS)
    points = report["measurements"]
    assert [p["tokens"] for p in points] == list(LENGTHS)
    # The report walks the same graph as a direct walk of one chunk's output and cache.
    cache = make_prompt_cache(model)
    out = model(tokens(64), cache=cache)
    assert graph_size([out] + [a for _, a in find_arrays(cache)]) == (
        points[2]["nodes"],
        points[2]["buffers"],
    )
    nodes = np.array([p["nodes"] for p in points], dtype=float)
    print(
        f"{model.model_type}: {report['nodes_per_token']:.2f} nodes/token, intercept "
        f"{report['nodes_intercept']:.0f}, r2 {report['nodes_r2']:.5f}, nodes {nodes.astype(int).tolist()}"
    )
    fit = report["nodes_intercept"] + report["nodes_per_token"] * np.array(LENGTHS)
    assert np.max(np.abs(fit - nodes) / nodes) < 0.05  # every point on the line
    if model.model_type == "qwen3_next":
        # CPU runs the gated delta recurrence as ops, one group per token and linear layer.
        assert report["nodes_r2"] > 0.999
        assert report["nodes_per_token"] > 10
        assert report["bounded"] and 0 < report["max_safe_prefill_tokens"] < UNBOUNDED_TOKENS
    else:
        # Dense and MoE forwards are vectorized over tokens: 8 times the tokens, about the same
        # graph (an MoE may switch to sorted routing once, a fixed step of a few nodes).
        assert abs(report["nodes_per_token"]) < 1
        assert nodes[-1] <= 1.25 * nodes[0]
    assert abs(report["buffers_per_token"]) < 0.5  # evaluated inputs are the weights, not tokens


def test_report_evaluates_nothing_and_skips_what_cannot_fit(hybrid4):
    wd = Watchdog(export=False)
    watch_model(hybrid4, wd)
    report = safe_prefill_report(hybrid4, lengths=(16, 32, 64, 1024))
    assert wd.steps == 0  # the report bypasses the watched forward
    assert report["skipped_lengths"] == []
    small = report["measurements"][1]["nodes"] + report["measurements"][1]["buffers"]
    # A limit that fits the 32-token graph but not a 1024-token one: that one is never built.
    tight = safe_prefill_report(hybrid4, limit=report["resident_buffers"] + 2 * small, lengths=(16, 32, 1024))
    assert tight["skipped_lengths"] == [1024]
    assert [m["tokens"] for m in tight["measurements"]] == [16, 32]
    assert tight["max_safe_prefill_tokens"] < 32  # half the limit cannot hold the 32-token chunk
    for bad in ((), (1,), (16, "x"), 5):
        with pytest.raises(ValueError):
            safe_prefill_report(hybrid4, lengths=bad)
    with pytest.raises(ValueError):
        safe_prefill_report(hybrid4, safety=1.5)


# ------------------------------------------------------------------ the guard on a watched model


def test_safe_chunk_from_a_configured_small_limit(hybrid4):
    limit = limit_for(hybrid4, 96)
    wd = Watchdog(limit=limit, export=False)
    sizes: list[int] = []
    guard = install(wd, hybrid4, on_safe_size=sizes.append)
    assert watched_state(hybrid4).watchdog is wd
    cache = make_prompt_cache(hybrid4)
    for n in (16, 32, 64, 64):
        run_chunk(hybrid4, cache, n)
    safe = guard.safe_tokens
    assert wd.prefill_guard is guard  # the watchdog's forecast reads the guard installed on it
    assert wd.forecast().max_safe_prefill_tokens == safe == sizes[-1]
    assert wd.forecast().prefill_graph_nodes == guard.graph_nodes == guard.measurements[-1].nodes
    assert guard.nodes_fit.points == 3
    # Each new length is walked once (the limit is near, so the fit is refined); the
    # repeated length is not walked again.
    assert [(m.tokens, m.live) for m in guard.measurements] == [(16, True), (32, True), (64, True)]
    assert guard.walks == 3 and guard.chunks == 4
    # Check against the fitted line: the largest chunk whose predicted buffers fit the budget.
    icpt, slope = fitted_total(guard.measurements)
    budget = 0.5 * limit - wd.forecast().resident_buffers
    assert icpt + slope * safe <= budget + 1e-6 < icpt + slope * (safe + 1)
    assert 48 <= safe <= 192  # the limit was chosen for about 96 tokens


def test_flat_graph_is_safe_at_any_size_or_none(flat_model):
    model = flat_model
    report = safe_prefill_report(model, lengths=LENGTHS)
    chunk = max(m["nodes"] + m["buffers"] for m in report["measurements"])
    for limit, expected in (
        (2 * (report["resident_buffers"] + chunk) + 1000, UNBOUNDED_TOKENS),
        (2 * report["resident_buffers"] + chunk, 0),
    ):
        wd = Watchdog(limit=limit, export=False)
        guard = install(wd, model)
        cache = make_prompt_cache(model)
        for n in LENGTHS:
            run_chunk(model, cache, n)
        assert guard.safe_tokens == expected == wd.forecast().max_safe_prefill_tokens


@pytest.mark.parametrize("near", [True, False])
def test_walks_once_per_length_and_predicts_between(hybrid4, near):
    wd = Watchdog(limit=limit_for(hybrid4, 100) if near else None, export=False)
    guard = install(wd, hybrid4)
    cache = make_prompt_cache(hybrid4)
    for n in (32, 32, 32, 16, 64, 48, 48):
        run_chunk(hybrid4, cache, n)
    assert guard.chunks == 7
    if near:
        # Near the limit shorter lengths refine the fit until it is trusted; 48 is predicted.
        assert [m.tokens for m in guard.measurements] == [16, 32, 64] and guard.walks == 3
        fresh = make_prompt_cache(hybrid4)
        measured = measure_chunk(48, hybrid4(tokens(48), cache=fresh), fresh)
        assert guard.predicted_buffers(48) == pytest.approx(measured.predicted_buffers, rel=0.02)
    else:
        # Far from it only longer chunks than any seen are walked.
        assert [m.tokens for m in guard.measurements] == [32, 64] and guard.walks == 2
        assert guard.safe_tokens > 4 * 64
    assert guard.walk_seconds > 0 and wd.overhead_seconds >= guard.walk_seconds


def test_decode_steps_and_batches_are_measured_by_chunk_length(hybrid4):
    wd = Watchdog(export=False)
    guard = install(wd, hybrid4)
    cache = make_prompt_cache(hybrid4)
    run_chunk(hybrid4, cache, 1)  # a decode step: not a prefill
    assert guard.chunks == 0
    batch_cache = make_prompt_cache(hybrid4)
    out = hybrid4(tokens(32, batch=3), cache=batch_cache)
    mx.eval(out)
    assert guard.chunks == 1 and 32 in [m.tokens for m in guard.measurements]


# ------------------------------------------------------------------ stop before evaluation


def capture_outputs(model, wd):
    """A prefill hook placed before the guard's: it sees the output the guard then judges."""
    seen = []
    watch_model(model, wd)
    watched_state(model).prefill_hooks.append(lambda w, inputs, output: seen.append(output))
    return seen


def test_raises_before_the_chunk_is_evaluated(model):
    report = safe_prefill_report(model, lengths=(64,))
    chunk = report["measurements"][0]["nodes"] + report["measurements"][0]["buffers"]
    wd = Watchdog(limit=report["resident_buffers"] + chunk // 2, stop_within=0, export=False)
    outputs = capture_outputs(model, wd)
    sizes: list[int] = []
    install(wd, model, on_safe_size=sizes.append)
    cache = make_prompt_cache(model)
    with pytest.raises(ResourceLimitForecast) as caught:
        model(tokens(64), cache=cache)
    assert caught.value.reason == "prefill" and wd.stops["prefill"] == 1
    assert "stopped the prefill before evaluating it" in str(caught.value)
    if model.model_type == "qwen3_next":
        # The graph grows: a smaller chunk fits, and the message names it.
        safe = caught.value.safe_prefill_tokens
        assert 0 < safe < 64 and f"prefill_step_size={safe}" in str(caught.value)
    else:
        # A flat graph: no chunk size is smaller than its fixed cost, and the message says so.
        assert caught.value.safe_prefill_tokens == 0
        assert "no chunk size fits" in str(caught.value)
    assert sizes[-1] == caught.value.safe_prefill_tokens
    # Nothing of the chunk was evaluated: not the output, not one cache update.
    assert len(outputs) == 1 and not is_evaluated(outputs[0])
    cache_arrays = [a for _, a in find_arrays(cache)]
    assert cache_arrays and not any(is_evaluated(a) for a in cache_arrays)


def test_stop_names_the_safe_step_size_and_it_works(hybrid4):
    limit = limit_for(hybrid4, 64)
    wd = Watchdog(limit=limit, stop_within=0, export=False)
    outputs = capture_outputs(hybrid4, wd)
    guard = install(wd, hybrid4)
    cache = make_prompt_cache(hybrid4)
    run_chunk(hybrid4, cache, 16)  # fits: evaluated normally
    with pytest.raises(ResourceLimitForecast) as caught:
        hybrid4(tokens(512), cache=cache)
    safe = caught.value.safe_prefill_tokens
    assert safe == guard.safe_tokens and 16 < safe < 512
    assert f"prefill_step_size={safe}" in str(caught.value)
    assert caught.value.predicted_buffers > limit - caught.value.forecast.resident_buffers
    assert not is_evaluated(outputs[-1])
    # The caller retries with the advised step size on a fresh cache: no stop.
    retry = make_prompt_cache(hybrid4)
    for start in range(0, 512, safe):
        run_chunk(hybrid4, retry, min(safe, 512 - start))
    assert wd.stops["prefill"] == 1


def test_no_stop_without_stop_within(hybrid4):
    report = safe_prefill_report(hybrid4, lengths=(32,))
    chunk = report["measurements"][0]["nodes"] + report["measurements"][0]["buffers"]
    wd = Watchdog(limit=report["resident_buffers"] + chunk // 2, export=False)
    guard = install(wd, hybrid4)
    out = run_chunk(hybrid4, make_prompt_cache(hybrid4), 32)
    assert is_evaluated(out) and guard.safe_tokens < 32 and not wd.stops


def test_guard_never_breaks_the_forward(hybrid4):
    wd = Watchdog(export=False)

    def broken(tokens):
        raise RuntimeError("callback bug")

    guard = install(wd, hybrid4, on_safe_size=broken)
    out = run_chunk(hybrid4, make_prompt_cache(hybrid4), 16)
    assert is_evaluated(out) and guard.internal_errors == 1 and wd.internal_errors == 1
    guard.check_chunk(object(), None)  # no shape, nothing to measure: counted, not raised
    assert guard.internal_errors == 2
    with pytest.raises(ValueError):
        PrefillGuard(wd, safety=0)
    with pytest.raises(ValueError):
        PrefillGuard("not a watchdog")


def test_install_replaces_and_remove_detaches(hybrid4):
    wd = Watchdog(export=False)
    first = install(wd, hybrid4)
    second = install(wd, hybrid4)
    hooks = watched_state(hybrid4).prefill_hooks
    assert len(hooks) == 1 and installed_guard(hybrid4) is second
    run_chunk(hybrid4, make_prompt_cache(hybrid4), 16)
    assert first.chunks == 0 and second.chunks == 1
    second.remove()
    assert installed_guard(hybrid4) is None and hooks == []


# ------------------------------------------------------------------ the server path


def test_adapt_server_prefill_targets():
    args = argparse.Namespace(prefill_step_size=2048)
    assert adapt_server_prefill(args, 512, 2048) == 512 and args.prefill_step_size == 512
    assert adapt_server_prefill(args, 4096, 2048) == 2048  # never above the user's size
    assert adapt_server_prefill(args, 0, 2048) == 1  # a step of 0 would never advance

    class Provider:
        cli_args = argparse.Namespace(prefill_step_size=2048)

    assert adapt_server_prefill(Provider(), 300, 2048) == 300 and Provider.cli_args.prefill_step_size == 300
    with pytest.raises(ValueError):
        adapt_server_prefill(object(), 300, 2048)
    with pytest.raises(ValueError):
        adapt_server_prefill(args, -1, 2048)


@pytest.mark.parametrize("calibrate", [(), (16, 32, 64)])
def test_server_batch_generator_adopts_the_safe_step(hybrid4, calibrate):
    import mlx_lm.server as server

    limit = limit_for(hybrid4, 40)
    wd = Watchdog(limit=limit, export=False)
    chunks: list[int] = []
    watch_model(hybrid4, wd)
    watched_state(hybrid4).prefill_hooks.append(lambda w, inputs, output: chunks.append(inputs.shape[1]))
    cli_args = argparse.Namespace(prefill_step_size=128)
    original = server.BatchGenerator
    adapter = ServerPrefillAdapter(cli_args).attach(server)
    try:
        applied: list[int] = []
        guard = install(wd, hybrid4, lambda n: applied.append(adapter(n)), calibrate=calibrate)
        # What mlx_lm.server does when it makes its batch generator.
        generator = server.BatchGenerator(hybrid4, max_tokens=2, prefill_step_size=cli_args.prefill_step_size)
        assert adapter.generators == [generator]
        generator.insert([[5] * 300])
        for _ in range(50):  # bounded: 2 tokens after the prompt's chunks
            if not generator.next_generated():
                break
        generator.close()
    finally:
        adapter.detach()
    assert server.BatchGenerator is original
    safe = guard.safe_tokens
    assert 8 < safe < 128 and cli_args.prefill_step_size == safe == adapter.applied == applied[-1]
    assert generator.prefill_step_size == safe
    assert sum(chunks) == 299  # the last prompt token starts the decode
    print("chunks", chunks, "applied", applied)
    if calibrate:
        assert chunks[0] == applied[0]  # calibrated before the first request: no oversized chunk
    else:
        assert chunks[0] == 128  # measured at the first chunk, lowered from the next one
    # Every later chunk follows the size applied while it ran: the final safe size, once the
    # fit rests on live chunks only.
    assert all(n <= max(applied) for n in chunks[1:])
    assert all(n == safe for n in chunks[2:-1]) and chunks[-1] <= safe
