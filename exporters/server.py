"""The metrics server's lifecycle: started once per address and port (a table of the servers
running), closed to free the port; and the port each rank of a distributed job takes."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable

import mlx.core as mx
import prometheus_client
from prometheus_client.registry import REGISTRY, CollectorRegistry

from ..core.coordination import launch_rank
from ..core.live import live_watchdogs
from ..core.options import DEFAULT_METRICS_PORT
from ..core.watchdog import Watchdog
from .exposition import check_port, check_positive, check_tls, listen, tls_context
from .http import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEADER_BYTES, BoundedHTTPServer
from .registration import register_collector

logger = logging.getLogger("mlx_watchdog")

DEFAULT_PORT = DEFAULT_METRICS_PORT  # the port OpenTelemetry's Prometheus exporter uses by default


@dataclasses.dataclass
class MetricsServer:
    """A running metrics server (:class:`~mlx_watchdog.exporters.http.BoundedHTTPServer`)."""

    addr: str
    port: int  # the bound port (the one picked when 0 was asked for)
    server: BoundedHTTPServer
    thread: threading.Thread
    registry: CollectorRegistry
    tls: bool

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port."""
        with _servers_lock:
            for key in [k for k, v in _servers.items() if v is self]:
                del _servers[key]
        self.server.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_servers: dict[tuple[str, int], MetricsServer] = {}
_servers_lock = threading.Lock()


def start_metrics_server(
    port: int = DEFAULT_PORT,
    addr: str = "127.0.0.1",
    *,
    registry: CollectorRegistry | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    client_cafile: str | None = None,
    client_capath: str | None = None,
    client_auth_required: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_sites: int | None = None,
) -> MetricsServer:
    """Serve ``/metrics`` for every live watchdog on ``addr:port`` from a daemon thread.

    Once per process: a second call with the same ``addr`` and ``port`` returns the running
    server. ``port=0`` picks a free port (``.port`` tells which). Loopback by default; pass
    ``addr="0.0.0.0"`` to serve other machines. ``certfile``/``keyfile`` serve HTTPS;
    ``client_cafile``/``client_capath`` with ``client_auth_required=True`` also demand a client
    certificate signed by that CA (mutual TLS).

    The server uses two threads whatever the clients do: at most ``max_connections`` are kept
    open (one more closes the one idle the longest), a connection or TLS handshake silent for
    ``idle_timeout`` seconds is closed, request heads over ``max_header_bytes`` get 431.
    ``max_sites``: see :func:`register_collector`.

    Raises ``ValueError`` for bad arguments or an address that does not resolve, ``OSError``
    when the port cannot be bound (in use, not a local address, no permission); both name the
    address and port."""
    check_port("port", port)
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"addr must be a host name or IP address, got {addr!r}")
    check_positive("max_connections", max_connections, integer=True)
    check_positive("idle_timeout", idle_timeout)
    check_positive("max_header_bytes", max_header_bytes, integer=True)
    tls = check_tls(certfile, keyfile, client_cafile, client_capath, client_auth_required)
    where = f"{addr}:{port}"
    with _servers_lock:
        running = _servers.get((addr, port)) if port else None
        if running is not None:
            if (registry is not None and registry is not running.registry) or (tls and not running.tls):
                logger.warning(
                    "mlx-watchdog: a metrics server already runs on %s; the options of this "
                    "call (registry, TLS) are ignored",
                    where,
                )
            return running
        registry = REGISTRY if registry is None else registry
        context = (
            tls_context(where, certfile, keyfile, client_cafile, client_capath, client_auth_required)
            if tls
            else None
        )
        register_collector(registry, max_sites=max_sites)
        sock = listen(addr, port)
        server = BoundedHTTPServer(
            prometheus_client.make_wsgi_app(registry),
            sock,
            ssl_context=context,
            max_connections=max_connections,
            idle_timeout=float(idle_timeout),
            max_header_bytes=max_header_bytes,
            name=f"mlx-watchdog-metrics-{sock.getsockname()[1]}",
        )
        try:
            server.start()
        except BaseException:
            sock.close()
            raise
        bound = MetricsServer(addr, int(server.server_address[1]), server, server.thread, registry, tls)
        _servers[(addr, bound.port)] = bound
        logger.info("mlx-watchdog: metrics at %s", bound.url)
        return bound


# --------------------------------------------------------------------------- distributed


def default_metrics_port(base: int = DEFAULT_PORT) -> int:
    """``base + rank`` in a distributed MLX job (so ranks on one host do not clash), else ``base``.

    The rank comes from a live watchdog in a group of size > 1, else from the launcher's
    environment. ``mx.distributed.init()`` is never called: it is not a query. Launched, it joins
    the ring (blocking until every rank joins); not launched, it caches a size-1 group under a
    backend's name that a later explicit ``init(backend=...)`` would silently get."""
    check_port("base", base)
    if base == 0:
        return 0  # any free port: nothing to offset
    rank = _distributed_rank()
    if base + rank > 65535:
        raise ValueError(f"metrics port base {base} + rank {rank} is above 65535")
    return base + rank


def _distributed_rank() -> int:
    try:
        if not mx.distributed.is_available():
            return 0
    except Exception:
        return 0
    for wd in _safe_live():
        if _world_size(wd) > 1:
            return int(wd.rank)
    return launch_rank() or 0


def _safe_live() -> Iterable[Watchdog]:
    try:
        return live_watchdogs()
    except Exception:
        return []


def _world_size(wd: Watchdog) -> int:
    try:
        return int(wd.world_size)
    except Exception:
        return 1
