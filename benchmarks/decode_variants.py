"""Models, decode loops and the compared variants of the decode-speed benchmark (``paired_speed.py``).

Every variant decodes the same random-weight model with greedy sampling; only what happens
around each forward pass differs:

* ``unwatched``       the model as mlx-lm runs it
* ``aa``              unwatched again: an A/A control, its difference to ``unwatched`` is the noise floor
* ``handfix``         the hand-written fix users apply today: a model wrapper that runs
                      ``mx.eval([c.state for c in cache])`` after every forward (synchronous)
* ``every256``        the same evaluation every 256 forwards, as some servers do
* ``async16``         the fix's work by hand: every 16 forwards, ``mx.async_eval`` of every array
                      attribute of every cache layer (what the fix schedules, without a watchdog)
* ``watched``         ``watch_model(model, Watchdog())`` (fix off)
* ``fix``             ``Watchdog(fix=True)`` with its default ``fix_every``
* ``fix4``, ``fix16`` ``Watchdog(fix=True, fix_every=4 / 16)`` (to choose the default)
* ``fixlow``          ``fix`` with a walk budget (``overhead_budget``) of 0.25% instead of 1%
* ``wrapped``         diagnostic: ``watch_model`` with an observe() that does nothing (the model
                      wrapper's own cost)
* ``nowalk``          diagnostic: ``watched`` with its walks switched off (``Schedule.switch_off``)
                      after the first that read the caches (untimed): observe()'s per-step path alone,
                      what a step that neither walks nor fixes runs
* ``subclass``        diagnostic: the model's instance given a subclass of its class that overrides
                      nothing (what a per-instance class costs, without watch_model's ``__call__``)
* ``VARIANT@base``    a watched variant (``watched@base``, ``fix@base``, ...) with another version of the
                      package (``load_base``: a folder holding its ``watchdog/``), in the same process:
                      two versions paired step by step, as no two processes pair them

A watchdog's internal error (caught and counted in ``internal_errors``, the decode goes on) means a
variant measured an error path, not what it names: ``Run.internal_errors`` carries the count, and
``paired_speed.py`` fails on any.

Needs only mlx, mlx-lm, numpy and mlx_watchdog (no prometheus/psutil/rich).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_watchdog.attach import model as this_version
from mlx_watchdog.core.arrays import find_arrays
from mlx_watchdog.core.graph import account
from mlx_watchdog.tiny import build_model, tiny_prompts

VARIANTS = (
    "unwatched",
    "aa",
    "handfix",
    "every256",
    "async16",
    "watched",
    "fix",
    "fix4",
    "fix16",
    "fixlow",
    "wrapped",
    "nowalk",
    "subclass",
)
LOW_BUDGET = 0.0025  # walk budget of ``fixlow`` (the default is 0.01)
WATCHED = ("watched", "fix", "fix4", "fix16", "fixlow", "wrapped", "nowalk")  # those a @base may take
BASE = "@base"
_versions: dict[str, Any] = {"": this_version}  # suffix -> that version's attach.model


def load_base(root: str) -> None:
    """Import the package version at ``root`` (a folder holding its ``watchdog/``) under a name of
    its own, for the ``VARIANT@base`` variants."""
    folder = tempfile.mkdtemp(prefix="decode-variants-")
    name = "mlx_watchdog_base"
    shutil.copytree(os.path.join(root, "watchdog"), os.path.join(folder, name))
    sys.path.insert(0, folder)
    _versions[BASE] = importlib.import_module(f"{name}.attach.model")


def known(variant: str) -> bool:
    """A variant of VARIANTS, or a watched one @base once a base version is loaded."""
    base, _, suffix = variant.partition("@")
    return variant in VARIANTS or (bool(suffix) and "@" + suffix in _versions and base in WATCHED)


def _version(variant: str) -> tuple[str, Any]:
    """The variant without its version suffix, and that version's attach.model."""
    base, at, suffix = variant.partition("@")
    return base, _versions[at + suffix]


