"""The flags ``serve`` and ``run`` share: the watchdog's options and the metrics endpoint's, and
the ``Watchdog`` keyword options they make."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..core.options import DEFAULT_METRICS_PORT, WatchdogOptions, checked_port, checked_process_count, flag
from .common import UsageError, fraction, port_number, positive_int, seconds, step_count

DEFAULT_METRICS_ADDR = "127.0.0.1"
# The flags' defaults are the Watchdog's own.
DEFAULTS: dict[str, Any] = {field.name: field.default for field in dataclasses.fields(WatchdogOptions)}
# The options the flags set.
FLAGGED = (
    "limit",
    "fix",
    "fix_every",
    "warn_within",
    "stop_within",
    "overhead_budget",
    "walk_interval",
    "process_count",
    "census",
)


def default_metrics_port() -> int:
    """The exporter's default (9464, plus the rank in a distributed job) when it is installed."""
    try:
        from ..exporters.server import default_metrics_port as exporter_default
    except ImportError:
        return DEFAULT_METRICS_PORT
    try:
        return exporter_default()
    except Exception:
        return DEFAULT_METRICS_PORT


# --process-count's words, and the Watchdog's values for them (--census's too).
PROCESS_COUNT: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
CENSUS = PROCESS_COUNT


def add_watchdog_arguments(group: Any, stop_help: str) -> None:
    """``--fix``, ``--fix-every``, ``--limit``, ``--warn-within``, ``--stop-within`` (``stop_help``
    says what a stop does), ``--overhead-budget``, ``--walk-interval``, ``--process-count``,
    ``--census``."""
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
    group.add_argument("--stop-within", type=step_count, default=None, metavar="STEPS", help=stop_help)
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
        "--process-count",
        choices=tuple(PROCESS_COUNT),
        default="auto",
        help="count MLX's live buffers in the whole process, at its allocator, so that a leak "
        "outside the model's caches is read too (as unattributed growth): auto (default) where "
        "its self-check passes, on (the same, a failure logged as a warning), off",
    )
    group.add_argument(
        "--census",
        choices=tuple(CENSUS),
        default="auto",
        help="look for the program's own objects that hold lazy arrays outside the model's caches "
        "(from the garbage collector's view, within a share of the overhead budget) and name them "
        "as leak sites outside:<module>.<Class>.<attribute>: auto (default: on unless "
        "MLX_WATCHDOG_CENSUS=off), on, off",
    )


def add_metrics_arguments(group: Any) -> None:
    """``--metrics-port``, ``--metrics-addr``, ``--no-metrics`` and the endpoint's TLS files."""
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
    group.add_argument(
        "--metrics-certfile",
        default=None,
        metavar="FILE",
        help="serve the metrics over HTTPS with this certificate (PEM; with --metrics-keyfile)",
    )
    group.add_argument(
        "--metrics-keyfile", default=None, metavar="FILE", help="the private key of --metrics-certfile (PEM)"
    )
    group.add_argument(
        "--metrics-client-cafile",
        default=None,
        metavar="FILE",
        help="with HTTPS, accept only scrapers whose client certificate this CA signed (mutual TLS)",
    )


def metrics_server_options(args: argparse.Namespace) -> dict[str, Any]:
    """``start_metrics_server``'s keyword options from the parsed metrics flags."""
    cafile = getattr(args, "metrics_client_cafile", None)
    return {
        "certfile": getattr(args, "metrics_certfile", None),
        "keyfile": getattr(args, "metrics_keyfile", None),
        "client_cafile": cafile,
        "client_auth_required": bool(cafile),
    }


def start_metrics(args: argparse.Namespace, **kwargs: Any) -> Any:
    """Start the metrics endpoint the flags describe (``kwargs``: more of ``start_metrics_server``'s
    options, e.g. its registry); ``UsageError`` naming the flags when it cannot start."""
    from ..exporters.server import start_metrics_server

    try:
        return start_metrics_server(
            args.metrics_port, addr=args.metrics_addr, **metrics_server_options(args), **kwargs
        )
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metrics-port/--metrics-addr: {exc} (or pass --no-metrics)") from exc


def watchdog_options(args: argparse.Namespace) -> dict:
    """The ``Watchdog`` keyword options from parsed arguments, checked as ``Watchdog`` checks them
    (``WatchdogOptions``). Raises ``ValueError`` naming the flag when a value is bad (for a
    Namespace built without the parser)."""
    if not getattr(args, "no_metrics", False):
        checked_port(getattr(args, "metrics_port", DEFAULT_METRICS_PORT), "--metrics-port")
        addr = getattr(args, "metrics_addr", DEFAULT_METRICS_ADDR)
        if not isinstance(addr, str) or not addr.strip():
            raise ValueError(f"--metrics-addr must be a host name or IP address, got {addr!r}")
    given = {name: getattr(args, name, DEFAULTS[name]) for name in FLAGGED}
    for name in ("process_count", "census"):  # an auto/on/off word, or a Watchdog value
        given[name] = _auto_on_off(given[name], flag(name))
    options = WatchdogOptions(**given, flags=True)
    return {name: getattr(options, name) for name in FLAGGED}


def _auto_on_off(value: Any, label: str) -> Any:
    """An auto/on/off flag's word (--process-count, --census) as the Watchdog's value; a bad
    word named as such (a Namespace built without the parser may hold a Watchdog value)."""
    if isinstance(value, str) and value in PROCESS_COUNT:
        return PROCESS_COUNT[value]
    try:
        return checked_process_count(value, label)
    except ValueError:
        raise ValueError(f"{label} must be one of auto, on, off, got {value!r}") from None
