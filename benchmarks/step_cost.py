"""What a watched decode step costs the host, in microseconds: ``watch_model``'s ``__call__`` and
the ``observe()`` it runs, for two or more versions of the package in one real decode.

Separate processes do not resolve a few microseconds (the same code read 10-28 us a step from one
run to the next: CPU placement, frequency). Here every version is imported under its own name into
one process, and each decodes its own copy of one tiny model (a 48-layer llama: a host-bound step
like a GPU decode's) through ``generate_step``'s loop written out, the variants taking one-step
turns in an order drawn afresh every round. The model's class stamps the clock as its forward
starts and ends, so a step's watch cost is the time from the call to the forward plus the time from
the forward back to the caller, less the same for an unwatched copy (the call itself). Each watched
version is given twice (``NAME`` and ``NAME~``), an A/A pair: their difference is the resolution.

    # the working tree against a commit:
    git archive 13a7a27 watchdog | tar -x -C /tmp/base
    python benchmarks/step_cost.py --version base=/tmp/base --version tree=. --fix

``--bytecodes`` counts instead the Python bytecodes the watched call runs around the forward at each
step (``sys.settrace`` with opcode events; the forward itself is not traced): a figure that does not
depend on the machine or its load. On a cold path each bytecode costs about the same (~0.16 us on the
H200's host), so the count says where the time goes.

Reported per variant, over the steps past the dense walks: the median and mean wrapper cost of the
steps that neither walked nor fixed (the per-step path), and the mean over all steps (walks and
fixes included); then the paired difference of each version to the first, round by round.
"""

from __future__ import annotations

import argparse
import copy as copier
import importlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time


def load(name: str, root: str):
    """Import the package at ``root`` (its ``watchdog/``) as ``name``; returns its attach.model."""
    folder = tempfile.mkdtemp(prefix="step-cost-")
    shutil.copytree(os.path.join(root, "watchdog"), os.path.join(folder, name))
    sys.path.insert(0, folder)
    return importlib.import_module(f"{name}.attach.model")


