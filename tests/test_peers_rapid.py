"""Rapid-MLX 0.16.10 (PyPI ``rapid-mlx``), watched by ``mlx-watchdog run`` with no line of it changed:
``rapid-mlx serve DIR`` on a tiny qwen3_next (hybrid), cold (``--disable-prefix-cache
--disable-disk-caches``, and a HOME of its own), driven by requests sent at once: chat (some
streaming) and raw completions.

Rapid-MLX installs a module ``vllm_mlx`` of its own, so it runs in an environment apart from
tests/test_peers.py's (tests/peers/envs.py, ``rapid-mlx``; tests/peers/requirements-rapid.txt
says which of its declared dependencies its text path imports: no torch). The truth is the one
tests/test_peers.py reads: the exact live-buffer count at the entry of every forward pass, counted
inside the server (tests/peers/truth).

What decides whether Rapid-MLX leaks is how a batch starts (mlx-lm 0.31.3's ``ArraysCache.merge``).
Two or more requests prefilled together, none with a prefix-cache hit, their prompts of one length,
get a left padding (``mx.array([0] * B)``) that every step decrements unevaluated: (linear layers
- 1) buffers a step, as on vllm-mlx, for as long as the batch lives (requests that join later
extend the chain). Batches started otherwise do not grow: a request prefilled alone keeps its
singleton cache (Rapid-MLX's B=1 fast path: no left padding, nor any once promoted into a batch);
prompts of different lengths are right-padded and the padding is dropped after the prefill; a
prefix-cache hit among them starts from caches that are not all empty. So the server here is cold
and the clients start at once, released from a barrier.
"""

from __future__ import annotations

import http.client
import itertools
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import LOOPBACK, missing, sse_events
from test_peers import (
    HYBRID,
    LEAK,
    SNAPSHOT_SETTLE,
    TOLERANCE,
    Peer,
    Reply,
    errors_total,
    reading,
    steady_rates,
    stops_by_reason,
    values,
)

RAPID = "rapid-mlx"
COLD = ("--disable-prefix-cache", "--disable-disk-caches")  # no prefix-cache hit, nothing on disk
TOKENS = 256  # max_tokens of each measured request (each prompt is answered at least this long)
SITE = "ArraysCache.left_padding"
# --fix runs the fix every 16 observed steps, or less often, at most every 64, while its budget is spent
# (a loaded host): a fixed count is a sawtooth whose teeth are at most this many steps wide.
TOOTH = 4 * 16
# The stop: a batch that grows until the forecast puts --limit within --stop-within steps. A measured
# batch (4 x 256 tokens) ends near 1,500 buffers, (3000 - 1500) / 5 = 300 steps from the limit.
LIMIT, STOP_WITHIN = 3000, 100
STOP_ARGS = ("--limit", str(LIMIT), "--stop-within", str(STOP_WITHIN))
STOP_TOKENS = 1000


@dataclass(frozen=True)
class Ask:
    """One request: a chat message or a raw completion of ``Tell me a story, number {prompt}.``"""

    kind: str  # "chat" or "completion"
    prompt: int
    stream: bool = False
    max_tokens: int = TOKENS


@dataclass
class Answer(Reply):
    """What one client saw, and the tokens the server says it generated (a reply without streaming)."""

    ask: Ask | None = None
    tokens: int | None = None


# Prompts of one length (32 chat tokens; 18 raw) that the tiny hybrid answers for at least 262
# tokens when greedy: prefilled together, the batch gets left padding and decodes TOKENS steps.
CHAT = tuple(Ask("chat", i, stream=n % 2 == 1) for n, i in enumerate((0, 1, 2, 9)))
COMPLETIONS = tuple(Ask("completion", i, stream=n % 2 == 1) for n, i in enumerate((0, 4, 5, 9)))
# The stop's batch: prompts the tiny hybrid answers at length when greedy (chat 7 and 1: 1,000 and
# 979 tokens; raw 8: 1,000). The two chats start together (the batch that grows); the completion
# joins a moment later (its prompt is shorter: together they would be padded, and not grow).
STOP_BATCH = (Ask("chat", 7, max_tokens=STOP_TOKENS), Ask("chat", 1, stream=True, max_tokens=STOP_TOKENS))
STOP_JOINING = (Ask("completion", 8, max_tokens=STOP_TOKENS),)
AFTER = (
    Ask("chat", 0, max_tokens=20),
    Ask("chat", 1, stream=True, max_tokens=20),
    Ask("completion", 0, max_tokens=20),
)


# --------------------------------------------------------------------------- environment


