"""Decode speed of the watchdog's variants, paired and resolved to 1%: every chunk written as it ends.

The variants (``decode_variants.py``) decode the same model side by side, taking turns of
``--chunk`` steps, every round in a fresh random order; ``aa`` (unwatched again) is the A/A
control. Each chunk's tokens, seconds and CPU seconds are appended to ``--jsonl`` and flushed as
soon as the chunk ends, so a run cut by a time limit keeps everything it measured. ``--time-box``
stops starting rounds that would end past it, and the report is still written.

The report (``paired_stats.py``): for each variant against ``unwatched`` (and the pairs in
``--compare``), tokens/s over the rounds both ran, a 95% bootstrap interval over rounds
(drawing repetitions, then rounds within them), and whether the interval excludes a loss of more than 1% or lies
within +/-1%. ``--report FILE...`` rebuilds it from the records of one or more runs (several
10-minute calls on a GPU machine add up: their repetitions are drawn alike).

    # leaking hybrid over 10,000 tokens (2,500 steps x batch 4), on the H200:
    python benchmarks/paired_speed.py --model qwen3_next --layers 48 --hidden 2048 --vocab 32000 \\
        --experts 32 --dtype bfloat16 --batch 4 --prompt-len 64 --steps 2500 --chunk 16 \\
        --variants unwatched,aa,fix,every256 --compare fix:every256 --jsonl $OUT/long.jsonl --time-box 520
    # host-bound CPU decode, 48 tiny layers:
    python benchmarks/paired_speed.py --model qwen3_next --layers 48 --batch 4 --steps 2500 --chunk 16 \\
        --variants unwatched,aa,fix,every256,handfix,async16 --compare fix:every256,fix:handfix,fix:async16
    python benchmarks/paired_speed.py --report run1.jsonl run2.jsonl --out benchmarks/results/speed.md
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shlex
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_variants import (  # noqa: E402
    VARIANTS,
    add_model_arguments,
    interleaved,
    internal_errors,
    known,
    load_base,
    make_model,
    model_defaults,
    prompts_for,
    revision,
)
from paired_stats import STALL_FACTOR, emit, paired_ratio, read_records, rounds_by_variant, stalls  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=2500, help="decode steps per variant per repetition")
    p.add_argument("--reps", type=int, default=1, help="repetitions (fresh decodes)")
    p.add_argument(
        "--chunk",
        type=int,
        default=16,
        help="steps per turn; with --interleave-steps, steps per record (the bootstrap's unit)",
    )
    p.add_argument(
        "--interleave-steps",
        action="store_true",
        help="variants take turns every step, no device wait between: each step's time is the host's "
        "work for it (what a host-bound decode runs at), paired within milliseconds",
    )
    p.add_argument(
        "--variants", default="unwatched,aa,watched,fix", help=f"comma list of {', '.join(VARIANTS)}"
    )
    p.add_argument("--compare", default="", help="extra pairs A:B, comma separated (e.g. fix:every256)")
    p.add_argument(
        "--base",
        default=None,
        metavar="DIR",
        help="another version of the package (a folder holding its watchdog/, e.g. from git archive): "
        "its variants are named VARIANT@base (watched@base, fix@base, ...), paired in this process",
    )
    p.add_argument(
        "--jsonl",
        default=None,
        help="append the per-chunk records here (default: $OUT/chunks.jsonl, "
        "or a file in the temporary folder)",
    )
    p.add_argument(
        "--time-box", type=float, default=None, help="seconds: start no round that would end later"
    )
    p.add_argument(
        "--warmup", type=int, default=32, help="untimed steps of every variant first (one-off costs)"
    )
    p.add_argument("--out", default=None, help="also append the markdown report here")
    p.add_argument(
        "--report", nargs="+", default=None, metavar="JSONL", help="only report these runs' records"
    )
    args = p.parse_args(argv)
    args.compare = [tuple(pair.split(":")) for pair in args.compare.split(",") if pair]
    if any(len(pair) != 2 for pair in args.compare):
        p.error("--compare takes pairs A:B")
    if args.report:
        return args
    model_defaults(args)
    if args.base:
        load_base(args.base)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants + [v for pair in args.compare for v in pair]:
        if not known(v):
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}, and VARIANT@base with --base")
    if "unwatched" not in args.variants:
        args.variants.insert(0, "unwatched")
    for name in ("steps", "reps", "chunk"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    if args.jsonl is None:
        folder = os.environ.get("OUT") or os.environ.get("TMPDIR") or "/tmp"
        args.jsonl = os.path.join(folder, "chunks.jsonl")
    return args


class Recorder:
    """Appends one JSON line per record and flushes it: a killed run keeps what it measured."""

    def __init__(self, path: str, run: str):
        self.run = run
        self.file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(dict(record, run=self.run)) + "\n")
        self.file.flush()


class InternalErrors(RuntimeError):
    """A watchdog of a variant had internal errors: it measured an error path, not the variant."""


def check_clean(runs, when: str) -> None:
    errors = internal_errors(runs)
    if errors:
        raise InternalErrors(
            f"{when}: the watchdog had internal errors ("
            + ", ".join(f"{v}: {n}" for v, n in errors.items())
            + "): the run measured an error path (its log says where)"
        )


def measure(args) -> list[str]:
    import mlx.core as mx

    if args.device != "default":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    started = time.perf_counter()
    deadline = started + args.time_box if args.time_box else None
    recorder = Recorder(args.jsonl, uuid.uuid4().hex[:8])
    recorder.write(
        {
            "type": "run",
            "command": "python benchmarks/paired_speed.py " + shlex.join(sys.argv[1:]),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
            "mlx": mx.__version__,
            "device": str(mx.default_device()),
            "revision": revision(),
            "load": os.getloadavg()[0],
            "variants": args.variants,
            "compare": [list(c) for c in args.compare],
            "steps": args.steps,
            "chunk": args.chunk,
            "interleave_steps": args.interleave_steps,
            "model": f"{args.model} {args.layers} layers hidden {args.hidden or 64} "
            f"{args.dtype} via {args.path}" + (f", batch {args.batch}" if args.path == "batched" else ""),
        }
    )
    model = make_model(args.model, args.layers, args.hidden, args.vocab, args.dtype, args.experts, args.seed)
    prompts = prompts_for(args.batch if args.path == "batched" else 1, args.prompt_len, args.vocab, args.seed)
    warm = interleaved(model, args.variants, args.path, prompts, args.warmup, args.warmup)  # one-off costs
    check_clean(warm, "warm-up")  # before the time is spent
    print(f"built and warmed up in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    # A record per chunk, or with --interleave-steps per block of `chunk` one-step turns.
    turn, per_record = (1, args.chunk) if args.interleave_steps else (args.chunk, 1)
    for rep in range(args.reps):
        block: dict[str, list] = {}

        def on_chunk(round_, position, decode, rep=rep, block=block):
            tokens, seconds, cpu = decode.last_chunk
            sums = block.setdefault(decode.variant, [0, 0.0, 0.0])
            sums[0] += tokens
            sums[1] += seconds
            sums[2] += cpu
            last_of_round = position == len(args.variants) - 1
            if last_of_round and ((round_ + 1) % per_record == 0 or (round_ + 1) * turn >= args.steps):
                for variant, (t, sec, c) in block.items():
                    recorder.write(
                        {
                            "type": "chunk",
                            "rep": rep,
                            "round": round_ // per_record,
                            "variant": variant,
                            "tokens": t,
                            "seconds": sec,
                            "cpu_seconds": c,
                        }
                    )
                block.clear()
            if last_of_round and round_ % (10 * per_record) == 0:
                print(
                    f"rep {rep + 1} round {round_ + 1}: {time.perf_counter() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

        runs = interleaved(
            model,
            args.variants,
            args.path,
            prompts,
            args.steps,
            turn,
            seed=rep,
            on_chunk=on_chunk,
            deadline=deadline,
            sync=not args.interleave_steps,
        )
        reference = next(r.outputs for r in runs if r.variant == "unwatched")
        for r in runs:
            recorder.write(
                {
                    "type": "end",
                    "rep": rep,
                    "variant": r.variant,
                    "tokens": r.tokens,
                    "identical": _same_prefix(r.outputs, reference),
                    "retained_at_end": r.retained_at_end,
                    "overhead_seconds": r.overhead_seconds,
                    "seconds": r.seconds,
                    "cpu_seconds": r.cpu_seconds,
                    "walks": r.walks,
                    "internal_errors": r.internal_errors,
                    "gc_seconds": r.gc_seconds,
                }
            )
        check_clean(runs, f"repetition {rep + 1}")
        if deadline is not None and time.perf_counter() > deadline:
            break
    return [args.jsonl]


def _same_prefix(outputs, reference) -> bool:
    """Same tokens as ``unwatched`` (as far as both got: a time box may end them apart)."""
    return all(a[: len(b)] == b[: len(a)] for a, b in zip(outputs, reference))


def report(paths: list[str], compare: list[tuple[str, str]], run_filter=None) -> str:
    records = read_records(paths)
    runs = [r for r in records if r.get("type") == "run"]
    if run_filter is not None:
        records = [r for r in records if r.get("run") in run_filter]
        runs = [r for r in runs if r["run"] in run_filter]
    table = rounds_by_variant(records)
    ends = [r for r in records if r.get("type") == "end"]
    variants = list(dict.fromkeys(v for r in runs for v in r["variants"])) or sorted(table)
    lines = []
    for r in runs:
        turns = (
            f"turns of one step, no device wait between, records of {r['chunk']}"
            if r.get("interleave_steps")
            else f"turns of {r['chunk']} steps, each ending with the device's work"
        )
        lines += [
            f"- run {r['run']}: {r['model']}, {r['steps']} steps in {turns}; {r['machine']}, "
            f"MLX {r['mlx']} on {r['device']}, mlx-watchdog {r['revision']}, load {r['load']:.1f}",
            f"  - command: `{r['command']}`",
        ]
    stalled = stalls(table)
    lines += [
        "",
        "| variant | vs | tokens/s ratio | 95% interval | without stall rounds | 95% interval | per-round IQR "
        "| rounds | loss > 1% excluded | within +/-1% | CPU vs unwatched | self-timed | retained at end "
        "| tokens identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    recorded = [tuple(c) for r in runs for c in r.get("compare", [])]
    pairs = list(
        dict.fromkeys([(v, "unwatched") for v in variants if v != "unwatched"] + recorded + list(compare))
    )
    for a, b in pairs:
        ratio, steady = paired_ratio(table, a, b), paired_ratio(table, a, b, skip=stalled)
        if ratio is None or steady is None:
            continue
        mine = [e for e in ends if e["variant"] == a]
        base = [e for e in ends if e["variant"] == "unwatched"]
        cpu = ""
        if mine and base and b == "unwatched":

            def per_token(es):
                return sum(e["cpu_seconds"] for e in es) / max(1, sum(e["tokens"] for e in es))

            cpu = f"{100 * (per_token(mine) / per_token(base) - 1):+.2f}%"
        timed = [e for e in mine if e.get("overhead_seconds") is not None]
        self_timed = (
            f"{100 * sum(e['overhead_seconds'] for e in timed) / sum(e['seconds'] for e in timed):.2f}%"
            if timed and b == "unwatched"
            else ""
        )
        retained = ", ".join(str(e["retained_at_end"]) for e in mine) if b == "unwatched" else ""
        identical = (
            ("yes" if all(e["identical"] for e in mine) else "NO") if mine and b == "unwatched" else ""
        )
        lines.append(
            f"| {a} | {b} | {ratio.percent()} | {ratio.interval()} | {steady.percent()} | "
            f"{steady.interval()} | {100 * steady.spread:.1f} pp | {steady.rounds} | "
            f"{'yes' if steady.excludes_loss() else 'no'} | {'yes' if steady.within() else 'no'} | "
            f"{cpu} | {self_timed} | {retained} | {identical} |"
        )
    slow = collections.Counter(stalled.values())
    errors = collections.Counter()
    for e in ends:
        errors[e["variant"]] += e.get("internal_errors") or 0
    if +errors:  # records of a run that failed, or written before runs failed on them
        lines += [
            "",
            "**Void: the watchdog had internal errors** (the variant measured an error path): "
            + ", ".join(f"{v} {n}" for v, n in (+errors).items())
            + ".",
        ]
    lines += [
        "",
        "Ratio: tokens/s of the variant over the reference on the rounds both ran; interval: bootstrap "
        "over repetitions and the rounds within them (each repetition builds its own decodes); `aa` is the A/A control (its interval should hold 0). "
        f"Stall rounds: one variant took over {STALL_FACTOR}x the round's median time per token (in one "
        "process a one-off cost, such as a kernel's first compile for a new shape, falls on whichever variant "
        "gets there first); the verdicts use the ratio without them. Stall rounds by slow variant: "
        + (", ".join(f"{v} {n}" for v, n in slow.most_common()) or "none")
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        text = report(args.report, args.compare)
    else:
        try:
            paths = measure(args)
        except InternalErrors as exc:  # the records so far stay in --jsonl
            print(f"paired_speed.py: {exc}", file=sys.stderr, flush=True)
            return 1
        run = read_records(paths)
        last = [r["run"] for r in run if r.get("type") == "run"][-1:]
        text = report(paths, args.compare, run_filter=set(last))
    emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
