"""``mlx-watchdog diagnose``: measure a model's decode leak, forecast the crash, check the fix.

    mlx-watchdog diagnose --model mlx-community/Qwen3-Next-80B-A3B-4bit --max-tokens 200
    mlx-watchdog diagnose --model ./my-port --path batched --json   # gate a model port in CI
    mlx-watchdog diagnose --model ./my-port --plot leak.png         # the picture to share
    mlx-watchdog diagnose --to-the-limit --model ./my-port        # on a Mac: trust the forecast
    mlx-watchdog diagnose --to-the-limit --limit 20000            # anywhere: same path, scaled

The diagnosis decodes ``--max-tokens`` steps through mlx-lm's plain path (``generate_step``, one
sequence) and/or its batched path (``BatchGenerator``, ``--batch-size`` equal-length copies of
the prompt: the case that leaks), first watched only, then with ``Watchdog(fix=True)``, and
compares the tokens. The measurements are of the decode (``decode.py``): the watchdog forgets
what it saw during the prefill, so the cache filling up once is not mistaken for growth.
``--to-the-limit`` runs in a child process (``to_the_limit.py``).

Exit status: 0 no leak, 1 a leak was found, 2 usage or load errors. With ``--to-the-limit``:
0 the forecast was checked against a failing step, 1 no failing step was reached (step cap, or
the child ended early), 2 usage or load errors.

Progress goes to stderr, as a bar per pass on a terminal (none in a pipe or a log); with
``--json`` stdout holds the one JSON document and nothing else.

The ``--json`` document (and ``--to-the-limit``'s) is described in docs/diagnose.md, key by key.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from . import to_the_limit
from .common import (
    EXIT_LEAK,
    EXIT_OK,
    UsageError,
    add_max_tokens,
    add_output_flags,
    consoles,
    finite,
    format_count,
    format_duration,
    positive_int,
    print_json,
    versions,
)
from .decode import LEAK_MIN_GROWTH, OnStep, PassResult, batch_prompts, decode_pass, leaking
from .load import encode_prompts, load_model

DESCRIPTION = (
    "Decode a model through mlx-lm's plain and/or batched path with the watchdog, then again with "
    "the fix, and report: leak rate per site, the step at which this device's buffer limit is "
    "reached, whether the fix removes the leak with identical tokens, the watchdog's overhead, "
    "and the command that serves the model with the fix. Exit status 0 no leak, 1 leak, 2 error."
)

SCHEMA = "mlx-watchdog.diagnose/1"
DEFAULT_STEPS = 200
DEFAULT_BATCH_SIZE = 2
DEFAULT_MAX_STEPS = 100_000
PATHS = ("batched", "plain")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--model",
        metavar="PATH_OR_HF_ID",
        help="local model folder or Hugging Face id for mlx_lm.load (required, "
        "except with --to-the-limit, which defaults to the demo's tiny model)",
    )
    parser.add_argument(
        "--path",
        choices=(*PATHS, "both"),
        default="both",
        help="mlx-lm's batched path (BatchGenerator), its plain path "
        "(generate_step), or both (default: %(default)s; --to-the-limit: batched)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help="sequences on the batched path (default: %(default)s)",
    )
    add_max_tokens(parser, DEFAULT_STEPS, "decode steps (tokens per sequence) of each pass")
    parser.add_argument(
        "-p",
        "--prompt",
        action="append",
        metavar="TEXT",
        help="prompt text (repeat for several; the batched path cycles through "
        "them; equal lengths are the case that leaks)",
    )
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="buffer limit (default: the device's Metal resource limit, else 499000)",
    )
    add_output_flags(parser, "its keys: docs/diagnose.md")
    group = parser.add_argument_group("--to-the-limit: check the forecast against a real failure")
    group.add_argument(
        "--to-the-limit",
        action="store_true",
        help="decode in a child process until the real Metal resource-limit error "
        "(or, with --limit N, the watchdog's estimate crossing N) and compare "
        "with the forecast made at 1%% of the run",
    )
    group.add_argument(
        "--max-steps",
        type=positive_int,
        default=DEFAULT_MAX_STEPS,
        metavar="M",
        help="step cap of the child (default: %(default)s)",
    )
    group.add_argument(
        "--model-type",
        default="qwen3_next",
        metavar="TYPE",
        help="without --model: the tiny model's type (default: %(default)s)",
    )
    group.add_argument(
        "--layers",
        type=positive_int,
        default=12,
        metavar="N",
        help="without --model: the tiny model's layers (default: %(default)s)",
    )
    group.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    # Test hook: the child aborts at the crossing (like an uncaught Metal error) without a report.
    group.add_argument("--crash-at-limit", action="store_true", help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> int:
    console, progress_console = consoles(json_output=args.json)
    if args.to_the_limit:
        if args.plot:
            raise UsageError("--plot draws the passes of a diagnosis; it does not apply to --to-the-limit")
        return to_the_limit.run(args, console, progress_console)
    if not args.model:
        raise UsageError("--model PATH_OR_HF_ID is required (a local folder or a Hugging Face id)")
    if args.plot:
        from . import plot

        plot.require()  # before minutes of decoding, not after
    from ..attach import compiled

    # The model's compiled functions are counted from its import on: a function that keeps a
    # cache entry per prompt length is a leak site too (compiled:<function>).
    counting = compiled.instrument()
    try:
        return _diagnose(args, console, progress_console)
    finally:
        if counting:
            compiled.uninstrument()


def _diagnose(args: argparse.Namespace, console, progress_console) -> int:
    model, tokenizer, info = load_model(args.model)
    prompts = encode_prompts(tokenizer, args.prompt)
    paths = selected_paths(args)
    if not args.json:
        console.print(
            f"mlx-watchdog diagnose: {args.model} ({info['model_type']}), "
            f"paths: {', '.join(paths)}, {args.max_tokens} decode steps per pass"
        )
    with PassProgress(progress_console, log=None if args.json else console.print) as progress:
        report = diagnose_model(
            model,
            prompts,
            paths=paths,
            steps=args.max_tokens,
            limit=args.limit,
            batch_size=args.batch_size,
            model_spec=args.model,
            model_type=info["model_type"],
            progress=progress,
        )
    if args.plot:
        from . import plot

        plot.save(report, args.plot)
    if args.json:
        print_json(report)
    else:
        render_report(report, console)
        if args.plot:
            console.print(f"plot: {args.plot}")
    return report["exit_status"]


def selected_paths(args: argparse.Namespace) -> list[str]:
    return list(PATHS) if args.path == "both" else [args.path]


class PassProgress:
    """Progress of the passes: a rich bar per pass on ``console`` (stderr) when it is a
    terminal, else one line per pass through ``log`` (None: quiet). ``start(title, steps)``
    begins a pass and returns its ``on_step`` for ``decode_pass``."""

    def __init__(self, console, log: Callable[[str], Any] | None = None) -> None:
        self.console, self.log = console, log
        self._progress = None
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )

    def __enter__(self) -> PassProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start(self, title: str, steps: int) -> OnStep | None:
        if self._progress is None:
            if self.log is not None:
                self.log(f"  {title}...")
            return None
        progress = self._progress
        task = progress.add_task(title, total=steps)

        def on_step(step: int, watchdog, elapsed: float) -> bool:
            progress.update(task, completed=step)
            return False

        return on_step


# --------------------------------------------------------------------------- the report


def _leaks(forecast) -> list[dict]:
    return [
        {
            "site": leak.site,
            "buffers_per_step": round(leak.buffers_per_step, 4),
            "buffers": int(leak.buffers),
            "paths": list(leak.paths),
            "cut_by_fix": leak.cut,
            "source": leak.source,
            "signatures": leak.signatures,
        }
        for leak in forecast.leaks
    ]


def diagnose_model(
    model,
    prompts: list[list[int]],
    *,
    paths: Sequence[str],
    steps: int,
    limit: int | None,
    batch_size: int,
    model_spec: str,
    model_type: str,
    progress: PassProgress | None = None,
) -> dict:
    """Run each path unfixed then fixed; return the report (``diagnose`` in docs/diagnose.md)."""
    from ..core.limits import device_name, device_resource_limit
    from ..core.watchdog import Watchdog

    if steps <= 0:
        raise UsageError(f"--max-tokens must be a positive integer, got {steps}")
    runs: list[dict] = []
    limit_value = limit or 0
    for path in paths:
        path_prompts = batch_prompts(prompts, batch_size) if path == "batched" else prompts[:1]
        results = {}
        for fix in (False, True):
            on_step = None
            if progress is not None:
                on_step = progress.start(
                    f"{path} path, {'Watchdog(fix=True)' if fix else 'watch only'}, "
                    f"{len(path_prompts)} sequence(s)",
                    steps,
                )
            # fix_every=1: the diagnosis asks whether cutting every step removes the growth.
            watchdog = Watchdog(
                limit, name=f"diagnose-{path}{'-fixed' if fix else ''}", fix=fix, fix_every=1, export=False
            )
            results[fix] = decode_pass(model, path, path_prompts, steps, watchdog, on_step)
        if not runs:
            limit_value = results[False].forecast.limit
        runs.append(run_entry(results[False], results[True]))
    leak = any(r["leak"] for r in runs)
    sites = sorted({leak["site"] for r in runs if r["leak"] for leak in r["leaks"]})
    leaking = [r for r in runs if r["leak"]]
    fix_ok = all(r["fix"]["removes_leak"] for r in leaking) if leaking else None
    return {
        "schema": SCHEMA,
        "model": model_spec,
        "model_type": model_type,
        "device": device_name(),
        "limit": int(limit_value),
        "limit_source": "--limit"
        if limit is not None
        else ("device" if device_resource_limit() else "default"),
        "steps": steps,
        "leak": leak,
        "leak_sites": sites,
        "fix_removes_leak": fix_ok,
        "fix_command": f"mlx-watchdog serve --fix -- --model {shlex.quote(model_spec)}",
        "exit_status": EXIT_LEAK if leak else EXIT_OK,
        "versions": versions(),
        "runs": runs,
    }


def run_entry(plain: PassResult, fixed: PassResult) -> dict:
    """A path's ``run`` object (docs/diagnose.md): the pass watched only, and with the fix."""
    f, g = plain.forecast, fixed.forecast
    tokens = sum(len(t) for t in plain.tokens)
    growth = max(0.0, f.buffers_per_step)
    fixed_growth = max(0.0, g.buffers_per_step)
    identical = plain.tokens == fixed.tokens
    return {
        "path": plain.path,
        "batch_size": len(plain.prompts),
        "prompt_tokens": [len(p) for p in plain.prompts],
        "decode_steps": plain.decode_steps,
        "observed_steps": plain.watchdog.steps,
        "tokens_per_second": round(tokens / plain.seconds, 2) if plain.seconds > 0 else 0.0,
        "decode_seconds": round(plain.seconds, 4),
        "resident_buffers": int(f.resident_buffers),
        "buffers_per_step": round(growth, 4),
        "leak": leaking(f),
        "leaks": _leaks(f),
        "limit_step": finite(f.limit_step - plain.step_offset),
        "steps_to_limit": finite(f.steps_to_limit),
        "seconds_to_limit": finite(f.seconds_to_limit),
        "watchdog_overhead": round(plain.watchdog.overhead_seconds / plain.seconds, 5)
        if plain.seconds > 0
        else 0.0,
        "readings": plain.readings,
        "fix": {
            "buffers_per_step": round(fixed_growth, 4),
            "removes_leak": bool(fixed_growth < LEAK_MIN_GROWTH and identical),
            "tokens_identical": bool(identical),
            "compared_tokens": sum(len(t) for t in fixed.tokens),
            "materialized_arrays": int(fixed.watchdog.materialized_arrays),
            "decode_seconds": round(fixed.seconds, 4),
            "watchdog_overhead": round(fixed.watchdog.overhead_seconds / fixed.seconds, 5)
            if fixed.seconds > 0
            else 0.0,
            "readings": fixed.readings,
        },
    }


