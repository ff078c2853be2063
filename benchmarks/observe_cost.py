"""CPU cost of one ``Watchdog.observe`` between walks, by cache size (issue 3: choosing fix_every).

Not the real cost of watching (that is decode tokens/s, ``decode_tokens_per_s.py``), but the
part of it that a fast device cannot hide: on a GPU a decode step is a few milliseconds, and
the watchdog's Python work per step sits on the critical path when the host builds the graph.
Each figure is the minimum over repetitions of the mean of many calls, so a busy machine
inflates it little. Walks are switched off after a few warm-up steps (they are budgeted
separately, at ``overhead_budget`` of decode time).

    python benchmarks/observe_cost.py --layers 4 16 48
    python benchmarks/observe_cost.py --layers 4 48 --in-decode   # also: inside a real decode

``--in-decode`` adds the same figure measured inside a real ``generate_step`` decode of the tiny
llama: the median, over steps that did not walk, of what ``overhead_seconds`` grew by. The model's
work between two calls leaves the CPU caches cold, so this is several times the hot-loop figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_watchdog import Watchdog
from mlx_watchdog.tiny import build_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import shadow  # noqa: E402

CONFIGS = {
    "watched": (Watchdog, {}),
    "fix": (Watchdog, {"fix": True}),
    "fix4": (Watchdog, {"fix": True, "fix_every": 4}),
    "fix16": (Watchdog, {"fix": True, "fix_every": 16}),
}


def per_call_us(wd: Watchdog, cache, calls: int, repeats: int) -> float:
    for _ in range(4):  # walk, probe, fix: the paths are known
        wd.observe(cache)
    shadow(wd._schedule, "due", lambda step: False)  # between walks only
    return min(timeit.timeit(lambda: wd.observe(cache), number=calls) / calls for _ in range(repeats)) * 1e6


def walk_us(cache, repeats: int) -> float:
    wd = Watchdog(export=False)
    wd.observe(cache)
    return min(timeit.timeit(lambda: wd._walk(cache, 1), number=20) / 20 for _ in range(repeats)) * 1e6


def in_decode_us(model, cache, steps: int, **options) -> float:
    """Median growth of ``overhead_seconds`` over the decode steps that did not walk."""
    from mlx_watchdog.attach.model import unwatch_model, watch_model

    wd = Watchdog(export=False, **options)
    watch_model(model, wd)
    try:
        decode = generate_step(mx.array([1, 2, 3, 4]), model, max_tokens=steps + 64, prompt_cache=cache)
        for _ in range(64):  # the dense walks of the start
            next(decode)
        per_step = []
        for _ in range(steps):
            spent, walks = wd.overhead_seconds, wd.walks
            next(decode)
            if wd.walks == walks:
                per_step.append(wd.overhead_seconds - spent)
        decode.close()
    finally:
        unwatch_model(model)
    return statistics.median(per_step) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 48])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--in-decode", action="store_true", help="also measure inside a real decode (watched, fix)"
    )
    args = p.parse_args(argv)
    extra = " | in a decode: watched us/step | in a decode: fix us/step" if args.in_decode else ""
    print(
        "| llama KV cache | arrays | "
        + " | ".join(f"{name} us/step" for name in CONFIGS)
        + " | one walk us"
        + extra
        + " |"
    )
    print("|---|---|" + "---|" * (len(CONFIGS) + 1 + 2 * args.in_decode))
    for layers in args.layers:
        model = build_model("llama", layers=layers)
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2, 3, 4]]), cache=cache)
        mx.eval([c.state for c in cache])
        cells = [
            f"{per_call_us(cls(export=False, **kw), cache, args.calls, args.repeats):.1f}"
            for cls, kw in CONFIGS.values()
        ]
        cells.append(f"{walk_us(cache, 3):.0f}")
        if args.in_decode:
            cells += [
                f"{in_decode_us(model, make_prompt_cache(model), args.calls, **kw):.1f}"
                for kw in ({}, {"fix": True})
            ]
        print(f"| {layers} layers | {2 * layers} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
