"""Tests for grafana/: Prometheus alert rules, example Prometheus / Alertmanager
configs, and the Grafana dashboard.

What runs:
  * `promtool check rules`, `promtool test rules`, `promtool check config`;
  * Alertmanager loads grafana/alertmanager.yml;
  * the dashboard JSON: schema, data sources, ids, layout, descriptions, units,
    and that it matches grafana/make_dashboard.py;
  * every PromQL expression of the dashboard and of the rules is sent to a real
    Prometheus (started here on a free loopback port, on a throw-away TSDB that
    is backfilled with synthetic exporter data), which must parse it; every
    dashboard query must also return data for that synthetic data set;
  * every metric name used is one the exporter exposes (see CONTRACT below).

Prometheus, promtool and Alertmanager come from Debian's `prometheus` and
`prometheus-alertmanager` packages (`make system-deps`). Without them these
tests are skipped with a loud reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import subprocess
import time
from pathlib import Path

import pytest
from support import (
    JOB,
    http_get,
    prom_api,
    require_binary,
    start_alertmanager,
    start_prometheus,
    stop_process,
)

yaml = pytest.importorskip("yaml", reason="pyyaml is needed (pip install pyyaml; it is in the [test] extra)")

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "mlx-watchdog.json"
GENERATOR = GRAFANA / "make_dashboard.py"
RULES = GRAFANA / "rules" / "mlx-watchdog-alerts.yml"
RULE_TESTS = GRAFANA / "rules" / "mlx-watchdog-alerts.test.yml"
PROM_CONFIGS = [GRAFANA / "prometheus.yml", GRAFANA / "prometheus-multi-host.yml"]
ALERTMANAGER_CONFIG = GRAFANA / "alertmanager.yml"
FILE_SD_TARGETS = GRAFANA / "targets" / "mlx-watchdog.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
DS = {"type": "prometheus", "uid": "${datasource}"}

# The exporter's metric contract: sample names as Prometheus stores them
# (counters with their `_total` suffix). Used when the exporter itself cannot be
# imported; see exposed_names().
CONTRACT = frozenset(
    {
        # gauges
        "mlx_watchdog_resident_buffers",
        "mlx_watchdog_peak_resident_buffers",
        "mlx_watchdog_bounded_site_peak_buffers",
        "mlx_watchdog_resource_limit_buffers",
        "mlx_watchdog_buffers_per_step",
        "mlx_watchdog_steps_to_limit",
        "mlx_watchdog_time_to_limit_seconds",
        "mlx_watchdog_pending_graph_nodes",
        "mlx_watchdog_leak_buffers_per_step",
        "mlx_watchdog_folded_leak_sites",
        "mlx_watchdog_memory_active_bytes",
        "mlx_watchdog_memory_peak_bytes",
        "mlx_watchdog_memory_cache_bytes",
        "mlx_watchdog_memory_limit_bytes",
        "mlx_watchdog_prefill_graph_nodes",
        "mlx_watchdog_max_safe_prefill_tokens",
        "mlx_watchdog_info",
        "mlx_watchdog_stop_forecast_held",
        "mlx_watchdog_last_stop_timestamp_seconds",
        "mlx_watchdog_last_stop_steps_to_limit",
        "mlx_watchdog_last_stop_leak_buffers_per_step",
        "mlx_watchdog_fixed_leak_buffers_per_step",
        "mlx_watchdog_unattributed_buffers_per_step",
        "mlx_watchdog_decoding",
        "mlx_watchdog_rate_known",
        "mlx_watchdog_compiled_signatures",
        "mlx_watchdog_compiled_entry_buffers",
        # counters
        "mlx_watchdog_steps_total",
        "mlx_watchdog_materialized_arrays_total",
        "mlx_watchdog_reclaimed_buffers_total",
        "mlx_watchdog_fix_failures_total",
        "mlx_watchdog_stops_total",
        "mlx_watchdog_overhead_seconds_total",
        "mlx_watchdog_internal_errors_total",
    }
)
METRIC_NAME = re.compile(r"\bmlx_watchdog_[a-z_]+\b")


# --------------------------------------------------------------------------- helpers
def run(cmd: list[str], cwd: Path | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def exposed_names() -> tuple[frozenset[str], str]:
    """Metric sample names the exporter exposes, and where that list came from.

    The exporter (mlx_watchdog.exporters.prometheus) is written separately. It is
    OPTIONAL here: if it is importable and provides exposed_metric_names()
    (returning the set of sample names, counters with `_total`), the dashboard and
    rules are checked against the real exporter; otherwise against CONTRACT.
    """
    try:
        module = importlib.import_module("mlx_watchdog.exporters.prometheus")
    except ImportError:
        return CONTRACT, "the CONTRACT list in tests/test_grafana.py (exporter not importable)"
    fn = getattr(module, "exposed_metric_names", None)
    if fn is None:
        return CONTRACT, "the CONTRACT list in tests/test_grafana.py (exporter has no exposed_metric_names())"
    return frozenset(fn()), "mlx_watchdog.exporters.prometheus.exposed_metric_names()"


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside collapsed rows
    return out


def dashboard_queries(dash: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every Prometheus annotation."""
    out = []
    for p in all_panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} target {t['refId']}", t["expr"]))
    for a in dash.get("annotations", {}).get("list", []):
        if a.get("builtIn"):
            continue
        expr = a.get("target", {}).get("expr")
        assert expr, f"annotation {a['name']!r}: no target.expr"
        assert a.get("expr", expr) == expr, f"annotation {a['name']!r}: expr and target.expr differ"
        out.append((f"annotation {a['name']!r}", expr))
    return out


