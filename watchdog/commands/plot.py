"""``--plot FILE`` of ``diagnose`` and ``demo``: resident buffers against decode steps.

One row per path (batched, plain); in each row, left the decode as measured (the graph walks'
readings, watched and with the fix, and the fitted growth line), right the same lines carried
on to the limit: the forecast crash step and the limit. The legend names the top leak sites.

The input is the report the command prints with ``--json`` (its ``runs``, each with
``readings`` and ``fix.readings``), so a plot can also be drawn later from a saved report:

    python -m mlx_watchdog.commands.plot report.json leak.png

matplotlib is an optional extra (``pip install 'mlx-watchdog[plot]'``); nothing here imports
pyplot, so no GUI backend or global figure state is involved.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .common import PLOT_SUFFIXES, UsageError

MISSING = "--plot needs matplotlib, which is not installed: pip install 'mlx-watchdog[plot]'"
TOP_SITES = 3
WATCHED, FIXED, LIMIT = "#c0392b", "#2471a3", "#555555"


def require() -> None:
    """Raise ``UsageError`` (one line, naming the extra) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise UsageError(MISSING) from None


def _fitted(
    readings: list, rate: float, limit_step: float | None, limit: float
) -> tuple[float, float] | None:
    """A (step, resident) the growth line goes through: the forecast crash on the limit when the
    pass grows (so the line meets the limit where the forecast says), else the last reading."""
    if rate > 0 and limit_step is not None and math.isfinite(limit_step):
        return float(limit_step), limit
    if not readings:
        return None
    step, resident = readings[-1]
    return float(step), float(resident)


def _line(anchor: tuple[float, float], rate: float, x0: float, x1: float) -> tuple[list, list]:
    step, resident = anchor
    return [x0, x1], [resident + rate * (x0 - step), resident + rate * (x1 - step)]


def _sites(run: dict) -> str:
    leaks = run.get("leaks") or []
    if not leaks:
        return "no leak site"
    text = ", ".join(f"{leak['site']} +{leak['buffers_per_step']:.3g}/step" for leak in leaks[:TOP_SITES])
    return text + (f", +{len(leaks) - TOP_SITES} more" if len(leaks) > TOP_SITES else "")


def figure(report: dict):
    """The matplotlib ``Figure`` of a report (``diagnose``'s or ``demo``'s JSON document)."""
    require()
    from matplotlib.figure import Figure

    runs = report["runs"]
    limit = float(report["limit"])
    fig = Figure(figsize=(10, 3.3 * len(runs) + 0.6), layout="constrained")
    title = f"mlx-watchdog: {report.get('model', '')} ({report.get('model_type', '')})"
    fig.suptitle(title, fontsize=11)
    axes = fig.subplots(len(runs), 2, squeeze=False)
    for row, run in zip(axes, runs):
        _measured(row[0], run, limit)
        _forecast(row[1], run, limit)
    return fig


def _passes(run: dict):
    """(readings, rate, crash step, colour, name) of the watched and the fixed pass."""
    fix = run["fix"]
    return (
        (run["readings"], run["buffers_per_step"], run.get("limit_step"), WATCHED, "watched"),
        (fix["readings"], fix["buffers_per_step"], fix.get("limit_step"), FIXED, "with the fix"),
    )


def _measured(ax, run: dict, limit: float) -> None:
    steps = max(1, int(run["decode_steps"]))
    for readings, rate, crash, color, _name in _passes(run):
        label = f"watched: {_sites(run)}" if color == WATCHED else "Watchdog(fix=True)"
        if readings:
            xs, ys = zip(*readings)
            ax.plot(xs, ys, "o", color=color, markersize=3, label=f"{label} (graph walks)")
        anchor = _fitted(readings, rate, crash, limit)
        if anchor is not None:
            line_x, line_y = _line(anchor, rate, 0, steps)
            ax.plot(line_x, line_y, "-", color=color, linewidth=1.2, label=f"fit {rate:+.3g} buffers/step")
    ax.set_title(
        f"{run['path']} path, batch {run['batch_size']}: {steps:,} decode steps measured", fontsize=10
    )
    ax.set_xlabel("decode step")
    ax.set_ylabel("resident buffers")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)


def _forecast(ax, run: dict, limit: float) -> None:
    steps = max(1, int(run["decode_steps"]))
    crash = run.get("limit_step")
    end = float(crash) * 1.1 if crash is not None and math.isfinite(crash) else steps * 10.0
    end = max(end, steps * 1.1)
    ax.axhline(limit, color=LIMIT, linestyle="--", linewidth=1, label=f"limit {limit:,.0f} buffers")
    for readings, rate, pass_crash, color, label in _passes(run):
        anchor = _fitted(readings, rate, pass_crash, limit)
        if anchor is None:
            continue
        stop = end
        if rate > 0:  # the line ends at the limit
            stop = min(end, anchor[0] + (limit - anchor[1]) / rate)
        xs, ys = _line(anchor, rate, 0, stop)
        ax.plot(xs, ys, "-", color=color, linewidth=1.5, label=f"{label}: {rate:+.3g}/step")
    if crash is not None and math.isfinite(crash):
        ax.axvline(
            crash, color=WATCHED, linestyle=":", linewidth=1.2, label=f"forecast crash: step {crash:,.0f}"
        )
    ax.axvspan(0, steps, color="#dddddd", alpha=0.5, label="measured")
    ax.set_xlim(0, end)
    ax.set_ylim(0, limit * 1.08)
    from matplotlib.ticker import FuncFormatter

    thousands = FuncFormatter(lambda value, _: f"{value:,.0f}")
    ax.xaxis.set_major_formatter(thousands)
    ax.yaxis.set_major_formatter(thousands)
    ax.set_title("forecast to the limit" + ("" if crash is not None else ": never reached"), fontsize=10)
    ax.set_xlabel("decode step")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)


def save(report: dict, path: str) -> str:
    """Draw ``report`` into ``path`` (PNG or SVG by its extension); returns the path."""
    suffix = Path(path).suffix.lower()
    if suffix not in PLOT_SUFFIXES:
        raise UsageError(f"--plot: the file must end in .png or .svg, got {path!r}")
    fig = figure(report)
    try:
        fig.savefig(path, format=suffix[1:], dpi=90)
    except OSError as exc:
        raise UsageError(f"--plot: cannot write {path}: {exc.strerror or exc}") from exc
    return path


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m mlx_watchdog.commands.plot REPORT.json FILE.png|FILE.svg", file=sys.stderr)
        return 2
    try:
        save(json.loads(Path(argv[0]).read_text()), argv[1])
    except (OSError, ValueError, KeyError) as exc:
        print(f"mlx_watchdog.plot: error: cannot read the report {argv[0]}: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"mlx_watchdog.plot: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
