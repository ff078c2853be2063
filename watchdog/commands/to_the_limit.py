"""``mlx-watchdog diagnose --to-the-limit``: check the forecast against a real failure.

A child process (``python -m mlx_watchdog.commands.to_the_limit --child CONFIG_JSON``) decodes
until the real Metal resource-limit error, or, with ``--limit N``, until the watchdog's measured
estimate crosses N; the error, and the Metal queue it may leave wedged, end only the child. The
parent reports the forecast made at 1% of the run against the failing step.

The protocol: the child writes one line per message on its stdout, ``CHILD_TAG`` then a JSON
object, and nothing else the parent reads:

  {"s": step, "r": resident buffers, "ls": forecast limit step or null}   after each decode step
  {"event": "start", "device": ..., "limit": ..., "metal": bool}          once the model is built
  {"event": "limit" | "cap" | "done", "step": ...}                        the run ended
  {"event": "resource_limit" | "error", "step": ..., "error": ...}        a step raised
  {"event": "error", "usage": true, "error": ...}                         the model could not load

A child that dies without an event (an uncaught Metal error aborts the process) is read from its
last step record and its stderr; one that stops streaming for ``STALL_SECONDS`` is killed.
The options are diagnose's (``diagnose.add_arguments``); the JSON document is described in
docs/diagnose.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from .common import (
    EXIT_LEAK,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    finite,
    format_count,
    local_model_problem,
    print_json,
)

SCHEMA = "mlx-watchdog.to-the-limit/1"
CHILD_MODULE = "mlx_watchdog.commands.to_the_limit"  # what the child runs: python -m CHILD_MODULE --child
CHECKPOINT_PERCENTS = (1.0, 5.0, 10.0, 25.0, 50.0)
CHILD_TAG = "@mlx-watchdog "  # prefix of the child's protocol lines on its stdout
STALL_SECONDS = 300.0  # no step record from the child for this long: it is stuck
# The check is of the forecast made at 1% of the run, which needs measurements by then even on a
# short (scaled-down) run: the child walks the graph more often than the 1% default.
CHILD_OVERHEAD_BUDGET = 0.05
CHILD_DENSE_STEPS = 20  # decode steps walked every step at the start of the child's run
FORECAST_PERCENT = 1.0  # the forecast checked is the one made at this share of the run...
FORECAST_PERCENT_MAX = 2.0  # ...or at the latest here (the first finite one after it)
EXIT_GRACE_SECONDS = 15.0  # after the child reported its end (a wedged Metal queue may hang it)
ENDING_EVENTS = ("limit", "cap", "error", "resource_limit", "done")


def run(args: argparse.Namespace, console, progress_console=None) -> int:
    """Run the decode in a child process until it fails; compare with the forecast at 1%."""
    import mlx.core as mx

    from .. import tiny

    metal = bool(mx.metal.is_available())
    if args.limit is None and not metal:
        raise UsageError(
            f"this backend ({mx.default_device()}) has no buffer resource limit to run into: pass "
            "--limit N, and the run ends where the watchdog's measured estimate crosses N"
        )
    if args.model is None:
        if args.model_type not in tiny.MODEL_TYPES:
            raise UsageError(
                f"unknown --model-type {args.model_type!r}; choose one of {', '.join(tiny.MODEL_TYPES)}"
            )
        model_label = f"embedded:{args.model_type}"
    else:
        problem = local_model_problem(args.model)
        if problem is not None:
            raise UsageError(problem)
        model_label = args.model
    path = "plain" if args.path == "plain" else "batched"
    config = {
        "model": args.model,
        "model_type": args.model_type,
        "layers": args.layers,
        "seed": args.seed,
        "path": path,
        "batch_size": args.batch_size if path == "batched" else 1,
        "prompts": args.prompt,
        "limit": args.limit,
        "max_steps": args.max_steps,
        "crash_at_limit": bool(args.crash_at_limit),
    }
    if not args.json:
        ends = (
            f"the watchdog's measured estimate crosses --limit {args.limit:,}"
            if args.limit
            else "the real Metal resource-limit error"
        )
        console.print(
            f"mlx-watchdog diagnose --to-the-limit: {model_label}, {path} path; a child "
            f"process decodes until {ends} (cap {args.max_steps:,} steps)"
        )
    if progress_console is not None and progress_console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # The total is the forecast limit step, known once the child has measured a rate.
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps to the forecast limit"),
            TimeElapsedColumn(),
            console=progress_console,
        )
        with bar:
            outcome = run_child(config, console, quiet=True, bar=bar)
    else:
        outcome = run_child(config, console, quiet=args.json)
    report = limit_report(outcome, config, model_label, path)
    if args.json:
        print_json(report)
    else:
        render_limit_report(report, console)
    return report["exit_status"]


# --------------------------------------------------------------------------- the parent


@dataclasses.dataclass
class ChildOutcome:
    records: list  # (step, resident, limit_step or None)
    events: list  # the child's event dicts
    returncode: int | None
    stderr_tail: str
    stalled: bool = False


def run_child(config: dict, console, quiet: bool, bar=None) -> ChildOutcome:
    """Run the child and collect its records; progress as a rich ``bar`` (on a terminal), or a
    line every 5 s on ``console`` unless ``quiet``."""
    command = [sys.executable, "-m", CHILD_MODULE, "--child", json.dumps(config)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    lines: queue.Queue[str | None] = queue.Queue()
    records: list = []
    events: list = []
    stalled = False
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as stderr:
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, bufsize=1
        )
        reader = threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True)
        reader.start()
        try:
            last_seen = time.monotonic()
            last_print = 0.0
            ended = None
            while True:
                timeout = EXIT_GRACE_SECONDS if ended else 1.0
                try:
                    line = lines.get(timeout=timeout)
                except queue.Empty:
                    if ended is not None:  # reported its end but does not exit: wedged
                        break
                    # Loading a big model may take long: only a child that has begun stepping stalls.
                    if records and time.monotonic() - last_seen > STALL_SECONDS:
                        stalled = True
                        break
                    continue
                if line is None:  # stdout closed: the child exited (or is exiting)
                    break
                if not line.startswith(CHILD_TAG):
                    continue
                last_seen = time.monotonic()
                try:
                    message = json.loads(line[len(CHILD_TAG) :])
                except ValueError:
                    continue
                if "s" in message:
                    records.append((message["s"], message["r"], message["ls"]))
                    if bar is not None:
                        if not bar.tasks:
                            bar.add_task("child decoding", total=None)
                        bar.update(
                            bar.tasks[0].id,
                            completed=message["s"],
                            total=message["ls"],
                            description=f"child: resident ~{message['r']:,} buffers",
                        )
                    if not quiet and time.monotonic() - last_print > 5.0:
                        last_print = time.monotonic()
                        console.print(
                            f"  child: step {message['s']:,}, resident ~{message['r']:,} "
                            f"buffers, forecast limit step {format_count(message['ls'])}"
                        )
                else:
                    events.append(message)
                    if message.get("event") in ENDING_EVENTS:
                        ended = message
        finally:
            if child.poll() is None:
                try:
                    child.wait(timeout=EXIT_GRACE_SECONDS if not stalled else 0.1)
                except subprocess.TimeoutExpired:
                    pass
            if child.poll() is None:
                child.kill()
                child.wait()
            reader.join(timeout=5)
        stderr.seek(0)
        tail = stderr.read()[-4000:]
    return ChildOutcome(records, events, child.returncode, tail, stalled)


def _pump(stream, lines: queue.Queue[str | None]) -> None:
    try:
        for line in stream:
            lines.put(line.rstrip("\n"))
    finally:
        lines.put(None)


# --------------------------------------------------------------------------- the report


def _failure(outcome: ChildOutcome) -> dict:
    """What ended the child's run, and at which step."""
    last_step = outcome.records[-1][0] if outcome.records else None
    for event in outcome.events:
        kind = event.get("event")
        if kind == "limit":
            return {"kind": "estimate_crossed_limit", "step": event["step"], "error": None}
        if kind == "resource_limit":
            return {"kind": "resource_limit_error", "step": event["step"], "error": event.get("error")}
        if kind == "cap":
            return {"kind": "step_cap", "step": None, "error": None}
        if kind == "done":
            return {
                "kind": "child_died",
                "step": None,
                "error": "the decode ended before the limit (the model stopped generating)",
            }
        if kind == "error":
            return {"kind": "child_died", "step": None, "error": event.get("error")}
    # No end reported: the child died in a step (an uncaught Metal error aborts the process).
    error = _resource_error_line(outcome.stderr_tail)
    if outcome.stalled:
        return {
            "kind": "stalled",
            "step": None,
            "error": f"no step finished for {STALL_SECONDS:.0f} s; the child was killed",
        }
    if error is not None and last_step is not None:
        return {"kind": "resource_limit_error", "step": last_step + 1, "error": error}
    return {
        "kind": "child_died",
        "step": None,
        "error": f"exit status {outcome.returncode}: "
        f"{outcome.stderr_tail.strip().splitlines()[-1] if outcome.stderr_tail.strip() else 'no message'}",
    }


