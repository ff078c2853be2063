"""``mlx-watchdog run``: any Python program, with every model it loads through mlx-lm or mlx-vlm
watched, and the metrics of all its processes on one endpoint. No line of the program changes.

    mlx-watchdog run --fix --stop-within 2000 -- vllm-mlx serve ~/models/qwen --continuous-batching
    mlx-watchdog run -- python -m mlx_vlm.server --model ~/models/qwen
    mlx-watchdog run -- python app.py

OpenTelemetry's ``opentelemetry-instrument python app.py`` is the model: this process is a
supervisor, not the program. It serves /metrics, prints one line saying what is watched, and
starts COMMAND as its child (same process group: Ctrl-C at the terminal reaches both; SIGTERM,
SIGHUP, SIGUSR1 and SIGUSR2 sent to the supervisor are passed on), waits for it and exits with
its status (128 + N when a signal N ended it). The child's environment has
``mlx_watchdog/bootstrap`` first on PYTHONPATH and ``MLX_WATCHDOG_RUN`` set (options and a
state folder, as JSON): every Python process of the program, its subprocesses and spawned
children included, runs the bootstrap's ``sitecustomize`` and instruments itself
(``mlx_watchdog.bootstrap``). Each writes its metrics to ``<state>/<pid>.prom``; the supervisor
merges them at scrape time with a ``pid`` label (``mlx_watchdog.exporters.processes``).

What cannot be watched is said at start, never silently: a Python started with ``-I``, ``-E`` or
``-S`` (on the command line or in a script's ``#!`` line) ignores PYTHONPATH or sitecustomize, so
``run`` refuses it (exit status 2) unless ``--allow-unwatched``; a program that is not Python, or
brings its own Python that ignores PYTHONPATH (an app bundle), is found out after the start: no
Python process says hello within ``HELLO_SECONDS`` and one line says that nothing is watched.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..bootstrap import HELLO_PREFIX, configuration, environment
from .common import EXIT_USAGE, PROG, UsageError, seconds
from .watch_options import (
    add_metrics_arguments,
    add_watchdog_arguments,
    metrics_server_options,
    watchdog_options,
)

DESCRIPTION = (
    "Run a Python program (a console script, `python -m ...`, `python app.py`) with every model it "
    "loads through mlx-lm or mlx-vlm watched, its child processes too, and their metrics on one "
    "endpoint with a pid label. The program is not changed. COMMAND goes after `--`."
)
USAGE = f"{PROG} run [watchdog options] -- COMMAND [ARGS ...]"

HELLO_SECONDS = 5.0  # no Python process said hello by then: nothing is watched
FORWARDED_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
EXIT_NOT_FOUND = 127  # the shell's statuses for a command not found / not executable
EXIT_NOT_EXECUTABLE = 126

# The interpreter flags that keep the bootstrap out, and why.
BLOCKING_FLAGS = {
    "I": "isolated mode: PYTHONPATH and sitecustomize are ignored",
    "E": "PYTHONPATH is ignored",
    "S": "site is not imported, so sitecustomize is not either",
}
_PYTHON_NAME = re.compile(r"^(python|pypy)(\d+(\.\d+)*)?[a-z]?(\.exe)?$")


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("watchdog")
    add_watchdog_arguments(
        group,
        stop_help="stop the generation when the limit is forecast within STEPS decode steps: the "
        "model's forward raises mlx_watchdog.ResourceLimitForecast (a RuntimeError), which servers "
        "answer by failing the running requests; the program goes on",
    )
    add_metrics_arguments(group)
    parser.add_argument(
        "--linger",
        type=seconds,
        default=0.0,
        metavar="SECONDS",
        help="after COMMAND exits, serve its last metrics SECONDS more before exiting with its "
        "status (a training run or batch job that stopped before the limit: the stop reaches the "
        "next scrape); Ctrl-C or SIGTERM ends the wait (default: 0)",
    )
    parser.add_argument(
        "--allow-unwatched",
        action="store_true",
        default=False,
        help="run COMMAND even when it cannot be watched (a Python started with -I, -E or -S); "
        "without it run refuses such a command (exit status 2)",
    )
    return parser


# --------------------------------------------------------------------------- what cannot be watched


def interpreter_options(interpreter_args: Sequence[str]) -> tuple[list[tuple[str, str | None]], int]:
    """A Python interpreter's own options, in order, as (flag, value), and the index in
    ``interpreter_args`` where the program's arguments start. ``-c`` and ``-m`` end the options,
    with the command or module as value; long options are kept as given."""
    args, i = list(interpreter_args), 0
    found: list[tuple[str, str | None]] = []
    while i < len(args):
        arg = args[i]
        if arg == "-" or arg == "--" or not arg.startswith("-"):
            return found, i  # the script (or stdin)
        if arg.startswith("--"):
            takes_value = arg == "--check-hash-based-pycs"
            found.append((arg, args[i + 1] if takes_value and i + 1 < len(args) else None))
            i += 2 if takes_value else 1
            continue
        for j, flag in enumerate(arg[1:]):
            rest = arg[j + 2 :]
            if flag in "cmWX":  # its value is the rest of this argument, or the next one
                value = rest or (args[i + 1] if i + 1 < len(args) else "")
                found.append((flag, value))
                i += 1 if rest else 2
                if flag in "cm":
                    return found, i
                break
            found.append((flag, None))
        else:
            i += 1
    return found, i


def blocking_flag(interpreter_args: Sequence[str]) -> str | None:
    """The first of -I, -E, -S among a Python interpreter's own options, or None."""
    options, _ = interpreter_options(interpreter_args)
    return next((flag for flag, _ in options if flag in BLOCKING_FLAGS), None)


