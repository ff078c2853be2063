"""What telling evaluated arrays costs a reading, for each way this MLX offers.

``is_evaluated`` runs on every array a sampled reading finds (``graph.evaluated_check``): with
``mx.get_array_buffer_size`` (mlx 0.32.4 and later), by reading the array's C++ descriptor
(earlier MLX) or, where neither works, by an export of the array's graph. The workload is the crash
scale's shape: ``--chains`` objects, each holding one evaluated array and one lazy chain of
``x = x - 1`` over an evaluated scalar, ``--depth`` nodes deep, each step extending every chain by
one node. For each check and depth it reports:

* the check alone: ``is_evaluated`` over every array of the objects (the chains and the evaluated
  arrays), per array and per sweep (median of ``--sweeps`` sweeps);
* the readings: a ``Watchdog`` (defaults, no exporter) observes the objects for ``--steps`` steps;
  the ``observe()`` calls that walked are the readings (wall time, median and worst; CPU time of
  the calling and walker threads, ``graph.cpu_clock``, median: what a loaded machine does not
  inflate). A sampled reading also walks one chain of the site (its reference). The
  watchdog's resident buffers at the end are checked against the workload's own count:
  ``chains x (depth + steps + 1)`` scalars the chains hold, plus the evaluated arrays.

    python benchmarks/evaluated_check.py                          # depths 1,000 and 5,000: ~1 min
    python benchmarks/evaluated_check.py --depths 1000,5000 --checks descriptor,export --out r.md

Run it once per MLX (a venv of mlx 0.31.2 and one of 0.32.4): the checks a version has not are
left out. Needs only mlx and mlx_watchdog.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import mlx.core as mx

from mlx_watchdog import Watchdog
from mlx_watchdog.core import graph


class ChainCache:  # one evaluated array and one lazy chain: two sites
    def __init__(self, depth: int):
        self.keys = mx.zeros((1, 4))
        x = mx.array(0)
        mx.eval(self.keys, x)
        for _ in range(depth):
            x = x - 1
        self.state = x


def run_one(check: str, depth: int, args) -> dict:
    graph.use_evaluated_check(check)
    caches = [ChainCache(depth) for _ in range(args.chains)]
    arrays = [a for c in caches for a in (c.keys, c.state)]
    sweeps = []
    for _ in range(args.sweeps):
        t = time.perf_counter()
        told = [graph.is_evaluated(a) for a in arrays]
        sweeps.append(time.perf_counter() - t)
    assert told.count(False) == args.chains, told  # every chain pending, every key evaluated
    wd = Watchdog(export=False)
    readings, cpu = [], []
    for _ in range(args.steps):
        for c in caches:
            c.state = c.state - 1
        walks, t, c0 = wd.walks, time.perf_counter(), graph.cpu_clock()
        wd.observe(caches)
        if wd.walks > walks:
            readings.append(time.perf_counter() - t)
            cpu.append(graph.cpu_clock() - c0)
    forecast = wd.forecast()
    truth = args.chains * (depth + args.steps + 1) + args.chains
    sweep = statistics.median(sweeps)
    return {
        "check": check,
        "depth": depth,
        "per_array_us": sweep / len(arrays) * 1e6,
        "sweep_ms": sweep * 1e3,
        "readings": len(readings),
        "reading_median_ms": statistics.median(readings) * 1e3 if readings else float("nan"),
        "reading_max_ms": max(readings) * 1e3 if readings else float("nan"),
        "reading_cpu_ms": statistics.median(cpu) * 1e3 if cpu else float("nan"),
        "resident": forecast.resident_buffers,
        "truth": truth,
        "errors": wd.internal_errors,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="1000,5000", help="chain depths, comma list")
    p.add_argument("--chains", type=int, default=47)
    p.add_argument("--steps", type=int, default=64, help="observed steps per check and depth")
    p.add_argument("--sweeps", type=int, default=5)
    p.add_argument("--checks", default=",".join(graph.EVALUATED_CHECKS), help="comma list")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    checks = []
    for check in args.checks.split(","):
        try:
            graph.use_evaluated_check(check)
            checks.append(check)
        except ValueError as exc:
            print(f"left out: {exc}", file=sys.stderr)
    rows = [run_one(c, int(d), args) for d in args.depths.split(",") for c in checks]
    graph.use_evaluated_check(None)
    lines = [
        "# Telling evaluated arrays: the check alone and the readings",
        "",
        "Command:",
        "",
        "    " + shlex.join([sys.executable, "benchmarks/evaluated_check.py", *(argv or sys.argv[1:])]),
        "",
        f"mlx {mx.__version__}, Python {platform.python_version()}, {platform.machine()} "
        f"{platform.system()}; {args.chains} objects of one evaluated array and one chain, "
        f"{args.steps} steps; default check here: {graph.evaluated_check()}.",
        "",
        "| check | depth | is_evaluated per array (us) | per sweep of "
        f"{2 * args.chains} arrays (ms) | readings | reading median (ms) | reading CPU median (ms) "
        "| worst reading (ms) "
        "| resident read / truth | internal errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['check']} | {r['depth']} | {r['per_array_us']:.1f} | {r['sweep_ms']:.2f} | "
            f"{r['readings']} | {r['reading_median_ms']:.1f} | {r['reading_cpu_ms']:.1f} | {r['reading_max_ms']:.1f} | "
            f"{r['resident']:.0f} / {r['truth']} | {r['errors']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
