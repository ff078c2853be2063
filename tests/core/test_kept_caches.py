"""A server's kept caches, against the exact live-buffer count.

A prefix or prompt cache may keep a finished request's cache list by reference (vllm-mlx's
``PrefixCacheManager`` stores ``CacheEntry(prompt_cache, 1)`` in its trie): caches the model ran
with, alive, no longer stepped, still carrying the pending chains their decode built. The stand-in
server here decodes each request as a batch through mlx-lm's ``BatchGenerator`` and keeps the
batch's cache list in a dict keyed by its tokens. Its kept caches must count in the resident
buffers, be named as kept, read as growth per request, be cut by the fix (nothing the program
never asked for computed), and a cache the server drops must leave nothing behind.
"""

from __future__ import annotations

import gc
import weakref

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.core.caches import KEPT_MARK
from mlx_watchdog.tiny import tiny_prompts

REQUESTS = 6
TOKENS = 40  # per request
LEAK = 8  # the conftest hybrid: 9 linear-attention layers leak 8 buffers a batched step
KEPT_SITE = "ArraysCache.left_padding" + KEPT_MARK


def batch_caches(gen: BatchGenerator) -> list:
    """The cache list the batch steps with (mlx-lm 0.32: ``_generation_batch.prompt_cache``;
    0.31: ``active_batch.cache``), copied: the batch clears it in place when it empties."""
    batch = getattr(gen, "_generation_batch", None)
    if batch is not None:
        return list(batch.prompt_cache)
    batch = getattr(gen, "active_batch", None)
    return list(batch.cache) if batch is not None else []


class PrefixCacheServer:
    """Serves one request at a time (two prompts of one length, batched: ``left_padding`` is
    stepped) and keeps each finished request's cache list by reference."""

    def __init__(self, model, watchdog: Watchdog):
        self.model, self.watchdog = model, watchdog
        self.kept: dict[tuple[int, ...], list] = {}

    def serve(self, seed: int, keep: bool = True) -> None:
        prompts = tiny_prompts(2, 6, 512, seed=seed)
        gen = BatchGenerator(self.model, max_tokens=TOKENS)
        gen.insert(prompts)
        caches, tokens = [], []
        while True:
            caches = batch_caches(gen) or caches
            responses = gen.next_generated()
            if not responses:
                break
            tokens.append(responses[0].token)
        gen.close()
        del gen
        if keep:
            self.kept[tuple(prompts[0] + tokens)] = caches
        del caches
        self.watchdog.generation_ended()  # as an attachment says it between requests


def kept_arrays(server: PrefixCacheServer) -> list[mx.array]:
    """Every array the kept caches hold, read through mlx-lm's own ``state`` (not the walk)."""
    arrays = tree_flatten([[c.state for c in caches] for caches in server.kept.values()])
    return list({id(a): a for _, a in arrays if isinstance(a, mx.array)}.values())


def run(counter, model, fix: bool):
    """Serve REQUESTS requests watched; rows of (watchdog step, exact count, resident read, read
    at that step) after each, counts above the count before the first."""
    # A budget that allows a reading at each request's end (when to read is not tested here): on
    # the fake clock (the caller's), steps 10 ms apart and walks free, on any machine.
    wd = Watchdog(limit=200_000, export=False, fix=fix, overhead_budget=0.1)
    watch_model(model, wd)
    server = PrefixCacheServer(model, wd)
    baseline = counter.live(collect=True)
    rows = []
    for request in range(REQUESTS):
        server.serve(seed=request)
        f = wd.forecast()
        true = counter.live(collect=True) - baseline
        rows.append((f.step, true, f.resident_buffers - f.parameter_buffers, f.measured_step == f.step))
    return wd, server, baseline, rows


