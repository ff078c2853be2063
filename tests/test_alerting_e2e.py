"""End to end: a leaky decode, the project's alert rules in a real Prometheus, the project's
Alertmanager config in a real Alertmanager, and a webhook receiver in this test that must get the
firing alerts BEFORE the decode reaches its limit.

The leak: mlx-lm's BatchGenerator on a tiny hybrid qwen3_next with equal-length prompts keeps
(linear-attention layers - 1) more buffers each step in ArraysCache.left_padding; 8 layers with
full attention every 4th -> 6 linear layers -> 5 buffers per step.

The real rules wait minutes (`for: 1m`, `for: 5m`) and warn thousands of steps ahead; a test
cannot. The test writes a copy of grafana/rules/mlx-watchdog-alerts.yml in which only the group's
evaluation interval, the `for:` of the three alerts under test and the threshold constants (the
`vector(N)` recording rules) are changed: every alert expression and annotation is the project's
own. The thresholds are set from a plan measured here: how fast this machine decodes and how
many buffers the decode starts with, so that the limit is ~35 s of decoding away.

Prometheus and Alertmanager come from Debian's `prometheus` and `prometheus-alertmanager`
packages: missing locally, the test skips with a loud reason; under CI=true it fails.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import re
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from mlx_lm.generate import BatchGenerator
from prometheus_client import CollectorRegistry
from support import (
    JOB,
    LOOPBACK,
    log_tail,
    prom_api,
    prom_query,
    require_binary,
    start_alertmanager,
    start_prometheus,
    stop_process,
)

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.exporters.prometheus import WatchdogCollector, start_metrics_server
from mlx_watchdog.tiny import build_model, tiny_prompts

yaml = pytest.importorskip("yaml", reason="pyyaml is needed (pip install pyyaml; it is in the [test] extra)")

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "grafana" / "rules" / "mlx-watchdog-alerts.yml"
ALERTMANAGER_CONFIG = ROOT / "grafana" / "alertmanager.yml"

NAME = "e2e-alerting"
LEAK_SITE = "ArraysCache.left_padding"
LEAK_PER_STEP = 5  # 6 linear-attention layers - 1
SOON, IMMINENT, LEAK_ALERT = (
    "MLXWatchdogResourceLimitSoon",
    "MLXWatchdogResourceLimitImminent",
    "MLXWatchdogLeakSiteGrowing",
)

# The plan: decode at most one step per PACE seconds (slower if the machine is), so that the
# limit is TARGET_SECONDS of decoding away; the warning fires with SOON_AT of the planned steps
# left, the critical alert with IMMINENT_AT left. At 0.1 s a step, IMMINENT_AT leaves ~12 s for
# scrape (1 s) + evaluation (1 s) + `for` (2 s) + Alertmanager, with room for a loaded machine.
PACE = 0.1
TARGET_SECONDS = 35
SOON_AT, IMMINENT_AT = 0.6, 0.35
WARMUP_STEPS = 20
DECODE_TIMEOUT = 60  # seconds: a decode slower than this fails the test (keeps it < 90 s)
TEST_FOR = {SOON: "2s", IMMINENT: "2s", LEAK_ALERT: "2s"}  # real: 1m, 15s, 5m


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    pace: float  # seconds per step, at least
    steps: int  # planned steps from the first to the limit
    limit: int  # buffers
    growth: float  # buffers per step measured in the warm-up
    start_buffers: float  # resident buffers at step 0
    warmup_seconds_per_step: float

    @property
    def thresholds(self) -> dict[str, float]:
        soon, imminent = round(SOON_AT * self.steps), round(IMMINENT_AT * self.steps)
        return {
            "mlx_watchdog:alert_threshold_soon_steps": soon,
            "mlx_watchdog:alert_threshold_soon_seconds": round(soon * self.pace, 1),
            "mlx_watchdog:alert_threshold_imminent_steps": imminent,
            "mlx_watchdog:alert_threshold_imminent_seconds": round(imminent * self.pace, 1),
        }


def plan_decode(model, prompts) -> Plan:
    """Decode WARMUP_STEPS steps under a throw-away watchdog: measures the leak per step, the
    resident buffers at step 0 and this machine's step time; the same decode starts identically."""
    probe = Watchdog(limit=10**9, name="e2e-warmup", overhead_budget=0.5, walk_interval=0, export=False)
    watch_model(model, probe)
    gen = BatchGenerator(model, max_tokens=100_000)
    try:
        gen.insert(prompts)
        assert gen.next_generated(), "the warm-up decode produced nothing"  # prefill + first step
        t0 = time.perf_counter()
        for _ in range(WARMUP_STEPS - 1):
            assert gen.next_generated(), "the warm-up decode ended early"
        seconds_per_step = (time.perf_counter() - t0) / (WARMUP_STEPS - 1)
        f = probe.forecast()
    finally:
        gen.close()
        unwatch_model(model)
    assert [leak.site for leak in f.leaks] == [LEAK_SITE], f"the decode should leak in {LEAK_SITE}: {f}"
    assert f.buffers_per_step == pytest.approx(LEAK_PER_STEP, rel=0.1), f
    # Step time grows ~2x over the decode (the leaked graph is walked and evaluated): leave room.
    pace = max(PACE, 3 * seconds_per_step)
    steps = round(TARGET_SECONDS / pace)
    start = f.resident_buffers - f.buffers_per_step * f.step
    return Plan(
        pace, steps, round(start + f.buffers_per_step * steps), f.buffers_per_step, start, seconds_per_step
    )


