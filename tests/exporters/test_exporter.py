"""Tests of mlx_watchdog.exporters.prometheus: the exposition during a real leaky decode, promtool's
lint, the HTTP server (TLS, errors), and a real Prometheus scraping it.

The leaky decode: mlx-lm's BatchGenerator on a tiny hybrid qwen3_next with equal-length prompts
keeps (linear-attention layers - 1) more buffers each step in ArraysCache.left_padding; 8 layers
with full attention every 4th -> 6 linear layers -> 5 buffers per step.

promtool and prometheus come from Debian's `prometheus` package: missing locally, their tests
skip with a loud reason; under CI=true they fail.
"""

import asyncio
import datetime
import gc
import io
import math
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import psutil
import pytest
from mlx_lm.generate import BatchGenerator
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from support import (
    FakeClock,
    busy_port,
    free_port,
    http_get,
    log_tail,
    prom_query,
    require_binary,
    start_prometheus,
    stop_process,
)

import mlx_watchdog
from mlx_watchdog import ResourceLimitForecast, Watchdog, watch
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.core import coordination
from mlx_watchdog.core.limits import device_name
from mlx_watchdog.exporters import prometheus as exporter
from mlx_watchdog.exporters import server as exporter_server
from mlx_watchdog.tiny import build_model, tiny_prompts

# The contract the dashboard and alert rules query, written out here independently of the
# exporter's own table.
GAUGES = {
    "mlx_watchdog_resident_buffers",
    "mlx_watchdog_peak_resident_buffers",
    "mlx_watchdog_bounded_site_peak_buffers",
    "mlx_watchdog_resource_limit_buffers",
    "mlx_watchdog_buffers_per_step",
    "mlx_watchdog_steps_to_limit",
    "mlx_watchdog_time_to_limit_seconds",
    "mlx_watchdog_pending_graph_nodes",
    "mlx_watchdog_leak_buffers_per_step",
    "mlx_watchdog_fixed_leak_buffers_per_step",
    "mlx_watchdog_unattributed_buffers_per_step",
    "mlx_watchdog_folded_leak_sites",
    "mlx_watchdog_memory_active_bytes",
    "mlx_watchdog_memory_peak_bytes",
    "mlx_watchdog_memory_cache_bytes",
    "mlx_watchdog_memory_limit_bytes",
    "mlx_watchdog_info",
    "mlx_watchdog_prefill_graph_nodes",
    "mlx_watchdog_max_safe_prefill_tokens",
    "mlx_watchdog_rate_known",
    "mlx_watchdog_decoding",
    "mlx_watchdog_stop_forecast_held",
    "mlx_watchdog_last_stop_timestamp_seconds",
    "mlx_watchdog_last_stop_steps_to_limit",
    "mlx_watchdog_last_stop_leak_buffers_per_step",
    "mlx_watchdog_compiled_signatures",
    "mlx_watchdog_compiled_entry_buffers",
}
COUNTERS = {  # sample names; the family names lack "_total"
    "mlx_watchdog_steps_total",
    "mlx_watchdog_materialized_arrays_total",
    "mlx_watchdog_fix_failures_total",
    "mlx_watchdog_reclaimed_buffers_total",
    "mlx_watchdog_stops_total",
    "mlx_watchdog_overhead_seconds_total",
    "mlx_watchdog_internal_errors_total",
}
EXTRA_LABELS = {
    "mlx_watchdog_leak_buffers_per_step": {"site"},
    "mlx_watchdog_fixed_leak_buffers_per_step": {"site"},
    "mlx_watchdog_bounded_site_peak_buffers": {"site"},
    "mlx_watchdog_compiled_signatures": {"function"},
    "mlx_watchdog_compiled_entry_buffers": {"function"},
    "mlx_watchdog_stops_total": {"reason"},
    "mlx_watchdog_last_stop_timestamp_seconds": {"reason"},
    "mlx_watchdog_last_stop_steps_to_limit": {"reason"},
    "mlx_watchdog_last_stop_leak_buffers_per_step": {"reason", "site"},
    "mlx_watchdog_info": {"version", "mlx_version", "mlx_lm_version", "device", "backend", "fix"},
}
LAST_STOP = {  # exported once a stop of that reason happened
    "mlx_watchdog_last_stop_timestamp_seconds",
    "mlx_watchdog_last_stop_steps_to_limit",
    "mlx_watchdog_last_stop_leak_buffers_per_step",
}
LEAK_SITE = "ArraysCache.left_padding"
LEAK_PER_STEP = 5  # 8 layers, full attention every 4th: 6 linear-attention layers - 1
LIMIT = 20_000


# --------------------------------------------------------------------------- helpers


