"""``mlx-watchdog serve``: the real ``mlx_lm.server``, in this process, with every model it loads
watched (``attach/server.py``), and the watchdogs' metrics on a separate port.

    mlx-watchdog serve --fix --stop-within 2000 -- --model mlx-community/Qwen3-Next-80B-A3B-4bit

Before mlx_lm.server starts listening, its parsed arguments are checked (``server.run`` is
wrapped while ``serve`` runs): a local ``--model`` (``--adapter-path``, ``--draft-model``) that
does not exist and an API port that is in use (or the metrics port) end ``serve`` with one line
and exit status 2, instead of mlx_lm.server's traceback and a server that hangs or answers 503.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..attach.server import ServerHooks
from ..core.process_count import start_early
from .common import (
    EXIT_USAGE,
    PROG,
    UsageError,
    local_model_problem,
    port_problem,
    split_server_argv,
)
from .watch_options import (  # noqa: F401  (DEFAULTS, default_metrics_port, watchdog_options: serve's API)
    DEFAULT_METRICS_ADDR,
    DEFAULT_METRICS_PORT,
    DEFAULTS,
    add_metrics_arguments,
    add_watchdog_arguments,
    default_metrics_port,
    start_metrics,
    watchdog_options,
)

SERVER_PROG = "mlx_lm.server"


# --------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the watchdog options of ``serve`` to ``parser`` (the server's own go after ``--``)."""
    group = parser.add_argument_group("watchdog")
    add_watchdog_arguments(
        group,
        stop_help='end the running requests (finish_reason "resource_limit") when the '
        "limit is forecast within STEPS decode steps; the server goes on",
    )
    group.add_argument(
        "--adapt-prefill",
        action="store_true",
        default=False,
        help="shrink the server's prefill chunks to what the watchdog measures as safe "
        "(needs mlx_watchdog.prefill)",
    )
    add_metrics_arguments(group)
    return parser


def build_parser(prog: str = "mlx-watchdog serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [watchdog options] -- [mlx_lm.server arguments]",
        description="Run mlx_lm.server with every model it loads watched by mlx-watchdog.",
        epilog="Everything after `--` goes to mlx_lm.server, e.g. "
        "`-- --model PATH --host 127.0.0.1 --port 8080`.",
    )
    return add_arguments(parser)


def parse_args(
    argv: Sequence[str], parser: argparse.ArgumentParser | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``[watchdog options] -- [server arguments]``; argparse exits (status 2) on bad input."""
    parser = parser or build_parser()
    ours, server_argv = split_server_argv(argv)
    args, unknown = parser.parse_known_args(ours)
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)} (mlx_lm.server's own arguments go after `--`)"
        )
    return args, server_argv


# --------------------------------------------------------------------------- running


def preflight(cli_args: argparse.Namespace, host: str, port: int, metrics: Any = None) -> None:
    """Check what mlx_lm.server parsed before it starts; raise ``UsageError`` naming the flag."""
    for flag in ("model", "adapter_path", "draft_model"):
        spec = getattr(cli_args, flag, None)
        problem = local_model_problem(str(spec)) if spec else None
        if problem is not None:
            raise UsageError(f"{problem} (mlx_lm.server's --{flag.replace('_', '-')})")
    metrics_port = getattr(metrics, "port", None)
    if metrics_port == port:
        raise UsageError(
            f"mlx_lm.server's --port {port} is the metrics port: choose another --port or --metrics-port"
        )
    problem = port_problem(host, port)
    if problem is not None:
        raise UsageError(
            f"mlx_lm.server's --host/--port: {problem} (another server there? choose another --port)"
        )


class _Preflight:
    """While active, ``server.run(host, port, model_provider)`` runs ``preflight`` first."""

    def __init__(self, server: Any, metrics: Any):
        self.server, self.metrics, self.original = server, metrics, None

    def __enter__(self):
        original = self.original = self.server.run

        @functools.wraps(original)
        def run(host, port, model_provider, *args, **kwargs):
            preflight(model_provider.cli_args, host, port, self.metrics)
            return original(host, port, model_provider, *args, **kwargs)

        self.server.run = run
        return self

    def __exit__(self, *exc):
        self.server.run = self.original
        return False


def run(args: argparse.Namespace, server_argv: Sequence[str]) -> int:
    """Run ``mlx_lm.server`` with ``server_argv`` in this process, watched as ``args`` say.

    Returns the exit status: 0 after a clean shutdown (Ctrl-C or SIGTERM), the server's own
    status when its argument parser exits. Raises ``UsageError`` (exit status 2 from the command
    line) when the metrics endpoint cannot start or ``preflight`` finds a problem."""
    options = watchdog_options(args)
    server_argv = [str(a) for a in server_argv]
    hooks = ServerHooks(options, adapt_prefill=getattr(args, "adapt_prefill", False))
    metrics = None
    if not getattr(args, "no_metrics", False):
        metrics = start_metrics(args)
        print(
            f"mlx-watchdog: metrics at {getattr(metrics, 'url', args.metrics_port)}",
            file=sys.stderr,
            flush=True,
        )
    saved_argv = sys.argv
    restore_signal = _terminate_as_interrupt()
    try:
        with hooks, _Preflight(hooks.server, metrics):
            sys.argv = [SERVER_PROG, *server_argv]
            # Before the server loads its model: the process count is then every buffer.
            start_early(options.get("process_count", "auto"))
            hooks.server.main()
        return 0
    except SystemExit as exc:  # mlx_lm.server's argument parser (e.g. --help, a bad option)
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the server's own loop caught it
        return 0
    finally:
        sys.argv = saved_argv
        restore_signal()
        if metrics is not None and hasattr(metrics, "close"):
            metrics.close()


def _terminate_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM and SIGINT stop the server like Ctrl-C does (mlx-lm shuts down on
    KeyboardInterrupt), whatever this process inherited: a shell starts a background job
    (``mlx-watchdog serve ... &`` in a script, a CI step) with SIGINT ignored, and Python then
    leaves it ignored, so ``kill -INT`` did nothing. Returns the function that puts the previous
    handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[signum] = signal.signal(signum, interrupt)
        except (ValueError, OSError):
            pass

    def restore() -> None:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler set outside Python, which cannot be put back
                signal.signal(signum, handler)

    return restore


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mlx_watchdog.serve [watchdog options] -- [mlx_lm.server arguments]``."""
    try:
        args, server_argv = parse_args(
            sys.argv[1:] if argv is None else argv, build_parser("python -m mlx_watchdog.serve")
        )
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return run(args, server_argv)
    except (UsageError, ValueError) as exc:
        print(f"{PROG} serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