def render_report(report: dict, console) -> None:
    from rich.table import Table

    console.print(
        f"device: {report['device']}; limit: {report['limit']:,} buffers ({report['limit_source']})"
    )
    table = Table(title=None, show_lines=False)
    for column in (
        "path",
        "batch",
        "tok/s",
        "growth/step",
        "crash at step",
        "in",
        "leak sites",
        "fix: growth",
        "tokens",
        "overhead",
    ):
        table.add_column(column)
    for r in report["runs"]:
        sites = ", ".join(f"{leak['site']} +{leak['buffers_per_step']:.3g}" for leak in r["leaks"]) or "-"
        table.add_row(
            r["path"],
            str(r["batch_size"]),
            f"{r['tokens_per_second']:.0f}",
            f"{r['buffers_per_step']:+.3g}",
            format_count(r["limit_step"]),
            format_duration(r["seconds_to_limit"]),
            sites,
            f"{r['fix']['buffers_per_step']:+.3g}",
            "identical" if r["fix"]["tokens_identical"] else "DIFFER",
            f"{100 * r['watchdog_overhead']:.1f}%",
        )
    console.print(table)
    for r in report["runs"]:
        fix = r["fix"]
        if r["leak"]:
            top = r["leaks"][0] if r["leaks"] else None
            where = (
                (
                    f"{top['site']} (+{top['buffers_per_step']:.3g} buffers/step, e.g. "
                    f"{', '.join(top['paths'][:3]) or 'no path'})"
                )
                if top
                else "no single site"
            )
            console.print(
                f"LEAK on the {r['path']} path: +{r['buffers_per_step']:.3g} buffers/step, site {where}."
            )
            for leak in r["leaks"]:
                if leak.get("source"):
                    console.print(f"  {leak['site']} is rebound at {leak['source']}")
                if leak.get("signatures") is not None:
                    from ..core.compiled import ADVICE

                    console.print(f"  {leak['site']} keeps {leak['signatures']} input signatures: {ADVICE}")
                from ..core import census

                if census.is_outside_site(leak["site"]):  # a program object's, outside the caches
                    console.print(f"  {leak['site']}: {census.ADVICE}")
            console.print(
                f"  at the limit of {report['limit']:,} buffers a generation like this "
                f"one crashes after {format_count(r['limit_step'])} tokens per sequence "
                f"({format_count(r['steps_to_limit'])} steps / {format_duration(r['seconds_to_limit'])} "
                f"after this run)."
            )
            verdict = "removes it" if fix["removes_leak"] else "does NOT remove it"
            console.print(
                f"  the fix (Watchdog(fix=True)) {verdict}: growth "
                f"{fix['buffers_per_step']:+.3g}/step, tokens "
                f"{'identical' if fix['tokens_identical'] else 'DIFFERENT'} "
                f"({fix['compared_tokens']} compared)."
            )
        else:
            console.print(
                f"no leak on the {r['path']} path: {r['buffers_per_step']:+.3g} buffers/step "
                f"over {r['decode_steps']} steps; with the fix "
                f"{fix['buffers_per_step']:+.3g}/step, tokens "
                f"{'identical' if fix['tokens_identical'] else 'DIFFERENT'}."
            )
        console.print(
            f"  watchdog overhead (self-timed): {100 * r['watchdog_overhead']:.2f}% "
            f"watching, {100 * fix['watchdog_overhead']:.2f}% with the fix."
        )
    if report["leak"]:
        console.print(
            f"Leak found ({', '.join(report['leak_sites']) or 'unattributed growth'}). "
            f"Serve this model with the fix:"
        )
        console.print(f"  {report['fix_command']}")
    else:
        console.print(
            f"No leak found. To serve it watched anyway: {report['fix_command'].replace(' --fix', '')}"
        )