def families_of(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def scrape(registry) -> dict:
    return families_of(generate_latest(registry).decode())


def samples(families: dict, sample_name: str, **labels) -> list:
    """Samples named ``sample_name`` whose labels include ``labels``."""
    out = []
    for family in families.values():
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                out.append(s)
    return out


def value(families: dict, sample_name: str, **labels) -> float:
    found = samples(families, sample_name, **labels)
    assert len(found) == 1, f"{sample_name}{labels}: expected one sample, got {found}"
    return found[0].value


@pytest.fixture(scope="module", autouse=True)
def watchdog_time():
    """The module's decodes run the watchdog on the fake clock (support.FakeClock), a step 10 ms
    after the last, walks free: when it walks, and whether a decode that holds still between two
    tests still reads as decoding, are the same on any machine, at any load."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        clock = FakeClock().install(monkeypatch)
        clock.step_each_observe(monkeypatch, 0.01)
        yield clock


class Decode:
    """A watched BatchGenerator decode that the test steps forward explicitly."""

    def __init__(self, name: str, layers: int, prompts: list, limit: int = LIMIT, fix: bool = False):
        self.model = build_model("qwen3_next", layers=layers)
        # A generous walk budget: measured often, so the rate is known within a few steps even
        # when one early walk is slow on a loaded machine (the default 1% can then wait seconds).
        self.wd = Watchdog(limit=limit, name=name, overhead_budget=0.5, walk_interval=0, fix=fix)
        watch_model(self.model, self.wd)
        self.gen = BatchGenerator(self.model, max_tokens=100_000)
        self.gen.insert(prompts)

    def advance(self, steps: int) -> None:
        for _ in range(steps):
            assert self.gen.next_generated(), "the decode ended early"

    def close(self) -> None:
        self.gen.close()
        unwatch_model(self.model)


@pytest.fixture(scope="module")
def leaky():
    decode = Decode("exp-leaky", 8, tiny_prompts(2, 6, 512, seed=1))  # equal lengths: leaks
    decode.advance(40)
    yield decode
    decode.close()


@pytest.fixture(scope="module")
def flat():
    # Unequal prompt lengths: mlx-lm right-pads and sets left_padding=None, nothing leaks.
    prompts = [tiny_prompts(1, 4, 512, seed=2)[0], tiny_prompts(1, 7, 512, seed=3)[0]]
    decode = Decode("exp-flat", 4, prompts)
    decode.advance(30)
    yield decode
    decode.close()


@pytest.fixture(scope="module")
def fixed():
    decode = Decode("exp-fixed", 8, tiny_prompts(2, 6, 512, seed=1), fix=True)  # the leak, fixed
    decode.advance(60)
    yield decode
    decode.close()


class SawtoothCache:
    def __init__(self):
        self.offset = mx.array(0)


@pytest.fixture(scope="module")
def sawtooth(counter):
    """Two chains the program cuts every 8 steps (it evaluates its cache state): bounded, no
    leak. The exact count after each step goes with it."""
    base = counter.live(collect=True)  # garbage of tests before is not freed in the middle of this one
    caches = [SawtoothCache(), SawtoothCache()]
    mx.eval([c.offset for c in caches])
    wd = Watchdog(name="exp-sawtooth", overhead_budget=0.5, walk_interval=0)
    live = []
    for n in range(1, 61):
        wd.observe(caches)
        for c in caches:
            c.offset = c.offset - 1
        if n % 8 == 0:
            mx.eval([c.offset for c in caches])
        live.append(counter.live() - base)
    yield wd, live
    wd.export = False


@pytest.fixture
def registry():
    reg = CollectorRegistry()
    exporter.register_collector(reg)
    return reg


# --------------------------------------------------------------------------- exposition


def test_promtool_check_metrics_has_no_findings(leaky, flat, fixed, sawtooth, registry):
    promtool = require_binary("promtool")
    prefill = Watchdog(name="exp-prefill")  # fills the families a decode leaves empty
    # the readings a prefill guard installed on the watchdog gives its forecast
    prefill.prefill_guard = types.SimpleNamespace(graph_nodes=149_000, safe_tokens=900)
    prefill.record_stop("forecast", leaky.wd.forecast())  # a forecast with a leak site
    prefill.record_stop("coordinator")
    # a compiled function that keeps a cache entry of 3 buffers (its families are the process's)
    from mlx_watchdog.core import compiled

    scaled = compiled.CompiledFunction("exp.scaled")
    scaled.traced(("signature",), 0)
    scaled.measured(3)
    compiled.register(scaled)
    try:
        text = generate_latest(registry)
    finally:
        compiled.unregister(scaled)
    names = {s.name for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert exporter.exposed_metric_names() <= names, "every family should have a sample here"
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    findings = (result.stdout + result.stderr).decode().strip()
    assert result.returncode == 0 and findings == "", f"promtool check metrics:\n{findings}"
    del prefill


def test_names_types_help_and_labels(leaky, flat):
    assert exporter.exposed_metric_names() == GAUGES | COUNTERS
    # These two only: a watchdog of another test module with world_size > 1 would add `rank`.
    registry = CollectorRegistry()
    registry.register(exporter.WatchdogCollector([leaky.wd, flat.wd]))
    families = scrape(registry)
    ours = {name: f for name, f in families.items() if name.startswith("mlx_watchdog_")}
    for family in ours.values():
        if family.name + "_total" in COUNTERS:
            assert family.type == "counter", family.name
        else:
            assert family.name in GAUGES and family.type == "gauge", (family.name, family.type)
        assert len(family.documentation.split()) >= 4, (
            f"{family.name}: HELP too short: {family.documentation!r}"
        )
        for s in family.samples:
            assert s.name in GAUGES | COUNTERS, s.name
            assert set(s.labels) == {"watchdog"} | EXTRA_LABELS.get(s.name, set()), (s.name, s.labels)
    # Both watchdogs, under their own names, in every family of per-watchdog readings.
    for name in ("exp-leaky", "exp-flat"):
        for sample_name in (
            (GAUGES | COUNTERS)
            - {
                "mlx_watchdog_leak_buffers_per_step",
                "mlx_watchdog_fixed_leak_buffers_per_step",
                "mlx_watchdog_bounded_site_peak_buffers",
                "mlx_watchdog_prefill_graph_nodes",
                "mlx_watchdog_max_safe_prefill_tokens",
                "mlx_watchdog_compiled_signatures",  # while a compiled function keeps an entry
                "mlx_watchdog_compiled_entry_buffers",
            }
            - LAST_STOP
        ):
            assert samples(families, sample_name, watchdog=name), (sample_name, name)
    # Prefill readings are left out while unknown (None), not exported as 0.
    assert not samples(families, "mlx_watchdog_prefill_graph_nodes", watchdog="exp-leaky")
    info = samples(families, "mlx_watchdog_info", watchdog="exp-leaky")[0]
    assert info.value == 1
    assert info.labels["version"] == mlx_watchdog.__version__
    assert info.labels["mlx_version"] == mx.__version__
    assert info.labels["device"] == device_name()
    assert info.labels["backend"] == (
        "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "cpu"
    )
    assert info.labels["fix"] == "false"
    assert info.labels["mlx_lm_version"].count(".") >= 1


def test_values_match_the_forecast_during_a_leaky_decode(leaky, flat, registry):
    wd = leaky.wd
    for _ in range(2):  # two moments of the same decode: the readings move with it
        leaky.advance(25)
        flat.advance(5)
        families = scrape(registry)
        f = wd.forecast()  # same thread, no step in between: the same state the scrape read
        label = {"watchdog": "exp-leaky"}
        assert value(families, "mlx_watchdog_resident_buffers", **label) == f.resident_buffers
        assert value(families, "mlx_watchdog_resource_limit_buffers", **label) == LIMIT
        assert value(families, "mlx_watchdog_buffers_per_step", **label) == pytest.approx(f.buffers_per_step)
        assert f.buffers_per_step == pytest.approx(LEAK_PER_STEP, rel=0.1)
        assert value(families, "mlx_watchdog_steps_to_limit", **label) == pytest.approx(f.steps_to_limit)
        assert math.isfinite(f.steps_to_limit) and f.steps_to_limit > 0
        assert value(families, "mlx_watchdog_time_to_limit_seconds", **label) == pytest.approx(
            f.seconds_to_limit
        )
        assert f.seconds_to_limit == pytest.approx(f.steps_to_limit / f.step_rate) and f.step_rate > 0
        assert value(families, "mlx_watchdog_pending_graph_nodes", **label) == f.pending_graph_nodes
        assert value(families, "mlx_watchdog_folded_leak_sites", **label) == 0
        assert [leak.site for leak in f.leaks] == [LEAK_SITE]
        assert value(
            families, "mlx_watchdog_leak_buffers_per_step", site=LEAK_SITE, **label
        ) == pytest.approx(f.leaks[0].buffers_per_step)
        assert value(families, "mlx_watchdog_steps_total", **label) == wd.steps == f.step
        assert value(families, "mlx_watchdog_overhead_seconds_total", **label) == pytest.approx(
            wd.overhead_seconds
        )
        assert value(families, "mlx_watchdog_internal_errors_total", **label) == wd.internal_errors == 0
        assert value(families, "mlx_watchdog_stops_total", reason="forecast", **label) == 0
        assert value(families, "mlx_watchdog_materialized_arrays_total", **label) == 0  # fix=False
        assert value(families, "mlx_watchdog_fix_failures_total", **label) == 0
    # The other watchdog: the same model family without the leak.
    flat_label = {"watchdog": "exp-flat"}
    assert value(families, "mlx_watchdog_buffers_per_step", **flat_label) == 0
    assert value(families, "mlx_watchdog_steps_to_limit", **flat_label) == math.inf
    assert value(families, "mlx_watchdog_time_to_limit_seconds", **flat_label) == math.inf
    assert not samples(families, "mlx_watchdog_leak_buffers_per_step", **flat_label)
    assert value(families, "mlx_watchdog_steps_total", **flat_label) == flat.wd.steps


def test_a_leak_the_fix_cuts_is_exported_apart(fixed, registry):
    # With the fix on, the leak is still named (what it would add), but as repaired: the alert on
    # mlx_watchdog_leak_buffers_per_step is for leaks nothing repairs.
    families = scrape(registry)
    label = {"watchdog": "exp-fixed"}
    assert [(leak.site, leak.cut) for leak in fixed.wd.forecast().leaks] == [(LEAK_SITE, True)]
    assert value(
        families, "mlx_watchdog_fixed_leak_buffers_per_step", site=LEAK_SITE, **label
    ) == pytest.approx(LEAK_PER_STEP, rel=0.1)
    assert not samples(families, "mlx_watchdog_leak_buffers_per_step", **label)
    assert value(families, "mlx_watchdog_buffers_per_step", **label) < 0.5
    assert "(cut by the fix)" in fixed.wd.forecast().describe()


def test_memory_readings(leaky, registry):
    families = scrape(registry)
    label = {"watchdog": "exp-leaky"}
    active = value(families, "mlx_watchdog_memory_active_bytes", **label)
    assert 0 < active <= value(families, "mlx_watchdog_memory_peak_bytes", **label)
    assert value(families, "mlx_watchdog_memory_cache_bytes", **label) >= 0
    assert value(families, "mlx_watchdog_memory_limit_bytes", **label) == mx.get_memory_limit()
    # The process's memory is the standard process collector's, not a watchdog metric.
    assert not [name for name in families if "process" in name and name.startswith("mlx_watchdog")]


def test_export_false_is_left_out_unless_listed(leaky, registry):
    hidden = Watchdog(name="exp-hidden", export=False)
    assert not samples(scrape(registry), "mlx_watchdog_steps_total", watchdog="exp-hidden")
    assert samples(scrape(registry), "mlx_watchdog_steps_total", watchdog="exp-leaky")
    # An explicit list exports exactly those watchdogs.
    own = CollectorRegistry()
    own.register(exporter.WatchdogCollector([hidden]))
    families = scrape(own)
    assert {s.labels["watchdog"] for s in families["mlx_watchdog_steps"].samples} == {"exp-hidden"}


def ranks(rank: int, world_size: int):
    """A coordinator of a distributed job, as far as the exporter reads it (core/coordination.py)."""
    return types.SimpleNamespace(
        rank=rank, world_size=world_size, worst=lambda step, steps_to_limit: steps_to_limit
    )


def test_rank_label_in_a_distributed_job():
    wd = Watchdog(name="exp-ranked", export=False)
    wd.coordinator = ranks(3, 4)
    reg = CollectorRegistry()
    reg.register(exporter.WatchdogCollector([wd]))
    families = scrape(reg)
    ours = [s for f in families.values() for s in f.samples]
    assert ours and all(s.labels["rank"] == "3" and s.labels["watchdog"] == "exp-ranked" for s in ours)


def test_one_broken_watchdog_does_not_break_the_scrape(leaky):
    broken = Watchdog(name="exp-broken", export=False)

    def fail():
        raise RuntimeError("forecast failed")

    broken.forecast = fail
    reg = CollectorRegistry()
    reg.register(exporter.WatchdogCollector([broken, leaky.wd]))
    families = scrape(reg)
    assert samples(families, "mlx_watchdog_steps_total", watchdog="exp-leaky")
    # Of the broken one only its counters go out (an alert on internal errors can see it).
    mine = {s.name for f in families.values() for s in f.samples if s.labels.get("watchdog") == "exp-broken"}
    assert mine == {"mlx_watchdog_steps_total", "mlx_watchdog_internal_errors_total"}
    assert value(families, "mlx_watchdog_internal_errors_total", watchdog="exp-broken") == 1
    assert broken.internal_errors == 1
    families = scrape(reg)
    assert broken.internal_errors == 2  # counted once per failed scrape
    assert value(families, "mlx_watchdog_internal_errors_total", watchdog="exp-broken") == 2


def test_same_names_get_distinct_labels():
    first, second = Watchdog(name="exp-twin", export=False), Watchdog(name="exp-twin", export=False)
    reg = CollectorRegistry()
    reg.register(exporter.WatchdogCollector([first, second]))
    text = generate_latest(reg)
    labels = [s.labels["watchdog"] for s in families_of(text.decode())["mlx_watchdog_steps"].samples]
    assert sorted(labels) == ["exp-twin", "exp-twin-2"]
    again = [s.labels["watchdog"] for s in scrape(reg)["mlx_watchdog_steps"].samples]
    assert again == labels  # stable across scrapes


def test_a_name_left_by_an_unexported_watchdog_is_free_again(registry):
    old = Watchdog(name="exp-swap")
    assert samples(scrape(registry), "mlx_watchdog_steps_total", watchdog="exp-swap")
    old.export = False  # as `serve` does when a model is unloaded; the object may live on
    new = Watchdog(name="exp-swap")
    new.steps = 7
    assert value(scrape(registry), "mlx_watchdog_steps_total", watchdog="exp-swap") == 7
    assert not samples(scrape(registry), "mlx_watchdog_steps_total", watchdog="exp-swap-2")


def test_openmetrics_exposition_parses(leaky, registry):
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    families = {f.name: f for f in parse_openmetrics(generate_openmetrics(registry).decode())}
    assert families["mlx_watchdog_steps"].type == "counter"
    assert families["mlx_watchdog_memory_active_bytes"].unit == "bytes"


def test_collector_registers_once_and_describes_its_names():
    reg = CollectorRegistry()
    first = exporter.register_collector(reg)
    assert exporter.register_collector(reg) is first
    described = {m.name for m in first.describe()}
    assert "mlx_watchdog_steps" in described and "mlx_watchdog_steps_to_limit" in described
    with pytest.raises(ValueError):  # a second collector would duplicate every series
        reg.register(exporter.WatchdogCollector())
    with pytest.raises(ValueError, match="Watchdog"):
        exporter.WatchdogCollector(["not a watchdog"])


# --------------------------------------------------------------------------- the HTTP server


def test_server_on_a_free_port_is_started_once(leaky, registry):
    server = exporter.start_metrics_server(0, registry=registry)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert exporter.start_metrics_server(server.port, registry=registry) is server
        status, body = http_get(server.url)
        assert status == 200
        families = families_of(body.decode())
        assert len(samples(families, "mlx_watchdog_steps_total", watchdog="exp-leaky")) == 1
    finally:
        server.close()
    again = exporter.start_metrics_server(server.port, registry=registry)  # close() freed the port
    try:
        assert again is not server and http_get(again.url)[0] == 200
    finally:
        again.close()


def test_decorator_starts_the_server_once_per_process():
    port = free_port()

    def generate(model, tokenizer, prompt, prompt_cache=None):
        return prompt

    try:
        watch(generate, metrics_port=port)
        watch(generate, metrics_port=port)  # a second decorated function: same server
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and b"mlx_watchdog_steps_total" in body
    finally:
        exporter.start_metrics_server(port).close()


def test_port_in_use_names_address_and_port(registry):
    with busy_port() as port:
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}.*already in use"):
            exporter.start_metrics_server(port, registry=registry)


@pytest.mark.parametrize("port", [-1, 65536, "9464", True, 1.5])
def test_bad_port_is_a_value_error(port):
    with pytest.raises(ValueError, match="port"):
        exporter.start_metrics_server(port)


def test_bad_address_names_address_and_port(registry):
    with pytest.raises(ValueError, match=r"no-such-host\.invalid.*port 9999"):
        exporter.start_metrics_server(9999, addr="no-such-host.invalid", registry=registry)
    with pytest.raises(OSError, match=r"192\.0\.2\.1:9999"):  # TEST-NET-1: not this machine's
        exporter.start_metrics_server(9999, addr="192.0.2.1", registry=registry)
    with pytest.raises(ValueError, match="addr"):
        exporter.start_metrics_server(9999, addr="")


def make_cert(directory: Path, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (also usable as its own CA): cryptography when
    installed, else the openssl command."""
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            msg = "neither the cryptography package nor openssl is installed: TLS test not run"
            print(f"\n*** WARNING: {msg} ***", file=sys.stderr)
            warnings.warn(msg, stacklevel=2)
            pytest.skip(f"*** {msg} ***")
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                f"/CN={name}",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-addext",
                "basicConstraints=critical,CA:TRUE",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return str(cert), str(key)
    import ipaddress

    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert), str(key)


