"""``mlx-watchdog diagnose``: measure a model's decode leak, forecast the crash, check the fix.

    mlx-watchdog diagnose --model mlx-community/Qwen3-Next-80B-A3B-4bit --max-tokens 200
    mlx-watchdog diagnose --model ./my-port --path batched --json   # gate a model port in CI
    mlx-watchdog diagnose --model ./my-port --plot leak.png         # the picture to share
    mlx-watchdog diagnose --to-the-limit --model ./my-port        # on a Mac: trust the forecast
    mlx-watchdog diagnose --to-the-limit --limit 20000            # anywhere: same path, scaled

The diagnosis decodes ``--max-tokens`` steps through mlx-lm's plain path (``generate_step``, one
sequence) and/or its batched path (``BatchGenerator``, ``--batch-size`` equal-length copies of
the prompt: the case that leaks in mlx-lm 0.32.2), first watched only, then with
``Watchdog(fix=True)``, and compares the tokens. The measurements are of the decode: the
watchdog forgets what it saw during the prefill (``Watchdog.reset`` after the first token), so
the cache filling up once is not mistaken for growth.

Exit status: 0 no leak, 1 a leak was found, 2 usage or load errors. With ``--to-the-limit``:
0 the forecast was checked against a failing step, 1 no failing step was reached (step cap, or
the child ended early), 2 usage or load errors.

Progress goes to stderr, as a bar per pass on a terminal (none in a pipe or a log); with
``--json`` stdout holds the one JSON document and nothing else.

JSON (``--json``): one object on stdout. Each block lists ``key  type  meaning``; a type in
braces is an object described by the block of that name, ``[x]`` a list of x, ``|null`` means
the value may be null (JSON has no infinity: "never" is null).

  diagnose:
    schema            str          "mlx-watchdog.diagnose/1"
    model             str          the --model argument as given
    model_type        str          config.json's model_type (or the model's module name)
    device            str          MLX's device name
    limit             int          buffer limit forecast against
    limit_source      str          "--limit" | "device" (Metal's resource_limit) | "default" (499000)
    steps             int          decode steps per pass (--max-tokens)
    leak              bool         some path grows by >= 0.01 buffers per decode step
    leak_sites        [str]        leaking sites over all paths, e.g. "ArraysCache.left_padding"
    fix_removes_leak  bool|null    every leaking path is flat (< 0.01/step) with the fix and its
                                   tokens are identical; null when nothing leaks
    fix_command       str          the command that serves this model with the fix
    exit_status       int          0 no leak, 1 leak
    versions          {versions}   package versions
    runs              [{run}]      one per path, in the order run

  versions:
    mlx               str
    mlx_lm            str
    mlx_watchdog      str

  run:
    path              str          "plain" | "batched"
    batch_size        int          sequences decoded together (1 on the plain path)
    prompt_tokens     [int]        prompt length of each sequence
    decode_steps      int          decode steps done (tokens per sequence)
    observed_steps    int          forward passes the watchdog observed (the prefill's included)
    tokens_per_second float        generated tokens (all sequences) per second of the pass
    decode_seconds    float        wall time of the pass
    resident_buffers  int          estimated resident buffers at the end
    buffers_per_step  float        net growth per decode step (0 when flat)
    leak              bool         buffers_per_step >= 0.01, or some site grows >= 0.01/step
    leaks             [{leak}]     growing sites, biggest first
    limit_step        float|null   decode step at which a generation like this one reaches the
                                   limit: tokens per sequence until the crash; null: never
    steps_to_limit    float|null   decode steps left after this pass; null: never
    seconds_to_limit  float|null   the same at the measured step rate; null: never
    watchdog_overhead float        watchdog seconds on the decode thread / decode_seconds
                                   (self-timed; short runs overstate it: the first walks are
                                   granted up front)
    readings          [[int]]      [decode step, resident buffers] at each graph walk
    fix               {fix}        the same decode again with Watchdog(fix=True)

  leak:
    site              str          class.attribute holding the buffers
    buffers_per_step  float        growth of this site per decode step
    buffers           int          buffers held at the site at the last measurement
    paths             [str]        where, from the cache list, e.g. "[0].left_padding"
    cut_by_fix        bool         the fix cuts this site (fix mode): buffers_per_step is what it would add
    source            str|null     the line that rebinds the site's attribute, e.g.
                                   "mlx_lm/models/cache.py:685 ArraysCache.advance" (null: not found)

  fix:
    buffers_per_step  float        growth with the fix
    removes_leak      bool         buffers_per_step < 0.01 and tokens_identical
    tokens_identical  bool         the fixed pass generated exactly the same tokens
    compared_tokens   int          tokens compared (all sequences)
    materialized_arrays int        pending cache arrays the fix scheduled for evaluation
    decode_seconds    float        wall time of the fixed pass
    watchdog_overhead float        as above, for the fixed pass
    readings          [[int]]      as above, for the fixed pass

With ``--to-the-limit --json``:

  to_the_limit:
    schema            str          "mlx-watchdog.to-the-limit/1"
    model             str          --model, or "embedded:<model_type>" (the built-in tiny model)
    path              str          "batched" | "plain"
    device            str|null     the child's MLX device name (null: it never started)
    limit             int          buffer limit of the child's watchdog
    limit_source      str          "metal" (the real error ends the run) | "--limit" (the
                                   watchdog's measured estimate crossing N ends it)
    failure           {failure}    what ended the run
    forecast          {forecast}|null  the forecast made at ~1% of the failing step
    error_percent     float|null   (forecast limit_step - failing step) / failing step * 100
    checkpoints       [{checkpoint}]  forecasts at 1, 5, 10, 25 and 50% of the run
    steps_recorded    int          step records the child streamed
    child             {child}      how the child process ended
    exit_status       int          0 the forecast was checked, 1 no failing step was reached

  failure:
    kind              str          "resource_limit_error" | "estimate_crossed_limit" |
                                   "step_cap" | "child_died" | "stalled"
    step              int|null     the failing decode step
    error             str|null     the error message

  forecast:
    made_at_step      int          decode step at which the forecast was made
    made_at_percent   float        made_at_step / failing step * 100
    limit_step        float        the decode step it forecast for the limit

  checkpoint:
    percent           float        the share of the run asked for
    made_at_step      int
    made_at_percent   float
    limit_step        float
    error_percent     float

  child:
    exit_status       int|null     the child's exit status (negative: killed by that signal)
    stderr_tail       str          the end of its error output
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .common import (
    EXIT_LEAK,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_max_tokens,
    add_output_flags,
    consoles,
    local_model_problem,
    looks_local,
    positive_int,
    print_json,
)

DESCRIPTION = (
    "Decode a model through mlx-lm's plain and/or batched path with the watchdog, then again with "
    "the fix, and report: leak rate per site, the step at which this device's buffer limit is "
    "reached, whether the fix removes the leak with identical tokens, the watchdog's overhead, "
    "and the command that serves the model with the fix. Exit status 0 no leak, 1 leak, 2 error."
)

SCHEMA = "mlx-watchdog.diagnose/1"
LIMIT_SCHEMA = "mlx-watchdog.to-the-limit/1"
LEAK_MIN_GROWTH = 0.01  # buffers/step: at or above this a path leaks
FIX_MAX_GROWTH = 0.01  # buffers/step: below this the fix holds
DEFAULT_STEPS = 200
DEFAULT_BATCH_SIZE = 2
DEFAULT_PROMPT = "The watchdog counts the buffers each decode step leaves behind."
DEFAULT_MAX_STEPS = 100_000
PATHS = ("batched", "plain")
CHECKPOINT_PERCENTS = (1.0, 5.0, 10.0, 25.0, 50.0)
CHILD_TAG = "@mlx-watchdog "  # prefix of the child's protocol lines on its stdout
STALL_SECONDS = 300.0  # no step record from the child for this long: it is stuck
# The child walks the graph more often than the 1% default: the check is about the forecast
# made at 1% of the run, which needs measurements by then even on a short (scaled-down) run.
CHILD_OVERHEAD_BUDGET = 0.05
CHILD_DENSE_STEPS = 20  # decode steps walked every step at the start of the child's run
FORECAST_PERCENT = 1.0  # the forecast checked is the one made at this share of the run...
FORECAST_PERCENT_MAX = 2.0  # ...or at the latest here (the first finite one after it)
EXIT_GRACE_SECONDS = 15.0  # after the child reported its end (a wedged Metal queue may hang it)


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
    add_output_flags(parser, "schema in `pydoc mlx_watchdog.diagnose`")
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
        return to_the_limit(args, console, progress_console)
    if not args.model:
        raise UsageError("--model PATH_OR_HF_ID is required (a local folder or a Hugging Face id)")
    if args.plot:
        from . import plot

        plot.require()  # before minutes of decoding, not after
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

    def __init__(self, console, log: Callable[[str], Any] | None = None):
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

    def __exit__(self, *exc) -> bool:
        if self._progress is not None:
            self._progress.stop()
        return False

    def start(self, title: str, steps: int) -> Callable[[int, Any, float], bool] | None:
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


# --------------------------------------------------------------------------- loading


def load_model(spec: str):
    """``mlx_lm.load(spec)`` with errors a user can act on. Returns (model, tokenizer, info)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"--model must be a local model folder or a Hugging Face id, got {spec!r}")
    local = Path(os.path.expanduser(spec))
    problem = local_model_problem(spec)
    if problem is not None:
        raise UsageError(problem)
    target = str(local) if looks_local(spec) else spec
    model_type = _config_model_type(local / "config.json") if local.is_dir() else None
    import mlx_lm

    try:
        model, tokenizer = mlx_lm.load(target)
    except ValueError as exc:
        if "not supported" in str(exc).lower():
            raise UsageError(
                f"unknown model type {model_type or '?'!r} in {spec}: mlx-lm "
                f"{_version('mlx-lm')} does not support it ({exc})"
            ) from exc
        raise UsageError(f"cannot load model {spec}: {exc}") from exc
    except Exception as exc:  # hub errors, missing weights, bad safetensors
        raise UsageError(f"cannot load model {spec}: {type(exc).__name__}: {exc}") from exc
    info = {"model_type": model_type or _model_type(model)}
    return model, tokenizer, info


