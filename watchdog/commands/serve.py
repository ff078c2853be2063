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
import inspect
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..attach.server import ServerHooks
from ..core.options import (
    checked_fraction,
    checked_port,
    checked_positive_int,
    checked_steps,
    checked_walk_interval,
)
from ..core.watchdog import Watchdog
from .common import (
    EXIT_USAGE,
    PROG,
    UsageError,
    fraction,
    local_model_problem,
    port_number,
    port_problem,
    positive_int,
    seconds,
    split_server_argv,
    step_count,
)

DEFAULT_METRICS_PORT = 9464
DEFAULT_METRICS_ADDR = "127.0.0.1"
# The flags' defaults are the Watchdog's own.
DEFAULTS = {name: p.default for name, p in inspect.signature(Watchdog).parameters.items()}
SERVER_PROG = "mlx_lm.server"


# --------------------------------------------------------------------------- arguments


def default_metrics_port() -> int:
    """The exporter's default (9464, plus the rank in a distributed job) when it is installed."""
    try:
        from ..exporters.prometheus import default_metrics_port as exporter_default
    except ImportError:
        return DEFAULT_METRICS_PORT
    try:
        return exporter_default()
    except Exception:
        return DEFAULT_METRICS_PORT


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the watchdog options of ``serve`` to ``parser`` (the server's own go after ``--``)."""
    group = parser.add_argument_group("watchdog")
    group.add_argument(
        "--fix",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="materialize the pending cache arrays every --fix-every decode steps "
        f"({DEFAULTS['fix_every']} unless set), cutting the lazy chains that leak "
        "buffers; default: --no-fix, only watch",
    )
    group.add_argument(
        "--fix-every",
        type=positive_int,
        default=DEFAULTS["fix_every"],
        metavar="N",
        help="run the fix every N decode steps (default: %(default)s)",
    )
    group.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="buffer limit to forecast against (default: the device's Metal resource limit, else 499000)",
    )
    group.add_argument(
        "--warn-within",
        type=step_count,
        default=None,
        metavar="STEPS",
        help="log a warning when the limit is forecast within STEPS decode steps",
    )
    group.add_argument(
        "--stop-within",
        type=step_count,
        default=None,
        metavar="STEPS",
        help='end the running requests (finish_reason "resource_limit") when the '
        "limit is forecast within STEPS decode steps; the server goes on",
    )
    group.add_argument(
        "--overhead-budget",
        type=fraction,
        default=DEFAULTS["overhead_budget"],
        metavar="FRACTION",
        help="share of the decode's wall time the watchdog may spend measuring "
        "(default: %(default)s); raise it on a busy machine to measure more often",
    )
    group.add_argument(
        "--walk-interval",
        type=seconds,
        default=DEFAULTS["walk_interval"],
        metavar="SECONDS",
        help="seconds of decode between two graph walks once a decode's first walks "
        "are done (default: 0.5, or longer where walks are dear, so that they "
        "take 0.1%% of decode time; 0: as often as the budget allows)",
    )
    group.add_argument(
        "--adapt-prefill",
        action="store_true",
        default=False,
        help="shrink the server's prefill chunks to what the watchdog measures as safe "
        "(needs mlx_watchdog.prefill)",
    )
    group.add_argument(
        "--metrics-port",
        type=port_number,
        default=default_metrics_port(),
        metavar="PORT",
        help="port of the Prometheus /metrics endpoint (default: %(default)s; 0 picks a free one)",
    )
    group.add_argument(
        "--metrics-addr",
        default=DEFAULT_METRICS_ADDR,
        metavar="ADDR",
        help="address the metrics endpoint binds (default: %(default)s, loopback only)",
    )
    group.add_argument("--no-metrics", action="store_true", default=False, help="do not serve metrics")
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


def watchdog_options(args: argparse.Namespace) -> dict:
    """The ``Watchdog`` keyword options from parsed arguments. Raises ``ValueError`` naming the
    option when a value is bad (for a Namespace built without the parser)."""

    def get(name, default=None):
        return getattr(args, name, default)

    limit = get("limit")
    if limit is not None:
        checked_positive_int(limit, "--limit")
    interval = checked_walk_interval(get("walk_interval", DEFAULTS["walk_interval"]), "--walk-interval")
    if not get("no_metrics", False):
        checked_port(get("metrics_port", DEFAULT_METRICS_PORT), "--metrics-port")
        addr = get("metrics_addr", DEFAULT_METRICS_ADDR)
        if not isinstance(addr, str) or not addr.strip():
            raise ValueError(f"--metrics-addr must be a host name or IP address, got {addr!r}")
    return {
        "limit": limit,
        "fix": bool(get("fix", False)),
        "fix_every": checked_positive_int(get("fix_every", DEFAULTS["fix_every"]), "--fix-every"),
        "warn_within": checked_steps(get("warn_within"), "--warn-within"),
        "stop_within": checked_steps(get("stop_within"), "--stop-within"),
        "overhead_budget": checked_fraction(
            get("overhead_budget", DEFAULTS["overhead_budget"]), "--overhead-budget"
        ),
        "walk_interval": interval,
    }


# --------------------------------------------------------------------------- running


def _start_metrics(args: argparse.Namespace):
    from ..exporters.prometheus import start_metrics_server

    try:
        return start_metrics_server(args.metrics_port, addr=args.metrics_addr)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metrics-port/--metrics-addr: {exc} (or pass --no-metrics)") from exc


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
        metrics = _start_metrics(args)
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
    """Make SIGTERM stop the server like Ctrl-C does (mlx-lm shuts down on KeyboardInterrupt).
    Returns the function that puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except (ValueError, OSError):
        return lambda: None

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

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
