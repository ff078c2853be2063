"""Tests of ``mlx-watchdog serve`` (mlx_watchdog.commands.serve): the real mlx_lm.server, watched.

The end-to-end tests start ``python -m mlx_watchdog.commands.serve`` on free loopback ports with a tiny
random-weight hybrid model (qwen3_next, 8 layers: 6 linear-attention layers) written by the test,
talk to it with the ``openai`` client as users do, and read the metrics endpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from queue import Queue

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import busy_port, free_port, mlx_before_0_32

from mlx_watchdog import tiny
from mlx_watchdog.attach import server as server_hooks
from mlx_watchdog.commands import serve
from mlx_watchdog.core.forecast import Forecast
from mlx_watchdog.core.watchdog import ResourceLimitForecast, live_watchdogs

NO_EOS = {str(tiny.EOS_ID): -100}  # a random model may say EOS anywhere: keep completions long
# The watchdog times itself in wall time: on a busy 2-core machine (other tests, the HTTP threads)
# that inflates and its walks thin out. A larger budget keeps the measurement dense here; the
# budget itself is core's business (tests/test_core.py).
BUDGET = ("--overhead-budget", "0.25")
# How long a server may take to come up: importing MLX and mlx-lm and loading the model took
# over 120 s beside two busy processes and other test runs (a wait, not a speed bound).
STARTUP_SECONDS = 300


# --------------------------------------------------------------------------- helpers


def _linear_layers(model_dir: Path) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    interval = config["full_attention_interval"]
    return sum(1 for i in range(config["num_hidden_layers"]) if (i + 1) % interval != 0)


def _wait_healthy(url: str, process, log) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            pytest.fail(
                f"server exited with {process.returncode} before it was up:\n{log.read_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    if process is not None and process.poll() is None:  # no orphan: its stacks go to its log (faulthandler)
        process.send_signal(signal.SIGABRT)
        process.wait(30)
    pytest.fail(f"server not healthy after {STARTUP_SECONDS} s:\n{log.read_text()[-6000:] if log else ''}")


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, frozenset of labels): value} of a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples in {sorted(k[0] for k in samples)}"
    return matches[0]


class Served:
    """A running ``python -m mlx_watchdog.commands.serve`` subprocess on free loopback ports."""

    def __init__(
        self, model_dir: Path, workdir: Path, watchdog_args: list[str], cli: bool = False, sigint: str = ""
    ):
        self.port, self.metrics_port = free_port(), free_port()
        self.log = workdir / f"serve-{self.port}.log"
        # cli: the user's command, `mlx-watchdog serve` (its module, so no console script is needed)
        entry = ["mlx_watchdog", "serve"] if cli else ["mlx_watchdog.commands.serve"]
        command = self._command(["-m", *entry], model_dir, watchdog_args, ("--prompt-cache-size", "2"))
        if sigint:  # "SIG_DFL" (a terminal) or "SIG_IGN" (a shell's background job): what it inherits
            command = [sys.executable, "-c", WITH_SIGINT, sigint, *command]
        self._launch(command, workdir)
        _wait_healthy(self.base + "/health", self.process, self.log)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def _command(self, entry: list[str], model_dir: Path, watchdog_args: list[str], server_args) -> list[str]:
        """``python ENTRY --metrics-port P WATCHDOG_ARGS -- --model DIR --port P --host 127.0.0.1
        SERVER_ARGS`` on this server's ports."""
        return [
            sys.executable,
            *entry,
            "--metrics-port",
            str(self.metrics_port),
            *watchdog_args,
            "--",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            *server_args,
        ]

    def _launch(self, command: list[str], workdir: Path, **env: str) -> None:
        """Start the server process (its output to ``self.log``) with ``env`` added."""
        # PYTHONFAULTHANDLER: a server that does not stop is sent SIGABRT, which prints every thread's stack
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **env)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir
            )
        self.base = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stream(self, prompt: str, max_tokens: int) -> dict:
        """Stream a text completion; returns its text, chunk count and last finish_reason."""
        text, chunks, finish = "", 0, None
        stream = self.client.completions.create(
            model="default_model", prompt=prompt, max_tokens=max_tokens, stream=True, logit_bias=NO_EOS
        )
        for chunk in stream:
            chunks += 1
            choice = chunk.choices[0]
            text += choice.text or ""
            finish = choice.finish_reason or finish
        return {"text": text, "chunks": chunks, "finish_reason": finish}

    def metrics(self) -> dict:
        return scrape(self.metrics_url)

    def healthy(self) -> bool:
        with urllib.request.urlopen(self.base + "/health", timeout=5) as response:
            return response.status == 200

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """SIGTERM (the server shuts down like on Ctrl-C); SIGKILL if it does not exit."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGABRT)  # its stacks go to the log (faulthandler)
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(10)
        return self.process.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


SERVER = Served  # what the start_server fixture (tests/conftest.py) starts

# `python -c WITH_SIGINT SIG_IGN|SIG_DFL COMMAND...`: COMMAND with that SIGINT disposition (exec keeps
# an ignored signal: a shell starts its background jobs so, and Python then leaves SIGINT ignored).
WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, getattr(signal, sys.argv[1])); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


# --------------------------------------------------------------------------- end to end

PROMPT = "The watchdog counts buffers"
LONG = 256


MLX_031_TEARDOWN = (
    "mlx 0.31's teardown: the generation thread's compile-cache cleanup takes the GIL in a thread-local "
    "destructor, which aborts (`terminate called without an active exception`) when the interpreter "
    "is already finalizing (2 of 5 SIGTERMs after a request here; fixed in mlx 0.32, mlx#3628)"
)


def assert_stops_cleanly(served) -> None:
    """The server exits with status 0; on mlx 0.31, an abort of its teardown skips (the rest of the
    test has passed by then)."""
    code = served.stop()
    if code != 0 and mlx_before_0_32() and "terminate called without an active exception" in served.output():
        pytest.skip(MLX_031_TEARDOWN)
    assert code == 0, served.output()[-3000:]


def test_leak_counted_without_fix_and_flat_with_fix(start_server, model_dir):
    expected = _linear_layers(model_dir) - 1  # 6 linear-attention layers: 5 buffers per step

    plain = start_server(*BUDGET)
    leaked = plain.stream(PROMPT, LONG)
    assert leaked["finish_reason"] == "length" and leaked["chunks"] > LONG // 4, leaked
    m = plain.metrics()
    assert metric(m, "mlx_watchdog_steps_total", watchdog="tiny-qwen3-next") >= LONG
    assert metric(m, "mlx_watchdog_buffers_per_step") == pytest.approx(expected, abs=0.5)
    assert metric(m, "mlx_watchdog_leak_buffers_per_step", site="ArraysCache.left_padding") == pytest.approx(
        expected, abs=0.5
    )
    assert metric(m, "mlx_watchdog_steps_to_limit") < float("inf")
    assert metric(m, "mlx_watchdog_info", fix="false") == 1
    assert metric(m, "mlx_watchdog_stops_total", reason="forecast") == 0
    leaked_resident = metric(m, "mlx_watchdog_resident_buffers")
    assert_stops_cleanly(plain)

    fixed = start_server("--fix", *BUDGET)
    flat = fixed.stream(PROMPT, LONG)
    assert flat["text"] == leaked["text"]  # the fix changes no token
    m = fixed.metrics()
    assert metric(m, "mlx_watchdog_steps_total") >= LONG
    assert metric(m, "mlx_watchdog_buffers_per_step") < 0.5
    assert metric(m, "mlx_watchdog_steps_to_limit") == float("inf")
    assert metric(m, "mlx_watchdog_materialized_arrays_total") > 0
    assert metric(m, "mlx_watchdog_reclaimed_buffers_total") > 0
    assert metric(m, "mlx_watchdog_info", fix="true") == 1
    # The leak is named as one the fix cuts, not as a leak nothing repairs (the alert's metric).
    assert metric(
        m, "mlx_watchdog_fixed_leak_buffers_per_step", site="ArraysCache.left_padding"
    ) == pytest.approx(expected, abs=0.5)
    assert not [k for k in m if k[0] == "mlx_watchdog_leak_buffers_per_step"]
    # After the request its caches are gone, with the chains they held, fixed or not: both read
    # the parameters alone again (a frozen reading of the finished request was the old behaviour).
    assert metric(m, "mlx_watchdog_resident_buffers") <= leaked_resident


def test_stop_ends_the_requests_and_the_server_goes_on(start_server):
    # ~130 parameter buffers + 5 per step: the forecast reaches 1200 - 5 * 50 after ~160 steps.
    served = start_server("--limit", "1200", "--stop-within", "50", *BUDGET, cli=True)
    stopped = served.stream(PROMPT, 600)
    assert stopped["finish_reason"] == server_hooks.STOP_FINISH_REASON, (
        stopped["chunks"],
        served.output()[-2000:],
    )
    assert 0 < stopped["chunks"] < 600 and stopped["text"]

    m = served.metrics()
    assert metric(m, "mlx_watchdog_stops_total", reason="forecast") == 1
    assert served.healthy()
    assert "leak sites: ArraysCache.left_padding" in served.output()  # the server log says why

    # A later request is served in full, streamed and not streamed, on a fresh batch.
    later = served.stream(PROMPT, 16)
    assert later["finish_reason"] == "length" and later["text"], later
    whole = served.client.completions.create(
        model="default_model", prompt="again", max_tokens=8, logit_bias=NO_EOS
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    chat = served.client.chat.completions.create(
        model="default_model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert "generation thread died" not in served.output()
    assert_stops_cleanly(served)


def test_stop_on_the_unbatched_path(start_server):
    # A seeded request is served alone (mlx-lm's _serve_single, stream_generate); a limit below
    # the parameters' buffers makes its first forward pass stop.
    served = start_server("--limit", "10", "--stop-within", "0")
    for _ in range(2):
        stream = served.client.completions.create(
            model="default_model", prompt=PROMPT, max_tokens=32, stream=True, seed=1
        )
        finish = [c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason]
        assert finish == [server_hooks.STOP_FINISH_REASON]
        whole = served.client.completions.create(model="default_model", prompt=PROMPT, max_tokens=32, seed=1)
        assert (
            whole.choices[0].finish_reason == server_hooks.STOP_FINISH_REASON and whole.choices[0].text == ""
        )
        assert served.healthy()
    assert metric(served.metrics(), "mlx_watchdog_stops_total", reason="forecast") >= 4


def test_shutdown_after_requests_exits_cleanly(start_server):
    """SIGINT and SIGTERM after a request end the server with status 0 and no abort at exit,
    whether it inherited SIGINT as from a terminal (default) or as a shell's background job
    (ignored: `serve ... &` in a script, a CI step started in the background)."""
    # Before serve handled SIGINT itself, an inherited SIG_IGN kept the server running after SIGINT
    # (stop() then sent SIGABRT: exit -6). Before it waited for the generation thread's exit, that
    # thread's MLX thread_locals could take the GIL while the interpreter finalized: `terminate called
    # without an active exception`, exit -6 (mlx 0.31.2: most runs; docs/internals.md).
    cases = [(signal.SIGINT, "SIG_IGN"), (signal.SIGTERM, "SIG_DFL"), (signal.SIGINT, "SIG_DFL")]
    for attempt, (sig, inherited) in enumerate(cases):
        served = start_server("--no-metrics", *BUDGET, sigint=inherited)
        assert served.stream(PROMPT, 8 + attempt)["finish_reason"] == "length"
        code = served.stop(sig)
        output = served.output()
        clean = "terminate called" not in output and "Fatal Python error" not in output
        assert code == 0 and clean, (attempt, sig, inherited, code, output[-6000:])


# A thread that used MLX's random key (as mlx-lm's generation thread does when it builds the model)
# ends after join() returns: its C++ thread_local destructor takes the GIL then. If this process
# is finalizing by then, that thread aborts it (about half the runs without the wait: the main thread
# keeps the GIL through finalization here). wait_for_thread_exit is what ServerHooks.detach() waits with.
THREAD_EXIT = """
import sys, threading
import mlx.core as mx
from mlx_watchdog.attach.server import wait_for_thread_exit
sys.setswitchinterval(30)
ids = []
def generate():
    mx.eval(mx.random.uniform(shape=(4,)))
    ids.append(threading.get_native_id())