def _bootstrap(diffs: list[float], seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median (a loaded machine's descheduled steps swamp a mean)."""
    rng = random.Random(seed)
    n = len(diffs)
    medians = sorted(statistics.median(rng.choices(diffs, k=n)) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--version",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="a package version: NAME=a folder holding watchdog/",
    )
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--skip", type=int, default=100, help="steps left out at the start (dense walks)")
    p.add_argument("--fix", action="store_true", help="Watchdog(fix=True) as well")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="append the report (markdown) to this file")
    p.add_argument("--bytecodes", action="store_true", help="count bytecodes a step instead of timing")
    args = p.parse_args(argv)
    versions = dict(v.split("=", 1) for v in args.version)
    if args.bytecodes:
        return bytecodes(versions, args)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.tiny import build_model

    attach = {name: load(f"wd_step_cost_{name}", root) for name, root in versions.items()}
    model = build_model("llama", layers=args.layers, seed=args.seed)
    clock = time.perf_counter
    stamps = [0.0, 0.0]
    original = type(model)

    def forward(self, *a, **k):
        stamps[0] = clock()
        out = original.__call__(self, *a, **k)
        stamps[1] = clock()
        return out

    timed = type(original.__name__, (original,), {"__call__": forward, "__module__": original.__module__})

    variants: dict[str, tuple] = {}  # name -> (model, watchdog or None, cache)
    modes = [False, True] if args.fix else [False]
    names = ["unwatched"]
    for fix in modes:
        for version in versions:
            for twin in ("", "~"):
                names.append(f"{version}{'+fix' if fix else ''}{twin}")
    for name in names:
        copy = copier.copy(model)  # the top-level object only: layers and weights shared
        copy.__class__ = timed
        wd = None
        if name != "unwatched":
            version = name.split("+")[0].rstrip("~")
            core = attach[version]
            wd = core.Watchdog(export=False, fix="+fix" in name, process_count=False)
            core.watch_model(copy, wd)
        variants[name] = (copy, wd, make_prompt_cache(model))

    prompt = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    state = {}
    for name, (m, _, cache) in variants.items():
        y = m(prompt, cache=cache)[:, -1].argmax(-1)
        mx.eval(y)
        state[name] = y

    per_step: dict[str, list[float]] = {n: [] for n in names}  # steps that neither walked nor fixed
    every: dict[str, list[float]] = {n: [] for n in names}  # all steps
    rounds: list[dict[str, float]] = []  # per round: name -> cost of that step (per-step path only)
    order = random.Random(args.seed)
    paused = dict.fromkeys(names, clock())
    for step in range(args.steps):
        turn: dict[str, float] = {}
        for name in order.sample(names, len(names)):
            m, wd, cache = variants[name]
            y = state[name]
            walks = wd.walks if wd is not None else 0
            fixes = wd._fixer.last_step if wd is not None else 0  # (private: benchmark only)
            if wd is not None:  # the other variants' turns are no decode time of its own
                wd._pace.last += clock() - paused[name]  # (private: benchmark only)
            t0 = clock()
            logits = m(y[None], cache=cache)
            t1 = clock()
            y = logits[:, -1, :].argmax(-1)
            mx.async_eval(y)
            state[name] = y
            y.item()
            paused[name] = clock()
            cost = (stamps[0] - t0) + (t1 - stamps[1])
            if step < args.skip:
                continue
            every[name].append(cost)
            if wd is None or (wd.walks == walks and wd._fixer.last_step == fixes):
                per_step[name].append(cost)
                turn[name] = cost
        if step >= args.skip:
            rounds.append(turn)

    base_cost = statistics.median(per_step["unwatched"])
    lines = [
        f"{args.layers}-layer tiny llama, {args.steps} steps ({args.skip} left out), one-step turns; "
        f"the call and return of an unwatched copy: {base_cost * 1e6:.2f} us (median), subtracted below",
        "",
        "| variant | per-step path: median us | mean us | steps | all steps: mean us | walks |",
        "|---|---|---|---|---|---|",
    ]
    for name in names[1:]:
        wd = variants[name][1]
        costs = per_step[name]
        lines.append(
            f"| {name} | {(statistics.median(costs) - base_cost) * 1e6:.2f} "
            f"| {(statistics.fmean(costs) - base_cost) * 1e6:.2f} | {len(costs)} "
            f"| {(statistics.fmean(every[name]) - base_cost) * 1e6:.2f} | {wd.walks} |"
        )
    lines += [
        "",
        "Paired differences on the per-step path (the same round, both without a walk or fix): "
        "the median with a 95% bootstrap interval over rounds, and the mean:",
        "",
        "| variant | vs | median us | 95% interval | mean us | rounds |",
        "|---|---|---|---|---|---|",
    ]
    first = next(iter(versions))
    pairs = []
    for fix in modes:
        suffix = "+fix" if fix else ""
        reference = f"{first}{suffix}"
        pairs.append((f"{first}{suffix}~", reference))
        for version in list(versions)[1:]:
            pairs += [(f"{version}{suffix}", reference), (f"{version}{suffix}~", f"{version}{suffix}")]
    for a, b in pairs:
        diffs = [r[a] - r[b] for r in rounds if a in r and b in r]
        low, high = _bootstrap(diffs)
        lines.append(
            f"| {a} | {b} | {statistics.median(diffs) * 1e6:+.2f} | {low * 1e6:+.2f} .. {high * 1e6:+.2f} "
            f"| {statistics.fmean(diffs) * 1e6:+.2f} | {len(diffs)} |"
        )
    errors = {
        n: v[1].internal_errors for n, v in variants.items() if v[1] is not None and v[1].internal_errors
    }
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n\n")
    if errors:
        print(f"internal errors: {errors}: a variant measured an error path", file=sys.stderr)
        return 1
    return 0


def bytecodes(versions: dict[str, str], args) -> int:
    """Bytecodes run by the watched call around the forward, per step, for each version (watched,
    and with --fix the fix too): the steps that neither walked nor fixed, those that looked at
    the batch's rows among them (every 4 steps), by function."""
    import collections
    import statistics

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.tiny import build_model

    attach = {name: load(f"wd_bytecodes_{name}", root) for name, root in versions.items()}
    model = build_model("llama", layers=args.layers, seed=args.seed)
    forward = type(model).__call__.__code__
    lines = [
        f"Bytecodes a step around the forward ({args.layers}-layer tiny llama, steps {args.skip}-"
        f"{args.steps} that neither walked nor fixed; Python {sys.version.split()[0]})",
        "",
        "| version | steps | median | min | a step that looked at the rows | by function (the least step) |",
        "|---|---|---|---|---|---|",
    ]
    errors = 0
    for name, core in attach.items():
        for fix in [False, True] if args.fix else [False]:
            m = copier.copy(model)
            wd = core.Watchdog(export=False, fix=fix, process_count=False)
            core.watch_model(m, wd)
            cache = make_prompt_cache(model)
            y = m(mx.array([[1, 2, 3, 4]]), cache=cache)[:, -1].argmax(-1)
            mx.eval(y)
            counts: list[collections.Counter] = []
            for step in range(args.steps):
                walks, fixed = wd.walks, wd._fixer.last_step  # (private: benchmark only)
                ops: collections.Counter = collections.Counter()
                inside = [True]

                def trace(frame, event, arg, ops=ops, inside=inside):
                    if frame.f_code is forward:  # the program's forward: not the watchdog's
                        inside[0] = False
                    if not inside[0]:
                        return None
                    frame.f_trace_opcodes = True

                    def local(frame, event, arg):
                        if event == "opcode":
                            code = frame.f_code
                            ops[getattr(code, "co_qualname", code.co_name)] += 1
                        return local

                    return local

                sys.settrace(trace)
                out = m(y[None], cache=cache)
                sys.settrace(None)
                y = out[:, -1].argmax(-1)
                mx.eval(y)
                if step >= args.skip and wd.walks == walks and wd._fixer.last_step == fixed:
                    counts.append(ops)
            totals = [sum(c.values()) for c in counts]
            least = min(counts, key=lambda c: sum(c.values()))
            rows = [t for t, c in zip(totals, counts) if "RowsWatch.changed" in c]
            lines.append(
                f"| {name}{'+fix' if fix else ''} | {len(totals)} | {statistics.median(totals):.0f} "
                f"| {min(totals)} | {statistics.median(rows) if rows else '-'} "
                f"| {', '.join(f'{k} {v}' for k, v in least.most_common())} |"
            )
            errors += wd.internal_errors
            core.unwatch_model(m)
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
