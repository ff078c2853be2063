"""Readings by sample against a walk of everything, on chains that change the way a busy batch's do.

Every step each layer's attribute is rebound to ``x - 1`` (one more node and buffer), except one
layer whose chain the program evaluates each step (as qwen3_next's mask does with the first
layer's left_padding). Now and then the batch changes under all layers at once: a gather as a
request leaves, a concatenation with a new request's own chain as one joins. The truth is one
``graph.account`` of every array; the sampler walks two arrays per site per reading (its reference and one in turn).

A buffer that several layers' chains share (the index array of a gather that filtered them
all) is counted once by a walk of everything, but once per array by arrays walked alone; and
until two walks of it have seen it stay put, the layer the program evaluates is read as growing.
Samples read high by at most that, never low.
"""

from __future__ import annotations

import mlx.core as mx
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.core import graph
from mlx_watchdog.core.arrays import scan
from mlx_watchdog.core.sampling import Sampler


class Layer:
    def __init__(self, batch: int) -> None:
        self.left_padding = mx.zeros((batch,), dtype=mx.int32)
        mx.eval(self.left_padding)


def joiner(depth: int) -> mx.array:
    """A new request's own chain, as its prompt cache leaves it."""
    x = mx.zeros((1,), dtype=mx.int32)
    mx.eval(x)
    for _ in range(depth):
        x = x - 1
    return x


events = st.lists(
    st.tuples(st.integers(1, 12), st.sampled_from(["step", "leave", "join"]), st.integers(0, 30)),
    min_size=10,
    max_size=40,
)


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(4, 10), still=st.booleans(), events=events)
def test_samples_follow_chains_that_change_together(layers, still, events):
    caches = [Layer(batch=3) for _ in range(layers)]
    sampler = Sampler(stall_seconds=1e-9)  # one node fits: every reading after the first is a sample
    step, sampled, shared = 0, 0, 0
    for readings, (steps, change, depth) in enumerate(events):
        for _ in range(steps):
            step += 1
            for layer in caches:
                layer.left_padding = layer.left_padding - 1
            if still:
                mx.eval(caches[0].left_padding)
        if change == "leave" and caches[0].left_padding.shape[0] > 1:
            keep = mx.arange(caches[0].left_padding.shape[0] - 1)
            for layer in caches:
                layer.left_padding = layer.left_padding[keep]
            shared += 1
        elif change == "join":
            for layer in caches:  # each layer its own joiner chain, all of one depth
                layer.left_padding = mx.concatenate([layer.left_padding, joiner(depth)])
        found = scan(caches).found
        reading = sampler.read(found, step, [0])
        exact = graph.account([f.array for f in found])
        sampled += reading.sampled
        if readings >= 2 * layers:  # once each array was walked twice: its share is known
            err = reading.retained_buffers - exact.retained_buffers
            high = layers * shared  # each shared index array, once per array walked alone
            if still:  # until two walks have seen it not grow, the evaluated layer is read as growing
                high += max(exact.retained_by_array)
            assert -(0.05 * exact.retained_buffers + 2) <= err <= 0.05 * exact.retained_buffers + 2 + high, (
                readings,
                reading.retained,
                exact.retained_by_array,
            )
    assert sampled >= len(events) - 3  # the first readings walk arrays never walked


@settings(max_examples=40, deadline=None)
@given(
    states=st.lists(st.sampled_from(["evaluated", "pending", "scheduled"]), min_size=1, max_size=10),
    depth=st.integers(1, 12),
)
def test_a_first_reading_is_the_walk_of_everything(states, depth):
    # Arrays evaluated, pending, or scheduled by mx.async_eval (their graph already cut, their
    # buffer given; the device may not have run them yet).
    caches = [Layer(batch=2) for _ in states]
    for layer, state in zip(caches, states):
        if state != "evaluated":
            for _ in range(depth):
                layer.left_padding = layer.left_padding - 1
        if state == "scheduled":
            mx.async_eval(layer.left_padding)
    found = scan(caches).found
    reading = Sampler().read(found, 1, [0])
    exact = graph.account([f.array for f in found])
    assert reading.evaluated == exact.evaluated_by_array
    assert reading.retained == [float(r) for r in exact.retained_by_array]
    assert reading.nodes == [float(n) for n in exact.nodes_by_array]


def test_a_reading_with_nothing_pending_exports_no_graph(monkeypatch):
    from mlx_watchdog.core import sampling

    exports = []
    real = sampling.account
    monkeypatch.setattr(
        sampling, "account", lambda arrays, **kw: exports.append(len(arrays)) or real(arrays, **kw)
    )
    caches = [Layer(batch=2) for _ in range(4)]
    sampler = Sampler()
    reading = sampler.read(scan(caches).found, 1, [0])
    assert exports == [] and reading.evaluated == [True] * 4 and reading.retained_buffers == 0
    for layer in caches:  # the next step leaves them pending: now the graph is read
        layer.left_padding = layer.left_padding - 1
    found = scan(caches).found
    reading = sampler.read(found, 2, [0])
    assert (
        exports and reading.retained_buffers == graph.account([f.array for f in found]).retained_buffers > 0
    )
