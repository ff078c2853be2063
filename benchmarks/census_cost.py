"""What the census (``mlx_watchdog.core.census``) costs: one census, and a decode watched with it.

Two parts, each printing a markdown report (appended to ``--out`` when given):

* ``census``: the CPU and wall time of one census (a pass over every object the garbage collector
  tracks: the pending arrays among them, their holders) in this process grown to each of
  ``--objects`` objects (plain instances, dicts and lists added), with a scheduler holding two
  lazy chains for it to find. Each round runs ``census`` (one census) and ``control`` (the same
  harness, no census) in a random order; their paired differences give a median and a 95%
  bootstrap interval. The census must find the scheduler's two attributes every time.
* ``decode``: tokens per second of a tiny llama decode (mlx-lm's ``generate_step``) watched by a
  ``Watchdog`` with the census on (``census``) against the same watchdog with it off (``off``,
  and ``aa``: off again, the A/A control), each beside a program object (``--program clean``: a
  lazy value rebound every step, one buffer behind it, no leak; ``leak``: the scheduler's two
  chains, +2 buffers a step), in chunks taking turns (``paired_stats.paired_ratio``: a bootstrap
  interval over repetitions and rounds). The process is grown to ``--objects`` objects first (a
  census passes over all of them). Also the census's own time as a share of the decode (it is
  charged to the watchdog's budget: at most a quarter of it), the censuses run and what they named.

    python benchmarks/census_cost.py census --objects 100000,300000,1000000 --rounds 20
    python benchmarks/census_cost.py decode --program clean --objects 300000 --reps 3 --rounds 30
    python benchmarks/census_cost.py decode --program leak --objects 300000 --reps 3 --rounds 30

* ``budget``: one long decode of that llama beside ``--program``, watched with the census on or
  off (``--census``) and the process count as users have it, and at each of ``--checkpoints``
  steps the watchdog's own time (``Watchdog.overhead_seconds``: all of ``observe()``, walks,
  censuses and owed walks included) as a share of the decode's wall time so far, beside what the
  budget allows then (1% of decode, at least the 0.25 s start-up credit). The owed walks (a new
  decode's first ones, the beats at steps 96, 144, 216, ...) are paid whatever the budget: this
  says how far they take the share over it, and how soon it comes back.

    python benchmarks/census_cost.py budget --program leak --census on --checkpoints 1000,2000,5000,10000,20000
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from paired_stats import emit, paired_ratio  # noqa: E402

VARIANTS = ("off", "aa", "census")


def header(part: str) -> str:
    import mlx.core as mx

    return (
        f"\n## {part}\n\n`python benchmarks/census_cost.py {shlex.join(sys.argv[1:])}`\n\n"
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; Python {platform.python_version()}; mlx {mx.__version__}, "
        f"device {mx.default_device()}\n"
    )


def bootstrap_median(values: list[float], seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    data = np.asarray(values, dtype=float)
    medians = np.median(rng.choice(data, size=(4000, len(data))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


class Filler:
    """An object of the program that holds no array (what a big process is mostly made of)."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.name = None


_ballast: list = []


