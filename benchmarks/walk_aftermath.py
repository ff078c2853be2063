"""What a walk costs the decode around it, step by step (diagnostic for issue 17).

On the leak-free H200 llama, ``watched`` against ``nowalk`` (the same watchdog with walks
switched off) read -0.9%, while the walks' own timed cost was ~0.14%: a walk costs the decode
more after (or around) it than it takes itself. This decodes the same model in several
configurations taking one-step turns (as ``paired_speed.py --interleave-steps``), walks often
(``walk_interval``), and reports the mean step time at each offset from a walk's step against
the unwatched decode's step at the same step number:

* ``unwatched``  the model as mlx-lm runs it: every other configuration is paired with it
* ``worker``     the watchdog as shipped: the graph export runs on the walker thread
* ``inline``     the export runs on the decode thread (no hand-off)
* ``noexport``   the walk without MLX's export: a DOT text that says every array is evaluated
                 (true on this leak-free model), so what is left is the watchdog's Python

Usage: python benchmarks/walk_aftermath.py --model llama --layers 48 [--hidden 2048 --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from decode_variants import add_model_arguments, make_model, model_defaults, prompts_for
from mlx_watchdog import Watchdog
from mlx_watchdog import graph
from mlx_watchdog.attach import watch_model

CONFIGS = ("unwatched", "worker", "inline", "noexport")
OFFSETS = range(-2, 6)
_shipped_export_dot = graph.export_dot
_mode = {"now": "worker"}


def _export_dot(arrays, *, nodes_hint=None):
    mode = _mode["now"]
    if mode == "inline":
        capture = graph._Capture()
        mx.export_to_dot(capture, **{f"n{i}": a for i, a in enumerate(arrays)})
        return capture.text
    if mode == "noexport":
        return "".join(f'{{ rank=source; "n{i}"; }}\n' for i in range(len(arrays)))
    return _shipped_export_dot(arrays, nodes_hint=nodes_hint)


graph.export_dot = _export_dot  # account() looks it up in the module at each call


class Run:
    def __init__(self, model, config: str, prompt: list[int], steps: int, walk_interval: float):
        self.config = config
        model = copy.copy(model)
        self.wd = None
        if config != "unwatched":
            self.wd = Watchdog(export=False, walk_interval=walk_interval)
            watch_model(model, self.wd)
        self.cache = make_prompt_cache(model)
        self.steps = generate_step(mx.array(prompt), model, max_tokens=steps + 2, prompt_cache=self.cache)
        next(self.steps)
        mx.synchronize()
        self.times: list[float] = []
        self.walked: list[bool] = []
        self._paused_at = time.perf_counter()

    def step(self) -> None:
        _mode["now"] = self.config
        walks = self.wd.walks if self.wd else 0
        start = time.perf_counter()
        if self.wd is not None:  # its decode time leaves out the other configurations' turns
            self.wd._last_observe += start - self._paused_at
        next(self.steps)
        self._paused_at = time.perf_counter()
        self.times.append(self._paused_at - start)
        self.walked.append(bool(self.wd) and self.wd.walks > walks)


def excess(times: list[float], base: list[float], walk_steps: list[int], skip: int) -> dict:
    """Per offset from the walk steps: the mean of this configuration's step time minus the
    unwatched decode's at the same step (its turn came just before or after), less that
    difference on the steps at no such offset from any walk; in ms. Pairing by step takes out
    what changes along the decode (the cache grows, the machine's speed drifts)."""
    diff = [t - b for t, b in zip(times, base)]
    near = {i + k for i in walk_steps for k in OFFSETS}
    far = statistics.fmean(d for i, d in enumerate(diff) if i >= skip and i not in near)
    out = {}
    for k in OFFSETS:
        at = [diff[i + k] for i in walk_steps if skip <= i + k < len(diff)]
        out[k] = 1e3 * (statistics.fmean(at) - far) if at else float("nan")
    return {"per_step_ms": 1e3 * far, "by_offset_ms": out, "walks": len(walk_steps),
            "per_walk_ms": sum(out.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--walk-interval", type=float, default=0.25, help="seconds of decode between walks")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None, help="also write the JSON result here")
    args = p.parse_args()
    model_defaults(args)
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    model = make_model(args.model, args.layers, args.hidden, args.vocab, args.dtype, args.experts, args.seed)
    prompt = prompts_for(1, args.prompt_len, args.vocab, args.seed)[0]
    runs = [Run(model, c, prompt, args.steps, args.walk_interval) for c in configs]
    for _ in range(args.steps):
        for r in runs:
            r.step()
    skip = 64  # the dense first walks of a decode (schedule.py) and warm-up
    if runs[0].config != "unwatched":
        p.error("--configs must start with unwatched (the others are paired with it)")
    base = runs[0].times
    result = {"command": "python " + " ".join(sys.argv), "device": str(mx.default_device()), "configs": {}}
    for r in runs[1:]:
        walk_steps = [i for i, w in enumerate(r.walked) if w and i >= skip]
        e = excess(r.times, base, walk_steps, skip)
        e["timed_overhead_ms_per_walk"] = (1e3 * r.wd.overhead_seconds / max(1, r.wd.walks)) if r.wd else None
        e["total_s"] = sum(r.times[skip:])
        result["configs"][r.config] = e
        row = " ".join(f"{k:+d}:{v:6.3f}" for k, v in e["by_offset_ms"].items())
        print(f"{r.config:9s} walks {e['walks']:4d}  per step {e['per_step_ms']:+.3f} ms  per walk {e['per_walk_ms']:+.3f} ms"
              f" (timed {e['timed_overhead_ms_per_walk']:.3f})  by offset {row}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
