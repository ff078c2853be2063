"""Prometheus exporter: the watchdogs' readings as metrics, built at scrape time.

    from mlx_watchdog.exporters.prometheus import start_metrics_server
    server = start_metrics_server(9464)          # http://127.0.0.1:9464/metrics

The exporter follows prometheus_client's custom-collector pattern: nothing runs on the decode
thread. Each scrape (on the HTTP server's thread) calls ``Watchdog.forecast()``, which holds the
watchdog's lock for a few microseconds, and reads its plain counters.

Every series carries a ``watchdog`` label (``Watchdog(name=...)``, else the model's type, else
``default``) and, in a distributed job (``world_size > 1``), a ``rank`` label.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import logging
import math
import numbers
import os
import socket
import ssl
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence

import mlx.core as mx
import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, CollectorRegistry

from .. import __version__
from ..core import compiled
from ..core.coordination import launch_rank
from ..core.limits import backend, device_name
from ..core.options import DEFAULT_METRICS_PORT
from ..core.watchdog import Watchdog, live_watchdogs
from .http import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEADER_BYTES, BoundedHTTPServer

logger = logging.getLogger("mlx_watchdog")

DEFAULT_PORT = DEFAULT_METRICS_PORT  # the port OpenTelemetry's Prometheus exporter uses by default
DEFAULT_MAX_SITES = 20  # site series per leak family and watchdog, "other" included
OTHER_SITE = "other"  # the site label of the sum of the sites past max_sites


@dataclasses.dataclass(frozen=True)
class _Spec:
    name: str  # family name, without the counter's "_total"
    kind: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...] = ()  # labels besides watchdog/rank
    unit: str = ""  # OpenMetrics UNIT metadata; the name already ends with it

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


# The names are a contract: the Grafana dashboard and the alert rules query them.
_SPECS = (
    _Spec(
        "mlx_watchdog_resident_buffers",
        "gauge",
        "Buffers (device allocations held by MLX arrays) estimated alive now: model parameters, "
        "cache arrays and the buffers that pending lazy graphs keep alive.",
    ),
    _Spec(
        "mlx_watchdog_peak_resident_buffers",
        "gauge",
        "Buffers resident at the peaks of the sawtooth of sites the program cuts itself (a "
        "program that evaluates its cache state every N steps): resident_buffers plus what those "
        "sites hold at their peaks beyond now. The steps to the limit count from it.",
    ),
    _Spec(
        "mlx_watchdog_resource_limit_buffers",
        "gauge",
        "The buffer limit the forecast counts against: the configured one, else the device's "
        "(Metal's resource_limit), else 499000. On Metal a process that allocates past Metal's "
        "limit crashes; the other backends have no buffer-count limit (see mlx_watchdog_info's backend).",
    ),
    _Spec(
        "mlx_watchdog_buffers_per_step",
        "gauge",
        "Net growth of resident buffers per decode step now; 0 when flat or not decoding, above 0 "
        "means a leak, NaN until measured (see mlx_watchdog_rate_known).",
    ),
    _Spec(
        "mlx_watchdog_steps_to_limit",
        "gauge",
        "Decode steps left until resident buffers reach the limit at the current growth "
        "(+Inf when not growing or not decoding, NaN until measured).",
    ),
    _Spec(
        "mlx_watchdog_time_to_limit_seconds",
        "gauge",
        "Seconds left until resident buffers reach the limit at the current growth and step rate "
        "(+Inf when not growing or not decoding, NaN until measured).",
        unit="seconds",
    ),
    _Spec(
        "mlx_watchdog_rate_known",
        "gauge",
        "1 once the growth per step has been measured on the caches alive now, 0 before: "
        "buffers_per_step and the time to the limit are then NaN, not a reading of no leak.",
    ),
    _Spec(
        "mlx_watchdog_decoding",
        "gauge",
        "1 while decode steps are observed, 0 when none came for a few seconds or the "
        "generation ended (resident buffers still held stay in resident_buffers).",
    ),
    _Spec(
        "mlx_watchdog_stop_forecast_held",
        "gauge",
        "1 while buffers_per_step, steps_to_limit, time_to_limit_seconds, rate_known and the leak "
        "site series read the forecast of the last stop: a stop ends the caches that grew, and the "
        "forecast that caused it stays until a reading taken on a decode step since measures the "
        "growth again. 0 otherwise.",
    ),
    _Spec(
        "mlx_watchdog_last_stop_timestamp_seconds",
        "gauge",
        "When the watchdog last stopped a generation before the limit, by reason (seconds since the "
        "Unix epoch); absent before the first stop of that reason.",
        ("reason",),
        unit="seconds",
    ),
    _Spec(
        "mlx_watchdog_last_stop_steps_to_limit",
        "gauge",
        "Decode steps to the limit forecast by the last stop of each reason, when it stopped (+Inf "
        "when its forecast saw no growth: a prefill stop).",
        ("reason",),
    ),
    _Spec(
        "mlx_watchdog_last_stop_leak_buffers_per_step",
        "gauge",
        "Buffers per decode step of each leaking site that nothing repairs, in the forecast of the "
        'last stop of each reason; site="other" sums the sites past the exporter\'s max_sites.',
        ("reason", "site"),
    ),
    _Spec(
        "mlx_watchdog_pending_graph_nodes",
        "gauge",
        "Unevaluated (lazy) graph nodes hanging off the watched cache at the last measurement.",
    ),
    _Spec(
        "mlx_watchdog_leak_buffers_per_step",
        "gauge",
        "Buffers per decode step added by one leaking site that nothing repairs; site is the "
        'class and attribute that holds them, e.g. ArraysCache.left_padding; site="other" sums '
        "the sites past the exporter's max_sites.",
        ("site",),
    ),
    _Spec(
        "mlx_watchdog_fixed_leak_buffers_per_step",
        "gauge",
        "Buffers per decode step a leaking site would add, which the fix cuts (Watchdog(fix=True)): "
        'the leak is there, the fix repairs it; site="other" as for the unrepaired ones.',
        ("site",),
    ),
    _Spec(
        "mlx_watchdog_unattributed_buffers_per_step",
        "gauge",
        "Buffers per decode step the whole process grows beyond what the named leak sites add: a "
        "leak outside the caches the watchdog reads (a server's own per-step outputs kept lazily, "
        "a compiled function's entry per input shape). Read from a count of the whole process "
        "(Watchdog(process_count=...)); 0 without one, NaN until measured.",
    ),
    _Spec(
        "mlx_watchdog_bounded_site_peak_buffers",
        "gauge",
        "Buffers a bounded site holds at its peak: a site whose chains the program itself cuts "
        "now and then (it evaluates its cache state every N steps) and whose peaks do not grow. "
        "A sawtooth, no leak: it costs headroom, not steps. One series per such site now.",
        ("site",),
    ),
    _Spec(
        "mlx_watchdog_folded_leak_sites",
        "gauge",
        'Leak sites summed into the site="other" series of the two leak families at this scrape '
        "(0 while every site has its own series; the exporter's max_sites bounds them).",
    ),
    _Spec(
        "mlx_watchdog_compiled_signatures",
        "gauge",
        "Input signatures (array shapes and dtypes, other arguments) a function compiled with "
        "mx.compile keeps a cache entry for, one series per function (the most signatures first, "
        "at most the exporter's max_sites); process-wide, the same on every watchdog of the "
        'process. A count that keeps growing is a leak: site="compiled:<function>" of '
        "mlx_watchdog_leak_buffers_per_step.",
        ("function",),
    ),
    _Spec(
        "mlx_watchdog_compiled_entry_buffers",
        "gauge",
        "Buffers one cache entry of a compiled function keeps (the constants of its traced "
        "graph), measured on its traces; process-wide. Times its signatures: what its cache holds.",
        ("function",),
    ),
    _Spec(
        "mlx_watchdog_prefill_graph_nodes",
        "gauge",
        "Lazy graph nodes of the last multi-token (prefill) forward pass.",
    ),
    _Spec(
        "mlx_watchdog_max_safe_prefill_tokens",
        "gauge",
        "Largest prefill chunk in tokens whose lazy graph stays within the buffer limit.",
    ),
    _Spec(
        "mlx_watchdog_memory_active_bytes",
        "gauge",
        "Memory in bytes held by live MLX arrays (mx.get_active_memory); process-wide, the same "
        "value on every watchdog of the process.",
        unit="bytes",
    ),
    _Spec(
        "mlx_watchdog_memory_peak_bytes",
        "gauge",
        "Highest MLX active memory in bytes since the process started or the peak was reset "
        "(mx.get_peak_memory); process-wide.",
        unit="bytes",
    ),
    _Spec(
        "mlx_watchdog_memory_cache_bytes",
        "gauge",
        "Memory in bytes MLX keeps cached for reuse, not held by arrays (mx.get_cache_memory); process-wide.",
        unit="bytes",
    ),
    _Spec(
        "mlx_watchdog_memory_limit_bytes",
        "gauge",
        "MLX's memory limit in bytes (mx.get_memory_limit); process-wide.",
        unit="bytes",
    ),
    _Spec(
        "mlx_watchdog_info",
        "gauge",
        "Always 1; the labels say which versions, device, backend (metal, cuda, cpu: only Metal has "
        "a buffer-count limit) and fix mode the watchdog runs with.",
        ("version", "mlx_version", "mlx_lm_version", "device", "backend", "fix"),
    ),
    _Spec(
        "mlx_watchdog_steps",
        "counter",
        "Forward passes the watchdog observed with a cache: decode steps, plus prefill and "
        "look-ahead forwards.",
    ),
    _Spec(
        "mlx_watchdog_materialized_arrays",
        "counter",
        "Pending cache arrays the fix scheduled for evaluation (Watchdog(fix=True)).",
    ),
    _Spec(
        "mlx_watchdog_fix_failures",
        "counter",
        "Pending cache arrays the fix could not schedule (MLX refused them, e.g. made on another "
        "thread's stream); the others were scheduled.",
    ),
    _Spec(
        "mlx_watchdog_reclaimed_buffers",
        "counter",
        "Buffers the fix kept from accumulating (the growth it cut, summed over steps).",
    ),
    _Spec(
        "mlx_watchdog_stops",
        "counter",
        "Generations the watchdog stopped before the limit, by reason.",
        ("reason",),
    ),
    _Spec(
        "mlx_watchdog_overhead_seconds",
        "counter",
        "Seconds the watchdog spent on the decode thread (observe calls).",
        unit="seconds",
    ),
    _Spec(
        "mlx_watchdog_internal_errors",
        "counter",
        "Errors inside the watchdog or this exporter that were caught; the decode went on.",
    ),
)

_STOP_REASONS = ("forecast",)  # exported at 0 before the first stop, so rate() works at once

# Process-wide readings: (spec name, reader). Each is guarded on its own at scrape time.
_MEMORY_READERS = (
    ("mlx_watchdog_memory_active_bytes", lambda: mx.get_active_memory()),
    ("mlx_watchdog_memory_peak_bytes", lambda: mx.get_peak_memory()),
    ("mlx_watchdog_memory_cache_bytes", lambda: mx.get_cache_memory()),
    ("mlx_watchdog_memory_limit_bytes", lambda: mx.get_memory_limit()),
)


def exposed_metric_names() -> set[str]:
    """The sample names this exporter can expose (counters with their ``_total``)."""
    return {spec.sample_name for spec in _SPECS}


# --------------------------------------------------------------------------- the collector


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
        return [_family(spec, ()) for spec in _SPECS]

    def collect(self) -> Iterator:
        watchdogs = list(dict.fromkeys(self._current_watchdogs()))  # each once
        label_of = self._assign_labels(watchdogs)
        with_rank = any(_world_size(wd) > 1 for wd in watchdogs)
        base = ("watchdog", "rank") if with_rank else ("watchdog",)
        families = {spec.name: _family(spec, base) for spec in _SPECS}
        memory = _read_memory() if watchdogs else {}
        static = self._static_labels() if watchdogs else {}
        functions = _read_compiled(self.max_sites) if watchdogs else []
        for wd in watchdogs:
            try:
                rows = self._rows(wd, label_of[wd], with_rank, memory, static)
                rows += _compiled_rows(functions, (label_of[wd],) + ((str(wd.rank),) if with_rank else ()))
            except Exception as exc:  # one broken watchdog must not break the scrape
                _count_error(wd, exc)
                # Its counters still go out: an alert on internal errors sees a watchdog whose
                # forecast fails, instead of its series vanishing with the failure.
                rows = _counter_rows(wd, label_of[wd], with_rank)
            for name, labels, value in rows:
                families[name].add_metric(labels, value)
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

    def _rows(self, wd: Watchdog, label: str, with_rank: bool, memory: dict, static: dict) -> list[tuple]:
        """All samples of one watchdog, built before any is added (all or none)."""
        f = wd.forecast()
        held = wd.held_stop
        base = (label,) + ((str(wd.rank),) if with_rank else ())  # this process, not a worst rank
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
        rows += self._stop_rows(wd, base)
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
            "true" if wd.fix else "false",
        )
        rows.append(("mlx_watchdog_info", base + info, 1))
        rows += [
            ("mlx_watchdog_steps", base, wd.steps),
            ("mlx_watchdog_materialized_arrays", base, wd.materialized_arrays),
            ("mlx_watchdog_fix_failures", base, wd.fix_failures),
            ("mlx_watchdog_reclaimed_buffers", base, wd.reclaimed_buffers),
            ("mlx_watchdog_overhead_seconds", base, wd.overhead_seconds),
            ("mlx_watchdog_internal_errors", base, wd.internal_errors),
        ]
        stops = dict.fromkeys(_STOP_REASONS, 0)
        stops.update(_copy_counter(wd.stops))
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
                ranked, count = _fold(by_site, self.max_sites)
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

    def _stop_rows(self, wd: Watchdog, base: tuple) -> list[tuple]:
        """The last stop of each reason: when, the steps to the limit it forecast and its leak
        sites (the largest ``max_sites - 1`` by buffers per step, the rest summed into "other")."""
        rows: list[tuple] = []
        for reason, stop in sorted(wd.last_stops.items()):
            labels = base + (str(reason),)
            rows.append(("mlx_watchdog_last_stop_timestamp_seconds", labels, stop.time))
            rows.append(("mlx_watchdog_last_stop_steps_to_limit", labels, stop.forecast.steps_to_limit))
            by_site: dict[str, float] = {}
            for leak in stop.forecast.leaks:
                if not leak.cut:
                    by_site[str(leak.site)] = by_site.get(str(leak.site), 0.0) + float(leak.buffers_per_step)
            ranked, _ = _fold(by_site, self.max_sites)
            rows += [
                ("mlx_watchdog_last_stop_leak_buffers_per_step", labels + (site,), v) for site, v in ranked
            ]
        return rows

    def _assign_labels(self, watchdogs: list[Watchdog]) -> dict[Watchdog, str]:
        """The ``watchdog`` label of each: its name, made unique among this scrape's watchdogs of
        the same rank. A watchdog keeps the label it had while its name stays the same, so its
        series do not change identity between scrapes."""
        with self._lock:
            labels, used, fresh = {}, set(), []
            for wd in watchdogs:
                name, rank = _name_and_rank(wd)
                known = self._labels.get(wd)
                if known is not None and known[0] == name and (known[1], rank) not in used:
                    labels[wd] = known[1]
                    used.add((known[1], rank))
                else:
                    fresh.append(wd)
            for wd in fresh:
                name, rank = _name_and_rank(wd)
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
            try:
                device = device_name()
            except Exception:
                device = "unknown"
            try:
                on = backend()
            except Exception:
                on = "unknown"
            self._static = {
                "version": __version__,
                "mlx_version": str(getattr(mx, "__version__", "unknown")),
                "mlx_lm_version": _package_version("mlx-lm"),
                "device": device,
                "backend": on,
            }
        return self._static


def _fold(by_site: dict[str, float], max_sites: int) -> tuple[list[tuple[str, float]], int]:
    """The sites by buffers per step, largest first, at most ``max_sites``: past the cap, the
    largest ``max_sites - 1`` and "other" with the sum of the rest; and how many were folded."""
    ranked = sorted(by_site.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(ranked) <= max_sites:
        return ranked, 0
    kept, rest = ranked[: max_sites - 1], ranked[max_sites - 1 :]
    other = sum(v for _, v in rest) + dict(kept).get(OTHER_SITE, 0.0)
    return [(site, v) for site, v in kept if site != OTHER_SITE] + [(OTHER_SITE, other)], len(rest)


def _counter_rows(wd: Watchdog, label: str, with_rank: bool) -> list[tuple]:
    """What a watchdog whose forecast fails still exports: its step and error counters."""
    base = (label,) + ((str(wd.rank),) if with_rank else ())
    rows = []
    for name, attribute in (
        ("mlx_watchdog_steps", "steps"),
        ("mlx_watchdog_internal_errors", "internal_errors"),
    ):
        try:
            value = getattr(wd, attribute)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                rows.append((name, base, float(value)))
        except Exception:
            pass
    return rows


def _name_and_rank(wd: Watchdog) -> tuple[str, int]:
    return str(wd.name), (wd.rank if _world_size(wd) > 1 else 0)


def _family(spec: _Spec, base: tuple[str, ...]):
    labels = list(base) + list(spec.labels)
    cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=labels, unit=spec.unit)


def _world_size(wd: Watchdog) -> int:
    try:
        return int(wd.world_size)
    except Exception:
        return 1


def _copy_counter(counter) -> dict:
    # The decode thread may add a reason while we copy; a copy of a dict is atomic under the GIL,
    # retry for interpreters where it is not.
    for _ in range(3):
        try:
            return dict(counter)
        except RuntimeError:
            continue
    return dict(counter)


def _count_error(wd: Watchdog, exc: Exception) -> None:
    try:
        wd.record_internal_error("prometheus exporter", exc)
    except Exception:
        logger.warning("mlx-watchdog exporter: skipped watchdog %r: %r", wd, exc)


def _read_compiled(limit: int) -> list[tuple[str, int, float | None]]:
    """(function, signatures, buffers per entry) of the compiled functions that keep an entry,
    the most signatures first, at most ``limit``; functions of one name summed."""
    by_name: dict[str, list] = {}
    try:
        for function in compiled.functions():
            entries = function.entries
            if not entries:
                continue
            total = by_name.setdefault(function.name, [0, 0, False])
            total[0] += entries
            total[1] += function.buffers
            total[2] = total[2] or function.entry_buffers is not None
    except Exception as exc:
        logger.debug("mlx-watchdog exporter: compiled functions unavailable: %r", exc)
        return []
    ranked = sorted(by_name.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]
    return [
        (name, entries, buffers / entries if measured else None)
        for name, (entries, buffers, measured) in ranked
    ]


def _compiled_rows(functions: list[tuple[str, int, float | None]], base: tuple) -> list[tuple]:
    rows: list[tuple] = []
    for name, signatures, per_entry in functions:
        rows.append(("mlx_watchdog_compiled_signatures", base + (name,), float(signatures)))
        if per_entry is not None:
            rows.append(("mlx_watchdog_compiled_entry_buffers", base + (name,), float(per_entry)))
    return rows


def _read_memory() -> dict[str, float]:
    readings = {}
    for name, read in _MEMORY_READERS:
        try:
            readings[name] = float(read())
        except Exception as exc:  # a backend without the call: leave the sample out
            logger.debug("mlx-watchdog exporter: %s unavailable: %r", name, exc)
    return readings


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------- registries

_registered: weakref.WeakKeyDictionary[CollectorRegistry, WatchdogCollector] = weakref.WeakKeyDictionary()
_register_lock = threading.Lock()


def register_collector(
    registry: CollectorRegistry | None = None, *, max_sites: int | None = None
) -> WatchdogCollector:
    """Register one :class:`WatchdogCollector` (every live watchdog) on ``registry`` (default:
    prometheus_client's global ``REGISTRY``), once; later calls return the same collector.
    ``max_sites`` (default 20) bounds the site series per leak family and watchdog.

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
            except ValueError as exc:  # DuplicateTimeseries: the user registered one already
                existing = getattr(registry, "_names_to_collectors", {}).get("mlx_watchdog_resident_buffers")
                if not isinstance(existing, WatchdogCollector):
                    raise ValueError(f"cannot register the mlx-watchdog collector: {exc}") from exc
                collector = existing
            _registered[registry] = collector
        if max_sites is not None:
            collector.max_sites = max_sites
        return collector


class PsutilProcessCollector:
    """The standard process metrics (the names prometheus_client's ``ProcessCollector`` exports
    from ``/proc`` on Linux) read through psutil, for platforms without ``/proc``."""

    def describe(self) -> list:
        return list(self.collect())  # the registry learns the names (no clash with another's)

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
        yield GaugeMetricFamily(
            "process_virtual_memory_bytes", "Virtual memory size in bytes.", value=memory.vms
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory size in bytes.", value=memory.rss
        )
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=started,
        )
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            value=cpu.user + cpu.system,
            unit="seconds",
        )
        if fds is not None:
            yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=fds)


