"""What the process-wide buffer count (``mlx_watchdog.core.process_count``) costs, and how noisy a
reading without ``mx.synchronize()`` is.

Three parts, each printing a markdown report (appended to ``--out`` when given):

* ``alloc``: CPU nanoseconds per buffer (one malloc and one free) through MLX's allocator as libmlx
  calls it, through its vtable (``alloc_cost.c``), with no hook (``off``, and ``aa``: off again,
  the A/A control), with the product's hook (``count``: one atomic counter) and with the tests'
  exact counter (``set``: tests/exact_buffers.c, a hash set of live pointers under a mutex).
  Variants take turns in a random order each round; a round's differences to ``off`` are paired.
* ``decode``: tokens per second (wall and CPU) of a tiny leak-free llama decode (mlx-lm's ``generate_step``) with each of
  those hooks, in chunks taking turns (``paired_stats.paired_ratio``: a bootstrap interval over
  repetitions and rounds; ``aa`` against ``off`` is the resolution of the run). Also the buffers
  one decode step allocates (read from the exact counter's malloc calls).
* ``noise``: a watched decode (``Watchdog(process_count=True)``) with a program object outside
  the cache that leaks two buffers a step (``history = concatenate([history, token])``,
  ``score = score + logprobs.max()``). At each walk, the watchdog's reading (no synchronize: the
  lowest count over the walk) against the exact count read right after it (after
  ``mx.synchronize()``): their difference is constant where the reading has no noise; its spread
  is what a step still computing adds. Also the growth of the two counts after synchronize (they
  must agree), and the rate the watchdog read against the exact count's. ``--reading instant``
  reads the count at one instant of the walk instead, for comparison.

    python benchmarks/process_count_cost.py alloc --rounds 40
    python benchmarks/process_count_cost.py decode --layers 8 --reps 3 --rounds 40 --chunk 32
    python benchmarks/process_count_cost.py noise --layers 4,16 --steps 600
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import exact_buffers  # noqa: E402  (tests/: the independent exact count)
from paired_stats import emit, paired_ratio  # noqa: E402

VARIANTS = ("off", "aa", "count", "set")


def header(part: str) -> str:
    import mlx.core as mx

    return (
        f"\n## {part}\n\n`python benchmarks/process_count_cost.py {shlex.join(sys.argv[1:])}`\n\n"
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; mlx {mx.__version__}, device {mx.default_device()}\n"
    )


class Hooks:
    """Puts one hook in MLX's allocator at a time: none, the product's count, or the tests' set."""

    def __init__(self) -> None:
        from mlx_watchdog.core import process_count

        self.address = process_count.allocator_address()
        self.count = process_count.load_shim(process_count.build_shim())
        self.state = "off"

    def set(self, variant: str) -> None:
        want = {"off": "off", "aa": "off", "count": "count", "set": "set"}[variant]
        if want == self.state:
            return
        if self.state == "count" and self.count.uninstall() != 0:
            raise RuntimeError("the count's hook could not be taken out")
        if self.state == "set":
            exact_buffers.uninstall()
        if want == "count" and self.count.install(self.address) != 0:
            raise RuntimeError("the count's hook could not be put in")
        if want == "set":
            exact_buffers.install()
        self.state = want