def _resource_error_line(text: str) -> str | None:
    for line in text.splitlines():
        if "Resource limit" in line:
            return line.strip()
    return None


def forecast_at(records: list, fail_step: int, percent: float) -> dict | None:
    """The first finite forecast made at or after ``percent`` % of ``fail_step``."""
    target = fail_step * percent / 100.0
    for step, _, limit_step in records:
        if step >= target and limit_step is not None:
            return {
                "made_at_step": int(step),
                "made_at_percent": round(100.0 * step / fail_step, 3),
                "limit_step": float(limit_step),
                "error_percent": round(100.0 * (limit_step - fail_step) / fail_step, 4),
            }
    return None


def limit_report(outcome: ChildOutcome, config: dict, model_label: str, path: str) -> dict:
    """The ``--json`` document (``to_the_limit`` in docs/diagnose.md)."""
    from ..core.limits import resolve_limit

    start: dict = next((e for e in outcome.events if e.get("event") == "start"), {})
    failure = _failure(outcome)
    usage_error = next((e for e in outcome.events if e.get("event") == "error" and e.get("usage")), None)
    fail_step = failure["step"]
    checkpoints, first = [], None
    if fail_step:
        for percent in CHECKPOINT_PERCENTS:
            point = forecast_at(outcome.records, fail_step, percent)
            if point is not None:
                checkpoints.append({"percent": percent, **point})
        first = next(
            (
                c
                for c in checkpoints
                if c["percent"] == FORECAST_PERCENT and c["made_at_percent"] <= FORECAST_PERCENT_MAX
            ),
            None,
        )
    if usage_error is not None:
        status = EXIT_USAGE
    elif first is not None:
        status = EXIT_OK
    else:
        status = EXIT_LEAK
    return {
        "schema": SCHEMA,
        "model": model_label,
        "path": path,
        "device": start.get("device"),
        "limit": int(start.get("limit") or config["limit"] or resolve_limit(None)),
        "limit_source": "--limit" if config["limit"] is not None else "metal",
        "failure": failure,
        "forecast": None
        if first is None
        else {k: first[k] for k in ("made_at_step", "made_at_percent", "limit_step")},
        "error_percent": None if first is None else first["error_percent"],
        "checkpoints": checkpoints,
        "steps_recorded": len(outcome.records),
        "child": {"exit_status": outcome.returncode, "stderr_tail": outcome.stderr_tail[-2000:]},
        "exit_status": status,
    }


