"""Cost of watching a leak that is left unfixed for a long decode (issue: core, cost target).

Two identical tiny hybrid models decode through mlx-lm's BatchGenerator (the leaking path),
one watched (fix off), one not. They advance in alternating chunks (AB, BA, AB, ...) inside
one process, so machine noise hits both alike; each chunk's time ratio watched/unwatched is
one sample. The leak grows in both for the whole run, so the watched graph walks get more
and more expensive: the sampling budget must keep the watchdog near 1% anyway.

    python benchmarks/leak_overhead.py --steps 20000 --chunk 500
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import watch_model
from mlx_watchdog.tiny import build_model, tiny_prompts


def run_chunk(gen: BatchGenerator, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        gen.next_generated()
    mx.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--chunk", type=int, default=500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()

    prompts = tiny_prompts(args.batch, 8, 512)
    plain = build_model("qwen3_next", layers=args.layers)
    watched = build_model("qwen3_next", layers=args.layers)
    wd = Watchdog()  # the device limit (499,000 here): the leak is never stopped
    watch_model(watched, wd)
    gens = {}
    for label, model in (("unwatched", plain), ("watched", watched)):
        gen = BatchGenerator(model, max_tokens=args.steps + 10)
        gen.insert(prompts)
        gen.next_generated()  # prefill
        gens[label] = gen

    times = {"unwatched": [], "watched": []}
    order = ["unwatched", "watched"]
    for i in range(args.steps // args.chunk):
        for label in order if i % 2 == 0 else reversed(order):
            times[label].append(run_chunk(gens[label], args.chunk))

    ratios = [w / u for w, u in zip(times["watched"], times["unwatched"])]
    q = statistics.quantiles(ratios, n=4)
    total_w, total_u = sum(times["watched"]), sum(times["unwatched"])
    f = wd.forecast()
    print(
        f"# leak_overhead: {args.steps} steps, chunks of {args.chunk}, {args.layers} layers, batch {args.batch}"
    )
    print(
        f"machine: {platform.machine()} {platform.processor()} mlx {mx.__version__} device {mx.default_device()}"
    )
    print(f"unwatched total {total_u:.2f} s ({args.steps / total_u:.1f} steps/s)")
    print(f"watched   total {total_w:.2f} s ({args.steps / total_w:.1f} steps/s)")
    print(
        f"slowdown per chunk (watched/unwatched - 1): median {100 * (statistics.median(ratios) - 1):+.2f}% "
        f"IQR [{100 * (q[0] - 1):+.2f}%, {100 * (q[2] - 1):+.2f}%] over {len(ratios)} chunk pairs"
    )
    print(f"slowdown in total: {100 * (total_w / total_u - 1):+.2f}%")
    print(
        f"self-timed overhead: {wd.overhead_seconds:.3f} s = {100 * wd.overhead_seconds / total_w:.2f}% "
        f"of watched decode time; {wd.walks} graph walks"
    )
    print(f"forecast at the end: {f.describe()}")


if __name__ == "__main__":
    main()