def _config_model_type(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text()).get("model_type")) or None
    except Exception:
        return None


def _model_type(model: Any) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def encode_prompts(tokenizer, texts: Sequence[str] | None) -> list[list[int]]:
    texts = list(texts) if texts else [DEFAULT_PROMPT]
    prompts = []
    for text in texts:
        ids = list(tokenizer.encode(text))
        if not ids:
            raise UsageError(f"--prompt {text!r} encodes to no tokens")
        prompts.append([int(i) for i in ids])
    return prompts


# --------------------------------------------------------------------------- decoding


@dataclasses.dataclass
class PassResult:
    """One watched decode."""

    path: str
    prompts: list[list[int]]
    tokens: list[list[int]]  # generated tokens per sequence
    seconds: float
    watchdog: Any
    forecast: Any
    stopped: Any = None  # the ResourceLimitForecast that ended the pass early, if any
    # Forward passes before decode step 1 (the prefill): watchdog step - offset = decode step.
    step_offset: int = 0
    # (decode step, resident buffers) of each graph walk during the decode
    readings: list = dataclasses.field(default_factory=list)

    @property
    def decode_steps(self) -> int:
        return max((len(t) for t in self.tokens), default=0)


def _batched_steps(model, prompts: list[list[int]], steps: int) -> Iterator[list[tuple[int, int]]]:
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=steps)  # stop_tokens=None: no early stop
    try:
        uids = generator.insert([list(p) for p in prompts])
        index = {uid: i for i, uid in enumerate(uids)}
        while True:
            responses = generator.next_generated()
            if not responses:
                return
            yield [(index[r.uid], int(r.token)) for r in responses]
    finally:
        try:
            generator.close()
        except Exception:  # a generator stopped mid-step may not close cleanly; it is dropped anyway
            pass