def test_tls_and_client_certificates(tmp_path, leaky, registry):
    cert, key = make_cert(tmp_path, "server")
    client_cert, client_key = make_cert(tmp_path, "client")
    trust_server = ssl.create_default_context(cafile=cert)

    server = exporter.start_metrics_server(0, registry=registry, certfile=cert, keyfile=key)
    try:
        assert server.url.startswith("https://127.0.0.1:")
        status, body = http_get(server.url, context=trust_server)
        assert status == 200 and b'mlx_watchdog_steps_total{watchdog="exp-leaky"}' in body
        with pytest.raises(OSError):  # plain HTTP is not served
            http_get(server.url.replace("https", "http"), timeout=3)
    finally:
        server.close()

    mutual = exporter.start_metrics_server(
        0, registry=registry, certfile=cert, keyfile=key, client_cafile=client_cert, client_auth_required=True
    )
    try:
        with pytest.raises(OSError):  # no client certificate: the handshake is refused
            http_get(mutual.url, timeout=3, context=trust_server)
        with_client = ssl.create_default_context(cafile=cert)
        with_client.load_cert_chain(client_cert, client_key)
        status, body = http_get(mutual.url, context=with_client)
        assert status == 200 and b"mlx_watchdog_resident_buffers" in body
    finally:
        mutual.close()


