"""Tests of mlx_watchdog.exporters.registration: one watchdog collector per registry, through
prometheus_client's public API alone (a registry that has nothing else is enough), and what
happens when the names are taken already."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog import Watchdog
from mlx_watchdog.core import live
from mlx_watchdog.exporters.collector import WatchdogCollector
from mlx_watchdog.exporters.exposition import make_wsgi_app
from mlx_watchdog.exporters.registration import names_taken, register_collector
from mlx_watchdog.exporters.schema import SPECS


class PublicRegistry:
    """A registry with prometheus_client's public methods only (``register``, ``unregister``,
    ``collect``): what the exporter may use of one."""

    def __init__(self) -> None:
        self.inner = CollectorRegistry()

    def register(self, collector) -> None:
        self.inner.register(collector)

    def unregister(self, collector) -> None:
        self.inner.unregister(collector)

    def collect(self):
        return self.inner.collect()


class Foreign:
    """Someone else's collector that exports one name of the watchdog's."""

    def __init__(self, name: str):
        self.name = name

    def collect(self):
        yield GaugeMetricFamily(self.name, "not the watchdog's", value=1.0)

    def describe(self):
        return list(self.collect())


def exposition(registry) -> dict[str, list]:
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.fixture
def wd():
    watchdog = Watchdog(name="reg-own", export=False)
    yield watchdog
    live.retire(watchdog)


def test_once_per_registry_through_the_public_api_alone():
    registry = PublicRegistry()
    first = register_collector(registry, max_sites=5)
    assert isinstance(first, WatchdogCollector) and first.max_sites == 5
    assert register_collector(registry) is first
    assert register_collector(registry, max_sites=7) is first and first.max_sites == 7
    shown = Watchdog(name="reg-public")
    try:
        steps = exposition(registry.inner)["mlx_watchdog_steps"]
        assert [s.labels["watchdog"] for s in steps].count("reg-public") == 1
    finally:
        live.retire(shown)


def test_a_collector_the_caller_registered_is_left_to_serve(wd, caplog):
    registry = PublicRegistry()
    own = WatchdogCollector([wd], max_sites=3)
    registry.register(own)
    with caplog.at_level(logging.WARNING, logger="mlx_watchdog"):
        assert register_collector(registry, max_sites=9) is None
    assert own.max_sites == 3 and "max_sites=9 is not applied" in caplog.text
    assert register_collector(registry) is None  # again: still the caller's
    make_wsgi_app(registry)  # what start_metrics_server(registry=...) does first: no error
    steps = exposition(registry.inner)["mlx_watchdog_steps"]
    assert [s.labels["watchdog"] for s in steps] == ["reg-own"]  # its watchdog, once


def test_another_collector_with_one_of_the_names_is_an_error_and_leaves_the_registry_as_it_was():
    registry = PublicRegistry()
    registry.register(Foreign("mlx_watchdog_resident_buffers"))
    with pytest.raises(ValueError, match="cannot register the mlx-watchdog collector"):
        register_collector(registry)
    # The names it tried are free again: nothing of the probes stayed registered.
    assert list(exposition(registry.inner)) == ["mlx_watchdog_resident_buffers"]
    registry.register(Foreign("mlx_watchdog_decoding"))
    assert sorted(exposition(registry.inner)) == ["mlx_watchdog_decoding", "mlx_watchdog_resident_buffers"]


def test_names_taken_reads_the_registry_without_changing_it():
    registry = CollectorRegistry()
    assert names_taken(registry, SPECS) == []
    foreign = Foreign("mlx_watchdog_steps_total")  # a counter's sample name
    registry.register(foreign)
    taken = names_taken(registry, SPECS)
    assert [spec.name for spec in taken] == ["mlx_watchdog_steps"]
    registry.unregister(foreign)
    registry.register(WatchdogCollector([]))  # every name is free again: the probes left nothing
    assert names_taken(registry, SPECS) == list(SPECS)