def _plain_steps(model, prompt: list[int], steps: int) -> Iterator[list[tuple[int, int]]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    # generate_step has no stop tokens: it decodes exactly max_tokens steps.
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=steps):
        yield [(0, int(token))]


def decode_pass(
    model,
    path: str,
    prompts: list[list[int]],
    steps: int,
    watchdog,
    on_step: Callable[[int, Any, float], bool] | None = None,
) -> PassResult:
    """Decode ``steps`` steps watched by ``watchdog``. ``on_step(step, watchdog, elapsed)`` runs
    after each decode step; returning True ends the pass. A ``ResourceLimitForecast`` raised by
    the watchdog ends it too (``result.stopped``)."""
    from ..attach.model import unwatch_model, watch_model
    from ..core.actions import ResourceLimitForecast

    if path == "plain":
        prompts = prompts[:1]
        stepper = _plain_steps(model, prompts[0], steps)
    elif path == "batched":
        stepper = _batched_steps(model, prompts, steps)
    else:
        raise ValueError(f"path must be 'plain' or 'batched', got {path!r}")
    tokens: list[list[int]] = [[] for _ in prompts]
    readings: list[list[int]] = []
    before_end = None  # the forecast one step before the last (see below)
    stopped = None
    offset = walks = 0
    watch_model(model, watchdog)
    start = time.perf_counter()
    try:
        for step, new in enumerate(stepper, 1):
            for sequence, token in new:
                tokens[sequence].append(token)
            if step == 1:
                watchdog.reset()  # measure the decode, not the prefill filling the cache once
                offset, walks = watchdog.steps - 1, watchdog.walks
            elif watchdog.walks != walks:  # a new reading: one forecast per walk, not per step
                walks = watchdog.walks
                forecast = watchdog.forecast()
                decode_step = int(forecast.measured_step - offset)
                # The last step's forward is where the batch ends and its caches die: that reading
                # is the teardown, not the decode's level.
                if forecast.decoding and decode_step < steps:
                    readings.append([decode_step, int(forecast.resident_buffers)])
            if step == steps - 1:
                before_end = watchdog.forecast()
            if on_step is not None and on_step(step, watchdog, time.perf_counter() - start):
                break
    except ResourceLimitForecast as exc:
        stopped = exc
    finally:
        stepper.close()
        seconds = time.perf_counter() - start
        unwatch_model(model)
    # BatchGenerator drops a batch's caches as it yields its last tokens, and the forecast drops
    # their buffers with them: a pass that ran to the end reports the forecast of its last
    # step but one, the decode's, not its teardown's.
    ran_out = stopped is None and max((len(t) for t in tokens), default=0) >= steps
    final = before_end if ran_out and before_end is not None else watchdog.forecast()
    return PassResult(path, prompts, tokens, seconds, watchdog, final, stopped, offset, readings)