def render_limit_report(report: dict, console) -> None:
    failure, child = report["failure"], report["child"]
    status = child["exit_status"]
    how = (
        "exited normally"
        if status == 0
        else f"was killed by signal {-status}"
        if status is not None and status < 0
        else f"exited with status {status}"
    )
    console.print(f"child process {how}; it streamed {report['steps_recorded']:,} step records.")
    if failure["kind"] == "resource_limit_error":
        console.print(f"real failure at step {failure['step']:,}: {failure['error']}")
    elif failure["kind"] == "estimate_crossed_limit":
        console.print(
            f"failing step: {failure['step']:,} (the watchdog's measured estimate crossed "
            f"the limit of {report['limit']:,} buffers; this backend has no real limit)"
        )
    elif failure["kind"] == "step_cap":
        console.print(
            "the child reached --max-steps without failing: nothing to compare the "
            "forecast with (no leak on this path, or raise --max-steps)."
        )
    else:
        console.print(f"the child ended without a failing step ({failure['kind']}): {failure['error']}")
        if child["stderr_tail"].strip():
            console.print(
                "  its last error output:\n    "
                + "\n    ".join(child["stderr_tail"].strip().splitlines()[-5:])
            )
    forecast = report["forecast"]
    if forecast is not None:
        console.print(
            f"forecast made at step {forecast['made_at_step']:,} "
            f"({forecast['made_at_percent']:.2g}% of the run): limit at step "
            f"{forecast['limit_step']:,.0f}; actual failing step {failure['step']:,}; "
            f"error {report['error_percent']:+.3f}%"
        )
        for point in report["checkpoints"][1:]:
            console.print(
                f"  at {point['percent']:g}% (step {point['made_at_step']:,}): forecast "
                f"{point['limit_step']:,.0f}, error {point['error_percent']:+.3f}%"
            )
    elif failure["step"]:
        console.print(
            f"the watchdog had no forecast by {FORECAST_PERCENT_MAX:g}% of the run (step "
            f"{failure['step'] * FORECAST_PERCENT_MAX / 100:.0f}): too few steps to "
            "measure a rate by then; raise --limit."
        )