class _GCClock:
    """Seconds spent in Python's garbage collector (gc.callbacks), wherever it was triggered: a
    collection started by the watchdog's allocations may run in the decode's own code."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None


GC_CLOCK = _GCClock()


def add_model_arguments(p) -> None:
    """The model, its shape, the decode path and the device (shared by the decode benchmarks)."""
    p.add_argument(
        "--model",
        choices=("llama", "qwen3_next"),
        default="llama",
        help="llama: leak-free, decoded by generate_step; qwen3_next: leaking, decoded by BatchGenerator",
    )
    p.add_argument(
        "--path",
        choices=("plain", "batched"),
        default=None,
        help="decode loop (default: plain for llama, batched for qwen3_next)",
    )
    p.add_argument("--layers", type=int, default=None, help="default 4 (llama), 8 (qwen3_next)")
    p.add_argument("--hidden", type=int, default=0, help="model width (0: tiny's 64-wide config)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--experts", type=int, default=8, help="qwen3_next routed experts (with --hidden)")
    p.add_argument("--dtype", default="float32", help="float32 (CPU MoE needs it), bfloat16, float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        choices=("default", "cpu", "gpu"),
        default="default",
        help="MLX device (cpu: the CPU backend, also on a GPU machine)",
    )
    p.add_argument(
        "--batch", type=int, default=2, help="sequences in the batched path (equal-length prompts)"
    )
    p.add_argument("--prompt-len", type=int, default=16)


def model_defaults(args) -> None:
    args.layers = args.layers or (4 if args.model == "llama" else 8)
    args.path = args.path or ("plain" if args.model == "llama" else "batched")


def shape_overrides(model_type: str, hidden: int, vocab: int, experts: int) -> dict:
    """Config overrides that scale tiny's model to ``hidden`` wide (heads of 64 up to hidden
    1024, of 128 above, a quarter as many KV heads, an MLP 4x wide for llama)."""
    head_dim = 64 if hidden <= 1024 else 128
    heads = max(1, hidden // head_dim)
    kv_heads = max(1, heads // 4)
    common = dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
    )
    if model_type == "llama":
        return dict(common, intermediate_size=4 * hidden)
    if model_type == "qwen3_next":
        linear_head = 64 if hidden <= 1024 else 128
        return dict(
            common,
            intermediate_size=2 * hidden,
            num_experts=experts,
            num_experts_per_tok=min(experts, max(2, experts // 8)),
            moe_intermediate_size=max(32, hidden // 4),
            shared_expert_intermediate_size=max(32, hidden // 2),
            linear_num_value_heads=max(2, hidden // linear_head),
            linear_num_key_heads=max(1, hidden // (2 * linear_head)),
            linear_key_head_dim=linear_head,
            linear_value_head_dim=linear_head,
        )
    raise ValueError(f"model_type must be 'llama' or 'qwen3_next', got {model_type!r}")


def make_model(
    model_type: str, layers: int, hidden: int, vocab: int, dtype: str, experts: int, seed: int = 0
):
    """A random-weight model. Built in float32, then cast: tiny.build_model refuses MoE models
    in other dtypes wherever Metal is absent, but MLX's CUDA backend runs them."""
    target = getattr(mx, dtype, None)
    if not isinstance(target, mx.Dtype) or not mx.issubdtype(target, mx.floating):
        raise ValueError(f"--dtype must be a floating MLX dtype (float32, bfloat16, float16), got {dtype!r}")
    if model_type == "qwen3_next" and target != mx.float32 and mx.default_device() == mx.cpu:
        raise ValueError(
            "MLX's CPU backend runs qwen3_next's MoE (GatherMM) only in float32: use --dtype float32"
        )
    overrides = shape_overrides(model_type, hidden, vocab, experts) if hidden else {"vocab_size": vocab}
    model = build_model(model_type, layers=layers, seed=seed, **overrides)
    if target != mx.float32:
        model.set_dtype(target)  # floating parameters only
        mx.eval(model.parameters())
    return model


def cache_state(cache: Any) -> list:
    """What the hand-written fix evaluates: the ``state`` of every cache (as users write it)."""
    return [c.state for c in cache]


class EvalCacheWrapper:
    """The hand-written fix: after every ``every``-th forward, ``mx.eval`` every cache's state
    (synchronous: the decode waits for the device). Other attributes come from the model."""

    def __init__(self, model: Any, every: int):
        self.model = model
        self.every = every
        self.calls = 0

    def __call__(self, inputs, cache=None, **kwargs):
        out = self.model(inputs, cache=cache, **kwargs)
        self.calls += 1
        if cache is not None and self.calls % self.every == 0:
            mx.eval(cache_state(cache))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


class AsyncEvalCacheWrapper(EvalCacheWrapper):
    """The fix's work without the watchdog: after every ``every``-th forward, schedule
    (``mx.async_eval``, no wait) every array attribute of every cache layer, the leaking ones
    included (``ArraysCache.left_padding`` is outside ``state``)."""

    def __call__(self, inputs, cache=None, **kwargs):
        out = self.model(inputs, cache=cache, **kwargs)
        self.calls += 1
        if cache is not None and self.calls % self.every == 0:
            mx.async_eval([v for c in cache for v in vars(c).values() if isinstance(v, mx.array)])
        return out