def test_tls_option_errors(tmp_path, registry):
    cert, key = make_cert(tmp_path, "server")
    with pytest.raises(ValueError, match="certfile and keyfile"):
        exporter.start_metrics_server(0, registry=registry, certfile=cert)
    with pytest.raises(ValueError, match="need TLS"):
        exporter.start_metrics_server(0, registry=registry, client_cafile=cert)
    with pytest.raises(ValueError, match="client_cafile or client_capath"):
        exporter.start_metrics_server(
            0, registry=registry, certfile=cert, keyfile=key, client_auth_required=True
        )
    port = free_port()
    with pytest.raises(ValueError, match=rf"127\.0\.0\.1:{port}.*missing\.pem"):
        exporter.start_metrics_server(
            port, registry=registry, certfile=str(tmp_path / "missing.pem"), keyfile=key
        )
    with socket.socket() as s:  # the bad files were found before the port was bound
        s.bind(("127.0.0.1", port))


def test_wsgi_and_asgi_apps(leaky):
    reg = CollectorRegistry()
    wsgi = exporter.make_wsgi_app(reg)
    replies = []
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/metrics",
        "QUERY_STRING": "",
        "wsgi.input": io.BytesIO(),
    }
    body = b"".join(wsgi(environ, lambda status, headers: replies.append(status)))
    assert replies == ["200 OK"]
    assert samples(families_of(body.decode()), "mlx_watchdog_steps_total", watchdog="exp-leaky")

    asgi = exporter.make_asgi_app(reg)  # same registry: the collector is not registered twice
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(asgi({"type": "http", "query_string": b"", "headers": []}, receive, send))
    assert sent[0]["status"] == 200
    assert samples(families_of(sent[1]["body"].decode()), "mlx_watchdog_steps_total", watchdog="exp-leaky")


