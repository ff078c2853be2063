"""``mlx-watchdog scan``: every mlx-lm architecture, built tiny, decoded watched, its leaks named.

    mlx-watchdog scan                          # every family the installed mlx-lm ships
    mlx-watchdog scan qwen3_next nemotron_h    # only these
    mlx-watchdog scan --jobs 2 --json > scan.json
    mlx-watchdog scan my_port --fail-on-leak   # CI gate for a model port (exit 1 on a leak)

Each family runs in a child process of its own (``--timeout`` seconds at most: a crash or a hang
of one family ends only its row). The child builds the family tiny (``families.py``: narrow
widths, its real depth and layer pattern, random weights) and decodes it through mlx-lm's paths:

  plain      generate_step, one prompt
  batched    BatchGenerator, two prompts of equal length
  unequal    BatchGenerator, two prompts of different lengths (left padding)
  join       BatchGenerator, two prompts, a third request joins at a third of the run (the
             growth is measured from 3 steps after the join: the merge is a one-off jump)
  quantized  generate_step with a quantized KV cache (kv_bits=8; --quantized)

each for ``--steps`` decode steps, watched (the prefill's filling of the cache is forgotten after
the first token). Where a path leaks it is decoded again with ``Watchdog(fix=True)``: the fix
cures it when the growth is gone and the tokens are identical. Per family and path the report
gives the leak per decode step (one token of each sequence), the leak sites with the line that
rebinds each (``attribution.py``), and the decode step at which a generation like this one
reaches the limit (499,000 buffers; the buffer count does not depend on the widths, so the tiny
model at the real depth holds as many as the real one).

Exit status: 0 done, 1 a leak was found (``--fail-on-leak``) or a family failed (``--fail-on-error``),
2 usage errors.

JSON (``--json``): one document on stdout, ``schema`` "mlx-watchdog.scan/1", with ``versions``,
``options``, ``seconds`` (wall), ``cpu_seconds`` (of the family processes), ``date``, ``summary``
and ``families``: per family ``family``, ``status`` ("ok", "build_error", "error", "timeout",
"crashed"), ``error``, ``layers``, ``seconds`` and ``runs``: per path ``path``, ``steps``,
``sequences``, ``leak``, ``buffers_per_step``, ``leaks`` (``site``, ``buffers_per_step``,
``buffers``, ``paths``, ``source``), ``resident_buffers``, ``limit_step`` (null: never), ``error``
(the path could not run) and ``fix`` (null where nothing leaked: ``buffers_per_step``,
``tokens_identical``, ``cures``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from .common import EXIT_LEAK, EXIT_OK, EXIT_USAGE, UsageError, positive_int, versions
from .decode import LEAK_MIN_GROWTH, decode_pass, leaking

SCHEMA = "mlx-watchdog.scan/1"
PATHS = ("plain", "batched", "unequal", "join", "quantized")
DEFAULT_PATHS = ("plain", "batched", "unequal", "join")
DEFAULT_STEPS = 100
DEFAULT_TIMEOUT = 240.0
LIMIT = 499_000
PROMPT_LENGTHS = {"plain": (8,), "batched": (8, 8), "unequal": (5, 11), "join": (8, 8, 6), "quantized": (8,)}
DECODE_PATHS = {"unequal": "batched"}  # scan's paths that decode.py decodes as another (its prompts differ)
CHILD_FLAG = "--child"

DESCRIPTION = (
    "Build every model family of the installed mlx-lm (or the ones named) tiny, with its real "
    "layer pattern and random weights, decode it through generate_step and BatchGenerator "
    "watched, and report per family and path: the leak per token, the leaking sites and the "
    "source line that rebinds each, the step at which the 499,000-buffer limit is reached, and "
    "whether Watchdog(fix=True) cures it with identical tokens. Families that cannot be built are "
    "listed with their error."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "families",
        nargs="*",
        metavar="FAMILY",
        help="mlx_lm.models module names (default: every family installed)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=DEFAULT_STEPS,
        metavar="N",
        help="decode steps per path (default: %(default)s)",
    )
    parser.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        metavar="N",
        help="layers of every model (default: its ModelArgs default, else 24)",
    )
    parser.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        metavar="P,P",
        help=f"paths to decode, of {', '.join(PATHS)} (default: %(default)s)",
    )
    parser.add_argument("--quantized", action="store_true", help="also decode with a quantized KV cache")
    parser.add_argument("--no-fix", action="store_true", help="do not check the fix on leaking paths")
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        metavar="N",
        help="families scanned at once, one process each (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help="seconds per family before it is stopped (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document (on stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress display (on stderr)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown to FILE")
    parser.add_argument("--fail-on-leak", action="store_true", help="exit 1 when any path leaks")
    parser.add_argument(
        "--fail-on-error", action="store_true", help="exit 1 when any family fails to build or to decode"
    )
    return parser


def options_from(args: argparse.Namespace) -> dict:
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise UsageError(
            f"--paths: unknown path(s) {', '.join(unknown) or '(none)'}; choose of {', '.join(PATHS)}"
        )
    if args.quantized and "quantized" not in paths:
        paths.append("quantized")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    return {
        "steps": args.steps,
        "layers": args.layers,
        "paths": paths,
        "fix": not args.no_fix,
        "limit": LIMIT,
    }


def run(args: argparse.Namespace) -> int:
    from ..tiny import families

    options = options_from(args)
    names = list(dict.fromkeys(args.families)) or families.families()
    started, cpu = time.perf_counter(), _children_cpu()
    results = scan(names, options, jobs=args.jobs, timeout=args.timeout, progress=not args.quiet)
    report = build_report(results, options, time.perf_counter() - started, _children_cpu() - cpu)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    if args.markdown:
        command = " ".join(["mlx-watchdog", "scan", *sys.argv[2:]]) if sys.argv[1:2] == ["scan"] else None
        with open(args.markdown, "w") as out:
            out.write(markdown(report, command))
    summary = report["summary"]
    if args.fail_on_leak and summary["leaking"]:
        return EXIT_LEAK
    if args.fail_on_error and summary["failed"]:
        return EXIT_LEAK
    return EXIT_OK


# --------------------------------------------------------------------------- the parent


class _Job:
    def __init__(self, name: str, options: dict):
        self.name = name
        self.out = tempfile.TemporaryFile(mode="w+")
        self.err = tempfile.TemporaryFile(mode="w+")
        command = [
            sys.executable,
            "-m",
            "mlx_watchdog.commands.scan",
            CHILD_FLAG,
            json.dumps({"family": name, **options}),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
        self.process = subprocess.Popen(
            command, stdout=self.out, stderr=self.err, env=env, stdin=subprocess.DEVNULL
        )
        self.started = time.perf_counter()

    def result(self, timed_out: bool) -> dict:
        seconds = round(time.perf_counter() - self.started, 2)
        self.out.seek(0)
        self.err.seek(0)
        lines = [line for line in self.out.read().splitlines() if line.startswith("{")]
        tail = self.err.read()[-1500:].strip()
        self.out.close()
        self.err.close()
        if timed_out:
            return _failed(self.name, "timeout", f"stopped after {seconds:.0f} s (--timeout)", seconds)
        if not lines:
            why = tail.splitlines()[-1] if tail else "no output"
            return _failed(self.name, "crashed", f"exit status {self.process.returncode}: {why}", seconds)
        try:
            result = json.loads(lines[-1])
        except ValueError:
            return _failed(self.name, "crashed", f"unreadable result: {lines[-1][:200]}", seconds)
        result["seconds"] = seconds
        return result


def _failed(name: str, status: str, error: str, seconds: float = 0.0) -> dict:
    return {"family": name, "status": status, "error": error, "layers": None, "seconds": seconds, "runs": []}


def scan(
    names: Sequence[str],
    options: dict,
    *,
    jobs: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    progress: bool = True,
) -> list[dict]:
    """Scan each family in a child process of its own, ``jobs`` at once; results in ``names``' order."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[str, dict] = {}
    queue = list(names)
    running: list[_Job] = []
    console = Console(file=sys.stderr)
    display = Progress(
        TextColumn("[bold]scan"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=not progress,
        transient=False,
    )
    with display:
        task = display.add_task("", total=len(queue))
        try:
            _drive(queue, running, results, options, jobs, timeout, display, task, progress)
        finally:  # interrupted: no child outlives the scan
            for job in running:
                job.process.kill()
                job.process.wait()
    return [results[name] for name in names]


def _drive(
    queue: list,
    running: list,
    results: dict,
    options: dict,
    jobs: int,
    timeout: float,
    display,
    task,
    progress: bool,
) -> None:
    """Start children while fewer than ``jobs`` run; collect each as it ends or runs out of time."""
    while queue or running:
        while queue and len(running) < jobs:
            running.append(_Job(queue.pop(0), options))
        time.sleep(0.05)
        for job in list(running):
            over = time.perf_counter() - job.started > timeout
            if job.process.poll() is None and not over:
                continue
            if job.process.poll() is None:
                job.process.kill()
            job.process.wait()
            result = results[job.name] = job.result(over and job.process.returncode != 0)
            running.remove(job)
            display.advance(task)
            if progress:
                display.console.print(_progress_line(result), markup=False, highlight=False)
        display.update(
            task, description=" ".join(f"{j.name} {time.perf_counter() - j.started:.0f}s" for j in running)
        )


def _progress_line(result: dict) -> str:
    if result["status"] != "ok":
        return f"  {result['family']:<22} {result['status'].upper()}: {result['error'][:100]}"
    parts = []
    for run in result["runs"]:
        parts.append(
            f"{run['path']} error" if run.get("error") else f"{run['path']} {run['buffers_per_step']:+.3g}"
        )
    return (
        f"  {result['family']:<22} {result['layers']} layers, {result['seconds']:.0f} s: {', '.join(parts)}"
    )


# --------------------------------------------------------------------------- the report


def _children_cpu() -> float:
    """CPU seconds of the child processes ended so far (what a scan costs on an idle machine)."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime
    except Exception:  # no resource module (Windows)
        return 0.0


def build_report(results: list[dict], options: dict, seconds: float, cpu_seconds: float = 0.0) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    leaky = [r["family"] for r in ok if any(run["leak"] for run in r["runs"])]
    failed = [r["family"] for r in results if r["status"] != "ok"]
    path_errors = [f"{r['family']}:{run['path']}" for r in ok for run in r["runs"] if run.get("error")]
    return {
        "schema": SCHEMA,
        "versions": versions(),
        "options": options,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),  # of the children: over N idle cores it takes about this / N
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "summary": {
            "families": len(results),
            "built": len(ok),
            "leaking": leaky,
            "failed": failed,
            "path_errors": path_errors,
        },
        "families": results,
    }


def _sites(run: dict) -> str:
    # No line seen rebinding the site: the growth is not from a rebinding (a measurement to doubt).
    return (
        "; ".join(
            f"{leak['site']} +{leak['buffers_per_step']:.3g} @ " + (leak.get("source") or "no rebinding seen")
            for leak in run["leaks"]
        )
        or "-"
    )


def _crash(run: dict) -> str:
    return "never" if run["limit_step"] is None else f"{run['limit_step']:,.0f}"


def _fix(run: dict) -> str:
    fix = run.get("fix")
    if fix is None:
        return "-"
    verdict = "cured" if fix["cures"] else "NOT cured"
    return f"{verdict} ({fix['buffers_per_step']:+.3g}, tokens {'identical' if fix['tokens_identical'] else 'differ'})"


def rows(report: dict) -> list[tuple[str, ...]]:
    """(family, layers, path, leak/step, crash at step, sites, fix) for each run of a built family."""
    out: list[tuple[str, ...]] = []
    for r in report["families"]:
        if r["status"] != "ok":
            continue
        for run in r["runs"]:
            if run.get("error"):
                out.append((r["family"], str(r["layers"]), run["path"], "error", "-", run["error"][:80], "-"))
            else:
                out.append(
                    (
                        r["family"],
                        str(r["layers"]),
                        run["path"],
                        f"{run['buffers_per_step']:+.3g}",
                        _crash(run),
                        _sites(run),
                        _fix(run),
                    )
                )
    return out


COLUMNS = ("family", "layers", "path", "leak/step", "limit at step", "leak sites @ source line", "fix=True")


def render(report: dict, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, highlight=False, markup=False, soft_wrap=True)
    if not console.is_terminal:
        console.width = max(console.width, 200)
    table = Table()
    for column in COLUMNS:
        table.add_column(column)
    for row in rows(report):
        table.add_row(*row)
    console.print(table)
    failed = [r for r in report["families"] if r["status"] != "ok"]
    if failed:
        console.print(f"{len(failed)} famil{'y' if len(failed) == 1 else 'ies'} not scanned:")
        for r in failed:
            console.print(f"  {r['family']}: {r['status']}: {r['error']}")
    s = report["summary"]
    console.print(
        f"{s['built']} of {s['families']} families built and decoded in {report['seconds']:.0f} s; "
        f"leaking: {', '.join(s['leaking']) or 'none'}"
    )


def markdown(report: dict, command: str | None = None) -> str:
    """The report as markdown: what ran, the table, what could not be scanned."""
    s, v = report["summary"], report["versions"]
    lines = ["# mlx-watchdog scan", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        f"Date: {report.get('date', '?')}; mlx {v['mlx']}, mlx-lm {v['mlx_lm']}, mlx-watchdog "
        f"{v['mlx_watchdog']}; {report['options']['steps']} decode steps per path; "
        f"{report['seconds']:.0f} s in all, {report.get('cpu_seconds', 0):.0f} CPU seconds of the "
        f"family processes.",
        "",
        f"{s['built']} of {s['families']} families built and decoded; leaking: "
        f"{', '.join(s['leaking']) or 'none'}.",
        "",
    ]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows(report)]
    failed = [r for r in report["families"] if r["status"] != "ok"]
    if failed:
        lines += ["", "Not scanned:", ""]
        lines += [f"- `{r['family']}`: {r['status']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the child


def _child(config: dict) -> dict:
    from ..tiny import families

    name = config["family"]
    try:
        # A quantized KV cache quantizes rows in groups of 32 at least: heads of 32 then.
        sizes = {"head_dim": 32} if "quantized" in config["paths"] else None
        model, _ = families.build(name, config.get("layers"), sizes=sizes)
    except BaseException as exc:  # SystemExit of a module too: the row says so
        return _failed(name, "build_error", f"{type(exc).__name__}: {str(exc)[:400]}")
    layers = len(getattr(model, "layers", None) or []) or None
    runs = []
    for path in config["paths"]:
        try:
            runs.append(scan_path(model, path, config["steps"], config["limit"], config["fix"]))
        except Exception as exc:
            runs.append({"path": path, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "leak": False})
    return {"family": name, "status": "ok", "error": None, "layers": layers, "runs": runs}


def scan_path(model, path: str, steps: int, limit: int = LIMIT, fix: bool = True) -> dict:
    """Decode ``model`` on ``path`` watched (and again fixed, where it leaks): one run's entry."""
    from .. import tiny
    from ..core.watchdog import Watchdog

    prompts = [p[:n] for p, n in zip(tiny.tiny_prompts(3, 11, seed=1), PROMPT_LENGTHS[path])]

    def watched(fixing: bool):
        watchdog = Watchdog(
            limit, fix=fixing, fix_every=1, export=False, overhead_budget=0.25, walk_interval=0
        )
        return decode_pass(model, DECODE_PATHS.get(path, path), prompts, steps, watchdog)

    result = watched(False)
    f = result.watchdog.forecast()
    leak = leaking(f)
    entry = {
        "path": path,
        "steps": result.decode_steps,
        "sequences": result.sequences,
        "leak": leak,
        "buffers_per_step": round(max(0.0, f.buffers_per_step), 3),
        "leaks": [
            {
                "site": site.site,
                "buffers_per_step": round(site.buffers_per_step, 3),
                "buffers": site.buffers,
                "paths": list(site.paths[:4]),
                "source": site.source,
            }
            for site in f.leaks
        ],
        "resident_buffers": f.resident_buffers,
        "limit_step": None if f.steps_to_limit == float("inf") else round(f.limit_step - result.step_offset),
        "fix": None,
    }
    if leak and fix:
        fixed = watched(True)
        growth = max(0.0, fixed.watchdog.forecast().buffers_per_step)
        identical = fixed.tokens == result.tokens
        entry["fix"] = {
            "buffers_per_step": round(growth, 3),
            "tokens_identical": identical,
            "cures": bool(identical and growth < LEAK_MIN_GROWTH),
        }
    return entry


def _child_entry(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != CHILD_FLAG:
        print(
            "usage: python -m mlx_watchdog.commands.scan --child CONFIG_JSON (used by `mlx-watchdog scan`)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = _child(json.loads(argv[1]))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(_child_entry(sys.argv[1:]))
