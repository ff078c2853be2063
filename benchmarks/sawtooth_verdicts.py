"""A leak beside a sawtooth, on the real clock: from which step does the watchdog read it right?

One cache object per "cache" holds a chain the program evaluates every PERIOD steps (a sawtooth,
bounded) and a counter rebound each step and never evaluated (a leak, a buffer a step), either as
two attributes or in one list attribute (one site). With ``--bounded``, the counter is left out.
Each step sleeps STEP seconds (the device's time), so walks by decode time come as they would on a
decode of that speed. The truth is the exact live-buffer count (tests/exact_buffers.py, MLX's CPU
backend).

    python benchmarks/sawtooth_verdicts.py --steps 1000 --step-ms 1,4 --periods 8,50,256 [--load 2]

Prints a markdown table: for each case the exact rate, the rate read at the last step, and the
first step from which every forecast to the end reads the rate within 5% and the right sites
("-" when it never settles). Exits 1 on an internal error of the watchdog.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx.core as mx  # noqa: E402
from exact_buffers import install  # noqa: E402

from mlx_watchdog import Watchdog  # noqa: E402


class Mixed:
    def __init__(self, layout: str, leak: bool) -> None:
        self.layout, self.leak = layout, leak
        rows, tick = mx.zeros((1, 4)), mx.array(0)
        mx.eval(rows, tick)
        if layout == "one site":
            self.state = [rows, tick]
        else:
            self.rows, self.tick = rows, tick

    def advance(self) -> None:
        if self.layout == "one site":
            rows, tick = self.state
            self.state = [
                mx.concatenate([rows[:, -4:], mx.ones((1, 1))], axis=1),
                tick + 1 if self.leak else tick,
            ]
        else:
            self.rows = mx.concatenate([self.rows[:, -4:], mx.ones((1, 1))], axis=1)
            if self.leak:
                self.tick = self.tick + 1

    def cut(self) -> None:
        mx.eval(self.state[0] if self.layout == "one site" else self.rows)


def expected(layout: str, leak: bool, caches: int) -> tuple[float, tuple, tuple]:
    if layout == "one site":
        return (float(caches), ("Mixed.state",), ()) if leak else (0.0, (), ("Mixed.state",))
    return (float(caches), ("Mixed.tick",), ("Mixed.rows",)) if leak else (0.0, (), ("Mixed.rows",))


def run(counter, layout: str, leak: bool, period: int, steps: int, step_seconds: float, caches: int):
    base = counter.live()
    mixed = [Mixed(layout, leak) for _ in range(caches)]
    wd = Watchdog(limit=10**6, export=False)
    verdicts, live = [], []
    for n in range(1, steps + 1):
        time.sleep(step_seconds)
        wd.observe(mixed)
        for c in mixed:
            c.advance()
        if n % period == 0:
            for c in mixed:
                c.cut()
        live.append(counter.live() - base)
        f = wd.forecast()
        verdicts.append(
            (f.buffers_per_step, tuple(x.site for x in f.leaks), tuple(x.site for x in f.bounded))
        )
    span = period * max(1, (steps // 2) // period)
    truth = (live[-1] - live[-1 - span]) / span
    rate, leaks, bounded = expected(layout, leak, caches)
    right = [abs(r - rate) <= 0.05 * rate + 1e-3 and (lk, bd) == (leaks, bounded) for r, lk, bd in verdicts]
    settled = next((i + 1 for i in range(steps) if all(right[i:])), None)
    return truth, verdicts[-1][0], settled, wd.internal_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--step-ms", default="1,4")
    parser.add_argument("--periods", default="8,50,256")
    parser.add_argument("--caches", type=int, default=4)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the run")
    args = parser.parse_args(argv)
    counter = install()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    errors = 0
    try:
        print("| layout | leak | period | step | exact rate | read at the end | right from step |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for period in map(int, args.periods.split(",")):
            for layout in ("attributes", "one site"):
                for leak in (True, False):
                    for ms in map(float, args.step_ms.split(",")):
                        truth, read, settled, failed = run(
                            counter, layout, leak, period, args.steps, ms / 1000, args.caches
                        )
                        errors += failed
                        print(
                            f"| {layout} | {'yes' if leak else 'no'} | {period} | {ms:g} ms | {truth:.3f} "
                            f"| {read:.3f} | {settled if settled else '-'} |",
                            flush=True,
                        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
