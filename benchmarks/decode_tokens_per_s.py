"""Decode tokens/s with and without the watchdog (issue 3: fix mode), side by side in one run.

Each repetition decodes every variant from a fresh cache; the variants take turns on the
machine, ``--chunk`` steps each, every round in a fresh random order (C A E B D, B D A E C, ...),
so machine noise hits them alike. ``aa`` (unwatched again) shows the noise floor.
Each chunk ends with ``mx.synchronize()`` so a variant pays for its own device work. For each
variant: median tokens/s over the repetitions, interquartile range and min-max, the median
of the per-repetition ratio to ``unwatched`` (paired: same repetition, same moments), and the
same per chunk: each chunk against ``unwatched``'s chunk of the same round (seconds apart), which
gives reps x steps/chunk pairs instead of reps, for machines whose speed drifts within a run.
Watched variants also report the watchdog's self-timed overhead (``wd.overhead_seconds``)
against their decode time: that is NOT the real cost (MLX computes on its own thread while
Python runs), the tokens/s ratio is. ``GC / decode time``: Python's garbage collector, wherever
it ran (a collection the watchdog's allocations start may run in the decode's code, untimed by it).
Diagnostic variants ``wrapped`` and ``nowalk`` take the watched cost apart. ``retained at end``
is how many buffers the pending graphs of the cache still keep alive at the end (the leak; walked
after the timed chunks).

    # leak-free dense llama through generate_step, and the leaking batched qwen3_next:
    python benchmarks/decode_tokens_per_s.py --model llama --layers 4 --hidden 256 --steps 400 --reps 7
    python benchmarks/decode_tokens_per_s.py --model qwen3_next --layers 8 --hidden 64 --steps 400 --reps 7
    # leaking model over 10,000 steps (minutes on a CPU):
    python benchmarks/decode_tokens_per_s.py --model qwen3_next --long
    # realistic shape on a GPU:
    python benchmarks/decode_tokens_per_s.py --model llama --layers 48 --hidden 2048 --vocab 32000 --dtype bfloat16

Needs only mlx, mlx-lm, numpy and mlx_watchdog.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import (  # noqa: E402
    VARIANTS,
    add_model_arguments,
    interleaved,
    make_model,
    model_defaults,
    prompts_for,
    revision,
)

DEFAULT_VARIANTS = "unwatched,aa,handfix,every256,watched,fix,fix4,fix16"
LONG_VARIANTS = "unwatched,aa,watched,fix"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=400, help="decode steps timed per repetition")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    p.add_argument(
        "--chunk", type=int, default=50, help="steps a variant decodes before the next one takes its turn"
    )
    p.add_argument(
        "--variants", default=None, help=f"comma list of {', '.join(VARIANTS)} (default: {DEFAULT_VARIANTS})"
    )
    p.add_argument(
        "--long",
        action="store_true",
        help=f"10,000 steps, 2 repetitions, variants {LONG_VARIANTS} (unless given)",
    )
    p.add_argument("--out", default=None, help="also write the markdown here (appends)")
    args = p.parse_args(argv)
    if args.long:
        if "--steps" not in (argv or sys.argv):
            args.steps = 10_000
        if "--reps" not in (argv or sys.argv):
            args.reps = 2
        args.variants = args.variants or LONG_VARIANTS
    args.variants = [v.strip() for v in (args.variants or DEFAULT_VARIANTS).split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    if args.variants[0] != "unwatched":
        args.variants = ["unwatched"] + [v for v in args.variants if v != "unwatched"]
    model_defaults(args)
    for name in ("layers", "steps", "reps", "batch", "prompt_len", "vocab", "chunk"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def quartiles(values):
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device != "default":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    model = make_model(args.model, args.layers, args.hidden, args.vocab, args.dtype, args.experts, args.seed)
    prompts = prompts_for(args.batch if args.path == "batched" else 1, args.prompt_len, args.vocab, args.seed)

    load_before = os.getloadavg()
    args.revision = revision()  # the code under test, read before it runs
    interleaved(model, args.variants, args.path, prompts, min(args.steps, 64), args.chunk)  # warm-up
    runs = {v: [] for v in args.variants}
    started = time.perf_counter()
    for rep in range(args.reps):
        for r in interleaved(model, args.variants, args.path, prompts, args.steps, args.chunk, seed=rep):
            runs[r.variant].append(r)
            print(
                f"rep {rep + 1}/{args.reps} {r.variant:>9}: {r.tokens_per_s:9.1f} tok/s"
                + (
                    f"  overhead {100 * r.overhead_seconds / r.seconds:5.2f}%"
                    if r.overhead_seconds is not None
                    else ""
                )
                + f"  retained {r.retained_at_end}",
                file=sys.stderr,
                flush=True,
            )
    wall = time.perf_counter() - started
    load_after = os.getloadavg()

    # Each repetition against the same repetition's unwatched decode; whether unwatched repeats
    # itself across repetitions is reported apart (MLX's CUDA backend did not, with random bf16
    # weights: near-tied logits), so a NO says something about the variant, not the device.
    reference = [r.outputs for r in runs["unwatched"]]
    identical = {v: all(r.outputs == ref for r, ref in zip(rs, reference)) for v, rs in runs.items()}
    reproducible = all(ref == reference[0] for ref in reference)
    text = report(args, runs, identical, wall, load_before, load_after, reproducible)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


def report(args, runs, identical, wall, load_before, load_after, reproducible=True) -> str:
    base = runs["unwatched"]
    command = "python benchmarks/decode_tokens_per_s.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        f"### {args.model} via {'generate_step' if args.path == 'plain' else 'BatchGenerator'}: "
        f"{args.layers} layers, hidden {args.hidden or 64}, {args.dtype}, {args.steps} steps x {args.reps} reps"
        + (f", batch {args.batch}" if args.path == "batched" else "")
        + f", chunks of {args.chunk}",
        "",
        f"- command: `{command}`",
        f"- machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, MLX {mx.__version__}, "
        f"mlx-lm {_version('mlx-lm')}, mlx-watchdog {args.revision}, default device {mx.default_device()}; load average {load_before[0]:.1f} "
        f"before, {load_after[0]:.1f} after; wall {wall:.0f} s",
        f"- tokens identical: each repetition against the same repetition's `unwatched`; `unwatched` "
        f"itself {'gave the same tokens in every repetition' if reproducible else 'gave DIFFERENT tokens across repetitions (the device is not reproducible run to run)'}",
        "",
        "| variant | median tok/s | IQR | min-max | tok/s vs unwatched (median of paired ratios) | paired min-max "
        "| per-chunk paired ratio: median (IQR), pairs "
        "| CPU ms/token | CPU vs unwatched (paired) | self-timed overhead / decode time | GC / decode time "
        "| retained at end | tokens identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, rs in runs.items():
        tps = [r.tokens_per_s for r in rs]
        q1, q3 = quartiles(tps)
        ratios = [r.tokens_per_s / b.tokens_per_s for r, b in zip(rs, base)]
        cpu_ratios = [r.cpu_ms_per_token / b.cpu_ms_per_token for r, b in zip(rs, base)]
        overhead = [r.overhead_seconds / r.seconds for r in rs if r.overhead_seconds is not None]
        chunk_ratios = [c / cb for r, b in zip(rs, base) for c, cb in zip(r.chunk_rates, b.chunk_rates)]
        if variant == "unwatched":
            paired = "(reference) | | | "
            cpu_paired = "(reference)"
        else:
            c1, c3 = quartiles(chunk_ratios)
            paired = (
                f"{_pct(statistics.median(ratios))} | {_pct(min(ratios))} .. {_pct(max(ratios))} | "
                f"{_pct(statistics.median(chunk_ratios))} ({_pct(c1)} .. {_pct(c3)}), {len(chunk_ratios)} | "
            )
            cpu_paired = _pct(statistics.median(cpu_ratios))
        lines.append(
            f"| {variant} | {statistics.median(tps):.1f} | {q1:.1f}-{q3:.1f} | {min(tps):.1f}-{max(tps):.1f} | "
            f"{paired}{statistics.median(r.cpu_ms_per_token for r in rs):.3f} | {cpu_paired} | "
            + (f"{100 * statistics.median(overhead):.2f}%" if overhead else "")
            + f" | {100 * statistics.median(r.gc_seconds / r.seconds for r in rs):.2f}%"
            + f" | {statistics.median(r.retained_at_end for r in rs):.0f} | {'yes' if identical[variant] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def _pct(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.2f}%"


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