# --------------------------------------------------------------------------- test configs


def write_test_rules(path: Path, plan: Plan | None, test_for: dict[str, str] = TEST_FOR) -> dict:
    """The project's rules with the group interval, the `for:` of the alerts in ``test_for`` and
    the thresholds of ``plan`` (none without a plan) rewritten. Returns the original rules by
    name, to compare."""
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    original = {r.get("alert") or r.get("record"): dict(r) for g in doc["groups"] for r in g["rules"]}
    thresholds = plan.thresholds if plan else {}
    changed_for, changed_thresholds = set(), set()
    for group in doc["groups"]:
        # The group's own `interval` (15s) overrides Prometheus' evaluation_interval.
        group["interval"] = "1s"
        for rule in group["rules"]:
            if rule.get("record") in thresholds:
                rule["expr"] = f"vector({thresholds[rule['record']]})"
                changed_thresholds.add(rule["record"])
            if rule.get("alert") in test_for:
                assert "for" in rule, f"{rule['alert']} has no `for:` any more: revisit TEST_FOR"
                rule["for"] = test_for[rule["alert"]]
                changed_for.add(rule["alert"])
    # A renamed rule or threshold must fail here, not silently test the real (slow) values.
    assert changed_thresholds == set(thresholds), f"threshold rules missing from {RULES}"
    assert changed_for == set(test_for), f"alerts missing from {RULES}"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    rewritten = {
        r.get("alert") or r.get("record"): r
        for g in yaml.safe_load(path.read_text())["groups"]
        for r in g["rules"]
    }
    for name, rule in original.items():  # every alert's expr and annotations are the project's
        if name not in thresholds:
            assert rewritten[name]["expr"] == rule["expr"], name
            assert rewritten[name].get("annotations") == rule.get("annotations"), name
    return original


def write_test_alertmanager_config(path: Path, webhook_url: str) -> None:
    """The project's Alertmanager config (routes, grouping, inhibitions) with the notification
    delays shortened and every webhook pointed at this test's receiver."""
    doc = yaml.safe_load(ALERTMANAGER_CONFIG.read_text(encoding="utf-8"))

    def shorten(route: dict, root: bool) -> None:
        if root or "group_wait" in route:
            route["group_wait"] = "0s"
        if root or "group_interval" in route:
            route["group_interval"] = "1s"
        for child in route.get("routes", []):
            shorten(child, False)

    shorten(doc["route"], True)
    hooks = [hook for receiver in doc["receivers"] for hook in receiver.get("webhook_configs", [])]
    assert hooks, f"{ALERTMANAGER_CONFIG} has no webhook receiver to point at the test"
    for hook in hooks:
        hook["url"] = webhook_url
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")


# --------------------------------------------------------------------------- the webhook


@dataclasses.dataclass
class Notification:
    at: float  # time.monotonic() when it arrived
    step: int  # the decode's step then
    steps_to_limit: float  # the decode's forecast then
    alert: dict  # one alert of the webhook payload


