"""The servers users run, from PyPI, watched by ``mlx-watchdog run`` with no line of them changed:
vllm-mlx 0.6.0 (``vllm-mlx serve DIR --continuous-batching``) and mlx-vlm 0.7.10's server
(``python -m mlx_vlm.server --model DIR``), each on a tiny qwen3_next (hybrid) and a tiny llama
(flat), driven by overlapping chat requests (several clients at once, some streaming).

They run in an environment of their own (tests/peers/envs.py, cached outside the clone; built
on first use). vllm-mlx is installed --no-deps: its declared dependencies pull torchvision and
with it a multi-GB CUDA torch that its text path never imports; tests/peers/requirements.txt
lists what that path and mlx-vlm's server do import, with mlx-lm 0.31.3 (vllm-mlx pins < 0.32).

The truth is counted inside each server process: a test-only ``sitecustomize``
(tests/peers/truth), which ``run``'s bootstrap runs after its own, hooks MLX's allocator
(exact_buffers) and writes the exact live-buffer count at the entry of every forward pass to a
file. The leak a batch leaves per step is the rise of that count over the steps of one batch.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import LOOPBACK, free_port, http_get, log_tail, missing, sse_events, stop_process, wait_ready

TESTS = Path(__file__).resolve().parent
PEERS = TESTS / "peers"
TRUTH_ENV = "MLX_WATCHDOG_PEERS_TRUTH"  # tests/peers/truth/sitecustomize.py
HYBRID, FLAT = "tiny-qwen3-next", "tiny-llama"
LEAK = 5  # 8 layers, full attention every 4th: 6 linear-attention layers leak 5 buffers a step
CLIENTS = 4  # overlapping requests; the odd ones stream
TOKENS = 200  # max_tokens of each
STEADY = 64  # forward passes of one batch, at least, for a slope (a half spans 2 fixes)
# The llama's measured workload: its clients ask again until it has decoded this long. On an idle
# machine the tiny llama answers 4 x 200 tokens in half a second, before a snapshot with a rate
# reaches the endpoint (written at most once a second). (Not the hybrid: it decodes for longer, and
# on vllm-mlx's watched server a batch that never empties would reach the stop's --limit.)
FLAT_SECONDS = 5.0
# ...each reply this long: clients asking again at once keep their stagger, so with CLIENTS replies
# of TOKENS a request left or joined every TOKENS / CLIENTS = 50 steps, and no run of STEADY steps
# at one batch size was left for the truth (a fresh-clone run, mlx-vlm).
FLAT_TOKENS = 2 * TOKENS
TOLERANCE = 0.05  # the reading, within 5% of the truth (of LEAK where the truth is about 0)

# vllm-mlx's stop: a second batch that grows until the forecast puts --limit within --stop-within.
VLLM_STOP_ARGS = ("--limit", "3000", "--stop-within", "100")
STOP_TOKENS = 1000
# Prompts the tiny hybrid answers at length when greedy (1,000 and 751 tokens; most others reach
# the end token within 170-330): the batch lives, and grows, until the stop. (vllm-mlx ignored a
# logit_bias barring the end token here, sent after requests without one.)
STOP_PROMPTS = (7, 10)
# mlx-vlm's hybrid does not grow (see below): its stop is made to fire by a limit over the buffers
# one request holds (153 here) and under what a batch of two or more holds (189 and more).
MLX_VLM_LIMIT = 170
SNAPSHOT_SETTLE = 2.5  # seconds: twice the snapshot writer's interval, and its write
# ...and at most this long more while the endpoint shows fewer stops than the log: on a loaded
# machine the writer thread may wait for the GIL behind the server's own threads.
SNAPSHOT_WAIT = 20.0


# --------------------------------------------------------------------------- environment


@pytest.fixture(scope="module")
def peer_env(tmp_path_factory) -> dict:
    """The servers' environment (built or found) and this checkout's mlx-watchdog beside it."""
    from peers import envs

    started = time.monotonic()
    try:
        env = envs.ensure()
        target = tmp_path_factory.mktemp("mlx-watchdog-checkout")
        envs.install_checkout(env, target)
    except envs.InstallError as exc:
        missing(f"the peer servers' environment cannot be built: {exc}")
    print(
        f"\nthe servers' environment and this checkout: {time.monotonic() - started:.1f} s", file=sys.stderr
    )
    return {"env": env, "python": envs.python_of(env), "target": target}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from mlx_watchdog.tiny import save_model_dir

    root = tmp_path_factory.mktemp("peer-models")
    return {
        HYBRID: save_model_dir(root / HYBRID, "qwen3_next", layers=8),
        FLAT: save_model_dir(root / FLAT, "llama", layers=4),
    }


# --------------------------------------------------------------------------- a server under run


def server_command(peer: str, env: Path, model: Path, port: int) -> list[str]:
    if peer == "rapid-mlx":  # tests/test_peers_rapid.py; nothing sent home, no check for a newer release
        return [str(env / "bin" / "rapid-mlx"), "--no-telemetry", "--disable-version-check", "serve", str(model),
                "--host", LOOPBACK, "--port", str(port)]  # fmt: skip
    if peer == "vllm-mlx":
        return [str(env / "bin" / "vllm-mlx"), "serve", str(model), "--host", LOOPBACK, "--port", str(port),
                "--continuous-batching"]  # fmt: skip
    return [str(env / "bin" / "python"), "-m", "mlx_vlm.server", "--model", str(model), "--host", LOOPBACK,
            "--port", str(port)]  # fmt: skip


@dataclass
class Reply:
    """What one client saw."""

    stream: bool
    status: int = 0
    text: str = ""
    finish: str | None = None
    done: bool = False  # a stream's `data: [DONE]`
    errors: list = field(default_factory=list)  # a stream's error events, or a failed reply's body


class Peer:
    """``python -m mlx_watchdog run --metrics-port M WATCHDOG_ARGS -- <server> --port P``."""

    def __init__(self, peer: str, peer_env: dict, model: Path, tmp: Path, watchdog_args=(), server_args=()):
        self.peer, self.tmp = peer, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.port, self.metrics_port = free_port(), free_port()
        self.truth_file, self.log = tmp / "truth.jsonl", tmp / "run.log"
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(PEERS / "truth"), str(peer_env["target"])]),
            MLX_WATCHDOG_PEERS_TESTS=str(TESTS),
            HOME=str(tmp),  # vllm-mlx keeps its prefix cache under ~/.cache: one per run
            HF_HUB_OFFLINE="1",
            **{TRUTH_ENV: str(self.truth_file)},
        )
        command = [*server_command(peer, peer_env["env"], model, self.port), *server_args]
        cmd = [str(peer_env["python"]), "-m", "mlx_watchdog", "run", "--metrics-port", str(self.metrics_port),
               *watchdog_args, "--", *command]  # fmt: skip
        started = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        wait_ready(f"http://{LOOPBACK}:{self.port}/v1/models", self.proc, timeout=240, log=self.log)
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        stop_process(self.proc, timeout=30)  # SIGTERM, passed on: the server shuts down
        stop_process(self.proc, group=True)

    # ---------------------------------------------------------------- requests

    def chat(self, model: Path, i: int, stream: bool, max_tokens: int) -> Reply:
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        reply = Reply(stream)
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=300)
        try:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            reply.status = response.status
            if response.status != 200:
                reply.errors.append(response.read().decode(errors="replace"))
            elif not stream:
                choice = json.loads(response.read())["choices"][0]
                reply.text, reply.finish = choice["message"]["content"] or "", choice.get("finish_reason")
            else:
                for event in sse_events(response):
                    if event is None:
                        reply.done = True
                        continue
                    if "error" in event:
                        reply.errors.append(event["error"])
                        continue
                    for choice in event.get("choices", []):
                        reply.text += (choice.get("delta") or {}).get("content") or ""
                        reply.finish = choice.get("finish_reason") or reply.finish
        finally:
            conn.close()
        return reply

    def overlapping(
        self,
        model: Path,
        prompts: Sequence[int] = range(CLIENTS),
        max_tokens: int = TOKENS,
        *,
        one_by_one: bool = False,
        min_seconds: float = 0.0,
    ) -> dict:
        """A request for each prompt number, each started 0.2 s after the one before
        (``one_by_one``: after it ended), every second one streaming, with /metrics scraped every
        0.25 s while they run. Each client asks again, the same, until ``min_seconds`` have passed
        (the replies after the first are under "more")."""
        replies: list[Reply | None] = [None] * len(prompts)
        more: list[Reply] = []
        failures: list[BaseException] = []
        started = time.monotonic()

        def client(i: int) -> None:
            def ask() -> Reply:
                return self.chat(model, prompts[i], stream=i % 2 == 1, max_tokens=max_tokens)

            try:
                replies[i] = ask()
                while time.monotonic() - started < min_seconds:
                    more.append(ask())
            except BaseException as exc:  # reported by the test
                failures.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        scrapes: list[tuple[float, str]] = []
        for thread in threads:
            thread.start()
            if one_by_one:
                thread.join()
            time.sleep(0.2)
        while any(t.is_alive() for t in threads):
            scrapes.append((time.monotonic(), self.metrics()))
            time.sleep(0.25)
        for thread in threads:
            thread.join()
        assert not failures, failures
        ended = time.monotonic()
        return {
            "replies": replies,
            "more": more,
            "started": started,  # the truth of this workload only: not the one before on its server
            "scrapes": scrapes,
            "ended": ended,
            "metrics": self.metrics(),
        }

    def metrics(self) -> str:
        status, body = http_get(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=10)
        assert status == 200, body
        return body.decode()

    def truth(self) -> list[dict]:
        if not self.truth_file.exists():
            return []
        return [json.loads(line) for line in self.truth_file.read_text().splitlines() if line.endswith("}")]


# --------------------------------------------------------------------------- readings


def values(text: str, name: str, **labels) -> list[float]:
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


def _labels(text: str) -> list[dict]:
    return [sample.labels for family in text_string_to_metric_families(text) for sample in family.samples]


def _stops_logged(log: Path) -> int:
    return log.read_text(errors="replace").count("mlx-watchdog: stopping the generation")


def stops_by_reason(text: str, watchdog: str) -> dict[str, float]:
    """The watchdog's stops, by reason, where there were any."""
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mlx_watchdog_stops_total"
        and sample.labels.get("watchdog") == watchdog
        and sample.value
    }