@pytest.fixture(scope="module")
def rapid_env(tmp_path_factory) -> dict:
    """Rapid-MLX's environment (built or found) and this checkout's mlx-watchdog beside it."""
    from peers import envs

    started = time.monotonic()
    try:
        env = envs.ensure(environment=envs.ENVIRONMENTS[RAPID])
        target = tmp_path_factory.mktemp("mlx-watchdog-checkout")
        envs.install_checkout(env, target)
    except envs.InstallError as exc:
        missing(f"Rapid-MLX's environment cannot be built: {exc}")
    print(f"\nRapid-MLX's environment and this checkout: {time.monotonic() - started:.1f} s", file=sys.stderr)
    return {"env": env, "python": envs.python_of(env), "target": target}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    from mlx_watchdog.tiny import save_model_dir

    return save_model_dir(tmp_path_factory.mktemp("rapid-model") / HYBRID, "qwen3_next", layers=8)


# --------------------------------------------------------------------------- requests


def ask(server: Peer, model: Path, request: Ask) -> Answer:
    """Send ``request`` and read its reply: a whole body, or a stream's events."""
    text = f"Tell me a story, number {request.prompt}."
    body: dict = {
        "model": str(model),
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": request.stream,
    }
    if request.kind == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    answer = Answer(request.stream, ask=request)
    conn = http.client.HTTPConnection(LOOPBACK, server.port, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer.status = response.status
        if response.status != 200:
            answer.errors.append(response.read().decode(errors="replace"))
        elif not request.stream:
            reply = json.loads(response.read())
            choice = reply["choices"][0]
            answer.text = (choice["message"]["content"] if request.kind == "chat" else choice["text"]) or ""
            answer.finish, answer.tokens = choice.get("finish_reason"), reply["usage"]["completion_tokens"]
        else:
            for event in sse_events(response):
                if event is None:
                    answer.done = True
                    continue
                if "error" in event:
                    answer.errors.append(event["error"])
                    continue
                for choice in event.get("choices", []):
                    delta = (
                        (choice.get("delta") or {}).get("content")
                        if request.kind == "chat"
                        else choice.get("text")
                    )
                    answer.text += delta or ""
                    answer.finish = choice.get("finish_reason") or answer.finish
    finally:
        conn.close()
    return answer


def together(server: Peer, model: Path, asks, joining=()) -> dict:
    """``asks`` sent at once (released together from a barrier), then ``joining`` 0.3 s later, with
    /metrics scraped every 0.25 s while they run."""
    requests = [*asks, *joining]
    replies: list[Answer | None] = [None] * len(requests)
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(asks))

    def client(i: int) -> None:
        try:
            if i < len(asks):
                barrier.wait(timeout=30)
            else:
                time.sleep(0.3)
            replies[i] = ask(server, model, requests[i])
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    scrapes: list[tuple[float, str]] = []
    while any(t.is_alive() for t in threads):
        scrapes.append((time.monotonic(), server.metrics()))
        time.sleep(0.25)
    for thread in threads:
        thread.join()
    assert not failures, failures
    return {"replies": replies, "started": started, "scrapes": scrapes, "ended": time.monotonic()}


def prefills(server: Peer, workload: dict) -> list[list[int]]:
    """The shapes of the prompt passes (more than one token per row) of a workload, from the truth."""
    return [
        r["shape"]
        for r in server.truth()
        if workload["started"] <= r["t"] <= workload["ended"] and len(r["shape"]) == 2 and r["shape"][1] > 1
    ]


def longest_run(records: list[dict], since: float, until: float) -> list[int]:
    """The exact count at each step of the longest run of decode steps at one batch size between two
    times, its first pass left out (it runs while a joining request's cache is still apart)."""
    runs = [
        [r["live"] for r in group][1:]
        for (_, shape), group in itertools.groupby(
            [r for r in records if since <= r["t"] <= until], key=lambda r: (r["pid"], tuple(r["shape"]))
        )
        if len(shape) == 2 and shape[1] == 1
    ]
    return max(runs, key=len, default=[])


def trough_rise(live: list[int]) -> int:
    """How far the count's lowest point rose from the first TOOTH steps to the last: 0 for a sawtooth
    whose teeth are at most TOOTH steps wide, whatever their widths; a leak's rate times the steps
    between the two windows."""
    return min(live[-TOOTH:]) - min(live[:TOOTH])