class Webhook:
    """An HTTP server on a free loopback port collecting Alertmanager's webhook POSTs."""

    def __init__(self, watchdog: Watchdog):
        self.notifications: list[Notification] = []
        self.payloads: list[dict] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                at = time.monotonic()
                f = watchdog.forecast()  # thread-safe; where the decode is as the alert arrives
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsable": body.decode(errors="replace")}
                with hook._lock:
                    hook.payloads.append(payload)
                    for alert in payload.get("alerts", []):
                        hook.notifications.append(Notification(at, f.step, f.steps_to_limit, alert))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}/mlx-watchdog"
        self.thread = threading.Thread(target=self.server.serve_forever, name="e2e-webhook", daemon=True)
        self.thread.start()

    def firing(self, alertname: str, watchdog: str = NAME) -> list[Notification]:
        with self._lock:
            return [
                n
                for n in self.notifications
                if n.alert.get("status") == "firing"
                and n.alert.get("labels", {}).get("alertname") == alertname
                and n.alert.get("labels", {}).get("watchdog") == watchdog
            ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


# --------------------------------------------------------------------------- the decode


class PacedDecode(threading.Thread):
    """The watched leaky decode, at most one step per ``plan.pace`` seconds, until the
    watchdog's resident estimate reaches the limit (or DECODE_TIMEOUT)."""

    def __init__(self, model, prompts, watchdog: Watchdog, plan: Plan):
        super().__init__(name="e2e-decode", daemon=True)
        self.model, self.prompts, self.wd, self.plan = model, prompts, watchdog, plan
        self.started_at: float | None = None
        self.reached: tuple[int, float] | None = None  # (step, monotonic time) at the limit
        self.error: str | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        gen = BatchGenerator(self.model, max_tokens=100_000)
        try:
            gen.insert(self.prompts)
            self.started_at = tick = time.monotonic()
            while not self.halt.is_set():
                if not gen.next_generated():
                    self.error = f"the decode ended at step {self.wd.steps}"
                    return
                f = self.wd.forecast()
                now = time.monotonic()
                if f.resident_buffers >= self.plan.limit:
                    self.reached = (f.step, now)
                    return
                if now - self.started_at > DECODE_TIMEOUT:
                    self.error = (
                        f"the limit was not reached in {DECODE_TIMEOUT} s: step {f.step}, "
                        f"{f.resident_buffers} of {self.plan.limit} buffers"
                    )
                    return
                tick += self.plan.pace
                delay = tick - time.monotonic()
                if delay > 0:
                    self.halt.wait(delay)
                else:
                    tick = time.monotonic()  # behind: go on at the pace, do not burst to catch up
        except Exception as exc:  # reported by the test
            self.error = f"the decode raised {exc!r}"
        finally:
            gen.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)


# --------------------------------------------------------------------------- the stack


def start_alerting(tmp_path: Path, request, wd: Watchdog, plan: Plan | None, test_for: dict[str, str]):
    """The webhook, a real Alertmanager with the project's config, the metrics server of ``wd``
    alone, and a real Prometheus running the project's rules (rewritten by write_test_rules);
    all stopped at the end of the test. Returns (webhook, metrics server, Prometheus URL, the
    original rules by name)."""
    webhook = Webhook(wd)
    request.addfinalizer(webhook.close)
    am_config = tmp_path / "alertmanager.yml"
    write_test_alertmanager_config(am_config, webhook.url)
    am_proc, am_url = start_alertmanager(tmp_path, am_config)
    request.addfinalizer(lambda: stop_process(am_proc))

    # Only this watchdog (other tests' live watchdogs would add series, or a `rank` label).
    registry = CollectorRegistry()
    registry.register(WatchdogCollector([wd]))
    metrics = start_metrics_server(0, registry=registry)
    request.addfinalizer(metrics.close)

    rules = tmp_path / "rules.yml"
    original = write_test_rules(rules, plan, test_for)
    prom_proc, prom_url = start_prometheus(
        tmp_path, [f"{LOOPBACK}:{metrics.port}"], rule_files=[rules], alertmanager_url=am_url
    )
    request.addfinalizer(lambda: stop_process(prom_proc))
    return webhook, metrics, prom_url, original


# --------------------------------------------------------------------------- the test


