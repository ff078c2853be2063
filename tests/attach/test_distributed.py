"""Rank-aware watchdogs: two ranks under ``mlx.launch --backend ring -n 2`` on loopback, only rank 1
leaking; both must agree on rank 1's forecast, stop at the same step, not hang, and be scraped by
a real Prometheus with distinct ``rank`` labels. Plus in-process tests of the agreement logic.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from support import (
    find_binary,
    free_port_run,
    log_tail,
    prom_query,
    require_binary,
    start_prometheus,
    stop_process,
)

from mlx_watchdog import ResourceLimitForecast, Watchdog
from mlx_watchdog.attach import distributed as dist
from mlx_watchdog.core import coordination

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"  # the venv's, next to its python
if not LAUNCH.exists() and shutil.which("mlx.launch"):
    LAUNCH = Path(shutil.which("mlx.launch"))
PROMETHEUS = find_binary("prometheus")

LEAK_RANK, LIMIT, STOP_WITHIN, MAX_TOKENS = 1, 200, 100, 400
RESULTS_TIMEOUT = 120  # seconds for both ranks to decode and stop
SCRAPE_TIMEOUT = 30
EXIT_TIMEOUT = 30


# --------------------------------------------------------------------------- helpers


def scraped_by_rank(url: str) -> dict[str, dict]:
    """rank label -> {instance, steps, stops} as Prometheus has them now."""
    seen: dict[str, dict] = {}
    for series in prom_query(url, 'mlx_watchdog_steps_total{watchdog="tiny"}'):
        labels = series["metric"]
        seen.setdefault(labels.get("rank", ""), {})["instance"] = labels.get("instance")
        seen[labels.get("rank", "")]["steps"] = float(series["value"][1])
    for series in prom_query(url, 'mlx_watchdog_stops_total{watchdog="tiny",reason="forecast"}'):
        seen.setdefault(series["metric"].get("rank", ""), {})["stops"] = float(series["value"][1])
    return seen


# --------------------------------------------------------------------------- the launched job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Run the two-rank job once; every test below reads what it recorded."""
    if not LAUNCH.exists():
        pytest.fail(f"mlx.launch not found next to {sys.executable}")
    tmp = tmp_path_factory.mktemp("distributed")
    out = tmp / "out"
    out.mkdir()
    release = tmp / "release"
    ring_base = free_port_run(2)
    metrics_base = free_port_run(2)
    record = {"metrics_base": metrics_base, "prometheus": None, "scraped": None, "timed_out": None}

    prometheus = None
    if PROMETHEUS is not None:
        prometheus, prom_url = start_prometheus(
            tmp, [f"127.0.0.1:{metrics_base}", f"127.0.0.1:{metrics_base + 1}"]
        )
        record["prometheus"] = prom_url

    command = [
        str(LAUNCH),
        "--backend",
        "ring",
        "-n",
        "2",
        "--starting-port",
        str(ring_base),
        "--",
        sys.executable,
        str(WORKER),
        "--out",
        str(out),
        "--metrics-base",
        str(metrics_base),
        "--leak-rank",
        str(LEAK_RANK),
        "--limit",
        str(LIMIT),
        "--stop-within",
        str(STOP_WITHIN),
        "--max-tokens",
        str(MAX_TOKENS),
        "--release",
        str(release),
        "--hold",
        "90",
    ]
    log_out, log_err = tmp / "launch.out", tmp / "launch.err"
    start = time.monotonic()
    # stdin is a pipe nobody writes: mlx.launch forwards stdin and would spin on an EOF.
    launcher = subprocess.Popen(
        command,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=open(log_out, "w"),
        stderr=open(log_err, "w"),
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        files = [out / "rank0.json", out / "rank1.json"]
        deadline = time.monotonic() + RESULTS_TIMEOUT
        while not all(f.exists() for f in files):
            if launcher.poll() is not None:
                break
            if time.monotonic() > deadline:
                record["timed_out"] = f"no results after {RESULTS_TIMEOUT} s"
                break
            time.sleep(0.2)
        record["results"] = {r: json.loads(f.read_text()) for r, f in enumerate(files) if f.exists()}
        record["decode_wall_seconds"] = time.monotonic() - start

        if prometheus is not None and len(record["results"]) == 2:
            deadline = time.monotonic() + SCRAPE_TIMEOUT
            while True:
                scraped = scraped_by_rank(record["prometheus"])
                record["scraped"] = scraped
                if all(scraped.get(r, {}).get("stops") == 1 for r in ("0", "1")):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)

        release.touch()
        try:
            record["returncode"] = launcher.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            record["timed_out"] = record["timed_out"] or f"the ranks did not exit within {EXIT_TIMEOUT} s"
            record["returncode"] = None
        record["wall_seconds"] = time.monotonic() - start
    finally:
        stop_process(launcher, group=True)
        stop_process(prometheus)
    record["output"] = f"--- stdout\n{log_tail(log_out, 4000)}\n--- stderr\n{log_tail(log_err, 4000)}"
    yield record