def reading(workload: dict, watchdog: str) -> float:
    """The watchdog's growth read while the batch decoded: its last scrape with a measured rate."""
    read = [
        values(text, "mlx_watchdog_buffers_per_step", watchdog=watchdog)
        for _, text in workload["scrapes"]
        if values(text, "mlx_watchdog_rate_known", watchdog=watchdog) == [1.0]
        and values(text, "mlx_watchdog_decoding", watchdog=watchdog) == [1.0]
    ]
    assert read, f"no scrape of {watchdog} with a measured rate while it decoded"
    return read[-1][0]


def steady_rates(records: list[dict], since: float, until: float) -> list[tuple[int, int, float]]:
    """(batch size, forward passes, buffers per step) of each run of decode steps (inputs of one
    token per row) at one batch size, between two times, from the exact count: the rise of its
    peak from the run's first half to its second, per step. That is the slope of a steady leak,
    and 0 for a count that the fix (every fix_every steps) or the server (mlx-vlm: every 50) brings
    back down, whatever the phase the run starts in. A run's first pass is left out: it runs while
    the joining request's own cache is still apart."""
    window = [r for r in records if since <= r["t"] <= until]
    rates = []
    for (_, shape), group in itertools.groupby(window, key=lambda r: (r["pid"], tuple(r["shape"]))):
        live = [r["live"] for r in group][1:]
        if len(shape) == 2 and shape[1] == 1 and len(live) >= STEADY:
            half = len(live) // 2
            rates.append(
                (shape[0], len(live) + 1, (max(live[half:]) - max(live[:half])) / (len(live) - half))
            )
    return rates