thread = threading.Thread(target=generate)
thread.start()
thread.join()
assert wait_for_thread_exit(ids, 30)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux: threads seen in /proc/self/task")
def test_exit_waits_for_a_thread_that_used_mlx():
    for _ in range(5):
        child = subprocess.run(
            [sys.executable, "-c", THREAD_EXIT], capture_output=True, text=True, timeout=300
        )
        assert child.returncode == 0, (child.returncode, child.stderr[-3000:])


def test_wait_for_thread_exit_waits_for_the_thread_itself():
    release = threading.Event()
    ids: list[int] = []

    def run():
        ids.append(threading.get_native_id())
        release.wait()

    thread = threading.Thread(target=run)
    thread.start()
    while not ids:
        time.sleep(0.001)
    if os.path.isdir("/proc/self/task"):
        assert not server_hooks.wait_for_thread_exit(ids, 0.05)  # still running
    release.set()
    thread.join()
    assert server_hooks.wait_for_thread_exit(ids, 30)
    assert not os.path.exists(f"/proc/self/task/{ids[0]}")


# --------------------------------------------------------------------------- arguments


def test_split_and_parse():
    args, server_argv = serve.parse_args(
        [
            "--fix",
            "--fix-every",
            "3",
            "--limit",
            "4000",
            "--warn-within",
            "500",
            "--stop-within",
            "100",
            "--metrics-port",
            "0",
            "--metrics-addr",
            "::1",
            "--adapt-prefill",
            "--overhead-budget",
            "0.5",
            "--walk-interval",
            "2",
            "--process-count",
            "off",
            "--census",
            "on",
            "--",
            "--model",
            "m",
            "--port",
            "8",
            "--",
            "x",
        ]
    )
    assert server_argv == ["--model", "m", "--port", "8", "--", "x"]
    assert (args.fix, args.fix_every, args.limit, args.warn_within, args.stop_within) == (
        True,
        3,
        4000,
        500.0,
        100.0,
    )
    assert (args.metrics_port, args.metrics_addr, args.no_metrics, args.adapt_prefill) == (
        0,
        "::1",
        False,
        True,
    )
    assert serve.watchdog_options(args) == {
        "limit": 4000,
        "fix": True,
        "fix_every": 3,
        "warn_within": 500.0,
        "stop_within": 100.0,
        "overhead_budget": 0.5,
        "walk_interval": 2.0,
        "process_count": False,
        "census": True,
    }

    args, server_argv = serve.parse_args(["--no-fix", "--no-metrics"])
    assert server_argv == [] and args.fix is False and args.no_metrics is True
    defaults, _ = serve.parse_args([])
    assert defaults.metrics_port == 9464 and defaults.metrics_addr == "127.0.0.1"
    assert defaults.limit is None and defaults.stop_within is None and defaults.fix is False
    assert defaults.overhead_budget == 0.01 and defaults.adapt_prefill is False
    assert defaults.walk_interval is None  # auto
    assert serve.watchdog_options(defaults)["process_count"] == "auto"
    assert serve.watchdog_options(defaults)["census"] == "auto"


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--limit", "0"], "--limit"),
        (["--limit", "lots"], "--limit"),
        (["--fix-every", "-2"], "--fix-every"),
        (["--stop-within", "-1"], "--stop-within"),
        (["--warn-within", "nan"], "--warn-within"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--overhead-budget", "0"], "--overhead-budget"),
        (["--walk-interval", "-1"], "--walk-interval"),
        (["--process-count", "yes"], "--process-count"),
        (["--census", "yes"], "--census"),
        (["--model", "m"], "after `--`"),
    ],
)
def test_bad_arguments_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and argv[-1] in err


