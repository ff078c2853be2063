"""The metrics the exporter serves: each family's name, type, help text, unit and labels, written
once here. The collector fills them; ``describe()``, the docs and the dashboards read the names.
"""

from __future__ import annotations

import dataclasses

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

OTHER_SITE = "other"  # the site label of the sum of the sites past max_sites
STOP_REASONS = ("forecast",)  # exported at 0 before the first stop, so rate() works at once


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One metric family: what the exposition says of it besides its samples."""

    name: str  # family name, without the counter's "_total"
    kind: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...] = ()  # labels besides watchdog/rank
    unit: str = ""  # OpenMetrics UNIT metadata; the name already ends with it

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name

    def family(self, base: tuple[str, ...]) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family of this metric, labelled ``base`` (watchdog, rank) and its own labels."""
        labels = list(base) + list(self.labels)
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        return cls(self.name, self.help, labels=labels, unit=self.unit)


# The names are a contract: the Grafana dashboard and the alert rules query them.
SPECS = (
    MetricSpec(
        "mlx_watchdog_resident_buffers",
        "gauge",
        "Buffers (device allocations held by MLX arrays) estimated alive now: model parameters, "
        "cache arrays and the buffers that pending lazy graphs keep alive.",
    ),
    MetricSpec(
        "mlx_watchdog_peak_resident_buffers",
        "gauge",
        "Buffers resident at the peaks of the sawtooth of sites the program cuts itself (a "
        "program that evaluates its cache state every N steps): resident_buffers plus what those "
        "sites hold at their peaks beyond now. The steps to the limit count from it.",
    ),
    MetricSpec(
        "mlx_watchdog_resource_limit_buffers",
        "gauge",
        "The buffer limit the forecast counts against: the configured one, else the device's "
        "(Metal's resource_limit), else 499000. On Metal a process that allocates past Metal's "
        "limit crashes; the other backends have no buffer-count limit (see mlx_watchdog_info's backend).",
    ),
    MetricSpec(
        "mlx_watchdog_buffers_per_step",
        "gauge",
        "Net growth of resident buffers per decode step now; 0 when flat or not decoding, above 0 "
        "means a leak, NaN until measured (see mlx_watchdog_rate_known).",
    ),
    MetricSpec(
        "mlx_watchdog_steps_to_limit",
        "gauge",
        "Decode steps left until resident buffers reach the limit at the current growth "
        "(+Inf when not growing or not decoding, NaN until measured).",
    ),
    MetricSpec(
        "mlx_watchdog_time_to_limit_seconds",
        "gauge",
        "Seconds left until resident buffers reach the limit at the current growth and step rate "
        "(+Inf when not growing or not decoding, NaN until measured).",
        unit="seconds",
    ),
    MetricSpec(
        "mlx_watchdog_rate_known",
        "gauge",
        "1 once the growth per step has been measured on the caches alive now, 0 before: "
        "buffers_per_step and the time to the limit are then NaN, not a reading of no leak.",
    ),
    MetricSpec(
        "mlx_watchdog_decoding",
        "gauge",
        "1 while decode steps are observed, 0 when none came for a few seconds or the "
        "generation ended (resident buffers still held stay in resident_buffers).",
    ),
    MetricSpec(
        "mlx_watchdog_stop_forecast_held",
        "gauge",
        "1 while buffers_per_step, steps_to_limit, time_to_limit_seconds, rate_known and the leak "
        "site series read the forecast of the last stop: a stop ends the caches that grew, and the "
        "forecast that caused it stays until a reading taken on a decode step since measures the "
        "growth again. 0 otherwise.",
    ),
    MetricSpec(
        "mlx_watchdog_last_stop_timestamp_seconds",
        "gauge",
        "When the watchdog last stopped a generation before the limit, by reason (seconds since the "
        "Unix epoch); absent before the first stop of that reason.",
        ("reason",),
        unit="seconds",
    ),
    MetricSpec(
        "mlx_watchdog_last_stop_steps_to_limit",
        "gauge",
        "Decode steps to the limit forecast by the last stop of each reason, when it stopped (+Inf "
        "when its forecast saw no growth: a prefill stop).",
        ("reason",),
    ),
    MetricSpec(
        "mlx_watchdog_last_stop_leak_buffers_per_step",
        "gauge",
        "Buffers per decode step of each leaking site that nothing repairs, in the forecast of the "
        'last stop of each reason; site="other" sums the sites past the exporter\'s max_sites.',
        ("reason", "site"),
    ),
    MetricSpec(
        "mlx_watchdog_pending_graph_nodes",
        "gauge",
        "Unevaluated (lazy) graph nodes hanging off the watched cache at the last measurement.",
    ),
    MetricSpec(
        "mlx_watchdog_leak_buffers_per_step",
        "gauge",
        "Buffers per decode step added by one leaking site that nothing repairs; site is the "
        'class and attribute that holds them, e.g. ArraysCache.left_padding; site="other" sums '
        "the sites past the exporter's max_sites.",
        ("site",),
    ),
    MetricSpec(
        "mlx_watchdog_fixed_leak_buffers_per_step",
        "gauge",
        "Buffers per decode step a leaking site would add, which the fix cuts (Watchdog(fix=True)): "
        'the leak is there, the fix repairs it; site="other" as for the unrepaired ones.',
        ("site",),
    ),
    MetricSpec(
        "mlx_watchdog_unattributed_buffers_per_step",
        "gauge",
        "Buffers per decode step the whole process grows beyond what the named leak sites add: a "
        "leak outside the caches the watchdog reads (a server's own per-step outputs kept lazily, "
        "a compiled function's entry per input shape). Read from a count of the whole process "
        "(Watchdog(process_count=...)); 0 without one, NaN until measured.",
    ),
    MetricSpec(
        "mlx_watchdog_bounded_site_peak_buffers",
        "gauge",
        "Buffers a bounded site holds at its peak: a site whose chains the program itself cuts "
        "now and then (it evaluates its cache state every N steps) and whose peaks do not grow. "
        "A sawtooth, no leak: it costs headroom, not steps. One series per such site now.",
        ("site",),
    ),
    MetricSpec(
        "mlx_watchdog_folded_leak_sites",
        "gauge",
        'Leak sites summed into the site="other" series of the two leak families at this scrape '
        "(0 while every site has its own series; the exporter's max_sites bounds them).",
    ),
    MetricSpec(
        "mlx_watchdog_compiled_signatures",
        "gauge",
        "Input signatures (array shapes and dtypes, other arguments) a function compiled with "
        "mx.compile keeps a cache entry for, one series per function (the most signatures first, "
        "at most the exporter's max_sites); process-wide, the same on every watchdog of the "
        'process. A count that keeps growing is a leak: site="compiled:<function>" of '
        "mlx_watchdog_leak_buffers_per_step.",
        ("function",),
    ),
    MetricSpec(
        "mlx_watchdog_compiled_entry_buffers",
        "gauge",
        "Buffers one cache entry of a compiled function keeps (the constants of its traced "
        "graph), measured on its traces; process-wide. Times its signatures: what its cache holds.",
        ("function",),
    ),
    MetricSpec(
        "mlx_watchdog_prefill_graph_nodes",
        "gauge",
        "Lazy graph nodes of the last multi-token (prefill) forward pass.",
    ),
    MetricSpec(
        "mlx_watchdog_max_safe_prefill_tokens",
        "gauge",
        "Largest prefill chunk in tokens whose lazy graph stays within the buffer limit.",
    ),
    MetricSpec(
        "mlx_watchdog_memory_active_bytes",
        "gauge",
        "Memory in bytes held by live MLX arrays (mx.get_active_memory); process-wide, the same "
        "value on every watchdog of the process.",
        unit="bytes",
    ),
    MetricSpec(
        "mlx_watchdog_memory_peak_bytes",
        "gauge",
        "Highest MLX active memory in bytes since the process started or the peak was reset "
        "(mx.get_peak_memory); process-wide.",
        unit="bytes",
    ),
    MetricSpec(
        "mlx_watchdog_memory_cache_bytes",
        "gauge",
        "Memory in bytes MLX keeps cached for reuse, not held by arrays (mx.get_cache_memory); process-wide.",
        unit="bytes",
    ),
    MetricSpec(
        "mlx_watchdog_memory_limit_bytes",
        "gauge",
        "MLX's memory limit in bytes (mx.get_memory_limit); process-wide.",
        unit="bytes",
    ),
    MetricSpec(
        "mlx_watchdog_info",
        "gauge",
        "Always 1; the labels say which versions, device, backend (metal, cuda, cpu: only Metal has "
        "a buffer-count limit) and fix mode the watchdog runs with.",
        ("version", "mlx_version", "mlx_lm_version", "device", "backend", "fix"),
    ),
    MetricSpec(
        "mlx_watchdog_steps",
        "counter",
        "Forward passes the watchdog observed with a cache: decode steps, plus prefill and "
        "look-ahead forwards.",
    ),
    MetricSpec(
        "mlx_watchdog_materialized_arrays",
        "counter",
        "Pending cache arrays the fix scheduled for evaluation (Watchdog(fix=True)).",
    ),
    MetricSpec(
        "mlx_watchdog_fix_failures",
        "counter",
        "Pending cache arrays the fix could not schedule (MLX refused them, e.g. made on another "
        "thread's stream); the others were scheduled.",
    ),
    MetricSpec(
        "mlx_watchdog_reclaimed_buffers",
        "counter",
        "Buffers the fix kept from accumulating (the growth it cut, summed over steps).",
    ),
    MetricSpec(
        "mlx_watchdog_stops",
        "counter",
        "Generations the watchdog stopped before the limit, by reason.",
        ("reason",),
    ),
    MetricSpec(
        "mlx_watchdog_overhead_seconds",
        "counter",
        "Seconds the watchdog spent on the decode thread (observe calls).",
        unit="seconds",
    ),
    MetricSpec(
        "mlx_watchdog_internal_errors",
        "counter",
        "Errors inside the watchdog or this exporter that were caught; the decode went on.",
    ),
)


def exposed_metric_names() -> set[str]:
    """The sample names this exporter can expose (counters with their ``_total``)."""
    return {spec.sample_name for spec in SPECS}