def batch_prompts(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(batch_size)]


# --------------------------------------------------------------------------- the report


def _finite(x: float) -> float | None:
    return None if x is None or math.isinf(x) or math.isnan(x) else float(x)


def _leaks(forecast) -> list[dict]:
    return [
        {
            "site": leak.site,
            "buffers_per_step": round(leak.buffers_per_step, 4),
            "buffers": int(leak.buffers),
            "paths": list(leak.paths),
            "cut_by_fix": leak.cut,
            "source": leak.source,
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
    """Run each path unfixed then fixed; return the report (the JSON object of the docstring)."""
    import mlx.core as mx

    from .. import __version__
    from ..core.limits import device_name, device_resource_limit
    from ..core.watchdog import Watchdog

    if steps <= 0:
        raise UsageError(f"--max-tokens must be a positive integer, got {steps}")
    runs = []
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
        runs.append(_run_entry(results[False], results[True]))
    limit_value = runs[0]["_limit"] if runs else (limit or 0)
    for entry in runs:
        entry.pop("_limit")
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
        "versions": {"mlx": mx.__version__, "mlx_lm": _version("mlx-lm"), "mlx_watchdog": __version__},
        "runs": runs,
    }


def _run_entry(plain: PassResult, fixed: PassResult) -> dict:
    f, g = plain.forecast, fixed.forecast
    tokens = sum(len(t) for t in plain.tokens)
    growth = max(0.0, f.buffers_per_step)
    leak = growth >= LEAK_MIN_GROWTH or any(site.buffers_per_step >= LEAK_MIN_GROWTH for site in f.leaks)
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
        "leak": bool(leak),
        "leaks": _leaks(f),
        "limit_step": _finite(f.limit_step - plain.step_offset),
        "steps_to_limit": _finite(f.steps_to_limit),
        "seconds_to_limit": _finite(f.seconds_to_limit),
        "watchdog_overhead": round(plain.watchdog.overhead_seconds / plain.seconds, 5)
        if plain.seconds > 0
        else 0.0,
        "readings": plain.readings,
        "fix": {
            "buffers_per_step": round(fixed_growth, 4),
            "removes_leak": bool(fixed_growth < FIX_MAX_GROWTH and identical),
            "tokens_identical": bool(identical),
            "compared_tokens": sum(len(t) for t in fixed.tokens),
            "materialized_arrays": int(fixed.watchdog.materialized_arrays),
            "decode_seconds": round(fixed.seconds, 4),
            "watchdog_overhead": round(fixed.watchdog.overhead_seconds / fixed.seconds, 5)
            if fixed.seconds > 0
            else 0.0,
            "readings": fixed.readings,
        },
        "_limit": f.limit,
    }


