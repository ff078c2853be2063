"""Prometheus exporter: the watchdogs' readings as metrics, built at scrape time.

    from mlx_watchdog.exporters.prometheus import start_metrics_server
    server = start_metrics_server(9464)          # http://127.0.0.1:9464/metrics

The public names, in one place; each has its module, after prometheus_client's own layout:
``schema`` (the metrics: names, types, help, labels), ``collector`` (``WatchdogCollector``, read
at scrape time), ``readings`` (MLX's memory, compiled functions, versions), ``process`` (the
``process_*`` metrics through psutil), ``registration`` (one collector per registry),
``exposition`` (option checks, the socket, TLS, the WSGI/ASGI apps), ``server`` (the metrics
server's lifecycle) and ``http`` (the bounded HTTP server itself).
"""

from .collector import DEFAULT_MAX_SITES, WatchdogCollector
from .exposition import make_asgi_app, make_wsgi_app
from .http import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEADER_BYTES
from .process import PsutilProcessCollector, register_process_collector
from .registration import register_collector
from .schema import OTHER_SITE, exposed_metric_names
from .server import DEFAULT_PORT, MetricsServer, default_metrics_port, start_metrics_server

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_SITES",
    "DEFAULT_PORT",
    "OTHER_SITE",
    "MetricsServer",
    "PsutilProcessCollector",
    "WatchdogCollector",
    "default_metrics_port",
    "exposed_metric_names",
    "make_asgi_app",
    "make_wsgi_app",
    "register_collector",
    "register_process_collector",
    "start_metrics_server",
]
