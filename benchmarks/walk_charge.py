"""How often a leak-free decode is walked, and what each walk is charged, in two or more versions
of the package: the schedule spaces walks by their charged cost (0.1% of decode time), so a
charge that holds someone else's work spaces them out.

Every version is imported under its own name (``observe_versions.load``) and decodes the same tiny
48-layer llama with default options, the versions taking turns, one decode each per repetition.

    git archive e210091 watchdog exporters | tar -x -C /tmp/before
    python benchmarks/walk_charge.py --version before=/tmp/before --version tree=. --reps 2
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from observe_versions import load  # noqa: E402


def decode(core, steps: int, layers: int) -> tuple[int, float, float]:
    """(walks, median charged cost of a walk in ms, overhead in ms) of one watched decode."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.tiny import build_model

    package = core.__name__.rsplit(".", 1)[0]
    schedule = importlib.import_module(f"{package}.schedule")
    charged = []
    walked = schedule.Schedule.walked

    def recording(self, step, cost, cpu_cost=None):
        charged.append(cost if cpu_cost is None else min(cost, cpu_cost))
        return walked(self, step, cost, cpu_cost)

    schedule.Schedule.walked = recording
    try:
        model = build_model("llama", layers=layers)
        wd = core.Watchdog(export=False)
        importlib.import_module(f"{package}.attach").watch_model(model, wd)
        cache = make_prompt_cache(model)
        for _ in zip(
            range(steps),
            generate_step(mx.array([1, 2, 3, 4] * 8), model, max_tokens=steps, prompt_cache=cache),
        ):
            pass
    finally:
        schedule.Schedule.walked = walked
    return wd.walks, 1e3 * statistics.median(charged), 1e3 * wd.overhead_seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--version",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="a package version: NAME=a folder holding watchdog/ (and exporters/)",
    )
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    versions = dict(v.split("=", 1) for v in args.version)
    cores = {name: load(f"wd_charge_{name}", root) for name, root in versions.items()}
    print(
        f"| version | repetition | walks in {args.steps} steps | charged per walk, median ms | overhead, ms |"
    )
    print("|---|---|---|---|---|")
    for rep in range(args.reps):
        for name, core in cores.items():
            walks, cost, overhead = decode(core, args.steps, args.layers)
            print(f"| {name} | {rep + 1} | {walks} | {cost:.2f} | {overhead:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
