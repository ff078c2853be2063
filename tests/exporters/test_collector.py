"""Tests of mlx_watchdog.exporters.collector: what a scrape reads (one ``Watchdog.snapshot()`` per
watchdog, taken under its lock) and which watchdogs it shows (the core's live set: retired,
hidden, inherited through fork)."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys
import textwrap
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog import Watchdog, live_watchdogs
from mlx_watchdog.core import live
from mlx_watchdog.core.snapshot import Snapshot
from mlx_watchdog.exporters.collector import WatchdogCollector


def scrape(collector: WatchdogCollector) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape of ``collector`` alone."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def names_shown() -> set[str]:
    """The ``watchdog`` labels a collector of every live watchdog exports now."""
    return {dict(labels).get("watchdog") for _, labels in scrape(WatchdogCollector())}


# --------------------------------------------------------------------------- the snapshot


def test_a_snapshot_is_taken_under_the_lock_a_stop_waits_for_it():
    wd = Watchdog(name="snap-lock", export=False)
    measured = dataclasses.replace(wd.forecast(), rate_known=True)  # a stop that is held
    recorder = threading.Thread(target=wd.record_stop, args=("forecast", measured))
    real_forecast = wd.forecast

    def forecast_while_a_stop_is_recorded():
        forecast = real_forecast()
        recorder.start()
        # Read under the lock, the stop cannot land before the snapshot's counters are read;
        # read apart, it would land here.
        recorder.join(timeout=1.0)
        return forecast

    wd.forecast = forecast_while_a_stop_is_recorded
    snap = wd.snapshot()
    recorder.join()
    assert (dict(snap.stops), dict(snap.last_stops), snap.held_stop) == ({}, {}, None)
    # The stop was recorded after it, all of it at once.
    del wd.forecast
    after = wd.snapshot()
    assert dict(after.stops) == {"forecast": 1}
    assert after.held_stop is after.last_stops["forecast"] is wd.held_stop


def test_a_snapshot_never_sees_half_a_stop():
    wd = Watchdog(name="snap-half", export=False)
    measured = dataclasses.replace(wd.forecast(), rate_known=True)
    taken: list[Snapshot] = []

    class Stops(collections.Counter):
        def __setitem__(self, reason, count):
            super().__setitem__(reason, count)
            # The stop is half recorded (its count, not yet its forecast): a snapshot now waits
            # for the rest; one read apart would be taken here.
            reader = threading.Thread(target=lambda: taken.append(wd.snapshot()))
            reader.start()
            reader.join(timeout=1.0)
            self.readers.append(reader)

    wd.stops = Stops()
    wd.stops.readers = []
    stop = wd.record_stop("forecast", measured)
    for reader in wd.stops.readers:
        reader.join()
    (snap,) = taken
    assert dict(snap.stops) == {"forecast": 1}
    assert snap.last_stops == {"forecast": stop} and snap.held_stop is stop


def test_a_snapshot_agrees_with_the_watchdog_and_is_frozen():
    wd = Watchdog(name="snap-parts", export=False, fix=True)
    wd.steps, wd.materialized_arrays, wd.fix_failures = 12, 3, 1
    wd.reclaimed_buffers = 2.5
    first = wd.record_stop("forecast")
    prefill = wd.record_stop("prefill")
    snap = wd.snapshot()
    assert snap.forecast is not None and snap.steps == snap.forecast.step == 12
    assert (snap.name, snap.fix, snap.rank, snap.world_size) == ("snap-parts", True, 0, 1)
    assert (snap.materialized_arrays, snap.fix_failures, snap.reclaimed_buffers) == (3, 1, 2.5)
    assert dict(snap.stops) == {"forecast": 1, "prefill": 1}
    assert dict(snap.last_stops) == {"forecast": first, "prefill": prefill}
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.steps = 13  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.stops["forecast"] = 2  # type: ignore[index]
    wd.record_stop("forecast")
    assert dict(snap.stops) == {"forecast": 1, "prefill": 1}  # a copy: later stops are not in it


def test_a_failed_forecast_gives_a_snapshot_without_one_and_counts_the_error():
    wd = Watchdog(name="snap-broken", export=False)
    wd.steps = 4

    def fail():
        raise RuntimeError("forecast failed")

    wd.forecast = fail
    snap = wd.snapshot()
    assert snap.forecast is None and snap.steps == 4
    assert snap.internal_errors == wd.internal_errors == 1  # counted before the counters were read


def test_the_collector_reads_the_snapshot_alone():
    wd = Watchdog(name="snap-read", export=False)
    real = wd.snapshot()
    assert real.forecast is not None
    crafted = dataclasses.replace(
        real,
        name="crafted",
        steps=41,
        internal_errors=3,
        reclaimed_buffers=7.0,
        stops={"forecast": 2, "prefill": 1},
        forecast=dataclasses.replace(real.forecast, resident_buffers=1234, pending_graph_nodes=99),
    )
    asked = []

    def snapshot() -> Snapshot:
        asked.append(1)
        return crafted

    def no_forecast():
        raise AssertionError("the collector reads the forecast through the snapshot only")

    wd.snapshot = snapshot
    wd.forecast = no_forecast
    wd.steps = 5  # what the watchdog says apart from its snapshot is not read
    got = scrape(WatchdogCollector([wd]))
    label = (("watchdog", "crafted"),)
    assert got[("mlx_watchdog_steps_total", label)] == 41
    assert got[("mlx_watchdog_internal_errors_total", label)] == 3
    assert got[("mlx_watchdog_reclaimed_buffers_total", label)] == 7
    assert got[("mlx_watchdog_resident_buffers", label)] == 1234
    assert got[("mlx_watchdog_pending_graph_nodes", label)] == 99
    assert got[("mlx_watchdog_stops_total", (("reason", "prefill"), ("watchdog", "crafted")))] == 1
    assert asked == [1] and wd.internal_errors == 0  # one snapshot a scrape; no forecast asked


# --------------------------------------------------------------------------- which watchdogs


def test_a_retired_watchdog_leaves_the_endpoint_and_stays_live():
    wd = Watchdog(name="live-retired")
    assert wd.export and "live-retired" in names_shown()
    live.retire(wd)
    assert not wd.export and "live-retired" not in names_shown()
    assert wd not in live_watchdogs() and wd in live_watchdogs(unexported=True)
    wd.steps += 1  # stepping does not bring a retired one back
    assert "live-retired" not in names_shown()
    wd.export = True  # asking does
    assert "live-retired" in names_shown()
    wd.export = False
    assert "live-retired" not in names_shown()
    with pytest.raises(ValueError, match="export"):
        wd.export = "yes"


def test_export_false_is_hidden_from_the_start():
    hidden, shown = Watchdog(name="live-hidden", export=False), Watchdog(name="live-shown")
    try:
        assert (hidden.export, shown.export) == (False, True)
        assert {"live-shown"} <= names_shown() and "live-hidden" not in names_shown()
        assert hidden in live_watchdogs(unexported=True)
    finally:
        live.retire(shown)


def test_inherited_watchdogs_are_hidden_until_they_step():
    registry = live.LiveSet()  # the process's own set is left alone
    stepping, still, retired, hidden = (Watchdog(export=False) for _ in range(4))
    for wd in (stepping, still, retired):
        registry.add(wd, shown=True)
    registry.add(hidden, shown=False)
    registry.hide_inherited()
    assert registry.watchdogs() == []
    assert len(registry.watchdogs(hidden=True)) == 4
    stepping.steps += 1
    registry.retire(retired)
    retired.steps += 1
    assert registry.watchdogs() == [stepping] and registry.shown(stepping)
    assert not registry.shown(still) and not registry.shown(retired) and not registry.shown(hidden)
    registry.show(still)  # asked for: shown, stepped or not
    assert set(registry.watchdogs()) == {stepping, still}


def test_a_forked_child_hides_what_it_inherited_from_a_parent_that_writes_snapshots(tmp_path):
    code = textwrap.dedent(
        f"""
        import os
        from mlx_watchdog import Watchdog, live_watchdogs
        from mlx_watchdog.exporters.processes import SnapshotWriter
        wd = Watchdog(name="forked")
        writer = SnapshotWriter({str(tmp_path)!r})  # not started: it exists, the child hides
        pid = os.fork()
        if pid == 0:
            hidden = wd not in live_watchdogs() and not wd.export
            wd.steps += 1
            print("child", hidden, wd in live_watchdogs() and wd.export, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", wd in live_watchdogs(), flush=True)
        writer.stop()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["child True True", "parent True"], done.stderr


def test_a_forked_child_lists_the_watchdogs_while_the_parent_was_listing_them():
    # A thread of the parent holds the live set's lock when the process forks (it reads an
    # inherited watchdog's steps, under the lock, and waits there): the child, where that thread
    # does not exist, lists the watchdogs all the same.
    code = textwrap.dedent(
        """
        import os, threading
        from mlx_watchdog import Watchdog, live_watchdogs
        from mlx_watchdog.core.live import hide_inherited

        inside, gate = threading.Event(), threading.Event()

        class Waiting(Watchdog):
            @property
            def steps(self):
                if threading.current_thread().name == "lister":
                    inside.set()
                    gate.wait()
                return self.counters.steps

            @steps.setter
            def steps(self, value):
                self.counters.steps = value

        wd = Waiting(name="waiting")
        hide_inherited()  # each listing now reads its steps under the lock
        lister = threading.Thread(target=live_watchdogs, name="lister")
        lister.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            print("child", [w.name for w in live_watchdogs(unexported=True)], flush=True)
            os._exit(0)
        gate.set()
        lister.join()
        os.waitpid(pid, 0)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["child ['waiting']"], done.stderr