def watchdog_for(variant: str) -> Any:
    """The variant's Watchdog (of its version of the package), or None for an unwatched one."""
    variant, version = _version(variant)
    Watchdog = version.Watchdog
    if variant == "watched":
        return Watchdog(export=False)
    if variant == "fix":
        return Watchdog(export=False, fix=True)
    if variant == "fixlow":
        return Watchdog(export=False, fix=True, overhead_budget=LOW_BUDGET)
    if variant.startswith("fix") and variant[3:].isdigit():
        return Watchdog(export=False, fix=True, fix_every=int(variant[3:]))
    # Diagnostics that take the watchdog apart (benchmark only)
    if variant == "wrapped":  # an instance attribute shadows observe(): the model wrapper alone
        wd = Watchdog(export=False)
        shadow(wd, "observe", lambda *args, **kwargs: None)
        return wd
    if variant == "nowalk":  # after its first walk none is ever due: observe()'s per-step path alone
        wd = Watchdog(export=False)
        # Switched off once the first walk that read the caches (before the timed steps: the first
        # forward's caches are empty) has armed what a step that walks nothing still runs (the look
        # at the batch's rows every few steps).
        wd.on_forecast = lambda forecast: forecast.cache_buffers and wd._schedule.switch_off()
        return wd
    return None


def shadow(obj: Any, name: str, replacement: Any) -> None:
    """Shadow the method ``name`` of ``obj`` by an instance attribute (benchmark diagnostics only).
    Refuses a name the class no longer has: a shadow of a renamed method changes nothing, and
    the diagnostic would silently measure the plain variant."""
    if not callable(getattr(type(obj), name, None)):
        raise AttributeError(f"{type(obj).__name__} has no method {name!r} to shadow")
    setattr(obj, name, replacement)


class Decode:
    """One variant's decode, advanced a chunk of steps at a time so the variants can take
    turns on the machine.

    Each variant decodes through its own shallow copy of the model: the layers and weights are
    shared, the top-level object is its own, so a watched variant is attached once, as a program
    attaches it (swapping one object's class at every turn cost the watched variants alone)."""

    def __init__(self, model, variant: str, path: str, prompts: list[list[int]], steps: int):
        model = copy.copy(model)  # the top-level object only
        self.model, self.variant, self.path = model, variant, path
        self.wd = watchdog_for(variant)
        self.version = _version(variant)[1]
        if variant == "handfix":
            self.fn = EvalCacheWrapper(model, 1)
        elif variant == "every256":
            self.fn = EvalCacheWrapper(model, 256)
        elif variant == "async16":
            self.fn = AsyncEvalCacheWrapper(model, 16)
        elif variant == "subclass":
            original = type(model)
            model.__class__ = type(
                original.__name__, (original,), {"__slots__": (), "__module__": original.__module__}
            )
            self.fn = model
        elif variant in ("unwatched", "aa") or self.wd is not None:
            self.fn = model
        else:
            raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
        if self.wd is not None:
            self.version.watch_model(model, self.wd)
        if path == "plain":
            self.cache = make_prompt_cache(model)
            self.outputs = [[]]
            self._steps = generate_step(
                mx.array(prompts[0]), self.fn, max_tokens=steps + 2, prompt_cache=self.cache
            )
        elif path == "batched":
            self.gen = BatchGenerator(self.fn, max_tokens=steps + 8)
            self.uids = self.gen.insert(prompts)
            self.outputs = [[] for _ in self.uids]
        else:
            raise ValueError(f"path must be 'plain' or 'batched', got {path!r}")
        self.advance(1)  # prefill and the first token: not decode, not timed
        mx.synchronize()
        self._paused_at = time.perf_counter()
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # CPU time of the whole process (all threads) in the chunks
        self.tokens = 0
        self.gc_seconds = 0.0
        self.overhead0 = self.wd.overhead_seconds if self.wd else None

    def advance(self, steps: int) -> int:
        """Decode ``steps`` steps; returns the tokens produced."""
        produced = 0
        if self.path == "plain":
            for _ in range(steps):
                token, _ = next(self._steps)
                self.outputs[0].append(token)
                produced += 1
        else:
            index = {uid: i for i, uid in enumerate(self.uids)}
            for _ in range(steps):
                for r in self.gen.next_generated():
                    self.outputs[index[r.uid]].append(r.token)
                    produced += 1
        return produced

    def timed_chunk(self, steps: int, sync: bool = True) -> None:
        """Decode ``steps`` steps, timed. ``sync``: wait for the device at the end, so the chunk
        pays its own device work; without it (steps interleaved one by one, see paired_speed.py)
        a step's time is the host's work for it, which is what a host-bound decode runs at."""
        self._resume_clock()
        start, cpu_start, gc_start = time.perf_counter(), time.process_time(), GC_CLOCK.seconds
        produced = self.advance(steps)
        if sync:
            mx.synchronize()
        elapsed = time.perf_counter() - start
        self.gc_seconds += GC_CLOCK.seconds - gc_start
        self.seconds += elapsed
        cpu = time.process_time() - cpu_start
        self.cpu_seconds += cpu
        self.last_chunk = (produced, elapsed, cpu)  # tokens, seconds, process CPU seconds
        self.tokens += produced
        self._paused_at = time.perf_counter()

    def _resume_clock(self) -> None:
        """The watchdog budgets its walks as a fraction of its decode time (the gaps between
        its steps, each capped at a second). Taking turns, the gap at the start of a turn
        would include the other variants' turns and grant it extra budget: move its clocks
        forward by the time it sat out, as if it had run alone. (A private attribute of the
        core: benchmark only.)"""
        if self.wd is not None and math.isfinite(self.wd._pace.last):  # its step clock's last step
            self.wd._pace.last += time.perf_counter() - self._paused_at

    def live_cache(self):
        return self.cache if self.path == "plain" else self.gen._generation_batch.prompt_cache

    def finish(self) -> Run:
        run = Run(
            self.variant,
            self.tokens,
            self.seconds,
            self.cpu_seconds,
            outputs=self.outputs,
            gc_seconds=self.gc_seconds,
        )
        if self.wd is not None:
            run.overhead_seconds = self.wd.overhead_seconds - self.overhead0
            run.walks = self.wd.walks
            run.internal_errors = self.wd.internal_errors  # over its whole life, the untimed steps too
        run.retained_at_end = _retained(self.live_cache())  # walked after the timed chunks
        if self.path == "plain":
            self._steps.close()
        else:
            self.gen.close()
        self.version.unwatch_model(self.model)
        return run