def grow_to(objects: int) -> int:
    """Add plain instances, dicts and lists until the collector tracks ``objects``; returns how
    many it tracks."""
    gc.collect()
    have = len(gc.get_objects())
    missing = max(0, objects - have)
    for i in range(missing // 3):  # each tracked by the collector (a dict of atoms alone is not)
        filler = Filler(i)
        _ballast.append(filler)
        _ballast.append({"i": i, "box": filler})
        _ballast.append([i, filler])
    gc.collect()
    return len(gc.get_objects())


def make_scheduler():
    import mlx.core as mx

    class Scheduler:  # a server's own per-step outputs, kept lazily: +2 buffers a step
        def __init__(self):
            self.history, self.score = mx.array([0]), mx.array(0.0)
            mx.eval(self.history, self.score)

        def step(self, token, logprobs):
            self.history = mx.concatenate([self.history, mx.array([token])])
            self.score = self.score + logprobs.max()

    class Clean:  # a lazy value rebound every step: one step's buffer behind it, never more
        def __init__(self):
            self.peak = mx.array(0.0)

        def step(self, token, logprobs):
            self.peak = logprobs.max()

    return Scheduler, Clean


def census_part(args) -> None:
    import mlx.core as mx

    from mlx_watchdog.core import census

    scheduler_class, _ = make_scheduler()
    scheduler = scheduler_class()
    for i in range(64):
        scheduler.step(i, mx.arange(8, dtype=mx.float32))
    rng = np.random.default_rng(2)
    lines = [header("census: the time of one census, by the objects of the process")]
    lines.append(
        "| objects | censuses | CPU ms a census: median of paired differences (95% interval) | "
        "wall ms (95% interval) | CPU ms per 100,000 objects | named |"
    )
    lines.append("|---|---|---|---|---|---|")
    for objects in args.objects:
        tracked = grow_to(objects)
        cpu: dict[str, list[float]] = {"census": [], "control": []}
        wall: dict[str, list[float]] = {"census": [], "control": []}
        named = set()
        for _ in range(args.rounds):
            for variant in rng.permutation(("census", "control")):
                c = census.Census(True)
                start, cpu0 = time.perf_counter(), time.thread_time()
                if variant == "census":
                    c.discover([])
                seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - cpu0
                cpu[str(variant)].append(1e3 * cpu_seconds)
                wall[str(variant)].append(1e3 * seconds)
                if variant == "census":
                    named.add(tuple(sorted(s.rsplit(".", 1)[-1] for s in c.sites)))
        if named != {("history", "score")}:
            raise SystemExit(f"the census did not name the scheduler's chains every time: {named}")
        diffs = [a - b for a, b in zip(cpu["census"], cpu["control"])]
        wall_diffs = [a - b for a, b in zip(wall["census"], wall["control"])]
        low, high = bootstrap_median(diffs)
        wlow, whigh = bootstrap_median(wall_diffs)
        median = statistics.median(diffs)
        lines.append(
            f"| {tracked:,} | {args.rounds} | {median:.1f} ({low:.1f} .. {high:.1f}) | "
            f"{statistics.median(wall_diffs):.1f} ({wlow:.1f} .. {whigh:.1f}) | "
            f"{1e5 * median / tracked:.1f} | history, score |"
        )
    emit("\n".join(lines), args.out)


def step(gen, program) -> None:
    """One decode step, and the program object's own step with its token and log-probabilities."""
    token, logprobs = next(gen)
    program.step(token, logprobs)


def decode_part(args) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog import Watchdog
    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.tiny import build_model

    tracked = grow_to(args.objects[0])
    scheduler_class, clean_class = make_scheduler()
    program = scheduler_class if args.program == "leak" else clean_class
    prompt = mx.array(list(range(1, 17)))
    rng = np.random.default_rng(1)
    table: dict[str, dict[tuple, tuple[float, float]]] = {v: {} for v in VARIANTS}
    cpu_table: dict[str, dict[tuple, tuple[float, float]]] = {v: {} for v in VARIANTS}
    models = {v: build_model("llama", layers=args.layers) for v in VARIANTS}
    shares, reads, runs, named, errors = [], [], [], set(), 0
    for rep in range(args.reps):
        watchdogs = {
            v: Watchdog(limit=10**6, export=False, process_count=False, census=v == "census")
            for v in VARIANTS
        }
        programs = {v: program() for v in VARIANTS}
        gens = {}
        for v in VARIANTS:
            watch_model(models[v], watchdogs[v])
            gens[v] = generate_step(
                prompt, models[v], prompt_cache=make_prompt_cache(models[v]), max_tokens=10**9
            )
        decode_seconds = dict.fromkeys(VARIANTS, 0.0)
        for v in VARIANTS:  # prefill and first steps: one-off costs, untimed
            for _ in range(4):
                step(gens[v], programs[v])
        for round_ in range(args.rounds):
            for v in rng.permutation(VARIANTS):
                v = str(v)
                mx.synchronize()
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.chunk):
                    step(gens[v], programs[v])
                mx.synchronize()
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                decode_seconds[v] += seconds
                table[v][("run", rep, round_)] = (float(args.chunk), seconds)
                cpu_table[v][("run", rep, round_)] = (float(args.chunk), cpu)
        wd = watchdogs["census"]
        shares.append(wd.census.seconds / decode_seconds["census"])
        reads.append(wd.census.read_seconds / decode_seconds["census"])
        runs.append(wd.census.runs)
        named.update(wd.census.sites)
        errors += sum(w.internal_errors + w.census.errors for w in watchdogs.values())
        for v in VARIANTS:
            unwatch_model(models[v])
        del gens, programs, watchdogs
    if errors:
        raise SystemExit(f"{errors} internal errors: the run measured an error path")
    lines = [
        header(
            f"decode: tokens/s of a tiny llama ({args.layers} layers, generate_step) beside a "
            f"{args.program} program object, the process at {tracked:,} objects"
        )
    ]
    lines.append(f"\n{args.reps} repetitions x {args.rounds} rounds x {args.chunk} tokens a variant\n")
    lines.append(
        "| variant vs `off` | clock | tokens per second ratio | 95% interval | rounds | per-round IQR |"
    )
    lines.append("|---|---|---|---|---|---|")
    for clock, data in (("wall", table), ("CPU (all threads)", cpu_table)):
        for v in ("aa", "census"):
            r = paired_ratio(data, v, "off")
            if r is not None:
                lines.append(
                    f"| `{v}` | {clock} | {r.percent()} | {r.interval()} | {r.rounds} | {100 * r.spread:.2f} pts |"
                )
    tokens_per_s = sum(t for t, _ in table["off"].values()) / sum(s for _, s in table["off"].values())
    lines.append(
        f"\n`off` decoded {tokens_per_s:.0f} tokens/s. Self-timed, as a share of each repetition's "
        f"decode: the censuses {', '.join(f'{100 * s:.3f}%' for s in shares)} "
        f"({', '.join(map(str, runs))} censuses), the readings of what they found at the walks "
        f"{', '.join(f'{100 * s:.3f}%' for s in reads)}; sites named: {', '.join(sorted(named)) or 'none'}."
    )
    emit("\n".join(lines), args.out)


