"""What evaluating a leak's chains costs the host, by chain depth: the work the fix adds.

A leaking cache attribute rebound every step as ``x -= 1`` grows a chain of two nodes a step
(``Broadcast`` of the constant, ``Subtract``). Evaluating it costs the host per node, whoever
asks: the fix (``mx.async_eval`` every 16 steps), a hand fix every 256 steps, or every step.
This measures that cost for ``--chains`` such chains (the 35 leaking layers of the 48-layer
hybrid) of each depth, per node and per decode step.

    python benchmarks/eval_cost.py
    python benchmarks/eval_cost.py --chains 35 --depths 1,16,256 --out results.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paired_stats import emit  # noqa: E402


def cost(chains: int, depth: int, repeats: int) -> float:
    """Median seconds of one ``mx.async_eval`` of ``chains`` chains ``depth`` steps deep."""
    xs = [mx.zeros((4,), dtype=mx.int32) for _ in range(chains)]
    mx.eval(xs)
    times = []
    for _ in range(repeats):
        for _ in range(depth):
            xs = [x - 1 for x in xs]
        start = time.perf_counter()
        mx.async_eval(xs)
        times.append(time.perf_counter() - start)
        mx.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=35)
    p.add_argument("--depths", default="1,4,16,64,256")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lines = [
        f"### Evaluating {args.chains} chains of `x - 1` on {mx.default_device()} (MLX {mx.__version__}), "
        f"median of {args.repeats}",
        "",
        "| depth (steps) | ms per async_eval | us per node | us per decode step |",
        "|---|---|---|---|",
    ]
    for depth in (int(d) for d in args.depths.split(",")):
        seconds = cost(args.chains, depth, args.repeats)
        lines.append(
            f"| {depth} | {1e3 * seconds:.2f} | {1e6 * seconds / (2 * args.chains * depth):.2f} | "
            f"{1e6 * seconds / depth:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