def register_process_collector(registry: CollectorRegistry, probe=None) -> PsutilProcessCollector | None:
    """Add :class:`PsutilProcessCollector` to ``registry`` when the process collector there
    (``probe``, default prometheus_client's ``PROCESS_COLLECTOR``) exports nothing and no other
    collector exports ``process_resident_memory_bytes``; returns it, or None when not needed."""
    probe = prometheus_client.PROCESS_COLLECTOR if probe is None else probe
    try:
        if any(family.samples for family in probe.collect()):
            return None  # /proc is there: the standard collector does it
        if "process_resident_memory_bytes" in getattr(registry, "_names_to_collectors", {}):
            return None
        collector = PsutilProcessCollector()
        registry.register(collector)
        return collector
    except Exception as exc:  # never a reason not to export the watchdogs
        logger.debug("mlx-watchdog: no psutil process metrics: %r", exc)
        return None


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


# --------------------------------------------------------------------------- the HTTP server


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
    _check_port("port", port)
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"addr must be a host name or IP address, got {addr!r}")
    _check_positive("max_connections", max_connections, integer=True)
    _check_positive("idle_timeout", idle_timeout)
    _check_positive("max_header_bytes", max_header_bytes, integer=True)
    tls = _check_tls(certfile, keyfile, client_cafile, client_capath, client_auth_required)
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
            _tls_context(where, certfile, keyfile, client_cafile, client_capath, client_auth_required)
            if tls
            else None
        )
        register_collector(registry, max_sites=max_sites)
        sock = _listen(addr, port)
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


def _listen(addr: str, port: int) -> socket.socket:
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


def _check_positive(label: str, value, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or value <= 0
        or (not integer and not math.isfinite(value))  # NaN too
    ):
        raise ValueError(f"{label} must be a positive {'integer' if integer else 'number'}, got {value!r}")


def _check_port(label: str, port) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{label} must be an integer from 0 to 65535 (0 picks a free port), got {port!r}")


def _check_tls(certfile, keyfile, client_cafile, client_capath, client_auth_required) -> bool:
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


def _tls_context(where, certfile, keyfile, cafile, capath, client_auth_required) -> ssl.SSLContext:
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


# --------------------------------------------------------------------------- distributed


def default_metrics_port(base: int = DEFAULT_PORT) -> int:
    """``base + rank`` in a distributed MLX job (so ranks on one host do not clash), else ``base``.

    The rank comes from a live watchdog in a group of size > 1, else from the launcher's
    environment. ``mx.distributed.init()`` is never called: it is not a query. Launched, it joins
    the ring (blocking until every rank joins); not launched, it caches a size-1 group under a
    backend's name that a later explicit ``init(backend=...)`` would silently get."""
    _check_port("base", base)
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