def is_python(path: str) -> bool:
    return bool(_PYTHON_NAME.match(os.path.basename(path)))


def shebang(path: str) -> list[str] | None:
    """The words of a script's ``#!`` line, or None (not a script, unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip()
    return line.split() or None


def interpreter_of(executable: str, argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """(the Python that runs, its own arguments) for ``argv`` run through ``executable``: Python
    itself, or a script whose ``#!`` line names Python (directly or through ``env``). None when
    COMMAND is not Python as far as can be seen."""
    if is_python(executable):
        return executable, list(argv[1:])
    words = shebang(executable)
    if not words:
        return None
    if os.path.basename(words[0]) == "env":
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):  # env's options, VAR=value
            words = words[1:]
    if words and is_python(words[0]):
        return words[0], words[1:]
    return None


def unwatchable(executable: str, argv: Sequence[str]) -> str | None:
    """Why COMMAND cannot be watched (one line), or None when nothing says so before it starts."""
    found = interpreter_of(executable, argv)
    if found is None:
        return None
    python, args = found
    flag = blocking_flag(args)
    if flag is None:
        return None
    where = "" if is_python(executable) else f" (the #! line of {executable})"
    return f"{os.path.basename(python)} -{flag}{where}: {BLOCKING_FLAGS[flag]}"


def runs_mlx_lm_server(command: Sequence[str]) -> bool:
    """``mlx_lm.server ...``, ``python -m mlx_lm.server ...`` or ``python -m mlx_lm server ...``."""
    if os.path.basename(command[0]) == "mlx_lm.server":
        return True
    if not is_python(command[0]):
        return False
    options, end = interpreter_options(command[1:])
    module = options[-1][1] if options and options[-1][0] == "m" else None
    program_args = list(command[1 + end :])
    return module == "mlx_lm.server" or (module == "mlx_lm" and program_args[:1] == ["server"])


# --------------------------------------------------------------------------- running


def run(args: argparse.Namespace, command: Sequence[str] | None = None) -> int:
    """Run ``command`` watched as ``args`` say; returns its exit status (see the module docstring).
    Raises ``UsageError`` for a bad option, a missing command or a metrics endpoint that cannot
    start; ``command=None`` reads ``args.command_argv``."""
    command = [str(c) for c in (getattr(args, "command_argv", None) if command is None else command) or ()]
    if not command:
        raise UsageError(f"no command to run: {USAGE}")
    try:
        options = watchdog_options(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    executable = _resolve(command[0])
    if executable is None:
        print(f"{PROG} run: {command[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    shown = shlex.join(command)
    problem = unwatchable(executable, command)
    if problem is not None:
        if not getattr(args, "allow_unwatched", False):
            print(
                f"{PROG} run: cannot watch `{shown}`: {problem}; nothing would be watched. "
                "Drop the flag, or pass --allow-unwatched to run it unwatched.",
                file=sys.stderr,
            )
            return EXIT_USAGE
        print(f"{PROG} run: `{shown}` runs UNWATCHED: {problem}", file=sys.stderr, flush=True)

    state = tempfile.mkdtemp(prefix="mlx-watchdog-run-")
    metrics = None
    restore: Callable[[], None] = lambda: None  # noqa: E731
    hello: threading.Timer | None = None
    try:
        no_metrics = bool(getattr(args, "no_metrics", False))
        if not no_metrics:
            metrics = _start_metrics(args, state)
        if problem is None:
            print(_start_line(shown, options, metrics), file=sys.stderr, flush=True)
        if options["stop_within"] is not None and runs_mlx_lm_server(command):
            print(
                f"{PROG} run: mlx_lm.server's batch loop has no handler for a stop (its generation "
                f"thread would end and requests hang): `{PROG} serve` ends stopped requests cleanly",
                file=sys.stderr,
                flush=True,
            )
        env = environment(dict(os.environ), configuration(options, state, metrics=not no_metrics))
        forwarder = _SignalForwarder()
        restore = forwarder.install()  # before the child starts: a SIGTERM meanwhile is passed on
        try:
            child = subprocess.Popen(command, env=env)
        except PermissionError as exc:
            print(f"{PROG} run: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_NOT_EXECUTABLE
        except OSError as exc:
            print(f"{PROG} run: cannot start {command[0]}: {exc}", file=sys.stderr)
            return EXIT_NOT_EXECUTABLE
        forwarder.started(child)
        if problem is None:
            hello = _watch_for_hello(child, state, shown)
        status = _wait(child)
        status = 128 - status if status < 0 else status
        linger = _linger_seconds(args)
        if metrics is not None and linger > 0:
            restore()
            restore = lambda: None  # noqa: E731
            _linger(linger, metrics.url, status)
        return status
    finally:
        if hello is not None:
            hello.cancel()
        restore()
        if metrics is not None:
            metrics.close()
        shutil.rmtree(state, ignore_errors=True)


def _linger_seconds(args: argparse.Namespace) -> float:
    return float(getattr(args, "linger", 0.0) or 0.0)


def _linger(wait: float, url: str, status: int) -> None:
    """Serve the metrics ``wait`` seconds more, or until SIGINT, SIGTERM or SIGHUP."""
    print(
        f"{PROG} run: the program exited with status {status}; its last metrics stay at {url} for "
        f"{wait:g} s (Ctrl-C to leave now)",
        file=sys.stderr,
        flush=True,
    )
    leave = threading.Event()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if signum is not None:
                previous[signum] = signal.signal(signum, lambda *_: leave.set())
    try:
        leave.wait(wait)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _resolve(name: str) -> str | None:
    if os.sep in name or (os.altsep and os.altsep in name):
        return name if os.path.exists(name) else None
    return shutil.which(name)


def _start_metrics(args: argparse.Namespace, state: str) -> Any:
    from ..exporters.processes import KEEP_EXITED_SECONDS, start_processes_server

    keep = max(KEEP_EXITED_SECONDS, _linger_seconds(args))
    try:
        return start_processes_server(
            state, args.metrics_port, args.metrics_addr, keep_exited=keep, **metrics_server_options(args)
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metrics-port/--metrics-addr: {exc} (or pass --no-metrics)") from exc


def _start_line(shown: str, options: dict, metrics: Any) -> str:
    def within(value: Any) -> str:
        return "off" if value is None else f"within {value:,.0f} steps"

    fix = f"every {options['fix_every']} steps" if options["fix"] else "off"
    limit = "the device's" if options["limit"] is None else f"{options['limit']:,} buffers"
    where = f"metrics of every process at {metrics.url} (label pid)" if metrics is not None else "no metrics"
    return (
        f"{PROG} run: watching every model `{shown}` (and its Python child processes) loads through "
        f"mlx_lm or mlx_vlm; fix: {fix}, stop: {within(options['stop_within'])}, warn: "
        f"{within(options['warn_within'])}, limit: {limit}; {where}"
    )


class _SignalForwarder:
    """Passes SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 on to the child (one that comes before the
    child starts is passed on when it does). SIGINT is ignored here while the child runs: Ctrl-C
    at the terminal reaches the child itself (the same process group), and it is the child's to
    act on; a second copy from here would read as a second Ctrl-C."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = self._previous
        for name in FORWARDED_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                try:
                    previous[signum] = signal.signal(signum, self._forward)
                except (ValueError, OSError):
                    continue

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

        return restore

    def started(self, child: subprocess.Popen) -> None:
        self.child = child
        if threading.current_thread() is threading.main_thread():
            # After the start: an ignored signal would be inherited by the child.
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for signum in self.pending:
            self._forward(signum, None)

    def _forward(self, signum: int, frame: Any) -> None:
        if self.child is None:
            self.pending.append(signum)
            return
        try:
            self.child.send_signal(signum)
        except ProcessLookupError:
            pass


def _wait(child: subprocess.Popen) -> int:
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:  # SIGINT is ignored while the child runs; a handler may differ
            continue


def _watch_for_hello(child: subprocess.Popen, state: str, shown: str) -> threading.Timer:
    """After ``HELLO_SECONDS``: if the child still runs and no Python process of it said hello,
    say that nothing is watched."""

    def check() -> None:
        if child.poll() is not None:
            return
        try:
            said = any(name.startswith(HELLO_PREFIX) for name in os.listdir(state))
        except OSError:
            return
        if not said:
            print(
                f"{PROG} run: no Python process of `{shown}` started the watchdog within "
                f"{HELLO_SECONDS:g} s: NOTHING IS WATCHED (a program that is not Python, or one "
                "with its own Python that ignores PYTHONPATH, e.g. an app bundle)",
                file=sys.stderr,
                flush=True,
            )

    timer = threading.Timer(HELLO_SECONDS, check)
    timer.daemon = True
    timer.start()
    return timer


def bootstrap_folder() -> Path:
    """The folder ``run`` puts first on PYTHONPATH (it holds ``sitecustomize.py``)."""
    from ..bootstrap import FOLDER

    return Path(FOLDER)
