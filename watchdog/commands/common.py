"""What every ``mlx-watchdog`` subcommand shares: exit codes, the usage error, argument types,
the flags spelled like mlx-lm's, the consoles and how numbers are written.

The subcommands (demo.py, diagnose.py, serve.py, scan.py, ...) import this module, never
``main.py``: the entry point imports them, so they must not import it back.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core import options

PROG = "mlx-watchdog"

EXIT_OK = 0
EXIT_LEAK = 1  # a leak was found (diagnose), the fix did not hold (demo), serve could not start
EXIT_USAGE = 2  # a bad option, a model that cannot be loaded, a port in use
EXIT_INTERRUPTED = 130

WIDE = 200  # columns of a console that is not a terminal: tables are never cut at 80


class UsageError(Exception):
    """A mistake the user can fix (bad option, missing model, a port in use): one line, exit 2."""


# --------------------------------------------------------------------------- argument types


def checked(convert, is_valid, what: str, name: str):
    """An argparse type: ``convert`` the text, then check it; errors say what was expected."""

    def parse(text: str):
        try:
            value = convert(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not is_valid(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = checked(int, options.POSITIVE_INT.holds, options.POSITIVE_INT.what, "positive_int")
port_number = checked(int, options.PORT.holds, options.PORT.what, "port_number")
step_count = checked(float, options.STEPS.holds, options.STEPS.what, "step_count")
fraction = checked(float, options.FRACTION.holds, options.FRACTION.what, "fraction")
seconds = checked(float, options.SECONDS.holds, options.SECONDS.what, "seconds")

PLOT_SUFFIXES = (".png", ".svg")


def plot_file(text: str) -> str:
    """An argparse type for ``--plot FILE``: the format comes from the extension."""
    if not text.lower().endswith(PLOT_SUFFIXES):
        raise argparse.ArgumentTypeError(f"must be a file name ending in .png or .svg, got {text!r}")
    return text


# --------------------------------------------------------------------------- flags shared by commands


def add_max_tokens(parser, default: int, help: str) -> None:
    """``--max-tokens/-m N`` (mlx_lm.generate's spelling)."""
    parser.add_argument(
        "-m",
        "--max-tokens",
        dest="max_tokens",
        type=positive_int,
        default=default,
        metavar="N",
        help=f"{help} (default: %(default)s)",
    )


def add_output_flags(parser, what: str) -> None:
    """``--json`` (one document on stdout, nothing else there) and ``--plot FILE``."""
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON document on stdout ({what}); progress goes to stderr, and only on a terminal",
    )
    parser.add_argument(
        "--plot",
        type=plot_file,
        metavar="FILE",
        help="draw resident buffers against steps (each path, with and without the "
        "fix, the fitted growth, the limit and the forecast crash) into FILE, "
        "PNG or SVG by its extension; needs `pip install 'mlx-watchdog[plot]'`",
    )


def split_server_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at the first literal ``--``: (our arguments, mlx_lm.server's arguments)."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


# --------------------------------------------------------------------------- checks before starting


def looks_local(spec: str) -> bool:
    """A path rather than a Hugging Face id (an id is "name" or "org/name": at most one slash,
    no leading "/", "." or "~")."""
    return (
        spec.startswith(("/", ".", "~"))
        or spec.count("/") > 1
        or (os.altsep is not None and os.altsep in spec)
        or os.path.exists(spec)
    )


def local_model_problem(spec: str) -> str | None:
    """What is wrong with a local model folder ``spec`` (None: fine, or a Hugging Face id)."""
    if not looks_local(spec):
        return None
    local = Path(os.path.expanduser(spec))
    if not local.exists():
        return f"model path does not exist: {spec}"
    if not local.is_dir():
        return f"model path is not a folder: {spec} (expected config.json and weights)"
    if not (local / "config.json").is_file():
        return f"model folder has no config.json: {spec}"
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why an HTTP server could not listen on ``host:port`` (None: it can), tried the way
    ``http.server`` binds (SO_REUSEADDR: a port in TIME_WAIT is free, one with a listener not)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError, OverflowError) as exc:
        return f"cannot resolve {host!r}: {exc}"
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


# --------------------------------------------------------------------------- output


def consoles(json_output: bool = False):
    """(report, progress): rich Consoles for the report (stdout) and progress (stderr).

    Neither cuts tables at 80 columns: a terminal gets its own width, a pipe or a file ``WIDE``.
    With ``json_output`` the report console writes to stderr, so stdout holds the JSON alone."""
    from rich.console import Console

    def make(stream):
        terminal = stream.isatty() if hasattr(stream, "isatty") else False
        width = shutil.get_terminal_size((WIDE, 24)).columns if terminal else WIDE
        # soft_wrap: plain lines (not a terminal) stay one line each, whatever the width.
        return Console(file=stream, highlight=False, markup=False, soft_wrap=True, width=width)

    report = make(sys.stderr if json_output else sys.stdout)
    return report, make(sys.stderr)


def print_json(document: dict) -> None:
    """The one JSON document a command prints (``--json``)."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    sys.stdout.flush()


def finite(x: float | None) -> float | None:
    """``x``, or None where it is infinite or not a number (JSON has no infinity: "never")."""
    return None if x is None or math.isinf(x) or math.isnan(x) else float(x)


def format_count(x: float | None) -> str:
    """A step count for people: "12,345", or "never" (None)."""
    return "never" if x is None else f"{x:,.0f}"


def format_duration(seconds: float | None) -> str:
    """A time for people: "42 s", "17 min", "3.5 h", or "never" (None or infinite)."""
    if seconds is None or math.isinf(seconds):
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# --------------------------------------------------------------------------- versions


def package_version(dist: str) -> str:
    """The installed version of the distribution ``dist`` ("?" if it is not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def versions() -> dict:
    """The versions a report records: mlx, mlx-lm and this package."""
    import mlx.core as mx

    from .. import __version__

    return {
        "mlx": str(getattr(mx, "__version__", "?")),
        "mlx_lm": package_version("mlx-lm"),
        "mlx_watchdog": __version__,
    }
