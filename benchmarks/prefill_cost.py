"""Cost of the prefill guard: a long prompt prefilled with and without it, interleaved.

Each repetition prefills the same prompt twice through mlx-lm's own loop (``generate_step``
with ``prefill_step_size``, one decode token), in alternating order: ``watched`` (the model
watched by a Watchdog, no guard) and ``guarded`` (the same plus a fresh ``PrefillGuard``, so
every run pays its walks: the first chunk, its half-length calibration chunk, the remainder
chunk). Reported per model:

* wall seconds per prefill (median, min-max) for both variants and the median of the paired
  ratio guarded / watched - 1 (the real cost, amortized over the prompt);
* the guard's self-timed walk seconds over the guarded prefill's seconds (amortized share);
* the walk of the first (full) chunk over the mean prefill time of one chunk (watched median /
  chunks): the unamortized cost, and how many chunks of one length bring it under 5%.

The guard walks the first chunk; it walks more (a short calibration chunk, shorter lengths)
only when the limit is near, which it is not here: one walk per prompt.

    python benchmarks/prefill_cost.py                          # 8-layer tiny models, 2000 tokens, step 128
    python benchmarks/prefill_cost.py --models qwen3_next --tokens 4096 --step 256 --reps 5

Needs only mlx, mlx-lm, numpy and mlx_watchdog.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.attach.prefill import install
from mlx_watchdog.tiny import build_model, tiny_prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3_next,llama,qwen3_moe", help="comma-separated tiny model types")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2000, help="prompt length")
    p.add_argument("--step", type=int, default=128, help="prefill_step_size")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    p.add_argument(
        "--device",
        choices=("default", "cpu", "gpu"),
        default="default",
        help="MLX device (gpu: Metal or CUDA)",
    )
    p.add_argument("--hidden", type=int, default=0, help="model width (0: tiny's 64-wide config)")
    return p.parse_args(argv)


def prefill(model, prompt, step: int) -> float:
    start = time.perf_counter()
    for _ in generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=step):
        pass
    return time.perf_counter() - start


def widths(hidden: int) -> dict:
    """Overrides for a wider tiny model (heads of 64; MoE experts a quarter as wide)."""
    if not hidden:
        return {}
    heads = max(1, hidden // 64)
    return {
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 64,
        "moe_intermediate_size": hidden,
    }


def bench(model_type: str, args) -> dict:
    model = build_model(model_type, layers=args.layers, **widths(args.hidden))
    prompt = tiny_prompts(1, args.tokens, seed=1)[0]
    wd = Watchdog(export=False)
    watch_model(model, wd)
    prefill(model, prompt[:256], args.step)  # warm-up
    times = {"watched": [], "guarded": []}
    shares, walks, first_walks = [], [], []
    for rep in range(args.reps):
        order = ("watched", "guarded") if rep % 2 == 0 else ("guarded", "watched")
        for variant in order:
            guard = install(wd, model) if variant == "guarded" else None
            seconds = prefill(model, prompt, args.step)
            times[variant].append(seconds)
            if guard is not None:
                shares.append(guard.walk_seconds / seconds)
                walks.append(guard.walks)
                first_walks.append(next(m.seconds for m in guard.measurements if m.tokens == args.step))
                guard.remove()
    ratios = [g / w - 1 for g, w in zip(times["guarded"], times["watched"])]
    unwatch_model(model)
    if wd.internal_errors:  # caught and counted, the prefill went on: the times are an error path's
        raise SystemExit(
            f"prefill_cost.py: {model_type}: the watchdog had {wd.internal_errors} internal errors"
        )
    chunks = -(-(args.tokens - 1) // args.step)
    return {
        "model": model_type,
        "watched": times["watched"],
        "guarded": times["guarded"],
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "share": statistics.median(shares),
        "walks": statistics.median(walks),
        "walk": statistics.median(first_walks),
        "chunk": statistics.median(times["watched"]) / chunks,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.device != "default":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    chunks = -(-(args.tokens - 1) // args.step)
    print(
        f"# prefill guard cost: {args.tokens}-token prompt, prefill_step_size={args.step} "
        f"({chunks} chunks), {args.layers} layers, hidden {args.hidden or 64}, {args.reps} interleaved reps"
    )
    print(
        f"# mlx {mx.__version__}, {mx.default_device()}, {platform.machine()}, "
        f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}"
    )
    print()
    print(
        "| model | watched s (median, min-max) | guarded s (median, min-max) | guarded/watched - 1 "
        "(median, min-max) | walks/run | walk share (self-timed) | 1st walk / mean chunk | chunks for <5% |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model_type in args.models.split(","):
        r = bench(model_type, args)
        w, g = r["watched"], r["guarded"]
        one = r["walk"] / r["chunk"]
        print(
            f"| {r['model']} | {statistics.median(w):.3f} ({min(w):.3f}-{max(w):.3f}) "
            f"| {statistics.median(g):.3f} ({min(g):.3f}-{max(g):.3f}) "
            f"| {r['ratio']:+.1%} ({r['ratio_range'][0]:+.1%} to {r['ratio_range'][1]:+.1%}) "
            f"| {r['walks']:.0f} | {r['share']:.2%} "
            f"| {one:.1%} ({r['walk'] * 1e3:.1f} ms / {r['chunk'] * 1e3:.1f} ms) "
            f"| {max(1, -(-one // 0.05)):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