def truth_rate(peer: Peer, workload: dict) -> float:
    """The leak per step, exactly: the rate over the longest steady run of the workload."""
    scrapes = workload["scrapes"]
    if not peer.truth():
        missing(f"no truth was counted in the server (exact_buffers in its process):\n{log_tail(peer.log)}")
    rates = steady_rates(peer.truth(), workload["started"], scrapes[-1][0])
    assert rates, f"no run of {STEADY} decode steps at one batch size in the truth"
    return max(rates, key=lambda r: r[1])[2]


def errors_total(text: str) -> list[float]:
    return values(text, "mlx_watchdog_internal_errors_total")


def resident(workload: dict, watchdog: str) -> list[float]:
    return [
        v
        for _, text in workload["scrapes"]
        for v in values(text, "mlx_watchdog_resident_buffers", watchdog=watchdog)
    ]


# --------------------------------------------------------------------------- the runs


class Runs:
    """Each server run of the plan, once per module, on first use; the tests read them.

    vllm-mlx serves one model per process: ``watched`` (the hybrid, then a batch that grows until
    the stop, then requests after it), ``fixed`` (the hybrid, --fix) and ``flat`` (the llama).
    mlx-vlm's server loads the model each request names: ``watched`` and ``fixed`` serve the
    hybrid, then the llama; ``stopped`` serves the hybrid under a --limit that its batch crosses and
    a request alone does not (no growth to forecast there: the batch is over the limit)."""

    def __init__(self, peer_env: dict, models: dict[str, Path], tmp: Path):
        self.peer_env, self.models, self.tmp = peer_env, models, tmp
        self.done: dict[tuple[str, str], dict] = {}

    def get(self, peer: str, kind: str) -> dict:
        if (peer, kind) not in self.done:
            started = time.monotonic()
            self.done[peer, kind] = getattr(self, kind)(peer)
            print(f"\n{peer} {kind}: {time.monotonic() - started:.1f} s", file=sys.stderr)
        return self.done[peer, kind]

    def serve(self, peer: str, kind: str, model: str, *watchdog_args: str) -> Peer:
        return Peer(peer, self.peer_env, self.models[model], self.tmp / f"{peer}-{kind}", watchdog_args)

    def finish(self, server: Peer, result: dict) -> dict:
        # The endpoint serves each process's snapshot, written at most once a second: the last
        # steps and a stop reach it a second or so after the last request.
        time.sleep(SNAPSHOT_SETTLE)
        metrics, deadline = server.metrics(), time.monotonic() + SNAPSHOT_WAIT
        while (
            sum(values(metrics, "mlx_watchdog_stops_total")) < _stops_logged(server.log)
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
            metrics = server.metrics()
        result.update(metrics=metrics, log=server.log, start_seconds=server.start_seconds)
        server.log.with_name("metrics.txt").write_text(result["metrics"])  # for a failure's post-mortem
        return result

    def measured(self, server: Peer, model: str) -> dict:
        flat = model == FLAT
        workload = server.overlapping(
            self.models[model],
            max_tokens=FLAT_TOKENS if flat else TOKENS,
            min_seconds=FLAT_SECONDS if flat else 0.0,
        )
        workload["truth"] = truth_rate(server, workload)
        read = reading(workload, model)
        print(
            f"\n{server.peer} {model}: exact {workload['truth']:.3f} buffers/step, read {read:.3f}",
            file=sys.stderr,
        )
        return workload

    def watched(self, peer: str) -> dict:
        if peer == "vllm-mlx":
            server = self.serve(peer, "watched", HYBRID, *VLLM_STOP_ARGS)
            try:
                result = {HYBRID: self.measured(server, HYBRID)}
                result["stop"] = server.overlapping(self.models[HYBRID], STOP_PROMPTS, max_tokens=STOP_TOKENS)
                result["after"] = server.overlapping(self.models[HYBRID], range(2), max_tokens=20)
                return self.finish(server, result)
            finally:
                server.stop()
        server = self.serve(peer, "watched", HYBRID)
        try:
            return self.finish(
                server, {HYBRID: self.measured(server, HYBRID), FLAT: self.measured(server, FLAT)}
            )
        finally:
            server.stop()

    def fixed(self, peer: str) -> dict:
        server = self.serve(peer, "fixed", HYBRID, "--fix")
        try:
            result = {HYBRID: self.measured(server, HYBRID)}
            if peer == "mlx-vlm":
                result[FLAT] = self.measured(server, FLAT)
            return self.finish(server, result)
        finally:
            server.stop()

    def flat(self, peer: str) -> dict:
        if peer == "mlx-vlm":
            return self.get(peer, "watched")
        server = self.serve(peer, "flat", FLAT)
        try:
            return self.finish(server, {FLAT: self.measured(server, FLAT)})
        finally:
            server.stop()

    def stopped(self, peer: str) -> dict:
        if peer == "vllm-mlx":
            return self.get(peer, "watched")
        server = self.serve(peer, "stopped", HYBRID, "--limit", str(MLX_VLM_LIMIT), "--stop-within", "10")
        try:
            result = {"stop": server.overlapping(self.models[HYBRID])}
            # one request at a time: each alone holds fewer buffers than the limit, once the failed
            # batch's caches are gone (the first may still meet them)
            result["after"] = server.overlapping(
                self.models[HYBRID], range(3), max_tokens=20, one_by_one=True
            )
            result["truth"] = server.truth()
            return self.finish(server, result)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def runs(peer_env, models, tmp_path_factory) -> Runs:
    return Runs(peer_env, models, tmp_path_factory.mktemp("peers"))


SERVERS = ["vllm-mlx", "mlx-vlm"]


def served(workload: dict) -> list[Reply]:
    """Every first reply of a client, each reply checked to be a whole answer."""
    replies = workload["replies"]
    for reply in replies + workload.get("more", []):
        assert reply.status == 200 and not reply.errors, reply
        assert reply.finish in ("length", "stop") and reply.text, reply
        assert reply.done or not reply.stream, reply
    return replies


def read_as_counted(workload: dict, watchdog: str) -> float:
    """The exact count's rate, once the requests were answered in full and the watchdog's reading
    was found within 5% of it (of LEAK, where it is about 0)."""
    served(workload)
    truth, read = workload["truth"], reading(workload, watchdog)
    assert abs(read - truth) <= TOLERANCE * max(truth, LEAK), (read, truth)
    return truth


# --------------------------------------------------------------------------- readings against the truth


@pytest.mark.slow
@pytest.mark.parametrize("peer", SERVERS)
def test_the_hybrid_leak_is_read_as_the_exact_count_shows(runs, peer):
    run = runs.get(peer, "watched")
    workload = run[HYBRID]
    truth = read_as_counted(workload, HYBRID)
    # What the allocator counts in the server: vllm-mlx drives mlx-lm's BatchGenerator, whose
    # ArraysCache.left_padding leaks (linear layers - 1) buffers a step; mlx-vlm's own
    # ArraysCache.advance counts in a Python int (and it evaluates the cache every 50 steps): flat.
    assert truth == pytest.approx(LEAK if peer == "vllm-mlx" else 0, abs=TOLERANCE * LEAK)
    if peer == "vllm-mlx":
        site = values(workload["scrapes"][-1][1], "mlx_watchdog_leak_buffers_per_step", watchdog=HYBRID,
                      site="ArraysCache.left_padding")  # fmt: skip
        assert site and abs(site[0] - truth) <= TOLERANCE * truth, site
    assert errors_total(run["metrics"]) and set(errors_total(run["metrics"])) == {0.0}
    assert f"watching {HYBRID} (pid" in run["log"].read_text()


@pytest.mark.slow
@pytest.mark.parametrize("peer", SERVERS)
def test_the_llama_reads_flat(runs, peer):
    run = runs.get(peer, "flat")
    assert read_as_counted(run[FLAT], FLAT) == pytest.approx(0, abs=TOLERANCE * LEAK)
    assert set(errors_total(run["metrics"])) == {0.0}


@pytest.mark.slow
@pytest.mark.parametrize("peer", SERVERS)
def test_the_fix_removes_the_growth_with_the_same_greedy_tokens(runs, peer):
    watched, fixed = runs.get(peer, "watched"), runs.get(peer, "fixed")
    models = [HYBRID] + ([FLAT] if peer == "mlx-vlm" else [])
    for model in models:
        # temperature 0: each request's answer, bit for bit, as without the fix
        assert [r.text for r in served(fixed[model])] == [r.text for r in served(watched[model])]
        # no growth left (the count may fall: the first fix of a batch cuts the chain it inherited)
        assert fixed[model]["truth"] <= TOLERANCE * LEAK
        assert abs(reading(fixed[model], model)) <= TOLERANCE * LEAK
    metrics = fixed["metrics"]
    if peer == "vllm-mlx":
        assert values(metrics, "mlx_watchdog_fixed_leak_buffers_per_step", watchdog=HYBRID,
                      site="ArraysCache.left_padding") == [pytest.approx(LEAK, rel=TOLERANCE)]  # fmt: skip
        assert values(metrics, "mlx_watchdog_materialized_arrays_total", watchdog=HYBRID)[0] > 0
    assert set(errors_total(metrics)) == {0.0}


# --------------------------------------------------------------------------- what a stop does


@pytest.mark.slow
def test_a_stop_in_vllm_mlx_fails_the_running_batch_and_the_server_serves_on(runs):
    run = runs.get("vllm-mlx", "stopped")
    plain, stream = run["stop"]["replies"]
    # The forecast stop raises from the forward on vllm-mlx's engine thread: the batch fails.
    stops = stops_by_reason(run["metrics"], HYBRID)
    said = [line for line in run["log"].read_text().splitlines() if "rror" in line]
    assert stops == {"forecast": 1.0}, (stops, said, plain)
    assert any("mlx-watchdog stopped the" in line for line in said), said
    assert plain.status == 500 and "Internal server error during generation" in plain.errors[0], plain
    assert stream.status == 200 and stream.errors and stream.done, stream  # an error event, then [DONE]
    served(run["after"])  # later requests: a new batch, answered in full
    assert set(errors_total(run["metrics"])) == {0.0}


@pytest.mark.slow
def test_a_stop_in_mlx_vlm_fails_the_running_batch_and_the_server_serves_on(runs):
    run = runs.get("mlx-vlm", "stopped")
    # A stop fired: the batch crossed the limit (a scrape of the watched run may miss its peak,
    # so that run's readings only explain a failure here).
    stops = values(run["metrics"], "mlx_watchdog_stops_total", watchdog=HYBRID, reason="forecast")
    batch = max(resident(runs.get("mlx-vlm", "watched")[HYBRID], HYBRID))
    assert stops and stops[0] >= 1, (
        f"no stop at the limit {MLX_VLM_LIMIT}: the watched batch was read at most {batch} buffers; "
        f"the log says {_stops_logged(run['log'])} stops; the endpoint has "
        f"{sorted({(lab.get('pid'), lab.get('watchdog')) for lab in _labels(run['metrics'])})} "
        f"(pid, watchdog), their stops {stops_by_reason(run['metrics'], HYBRID)} and steps "
        f"{values(run['metrics'], 'mlx_watchdog_steps_total', watchdog=HYBRID)} (a stale snapshot: few)"
    )
    for reply in run["stop"]["replies"]:
        # The watchdog's message reaches the client: mlx-vlm passes the exception's text on.
        assert "mlx-watchdog stopped the generation" in json.dumps(reply.errors), reply
        if reply.stream:
            assert reply.status == 200 and not reply.done, reply  # an error event, no [DONE]
        else:
            assert reply.status == 500, reply
    # The same model, one request at a time: every one is answered. mlx-vlm keeps some of the failed
    # batch's caches alive after the failure (the exact count of a request alone was 178 here, not
    # about 161 before the stop), and the watchdog reads them (as kept caches): a request
    # is stopped only where the exact count shows the process at the limit; the rest are whole.
    after = [x["live"] for x in run["truth"] if x["t"] > run["stop"]["ended"]]
    for reply in run["after"]["replies"]:
        if reply.errors:  # a 500, or when streamed a 200 whose events end in the watchdog's error
            assert "mlx-watchdog stopped the generation" in json.dumps(reply.errors), reply
            assert after and max(after) >= 0.95 * MLX_VLM_LIMIT, (after, reply)
        else:
            served({"replies": [reply]})
    assert set(errors_total(run["metrics"])) == {0.0}
