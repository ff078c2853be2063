"""What reading an object's ``__dict__`` costs the program afterwards (CPython 3.11+).

CPython 3.11+ keeps an instance's attributes inline, without a dict object, until something asks
for its ``__dict__``; then the object gets a real dict for good. A walk that read every cache's
``__dict__`` would leave each cache of the decode with one (``rawread.py`` reads by name instead).
Two measurements, each paired with an A/A control:

* ``--pure`` (any Python, no MLX): the attribute traffic of a KV cache's update (5 reads, 2
  writes) on 48 plain objects, fresh against objects whose ``__dict__`` was read once, and
  against objects read the ways the walk reads them now (``gc.get_referents``,
  ``object.__getattribute__``). Best of 5 blocks each, in microseconds for the 48.
* default (needs MLX and mlx-lm): the graph build of a 48-layer tiny llama's forward (no
  evaluation timed) on three cache sets taking turns in a rotating order: two untouched (A/A) and
  one whose caches' ``__dict__`` was read once; median and trimmed mean of the paired
  differences, in microseconds a forward.

Usage: python benchmarks/inline_attributes.py [--pure] [--forwards 3000]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time


class Cache:
    def __init__(self) -> None:
        self.keys = None
        self.values = None
        self.offset = 0
        self.step = 256


def _traffic(objs: list, blocks: int = 5, rounds: int = 800) -> float:
    best = float("inf")
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(rounds):
            for c in objs:
                c.offset += 1
                c.offset -= 1
                _ = c.keys, c.values, c.step
        best = min(best, (time.perf_counter() - start) / rounds * 1e6)
    return best


def pure() -> None:
    touches = {
        "untouched": lambda c: None,
        "untouched again (A/A)": lambda c: None,
        "__dict__ read once": lambda c: c.__dict__,
        "gc.get_referents": gc.get_referents,
        "object.__getattribute__": lambda c: [
            object.__getattribute__(c, n) for n in ("keys", "values", "offset", "step")
        ],
    }
    print(f"Python {sys.version.split()[0]}: 48 objects, 5 attribute reads and 2 writes each, us (best of 5)")
    for label, touch in touches.items():
        objs = [Cache() for _ in range(48)]
        _traffic(objs, blocks=1)  # the interpreter specializes the loop first, as a decode's would be
        for c in objs:
            touch(c)
        print(f"| {label} | {_traffic(objs):.2f} |")


def forward(forwards: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.tiny import build_model

    model = build_model("llama", layers=48)
    token = mx.array([[1]])
    sets = {name: make_prompt_cache(model) for name in ("a", "a2", "read")}
    for cache in sets.values():
        mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    for c in sets["read"]:
        c.__dict__  # what a walk reading __dict__ would do

    def build(cache) -> float:
        start = time.perf_counter()
        out = model(token, cache=cache)
        elapsed = time.perf_counter() - start
        mx.eval(out, [c.keys for c in cache])
        return elapsed

    times = {name: [] for name in sets}
    order = list(sets)
    for _i in range(forwards):
        order = order[1:] + order[:1]  # no set always goes first
        for name in order:
            times[name].append(build(sets[name]))
    print(
        f"Python {sys.version.split()[0]}, MLX {mx.__version__} on {mx.default_device()}: "
        f"48-layer llama forward (graph build only), {forwards} forwards a set, taking turns"
    )
    print("| compared | median difference, us | trimmed mean (10%), us |")
    print("|---|---|---|")
    for label, other in (("a2 - a (A/A)", "a2"), ("read - a", "read")):
        d = sorted(1e6 * (x - y) for x, y in zip(times[other][100:], times["a"][100:]))
        cut = len(d) // 10
        print(f"| {label} | {statistics.median(d):+.1f} | {statistics.fmean(d[cut:-cut]):+.1f} |")
    print(f"(a's median forward: {1e6 * statistics.median(times['a'][100:]):.0f} us)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pure", action="store_true", help="the plain-object measurement only (no MLX needed)")
    p.add_argument("--forwards", type=int, default=3000)
    args = p.parse_args()
    pure()
    if not args.pure:
        forward(args.forwards)


if __name__ == "__main__":
    main()
