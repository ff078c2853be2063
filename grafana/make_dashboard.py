#!/usr/bin/env python3
"""Generate grafana/dashboards/mlx-watchdog.json.

The dashboard JSON is committed (Grafana imports and provisions it as is); this
script is its source. To change the dashboard, edit this file and run

    python3 grafana/make_dashboard.py

tests/test_grafana.py fails when the committed JSON and this script disagree.
(If you edit the dashboard in Grafana instead, export it with "Export for
sharing externally" OFF and port the change back here.)

Target: Grafana 10.4 / 11.x, classic dashboard JSON, schemaVersion 39.
Standard library only (docs/dashboard.md says why not Grafana's grafana-foundation-sdk,
after trying it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "mlx-watchdog.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
# Every query is restricted to the selected watchdog(s), instance(s) and rank(s).
# The variables' "All" value is `.*`, which also matches series that have no
# `rank` label at all (single-process runs).
SEL = 'watchdog=~"$watchdog",instance=~"$instance",rank=~"$rank"'
LEGEND = "{{watchdog}} {{instance}} {{rank}}"

# Alert thresholds (keep in sync with rules/mlx-watchdog-alerts.yml).
SOON_STEPS, IMMINENT_STEPS = 20000, 2000
SOON_SECONDS, IMMINENT_SECONDS = 1800, 300


class Layout:
    """Hands out unique panel ids and non-overlapping gridPos, row by row."""

    def __init__(self) -> None:
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.row_h = 0
        self.panels: list[dict] = []

    def _id(self) -> int:
        pid = self.next_id
        self.next_id += 1
        return pid

    def row(self, title: str) -> None:
        self.newline()
        self.panels.append(
            {
                "id": self._id(),
                "type": "row",
                "title": title,
                "collapsed": False,
                "datasource": DS,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > 24:
            self.newline()
        panel = {"id": self._id(), **panel, "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)
        if self.x == 24:
            self.newline()


def target(
    expr: str, legend: str = LEGEND, ref: str = "A", instant: bool = False, fmt: str = "time_series"
) -> dict:
    return {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": fmt,
        "instant": instant,
        "legendFormat": legend,
        "range": not instant,
        "refId": ref,
    }


def thresholds(*steps: tuple[float | None, str]) -> dict:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def ts_custom(**overrides) -> dict:
    custom = {
        "axisBorderShow": False,
        "axisCenteredZero": False,
        "axisColorMode": "text",
        "axisLabel": "",
        "axisPlacement": "auto",
        "barAlignment": 0,
        "drawStyle": "line",
        "fillOpacity": 10,
        "gradientMode": "none",
        "hideFrom": {"legend": False, "tooltip": False, "viz": False},
        "insertNulls": False,
        "lineInterpolation": "linear",
        "lineWidth": 1,
        "pointSize": 4,
        "scaleDistribution": {"type": "linear"},
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "none"},
        "thresholdsStyle": {"mode": "off"},
    }
    custom.update(overrides)
    return custom


def timeseries(
    title: str,
    description: str,
    targets: list[dict],
    unit: str,
    *,
    custom: dict | None = None,
    th: dict | None = None,
    overrides: list | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    decimals: int | None = None,
) -> dict:
    defaults: dict = {
        "color": {"mode": "palette-classic"},
        "custom": ts_custom(**(custom or {})),
        "mappings": [],
        "thresholds": th or thresholds((None, "green")),
        "unit": unit,
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {
                "calcs": ["lastNotNull", "max"],
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def fixed_color_override(name: str, color: str, dashed: bool = True) -> dict:
    props = [
        {"id": "color", "value": {"fixedColor": color, "mode": "fixed"}},
        {"id": "custom.fillOpacity", "value": 0},
        {"id": "custom.lineWidth", "value": 2},
    ]
    if dashed:
        props.append({"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}})
    return {"matcher": {"id": "byName", "options": name}, "properties": props}


def stat(
    title: str,
    description: str,
    targets: list[dict],
    unit: str,
    th: dict,
    *,
    mappings: list | None = None,
    graph: str = "none",
    color_mode: str = "background",
    decimals: int | None = None,
    no_value: str | None = None,
) -> dict:
    defaults: dict = {
        "color": {"mode": "thresholds"},
        "mappings": mappings or [],
        "thresholds": th,
        "unit": unit,
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "colorMode": color_mode,
            "graphMode": graph,
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showPercentChange": False,
            "textMode": "value_and_name",
            "wideLayout": True,
        },
    }


# +Inf (not growing) arrives in Grafana as the number Infinity; a value
# mapping keyed "Infinity" replaces it with words.
STOPS_ANNOTATION = f"sum by (watchdog, reason) (increase(mlx_watchdog_stops_total{{{SEL}}}[$__interval])) > 0"

# The name 'Top leak sites' gives the growth that no site explains (the process count's).
UNATTRIBUTED_SITE = "unattributed (outside the caches)"

NOT_GROWING = [
    {"type": "value", "options": {"Infinity": {"color": "green", "index": 0, "text": "not growing"}}},
    # NaN: the growth is not measured yet (mlx_watchdog_rate_known 0), which is no "no leak".
    {
        "type": "special",
        "options": {"match": "nan", "result": {"color": "blue", "index": 1, "text": "measuring"}},
    },
]


def build() -> dict:
    """The dashboard: its panels row by row, the stops as annotations, and the variables that pick
    the watched processes."""
    layout = Layout()
    forecast_row(layout)
    buffers_row(layout)
    memory_row(layout)
    prefill_row(layout)
    compiled_row(layout)
    health_row(layout)
    layout.newline()
    return {
        "annotations": stop_annotations(),
        "description": "mlx-watchdog: buffer growth per decode step, the leaking cache attribute, and the "
        "forecast of the buffer limit (on Metal the `[metal::malloc] Resource limit (499000) exceeded` "
        "crash) for MLX / mlx-lm processes.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": layout.panels,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["mlx", "mlx-watchdog", "metal", "apple-silicon"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "MLX Watchdog",
        "uid": "mlx-watchdog",
        "version": 1,
        "weekStart": "",
    }


def forecast_row(layout: Layout) -> None:
    """When the limit will be hit, how full the buffers are, which sites leak, and the processes."""
    layout.row("Forecast: when will the buffer limit be hit?")
    layout.add(
        stat(
            "Steps to limit",
            "How many more decode steps (about one generated token each) this process can run before the "
            "number of live buffers reaches the limit: on Metal MLX then fails with "
            "`[metal::malloc] Resource limit (499000) exceeded`; the other backends have no buffer-count "
            "limit, the limit is the configured one. Computed by the watchdog as "
            "(buffer limit - resident buffers) / buffers gained per step. 'not growing' (+Inf) means the "
            f"buffer count is flat: no leak. Orange below {SOON_STEPS}, red below {IMMINENT_STEPS} steps "
            "(the thresholds of the Prometheus alerts). One value per process / rank. After a stop it "
            "reads the stop's forecast until a new reading replaces it ('Decoding / growth measured').",
            [target(f"mlx_watchdog_steps_to_limit{{{SEL}}}")],
            "none",
            thresholds((None, "red"), (IMMINENT_STEPS, "orange"), (SOON_STEPS, "green")),
            mappings=NOT_GROWING,
            decimals=0,
        ),
        w=6,
        h=6,
    )
    layout.add(
        stat(
            "Time to limit",
            "The same forecast in wall-clock time: steps to limit divided by the current decode step rate. "
            "'not growing' (+Inf) means no leak, or no decoding right now (step rate 0). Orange below "
            f"{SOON_SECONDS // 60} minutes, red below {IMMINENT_SECONDS // 60} minutes (the alert thresholds).",
            [target(f"mlx_watchdog_time_to_limit_seconds{{{SEL}}}")],
            "s",
            thresholds((None, "red"), (IMMINENT_SECONDS, "orange"), (SOON_SECONDS, "green")),
            mappings=NOT_GROWING,
        ),
        w=6,
        h=6,
    )
    layout.add(buffers_used_gauge(), w=6, h=6)
    layout.add(top_leak_sites(), w=6, h=6)
    layout.add(processes_table(), w=24, h=5)


def buffers_used_gauge() -> dict:
    return {
        "type": "gauge",
        "title": "Buffers used (% of limit)",
        "description": "Resident buffers as a share of the buffer limit (Metal's resource limit, about "
        "499000 buffers on macOS; elsewhere the configured one). The limit counts buffers, not bytes: many "
        "small arrays can exhaust it while plenty of memory is free. On Metal 100% is the crash.",
        "datasource": DS,
        "targets": [
            target(f"mlx_watchdog_resident_buffers{{{SEL}}} / mlx_watchdog_resource_limit_buffers{{{SEL}}}")
        ],
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "mappings": [],
                "max": 1,
                "min": 0,
                "thresholds": thresholds((None, "green"), (0.8, "orange"), (0.95, "red")),
                "unit": "percentunit",
            },
            "overrides": [],
        },
        "options": {
            "minVizHeight": 75,
            "minVizWidth": 75,
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showThresholdLabels": False,
            "showThresholdMarkers": True,
            "sizing": "auto",
        },
    }


def top_leak_sites() -> dict:
    return {
        "type": "bargauge",
        "title": "Top leak sites (buffers per step)",
        "description": "The cache attributes (for example `ArraysCache.left_padding`) that the watchdog blames "
        "for the growth, ranked by how many buffers each one leaves alive per decode step (top 10 "
        "over the selected processes, current value). Empty means nothing is leaking unrepaired. Without "
        "the fix these are the attributes `mlx-watchdog serve --fix` / `Watchdog(fix=True)` repairs; with "
        f"it, a site it cuts is left out here (it shows dashed in 'Leak per site'). '{UNATTRIBUTED_SITE}' "
        "is the growth of the whole process that no site explains (from the process count): a leak "
        "outside the caches the watchdog reads, which the fix does not reach (see 'Growth per step: "
        "named sites vs unattributed').",
        "datasource": DS,
        "targets": [
            target(
                "topk(10, max by (watchdog, site) ("
                f"mlx_watchdog_leak_buffers_per_step{{{SEL}}} or label_replace("
                f'mlx_watchdog_unattributed_buffers_per_step{{{SEL}}}, "site", "{UNATTRIBUTED_SITE}", "", "")'
                ") > 0)",
                legend="{{site}} ({{watchdog}})",
                instant=True,
            )
        ],
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "decimals": 2,
                "mappings": [],
                "min": 0,
                "noValue": "no leaking site",
                "thresholds": thresholds((None, "green"), (0.001, "orange"), (1, "red")),
                "unit": "suffix:buffers/step",
            },
            "overrides": [],
        },
        "options": {
            "displayMode": "gradient",
            "maxVizHeight": 300,
            "minVizHeight": 16,
            "minVizWidth": 8,
            "namePlacement": "auto",
            "orientation": "horizontal",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showUnfilled": True,
            "sizing": "auto",
            "valueMode": "color",
        },
    }


def processes_table() -> dict:
    return {
        "type": "table",
        "title": "Processes: versions and fix",
        "description": "One row per watched process (from the `mlx_watchdog_info` metric): the watchdog "
        "name, scrape address and rank, whether the leak fix is on, and the mlx-watchdog, MLX and mlx-lm "
        "versions, the MLX device and its backend (metal, cuda, cpu: only Metal has a buffer-count "
        "limit). If a leak is reported while `fix` is off, restart with `mlx-watchdog serve --fix` or "
        "`Watchdog(fix=True)`.",
        "datasource": DS,
        "targets": [target(f"mlx_watchdog_info{{{SEL}}}", legend="", instant=True, fmt="table")],
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {
                        "Time": True,
                        "Value": True,
                        "Value #A": True,
                        "__name__": True,
                        "job": True,
                    },
                    "indexByName": {
                        "watchdog": 0,
                        "instance": 1,
                        "rank": 2,
                        "fix": 3,
                        "version": 4,
                        "mlx_version": 5,
                        "mlx_lm_version": 6,
                        "device": 7,
                        "backend": 8,
                    },
                    "renameByName": {},
                },
            }
        ],
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "custom": {"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
                "mappings": [],
                "thresholds": thresholds((None, "text")),
                "unit": "none",
            },
            "overrides": [
                {
                    "matcher": {"id": "byName", "options": "fix"},
                    "properties": [
                        {
                            "id": "mappings",
                            "value": [
                                {
                                    "type": "value",
                                    "options": {
                                        **{
                                            v: {"color": "green", "index": 0, "text": "on"}
                                            for v in ("on", "true", "1", "yes", "enabled")
                                        },
                                        **{
                                            v: {"color": "orange", "index": 1, "text": "off"}
                                            for v in ("off", "false", "0", "no", "disabled")
                                        },
                                    },
                                }
                            ],
                        },
                        {"id": "custom.cellOptions", "value": {"type": "color-background", "mode": "basic"}},
                    ],
                }
            ],
        },
        "options": {
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "fields": "", "countRows": False},
            "showHeader": True,
        },
    }


def buffers_row(layout: Layout) -> None:
    """The buffers against the limit, their growth per step and per site, and what drives it."""
    layout.row("Buffers and the lazy graph")
    layout.add(
        timeseries(
            "Resident buffers vs limit",
            "Number of buffers alive in the process after each decode step (solid), against the buffer "
            "limit (dashed red: Metal's resource limit, elsewhere the configured one). A healthy decode is "
            "flat; a leak is a straight ramp toward the dashed line, and the crash happens where they meet. "
            "A program that cuts its own chains now and then (it evaluates its cache state every N steps) "
            "makes a sawtooth: the dashed line of its color is the count at the sawtooth's peaks, where the "
            "steps to the limit are counted from.",
            [
                target(f"mlx_watchdog_resident_buffers{{{SEL}}}", ref="A"),
                target(
                    f"max(mlx_watchdog_resource_limit_buffers{{{SEL}}})", legend="resource limit", ref="B"
                ),
                target(
                    f"mlx_watchdog_peak_resident_buffers{{{SEL}}} > mlx_watchdog_resident_buffers{{{SEL}}}",
                    ref="C",
                    legend="at the sawtooth's peak: {{watchdog}} {{instance}} {{rank}}",
                ),
            ],
            "short",
            overrides=[
                fixed_color_override("resource limit", "red"),
                {
                    "matcher": {"id": "byFrameRefID", "options": "C"},
                    "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}}],
                },
            ],
            minimum=0,
            decimals=0,
        ),
        w=12,
        h=8,
    )
    layout.add(
        timeseries(
            "Growth per step",
            "Net buffers gained per decode step (the slope of the left graph), as measured by the "
            "watchdog. 0 is healthy; a steady positive value is a leak that ends in the resource-limit "
            "crash; short spikes during prefill or cache resizing are normal. The panel below splits it "
            "into the named leak sites and the growth no site explains.",
            [target(f"mlx_watchdog_buffers_per_step{{{SEL}}}")],
            "suffix:buffers/step",
            custom={"thresholdsStyle": {"mode": "line"}},
            th=thresholds((None, "green"), (0.5, "orange")),
            decimals=2,
        ),
        w=12,
        h=8,
    )
    layout.add(growth_split(), w=12, h=8)
    layout.add(
        timeseries(
            "Leak per site",
            "Buffers per step attributed to each cache attribute (`site`) over time, per process. Use it "
            "to see when a site started leaking and whether `--fix` stopped it: with the fix on, a site it "
            'cuts moves to the dashed "cut by the fix" series (what it would add unrepaired). The alert '
            "MLXWatchdogLeakSiteGrowing fires when a site nothing repairs stays above 0.5 whenever it is "
            "measured while decoding, for 10 minutes. Past 20 sites per process the rest are summed as "
            'site="other" (mlx_watchdog_folded_leak_sites says how many).',
            [
                target(
                    f"mlx_watchdog_leak_buffers_per_step{{{SEL}}}",
                    legend="{{site}} {{watchdog}} {{instance}} {{rank}}",
                ),
                target(
                    f"mlx_watchdog_fixed_leak_buffers_per_step{{{SEL}}}",
                    ref="B",
                    legend="cut by the fix: {{site}} {{watchdog}} {{instance}} {{rank}}",
                ),
            ],
            "suffix:buffers/step",
            decimals=2,
            overrides=[
                {
                    "matcher": {"id": "byFrameRefID", "options": "B"},
                    "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}}],
                }
            ],
        ),
        w=12,
        h=8,
    )
    layout.add(
        timeseries(
            "Bounded sites: peak buffers (cut by the program, no leak)",
            "Cache attributes whose lazy chains the program itself cuts now and then (it evaluates its "
            "cache state every N steps, as mlx-vlm's BatchGenerator does every 50) and whose peaks do not "
            "grow: a sawtooth, not a leak. Each line is the buffers the site holds at its peak, which the "
            "forecast counts the limit from; no leak alert fires for it. A site whose peaks grow is a leak, "
            "shown in 'Leak per site' at the growth of its peaks.",
            [
                target(
                    f"mlx_watchdog_bounded_site_peak_buffers{{{SEL}}}",
                    legend="{{site}} {{watchdog}} {{instance}} {{rank}}",
                )
            ],
            "short",
            minimum=0,
            decimals=0,
        ),
        w=12,
        h=8,
    )
    layout.add(
        timeseries(
            "Pending graph nodes",
            "Operations recorded in MLX's lazy compute graph but not yet evaluated at the end of a step. "
            "Unevaluated nodes keep their inputs' buffers alive, so a count that keeps growing (for example "
            "a cache attribute that is updated every step but never evaluated) shows up as buffer growth.",
            [target(f"mlx_watchdog_pending_graph_nodes{{{SEL}}}")],
            "short",
            minimum=0,
        ),
        w=12,
        h=8,
    )
    layout.add(
        timeseries(
            "Fix activity: arrays materialized / buffers reclaimed / arrays failed per second",
            "What the leak fix (`mlx-watchdog serve --fix`, `Watchdog(fix=True)`) does, per second. "
            "Materialized: pending cache arrays the fix scheduled for evaluation, so their lazy graphs "
            "stop pinning buffers. Reclaimed: buffers the fix kept from accumulating (the growth it cut). "
            "Failed: pending arrays the fix could not schedule (MLX refused them); above 0, those "
            "arrays still leak. All stay at 0 while the fix is off; rates of "
            "mlx_watchdog_materialized_arrays_total, mlx_watchdog_reclaimed_buffers_total and "
            "mlx_watchdog_fix_failures_total.",
            [
                target(
                    f"rate(mlx_watchdog_materialized_arrays_total{{{SEL}}}[$__rate_interval])",
                    legend="materialized " + LEGEND,
                    ref="A",
                ),
                target(
                    f"rate(mlx_watchdog_reclaimed_buffers_total{{{SEL}}}[$__rate_interval])",
                    legend="reclaimed " + LEGEND,
                    ref="B",
                ),
                target(
                    f"rate(mlx_watchdog_fix_failures_total{{{SEL}}}[$__rate_interval])",
                    legend="failed " + LEGEND,
                    ref="C",
                ),
            ],
            "suffix:/s",
            minimum=0,
        ),
        w=12,
        h=8,
    )
    layout.add(
        timeseries(
            "Decode step rate",
            "Decode steps per second (about tokens per second per sequence): Prometheus' rate of "
            "mlx_watchdog_steps_total (forward passes with a cache: decode steps plus prefill chunks). "
            "The watchdog's own step rate turns steps-to-limit into time-to-limit. 0 while the model is idle.",
            [target(f"rate(mlx_watchdog_steps_total{{{SEL}}}[$__rate_interval])")],
            "suffix:steps/s",
            minimum=0,
        ),
        w=12,
        h=8,
    )


def growth_split() -> dict:
    """The growth per step in two parts: the named leak sites, and what the process grows beyond them."""
    return timeseries(
        "Growth per step: named sites vs unattributed",
        "The growth per step of each process in two parts. Named sites (solid): the sum of the leak "
        "sites the watchdog names in 'Leak per site' (cache attributes, and compiled functions "
        "`compiled:...` under `mlx-watchdog run` or `instrument()`). Unattributed (dashed): what the "
        "whole process grows beyond them (mlx_watchdog_unattributed_buffers_per_step), read from the "
        "process count (every buffer MLX makes and frees): a leak outside the caches the watchdog "
        "reads, such as a server's or program's own per-step outputs kept as lazy arrays, or a function "
        "under mx.compile fed a new input shape each step. The fix does not reach it. It reads 0 where "
        "the process count is off (`--process-count off`, or its self-check failed: the process log "
        "says why). MLXWatchdogUnattributedGrowth fires when it stays above 0.5 whenever it is "
        "measured while decoding, for 10 minutes; `mlx-watchdog diagnose --model ...` then tells "
        "whether mlx-lm's own decode of the model grows, or the program around it.",
        [
            target(
                f"sum by (job, instance, pid, watchdog, rank) (mlx_watchdog_leak_buffers_per_step{{{SEL}}})",
                legend="named sites " + LEGEND,
                ref="A",
            ),
            target(
                f"mlx_watchdog_unattributed_buffers_per_step{{{SEL}}}",
                legend="unattributed " + LEGEND,
                ref="B",
            ),
        ],
        "suffix:buffers/step",
        overrides=[
            {
                "matcher": {"id": "byFrameRefID", "options": "B"},
                "properties": [{"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}}],
            }
        ],
        minimum=0,
        decimals=2,
    )


def memory_row(layout: Layout) -> None:
    """Bytes, beside the buffer count: MLX's allocator and the process's resident memory."""
    layout.row("Memory (bytes)")
    layout.add(
        timeseries(
            "MLX memory vs memory limit",
            "MLX's allocator, in bytes: active = memory held by live arrays; peak = highest active "
            "memory so far; cache = freed buffers MLX keeps for reuse; memory limit (dashed red) = MLX's "
            "memory limit. Note that the resource-limit crash counts buffers, not bytes: it can happen "
            "far below the memory limit.",
            [
                target(f"mlx_watchdog_memory_active_bytes{{{SEL}}}", legend="active " + LEGEND, ref="A"),
                target(f"mlx_watchdog_memory_peak_bytes{{{SEL}}}", legend="peak " + LEGEND, ref="B"),
                target(f"mlx_watchdog_memory_cache_bytes{{{SEL}}}", legend="cache " + LEGEND, ref="C"),
                target(f"max(mlx_watchdog_memory_limit_bytes{{{SEL}}})", legend="memory limit", ref="D"),
            ],
            "bytes",
            overrides=[fixed_color_override("memory limit", "red")],
            minimum=0,
        ),
        w=12,
        h=8,
    )
    layout.add(
        timeseries(
            "Process resident memory (RSS)",
            "Resident set size of the whole Python process as the operating system reports it: the "
            "standard process_resident_memory_bytes of prometheus_client's process collector (psutil's "
            "reading on macOS, which has no /proc), of the targets that run the selected watchdogs. On "
            "Apple silicon (unified memory) GPU buffers are not necessarily counted here; compare with "
            "MLX active memory on the left.",
            [
                target(
                    f"process_resident_memory_bytes and on(job, instance) mlx_watchdog_info{{{SEL}}}",
                    legend="{{instance}}",
                )
            ],
            "bytes",
            minimum=0,
        ),
        w=12,
        h=8,
    )


def prefill_row(layout: Layout) -> None:
    """The last prefill's graph, and the largest chunk that stays within the limit."""
    layout.row("Prefill")
    layout.add(
        timeseries(
            "Prefill graph nodes",
            "Lazy graph nodes of the last multi-token (prefill) forward pass. Prefill evaluates a whole "
            "prompt chunk at once, so a long prompt needs many buffers at the same moment and can hit "
            "the resource limit even without any decode leak. No data until a prefill has been measured.",
            [target(f"mlx_watchdog_prefill_graph_nodes{{{SEL}}}")],
            "short",
            minimum=0,
        ),
        w=16,
        h=7,
    )
    layout.add(
        stat(
            "Max safe prefill tokens",
            "The largest prefill chunk, in tokens, whose lazy graph stays within the buffer limit, as "
            "estimated by the watchdog. Prompts longer than this should be prefilled in chunks of at "
            "most this size (mlx-lm's prefill step size). No data until a prefill has been measured.",
            [target(f"mlx_watchdog_max_safe_prefill_tokens{{{SEL}}}")],
            "suffix:tokens",
            thresholds((None, "blue")),
            graph="area",
            color_mode="value",
            decimals=0,
        ),
        w=8,
        h=7,
    )


