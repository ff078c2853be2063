"""Tests of mlx_watchdog.exporters.process: the standard process metrics through psutil, added
only where nothing else exports them (told by the registry's public API)."""

from __future__ import annotations

import os

import psutil
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog.exporters.process import PsutilProcessCollector, register_process_collector


class NoProc:
    """prometheus_client's process collector where there is no /proc: nothing."""

    def collect(self):
        return []


class OpenFiles:
    """Someone else's collector of one of the standard names."""

    def collect(self):
        yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=3.0)

    def describe(self):
        return list(self.collect())


def values(registry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_added_once_where_nothing_exports_the_process_metrics():
    registry = CollectorRegistry()
    added = register_process_collector(registry, probe=NoProc())
    assert isinstance(added, PsutilProcessCollector)
    assert register_process_collector(registry, probe=NoProc()) is None  # the names are taken now
    got = values(registry)
    process = psutil.Process(os.getpid())
    assert got["process_start_time_seconds"] == process.create_time()
    assert got["process_virtual_memory_bytes"] > 0 and got["process_resident_memory_bytes"] > 0
    assert got["process_cpu_seconds_total"] > 0


def test_not_added_beside_a_collector_of_one_of_the_names():
    registry = CollectorRegistry()
    registry.register(OpenFiles())
    assert register_process_collector(registry, probe=NoProc()) is None
    assert values(registry) == {"process_open_fds": 3.0}  # nothing else was added


def test_the_names_are_described_even_where_psutil_reads_nothing(monkeypatch):
    monkeypatch.setattr(psutil, "Process", lambda pid: (_ for _ in ()).throw(psutil.AccessDenied(pid)))
    collector = PsutilProcessCollector()
    assert list(collector.collect()) == []
    assert {f.name for f in collector.describe()} == {
        "process_virtual_memory_bytes",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_cpu_seconds",
        "process_open_fds",
    }