def budget_part(args) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog import Watchdog
    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.core.schedule import WALK_CREDIT_SECONDS
    from mlx_watchdog.tiny import build_model

    tracked = grow_to(args.objects[0])
    scheduler_class, clean_class = make_scheduler()
    program = (scheduler_class if args.program == "leak" else clean_class)()
    model = build_model("llama", layers=args.layers)
    wd = Watchdog(limit=10**7, export=False, census=args.census == "on")
    watch_model(model, wd)
    gen = generate_step(
        mx.array(list(range(1, 17))), model, prompt_cache=make_prompt_cache(model), max_tokens=10**9
    )
    rows = []
    start = time.perf_counter()
    for done in range(1, max(args.checkpoints) + 1):
        step(gen, program)
        if done in args.checkpoints:
            mx.synchronize()
            decode = time.perf_counter() - start
            own = wd.overhead_seconds
            allowed = max(wd.overhead_budget * decode, WALK_CREDIT_SECONDS)
            forecast = wd.forecast()
            rows.append(
                f"| {done:,} | {decode:.1f} | {own:.3f} | {100 * own / decode:.2f}% | "
                f"{100 * allowed / decode:.2f}% | {wd.walks} | {wd.census.runs} | "
                f"{100 * wd.census.seconds / decode:.2f}% | {100 * wd.census.read_seconds / decode:.2f}% | "
                f"{forecast.buffers_per_step:+.2f} | {os.getloadavg()[0]:.1f} |"
            )
    unwatch_model(model)
    if wd.internal_errors or wd.census.errors:
        raise SystemExit(
            f"{wd.internal_errors + wd.census.errors} internal errors: the run measured an error path"
        )
    lines = [
        header(
            f"budget: the watchdog's own time over one decode of a tiny llama ({args.layers} layers) "
            f"beside a {args.program} program object, census {args.census}, the process at {tracked:,} objects"
        ),
        "",
        "| step | decode s | own s | own share | allowed | walks | censuses | census share | its readings | read /step | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    emit("\n".join(lines), args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("census", "decode", "budget"))
    p.add_argument("--objects", default="100000", help="comma-separated objects the process is grown to")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--program", choices=("clean", "leak"), default="clean")
    p.add_argument("--census", choices=("on", "off"), default="on", help="budget: the census on or off")
    p.add_argument("--checkpoints", default="1000,2000,5000,10000", help="budget: steps read at")
    p.add_argument("--out", default=None, help="append the report to this file")
    args = p.parse_args(argv)
    args.objects = [int(x) for x in args.objects.split(",")]
    args.checkpoints = [int(x) for x in args.checkpoints.split(",")]
    {"census": census_part, "decode": decode_part, "budget": budget_part}[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