# The compiled functions' series are process-wide: every watchdog of a process exports the same
# ones, so the panels drop the watchdog label and show one series per process and function.
COMPILED_LEGEND = "{{function}} {{instance}} {{rank}} {{pid}}"


def compiled_row(layout: Layout) -> None:
    """mx.compile's cache entries per function: the leak of a training loop fed many shapes."""
    layout.row("Compiled functions (mx.compile: training steps)")
    layout.add(compiled_signatures(), w=16, h=8)
    layout.add(compiled_share_of_limit(), w=8, h=8)


def compiled_signatures() -> dict:
    """Each function's signatures over time, and the buffers one of its entries keeps."""
    return timeseries(
        "Compiled functions: input signatures kept, buffers per entry",
        "Solid: the input signatures (array shapes and dtypes, other arguments) each function compiled "
        "with mx.compile keeps a cache entry for (mlx_watchdog_compiled_signatures), for as long as the "
        "function lives; mlx-lm's trainer compiles its step (`mlx_lm.tuner.trainer.step`). Dashed, right "
        "axis: the buffers one entry keeps, measured on its traces (mlx_watchdog_compiled_entry_buffers). "
        "A count that levels off is fine; one that keeps climbing (a new batch length at many steps) is "
        "a leak, named `compiled:<function>` in 'Leak per site', which the fix cannot cut: compile with "
        "`mx.compile(..., shapeless=True)` where the function allows, or pad the inputs to a few lengths "
        "(buckets). Counted only where `mx.compile` is instrumented (`mlx-watchdog run`, "
        "`instrument()`), for at most the exporter's max_sites functions per process, the most "
        "signatures first; one series per process, whichever watchdog exports it.",
        [
            target(
                f"max without (watchdog) (mlx_watchdog_compiled_signatures{{{SEL}}})",
                legend="signatures: " + COMPILED_LEGEND,
                ref="A",
            ),
            target(
                f"max without (watchdog) (mlx_watchdog_compiled_entry_buffers{{{SEL}}})",
                legend="buffers per entry: " + COMPILED_LEGEND,
                ref="B",
            ),
        ],
        "short",
        overrides=[
            {
                "matcher": {"id": "byFrameRefID", "options": "B"},
                "properties": [
                    {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
                    {"id": "custom.axisPlacement", "value": "right"},
                    {"id": "custom.axisLabel", "value": "buffers per entry"},
                ],
            }
        ],
        minimum=0,
    )


def compiled_share_of_limit() -> dict:
    """What each function's cache holds (signatures x buffers per entry), against the buffer limit."""
    held = (
        f"max without (watchdog) (mlx_watchdog_compiled_signatures{{{SEL}}} "
        f"* mlx_watchdog_compiled_entry_buffers{{{SEL}}})"
    )
    limit = f"min without (watchdog) (mlx_watchdog_resource_limit_buffers{{{SEL}}})"
    top_sites = top_leak_sites()  # the same bar gauge, of another quantity
    return {
        **top_sites,
        "title": "Compiled caches: share of the buffer limit",
        "description": "The buffers each compiled function's cache holds now (its signatures times the "
        "buffers per entry), as a share of the process's buffer limit (Metal's resource limit, elsewhere "
        "the configured one); top 10 over the selected processes. These buffers stay for the function's "
        "life: a share that grows with every new input shape ends in the resource-limit crash of a "
        "fine-tune (mlx #4464). Empty until a function compiled under `mlx-watchdog run` or "
        "`instrument()` has kept an entry.",
        "targets": [
            target(
                f"topk(10, {held} / on(job, instance, pid, rank) group_left() {limit})",
                legend="{{function}} ({{instance}} {{rank}} {{pid}})",
                instant=True,
            )
        ],
        "fieldConfig": {
            "defaults": {
                **top_sites["fieldConfig"]["defaults"],
                "decimals": 1,
                "max": 1,
                "noValue": "no compiled function",
                "thresholds": thresholds((None, "green"), (0.1, "orange"), (0.5, "red")),
                "unit": "percentunit",
            },
            "overrides": [],
        },
    }


def health_row(layout: Layout) -> None:
    """The watchdog itself: whether it measures, what it costs, its stops and its errors."""
    layout.row("Watchdog health")
    layout.add(
        stat(
            "Decoding / growth measured",
            "Decoding: 1 while decode steps are observed, 0 when none came for a few seconds or the "
            "generation ended (then nothing is forecast to grow). Growth measured: 1 once two readings "
            "of the caches alive now have measured the growth per step; 0 right after a new decode "
            "starts, when the forecast panels read 'measuring' instead of a number. Stop's forecast: 1 "
            "after a stop, while the forecast panels show the forecast that caused it (the stopped batch "
            "is gone), until a new reading measures the growth again.",
            [
                target(f"mlx_watchdog_decoding{{{SEL}}}", legend="decoding " + LEGEND, ref="A"),
                target(f"mlx_watchdog_rate_known{{{SEL}}}", legend="growth measured " + LEGEND, ref="B"),
                target(
                    f"mlx_watchdog_stop_forecast_held{{{SEL}}}", legend="stop's forecast " + LEGEND, ref="C"
                ),
            ],
            "none",
            thresholds((None, "blue"), (1, "green")),
            mappings=[
                {
                    "type": "value",
                    "options": {"0": {"index": 0, "text": "no"}, "1": {"index": 1, "text": "yes"}},
                }
            ],
        ),
        w=6,
        h=7,
    )
    layout.add(
        timeseries(
            "Watchdog overhead (share of decode time)",
            "Seconds spent inside the watchdog's own bookkeeping per second of wall time while decoding, "
            "i.e. rate(mlx_watchdog_overhead_seconds_total). A few percent or less is expected; the "
            "dashed lines mark 2% and 5% (MLXWatchdogOverheadHigh fires above 5% for 10 minutes).",
            [target(f"rate(mlx_watchdog_overhead_seconds_total{{{SEL}}}[$__rate_interval])")],
            "percentunit",
            custom={"thresholdsStyle": {"mode": "dashed"}},
            th=thresholds((None, "green"), (0.02, "orange"), (0.05, "red")),
            minimum=0,
        ),
        w=6,
        h=7,
    )
    layout.add(
        timeseries(
            "Stops by reason",
            "Generations the watchdog stopped, by `reason`, counted per interval (increase of "
            "mlx_watchdog_stops_total). A stop means the watchdog ended a generation on purpose (for "
            "example before the forecast crash) instead of letting the process die.",
            [
                target(
                    f"sum by (watchdog, reason) (increase(mlx_watchdog_stops_total{{{SEL}}}[$__rate_interval]))",
                    legend="{{reason}} ({{watchdog}})",
                )
            ],
            "short",
            custom={"drawStyle": "bars", "fillOpacity": 80, "lineWidth": 1},
            minimum=0,
            decimals=0,
        ),
        w=6,
        h=7,
    )
    layout.add(
        timeseries(
            "Internal errors",
            "Errors caught inside the watchdog itself (they are never raised into your generation), "
            "counted per interval. Anything above 0 means the numbers on this dashboard may be stale or "
            "wrong: check the process log.",
            [
                target(
                    f"sum by (watchdog, instance, rank) (increase(mlx_watchdog_internal_errors_total{{{SEL}}}[$__rate_interval]))",
                )
            ],
            "short",
            custom={
                "drawStyle": "bars",
                "fillOpacity": 80,
                "lineWidth": 1,
                "thresholdsStyle": {"mode": "area"},
            },
            th=thresholds((None, "green"), (0.5, "red")),
            minimum=0,
            decimals=0,
        ),
        w=6,
        h=7,
    )
    layout.add(
        stat(
            'Leak sites folded into "other"',
            "How many leak sites the exporter summed into the site=\"other\" series of 'Leak per site' "
            "(mlx_watchdog_folded_leak_sites): it keeps the 20 largest per process (start_metrics_server("
            "max_sites=...)) so that a program with many leaking objects cannot flood Prometheus with "
            "series. 0 means every site has its own series.",
            [target(f"mlx_watchdog_folded_leak_sites{{{SEL}}}")],
            "none",
            thresholds((None, "green"), (1, "orange")),
            decimals=0,
        ),
        w=6,
        h=7,
    )
    layout.add(last_stop_stat(), w=6, h=7)
    layout.add(stop_leak_sites(), w=12, h=7)


def last_stop_stat() -> dict:
    last_stop = stat(
        "Last stop",
        "How long ago the watchdog last stopped a generation before the limit, by reason "
        "(mlx_watchdog_last_stop_timestamp_seconds), and the decode steps to the limit its forecast "
        "read then (mlx_watchdog_last_stop_steps_to_limit). Orange within 15 minutes "
        "(MLXWatchdogStopped fires then). The stop's series stay after the stopped batch is gone.",
        [
            target(
                f"time() - max by (watchdog, reason) (mlx_watchdog_last_stop_timestamp_seconds{{{SEL}}})",
                legend="ago: {{reason}} ({{watchdog}})",
                ref="A",
            ),
            target(
                f"min by (watchdog, reason) (mlx_watchdog_last_stop_steps_to_limit{{{SEL}}})",
                legend="steps left then: {{reason}} ({{watchdog}})",
                ref="B",
            ),
        ],
        "s",
        thresholds((None, "orange"), (900, "green")),
        no_value="no stop",
    )
    last_stop["fieldConfig"]["overrides"] = [
        {
            "matcher": {"id": "byFrameRefID", "options": "B"},
            "properties": [
                {"id": "unit", "value": "none"},
                {"id": "decimals", "value": 0},
                {"id": "thresholds", "value": thresholds((None, "text"))},
            ],
        }
    ]
    return last_stop


def stop_leak_sites() -> dict:
    """'Top leak sites' for the forecast of the last stop of each reason."""
    top_sites = top_leak_sites()
    stop_sites = {
        **top_sites,
        "title": "Leak sites at the last stop (buffers per step)",
        "description": "The leak sites of the forecast that made the last stop of each reason, by buffers "
        "per step (mlx_watchdog_last_stop_leak_buffers_per_step): what was leaking when the watchdog "
        "stopped the generation, kept after the stopped batch is gone and the readings start again.",
        "targets": [
            target(
                f"max by (watchdog, reason, site) (mlx_watchdog_last_stop_leak_buffers_per_step{{{SEL}}}) > 0",
                legend="{{site}} ({{watchdog}}, {{reason}})",
                instant=True,
            )
        ],
    }
    stop_sites["fieldConfig"] = {
        **top_sites["fieldConfig"],
        "defaults": {**top_sites["fieldConfig"]["defaults"], "noValue": "no stop"},
    }
    return stop_sites


def stop_annotations() -> dict:
    """Grafana's own annotations, and a mark where the watchdog stopped a generation."""
    return {
        "list": [
            {
                "builtIn": 1,
                "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True,
                "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts",
                "type": "dashboard",
            },
            {
                # Grafana 10.4+/11 read the query from `target`; the legacy
                # top-level `expr` is kept for older importers.
                "datasource": DS,
                "enable": True,
                "expr": STOPS_ANNOTATION,
                "hide": False,
                "iconColor": "orange",
                "name": "Watchdog stops",
                "step": "",
                "tagKeys": "watchdog,reason",
                "target": {"datasource": DS, "expr": STOPS_ANNOTATION, "interval": "", "refId": "Anno"},
                "textFormat": "{{watchdog}}: generation stopped ({{reason}})",
                "titleFormat": "watchdog stop: {{reason}}",
                "useValueForTime": False,
            },
        ]
    }


def query_var(name: str, label: str, query: str, description: str) -> dict:
    """A variable that picks among the values ``query`` lists, any number of them (All: `.*`)."""
    return {
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": DS,
        "definition": query,
        "description": description,
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": query,
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def variables() -> list[dict]:
    """Pick the data source, then the watched processes: by watchdog, instance and rank."""
    return [
        {
            "current": {},
            "description": "The Prometheus data source that scrapes the mlx-watchdog exporters.",
            "hide": 0,
            "includeAll": False,
            "label": "Data source",
            "multi": False,
            "name": "datasource",
            "options": [],
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "skipUrlSync": False,
            "type": "datasource",
        },
        query_var(
            "watchdog",
            "Watchdog",
            "label_values(mlx_watchdog_info, watchdog)",
            "The watchdog (model) name given to mlx-watchdog.",
        ),
        query_var(
            "instance",
            "Instance",
            'label_values(mlx_watchdog_info{watchdog=~"$watchdog"}, instance)',
            "host:port of the exporter (one per process; base port + rank in multi-rank runs).",
        ),
        query_var(
            "rank",
            "Rank",
            'label_values(mlx_watchdog_info{watchdog=~"$watchdog",instance=~"$instance"}, rank)',
            "Distributed rank; empty for single-process runs (All still matches them).",
        ),
    ]


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run python3 {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