def test_kept_caches_are_counted_named_and_read_as_growth_per_request(
    counter, hybrid, monkeypatch, fake_clock
):
    fake_clock.step_each_observe(monkeypatch, 0.01)
    wd, server, baseline, rows = run(counter, hybrid, fix=False)
    table = "\n".join(map(str, rows))
    print("\nno fix: (step, exact, read, read at that step)\n" + table)
    read_now = [(true, read) for _, true, read, now in rows if now]
    assert len(read_now) >= REQUESTS // 2, table  # the budget allows most readings at a request's end
    for true, read in read_now:
        assert read == pytest.approx(true, rel=0.05), table
    # Each kept list holds its decode's chains: a request leaves ~LEAK x TOKENS buffers behind.
    (s0, n0, *_), (s1, n1, *_) = rows[1], rows[-1]
    per_step = (n1 - n0) / (s1 - s0)
    assert (n1 - n0) / (REQUESTS - 2) > LEAK * TOKENS, table
    f = wd.forecast()
    print(f"rate read {f.buffers_per_step:.2f}/step, exact {per_step:.2f}/step; leaks {f.leaks}")
    assert f.buffers_per_step == pytest.approx(per_step, rel=0.1), (f, table)
    kept = {leak.site: leak for leak in f.leaks}
    assert KEPT_SITE in kept, f.leaks
    assert kept[KEPT_SITE].buffers >= (REQUESTS - 2) * LEAK * TOKENS, f.leaks
    assert kept[KEPT_SITE].source is None or "advance" in kept[KEPT_SITE].source
    assert wd.materialized_arrays == 0 and wd.internal_errors == 0
    # The contrast for the fix: evaluating the kept caches here frees their chains.
    before = counter.live(collect=True)
    mx.eval(kept_arrays(server))
    freed = before - counter.live(collect=True)
    print(f"{len(server.kept)} kept lists, {before - baseline} buffers; evaluated: -{freed}")
    assert freed > (REQUESTS - 2) * LEAK * TOKENS
    unwatch_model(hybrid)


def test_the_fix_cuts_kept_caches_and_a_dropped_one_leaves_nothing_behind(
    counter, hybrid, monkeypatch, fake_clock
):
    fake_clock.step_each_observe(monkeypatch, 0.01)
    wd, server, baseline, rows = run(counter, hybrid, fix=True)
    table = "\n".join(map(str, rows))
    print("\nfix: (step, exact, read, read at that step)\n" + table)
    read_now = [(true, read) for _, true, read, now in rows if now]
    assert len(read_now) >= REQUESTS // 2, table
    for true, read in read_now:
        assert read == pytest.approx(true, rel=0.05), table
    # Per request, what stays is its cache list, not its chains (without the fix, LEAK x TOKENS).
    (_, n0, *_), (_, n1, *_) = rows[1], rows[-1]
    assert (n1 - n0) / (REQUESTS - 2) < LEAK * TOKENS / 4, table

    # A cache is kept 16 steps after its last forward and cut at the next fix: one more request
    # (not kept) and every kept list has been cut.
    server.serve(seed=REQUESTS, keep=False)
    # The server evicts half of them: their buffers leave the reading at once, not at a walk.
    for key in list(server.kept)[: REQUESTS // 2]:
        del server.kept[key]
    f = wd.forecast()
    true = counter.live(collect=True) - baseline
    assert f.resident_buffers - f.parameter_buffers == pytest.approx(true, rel=0.05), (f, true, table)
    before = counter.live(collect=True)
    arrays = kept_arrays(server)
    mx.eval(arrays)  # what the fix left to evaluate: no chain
    freed = before - counter.live(collect=True)
    print(
        f"{len(server.kept)} kept lists, {len(arrays)} arrays, {before - baseline} buffers; evaluated: -{freed}"
    )
    del arrays
    assert freed <= len(server.kept) * LEAK * TOKENS / 10, table
    assert wd.materialized_arrays > 0 and wd.fix_failures == 0 and wd.internal_errors == 0

    # The server drops its kept caches: the watchdog holds them by weak reference only.
    refs = [weakref.ref(c) for caches in server.kept.values() for c in caches]
    server.kept.clear()
    gc.collect()
    assert not [r for r in refs if r() is not None]
    assert counter.live(collect=True) - baseline <= 2
    f = wd.forecast()
    assert f.resident_buffers - f.parameter_buffers <= 2, f
    unwatch_model(hybrid)


def test_kept_caches_of_forwards_never_evaluated_are_not_computed(hybrid):
    # Like mlx-lm's own model tests: a forward whose output is never evaluated, its cache kept,
    # then a decode that evaluates its outputs and leaks, with the fix at every step.
    wd = Watchdog(fix=True, fix_every=1, export=False)
    watch_model(hybrid, wd)
    never = make_prompt_cache(hybrid)
    hybrid(mx.array([[1, 2, 3]]), cache=never)
    prompts = tiny_prompts(2, 6, 512, seed=3)
    gen = BatchGenerator(hybrid, max_tokens=TOKENS)
    gen.insert(prompts)
    while gen.next_generated():
        pass
    gen.close()
    unwatch_model(hybrid)
    assert wd.materialized_arrays > 0
    arrays = [a for _, a in tree_flatten([c.state for c in never]) if isinstance(a, mx.array)]
    from mlx_watchdog.core.graph import is_evaluated

    assert arrays and not any(is_evaluated(a) for a in arrays)