def measured(server: Peer, model: Path, asks) -> dict:
    """A batch of ``asks`` started together, its exact rate (over the longest run of decode steps at
    one batch size: the slope of the count's peaks, as test_peers reads it), that run's counts, and
    the watchdog's reading while it decoded."""
    workload = together(server, model, asks)
    if not server.truth():
        missing(
            f"no truth was counted in the server (exact_buffers in its process):\n{server.log.read_text()[-3000:]}"
        )
    # Admitted together, or the batch would not be the one this test is about (see the docstring).
    shapes = prefills(server, workload)
    assert any(shape[0] >= 2 for shape in shapes), f"the requests were prefilled one by one: {shapes}"
    until = workload["scrapes"][-1][0]
    workload["run"] = longest_run(server.truth(), workload["started"], until)
    assert len(workload["run"]) >= 3 * TOOTH, f"the batch decoded {len(workload['run'])} steps at one size"
    workload["truth"] = max(steady_rates(server.truth(), workload["started"], until), key=lambda r: r[1])[2]
    print(
        f"\n{RAPID} {asks[0].kind}: exact {workload['truth']:.3f} buffers/step (peaks; lowest points "
        f"{trough_rise(workload['run']):+d} over {len(workload['run'])} steps), read {reading(workload, HYBRID):.3f}",
        file=sys.stderr,
    )
    return workload


# --------------------------------------------------------------------------- the runs


class Runs:
    """Two servers, cold: ``watched`` (a chat batch, a completions batch, then a batch that grows until
    the stop, then requests after it) and ``fixed`` (--fix: the same two batches)."""

    def __init__(self, rapid_env: dict, model: Path, tmp: Path):
        self.rapid_env, self.model, self.tmp = rapid_env, model, tmp
        self.done: dict[str, dict] = {}

    def get(self, kind: str) -> dict:
        if kind not in self.done:
            started = time.monotonic()
            self.done[kind] = getattr(self, kind)()
            print(f"\n{RAPID} {kind}: {time.monotonic() - started:.1f} s", file=sys.stderr)
        return self.done[kind]

    def serve(self, kind: str, *watchdog_args: str) -> Peer:
        server = Peer(RAPID, self.rapid_env, self.model, self.tmp / kind, watchdog_args, COLD)
        print(f"\n{RAPID} {kind}: started in {server.start_seconds:.1f} s", file=sys.stderr)
        return server

    def finish(self, server: Peer, result: dict) -> dict:
        time.sleep(SNAPSHOT_SETTLE)  # the last steps and a stop reach the endpoint a second later
        result.update(metrics=server.metrics(), log=server.log, start_seconds=server.start_seconds)
        return result

    def watched(self) -> dict:
        server = self.serve("watched", *STOP_ARGS)
        try:
            result = {
                "chat": measured(server, self.model, CHAT),
                "completion": measured(server, self.model, COMPLETIONS),
            }
            result["stop"] = together(server, self.model, STOP_BATCH, STOP_JOINING)
            result["stop"]["truth"] = [r for r in server.truth() if r["t"] >= result["stop"]["started"]]
            result["after"] = together(server, self.model, AFTER)
            return self.finish(server, result)
        finally:
            stopping = time.monotonic()
            server.stop()
            print(f"\n{RAPID}: server stopped in {time.monotonic() - stopping:.1f} s", file=sys.stderr)

    def fixed(self) -> dict:
        server = self.serve("fixed", "--fix")
        try:
            return self.finish(
                server,
                {
                    "chat": measured(server, self.model, CHAT),
                    "completion": measured(server, self.model, COMPLETIONS),
                },
            )
        finally:
            stopping = time.monotonic()
            server.stop()
            print(f"\n{RAPID}: server stopped in {time.monotonic() - stopping:.1f} s", file=sys.stderr)


@pytest.fixture(scope="module")
def runs(rapid_env, hybrid, tmp_path_factory) -> Runs:
    return Runs(rapid_env, hybrid, tmp_path_factory.mktemp("rapid"))


def read_while_decoding(workload: dict, name: str, **labels: str) -> float:
    """A series of the model's watchdog at the last scrape that had a measured rate while it decoded
    (``reading`` for any series)."""
    read = [
        values(text, name, watchdog=HYBRID, **labels)
        for _, text in workload["scrapes"]
        if values(text, "mlx_watchdog_rate_known", watchdog=HYBRID) == [1.0]
        and values(text, "mlx_watchdog_decoding", watchdog=HYBRID) == [1.0]
    ]
    assert read and read[-1], f"no scrape of {name} {labels} with a measured rate while it decoded"
    return read[-1][0]


def served(workload: dict) -> list[Answer]:
    """Every reply, each checked to be a whole answer. (A stream's text may be empty: Rapid-MLX's
    streaming detokenizer holds back the tiny model's invalid UTF-8 bytes, so a stream's text stops
    at the first of them.)"""
    replies = workload["replies"]
    for reply in replies:
        assert reply.status == 200 and not reply.errors, reply
        assert reply.finish in ("length", "stop"), reply
        assert reply.done if reply.stream else reply.text and reply.tokens, reply
    return replies


