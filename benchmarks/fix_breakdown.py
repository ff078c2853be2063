"""Where fix mode's own time goes on a leaking decode: walks, probe walks, finding the pending
arrays, and scheduling them (``mx.async_eval`` of the leaking chains), with the chains' size.

The last part is the leak's own work: the chains the program left uncomputed, computed. Its
reference is a plain ``mx.async_eval`` of chains of the same shape (as many arrays, as many nodes):
what MLX charges per node whoever asks.

    python benchmarks/fix_breakdown.py --layers 48 --batch 4 --steps 1200
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import make_model, prompts_for  # noqa: E402


def plain_chains_us_per_node(arrays: int, depth: int, repeats: int = 15) -> float:
    """``mx.async_eval`` of ``arrays`` chains of ``depth`` subtract+maximum steps, per node."""
    import mlx.core as mx

    best = float("inf")
    for _ in range(repeats):
        chains = [mx.zeros((4,), mx.int32) for _ in range(arrays)]
        mx.eval(chains)
        for _ in range(depth):
            chains = [mx.maximum(c - 1, 0) for c in chains]
        mx.synchronize()
        start = time.perf_counter()
        mx.async_eval(chains)
        best = min(best, time.perf_counter() - start)
        mx.synchronize()
    return best / (arrays * depth * 2) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=1200)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlx_watchdog import Watchdog
    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.core import watchdog as core
    from mlx_watchdog.core.graph import account

    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    nodes = []

    def timed(name, fn):
        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - started
                calls[name] += 1

        return wrapper

    walk, pending, schedule = core.Watchdog._walk, core.Fixer.pending, core.schedule_evaluation

    plain_walk, probe_walk = timed("walk", walk), timed("walk, ending a probe", walk)

    def walk_by_kind(self, roots, step, probe_start=None):
        return (plain_walk if probe_start is None else probe_walk)(self, roots, step, probe_start)

    timed_schedule = timed("fix: async_eval of the chains", schedule)

    def schedule_counted(arrays, async_eval=mx.async_eval):
        started = time.perf_counter()
        nodes.append((len(arrays), account(arrays).pending_nodes))  # not the fix's: taken off its time below
        seconds["(counting the nodes)"] += time.perf_counter() - started
        return timed_schedule(arrays, async_eval)

    model = make_model("qwen3_next", args.layers, 0, 512, "float32", 8)
    wd = Watchdog(export=False, fix=True)
    core.Watchdog._walk = walk_by_kind
    core.Fixer.pending = timed("fix: finding the arrays", pending)
    core.schedule_evaluation = schedule_counted
    try:
        watch_model(model, wd)
        gen = BatchGenerator(model, max_tokens=args.steps + 8)
        gen.insert(prompts_for(args.batch, 16, 512))
        steps, spent0, started = 0, 0.0, 0.0
        while steps < args.steps and gen.next_generated():
            steps += 1
            if steps == 1:  # the prompt is not decode
                spent0, started = wd.overhead_seconds, time.perf_counter()
        total = time.perf_counter() - started
        gen.close()
        unwatch_model(model)
    finally:
        core.Watchdog._walk, core.Fixer.pending, core.schedule_evaluation = walk, pending, schedule
    spent = wd.overhead_seconds - spent0 - seconds.pop("(counting the nodes)", 0.0)
    print(
        f"qwen3_next {args.layers} layers, batch {args.batch}, {steps} steps: {1e3 * total / steps:.1f} ms a step; "
        f"the watchdog's own time {100 * spent / total:.2f}% of decode ({wd.walks} walks)\n"
    )
    print("| part | share of decode | calls | ms a call |")
    print("|---|---|---|---|")
    for name in sorted(seconds):
        print(
            f"| {name} | {100 * seconds[name] / total:.2f}% | {calls[name]} | {1e3 * seconds[name] / calls[name]:.2f} |"
        )
    if nodes:
        arrays = round(sum(a for a, _ in nodes) / len(nodes))
        per_fix = sum(n for _, n in nodes) / len(nodes)
        fix_us = 1e6 * seconds["fix: async_eval of the chains"] / sum(n for _, n in nodes)
        depth = max(1, round(per_fix / (2 * arrays)))
        print(
            f"\nEach fix scheduled {arrays} arrays, {per_fix:.0f} pending nodes on average: {fix_us:.2f} us a node. "
            f"A plain async_eval of {arrays} chains of {depth} x 2 nodes: "
            f"{plain_chains_us_per_node(arrays, depth):.2f} us a node."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