def template_vars(dash: dict) -> list[dict]:
    return dash["templating"]["list"]


LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S
)


def variable_queries(dash: dict) -> list[tuple[str, str, str]]:
    """(variable name, series selector, label) for every label_values() variable."""
    out = []
    for v in template_vars(dash):
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = LABEL_VALUES.match(q)
        assert m, f"variable {v['name']}: expected label_values(<selector>, <label>), got {q!r}"
        out.append((v["name"], m["selector"], m["label"]))
    return out


GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "1m", "__range": "30m"}
VAR_REF = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Interpolate Grafana variables the way Grafana would for Prometheus."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name in values:
            return values[name]
        raise AssertionError(f"unknown Grafana variable ${name} in {expr!r}")

    return VAR_REF.sub(repl, expr)


ALL = {"watchdog": ".*", "instance": ".*", "rank": ".*"}


def load_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [r for g in doc["groups"] for r in g["rules"]]


def rule_thresholds() -> dict[str, float]:
    out = {}
    for r in load_rules():
        m = re.fullmatch(r"\s*vector\(\s*([0-9.e+-]+)\s*\)\s*", r.get("expr", ""))
        if "record" in r and m:
            out[r["record"]] = float(m[1])
    return out


# --------------------------------------------------------------------------- promtool
def test_promtool_check_rules():
    promtool = require_binary("promtool")
    r = run([promtool, "check", "rules", str(RULES)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_test_rules():
    promtool = require_binary("promtool")
    r = run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_the_job_name_is_changed_in_one_place(tmp_path):
    # Rename the scrape job in the one rule that names it, and the job in the test data: every
    # rule test passes again. No other rule may name the job.
    promtool = require_binary("promtool")
    job_rules = [r for r in load_rules() if "job=" in r["expr"]]
    assert [r.get("record") for r in job_rules] == ["mlx_watchdog:up"], "the job name is in one rule only"
    rules = RULES.read_text(encoding="utf-8")
    (tmp_path / RULES.name).write_text(rules.replace(f'job="{JOB}"', 'job="llm-serve"'), encoding="utf-8")
    tests = RULE_TESTS.read_text(encoding="utf-8")
    renamed = re.sub(rf'job="{JOB}"', 'job="llm-serve"', tests)
    renamed = re.sub(rf"job: {JOB}\b", "job: llm-serve", renamed)
    renamed = re.sub(rf"\bjob {JOB}\b", "job llm-serve", renamed)  # in the expected annotations
    assert renamed.count("llm-serve") > 50
    (tmp_path / RULE_TESTS.name).write_text(renamed, encoding="utf-8")
    r = run([promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr
    # And the original rules do not see the renamed job: the one place is the one that counts.
    (tmp_path / RULES.name).write_text(rules, encoding="utf-8")
    r = run([promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path)
    assert r.returncode != 0


@pytest.mark.parametrize("config", PROM_CONFIGS, ids=lambda p: p.name)
def test_promtool_check_config(config: Path):
    # Also checks the rule files and the file_sd target files the config names.
    promtool = require_binary("promtool")
    r = run([promtool, "check", "config", config.name], cwd=config.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_rule_tests_cover_every_alert_firing_and_silent():
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    expected = {
        "MLXWatchdogResourceLimitSoon",
        "MLXWatchdogResourceLimitImminent",
        "MLXWatchdogLeakSiteGrowing",
        "MLXWatchdogUnattributedGrowth",
        "MLXWatchdogTargetAbsent",
        "MLXWatchdogCannotMeasure",
    }
    assert expected <= alerts
    doc = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    firing, silent = set(), set()
    for t in doc["tests"]:
        for a in t.get("alert_rule_test", []):
            (firing if a.get("exp_alerts") else silent).add(a["alertname"])
    assert alerts - firing == set(), "alerts without a firing test case"
    assert alerts - silent == set(), "alerts without a not-firing test case"
    for r in load_rules():
        if "alert" in r:
            assert r["labels"]["severity"] in {"warning", "critical"}
            assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_prometheus_examples_scrape_the_watchdog():
    single = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in single["scrape_configs"]}
    assert jobs[JOB]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
    assert single["rule_files"] == ["rules/mlx-watchdog-alerts.yml"]
    assert single["alerting"]["alertmanagers"]

    multi = yaml.safe_load((GRAFANA / "prometheus-multi-host.yml").read_text())
    job = {j["job_name"]: j for j in multi["scrape_configs"]}[JOB]
    assert job["static_configs"] and job["file_sd_configs"]
    sd = json.loads(FILE_SD_TARGETS.read_text())
    for cfg in [*job["static_configs"], *sd]:
        # The exporter sets these labels itself; a target label would rename them.
        assert not {"watchdog", "rank"} & set(cfg.get("labels", {}))
        for t in cfg["targets"]:
            assert int(t.rsplit(":", 1)[1]) >= 9464  # base port 9464 + rank


def test_alertmanager_config_loads(tmp_path, request):
    proc, url = start_alertmanager(tmp_path, ALERTMANAGER_CONFIG)
    request.addfinalizer(lambda: stop_process(proc))
    status, body = http_get(f"{url}/api/v2/status")
    assert status == 200
    assert "MLXWatchdogResourceLimitImminent" in json.loads(body)["config"]["original"]


# --------------------------------------------------------------------------- dashboard structure
def test_dashboard_matches_generator():
    spec = importlib.util.spec_from_file_location("make_dashboard", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.build() == load_dashboard(), (
        "grafana/dashboards/mlx-watchdog.json differs from grafana/make_dashboard.py: "
        "edit the script and run `python3 grafana/make_dashboard.py`"
    )


def test_dashboard_schema_and_datasources():
    dash = load_dashboard()
    assert dash["schemaVersion"] >= 39
    assert dash["uid"] == "mlx-watchdog" and dash["title"]
    assert "__inputs" not in dash, "provisioning cannot fill __inputs: use the datasource variable"
    ds_vars = [v for v in template_vars(dash) if v["name"] == "datasource"]
    assert len(ds_vars) == 1 and ds_vars[0]["type"] == "datasource" and ds_vars[0]["query"] == "prometheus"

    for p in all_panels(dash):
        assert p.get("datasource") == DS, (
            f"panel {p['id']} {p.get('title')!r}: datasource {p.get('datasource')}"
        )
        for t in p.get("targets", []):
            assert t.get("datasource") == DS, (
                f"panel {p['id']} target {t.get('refId')}: datasource {t.get('datasource')}"
            )
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), f"panel {p['id']}: duplicate refIds"
    for v in template_vars(dash):
        if v["type"] == "query":
            assert v["datasource"] == DS
    for a in dash["annotations"]["list"]:
        if not a.get("builtIn"):
            assert a["datasource"] == DS and a["target"]["datasource"] == DS, a["name"]


def test_dashboard_panels_ids_layout_descriptions_units():
    dash = load_dashboard()
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"

    cells: dict[tuple[int, int], int] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, f"panel {p['id']} {p['title']!r} exceeds the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {p['id']} overlap at {(x, y)}"
                cells[(x, y)] = p["id"]

    for p in panels:
        if p["type"] == "row":
            continue
        assert len(p.get("description", "")) >= 60, (
            f"panel {p['id']} {p['title']!r}: needs a real description"
        )
        assert p["fieldConfig"]["defaults"].get("unit"), f"panel {p['id']} {p['title']!r}: no unit"
        assert p.get("targets"), f"panel {p['id']} {p['title']!r}: no query"

    by_title = {p["title"]: p for p in panels}
    assert by_title["Time to limit"]["fieldConfig"]["defaults"]["unit"] == "s"
    assert (
        by_title["Watchdog overhead (share of decode time)"]["fieldConfig"]["defaults"]["unit"]
        == "percentunit"
    )
    assert by_title["MLX memory vs memory limit"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert by_title["Process resident memory (RSS)"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    for title in ("Steps to limit", "Time to limit"):
        p = by_title[title]
        assert p["type"] == "stat"
        colors = [s["color"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"]]
        assert colors == ["red", "orange", "green"], f"{title}: thresholds {colors}"


def test_dashboard_thresholds_match_alert_rules():
    th = rule_thresholds()
    by_title = {p["title"]: p for p in all_panels(load_dashboard())}

    def steps(title):
        return [s["value"] for s in by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    assert steps("Steps to limit") == [
        None,
        th["mlx_watchdog:alert_threshold_imminent_steps"],
        th["mlx_watchdog:alert_threshold_soon_steps"],
    ]
    assert steps("Time to limit") == [
        None,
        th["mlx_watchdog:alert_threshold_imminent_seconds"],
        th["mlx_watchdog:alert_threshold_soon_seconds"],
    ]


def test_dashboard_template_variables():
    dash = load_dashboard()
    names = [v["name"] for v in template_vars(dash)]
    assert names[0] == "datasource", "the datasource variable must come first (others query it)"
    for name in ("watchdog", "instance", "rank"):
        (v,) = [v for v in template_vars(dash) if v["name"] == name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], name
        # `.*` as All also matches series without the label (single-rank runs have no `rank`).
        assert v["allValue"] == ".*", name
    queried = {name: (sel, label) for name, sel, label in variable_queries(dash)}
    assert {name: label for name, (_, label) in queried.items()} == {
        "watchdog": "watchdog",
        "instance": "instance",
        "rank": "rank",
    }
    for name, (sel, _) in queried.items():
        assert sel.split("{")[0].strip() in {"mlx_watchdog_info", "mlx_watchdog_steps_total"}, name


# --------------------------------------------------------------------------- metric names
def rule_texts() -> list[tuple[str, str]]:
    out = []
    for r in load_rules():
        name = r.get("alert") or r.get("record")
        out.append((f"rule {name} expr", r["expr"]))
        for k, v in r.get("annotations", {}).items():
            out.append((f"rule {name} annotation {k}", v))
    return out


def test_metric_names_are_exposed_by_the_exporter():
    names, source = exposed_names()
    texts = dashboard_queries(load_dashboard()) + rule_texts()
    texts += [(f"variable {n}", sel) for n, sel, _ in variable_queries(load_dashboard())]
    unknown = {(where, m) for where, text in texts for m in METRIC_NAME.findall(text) if m not in names}
    assert not unknown, f"metric names not in {source}: {sorted(unknown)}"


def test_dashboard_shows_every_exported_metric():
    # Every metric the exporter serves is on the dashboard: a new one fails here until a panel
    # shows it (CONTRACT, the list written here, is the exporter's own where it can be imported).
    used = {m for _, e in dashboard_queries(load_dashboard()) for m in METRIC_NAME.findall(e)}
    assert CONTRACT - used == set(), f"contract metrics missing from the dashboard: {sorted(CONTRACT - used)}"
    names, source = exposed_names()
    assert names - used == set(), f"metrics from {source} not on the dashboard: {sorted(names - used)}"
    if names is not CONTRACT:
        assert names == CONTRACT, f"CONTRACT differs from {source}: {sorted(names ^ CONTRACT)}"


def metrics_doc_names() -> set[str]:
    """The sample names in docs/metrics.md's table of metrics: labels dropped, `{a,b}` spelled out."""
    names = set()
    for cell in re.findall(r"^\| `(mlx_watchdog_[^`]+)` \|", METRICS_DOC.read_text(encoding="utf-8"), re.M):
        cell = re.sub(r"\{[a-z_,]+\}$", "", cell)  # the labels: `..._per_step{site}`
        m = re.fullmatch(r"(\w+)\{([a-z,]+)\}(\w+)", cell)  # `mlx_watchdog_memory_{active,peak}_bytes`
        names |= {m[1] + part + m[3] for part in m[2].split(",")} if m else {cell}
    return names


def test_every_metric_docs_metrics_md_lists_is_exported_and_on_the_dashboard():
    documented = metrics_doc_names()
    assert len(documented) > 30 and "mlx_watchdog_memory_cache_bytes" in documented, sorted(documented)
    assert documented == CONTRACT, f"docs/metrics.md and CONTRACT differ: {sorted(documented ^ CONTRACT)}"
    used = {m for _, e in dashboard_queries(load_dashboard()) for m in METRIC_NAME.findall(e)}
    assert documented - used == set(), f"documented, not on the dashboard: {sorted(documented - used)}"


def test_metric_name_extraction():
    expr = 'rate(mlx_watchdog_steps_total{x="1"}[1m]) / on() group_left() mlx_watchdog:alert_threshold_soon_steps'
    assert METRIC_NAME.findall(expr) == ["mlx_watchdog_steps_total"]


# --------------------------------------------------------------------------- a real Prometheus
PROCESSES = [
    # (labels, buffers gained per step, stop reason that occurs midway or None, fix)
    ({"watchdog": "qwen3-4b", "instance": "127.0.0.1:9464"}, 2.0, "forecast", "false"),
    ({"watchdog": "llama-70b", "instance": "10.0.0.1:9464", "rank": "0"}, 0.0, None, "true"),
    ({"watchdog": "llama-70b", "instance": "10.0.0.2:9465", "rank": "1"}, 3.0, "forecast", "false"),
]
SCRAPE = 15  # seconds between synthetic samples
WINDOW = 30 * 60


def _fmt_labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def synthetic_openmetrics(end: int) -> str:
    """Exporter-like data for PROCESSES, one sample per SCRAPE seconds, ending at `end`."""
    start = end - WINDOW
    times = list(range(start, end + 1, SCRAPE))
    step_rate = 25.0
    series: dict[str, list[tuple[dict, list[float]]]] = {}

    def add(name: str, labels: dict, values: list[float]) -> None:
        series.setdefault(name, []).append((labels, values))

    for base, growth, stop_reason, fix in PROCESSES:
        labels = {**base, "job": JOB}
        limit = 499000.0
        steps = [step_rate * (t - start) for t in times]
        resident = [300000.0 + growth * s for s in steps]
        to_limit = [(limit - r) / growth if growth else math.inf for r in resident]
        n = len(times)
        add("mlx_watchdog_resident_buffers", labels, resident)
        # A site the program cuts every 50 steps (a sawtooth of 80 buffers): bounded, no leak.
        add("mlx_watchdog_peak_resident_buffers", labels, [r + 80 for r in resident])
        add("mlx_watchdog_bounded_site_peak_buffers", {**labels, "site": "BatchKVCache.offset"}, [258.0] * n)
        add("mlx_watchdog_resource_limit_buffers", labels, [limit] * n)
        add("mlx_watchdog_buffers_per_step", labels, [growth] * n)
        add("mlx_watchdog_steps_to_limit", labels, to_limit)
        add("mlx_watchdog_time_to_limit_seconds", labels, [s / step_rate for s in to_limit])
        add("mlx_watchdog_pending_graph_nodes", labels, [3 + growth] * n)
        add(
            "mlx_watchdog_leak_buffers_per_step", {**labels, "site": "ArraysCache.left_padding"}, [growth] * n
        )
        add("mlx_watchdog_leak_buffers_per_step", {**labels, "site": "KVCache.keys"}, [0.0] * n)
        add("mlx_watchdog_fixed_leak_buffers_per_step", {**labels, "site": "ArraysCache.offset"}, [1.0] * n)
        # Growth beyond the named sites (the process count's): a quarter of the leaking processes'.
        add("mlx_watchdog_unattributed_buffers_per_step", labels, [growth / 4] * n)
        # A training step compiled for a new batch length every 100 steps, 17 buffers an entry.
        function = {**labels, "function": "mlx_lm.tuner.trainer.step"}
        add("mlx_watchdog_compiled_signatures", function, [1.0 + s // 100 for s in steps])
        add("mlx_watchdog_compiled_entry_buffers", function, [17.0] * n)
        add("mlx_watchdog_folded_leak_sites", labels, [0.0] * n)
        add("mlx_watchdog_decoding", labels, [1] * n)
        add("mlx_watchdog_rate_known", labels, [1] * n)
        add("mlx_watchdog_stop_forecast_held", labels, [0] * n)
        add("mlx_watchdog_memory_active_bytes", labels, [8e9 + 1e3 * s for s in steps])
        add("mlx_watchdog_memory_peak_bytes", labels, [9e9 + 1e3 * s for s in steps])
        add("mlx_watchdog_memory_cache_bytes", labels, [5e8] * n)
        add("mlx_watchdog_memory_limit_bytes", labels, [96e9] * n)
        # The standard process collector's: per target, without the exporter's labels.
        add("process_resident_memory_bytes", {"job": JOB, "instance": base["instance"]}, [2e9] * n)
        add("mlx_watchdog_prefill_graph_nodes", labels, [12000.0] * n)
        add("mlx_watchdog_max_safe_prefill_tokens", labels, [32768.0] * n)
        info = {
            **labels,
            "version": "0.1.0",
            "mlx_version": "0.32.4",
            "mlx_lm_version": "0.32.2",
            "device": "gpu",
            "backend": "metal",
            "fix": fix,
        }
        add("mlx_watchdog_info", info, [1.0] * n)
        add("mlx_watchdog_steps_total", labels, steps)
        add("mlx_watchdog_materialized_arrays_total", labels, [40 * s for s in steps])
        add("mlx_watchdog_fix_failures_total", labels, [float(i // 20) for i in range(n)])
        add("mlx_watchdog_reclaimed_buffers_total", labels, [(40 - growth) * s for s in steps])
        stops = [float(stop_reason is not None and t >= end - 4 * SCRAPE) for t in times]
        add("mlx_watchdog_stops_total", {**labels, "reason": stop_reason or "forecast"}, stops)
        if stop_reason is not None:  # the stop's own series, from the stop on (NaN: no sample)
            before = [math.nan if t < end - 4 * SCRAPE else 1.0 for t in times]
            reason = {**labels, "reason": stop_reason}
            add("mlx_watchdog_last_stop_timestamp_seconds", reason, [(end - 4 * SCRAPE) * b for b in before])
            add("mlx_watchdog_last_stop_steps_to_limit", reason, [40.0 * b for b in before])
            site = {**reason, "site": "ArraysCache.left_padding"}
            add("mlx_watchdog_last_stop_leak_buffers_per_step", site, [growth * b for b in before])
        add("mlx_watchdog_overhead_seconds_total", labels, [0.01 * (t - start) for t in times])
        add("mlx_watchdog_internal_errors_total", labels, [float(i // 40) for i in range(n)])

    lines = []
    for name, entries in series.items():
        for labels, values in entries:
            for t, v in zip(times, values):
                if math.isnan(v):
                    continue
                lines.append(f"{name}{_fmt_labels(labels)} {_fmt_value(v)} {t}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


class Prometheus:
    def __init__(self, url: str, end: int):
        self.url = url
        self.end = end

    def api(self, path: str, **params) -> dict:
        return prom_api(self.url, path, **params)

    def query(self, expr: str) -> dict:
        return self.api("/api/v1/query", query=expr, time=self.end)

    def query_range(self, expr: str) -> dict:
        return self.api("/api/v1/query_range", query=expr, start=self.end - 20 * 60, end=self.end, step=60)

    def label_values(self, selector: str, label: str) -> dict:
        params = {"match[]": selector, "start": self.end - WINDOW, "end": self.end}
        return prom_api(self.url, f"/api/v1/label/{label}/values", method="GET", **params)


@pytest.fixture(scope="module")
def prometheus(request, tmp_path_factory) -> Prometheus:
    """A real Prometheus on a free loopback port, on a temporary TSDB backfilled
    (promtool tsdb create-blocks-from openmetrics) with synthetic exporter data."""
    require_binary("prometheus")
    promtool = require_binary("promtool")
    work = tmp_path_factory.mktemp("prometheus")
    end = int(time.time()) // SCRAPE * SCRAPE - 2 * SCRAPE
    data = work / "data"
    (work / "input.om").write_text(synthetic_openmetrics(end))
    r = run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(work / "input.om"), str(data)], timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # No targets: every query reads the backfilled blocks.
    proc, url = start_prometheus(
        work, storage=data, extra_flags=["--storage.tsdb.retention.time=30d", "--log.level=warn"]
    )
    request.addfinalizer(lambda: stop_process(proc))
    return Prometheus(url, end)


def test_prometheus_rejects_bad_promql(prometheus):
    # Guards the checks below: a parse error must be reported as bad_data.
    bad = prometheus.query("rate(mlx_watchdog_steps_total[5m]")
    assert bad["status"] == "error" and bad["errorType"] == "bad_data", bad
    assert prometheus.query("vector(1)")["status"] == "success"


def test_rule_expressions_parse(prometheus):
    for r in load_rules():
        res = prometheus.query(r["expr"])
        assert res["status"] == "success", f"{r.get('alert') or r.get('record')}: {res.get('error')}"


def test_dashboard_expressions_parse(prometheus):
    for where, expr in dashboard_queries(load_dashboard()):
        q = substitute(expr, ALL)
        res = prometheus.query(q)
        assert res["status"] == "success", f"{where}: {q!r}: {res.get('errorType')}: {res.get('error')}"


def test_variable_queries_are_valid_and_find_values(prometheus):
    dash = load_dashboard()
    for name, selector, label in variable_queries(dash):
        sel = substitute(selector, ALL)
        res = prometheus.label_values(sel, label)
        assert res["status"] == "success", f"variable {name}: {sel!r}: {res.get('error')}"
        assert res["data"], f"variable {name}: no values for {sel!r}"
    # the selector must also be valid PromQL on its own
    for name, selector, _ in variable_queries(dash):
        res = prometheus.query(substitute(selector, ALL))
        assert res["status"] == "success", f"variable {name}: {res.get('error')}"


@pytest.mark.parametrize(
    "values",
    [
        ALL,  # everything ("All" everywhere)
        {"watchdog": "qwen3-4b", "instance": ".*", "rank": ".*"},  # a single-process run: no rank label
        {"watchdog": "(llama-70b|qwen3-4b)", "instance": ".*", "rank": "1"},  # multi-select + one rank
    ],
    ids=["all", "single-process", "one-rank"],
)
def test_dashboard_queries_return_data(prometheus, values):
    dash = load_dashboard()
    empty = []
    for where, expr in dashboard_queries(dash):
        q = substitute(expr, values)
        res = prometheus.query_range(q)
        assert res["status"] == "success", f"{where}: {q!r}: {res.get('error')}"
        if not res["data"]["result"]:
            empty.append(f"{where}: {q}")
    assert not empty, "queries without data for the synthetic exporter data:\n" + "\n".join(empty)


def test_forecast_panels_see_the_worst_rank(prometheus):
    # Steps-to-limit per rank: the flat rank is +Inf, the leaking one finite.
    res = prometheus.query(
        substitute('mlx_watchdog_steps_to_limit{watchdog=~"$watchdog",rank=~"$rank"}', ALL)
    )
    by_rank = {s["metric"].get("rank", ""): float(s["value"][1]) for s in res["data"]["result"]}
    assert math.isinf(by_rank["0"]) and by_rank["1"] < 1e6 and by_rank[""] < 1e6


def panel_expr(title: str, ref: str = "A") -> str:
    [panel] = [p for p in all_panels(load_dashboard()) if p["title"] == title]
    [expr] = [t["expr"] for t in panel["targets"] if t["refId"] == ref]
    return substitute(expr, ALL)


def test_growth_panels_split_named_sites_from_unattributed_growth(prometheus):
    # The synthetic processes grow `growth` a step at their one leaking site, and a quarter of it
    # beyond (unattributed): each part is read apart, per process, and ranked among the sites.
    growth = {(b.get("rank", ""), b["watchdog"]): g for b, g, _, _ in PROCESSES}

    def by_process(expr: str) -> dict:
        res = prometheus.query(expr)["data"]["result"]
        return {(s["metric"].get("rank", ""), s["metric"]["watchdog"]): float(s["value"][1]) for s in res}

    split = "Growth per step: named sites vs unattributed"
    assert by_process(panel_expr(split, "A")) == growth
    assert by_process(panel_expr(split, "B")) == {k: g / 4 for k, g in growth.items()}
    res = prometheus.query(panel_expr("Top leak sites (buffers per step)"))["data"]["result"]
    ranked = [(s["metric"]["site"], s["metric"]["watchdog"], float(s["value"][1])) for s in res]
    assert sorted(ranked) == sorted(
        [
            ("ArraysCache.left_padding", "llama-70b", 3.0),
            ("ArraysCache.left_padding", "qwen3-4b", 2.0),
            ("unattributed (outside the caches)", "llama-70b", 0.75),
            ("unattributed (outside the caches)", "qwen3-4b", 0.5),
        ]
    )


def test_compiled_panels_read_one_series_per_process_and_function(prometheus):
    # Each process's trainer step kept a signature per 100 steps (1 + steps // 100), 17 buffers
    # each; the share of the limit is what the cache holds over the 499000-buffer limit.
    steps = 25.0 * WINDOW  # the synthetic step rate times the window: the last sample's count
    signatures = 1 + steps // 100
    title = "Compiled functions: input signatures kept, buffers per entry"
    for ref, value in (("A", signatures), ("B", 17.0)):
        res = prometheus.query(panel_expr(title, ref))["data"]["result"]
        assert len(res) == len(PROCESSES) and all("watchdog" not in s["metric"] for s in res), res
        assert {float(s["value"][1]) for s in res} == {value}
        assert {s["metric"]["function"] for s in res} == {"mlx_lm.tuner.trainer.step"}
    res = prometheus.query(panel_expr("Compiled caches: share of the buffer limit"))["data"]["result"]
    assert len(res) == len(PROCESSES), res
    for s in res:
        assert float(s["value"][1]) == pytest.approx(signatures * 17 / 499000), s