@dataclasses.dataclass
class Run:
    variant: str
    tokens: int  # decode tokens timed (all sequences of the batch)
    seconds: float  # decode time: the sum of this variant's chunks
    cpu_seconds: float  # process CPU time (all threads) over the same chunks
    overhead_seconds: float | None = None  # wd.overhead_seconds over the timed decode
    walks: int | None = None
    internal_errors: int | None = None  # the watchdog's own errors (caught): any one voids the run
    retained_at_end: int | None = None  # buffers the cache's pending graphs keep at the end
    outputs: list | None = None
    gc_seconds: float = 0.0  # in Python's garbage collector during the timed chunks


def internal_errors(runs: list[Run]) -> dict[str, int]:
    """The variants whose watchdog had internal errors, with their counts (none: a clean run)."""
    return {r.variant: r.internal_errors for r in runs if r.internal_errors}


def _retained(cache) -> int:
    arrays = [a for _, a in find_arrays(cache)]
    return account(arrays).retained_buffers if arrays else 0


def interleaved(
    model,
    variants: list[str],
    path: str,
    prompts,
    steps: int,
    chunk: int,
    seed: int = 0,
    on_chunk=None,
    deadline: float | None = None,
    sync: bool = True,
) -> list[Run]:
    """One repetition: a fresh decode per variant, advanced in turns of ``chunk`` steps. Each
    round runs every variant once, in a fresh random order: no variant always goes first or
    always follows the same one (whatever a turn leaves behind, such as garbage to collect or
    a cleared allocator cache, lands on a different variant each time).

    ``on_chunk(round, position, decode)`` is called after each timed chunk. ``deadline`` (a
    ``time.perf_counter()`` value): no round is started that the last one says would end later."""
    order = random.Random(seed)
    # Built in a random order too: the variant always built first ran faster than its A/A twin.
    built = {v: Decode(model, v, path, prompts, steps) for v in order.sample(variants, len(variants))}
    decodes = [built[v] for v in variants]
    done = round_ = 0
    round_seconds = 0.0
    while done < steps:
        if deadline is not None and time.perf_counter() + round_seconds > deadline:
            break
        started = time.perf_counter()
        k = min(chunk, steps - done)
        for position, d in enumerate(order.sample(decodes, len(decodes))):
            d.timed_chunk(k, sync)
            if on_chunk is not None:
                on_chunk(round_, position, d)
        done += k
        round_ += 1
        round_seconds = time.perf_counter() - started
    return [d.finish() for d in decodes]


def prompts_for(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of equal length: the case where BatchGenerator keeps left_padding."""
    return tiny_prompts(batch, length, vocab, seed=seed)


def revision() -> str:
    """$MLX_WATCHDOG_REVISION when set (a copy of the tree, as on a lent GPU machine); else the
    project's git commit (+ "dirty" when the tree has changes), where git can tell."""
    if os.environ.get(
        "MLX_WATCHDOG_REVISION"
    ):  # said by whoever copied the tree (a copy's .git may be stale)
        return os.environ["MLX_WATCHDOG_REVISION"]
    fallback = "(no git)"
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except Exception:
        return fallback
    return f"{sha}{'+dirty' if dirty else ''}" if sha else fallback
