"""Per-step cost of ``Watchdog.observe`` in two or more versions of the package, in one decode.

Separate processes do not resolve a few microseconds: the same code read 10-28 us a step from
one run to the next (CPU placement, frequency). Here every version is imported under its own
name into one process, and the watchdogs of all versions observe the same real decode (a tiny
48-layer llama, ``generate_step``'s loop by hand), each step in a rotating order. The figure that
matters is the first call after the forward (cold caches, as in a real decode); the others are
warmer. Steps that walked are left out: walks are budgeted separately.

    # the working tree against HEAD:
    git archive HEAD watchdog exporters | tar -x -C /tmp/head
    python benchmarks/observe_versions.py --version head=/tmp/head --version tree=.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time


def load(name: str, root: str):
    """Import the package at ``root`` (its ``watchdog/`` and ``exporters/``) as ``name``."""
    folder = tempfile.mkdtemp(prefix="observe-versions-")
    shutil.copytree(os.path.join(root, "watchdog"), os.path.join(folder, name))
    if os.path.isdir(os.path.join(root, "exporters")):
        shutil.copytree(os.path.join(root, "exporters"), os.path.join(folder, name, "exporters"))
    sys.path.insert(0, folder)
    return importlib.import_module(f"{name}.core")


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
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    versions = dict(v.split("=", 1) for v in args.version)
    if len(versions) < 2:
        p.error("give two --version NAME=DIR or more")

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.tiny import build_model

    cores = {name: load(f"wd_version_{name}", root) for name, root in versions.items()}
    model = build_model("llama", layers=args.layers)
    cache = make_prompt_cache(model)
    watchdogs = {name: core.Watchdog(export=False) for name, core in cores.items()}
    y = model(mx.array([[1, 2, 3, 4]]), cache=cache)[:, -1].argmax(-1)
    mx.eval(y)
    names = list(watchdogs)
    first: dict[str, list[float]] = {n: [] for n in names}
    later: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter
    for step in range(args.steps):
        order = names[step % len(names) :] + names[: step % len(names)]
        for position, name in enumerate(order):
            wd = watchdogs[name]
            walks = wd.walks
            t0 = clock()
            wd.observe(cache)
            elapsed = clock() - t0
            if wd.walks == walks and step > 80:  # past the dense walks; no walk this step
                (first if position == 0 else later)[name].append(elapsed)
        y = model(y[:, None], cache=cache)[:, -1].argmax(-1)
        mx.async_eval(y)
        y.item()
    print("| version | first after the forward: median us | p25 | n | later calls: median us |")
    print("|---|---|---|---|---|")
    for name in names:
        cold = sorted(first[name])
        print(
            f"| {name} | {statistics.median(cold) * 1e6:.2f} | {cold[len(cold) // 4] * 1e6:.2f} | {len(cold)} "
            f"| {statistics.median(later[name]) * 1e6:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