# --------------------------------------------------------------------------- the child


def _emit(message: dict) -> None:
    try:
        sys.stdout.write(CHILD_TAG + json.dumps(message, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # the parent is gone: nobody to decode for
        os._exit(1)


def child_main(config: dict) -> int:
    """Decode until the limit; stream one record per step to the parent (see run_child)."""
    import mlx.core as mx

    from .. import tiny
    from ..core.limits import device_name
    from ..core.watchdog import Watchdog
    from .decode import batch_prompts, decode_pass
    from .load import encode_prompts, load_model

    try:
        if config["model"] is None:
            model = tiny.build_model(config["model_type"], layers=config["layers"], seed=config["seed"])
            prompts = tiny.tiny_prompts(config["batch_size"], 8, seed=config["seed"])
        else:
            model, tokenizer, _ = load_model(config["model"])
            prompts = batch_prompts(encode_prompts(tokenizer, config["prompts"]), config["batch_size"])
        watchdog = Watchdog(
            config["limit"],
            name="to-the-limit",
            export=False,
            overhead_budget=CHILD_OVERHEAD_BUDGET,
            walk_interval=0,
        )
    except (UsageError, ValueError) as exc:
        _emit({"event": "error", "usage": True, "error": str(exc)})
        return EXIT_USAGE
    limit = watchdog.limit
    by_estimate = config["limit"] is not None
    _emit({"event": "start", "device": device_name(), "limit": limit, "metal": bool(mx.metal.is_available())})

    ended = []  # set once on_step reported the end (the limit or the cap)
    offset = [0]

    def on_step(step: int, wd, elapsed: float) -> bool:
        forecast = wd.forecast()
        if step == 1:
            offset[0] = wd.steps - 1  # forward passes of the prefill: records are in decode steps
        record = {"s": step, "r": forecast.resident_buffers, "ls": finite(forecast.limit_step - offset[0])}
        # Walk every step at first (the chains are short, the walks cheap): the forecast at 1% of
        # a short run must rest on measurements, not on a walk budget that is still filling up.
        wd.overhead_budget = 1.0 if step < CHILD_DENSE_STEPS else CHILD_OVERHEAD_BUDGET
        if by_estimate:
            # Near the limit, measure every step, so the crossing is a measurement, not an extrapolation.
            if forecast.steps_to_limit <= max(20.0, 0.05 * forecast.step):
                wd.overhead_budget = 1.0
            if forecast.measured_step == forecast.step and forecast.resident_buffers >= limit:
                if config["crash_at_limit"]:
                    sys.stderr.write(
                        f"[metal::malloc] Resource limit ({limit}) exceeded "
                        f"(simulated by --crash-at-limit at step {step})\n"
                    )
                    sys.stderr.flush()
                    os.abort()
                _emit(record)
                _emit({"event": "limit", "step": step})
                ended.append("limit")
                return True
        _emit(record)
        if step >= config["max_steps"]:
            _emit({"event": "cap", "step": step})
            ended.append("cap")
            return True
        return False

    try:
        decode_pass(model, config["path"], prompts, config["max_steps"], watchdog, on_step)
    except Exception as exc:
        message = str(exc)
        kind = "resource_limit" if "Resource limit" in message else "error"
        _emit({"event": kind, "step": max(1, watchdog.steps - offset[0]), "error": message})
        sys.stdout.flush()
        os._exit(3)  # skip clean-up: after a Metal error the queue may be wedged
    if not ended:  # the decode ran out before the limit or the cap
        _emit({"event": "done", "step": watchdog.steps - offset[0]})
    return EXIT_OK


def main(argv: Sequence[str]) -> int:
    """The child's entry point: ``--child CONFIG_JSON``."""
    if len(argv) != 2 or argv[0] != "--child":
        print(
            f"usage: python -m {CHILD_MODULE} --child CONFIG_JSON (used by "
            "`mlx-watchdog diagnose --to-the-limit`; run that instead)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return child_main(json.loads(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
