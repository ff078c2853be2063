"""The collector: the watchdogs' state as metric families, built when Prometheus scrapes.

It follows prometheus_client's custom-collector pattern: nothing runs on the decode thread. Each
scrape (on the HTTP server's thread) takes one ``Watchdog.snapshot()`` of each watchdog, which
holds the watchdog's lock for a few microseconds, and builds its samples from that alone.

Every series carries a ``watchdog`` label (``Watchdog(name=...)``, else the model's type, else
``default``) and, in a distributed job (``world_size > 1``), a ``rank`` label.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import threading
import weakref
from collections.abc import Iterator, Sequence

from ..core.live import live_watchdogs
from ..core.snapshot import Snapshot
from ..core.watchdog import Watchdog
from .readings import compiled_rows, read_compiled, read_memory, read_static
from .schema import OTHER_SITE, SPECS, STOP_REASONS

logger = logging.getLogger("mlx_watchdog")

DEFAULT_MAX_SITES = 20  # site series per leak family and watchdog, "other" included


class WatchdogCollector:
    """A prometheus_client collector: ``collect()`` builds the metric families from the
    watchdogs' state when Prometheus scrapes.

    ``watchdogs=None`` exports every live watchdog created with ``export=True`` (looked up at each
    scrape); a sequence exports exactly those. Two watchdogs with the same name and rank would
    produce duplicate series, so a later one is exported as ``name-2``, ``name-3`` (with a
    warning); name your watchdogs ``Watchdog(name=...)`` to choose."""

    _max_sites: int

    def __init__(self, watchdogs: Sequence[Watchdog] | None = None, *, max_sites: int = DEFAULT_MAX_SITES):
        self.max_sites = max_sites  # checked by the property
        if watchdogs is not None:
            watchdogs = list(watchdogs)
            for wd in watchdogs:
                if not isinstance(wd, Watchdog):
                    raise ValueError(f"WatchdogCollector takes Watchdog objects, got {type(wd).__name__}")
        self._watchdogs = watchdogs
        self._lock = threading.Lock()  # scrapes may run on several server threads at once
        # watchdog -> (its name, its label) as last exported; entries go with the watchdogs
        self._labels: weakref.WeakKeyDictionary[Watchdog, tuple[str, str]] = weakref.WeakKeyDictionary()
        # watchdog -> {family: the sites last exported}; a site that stops leaking stays at 0
        self._known_sites: weakref.WeakKeyDictionary[Watchdog, dict] = weakref.WeakKeyDictionary()
        self._static: dict[str, str] | None = None

    @property
    def max_sites(self) -> int:
        """Site series per leak family and watchdog, ``site="other"`` included (at least 2)."""
        return self._max_sites

    @max_sites.setter
    def max_sites(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 2:
            raise ValueError(
                f'max_sites must be an integer of at least 2 (the top sites plus one "other"), got {value!r}'
            )
        self._max_sites = int(value)

    def describe(self) -> list:
        # The names are fixed even though the watchdogs are not: the registry can check clashes.
        return [spec.family(()) for spec in SPECS]

    def collect(self) -> Iterator:
        snapshots: dict[Watchdog, Snapshot] = {}
        for wd in dict.fromkeys(self._current_watchdogs()):  # each once
            try:
                snapshots[wd] = wd.snapshot()
            except Exception as exc:  # it says it never raises; a subclass may
                _count_error(wd, exc)
        label_of = self._assign_labels(snapshots)
        with_rank = any(snap.world_size > 1 for snap in snapshots.values())
        base = ("watchdog", "rank") if with_rank else ("watchdog",)
        families = {spec.name: spec.family(base) for spec in SPECS}
        memory = read_memory() if snapshots else {}
        static = self._static_labels() if snapshots else {}
        functions = read_compiled(self.max_sites) if snapshots else []
        for wd, snap in snapshots.items():
            labels = (label_of[wd],) + ((str(snap.rank),) if with_rank else ())  # this process's rank
            try:
                rows = self._rows(wd, snap, labels, memory, static)
                if rows:
                    rows += compiled_rows(functions, labels)
            except Exception as exc:  # one broken watchdog must not break the scrape
                _count_error(wd, exc)
                rows = []
            if not rows:
                # Its counters still go out: an alert on internal errors sees a watchdog whose
                # forecast fails, instead of its series vanishing with the failure.
                rows = _counter_rows(snap, labels)
            for name, row_labels, value in rows:
                families[name].add_metric(row_labels, value)
        yield from families.values()

    # ------------------------------------------------------------------ helpers

    def _current_watchdogs(self) -> list[Watchdog]:
        if self._watchdogs is not None:
            return list(self._watchdogs)
        try:
            return live_watchdogs()
        except Exception as exc:
            logger.warning("mlx-watchdog exporter: cannot list the live watchdogs: %r", exc)
            return []

    def _rows(self, wd: Watchdog, snap: Snapshot, base: tuple, memory: dict, static: dict) -> list[tuple]:
        """All samples of one watchdog, built before any is added (all or none); none without a
        forecast."""
        f = snap.forecast
        if f is None:
            return []
        held = snap.held_stop
        # What grows now: nothing while nothing steps (no alert pages for an idle server), and
        # nothing known before it was measured (NaN: no "0/step" that would read as no leak).
        # After a stop, until a new reading measures the growth, the forecast that caused it.
        shown = f
        if held is not None:
            stopped = held.forecast
            per_step, steps_left, seconds_left, unattributed = (
                stopped.buffers_per_step,
                stopped.steps_to_limit,
                stopped.seconds_to_limit,
                stopped.unattributed_buffers_per_step,
            )
            shown = dataclasses.replace(f, leaks=stopped.leaks, decoding=True, rate_known=True)
        elif not f.rate_known:
            per_step = steps_left = seconds_left = unattributed = math.nan
        elif not f.decoding:
            per_step, steps_left, seconds_left, unattributed = 0.0, math.inf, math.inf, 0.0
        else:
            per_step, steps_left, seconds_left = f.buffers_per_step, f.steps_to_limit, f.seconds_to_limit
            unattributed = f.unattributed_buffers_per_step
        rows: list[tuple[str, tuple, float]] = [
            ("mlx_watchdog_resident_buffers", base, f.resident_buffers),
            ("mlx_watchdog_peak_resident_buffers", base, f.peak_resident_buffers),
            ("mlx_watchdog_resource_limit_buffers", base, f.limit),
            ("mlx_watchdog_buffers_per_step", base, per_step),
            ("mlx_watchdog_steps_to_limit", base, steps_left),
            ("mlx_watchdog_time_to_limit_seconds", base, seconds_left),
            ("mlx_watchdog_rate_known", base, int(shown.rate_known)),
            ("mlx_watchdog_decoding", base, int(f.decoding)),
            ("mlx_watchdog_stop_forecast_held", base, int(held is not None)),
            ("mlx_watchdog_pending_graph_nodes", base, f.pending_graph_nodes),
            ("mlx_watchdog_unattributed_buffers_per_step", base, unattributed),
        ]
        rows += self._site_rows(wd, shown, base)
        rows += self._stop_rows(snap, base)
        for name, reading in (
            ("mlx_watchdog_prefill_graph_nodes", f.prefill_graph_nodes),
            ("mlx_watchdog_max_safe_prefill_tokens", f.max_safe_prefill_tokens),
        ):
            if reading is not None:
                rows.append((name, base, reading))
        rows += [(name, base, value) for name, value in memory.items()]
        info = (
            static["version"],
            static["mlx_version"],
            static["mlx_lm_version"],
            static["device"],
            static["backend"],
            "true" if snap.fix else "false",
        )
        rows.append(("mlx_watchdog_info", base + info, 1))
        rows += [
            ("mlx_watchdog_steps", base, snap.steps),
            ("mlx_watchdog_materialized_arrays", base, snap.materialized_arrays),
            ("mlx_watchdog_fix_failures", base, snap.fix_failures),
            ("mlx_watchdog_reclaimed_buffers", base, snap.reclaimed_buffers),
            ("mlx_watchdog_overhead_seconds", base, snap.overhead_seconds),
            ("mlx_watchdog_internal_errors", base, snap.internal_errors),
        ]
        stops = dict.fromkeys(STOP_REASONS, 0)
        stops.update(snap.stops)
        rows += [("mlx_watchdog_stops", base + (str(reason),), n) for reason, n in sorted(stops.items())]
        for name, _, value in rows:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name}: not a number: {value!r}")
        return [(name, labels, float(value)) for name, labels, value in rows]

    def _site_rows(self, wd: Watchdog, f, base: tuple) -> list[tuple]:
        """The two leak families, at most ``max_sites`` series each: the largest sites by buffers
        per step, the rest summed into ``site="other"``. Sites of the same label are summed, so a
        label that stands for several sites is one series. A site exported before that leaks no
        more reads 0 (as long as it fits under the cap) instead of vanishing, so that an alert
        sees it stop."""
        rows, folded = [], 0
        with self._lock:
            known = self._known_sites.setdefault(wd, {})
            for name, cut in (
                ("mlx_watchdog_leak_buffers_per_step", False),
                ("mlx_watchdog_fixed_leak_buffers_per_step", True),
            ):
                by_site: dict[str, float] = {}
                for leak in f.leaks:
                    if bool(leak.cut) == cut:
                        site = str(leak.site)
                        by_site[site] = by_site.get(site, 0.0) + float(leak.buffers_per_step)
                ranked, count = fold(by_site, self.max_sites)
                folded += count
                # Sites that leaked before and no longer do: 0, in the room the cap leaves.
                gone = [site for site in known.get(name, ()) if site not in by_site]
                ranked += [(site, 0.0) for site in gone[: max(0, self.max_sites - len(ranked))]]
                known[name] = dict.fromkeys(site for site, _ in ranked)
                # Not decoding, nothing grows now: the sites stay, at 0 (no alert for an idle server).
                rows += [(name, base + (site,), v if f.decoding else 0.0) for site, v in ranked]
        rows.append(("mlx_watchdog_folded_leak_sites", base, folded))
        # Bounded sites: the biggest peaks, as many as the cap allows (no "other": they add no steps).
        peaks: dict[str, float] = {}
        for site in f.bounded:
            peaks[str(site.site)] = max(peaks.get(str(site.site), 0.0), float(site.peak_buffers))
        ranked = sorted(peaks.items(), key=lambda kv: (-kv[1], kv[0]))[: self.max_sites]
        rows += [("mlx_watchdog_bounded_site_peak_buffers", base + (site,), v) for site, v in ranked]
        return rows

    def _stop_rows(self, snap: Snapshot, base: tuple) -> list[tuple]:
        """The last stop of each reason: when, the steps to the limit it forecast and its leak
        sites (the largest ``max_sites - 1`` by buffers per step, the rest summed into "other")."""
        rows: list[tuple] = []
        for reason, stop in sorted(snap.last_stops.items()):
            labels = base + (str(reason),)
            rows.append(("mlx_watchdog_last_stop_timestamp_seconds", labels, stop.time))
            rows.append(("mlx_watchdog_last_stop_steps_to_limit", labels, stop.forecast.steps_to_limit))
            by_site: dict[str, float] = {}
            for leak in stop.forecast.leaks:
                if not leak.cut:
                    by_site[str(leak.site)] = by_site.get(str(leak.site), 0.0) + float(leak.buffers_per_step)
            ranked, _ = fold(by_site, self.max_sites)
            rows += [
                ("mlx_watchdog_last_stop_leak_buffers_per_step", labels + (site,), v) for site, v in ranked
            ]
        return rows

    def _assign_labels(self, snapshots: dict[Watchdog, Snapshot]) -> dict[Watchdog, str]:
        """The ``watchdog`` label of each: its name, made unique among this scrape's watchdogs of
        the same rank. A watchdog keeps the label it had while its name stays the same, so its
        series do not change identity between scrapes."""
        with self._lock:
            labels, used, fresh = {}, set(), []
            for wd, snap in snapshots.items():
                name, rank = _name_and_rank(snap)
                known = self._labels.get(wd)
                if known is not None and known[0] == name and (known[1], rank) not in used:
                    labels[wd] = known[1]
                    used.add((known[1], rank))
                else:
                    fresh.append(wd)
            for wd in fresh:
                name, rank = _name_and_rank(snapshots[wd])
                label, n = name, 1
                while (label, rank) in used:
                    n += 1
                    label = f"{name}-{n}"
                if label != name:
                    logger.warning(
                        "mlx-watchdog exporter: two watchdogs are named %r; exporting %r as "
                        "watchdog=%r (set Watchdog(name=...) to choose)",
                        name,
                        wd,
                        label,
                    )
                labels[wd] = label
                used.add((label, rank))
                self._labels[wd] = (name, label)
            return labels

    def _static_labels(self) -> dict[str, str]:
        if self._static is None:  # versions and device do not change while the process runs
            self._static = read_static()
        return self._static


def fold(by_site: dict[str, float], max_sites: int) -> tuple[list[tuple[str, float]], int]:
    """The sites by buffers per step, largest first, at most ``max_sites``: past the cap, the
    largest ``max_sites - 1`` and "other" with the sum of the rest; and how many were folded."""
    ranked = sorted(by_site.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(ranked) <= max_sites:
        return ranked, 0
    kept, rest = ranked[: max_sites - 1], ranked[max_sites - 1 :]
    other = sum(v for _, v in rest) + dict(kept).get(OTHER_SITE, 0.0)
    return [(site, v) for site, v in kept if site != OTHER_SITE] + [(OTHER_SITE, other)], len(rest)


def _counter_rows(snap: Snapshot, base: tuple) -> list[tuple]:
    """What a watchdog whose forecast fails still exports: its step and error counters."""
    rows: list[tuple] = []
    for name, value in (
        ("mlx_watchdog_steps", snap.steps),
        ("mlx_watchdog_internal_errors", snap.internal_errors),
    ):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            rows.append((name, base, float(value)))
    return rows


def _name_and_rank(snap: Snapshot) -> tuple[str, int]:
    return str(snap.name), (snap.rank if snap.world_size > 1 else 0)


def _count_error(wd: Watchdog, exc: Exception) -> None:
    try:
        wd.record_internal_error("prometheus exporter", exc)
    except Exception:
        logger.warning("mlx-watchdog exporter: skipped watchdog %r: %r", wd, exc)
