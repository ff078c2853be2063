"""Where the watchdog's time goes on one step of a leaking batched decode: the walk, the
pending check, and the fix (``mx.async_eval`` of the pending cache arrays), by chain depth.

What a fast device cannot hide: on an H200 a step of the 48-layer hybrid below is ~35 ms and
these are host (CPU) costs on the decode thread. Each figure is the median over repetitions,
timed while the device still computes the step just scheduled ("in flight") and after
``mx.synchronize()`` ("synced"): equal figures mean the watchdog does not wait for the device.

    # the GPU shape of decode_gpu.md (random bf16 weights):
    python benchmarks/walk_and_fix_cost.py --layers 48 --hidden 2048 --experts 32 --batch 4 --dtype bfloat16
    # a CPU-sized one:
    python benchmarks/walk_and_fix_cost.py --layers 8 --hidden 0 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import Decode, make_model, prompts_for  # noqa: E402

from mlx_watchdog.core.arrays import find_arrays  # noqa: E402
from mlx_watchdog.core.graph import account, export_dot, is_evaluated  # noqa: E402


def timed(results: dict, key: str, fn):
    start = time.perf_counter()
    value = fn()
    results.setdefault(key, []).append(time.perf_counter() - start)
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=0, help="0: tiny's 64-wide config")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--depth", type=int, default=16, help="steps a chain grows before the fix (fix_every)")
    p.add_argument("--repeats", type=int, default=12)
    args = p.parse_args(argv)

    model = make_model("qwen3_next", args.layers, args.hidden, args.vocab, args.dtype, args.experts)
    decode = Decode(
        model,
        "unwatched",
        "batched",
        prompts_for(args.batch, 64, args.vocab),
        (2 * args.depth + 2) * args.repeats + 40,
    )

    def cache_arrays():
        return [a for _, a in find_arrays(decode.live_cache())]

    decode.advance(20)
    mx.synchronize()
    r: dict = {}
    reading = None
    for _ in range(args.repeats):
        step_start = time.perf_counter()
        decode.advance(args.depth)
        r.setdefault("decode step", []).append((time.perf_counter() - step_start) / args.depth)
        arrays = timed(r, "find_arrays (introspection)", cache_arrays)
        reading = timed(r, "walk: account(), in flight", lambda: account(arrays))
        timed(r, "  of which export_to_dot", lambda: export_dot(arrays))
        pending = timed(r, "is_evaluated on every array", lambda: [a for a in arrays if not is_evaluated(a)])
        timed(r, f"fix, chains {args.depth} deep, in flight", lambda: mx.async_eval(pending))
        decode.advance(args.depth)
        arrays = cache_arrays()
        pending = [a for a in arrays if not is_evaluated(a)]
        mx.synchronize()
        timed(r, "walk: account(), synced", lambda: account(arrays))
        timed(r, f"fix, chains {args.depth} deep, synced", lambda: mx.async_eval(pending))
        mx.synchronize()
        decode.advance(1)
        pending = [a for a in cache_arrays() if not is_evaluated(a)]
        timed(r, "fix, chains 1 deep, in flight", lambda: mx.async_eval(pending))
    decode.finish()

    print(
        f"qwen3_next via BatchGenerator: {args.layers} layers, hidden {args.hidden or 'tiny'}, "
        f"{args.experts} experts, batch {args.batch}, {args.dtype}; MLX {mx.__version__}, {mx.default_device()}"
    )
    print(
        f"cache arrays {len(arrays)}, pending at step entry {len(pending)}; after {args.depth} steps: "
        f"{reading.pending_nodes} pending nodes, {reading.retained_buffers} retained buffers, "
        f"{reading.dot_bytes} bytes of DOT\n"
    )
    print("| what | median ms | min-max ms |\n|---|---|---|")
    for key, values in r.items():
        print(
            f"| {key} | {statistics.median(values) * 1e3:.3f} | "
            f"{min(values) * 1e3:.3f}-{max(values) * 1e3:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
