"""What the metrics server needs before it serves, and the apps that serve the metrics in a web
server of the program's own: the checks of its options, the TLS context, the listening socket
(with errors that name the address and port), prometheus_client's WSGI and ASGI apps."""

from __future__ import annotations

import errno
import math
import numbers
import socket
import ssl

import prometheus_client
from prometheus_client.registry import REGISTRY, CollectorRegistry

from .registration import register_collector


def make_wsgi_app(registry: CollectorRegistry | None = None, **options):
    """A WSGI app serving the metrics (prometheus_client's), with the collector registered.
    Mount it at ``/metrics`` in your own server. ``options`` go to prometheus_client."""
    registry = REGISTRY if registry is None else registry
    register_collector(registry)
    return prometheus_client.make_wsgi_app(registry, **options)


def make_asgi_app(registry: CollectorRegistry | None = None, **options):
    """An ASGI app serving the metrics (prometheus_client's), with the collector registered."""
    registry = REGISTRY if registry is None else registry
    register_collector(registry)
    return prometheus_client.make_asgi_app(registry, **options)


def listen(addr: str, port: int) -> socket.socket:
    """A listening socket on addr:port (the first address it resolves to), or a clear error."""
    where = f"{addr}:{port}"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ValueError(
            f"mlx-watchdog metrics server: address {addr!r} (port {port}) is not a "
            f"host name or IP address of this machine: {exc}"
        ) from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"mlx-watchdog metrics server: cannot listen on {where}: {_bind_hint(exc, port)}"
        ) from exc
    return sock


def check_positive(label: str, value, integer: bool = False) -> None:
    """``ValueError`` naming ``label`` unless ``value`` is a positive (finite) number or integer."""
    kind = numbers.Integral if integer else numbers.Real
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or value <= 0
        or (not integer and not math.isfinite(value))  # NaN too
    ):
        raise ValueError(f"{label} must be a positive {'integer' if integer else 'number'}, got {value!r}")


def check_port(label: str, port) -> None:
    """``ValueError`` naming ``label`` unless ``port`` is a port number (0: any free port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{label} must be an integer from 0 to 65535 (0 picks a free port), got {port!r}")


def check_tls(certfile, keyfile, client_cafile, client_capath, client_auth_required) -> bool:
    """Whether the options ask for TLS; ``ValueError`` for a combination that cannot work."""
    if bool(certfile) != bool(keyfile):
        # prometheus_client silently serves plain HTTP when only one is given.
        raise ValueError(
            f"TLS needs both certfile and keyfile (got certfile={certfile!r}, keyfile={keyfile!r})"
        )
    tls = bool(certfile)
    if not tls and (client_cafile or client_capath or client_auth_required):
        raise ValueError(
            "client certificate options (client_cafile, client_capath, "
            "client_auth_required) need TLS: pass certfile and keyfile too"
        )
    if client_auth_required and not (client_cafile or client_capath):
        raise ValueError(
            "client_auth_required=True needs client_cafile or client_capath: the CA "
            "that signs the client certificates to accept"
        )
    return tls


def tls_context(where, certfile, keyfile, cafile, capath, client_auth_required) -> ssl.SSLContext:
    """The server's TLS context, loaded before binding so that a bad file leaves no port open."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(certfile=certfile, keyfile=keyfile)
        if cafile or capath:
            context.load_verify_locations(cafile, capath)
            context.verify_mode = ssl.CERT_REQUIRED if client_auth_required else ssl.CERT_OPTIONAL
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"mlx-watchdog metrics server on {where}: cannot load the TLS files "
            f"(certfile={certfile!r}, keyfile={keyfile!r}, client_cafile={cafile!r}, "
            f"client_capath={capath!r}): {exc}"
        ) from exc
    return context


def _bind_hint(exc: OSError, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} is already in use (another exporter or server?); choose another "
            "metrics port, or 0 for a free one"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return "the address is not one of this machine's"
    if exc.errno == errno.EACCES:
        return f"permission denied (ports below 1024 need privileges): {exc.strerror}"
    return exc.strerror or str(exc)