def test_bad_namespace_values_raise_value_error():
    good = vars(serve.parse_args([])[0])
    for option, value in (
        ("limit", -5),
        ("fix_every", 0),
        ("stop_within", -1.0),
        ("metrics_port", 99999),
        ("overhead_budget", 2.0),
        ("walk_interval", float("inf")),
        ("process_count", "maybe"),
        ("census", "maybe"),
    ):
        args = argparse.Namespace(**dict(good, **{option: value}))
        with pytest.raises(ValueError, match="--" + option.replace("_", "-")):
            serve.watchdog_options(args)
    assert serve.main(["--limit", "0"]) == 2


def test_main_reports_a_busy_metrics_port(capsys):
    with busy_port() as port:
        assert serve.main(["--metrics-port", str(port), "--", "--model", "unused"]) == 2
    err = capsys.readouterr().err
    assert str(port) in err and "--no-metrics" in err


def test_main_checks_the_server_arguments_before_it_starts(capsys, tmp_path):
    """`python -m mlx_watchdog.commands.serve` too: mlx_lm.server's parsed arguments are checked before
    it listens (its own run() would hang on a busy port or answer 503 for a missing model)."""
    before = _hooked()
    missing = tmp_path / "gone"
    assert serve.main(["--no-metrics", "--", "--model", str(missing), "--draft-model", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mlx-watchdog serve: error: model path does not exist: {missing} (mlx_lm.server's --model)"
    )
    (tmp_path / "draft").mkdir()
    assert serve.main(["--no-metrics", "--", "--draft-model", str(tmp_path / "draft")]) == 2
    assert "model folder has no config.json" in capsys.readouterr().err
    assert serve.main(["--no-metrics", "--", "--host", "no-such-host.invalid"]) == 2
    assert "cannot resolve 'no-such-host.invalid'" in capsys.readouterr().err
    assert all(_hooked()[k] is before[k] for k in before)  # the hooks are off again
    import mlx_lm.server

    assert mlx_lm.server.run.__name__ == "run" and not hasattr(mlx_lm.server.run, "__wrapped__")


# --------------------------------------------------------------------------- attach / detach


def _hooked():
    import mlx_lm.server as server

    return {(c, m): getattr(server, c).__dict__[m] for c, m in server_hooks._HOOK_POINTS}


def test_attach_detach_is_symmetric():
    before = _hooked()
    hooks = server_hooks.ServerHooks({"fix": True})
    with hooks:
        during = _hooked()
        assert all(during[k] is not before[k] for k in before)
        assert all(during[k].__name__ == before[k].__name__ for k in before)
        with pytest.raises(RuntimeError, match="already attached"):
            hooks.attach()
    assert _hooked() == before and all(_hooked()[k] is before[k] for k in before)
    hooks.attach()  # attach again after a detach
    hooks.detach()
    assert all(_hooked()[k] is before[k] for k in before)


def test_run_detaches_when_the_server_parser_exits(capsys):
    before = _hooked()
    argv = list(sys.argv)
    args, _ = serve.parse_args(["--no-metrics"])
    assert serve.run(args, ["--no-such-option"]) == 2
    assert "--no-such-option" in capsys.readouterr().err
    assert all(_hooked()[k] is before[k] for k in before)
    assert sys.argv == argv


def test_run_in_process_watches_and_restores(model_dir, tmp_path):
    """run() in this process: the loaded model is watched while the server runs; after SIGTERM
    run() returns 0 and mlx_lm.server's functions, sys.argv and the signal handler are back."""
    before = _hooked()
    argv, handler = list(sys.argv), signal.getsignal(signal.SIGTERM)
    sigint_handler = signal.getsignal(signal.SIGINT)
    port, metrics_port = free_port(), free_port()
    seen: dict = {}

    def client():
        try:
            _wait_healthy(f"http://127.0.0.1:{port}/health", None, None)
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            seen["finish"] = (
                c.completions.create(model="default_model", prompt=PROMPT, max_tokens=8)
                .choices[0]
                .finish_reason
            )
            seen["watchdogs"] = [wd.name for wd in live_watchdogs()]
            samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            seen["steps"] = metric(samples, "mlx_watchdog_steps_total", watchdog="tiny-qwen3-next")
            seen["prefill_nodes"] = metric(samples, "mlx_watchdog_prefill_graph_nodes")
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    args, _ = serve.parse_args(["--metrics-port", str(metrics_port), "--adapt-prefill"])
    thread = threading.Thread(target=client)
    thread.start()
    code = serve.run(args, ["--model", str(model_dir), "--port", str(port), "--host", "127.0.0.1"])
    thread.join(30)
    assert code == 0
    assert seen["finish"] == "length" and "tiny-qwen3-next" in seen["watchdogs"] and seen["steps"] >= 8
    assert seen["prefill_nodes"] > 0  # --adapt-prefill installed the prefill guard on the loaded model
    assert all(_hooked()[k] is before[k] for k in before)
    assert sys.argv == argv and signal.getsignal(signal.SIGTERM) == handler
    assert signal.getsignal(signal.SIGINT) == sigint_handler
    assert "tiny-qwen3-next" not in [wd.name for wd in live_watchdogs()]
    with socket.socket() as sock:  # nothing listens on the metrics port any more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of the scrape is fine
        sock.bind(("127.0.0.1", metrics_port))
        sock.listen()


def test_adapt_prefill_sets_the_server_prefill_step(monkeypatch):
    from mlx_watchdog.attach import prefill
    from mlx_watchdog.core.watchdog import Watchdog

    calls = []
    monkeypatch.setattr(
        prefill, "install", lambda wd, model, on_safe_size: calls.append((wd, model, on_safe_size))
    )
    hooks = server_hooks.ServerHooks({}, adapt_prefill=True)
    provider = argparse.Namespace(cli_args=argparse.Namespace(prefill_step_size=2048))
    watchdog, model = Watchdog(export=False), object()
    hooks._install_prefill(watchdog, model, provider)
    ((wd, got_model, on_safe_size),) = calls
    assert wd is watchdog and got_model is model
    on_safe_size(300)
    assert provider.cli_args.prefill_step_size == 300
    on_safe_size(1 << 20)  # never above what the user asked for
    assert provider.cli_args.prefill_step_size == 2048
    on_safe_size(0)
    assert provider.cli_args.prefill_step_size == 1


# --------------------------------------------------------------------------- stop bookkeeping


def _server_record(cls, **given):
    """One of mlx_lm.server's dataclasses (GenerationContext, Response) built by field name
    whatever fields this mlx-lm version gives it: ``given`` where it has the field, None for the
    other fields without a default (0.31 and 0.32 differ in both)."""
    fields = [f for f in dataclasses.fields(cls) if f.init]
    return cls(
        **{
            f.name: given.get(f.name)
            for f in fields
            if f.name in given
            or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        }
    )


class _FakeGenerator:
    def __init__(self):
        self.requests = Queue()


def test_batch_stop_ends_started_requests_and_requeues_waiting_ones():
    import mlx_lm.server as server

    hooks = server_hooks.ServerHooks({})
    generator = _FakeGenerator()
    queues = [Queue() for _ in range(4)]
    channels = []
    for q in queues:
        channel = server_hooks._Channel(hooks, q, (q, f"request-{len(channels)}", "args"))
        hooks._track(generator, channel)
        channels.append(channel)
    context = _server_record(
        server.GenerationContext, has_tool_calling=False, has_thinking=False, prompt=[1, 2]
    )
    channels[0].put(context)  # started, streamed one token (mlx-lm 0.31: in a reasoning span)
    streamed = _server_record(
        server.Response, text="a", token=97, logprob=-0.5, top_tokens=(), state="reasoning", match=(5,)
    )
    channels[0].put(streamed)
    channels[1].put(_server_record(server.GenerationContext, prompt=[1]))
    channels[1].put(None)  # finished normally
    # channels[2] and [3] were taken but had not started (e.g. waiting to join a batch)
    forecast = Forecast(
        step=9, resident_buffers=95, limit=100, buffers_per_step=5.0, steps_to_limit=1.0, seconds_to_limit=0.1
    )
    hooks._after_batch_stop(generator, ResourceLimitForecast(forecast))

    got = [queues[0].get_nowait() for _ in range(queues[0].qsize())]
    assert got[0] is context and got[1].text == "a"
    assert got[2].finish_reason == server_hooks.STOP_FINISH_REASON and got[2].text == "" and got[3] is None
    assert got[2].token == 97 and type(got[2]) is server.Response
    if hasattr(streamed, "state"):  # mlx-lm 0.31: the span goes on, and no stop sequence to hide
        assert got[2].state == "reasoning" and got[2].match is None
    assert queues[1].qsize() == 2  # untouched: it had ended
    assert queues[2].empty() and queues[3].empty()
    requeued = [generator.requests.get_nowait() for _ in range(generator.requests.qsize())]
    assert requeued == [(queues[2], "request-2", "args"), (queues[3], "request-3", "args")]
    assert hooks._channels == {}


def test_the_final_chunk_is_built_by_field_name_and_an_unknown_response_is_refused():
    @dataclasses.dataclass
    class Reordered:  # the fields of mlx-lm 0.32's Response in another order, one with a default
        finish_reason: str | None
        top_tokens: tuple
        token: int
        text: str
        logprob: float = 1.0

    last = Reordered(None, (), 42, "x", -0.1)
    final = server_hooks.stop_response(Reordered, last)
    assert final == Reordered(server_hooks.STOP_FINISH_REASON, (), 42, "", 0.0)

    @dataclasses.dataclass
    class Novel:  # a required field nobody knows the meaning of: refused, not guessed
        text: str
        token: int
        speculative: bool

    with pytest.raises(RuntimeError, match=r"fields \['speculative'\] not known"):
        server_hooks.stop_response(Novel, None)


def test_a_stop_put_on_the_queue_becomes_the_final_chunk():
    # mlx-lm's unbatched path puts any exception on the response queue.
    import mlx_lm.server as server

    hooks = server_hooks.ServerHooks({})
    queue = Queue()
    channel = server_hooks._Channel(hooks, queue, (queue, None, None))
    channel.put(_server_record(server.GenerationContext, prompt=[1]))
    forecast = Forecast(
        step=1,
        resident_buffers=200,
        limit=100,
        buffers_per_step=0.0,
        steps_to_limit=0.0,
        seconds_to_limit=0.0,
    )
    channel.put(ResourceLimitForecast(forecast))
    channel.put(ValueError("after the end"))  # forwarded as is: the handler stopped reading
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert items[1].finish_reason == server_hooks.STOP_FINISH_REASON and items[2] is None
    assert channel.finished and not channel.stop(ResourceLimitForecast(forecast))
    # Not started: the handler gets an error it answers with {"error": ...}.
    queue = Queue()
    channel = server_hooks._Channel(hooks, queue, (queue, None, None))
    channel.put(ResourceLimitForecast(forecast))
    error = queue.get_nowait()
    assert isinstance(error, RuntimeError) and str(error) == str(ResourceLimitForecast(forecast))