def wait_for(condition, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    return condition()


def summary_steps(alert: dict) -> int:
    m = re.search(r"in (\d+) steps", alert["annotations"]["summary"])
    assert m, f"no step count in the summary: {alert['annotations']['summary']!r}"
    return int(m[1])


def test_alerts_reach_the_webhook_before_the_decode_reaches_its_limit(tmp_path, request):
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    model = build_model("qwen3_next", layers=8)
    prompts = tiny_prompts(2, 6, 512, seed=1)  # equal lengths: the left_padding leak
    plan = plan_decode(model, prompts)

    wd = Watchdog(limit=plan.limit, name=NAME, overhead_budget=0.5, walk_interval=0, export=False)
    watch_model(model, wd)
    request.addfinalizer(lambda: unwatch_model(model))

    webhook, metrics, prom_url, original = start_alerting(tmp_path, request, wd, plan, TEST_FOR)

    # Prometheus runs the rewritten copy (all rules, every second) and scrapes the exporter
    # before the decode starts, so the decode's time is not spent on start-up.
    groups = prom_api(prom_url, "/api/v1/rules", method="GET")["data"]["groups"]
    assert [g["interval"] for g in groups] == [1]
    assert {r["name"] for g in groups for r in g["rules"]} == set(original)
    assert wait_for(lambda: prom_query(prom_url, f'up{{job="{JOB}"}} == 1'), 15), (
        "the exporter was never scraped"
    )

    decode = PacedDecode(model, prompts, wd, plan)
    request.addfinalizer(decode.stop)
    decode.start()
    decode.join(timeout=DECODE_TIMEOUT + 15)
    assert not decode.is_alive(), "the decode thread hung"
    # Alerts that arrive now would be late; wait a little only to tell "late" from "never".
    wait_for(lambda: webhook.firing(SOON) and webhook.firing(IMMINENT) and webhook.firing(LEAK_ALERT), 5)

    def timeline() -> str:
        t0 = decode.started_at or 0
        lines = [f"plan: {plan}, thresholds {plan.thresholds}"]
        if decode.reached:
            lines.append(f"limit reached at step {decode.reached[0]}, t={decode.reached[1] - t0:.1f} s")
        for n in webhook.notifications:
            lines.append(
                f"t={n.at - t0:.1f} s step {n.step} steps_to_limit {n.steps_to_limit:.0f}: "
                f"{n.alert['labels'].get('alertname')} {n.alert.get('status')}"
            )
        return "\n".join(lines)

    print("\n" + timeline())
    assert decode.error is None, f"{decode.error}\n{timeline()}"
    assert decode.reached is not None, timeline()
    limit_step, limit_at = decode.reached
    assert limit_step >= 0.8 * plan.steps, f"the limit came too soon: {timeline()}"

    # The forecast alerts: firing, for this watchdog, BEFORE the limit, and not too early (at
    # arrival the decode's own forecast was below the alert's threshold).
    for alertname, threshold in (
        (SOON, plan.thresholds["mlx_watchdog:alert_threshold_soon_steps"]),
        (IMMINENT, plan.thresholds["mlx_watchdog:alert_threshold_imminent_steps"]),
    ):
        got = webhook.firing(alertname)
        assert got, f"{alertname} never reached the webhook\n{timeline()}"
        first = min(got, key=lambda n: n.at)
        assert first.at < limit_at and first.step < limit_step, (
            f"{alertname} arrived after the limit\n{timeline()}"
        )
        assert first.steps_to_limit < threshold, f"{alertname} fired too early\n{timeline()}"
        labels, annotations = first.alert["labels"], first.alert["annotations"]
        assert labels["watchdog"] == NAME and labels["job"] == JOB
        assert labels["instance"] == f"{LOOPBACK}:{metrics.port}"
        assert labels["severity"] == ("warning" if alertname == SOON else "critical")
        assert "rank" not in labels  # a single-process decode
        # The annotations read the live forecast: the leak site, the fix, a step count below
        # the threshold.
        description = annotations["description"]
        site = re.search(r"Top leak site: (\S+) \(\+([0-9.]+) buffers/step\)", description)
        assert site and site[1] == LEAK_SITE, description
        assert float(site[2]) == pytest.approx(LEAK_PER_STEP, rel=0.1), description
        assert "mlx-watchdog serve --fix" in description and "Watchdog(fix=True)" in description, description
        assert re.search(rf"\b\d+ of (the )?{plan.limit}\b", description), description
        assert 0 < summary_steps(first.alert) < threshold, annotations["summary"]
        assert NAME in annotations["summary"]
    assert min(n.at for n in webhook.firing(SOON)) < min(n.at for n in webhook.firing(IMMINENT))

    # The leak-site warning: its copy waits 2 s, not 5 min; it fires early, long before the
    # forecast alerts (which would inhibit it in the project's Alertmanager config).
    got = webhook.firing(LEAK_ALERT)
    assert got, f"{LEAK_ALERT} never reached the webhook\n{timeline()}"
    first = min(got, key=lambda n: n.at)
    assert first.at < limit_at, timeline()
    assert first.alert["labels"]["site"] == LEAK_SITE
    assert LEAK_SITE in first.alert["annotations"]["summary"]
    assert "mlx-watchdog serve --fix" in first.alert["annotations"]["description"]

    # Nothing else fired for this watchdog: the watchdog itself worked throughout.
    others = {
        n.alert["labels"]["alertname"] for n in webhook.notifications if n.alert.get("status") == "firing"
    } - {SOON, IMMINENT, LEAK_ALERT}
    assert not others, timeline()
    assert wd.internal_errors == 0
    for payload in webhook.payloads:
        assert payload.get("receiver") == "default" and payload.get("version") == "4", payload


# --------------------------------------------------------------------------- a watchdog that cannot measure

CANNOT = "MLXWatchdogCannotMeasure"
BLIND = "e2e-blind"


def test_a_watchdog_that_cannot_measure_is_reported(tmp_path, request):
    """A real decode the watchdog cannot measure: the program makes a new cache for every step,
    so no cache lives for two readings and the growth per step stays unknown while the steps
    climb. No forecast alert can fire for it; MLXWatchdogCannotMeasure must (its `for:` cut to
    2 s; its expression, with its 10-minute windows, is the project's)."""
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = build_model("llama", layers=2)
    wd = Watchdog(name=BLIND, export=False)
    watch_model(model, wd)
    request.addfinalizer(lambda: unwatch_model(model))

    webhook, metrics, prom_url, _ = start_alerting(tmp_path, request, wd, None, {CANNOT: "2s"})
    assert wait_for(lambda: prom_query(prom_url, f'up{{job="{JOB}"}} == 1'), 15), (
        "the exporter was never scraped"
    )

    token = mx.array([[1]])
    deadline = time.monotonic() + 45
    while not webhook.firing(CANNOT, BLIND) and time.monotonic() < deadline:
        cache = make_prompt_cache(model)  # a fresh cache every step
        mx.eval(model(token, cache=cache))
        time.sleep(0.02)
    got = webhook.firing(CANNOT, BLIND)
    f = wd.forecast()
    assert got, (
        f"{CANNOT} never reached the webhook in 45 s ({wd.steps} steps, rate known: {f.rate_known}); "
        f"{log_tail(tmp_path / 'prometheus.log')}"
    )
    alert = got[0].alert
    assert alert["labels"]["reason"] == "growth not measured" and alert["labels"]["job"] == JOB
    assert alert["labels"]["instance"] == f"{LOOPBACK}:{metrics.port}"
    steps = re.match(r"(\d+) decode steps in the last 10 minutes", alert["annotations"]["description"])
    # increase() extrapolates a little past the samples; the steps so far bound it otherwise
    assert steps and 100 < int(steps[1]) <= 1.2 * wd.steps, alert["annotations"]["description"]
    assert not f.rate_known and wd.steps > 100 and wd.internal_errors == 0
    # The forecast alerts had nothing to go on: the growth was never a number.
    assert not any(webhook.firing(name, BLIND) for name in (SOON, IMMINENT, LEAK_ALERT))


# --------------------------------------------------------------------------- growth outside the caches

OUTSIDE = "MLXWatchdogUnattributedGrowth"
SCHEDULER = "e2e-scheduler"
# The process count reads the growth outside the caches from readings spanning this many steps,
# two in each half (core/process_count.py); from there on it reads the true rate within 15%
# (tests/core/test_process_count.py).
OUTSIDE_FROM = 2 * 48 + 32


class SchedulerDecode(threading.Thread):
    """A decode whose cache does not grow (``generate_step`` evaluates a tiny llama's KV cache
    every step) beside what a server keeps of each step and never evaluates (Rapid-MLX's #2834):
    the tokens so far as one array and a running score, one more buffer each a step, outside any
    cache the watchdog is handed. Paced, so that the machine's other work goes on; it runs until
    stopped and marks (watchdog step, exact live buffers) after a step when asked."""

    def __init__(self, model, counter):
        super().__init__(name="e2e-scheduler", daemon=True)
        self.model, self.counter = model, counter
        self.marks: list[tuple[int, int]] = []
        self.mark_now = threading.Event()
        self.halt = threading.Event()
        self.error: str | None = None
        self.steps = 0

    def run(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        history, score = mx.array([0]), mx.array(0.0)
        mx.eval(history, score)
        try:
            cache = make_prompt_cache(self.model)
            prompt = mx.array(list(range(1, 17)))
            for token, logprobs in generate_step(prompt, self.model, prompt_cache=cache, max_tokens=100_000):
                history = mx.concatenate([history, mx.array([token])])
                score = score + logprobs.max()
                self.steps += 1
                if self.mark_now.is_set():
                    self.mark_now.clear()
                    self.marks.append((self.steps, self.counter.live()))
                if self.halt.wait(0.01):
                    return
            self.error = "the decode ended"
        except Exception as exc:  # reported by the test
            self.error = f"the decode raised {exc!r}"

    def mark(self) -> None:
        self.mark_now.set()
        assert wait_for(lambda: not self.mark_now.is_set(), 10), "the decode did not step"

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=30)


def test_growth_outside_the_caches_is_reported(tmp_path, request, counter):
    """With the process count on, a leak outside every cache (the scheduler's chains: +2 buffers
    a step, by the exact count) is read as unattributed growth, and MLXWatchdogUnattributedGrowth
    reaches the webhook at that rate, with the advice (its `for:` cut to 2 s; its expression, with
    its 10-minute window, is the project's). Prometheus starts once the growth is measured: until
    then the exporter reads 0, and the rule's 10-minute window would keep those samples for 10
    minutes (docs/alerts.md)."""
    require_binary("prometheus")
    require_binary("prometheus-alertmanager", "alertmanager")
    model = build_model("llama", layers=2)
    wd = Watchdog(limit=10**7, name=SCHEDULER, export=False, process_count=True, walk_interval=0.1)
    assert wd.process_count_off is None, wd.process_count_off
    watch_model(model, wd)
    request.addfinalizer(lambda: unwatch_model(model))
    decode = SchedulerDecode(model, counter)
    request.addfinalizer(decode.stop)
    decode.start()

    def measured() -> bool:
        f = wd.forecast()
        return f.step >= OUTSIDE_FROM and f.unattributed_buffers_per_step > 0

    assert wait_for(measured, 90), f"no unattributed growth read: {wd.forecast()} ({decode.error})"
    decode.mark()
    webhook, metrics, prom_url, _ = start_alerting(tmp_path, request, wd, None, {OUTSIDE: "2s"})
    got = wait_for(lambda: webhook.firing(OUTSIDE, SCHEDULER), 60)
    decode.mark()
    decode.stop()
    assert decode.error is None, decode.error
    assert got, (
        f"{OUTSIDE} never reached the webhook in 60 s: {wd.forecast()}; "
        f"{log_tail(tmp_path / 'prometheus.log')}"
    )
    (s0, n0), (s1, n1) = decode.marks
    true_rate = (n1 - n0) / (s1 - s0)
    assert true_rate == pytest.approx(2.0, abs=0.05), decode.marks  # the two chains, a buffer each

    alert = got[0].alert
    assert alert["labels"]["job"] == JOB and alert["labels"]["instance"] == f"{LOOPBACK}:{metrics.port}"
    assert "rank" not in alert["labels"] and alert["labels"]["severity"] == "warning"
    summary, description = alert["annotations"]["summary"], alert["annotations"]["description"]
    rate = re.search(r"the process grows ([0-9.]+) buffers per step outside the caches", summary)
    assert rate and float(rate[1]) == pytest.approx(true_rate, rel=0.15), summary
    # No site of the watched cache grows; the advice is diagnose, not the fix.
    assert "beyond what the named leak sites add (none of them grows)" in description, description
    assert "mlx-watchdog diagnose" in description and "--fix" not in description, description
    # Nothing else fired for it: the limit is far, and the watchdog measured throughout.
    others = {
        n.alert["labels"]["alertname"] for n in webhook.notifications if n.alert.get("status") == "firing"
    }
    assert others == {OUTSIDE}, others
    assert wd.internal_errors == 0
