"""``mlx-watchdog demo`` (what ``make demo`` runs): the leak, the forecast and the fix, live.

A tiny random-weight hybrid model (``qwen3_next``: linear-attention layers with an
``ArraysCache``) is built in memory, nothing is downloaded. mlx-lm's ``BatchGenerator`` decodes a
batch of equal-length prompts with it; in mlx-lm 0.32.2 each step then leaves one more pending
``left_padding`` array per linear-attention layer (but one) behind, and the buffers they keep
alive add up until Metal refuses to allocate (``Resource limit (499000) exceeded``).

Pass 1 watches the decode (``watch_model``) and shows the step, tokens/s, the resident-buffer
estimate against the limit, the growth per step, the forecast crash and the top leak sites. The
limit is scaled down (default 10,000 buffers) so the crash is seconds away, not an hour; where the
estimate reaches it, the watchdog stops the pass cleanly (``stop_within=0``), where a device with
that limit would have crashed. Pass 2 decodes the same prompts with ``Watchdog(fix=True)``, as
many steps as pass 1 decoded (fewer than ``--max-tokens`` after such a stop, so that the tokens can be
compared): the growth is gone and the tokens are the same. A model whose cache mlx-lm cannot
batch (``deepseek_v41``) runs the plain path (``generate_step``, one sequence) instead.
``/metrics`` is served on loopback meanwhile.

``--json`` prints one JSON document on stdout (the live display goes to stderr): diagnose's
report shape (docs/diagnose.md: ``runs`` with ``readings``, ``leaks`` and ``fix``) with
``schema`` "mlx-watchdog.demo/1", ``real_limit`` (the device's limit the crash is also forecast
against), ``real_limit_step`` (the decode step of that crash, null: never) and ``metrics_url``.
``--plot FILE`` draws it (``plot.py``).

Exit status: 0 the fix removed the growth with identical tokens, 1 it did not, 2 usage errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from typing import Any

from ..core.options import DEFAULT_METRICS_PORT
from .common import (
    EXIT_LEAK,
    EXIT_OK,
    UsageError,
    add_max_tokens,
    add_output_flags,
    consoles,
    finite,
    format_duration,
    port_number,
    positive_int,
    print_json,
)
from .decode import LEAK_MIN_GROWTH, PassResult, decode_pass
from .diagnose import run_entry

DESCRIPTION = (
    "Build a tiny random-weight hybrid model in memory (no download), decode it through "
    "mlx-lm's batched path and watch the buffer leak live: resident buffers against a scaled-down "
    "limit, growth per step, the forecast crash and the leaking attribute. Then decode again with "
    "the fix and compare: growth gone, tokens unchanged. Serves /metrics on 127.0.0.1 meanwhile."
)

DEFAULT_STEPS = 300
DEFAULT_LAYERS = 12  # qwen3_next with full attention every 4th layer: 9 linear layers, +8 buffers/step
DEFAULT_LIMIT = 10_000  # scaled down from Metal's 499,000 so the forecast crash is seconds away
DEFAULT_BATCH = 2
PROMPT_TOKENS = 8
# Walks more often than the 1% default (and no walk interval), so the display moves from the
# first steps: the chains are short, the walks cheap.
OVERHEAD_BUDGET = 0.05
REFRESH_SECONDS = 0.25
SCHEMA = "mlx-watchdog.demo/1"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_max_tokens(parser, DEFAULT_STEPS, "decode steps (tokens per sequence) of pass 1")
    parser.add_argument(
        "--model-type",
        default="qwen3_next",
        metavar="TYPE",
        help="tiny model type: llama, qwen3, qwen3_next, deepseek_v41, qwen3_moe "
        "(default: %(default)s, the hybrid that leaks)",
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=DEFAULT_LAYERS,
        metavar="N",
        help="layers of the tiny model (default: %(default)s)",
    )
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=DEFAULT_LIMIT,
        metavar="N",
        help="buffer limit, scaled down from Metal's 499,000 so the crash is near (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=DEFAULT_BATCH,
        metavar="N",
        help="sequences decoded together (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default: 0)")
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=DEFAULT_METRICS_PORT,
        metavar="PORT",
        help="port of /metrics on 127.0.0.1 (default: %(default)s; 0 picks a free one)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not serve /metrics")
    add_output_flags(parser, "diagnose's report shape: docs/demo.md")
    return parser


@dataclasses.dataclass
class DemoOutcome:
    """What the two passes did and the exit status."""

    first: PassResult  # watched only
    second: PassResult  # Watchdog(fix=True)
    exit_status: int
    metrics_url: str | None = None


def run(args: argparse.Namespace) -> int:
    console, _ = consoles(json_output=args.json)
    if args.plot:
        from . import plot

        plot.require()  # before the passes, not after
    outcome = run_demo(args, console)
    if args.plot or args.json:
        document = report(args, outcome)
        if args.plot:
            from . import plot

            plot.save(document, args.plot)
            console.print(f"plot: {args.plot}")
        if args.json:
            print_json(document)
    return outcome.exit_status


def report(args: argparse.Namespace, outcome: DemoOutcome) -> dict:
    """The ``--json`` document (diagnose's report shape, see the module docstring)."""
    from ..core.limits import resolve_limit

    entry = run_entry(outcome.first, outcome.second)
    real_limit = resolve_limit(None)
    f = outcome.first.forecast
    growth = max(0.0, f.buffers_per_step)
    real_step = None
    if growth > 0:
        real_step = finite(f.step - outcome.first.step_offset + (real_limit - f.resident_buffers) / growth)
    return {
        "schema": SCHEMA,
        "model": f"tiny:{args.model_type}",
        "model_type": args.model_type,
        "layers": args.layers,
        "limit": int(f.limit),
        "real_limit": int(real_limit),
        "real_limit_step": real_step,
        "steps": args.max_tokens,
        "leak": entry["leak"],
        "leak_sites": [leak["site"] for leak in entry["leaks"]],
        "fix_removes_leak": entry["fix"]["removes_leak"],
        "metrics_url": outcome.metrics_url,
        "exit_status": outcome.exit_status,
        "runs": [entry],
    }


def run_demo(args: argparse.Namespace, console) -> DemoOutcome:
    """Build the tiny model, serve metrics, run both passes, print the verdict on ``console``
    (a rich Console with markup=False: the output holds brackets such as ``[0].left_padding``)."""
    from .. import tiny
    from ..core.limits import resolve_limit

    if args.model_type not in tiny.MODEL_TYPES:
        raise UsageError(
            f"unknown --model-type {args.model_type!r}; choose one of {', '.join(tiny.MODEL_TYPES)}"
        )
    try:
        model = tiny.build_model(args.model_type, layers=args.layers, seed=args.seed)
    except ValueError as exc:
        raise UsageError(f"cannot build the tiny {args.model_type} model: {exc}") from exc
    metrics = _start_metrics(args, console)
    handler = _log_to(console)
    try:
        first, second = _passes(args, model, console, real_limit=resolve_limit(None))
        status = _verdict(console, first, second, real_limit=resolve_limit(None))
        return DemoOutcome(first, second, status, metrics.url if metrics is not None else None)
    finally:
        logging.getLogger("mlx_watchdog").removeHandler(handler)
        if metrics is not None:
            metrics.close()


def _log_to(console) -> logging.Handler:
    """The watchdog's warnings go through the console (above the live display, not through it).
    Its "stopping the generation" error is left out: the demo explains the stop itself."""
    from rich.logging import RichHandler

    handler = RichHandler(console=console, show_time=False, show_path=False, level=logging.WARNING)
    handler.addFilter(lambda record: "stopping the generation" not in record.getMessage())
    logging.getLogger("mlx_watchdog").addHandler(handler)
    return handler


def _start_metrics(args: argparse.Namespace, console):
    if args.no_metrics:
        return None
    from ..exporters.server import start_metrics_server

    try:
        server = start_metrics_server(args.metrics_port, addr="127.0.0.1")
    except (OSError, ValueError) as exc:
        raise UsageError(f"{exc} (choose another --metrics-port, 0 for a free one, or --no-metrics)") from exc
    console.print(f"metrics: {server.url} (Prometheus text format, while the demo runs)")
    return server


def _passes(args: argparse.Namespace, model, console, real_limit: int):
    from .. import tiny
    from ..core.watchdog import Watchdog

    prompts = tiny.tiny_prompts(args.batch_size, PROMPT_TOKENS, seed=args.seed)
    unbatchable = _unbatchable_cache(model)
    path = "plain" if unbatchable else "batched"
    if unbatchable:
        prompts = prompts[:1]
    linear = sum(bool(getattr(layer, "is_linear", False)) for layer in getattr(model, "layers", []))
    kind = f", {linear} linear-attention layers" if linear else ""
    console.print(
        f"mlx-watchdog demo: tiny random-weight {args.model_type} ({args.layers} layers{kind}), "
        + _path_words(path, len(prompts))
    )
    if unbatchable:
        console.print(
            f"note: mlx-lm's BatchGenerator cannot batch {args.model_type} (its {unbatchable} "
            "has no merge()); the demo uses the plain path"
        )
    console.print(
        f"limit: {args.limit:,} buffers, scaled down from the real {real_limit:,} so the "
        f"crash is near (--limit)"
    )

    def watched() -> Watchdog:
        return Watchdog(
            args.limit,
            name=f"demo-{args.model_type}",
            stop_within=0,
            overhead_budget=OVERHEAD_BUDGET,
            walk_interval=0,
        )

    leaky = watched()
    view = _View(console, "pass 1/2: watch only", args.max_tokens, len(prompts))
    try:
        first = view.run(lambda cb: decode_pass(model, path, prompts, args.max_tokens, leaky, cb))
    except Exception as exc:
        # A cache mlx-lm cannot batch that the check above did not see: fall back to the plain path.
        if path != "batched" or "batch" not in str(exc).lower():
            raise
        path, prompts = "plain", prompts[:1]
        console.print(
            f"note: mlx-lm cannot batch {args.model_type} ({exc}); pass 1 again on the "
            "plain path (generate_step, one sequence)"
        )
        leaky = watched()
        view = _View(console, "pass 1/2: watch only (plain path)", args.max_tokens, 1)
        first = view.run(lambda cb: decode_pass(model, path, prompts, args.max_tokens, leaky, cb))
    steps_done = first.decode_steps
    if first.stopped is not None:
        console.print(
            f"step {first.forecast.step - first.step_offset:,}: the estimate reached the limit of "
            f"{args.limit:,} buffers. A device with this limit would crash here; the "
            f"watchdog stopped the decode cleanly (Watchdog(stop_within=0)) after "
            f"{steps_done:,} of {args.max_tokens:,} steps."
        )
    title = "pass 2/2: Watchdog(fix=True)"
    if steps_done < args.max_tokens:
        title += (
            f", {steps_done:,} steps (not {args.max_tokens:,}): as many as pass 1 decoded, "
            "so that the tokens can be compared"
        )
    fixed = Watchdog(
        args.limit,
        name=f"demo-{args.model_type}-fixed",
        fix=True,
        fix_every=1,
        overhead_budget=OVERHEAD_BUDGET,
        walk_interval=0,
    )
    view = _View(console, title, steps_done, len(prompts))
    second = view.run(lambda cb: decode_pass(model, path, prompts, steps_done, fixed, cb))
    return first, second


def _path_words(path: str, prompts: int) -> str:
    if path == "batched":
        what = f"{prompts} equal-length prompts" if prompts > 1 else "1 prompt"
        return f"{what} of {PROMPT_TOKENS} tokens, mlx-lm BatchGenerator"
    return f"1 prompt of {PROMPT_TOKENS} tokens, mlx-lm generate_step (plain path, one sequence)"


def _unbatchable_cache(model) -> str | None:
    """The class name of a cache of ``model`` that mlx-lm's ``BatchGenerator`` cannot batch
    (it merges the prompt caches with their ``merge`` method: mlx-lm 0.32's ``_merge_caches``),
    else None. ``deepseek_v41``'s ``LayerCache`` has none in mlx-lm 0.32.2."""
    try:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    except Exception:  # let the batched path itself say what is wrong
        return None
    for layer_cache in cache:
        if not hasattr(layer_cache, "merge"):
            return type(layer_cache).__name__
    return None


def _verdict(console, first, second, real_limit: int) -> int:
    f, g = first.forecast, second.forecast
    growth, fixed_growth = max(0.0, f.buffers_per_step), max(0.0, g.buffers_per_step)
    identical = first.tokens == second.tokens
    compared = sum(len(t) for t in second.tokens)
    console.print()
    if f.leaks:
        top = f.leaks[0]
        console.print(
            f"top leak site: {top.site} +{top.buffers_per_step:.3g} buffers/step "
            f"({', '.join(top.paths[:4])}{', ...' if len(top.paths) > 4 else ''})"
        )
    if growth > 0:
        real_steps = max(0.0, (real_limit - f.resident_buffers) / growth)
        rate = f.step_rate
        when = f" (~{format_duration(real_steps / rate)} at {rate:.0f} steps/s)" if rate > 0 else ""
        console.print(
            f"at the real limit of {real_limit:,} buffers this decode would crash after "
            f"~{f.step - first.step_offset + real_steps:,.0f} steps{when}."
        )
    console.print(
        f"growth: {growth:+.3g} buffers/step watched, {fixed_growth:+.3g} with the fix; "
        f"tokens {'identical' if identical else 'DIFFERENT'} ({compared:,} compared)."
    )
    ok = fixed_growth < LEAK_MIN_GROWTH and identical
    if ok and growth >= LEAK_MIN_GROWTH:
        console.print("VERDICT: the fix removes the leak and the tokens are unchanged.", style="bold green")
    elif ok:
        console.print(
            "VERDICT: no leak on this model and path; the fix changes nothing, tokens unchanged.",
            style="bold green",
        )
    else:
        console.print("VERDICT: the fix did NOT hold (growth left or tokens changed).", style="bold red")
    return EXIT_OK if ok else EXIT_LEAK


class _View:
    """The live display of one pass: rich's Live (progress bar + table) on a terminal, plain
    periodic lines otherwise (rich's Console detects which)."""

    def __init__(self, console, title: str, steps: int, batch: int):
        self.console, self.title, self.steps, self.batch = console, title, steps, batch
        self.live = console.is_terminal
        self.every = max(1, steps // 8)
        self._last_refresh = 0.0
        self._progress: Any = None  # rich's Progress, Live and task id, on a terminal
        self._task: Any = None
        self._live: Any = None
        self._walks_at_start: int | None = None
        self._offset = 0  # watchdog steps (forward passes) before decode step 1

    def run(self, decode):
        self.console.print(self.title)
        if not self.live:
            result = decode(self._plain_step)
            self.console.print(self._line(result.watchdog, result.seconds, result.decode_steps))
            return result
        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("decode"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=self.console
        )
        self._task = self._progress.add_task("decode", total=self.steps)
        with Live(
            Group(self._progress, self._table(None, 0, 0.0)), console=self.console, refresh_per_second=8
        ) as live:
            self._live = live
            result = decode(self._live_step)
            self._progress.update(self._task, completed=result.decode_steps)
            live.update(
                Group(self._progress, self._table(result.watchdog, result.decode_steps, result.seconds))
            )
        return result

    def _start(self, step: int, watchdog) -> None:
        """Decode step 1: the watchdog was just reset; its step count includes the prefill."""
        self._walks_at_start = watchdog.walks
        self._offset = watchdog.steps - step

    def _plain_step(self, step: int, watchdog, elapsed: float) -> bool:
        if step == 1:
            self._start(step, watchdog)
        if step % self.every == 0 and step < self.steps:
            self.console.print(self._line(watchdog, elapsed, step))
        return False

    def _live_step(self, step: int, watchdog, elapsed: float) -> bool:
        if step == 1:
            self._start(step, watchdog)
        now = time.monotonic()
        if now - self._last_refresh >= REFRESH_SECONDS:
            self._last_refresh = now
            from rich.console import Group

            self._progress.update(self._task, completed=step)
            self._live.update(Group(self._progress, self._table(watchdog, step, elapsed)))
        return False

    def _numbers(self, watchdog, steps: int, elapsed: float) -> dict:
        f = watchdog.forecast()
        tps = steps * self.batch / elapsed if elapsed > 0 else 0.0
        if self._walks_at_start is None:
            self._start(steps, watchdog)
        if not f.rate_known or (watchdog.walks - self._walks_at_start < 2 and not f.leaks):
            crash = "measuring..."  # a rate needs two graph walks after the prefill
        elif not f.decoding:
            crash = "none (the decode ended)"  # its caches, and the chains they held, are gone
        elif math.isinf(f.steps_to_limit):
            crash = "never"
        else:
            crash = f"step {f.limit_step - self._offset:,.0f} (in {format_duration(f.seconds_to_limit)})"
        leaks = f.leaks
        if watchdog.fix and leaks:
            sites = ", ".join(
                f"{leak.site} +{leak.buffers_per_step:.3g}/step cut by the fix" for leak in leaks[:3]
            )
        else:
            sites = (
                ", ".join(f"{leak.site} +{leak.buffers_per_step:.3g}/step" for leak in leaks[:3]) or "none"
            )
        return {"forecast": f, "tps": tps, "crash": crash, "sites": sites}

    def _line(self, watchdog, elapsed: float, steps: int) -> str:
        n = self._numbers(watchdog, steps, elapsed)
        f = n["forecast"]
        return (
            f"  step {steps:>5}/{self.steps}  {n['tps']:7.0f} tok/s  resident {f.resident_buffers:,}"
            f"/{f.limit:,}  {max(0.0, f.buffers_per_step):+.3g}/step  crash: {n['crash']}  "
            f"leak sites: {n['sites']}"
        )

    def _table(self, watchdog, steps: int, elapsed: float):
        from rich.table import Table

        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        if watchdog is None:
            table.add_row("status", "starting (prefill)...")
            return table
        n = self._numbers(watchdog, steps, elapsed)
        f = n["forecast"]
        share = f.resident_buffers / f.limit if f.limit else 0.0
        table.add_row("step", f"{steps:,} of {self.steps:,}")
        table.add_row("tokens/s", f"{n['tps']:,.0f} ({self.batch} sequences)")
        table.add_row("resident buffers", f"{f.resident_buffers:,} of {f.limit:,} ({100 * share:.1f}%)")
        table.add_row("growth", f"{max(0.0, f.buffers_per_step):+.3g} buffers/step")
        table.add_row("forecast crash", n["crash"])
        table.add_row("top leak sites", n["sites"])
        if watchdog.fix:
            table.add_row("fix", f"{watchdog.materialized_arrays:,} pending cache arrays materialized")
        return table