KINDS = ["chat", "completion"]


# --------------------------------------------------------------------------- readings against the truth


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_cold_batch_leaks_at_left_padding_as_the_exact_count_shows(runs, kind):
    run = runs.get("watched")
    workload = run[kind]
    served(workload)
    truth, read = workload["truth"], reading(workload, HYBRID)
    # mlx-lm 0.31.3's BatchGenerator under Rapid-MLX's scheduler: 6 linear-attention layers, 5 a step
    assert truth == pytest.approx(LEAK, abs=TOLERANCE * LEAK)
    assert abs(read - truth) <= TOLERANCE * truth, (read, truth)
    site = read_while_decoding(workload, "mlx_watchdog_leak_buffers_per_step", site=SITE)
    assert abs(site - truth) <= TOLERANCE * truth, site
    assert set(errors_total(run["metrics"])) == {0.0}
    assert f"watching {HYBRID} (pid" in run["log"].read_text()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_fix_removes_the_growth_with_the_same_greedy_tokens(runs, kind):
    watched, fixed = runs.get("watched"), runs.get("fixed")

    def answers(workload):
        return [(r.text, r.finish, r.tokens) for r in served(workload)]

    # temperature 0: each request's answer, token for token, as without the fix
    assert answers(fixed[kind]) == answers(watched[kind])
    # No growth left, by the exact count's lowest points: the fix runs every 16 to 64 steps (its budget
    # on a loaded host), so the peaks of its sawtooth vary and their slope says little. Unfixed, the
    # lowest point of the last TOOTH steps is LEAK x (steps - TOOTH) above that of the first.
    run = fixed[kind]["run"]
    assert trough_rise(run) <= 2 * LEAK, (trough_rise(run), run)
    assert trough_rise(watched[kind]["run"]) >= (1 - TOLERANCE) * LEAK * (len(watched[kind]["run"]) - TOOTH)
    assert abs(reading(fixed[kind], HYBRID)) <= TOLERANCE * LEAK
    # what the fix cut, read while the batch decoded (the series of a batch that ended starts afresh)
    cut = read_while_decoding(fixed[kind], "mlx_watchdog_fixed_leak_buffers_per_step", site=SITE)
    assert cut == pytest.approx(LEAK, rel=TOLERANCE), cut
    metrics = fixed["metrics"]
    assert values(metrics, "mlx_watchdog_materialized_arrays_total", watchdog=HYBRID)[0] > 0
    assert set(errors_total(metrics)) == {0.0}


# --------------------------------------------------------------------------- what a stop does


@pytest.mark.slow
def test_a_stop_fails_the_running_batch_and_the_server_serves_on(runs):
    run = runs.get("watched")
    stop = run["stop"]
    chat, stream, completion = stop["replies"]
    for reply in stop["replies"]:
        print(
            f"\n{RAPID} stopped {reply.ask}: {reply.status} {reply.errors} [DONE]: {reply.done}",
            file=sys.stderr,
        )
    stops = stops_by_reason(run["metrics"], HYBRID)
    assert stops == {"forecast": 1.0}, (stops, [r.errors for r in stop["replies"]])
    # The batch grew LEAK a step by the exact count, and was stopped short of the limit.
    grown = longest_run(stop["truth"], stop["started"], stop["ended"])
    rate = max(steady_rates(stop["truth"], stop["started"], stop["ended"]), key=lambda r: r[1])[2]
    assert rate == pytest.approx(LEAK, abs=TOLERANCE * LEAK) and max(grown) < LIMIT, (rate, max(grown))
    # at the step the forecast put the limit within --stop-within steps
    (said,) = [
        line
        for line in run["log"].read_text().splitlines()
        if "mlx-watchdog: stopping the generation" in line
    ]
    within = re.search(r"limit in (\d+) steps", said)
    assert within and int(within[1]) <= STOP_WITHIN and f"{SITE} +5/step" in said, said
    # Rapid-MLX fails every request of the batch with a code, never the exception's text: chat 503,
    # a stream its tokens so far, an error event and [DONE], a completion 500.
    assert chat.status == 503 and json.loads(chat.errors[0])["error"]["code"] == "engine_aborted", chat
    assert stream.status == 200 and stream.done, stream
    assert [e.get("code") for e in stream.errors] == ["engine_aborted"], stream
    assert completion.status == 500, completion
    assert "mlx-watchdog" not in json.dumps([r.errors for r in stop["replies"]])
    served(run["after"])  # later requests: a new batch, answered in full
    assert set(errors_total(run["metrics"])) == {0.0}