def results(job) -> tuple[dict, dict]:
    assert not job["timed_out"], f"{job['timed_out']} (a rank hung?)\n{job['output']}"
    assert set(job["results"]) == {0, 1}, f"missing rank results\n{job['output']}"
    return job["results"][0], job["results"][1]


def steps_value(v) -> float:
    return float(v)  # "inf" strings from the worker's JSON


def test_both_ranks_finish_together_without_hanging(job):
    results(job)
    assert job["returncode"] == 0, f"mlx.launch exited with {job['returncode']}\n{job['output']}"


def test_watchdogs_know_rank_and_world_size(job):
    for rank, r in enumerate(results(job)):
        assert r["rank"] == rank == r["launched_rank"]
        assert (r["wd_rank"], r["wd_world_size"]) == (rank, 2)
        assert r["coordinated"], "the decorator's watchdog (created before init) was not attached"
        assert r["later"] == {"rank": rank, "world_size": 2, "coordinated": True}
        assert r["metrics_port"] == job["metrics_base"] + rank
        assert r["internal_errors"] == 0


def test_ranks_agree_on_the_leaking_ranks_forecast(job):
    r0, r1 = results(job)
    every = r0["every"]
    assert every == r1["every"] == dist.DEFAULT_EVERY
    assert r0["agreements"] == r1["agreements"], "the ranks saw different agreements"
    agreements = r0["agreements"]
    assert len(agreements) >= 2, agreements
    leak_local = {int(s): steps_value(v) for s, v in r1["local_at_rounds"].items()}
    quiet_local = {int(s): steps_value(v) for s, v in r0["local_at_rounds"].items()}
    for a in agreements:
        assert a["step"] % every == 0 and a["in_lockstep"], a
        # rank 0 does not leak; the group's value is rank 1's own forecast at that step
        assert math.isinf(quiet_local[a["step"]])
        assert a["worst_rank"] == LEAK_RANK
        assert math.isclose(steps_value(a["steps_to_limit"]), leak_local[a["step"]], rel_tol=1e-6)
        assert steps_value(a["steps_to_limit"]) < LIMIT


def test_every_rank_stops_at_the_same_step(job):
    r0, r1 = results(job)
    s0, s1 = r0["stop"], r1["stop"]
    assert s0 is not None and s1 is not None, "a rank decoded to the end without stopping"
    assert s0["step"] == s1["step"] == s0["agreement"]["stop_step"]
    assert s0["step"] < MAX_TOKENS
    assert r0["tokens"] == r1["tokens"]
    for stop in (s0, s1):
        assert stop["reason"] == "forecast"
        assert stop["rank"] == LEAK_RANK  # the forecast reported is the leaking rank's
        assert stop["steps_to_limit"] == s0["steps_to_limit"] <= STOP_WITHIN
        assert stop["limit"] == LIMIT and stop["buffers_per_step"] > 0.5
    assert math.isinf(steps_value(s0["local_steps_to_limit"])), "rank 0 should stop only for rank 1"
    assert s1["local_resident_buffers"] < LIMIT, "rank 1 stopped after reaching its limit"
    assert r0["stops"] == r1["stops"] == {"forecast": 1}


def test_coordination_cost_stays_small(job):
    for r in results(job):
        # The collective runs once a round, a round every `every` steps: not once per step. (Counted,
        # not timed: its seconds against the decode's are the machine's.)
        assert r["rounds"] == r["steps"] // r["every"]
        assert r["collectives"] == r["rounds"] and r["every"] > 1, r


def test_prometheus_scrapes_both_ranks_with_rank_labels(job):
    require_binary("prometheus")  # the job above ran without it: skip loudly (fail in CI)
    results(job)
    scraped = job["scraped"]
    assert scraped is not None, "no scrape result recorded"
    assert set(scraped) == {"0", "1"}, f"rank labels seen: {scraped}"
    for rank in (0, 1):
        series = scraped[str(rank)]
        assert series["instance"] == f"127.0.0.1:{job['metrics_base'] + rank}"
        assert series["steps"] > 0 and series["stops"] == 1, series


# --------------------------------------------------------------------------- in process