def test_default_metrics_port(monkeypatch):
    def no_init(*args, **kwargs):
        raise AssertionError("default_metrics_port must not initialize a distributed group")

    monkeypatch.setattr(mx.distributed, "init", no_init)
    for variable in coordination.RANK_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(exporter_server, "live_watchdogs", lambda: [])  # other tests' watchdogs aside
    assert exporter.default_metrics_port() == 9464
    assert exporter.default_metrics_port(9100) == 9100
    monkeypatch.setenv("MLX_RANK", "3")  # set by mlx.launch for each rank
    expected = 9467 if mx.distributed.is_available() else 9464
    assert exporter.default_metrics_port() == expected
    monkeypatch.delenv("MLX_RANK")
    ranked = Watchdog(name="exp-rank-port", export=False)  # as the distributed module sets it up
    ranked.coordinator = ranks(2, 4)
    monkeypatch.setattr(exporter_server, "live_watchdogs", lambda: [ranked])
    assert exporter.default_metrics_port(9000) == (9002 if mx.distributed.is_available() else 9000)
    assert exporter.default_metrics_port(0) == 0  # any free port: no offset
    with pytest.raises(ValueError, match="base"):
        exporter.default_metrics_port(70000)


# --------------------------------------------------------------------------- a real Prometheus


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus on a free loopback port; returns a function that starts scraping a target."""
    require_binary("prometheus")
    procs = []

    def start(target_port: int) -> str:
        proc, base = start_prometheus(tmp_path, [f"127.0.0.1:{target_port}"])
        procs.append(proc)
        return base

    start.log = lambda: log_tail(tmp_path / "prometheus.log")
    yield start
    for proc in procs:
        stop_process(proc)


def query(base: str, expr: str) -> dict:
    """{metric name: float value} of an instant query (one series per name expected)."""
    return {r["metric"]["__name__"]: float(r["value"][1]) for r in prom_query(base, expr)}


def test_real_prometheus_scrapes_the_forecast(prometheus, leaky, flat, registry):
    server = exporter.start_metrics_server(0, registry=registry)
    try:
        base = prometheus(server.port)
        wanted = (
            '{__name__=~"mlx_watchdog_(buffers_per_step|steps_to_limit|steps_total)",watchdog="exp-leaky"}'
        )
        # While the decode runs (Prometheus scrapes every second from its own process).
        seen_during = None
        deadline = time.monotonic() + 40
        while seen_during is None and time.monotonic() < deadline:
            leaky.advance(10)
            got = query(base, wanted)
            if len(got) == 3:
                seen_during = (got, leaky.wd.forecast())
        assert seen_during, f"no scrape reached Prometheus in 40 s: {prometheus.log()}"
        got, now = seen_during
        assert got["mlx_watchdog_buffers_per_step"] == pytest.approx(now.buffers_per_step, rel=0.1)
        # Each step brings the limit one step closer: correct for the steps since that scrape.
        behind = now.step - got["mlx_watchdog_steps_total"]
        assert 0 <= behind
        assert got["mlx_watchdog_steps_to_limit"] == pytest.approx(
            now.steps_to_limit + behind, rel=0.05, abs=10
        )
        leaky.advance(20)

        # The decode holds still: the next scrape carries exactly the watchdog's forecast.
        final = leaky.wd.forecast()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = query(base, wanted)
            if got.get("mlx_watchdog_steps_total") == final.step:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"Prometheus never saw step {final.step}: {got}; {prometheus.log()}")
        assert got["mlx_watchdog_buffers_per_step"] == pytest.approx(final.buffers_per_step, rel=1e-9)
        assert got["mlx_watchdog_steps_to_limit"] == pytest.approx(final.steps_to_limit, rel=1e-9)
        assert final.buffers_per_step == pytest.approx(LEAK_PER_STEP, rel=0.1)
        # Not growing: +Inf reaches Prometheus as +Inf.
        flat_stl = query(base, 'mlx_watchdog_steps_to_limit{watchdog="exp-flat"}')
        assert flat_stl == {"mlx_watchdog_steps_to_limit": math.inf}
        assert query(base, 'up{job="mlx-watchdog"}') == {"up": 1.0}
    finally:
        server.close()


# --------------------------------------------------------------------------- the real scrape, linted


def test_promtool_check_metrics_on_a_real_http_scrape(leaky, flat):
    # What Prometheus gets: the global registry (process, platform and gc collectors beside the
    # watchdogs), over HTTP from start_metrics_server.
    promtool = require_binary("promtool")
    server = exporter.start_metrics_server(0)
    try:
        status, body = http_get(server.url)
    finally:
        server.close()
    assert status == 200
    names = {s.name for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert {"mlx_watchdog_time_to_limit_seconds", "mlx_watchdog_steps_total"} <= names
    assert "process_resident_memory_bytes" in names  # the standard collector's, on Linux from /proc
    result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=30)
    findings = (result.stdout + result.stderr).decode().strip()
    assert result.returncode == 0 and findings == "", f"promtool check metrics:\n{findings}"


def test_process_metrics_from_psutil_where_proc_is_missing():
    from prometheus_client import ProcessCollector

    # Where /proc exists the standard collector does it: nothing is added.
    assert exporter.register_process_collector(CollectorRegistry()) is None
    # Where it does not (macOS), the psutil collector exports the standard names.
    no_proc = ProcessCollector(registry=None, proc="/nonexistent-procfs")
    reg = CollectorRegistry()
    added = exporter.register_process_collector(reg, probe=no_proc)
    assert isinstance(added, exporter.PsutilProcessCollector)
    assert exporter.register_process_collector(reg, probe=no_proc) is None  # once
    # Against an independent reading of the same process: prometheus_client's /proc collector.
    truth = CollectorRegistry()
    ProcessCollector(registry=truth)
    for name, rel, abs_ in (
        ("process_resident_memory_bytes", 0.2, 0),
        ("process_virtual_memory_bytes", 0.2, 0),
        ("process_start_time_seconds", 0, 1.5),
        ("process_cpu_seconds_total", 0.05, 0.5),
        ("process_open_fds", 0, 5),
    ):
        got, want = reg.get_sample_value(name), truth.get_sample_value(name)
        assert got is not None and want is not None, name
        assert got == pytest.approx(want, rel=rel, abs=abs_), name
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=generate_latest(reg), capture_output=True, timeout=30
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result


# --------------------------------------------------------------------------- site series: bounded


def leaking_objects(n: int) -> list:
    """n objects of n classes, each with one 0-d array that `x = x - 1` strands a buffer of per step."""
    objects = []
    for i in range(n):
        obj = type(f"LeakyCache{i:02d}", (), {})()
        obj.offset = mx.array(0)
        objects.append(obj)
    mx.eval([o.offset for o in objects])
    return objects


def step_leaking(wd: Watchdog, objects: list, steps: int) -> None:
    for _ in range(steps):
        wd.observe(objects)
        for obj in objects:
            obj.offset = obj.offset - 1


def test_site_series_are_capped_and_the_rest_summed_into_other():
    objects = leaking_objects(30)
    wd = Watchdog(name="exp-many-sites", overhead_budget=0.5, walk_interval=0, export=False)
    step_leaking(wd, objects, 40)
    f = wd.forecast()
    # The truth: 30 sites that each leak one buffer per step.
    assert sorted(leak.site for leak in f.leaks) == [f"LeakyCache{i:02d}.offset" for i in range(30)]
    assert all(leak.buffers_per_step == pytest.approx(1) for leak in f.leaks)
    collector = exporter.WatchdogCollector([wd])
    reg = CollectorRegistry()
    reg.register(collector)
    for max_sites in (exporter.DEFAULT_MAX_SITES, 5):
        collector.max_sites = max_sites
        families = scrape(reg)
        series = samples(families, "mlx_watchdog_leak_buffers_per_step")
        assert len(series) == max_sites
        by_site = {s.labels["site"]: s.value for s in series}
        folded = 30 - (max_sites - 1)
        assert by_site["other"] == pytest.approx(folded)  # the folded sites' sum
        assert sum(by_site.values()) == pytest.approx(f.buffers_per_step)  # nothing lost
        assert value(families, "mlx_watchdog_folded_leak_sites") == folded
    with pytest.raises(ValueError, match="max_sites"):
        collector.max_sites = 1
    with pytest.raises(ValueError, match="max_sites"):
        exporter.WatchdogCollector([wd], max_sites=True)


def test_a_bounded_site_is_exported_with_its_peak_and_leaks_nothing(sawtooth, registry):
    wd, live = sawtooth
    f = wd.forecast()
    (bounded,) = f.bounded
    assert bounded.site == "SawtoothCache.offset"
    # The truth: the count comes back to the same peak before each cut. Walked every step, the
    # readings see that peak (the count at the entry of the step that cuts).
    peaks = {live[n - 1] for n in range(1, len(live)) if live[n] < live[n - 1]}
    assert len(peaks) == 1 and bounded.peak_buffers == max(peaks)
    families = scrape(registry)
    mine = {"watchdog": "exp-sawtooth"}
    exported = value(families, "mlx_watchdog_bounded_site_peak_buffers", site=bounded.site, **mine)
    assert exported == bounded.peak_buffers
    # It read as a leak before the first cut was seen: its leak series stays, at 0.
    leak_series = samples(families, "mlx_watchdog_leak_buffers_per_step", **mine)
    assert [s.value for s in leak_series] in ([], [0.0])
    assert value(families, "mlx_watchdog_buffers_per_step", **mine) == 0
    assert value(families, "mlx_watchdog_steps_to_limit", **mine) == math.inf
    peak = value(families, "mlx_watchdog_peak_resident_buffers", **mine)
    assert peak == f.peak_resident_buffers >= value(families, "mlx_watchdog_resident_buffers", **mine)
    assert (
        peak - value(families, "mlx_watchdog_resident_buffers", **mine)
        == bounded.peak_buffers - bounded.buffers
    )


# The label text: a dict key that is not a short identifier of a code-defined structure is a placeholder.
def test_no_key_text_of_a_user_dict_reaches_the_metrics():
    from collections import OrderedDict

    secret = "alice0@example.com: my password is hunter0"

    class SessionCache:
        pass

    cache = SessionCache()
    cache.state = OrderedDict({secret: mx.array(0)})
    mx.eval(cache.state[secret])
    wd = Watchdog(name="exp-private", overhead_budget=0.5, walk_interval=0, export=False)
    for _ in range(40):
        wd.observe([cache])
        cache.state[secret] = cache.state[secret] - 1  # a leaking lazy array under the key
    assert [leak.buffers_per_step for leak in wd.forecast().leaks] == [pytest.approx(1)]  # it is seen
    reg = CollectorRegistry()
    reg.register(exporter.WatchdogCollector([wd]))
    text = generate_latest(reg).decode()
    assert samples(families_of(text), "mlx_watchdog_leak_buffers_per_step")  # exported, under some name
    for fragment in ("alice0", "example.com", "hunter0", "password"):
        assert fragment not in text, fragment


# --------------------------------------------------------------------------- the server under abuse


def _threads() -> int:
    return psutil.Process().num_threads()


def _server_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mlx-watchdog-metrics")]


@pytest.fixture
def tls_files(tmp_path):
    return make_cert(tmp_path, "server")


@pytest.mark.parametrize("use_tls", [False, True], ids=["http", "https"])
def test_300_idle_connections_do_not_stop_a_scrape(leaky, registry, tls_files, use_tls):
    cert, key = tls_files
    options = {"certfile": cert, "keyfile": key} if use_tls else {}
    context = ssl.create_default_context(cafile=cert) if use_tls else None
    before = _threads()
    server = exporter.start_metrics_server(0, registry=registry, **options)
    idle = []
    try:
        for _ in range(300):  # connect, send nothing (no request, no TLS handshake)
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        t0 = time.monotonic()
        status, body = http_get(server.url, timeout=5, context=context)
        took = time.monotonic() - t0
        assert status == 200 and b'mlx_watchdog_steps_total{watchdog="exp-leaky"}' in body
        assert took < 3, f"the scrape took {took:.1f} s beside 300 idle connections"
        assert _threads() - before <= 3, f"threads {before} -> {_threads()}"  # loop + render (+1 slack)
        assert len(_server_threads()) == 2, _server_threads()
        assert server.server.open_connections <= exporter.DEFAULT_MAX_CONNECTIONS
        if not use_tls or sys.version_info >= (3, 11):
            assert server.server.evicted >= 300 - exporter.DEFAULT_MAX_CONNECTIONS
        # Python 3.10 (no StreamWriter.start_tls): the listener does the handshake, so a connection
        # that never starts one is not yet counted, nor evicted: idle_timeout ends it.
    finally:
        for s in idle:
            s.close()
        server.close()
    assert _server_threads() == []  # close() joined its threads


def test_an_idle_connection_is_closed_after_idle_timeout(registry):
    server = exporter.start_metrics_server(0, registry=registry, idle_timeout=0.5)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            t0 = time.monotonic()
            assert s.recv(1) == b""  # closed by the server
            assert 0.3 < time.monotonic() - t0 < 3
    finally:
        server.close()


def test_a_request_trickled_byte_by_byte_is_cut_at_idle_timeout(registry):
    server = exporter.start_metrics_server(0, registry=registry, idle_timeout=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            closed = False
            for _ in range(40):  # a header byte every 0.1 s: never silent for a whole second
                time.sleep(0.1)
                try:
                    s.sendall(b"X")
                except OSError:
                    closed = True
                    break
            if not closed:
                s.settimeout(3)
                closed = s.recv(1) == b""
            assert closed and time.monotonic() - t0 < 4, "the trickling client was kept"
    finally:
        server.close()


def test_huge_headers_are_refused_without_growing_memory(registry):
    server = exporter.start_metrics_server(0, registry=registry)
    # Lines under 64 KiB, as many as http.server accepts (it buffered all: +224 MiB measured).
    header = b"X-Filler: " + b"a" * 60_000 + b"\r\n"
    clients = []
    try:
        rss_before = psutil.Process().memory_info().rss
        for _ in range(60):  # 60 clients x 3.8 MB of headers that never end
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            clients.append(s)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            try:
                for _ in range(64):
                    s.sendall(header)
            except OSError:  # the server answered 431 and closed: what is expected
                pass
        grown = psutil.Process().memory_info().rss - rss_before
        replies = []
        for s in clients:
            try:
                replies.append(s.recv(64))
            except OSError:
                replies.append(b"")
        assert grown < 64 << 20, f"RSS grew {grown / 2**20:.0f} MiB for 230 MB of headers sent"
        assert sum(r.startswith(b"HTTP/1.1 431") for r in replies) >= 30, replies[:5]
        status, _ = http_get(server.url, timeout=5)
        assert status == 200
    finally:
        for s in clients:
            s.close()
        server.close()


def test_keep_alive_head_gzip_and_bad_requests(leaky, registry):
    import gzip
    import http.client

    server = exporter.start_metrics_server(0, registry=registry)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        for _ in range(3):  # one connection, three scrapes (Prometheus keeps its connection alive)
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
            reply = conn.getresponse()
            body = gzip.decompress(reply.read())
            assert reply.status == 200 and reply.getheader("Content-Encoding") == "gzip"
            assert b"mlx_watchdog_resident_buffers" in body
        conn.request("HEAD", "/metrics")
        reply = conn.getresponse()
        assert reply.status == 200 and reply.read() == b""
        conn.request("GET", "/metrics?name[]=mlx_watchdog_steps_total")  # prometheus_client's filter
        assert set(families_of(conn.getresponse().read().decode())) == {"mlx_watchdog_steps"}
        conn.close()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 400")
    finally:
        server.close()


@pytest.mark.parametrize(
    "option, bad",
    [
        ("max_connections", 0),
        ("max_connections", 2.5),
        ("idle_timeout", 0),
        ("idle_timeout", math.inf),
        ("max_header_bytes", -1),
        ("max_sites", 1),
    ],
)
def test_bad_server_options_are_value_errors(registry, option, bad):
    with pytest.raises(ValueError, match=option):
        exporter.start_metrics_server(0, registry=registry, **{option: bad})


def test_a_site_that_stops_leaking_reads_0_instead_of_vanishing():
    objects = leaking_objects(3)
    wd = Watchdog(name="exp-stopping", overhead_budget=0.5, walk_interval=0, export=False)
    reg = CollectorRegistry()
    reg.register(exporter.WatchdogCollector([wd]))
    step_leaking(wd, objects, 40)
    assert len(wd.forecast().leaks) == 3
    first = {s.labels["site"]: s.value for s in samples(scrape(reg), "mlx_watchdog_leak_buffers_per_step")}
    assert first == {f"LeakyCache{i:02d}.offset": pytest.approx(1) for i in range(3)}
    # Two of the three stop leaking: their chains are evaluated and they stay so.
    mx.eval(objects[1].offset, objects[2].offset)
    for _ in range(200):
        wd.observe(objects)
        objects[0].offset = objects[0].offset - 1
        if [leak.site for leak in wd.forecast().leaks] == ["LeakyCache00.offset"]:
            break
    assert [leak.site for leak in wd.forecast().leaks] == ["LeakyCache00.offset"], wd.forecast().leaks
    after = {s.labels["site"]: s.value for s in samples(scrape(reg), "mlx_watchdog_leak_buffers_per_step")}
    assert after == {
        "LeakyCache00.offset": pytest.approx(1),
        "LeakyCache01.offset": 0,
        "LeakyCache02.offset": 0,
    }


# --------------------------------------------------------------------------- after a stop


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "idle"])
def test_a_stops_forecast_stays_exported_until_a_new_reading_replaces_it(counter, ended, watchdog_time):
    """A stop ends the batch that leaked and its caches die. Said so (the instrumentor's watchdogs
    forget their growth when they stop, an attachment says the generation ended), the watchdog
    reads the growth as unknown; left alone, it reads nothing growing once idle. Until a reading
    measures the growth again, the exporter publishes the stop's forecast instead: its rate (the
    exact count's), leak site and steps to the limit."""
    model = build_model("qwen3_next", layers=8)
    limit, stop_within = 800, 50
    wd = Watchdog(
        limit=limit,
        stop_within=stop_within,
        name="exp-stop",
        overhead_budget=0.5,
        walk_interval=0,
        export=False,
    )
    watch_model(model, wd)
    reg = CollectorRegistry()
    reg.register(exporter.WatchdogCollector([wd]))
    mine = {"watchdog": "exp-stop"}
    try:
        gen = BatchGenerator(model, max_tokens=100_000)
        gen.insert(tiny_prompts(2, 6, 512, seed=1))  # equal lengths: leaks
        live = []
        with pytest.raises(ResourceLimitForecast) as stopped:
            for _ in range(1000):
                gen.next_generated()
                live.append(counter.live())
        before = time.time()
        forecast, message = stopped.value.forecast, str(stopped.value)
        del stopped  # its traceback holds the batch's caches
        truth = statistics.median(b - a for a, b in zip(live, live[1:]))  # the exact count's growth per step
        assert truth == LEAK_PER_STEP
        assert forecast.steps_to_limit <= stop_within and forecast.limit == limit
        assert ("Metal" in message) == bool(mx.metal.is_available()), message
        if ended:
            wd.reset()  # as the instrumentor's watchdogs do when they stop
        gen.close()
        del gen
        gc.collect()
        assert counter.live(collect=True) < live[-1] - 30 * LEAK_PER_STEP  # its leaked chains went with it
        if ended:
            wd.generation_ended()
        watchdog_time.now += 60  # a minute without a step, on the watchdog's clock
        assert not wd.decoding()  # left alone: idle after a few seconds without a step
        now = wd.forecast()  # what would be exported from it alone:
        if ended:
            assert not now.rate_known  # NaN
        else:
            assert now.rate_known and not now.decoding  # 0 per step, +Inf steps, the site at 0

        families = scrape(reg)
        assert value(families, "mlx_watchdog_stop_forecast_held", **mine) == 1
        assert value(families, "mlx_watchdog_rate_known", **mine) == 1
        assert value(families, "mlx_watchdog_decoding", **mine) == 0
        assert value(families, "mlx_watchdog_buffers_per_step", **mine) == pytest.approx(truth, abs=0.5)
        assert value(families, "mlx_watchdog_steps_to_limit", **mine) == forecast.steps_to_limit
        assert value(families, "mlx_watchdog_time_to_limit_seconds", **mine) == forecast.seconds_to_limit
        site = {"site": LEAK_SITE, **mine}
        assert value(families, "mlx_watchdog_leak_buffers_per_step", **site) == pytest.approx(truth, abs=0.5)
        # The stop itself, for an alert: when, the steps it forecast and its sites, by reason.
        stop = {"reason": "forecast", **mine}
        assert value(families, "mlx_watchdog_stops_total", **stop) == 1
        assert before - 60 < value(families, "mlx_watchdog_last_stop_timestamp_seconds", **stop) <= before
        assert value(families, "mlx_watchdog_last_stop_steps_to_limit", **stop) == forecast.steps_to_limit
        assert value(
            families, "mlx_watchdog_last_stop_leak_buffers_per_step", site=LEAK_SITE, **stop
        ) == pytest.approx(truth, abs=0.5)
        assert scrape(reg).keys() == families.keys()  # a second scrape: the same, still held

        # A new decode (unequal lengths: nothing leaks) measures the growth again: it replaces them.
        gen = BatchGenerator(model, max_tokens=100_000)
        gen.insert([tiny_prompts(1, 4, 512, seed=2)[0], tiny_prompts(1, 7, 512, seed=3)[0]])
        live = []
        for _ in range(120):
            gen.next_generated()
            live.append(counter.live())
        families = scrape(reg)
        gen.close()
        assert statistics.median(b - a for a, b in zip(live, live[1:])) == 0  # the truth: flat
        assert value(families, "mlx_watchdog_stop_forecast_held", **mine) == 0
        assert value(families, "mlx_watchdog_rate_known", **mine) == 1
        assert value(families, "mlx_watchdog_buffers_per_step", **mine) == 0
        assert value(families, "mlx_watchdog_steps_to_limit", **mine) == math.inf
        assert value(families, "mlx_watchdog_leak_buffers_per_step", **site) == 0
        # The stop's own series stay: they are about the stop.
        assert value(families, "mlx_watchdog_last_stop_steps_to_limit", **stop) == forecast.steps_to_limit
    finally:
        unwatch_model(model)