def bootstrap_median(values: list[float], seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    data = np.asarray(values, dtype=float)
    medians = np.median(rng.choice(data, size=(4000, len(data))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def alloc_part(args) -> None:
    import mlx.core as mx  # noqa: F401

    src = HERE / "alloc_cost.c"
    out = Path(tempfile.mkdtemp(prefix="alloc-cost-")) / "alloc_cost.so"
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], check=True
    )
    bench = ctypes.CDLL(str(out))
    bench.alloc_free_ns.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_long]
    bench.alloc_free_ns.restype = ctypes.c_double
    hooks = Hooks()
    rng = np.random.default_rng(0)
    lines = [header("alloc: CPU nanoseconds per buffer (one malloc and one free through the vtable)")]
    for size, batch in ((256, 1), (256, 64), (65536, 64)):
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in rng.permutation(VARIANTS):
                hooks.set(str(v))
                bench.alloc_free_ns(hooks.address, size, batch, 200)  # warm
                times[str(v)].append(bench.alloc_free_ns(hooks.address, size, batch, args.calls // batch))
        hooks.set("off")
        lines.append(
            f"\n{size} bytes, {batch} live at a time, {args.rounds} rounds of {args.calls} buffers:\n"
        )
        lines.append("| variant | median ns/buffer | paired difference to `off`, median (95% interval) |")
        lines.append("|---|---|---|")
        for v in VARIANTS:
            diffs = [a - b for a, b in zip(times[v], times["off"])]
            low, high = bootstrap_median(diffs)
            diff = "" if v == "off" else f"{statistics.median(diffs):+.1f} ({low:+.1f} .. {high:+.1f})"
            lines.append(f"| `{v}` | {statistics.median(times[v]):.1f} | {diff} |")
    emit("\n".join(lines), args.out)


def decode_part(args) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.tiny import build_model

    hooks = Hooks()
    model = build_model("llama", layers=args.layers)
    prompt = mx.array(list(range(1, 17)))
    rng = np.random.default_rng(1)
    table: dict[str, dict[tuple, tuple[float, float]]] = {v: {} for v in VARIANTS}
    cpu_table: dict[str, dict[tuple, tuple[float, float]]] = {v: {} for v in VARIANTS}
    allocations: list[float] = []
    for rep in range(args.reps):
        gens = {
            v: generate_step(prompt, model, prompt_cache=make_prompt_cache(model), max_tokens=10**9)
            for v in VARIANTS
        }
        for v in VARIANTS:  # prefill and first steps: one-off costs, untimed
            for _ in range(8):
                next(gens[v])
        for round_ in range(args.rounds):
            for v in rng.permutation(VARIANTS):
                v = str(v)
                hooks.set(v)
                mx.synchronize()
                calls = exact_buffers.install().stats(sync=False)["malloc_calls"] if v == "set" else 0
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.chunk):
                    next(gens[v])
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                if v == "set":
                    mx.synchronize()
                    made = exact_buffers.install().stats(sync=False)["malloc_calls"] - calls
                    allocations.append(made / args.chunk)
                table[v][("run", rep, round_)] = (float(args.chunk), seconds)
                cpu_table[v][("run", rep, round_)] = (float(args.chunk), cpu)
        hooks.set("off")
        del gens
    lines = [header(f"decode: tokens/s of a tiny llama ({args.layers} layers) through generate_step")]
    lines.append(
        f"\n{args.reps} repetitions x {args.rounds} rounds x {args.chunk} tokens a variant; "
        f"{statistics.median(allocations):.0f} buffers allocated a step (median over chunks)\n"
    )
    lines.append(
        "| variant vs `off` | clock | tokens per second ratio | 95% interval | rounds | per-round IQR |"
    )
    lines.append("|---|---|---|---|---|---|")
    for clock, data in (("wall", table), ("CPU (all threads)", cpu_table)):
        for v in ("aa", "count", "set"):
            r = paired_ratio(data, v, "off")
            if r is not None:
                lines.append(
                    f"| `{v}` | {clock} | {r.percent()} | {r.interval()} | {r.rounds} | {100 * r.spread:.2f} pts |"
                )
    tokens_per_s = sum(t for t, _ in table["off"].values()) / sum(s for _, s in table["off"].values())
    lines.append(f"\n`off` decoded {tokens_per_s:.0f} tokens/s.")
    emit("\n".join(lines), args.out)


def noise_part(args) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog import Watchdog
    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.core import process_count
    from mlx_watchdog.tiny import build_model

    exact = exact_buffers.install()
    rows: list[tuple[int, int, float, int]] = []  # (step, the reading's raw count, walked, exact count)
    reading = process_count.ProcessCounter.reading

    def recorded(self, step, walked):
        resident = reading(self, step, walked)
        rows.append((step, self.last_raw, walked, exact.live()))  # exact.live() synchronizes
        return resident

    process_count.ProcessCounter.reading = recorded  # type: ignore[method-assign]
    if args.reading == "instant":  # the count at the instant of the reading: no interval
        process_count.ProcessCounter.mark = lambda self: None  # type: ignore[method-assign]
    lines = [header(f"noise: the count read without synchronize ({args.reading}), at each walk")]
    lines.append(
        "| layers | walks | reading - exact: median, spread (max - min), IQR | readings above the "
        "median by 3+ | counts' growth apart (after synchronize) | rate read | exact rate |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for layers in args.layers:
        model = build_model("llama", layers=layers)
        rows.clear()
        wd = Watchdog(limit=10**6, export=False, process_count=True)
        if wd.process_count_off:
            raise SystemExit(f"the process count is off: {wd.process_count_off}")
        reader, _ = process_count.counter(True)
        watch_model(model, wd)

        class Scheduler:  # a server's own per-step outputs, kept lazily: +2 buffers a step
            def __init__(self):
                self.history, self.score = mx.array([0]), mx.array(0.0)
                mx.eval(self.history, self.score)

            def step(self, token, logprobs):
                self.history = mx.concatenate([self.history, mx.array([token])])
                self.score = self.score + logprobs.max()

        scheduler = Scheduler()
        cache = make_prompt_cache(model)
        marks = []
        synced = []
        for i, (token, logprobs) in enumerate(
            generate_step(mx.array(list(range(1, 17))), model, prompt_cache=cache, max_tokens=args.steps)
        ):
            scheduler.step(token, logprobs)
            if i in (args.steps // 5, args.steps - 2):
                marks.append((wd.steps, exact.live()))
                synced.append((reader.raw(), marks[-1][1]))  # both after synchronize
        f = wd.forecast()
        unwatch_model(model)
        offsets = [raw - truth for _, raw, _, truth in rows]
        median = statistics.median(offsets)
        q1, q3 = np.percentile(offsets, [25, 75])
        spikes = sum(o >= median + 3 for o in offsets)
        apart = abs((synced[1][0] - synced[0][0]) - (synced[1][1] - synced[0][1]))
        exact_rate = (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0])
        lines.append(
            f"| {layers} | {len(rows)} | {median:+.0f}, {max(offsets) - min(offsets)}, {q3 - q1:.1f} | "
            f"{spikes} | {apart} | {f.buffers_per_step:.3f} (unattributed {f.unattributed_buffers_per_step:.3f})"
            f" | {exact_rate:.3f} |"
        )
    emit("\n".join(lines), args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("alloc", "decode", "noise"))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--calls", type=int, default=200_000, help="alloc: buffers timed per variant and round")
    p.add_argument("--layers", default="8", help="decode: layers; noise: comma-separated layer counts")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--reading", choices=("lowest", "instant"), default="lowest", help="noise: how the count is read"
    )
    p.add_argument("--out", default=None, help="append the report to this file")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    if args.part == "alloc":
        alloc_part(args)
    elif args.part == "decode":
        args.layers = layers[0]
        decode_part(args)
    else:
        args.layers = layers
        noise_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