def test_agree_is_a_pure_function_of_the_gathered_rows():
    inf = math.inf
    # rows: step, steps_to_limit, resident, buffers/step, limit, stop_within
    rows = [[64, inf, 30, 0, 200, 50], [64, 113, 87, 1, 200, 100], [64, 113, 87, 1, 200, inf]]
    a = dist.agree(rows, 64, lag=1)
    assert (a.worst_rank, a.steps_to_limit, a.stop_within) == (1, 113, 100)  # tie -> lowest rank
    assert a.stop_step == 64 + 13 and a.steps_to_limit_at(70) == 107 and a.in_lockstep
    assert dist.agree(rows, 64, lag=1) == a
    late = dist.agree([[64, 20, 0, 1, 200, 100], [64, inf, 0, 0, 200, 100]], 64, lag=1)
    assert late.stop_step == 65  # already within stop_within: stop as soon as every rank knows
    quiet = dist.agree([[64, inf, 0, 0, 200, 100], [65, inf, 0, 0, 200, inf]], 64)
    assert quiet.stop_step is None and not quiet.in_lockstep
    assert dist.agree([[64, 50, 0, 1, 200, inf]] * 2, 64).stop_step is None  # nobody asked to stop


class FakeGroup:
    def __init__(self, rank=0, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def peer_gather(peer_steps_to_limit, calls):
    """An all_gather for rank 0 of 2 whose peer reports ``peer_steps_to_limit(step)``."""

    def all_gather(x, group=None):
        own = x.tolist()
        calls.append(int(own[0]))
        peer = list(own)
        peer[1] = peer_steps_to_limit(int(own[0]))
        return mx.array(own + peer, dtype=mx.float32)

    return all_gather


def test_coordinator_rounds_countdown_and_stop_with_a_scripted_peer():
    wd = Watchdog(limit=1000, stop_within=20, export=False)
    coordinator = dist.attach(wd, FakeGroup(0, 2), every=8)
    assert wd.coordinator is coordinator and (wd.rank, wd.world_size) == (0, 2)
    calls: list[int] = []
    coordinator._all_gather = peer_gather(lambda step: 60.0 - step, calls)
    cache = [mx.array([1.0])]
    mx.eval(cache)
    stopped_at = None
    for step in range(1, 200):
        try:
            wd.observe(cache)
        except ResourceLimitForecast as exc:
            stopped_at = step
            assert exc.forecast.rank == 1 and exc.agreement.worst_rank == 1
            break
        if step == 9:  # round of step 8 read at step 9: the peer's 52 counted down by one
            assert coordinator.agreement.step == 8
            assert coordinator.worst(9, math.inf) == 51
    assert calls == [8, 16, 24, 32, 40]  # the collective only at multiples of `every`
    # peer: limit at step 60; stop_within 20 -> the countdown reaches 20 at step 40
    assert stopped_at == 40 == wd.steps and wd.stops["forecast"] == 1
    # After a stop, readings taken before it never stop the next generation.
    assert coordinator.agreement is None and coordinator.worst(41, math.inf) == math.inf


def test_a_broken_group_leaves_the_watchdog_working_locally():
    wd = Watchdog(limit=1000, export=False)
    dist.attach(wd, FakeGroup(1, 2), every=2)  # mx.distributed rejects the fake group
    cache = [mx.array([1.0])]
    mx.eval(cache)
    for _ in range(6):
        wd.observe(cache)
    assert wd.coordinator.errors == 1 and wd.steps == 6 and wd.internal_errors == 0


def test_attach_rejects_bad_arguments():
    wd = Watchdog(limit=1000, export=False)
    with pytest.raises(ValueError, match="every"):
        dist.attach(wd, FakeGroup(), every=0)
    with pytest.raises(ValueError, match="group"):
        dist.attach(wd, object())
    with pytest.raises(ValueError, match="Watchdog"):
        dist.attach(object(), FakeGroup())
    assert dist.attach(wd, FakeGroup(0, 1)) is None and wd.world_size == 1 and wd.coordinator is None


def test_single_process_watchdog_is_not_coordinated():
    # Not launched here: nothing is initialized for the program, so nothing is attached.
    assert dist.current_group() is None
    wd = Watchdog(export=False)
    assert (wd.rank, wd.world_size, wd.coordinator) == (0, 1, None)


def test_instrument_is_idempotent_and_uninstrument_restores_init_exactly(monkeypatch):
    def init(*args, **kwargs):
        return FakeGroup(0, 1)

    monkeypatch.setattr(mx.distributed, "init", init)
    assert not dist.instrumented()
    assert dist.instrument() and not dist.instrument()
    try:
        wrapper = mx.distributed.init
        assert wrapper is not init and wrapper.__wrapped__ is init and dist.instrumented()
        group = mx.distributed.init()
        assert isinstance(group, FakeGroup) and dist.current_group() is None  # size 1: not recorded
    finally:
        dist.uninstrument()
    assert mx.distributed.init is init and not dist.instrumented()
    assert Watchdog(export=False).coordinator is None  # no factory left behind
    dist.uninstrument()  # undoing twice changes nothing
    assert mx.distributed.init is init


# Run in a process of its own: it records a (fake) group of size 2 for good.
INSTRUMENT_SCRIPT = """
import importlib, json, pkgutil
import mlx.core as mx

real_init = mx.distributed.init
import mlx_watchdog
import mlx_watchdog.exporters.prometheus
for module in pkgutil.walk_packages(mlx_watchdog.__path__, "mlx_watchdog."):
    if module.name != "mlx_watchdog.__main__":
        importlib.import_module(module.name)
untouched = mx.distributed.init is real_init

class Group:
    def rank(self):
        return 1

    def size(self):
        return 2

def fake_init(*args, **kwargs):
    return Group()

mx.distributed.init = fake_init
from mlx_watchdog import Watchdog
from mlx_watchdog.attach import distributed as dist

before = Watchdog(export=False)  # made before init: joins when init returns
stepped = Watchdog(export=False)
stepped.observe([mx.array([1.0])])  # stepped before init: not joined (its steps would not line up)
instrumented = dist.instrument()
group = mx.distributed.init()
after = Watchdog(export=False)  # made once the group exists
dist.uninstrument()
late = Watchdog(export=False)  # made after uninstrument: no factory
print(json.dumps({
    "untouched": untouched,
    "instrumented": instrumented,
    "returned": type(group).__name__,
    "restored": mx.distributed.init is fake_init,
    "recorded": dist.current_group() is group,
    "before": [before.rank, before.world_size, type(before.coordinator).__name__],
    "stepped": type(stepped.coordinator).__name__,
    "after": [after.rank, after.world_size, type(after.coordinator).__name__],
    "forecast": [after.forecast().rank, after.forecast().world_size],
    "late": type(late.coordinator).__name__,
}))
"""


def test_importing_patches_nothing_and_instrument_coordinates_watchdogs_before_and_after_init():
    env = {k: v for k, v in os.environ.items() if k != dist.ENV_DISABLE}
    done = subprocess.run(
        [sys.executable, "-c", INSTRUMENT_SCRIPT], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {
        "untouched": True,  # importing every module of the package wraps nothing
        "instrumented": True,
        "returned": "Group",  # the wrapper returns what init returns
        "restored": True,
        "recorded": True,
        "before": [1, 2, "Coordinator"],
        "stepped": "NoneType",
        "after": [1, 2, "Coordinator"],
        "forecast": [1, 2],
        "late": "NoneType",
    }, done.stderr


def test_launch_env_reads_the_launchers_variables(monkeypatch, tmp_path):
    names = coordination.RANK_VARIABLES + coordination.SIZE_VARIABLES + (coordination.HOSTFILE_VARIABLE,)
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert coordination.launch_env() is None and coordination.launch_rank() is None
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["127.0.0.1:5002"]]))
    monkeypatch.setenv("MLX_RANK", "2")
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert coordination.launch_env() == (2, 3)
    monkeypatch.setenv("MLX_RANK", "3")
    assert coordination.launch_env() is None  # a rank outside the ring is not trusted
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert coordination.launch_env() == (3, 4)
    monkeypatch.delenv("MLX_RANK")
    monkeypatch.setenv("JACCL_RANK", "1")  # the exporter's metrics port and the labels agree on it
    assert coordination.launch_env() == (1, 4) and coordination.launch_rank() == 1


def test_without_a_coordinator_the_rank_is_the_launchers(monkeypatch):
    for name in coordination.RANK_VARIABLES + coordination.SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    coordination.launched.cache_clear()  # read once per process: read this environment
    try:
        wd = Watchdog(export=False)
        assert (wd.rank, wd.world_size, wd.coordinator) == (1, 2, None)
        assert (wd.forecast().rank, wd.forecast().world_size) == (1, 2)
        dist.attach(wd, FakeGroup(0, 3), every=8)  # a group's rank wins (the coordinator's)
        assert (wd.rank, wd.world_size, wd.forecast().world_size) == (0, 3, 3)
        dist.detach(wd)
        assert (wd.rank, wd.world_size, wd.coordinator) == (1, 2, None)
    finally:
        monkeypatch.undo()
        coordination.launched.cache_clear()


def test_the_coordinator_hook_checks_what_it_is_given():
    wd = Watchdog(export=False)
    with pytest.raises(ValueError, match="coordinator"):
        wd.coordinator = object()
    with pytest.raises(ValueError, match="prefill_guard"):
        wd.prefill_guard = object()
