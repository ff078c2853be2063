"""The standard ``process_*`` metrics through psutil, where prometheus_client's own process
collector exports nothing (macOS: no ``/proc``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import CollectorRegistry

logger = logging.getLogger("mlx_watchdog")


class PsutilProcessCollector:
    """The standard process metrics (the names prometheus_client's ``ProcessCollector`` exports
    from ``/proc`` on Linux) read through psutil, for platforms without ``/proc``."""

    def describe(self) -> list:
        # The names, whether psutil reads them here or not: the registry refuses a second exporter.
        return list(_families())

    def collect(self) -> Iterator:
        try:
            import psutil

            process = psutil.Process(os.getpid())  # a forked child reads itself
            with process.oneshot():
                memory, cpu, started = process.memory_info(), process.cpu_times(), process.create_time()
                fds = process.num_fds() if hasattr(process, "num_fds") else None
        except Exception as exc:
            logger.debug("mlx-watchdog: psutil process metrics unavailable: %r", exc)
            return
        vms, rss, start, seconds, open_fds = _families()
        vms.add_metric([], memory.vms)
        rss.add_metric([], memory.rss)
        start.add_metric([], started)
        seconds.add_metric([], cpu.user + cpu.system)
        yield from (vms, rss, start, seconds)
        if fds is not None:
            open_fds.add_metric([], fds)
            yield open_fds


def _families() -> tuple[
    GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily, GaugeMetricFamily
]:
    return (
        GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes."),
        GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes."),
        GaugeMetricFamily(
            "process_start_time_seconds", "Start time of the process since unix epoch in seconds."
        ),
        CounterMetricFamily(
            "process_cpu_seconds", "Total user and system CPU time spent in seconds.", unit="seconds"
        ),
        GaugeMetricFamily("process_open_fds", "Number of open file descriptors."),
    )


def register_process_collector(registry: CollectorRegistry, probe=None) -> PsutilProcessCollector | None:
    """Add :class:`PsutilProcessCollector` to ``registry`` when the process collector there
    (``probe``, default prometheus_client's ``PROCESS_COLLECTOR``) exports nothing and no other
    collector exports the standard process metrics; returns it, or None when not needed."""
    probe = prometheus_client.PROCESS_COLLECTOR if probe is None else probe
    try:
        if any(family.samples for family in probe.collect()):
            return None  # /proc is there: the standard collector does it
        collector = PsutilProcessCollector()
        try:
            registry.register(collector)
        except ValueError:  # another collector exports those names: it does the job
            return None
        return collector
    except Exception as exc:  # never a reason not to export the watchdogs
        logger.debug("mlx-watchdog: no psutil process metrics: %r", exc)
        return None
