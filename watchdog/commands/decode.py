"""One watched decode through mlx-lm: the loop that ``demo``, ``diagnose`` and ``scan`` share.

A *path* is how mlx-lm decodes the prompts:

  plain      ``generate_step``, the first prompt
  quantized  ``generate_step`` with a quantized KV cache (kv_bits=8)
  batched    ``BatchGenerator``, every prompt at once
  join       ``BatchGenerator``, every prompt but the last; the last request joins the running
             batch at a third of the run

``decode_pass`` decodes on a path with a watchdog watching the model and returns a
``PassResult``. What it measures is the decode: the watchdog forgets the prefill (the cache
filling up once) after the first token and, on the join path, the merge of the joining request
(a one-off jump) a few steps after it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator
from typing import Any

PLAIN_PATHS = ("plain", "quantized")
PATHS = (*PLAIN_PATHS, "batched", "join")
JOIN_SETTLE = 3  # decode steps after a join before the growth is measured afresh
LEAK_MIN_GROWTH = 0.01  # buffers/step: at or above this a pass leaks; below it, it is flat
QUANTIZED_KV = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}

Tokens = list[tuple[int, int]]  # (sequence, token) of each sequence that produced one this step
Steps = Generator[Tokens, None, None]  # the new tokens of each decode step
OnStep = Callable[[int, Any, float], bool]  # (decode step, watchdog, seconds so far) -> stop?


@dataclasses.dataclass
class PassResult:
    """One watched decode."""

    path: str
    prompts: list[list[int]]
    tokens: list[list[int]]  # generated tokens per sequence
    seconds: float
    watchdog: Any
    # The decode's forecast: of the last step but one when the pass ran to its end, since
    # BatchGenerator drops a batch's caches as it yields its last tokens (that is teardown).
    forecast: Any
    stopped: Any = None  # the ResourceLimitForecast that ended the pass early, if any
    # Forward passes that were no decode step (the prefill's): watchdog step - offset = decode step.
    step_offset: int = 0
    # (decode step, resident buffers) of each graph walk during the decode
    readings: list = dataclasses.field(default_factory=list)

    @property
    def decode_steps(self) -> int:
        return max((len(t) for t in self.tokens), default=0)

    @property
    def sequences(self) -> int:
        """Sequences that generated a token."""
        return sum(1 for t in self.tokens if t)


def join_step(steps: int) -> int:
    """The decode step after which the joining request joins: a third of the run."""
    return max(1, steps // 3)


def batch_prompts(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """``batch_size`` prompts, cycling through ``prompts``."""
    return [prompts[i % len(prompts)] for i in range(batch_size)]


def leaking(forecast) -> bool:
    """Does the growth, or the growth of one site, reach ``LEAK_MIN_GROWTH``?"""
    return forecast.buffers_per_step >= LEAK_MIN_GROWTH or any(
        site.buffers_per_step >= LEAK_MIN_GROWTH for site in forecast.leaks
    )


def token_steps(model, path: str, prompts: list[list[int]], steps: int) -> Steps:
    """mlx-lm decoding ``prompts`` on ``path`` for ``steps`` steps: the new tokens of each step."""
    if path == "plain":
        return _generate_steps(model, prompts[0], steps, {})
    if path == "quantized":
        return _generate_steps(model, prompts[0], steps, QUANTIZED_KV)
    if path == "batched":
        return _batch_steps(model, prompts, steps, joining=None)
    if path == "join":
        return _batch_steps(model, prompts[:-1], steps, joining=prompts[-1])
    raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")


def _generate_steps(model, prompt: list[int], steps: int, kv: dict) -> Steps:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    # generate_step has no stop tokens: it decodes exactly max_tokens steps.
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=steps, **kv):
        yield [(0, int(token))]


def _batch_steps(model, prompts: list[list[int]], steps: int, joining: list[int] | None) -> Steps:
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=steps)  # stop_tokens=None: no early stop
    try:
        uids = generator.insert([list(p) for p in prompts])
        index = {uid: i for i, uid in enumerate(uids)}
        step = 0
        while responses := generator.next_generated():
            step += 1
            yield [(index[r.uid], int(r.token)) for r in responses]
            if joining is not None and step == join_step(steps):
                index[generator.insert([list(joining)])[0]] = len(prompts)
    finally:
        try:
            generator.close()
        except Exception:  # a generator stopped mid-step may not close cleanly; it is dropped anyway
            pass


def decode_pass(
    model,
    path: str,
    prompts: list[list[int]],
    steps: int,
    watchdog,
    on_step: OnStep | None = None,
) -> PassResult:
    """Decode ``steps`` steps on ``path`` watched by ``watchdog``. ``on_step(step, watchdog,
    elapsed)`` runs after each decode step; returning True ends the pass. A
    ``ResourceLimitForecast`` raised by the watchdog ends it too (``result.stopped``)."""
    from ..attach.model import unwatch_model, watch_model
    from ..core.actions import ResourceLimitForecast

    if path in PLAIN_PATHS:
        prompts = prompts[:1]
    stepper = token_steps(model, path, prompts, steps)
    resets = {1, join_step(steps) + JOIN_SETTLE} if path == "join" else {1}
    tokens: list[list[int]] = [[] for _ in prompts]
    readings: list[list[int]] = []
    before_end = None
    stopped = None
    offset = walks = 0
    watch_model(model, watchdog)
    start = time.perf_counter()
    try:
        for step, new in enumerate(stepper, 1):
            for sequence, token in new:
                tokens[sequence].append(token)
            if step in resets:
                watchdog.reset()
                offset, walks = watchdog.steps - step, watchdog.walks
            elif watchdog.walks != walks:  # a new reading: one forecast per walk, not per step
                walks = watchdog.walks
                forecast = watchdog.forecast()
                decode_step = int(forecast.measured_step - offset)
                # The last step's forward is where the batch ends: that reading is teardown.
                if forecast.decoding and decode_step < steps:
                    readings.append([decode_step, int(forecast.resident_buffers)])
            if step == steps - 1:
                before_end = watchdog.forecast()
            if on_step is not None and on_step(step, watchdog, time.perf_counter() - start):
                break
    except ResourceLimitForecast as exc:
        stopped = exc
    finally:
        stepper.close()
        seconds = time.perf_counter() - start
        unwatch_model(model)
    ran_out = stopped is None and max((len(t) for t in tokens), default=0) >= steps
    final = before_end if ran_out and before_end is not None else watchdog.forecast()
    return PassResult(path, prompts, tokens, seconds, watchdog, final, stopped, offset, readings)