def _count(x: float | None) -> str:
    return "never" if x is None else f"{x:,.0f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
            _count(r["limit_step"]),
            _duration(r["seconds_to_limit"]),
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
            console.print(
                f"  at the limit of {report['limit']:,} buffers a generation like this "
                f"one crashes after {_count(r['limit_step'])} tokens per sequence "
                f"({_count(r['steps_to_limit'])} steps / {_duration(r['seconds_to_limit'])} "
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


# --------------------------------------------------------------------------- --to-the-limit


def to_the_limit(args: argparse.Namespace, console, progress_console=None) -> int:
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
    path = selected_paths(args)[0]
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
    bar = None
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
    if bar is not None:
        with bar:
            outcome = _run_child(config, console, quiet=True, bar=bar)
    else:
        outcome = _run_child(config, console, quiet=args.json)
    report = _limit_report(outcome, config, model_label, path)
    if args.json:
        print_json(report)
    else:
        _render_limit_report(report, console)
    return report["exit_status"]


@dataclasses.dataclass
class _ChildOutcome:
    records: list  # (step, resident, limit_step or None)
    events: list  # the child's event dicts
    returncode: int | None
    stderr_tail: str
    stalled: bool = False


def _run_child(config: dict, console, quiet: bool, bar=None) -> _ChildOutcome:
    """Run the child and collect its records; progress as a rich ``bar`` (on a terminal), or a
    line every 5 s on ``console`` unless ``quiet``."""
    command = [sys.executable, "-m", "mlx_watchdog.commands.diagnose", "--child", json.dumps(config)]
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
                        forecast = _count(message["ls"])
                        console.print(
                            f"  child: step {message['s']:,}, resident ~{message['r']:,} "
                            f"buffers, forecast limit step {forecast}"
                        )
                else:
                    events.append(message)
                    if message.get("event") in ("limit", "cap", "error", "resource_limit", "done"):
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
    return _ChildOutcome(records, events, child.returncode, tail, stalled)


def _pump(stream, lines: queue.Queue[str | None]) -> None:
    try:
        for line in stream:
            lines.put(line.rstrip("\n"))
    finally:
        lines.put(None)


def _failure(outcome: _ChildOutcome, config: dict) -> dict:
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


def _limit_report(outcome: _ChildOutcome, config: dict, model_label: str, path: str) -> dict:
    from ..core.limits import resolve_limit

    start = next((e for e in outcome.events if e.get("event") == "start"), {})
    failure = _failure(outcome, config)
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
        "schema": LIMIT_SCHEMA,
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


def _render_limit_report(report: dict, console) -> None:
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


def _child_main(config: dict) -> int:
    """Decode until the limit; stream one record per step to the parent (see _run_child)."""
    import mlx.core as mx

    from .. import tiny
    from ..core.limits import device_name
    from ..core.watchdog import Watchdog

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
        record = {"s": step, "r": forecast.resident_buffers, "ls": _finite(forecast.limit_step - offset[0])}
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


def _child_entry(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "--child":
        print(
            "usage: python -m mlx_watchdog.commands.diagnose --child CONFIG_JSON (used by "
            "`mlx-watchdog diagnose --to-the-limit`; run that instead)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    return _child_main(json.loads(argv[1]))


if __name__ == "__main__":
    sys.exit(_child_entry(sys.argv[1:]))
