"""One watchdog collector per prometheus_client registry.

What this module registered is kept in its own record (registry -> collector). A registry whose
watchdog metrics a collector of the caller's serves already (``registry.register(
WatchdogCollector([...]))``, then ``start_metrics_server(registry=registry)``) is left as it is:
the registry refuses every one of the names, which is how it tells, through its public API.
"""

from __future__ import annotations

import logging
import threading
import weakref

from prometheus_client.registry import REGISTRY, CollectorRegistry

from .collector import WatchdogCollector
from .process import register_process_collector
from .schema import SPECS, MetricSpec

logger = logging.getLogger("mlx_watchdog")

_registered: weakref.WeakKeyDictionary[CollectorRegistry, WatchdogCollector] = weakref.WeakKeyDictionary()
_register_lock = threading.Lock()


def register_collector(
    registry: CollectorRegistry | None = None, *, max_sites: int | None = None
) -> WatchdogCollector | None:
    """Register one :class:`WatchdogCollector` (every live watchdog) on ``registry`` (default:
    prometheus_client's global ``REGISTRY``), once; later calls return the same collector.
    ``max_sites`` (default 20) bounds the site series per leak family and watchdog.

    Returns None, registering nothing, when a collector registered by the caller serves the
    watchdog metrics there already (set ``max_sites`` on that one); raises ``ValueError`` when
    another collector exports some of their names.

    On the global registry, where prometheus_client's process collector exports nothing (macOS:
    no ``/proc``), the standard ``process_*`` metrics are added from psutil."""
    registry = REGISTRY if registry is None else registry
    if not hasattr(registry, "register"):
        raise ValueError(
            f"registry must be a prometheus_client CollectorRegistry, got {type(registry).__name__}"
        )
    with _register_lock:
        collector = _registered.get(registry)
        if collector is None:
            if registry is REGISTRY:
                register_process_collector(registry)
            collector = WatchdogCollector()
            try:
                registry.register(collector)
            except ValueError as exc:  # duplicated names
                taken = names_taken(registry, SPECS)
                if len(taken) < len(SPECS):
                    raise ValueError(f"cannot register the mlx-watchdog collector: {exc}") from exc
                if max_sites is not None:
                    logger.warning(
                        "mlx-watchdog: the registry has a watchdog collector of its own; "
                        "max_sites=%r is not applied (set it on that collector)",
                        max_sites,
                    )
                return None
            _registered[registry] = collector
        if max_sites is not None:
            collector.max_sites = max_sites
        return collector


def names_taken(registry: CollectorRegistry, specs: tuple[MetricSpec, ...]) -> list[MetricSpec]:
    """The metrics of ``specs`` that a collector of ``registry`` exports already: each offered
    alone to the registry on a collector that exports nothing, withdrawn at once if accepted."""
    taken = []
    for spec in specs:
        probe = _Probe(spec)
        try:
            registry.register(probe)
        except ValueError:
            taken.append(spec)
        else:
            registry.unregister(probe)
    return taken


class _Probe:
    """Describes one metric, collects nothing (a scrape meanwhile sees nothing of it)."""

    def __init__(self, spec: MetricSpec):
        self.spec = spec

    def describe(self) -> list:
        return [self.spec.family(())]

    def collect(self) -> list:
        return []
