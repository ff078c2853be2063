"""Helpers shared by the tests: free ports, required system binaries (Prometheus, promtool,
Alertmanager), starting and stopping those servers, small HTTP / PromQL clients, the exact
live-buffer counter, a batched decode and a fake clock for the watchdog.

Policy for missing binaries: locally a test that needs one skips with a loud reason (printed to
stderr and raised as a warning); under CI=true it fails, so CI never passes by skipping.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

LOOPBACK = "127.0.0.1"
JOB = "mlx-watchdog"  # the job name the alert rules select on (up{job="mlx-watchdog"})
IN_CI = os.environ.get("CI", "").lower() == "true"

# Which Debian package ships each binary, for the "install it" hint.
_PACKAGES = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "alertmanager": "prometheus-alertmanager",
}


# --------------------------------------------------------------------------- the watchdog's time


class FakeClock:
    """All the time the watchdog sees (``mlx_watchdog.core.clock``: wall and CPU), moved by the
    test alone: what the watchdog decides from time (when to walk, what fits its budget, how much
    a reading walks, its own time) is then the same on any machine, at any load.

    ``now`` is the wall clock, ``cpu_now`` the CPU time of every thread. ``work(s)`` moves both
    (the watchdog working); moving ``now`` alone is time that does no work for it (the decode, a
    wait for a core)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.cpu_now = 0.0

    def wall(self) -> float:
        return self.now

    def cpu(self) -> float:
        return self.cpu_now

    def work(self, seconds: float) -> None:
        self.now += seconds
        self.cpu_now += seconds

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
        from mlx_watchdog.core import clock

        monkeypatch.setattr(clock, "wall", self.wall)
        monkeypatch.setattr(clock, "cpu", self.cpu)
        return self

    def step_each_observe(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        """Every ``Watchdog.observe`` call (from any attachment point) comes ``seconds`` after the
        last: a real decode's steps, each as long on any machine."""
        from mlx_watchdog.core.watchdog import Watchdog

        real_observe = Watchdog.observe

        def observe(wd, *args, **kwargs):
            self.now += seconds
            return real_observe(wd, *args, **kwargs)

        monkeypatch.setattr(Watchdog, "observe", observe)

    def charge_walks(
        self, monkeypatch: pytest.MonkeyPatch, cost: Callable[[Any], float], wall: float = 1.0
    ) -> None:
        """Each walk of the graph (``sampling.account``) works ``cost(reading)`` CPU seconds and
        takes ``wall`` times that on the wall clock: 1, a core of its own; more, it waited for
        one (beside busy processes on 2 cores: up to 3.9 measured); 0, the walks seem free to the
        schedule, and only the sampler sees their cost."""
        from mlx_watchdog.core import sampling

        real_account = sampling.account

        def costly_account(arrays, **options):
            reading = real_account(arrays, **options)
            work = cost(reading)
            self.cpu_now += work
            self.now += wall * work
            return reading

        monkeypatch.setattr(sampling, "account", costly_account)


# --------------------------------------------------------------------------- ports


@contextlib.contextmanager
def cpu_load(processes: int = 2) -> Iterator[None]:
    """Busy processes beside the test, as on a loaded machine (2 cores here): for what must hold
    on the real clock whatever the machine does."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


def sse_events(response: Iterable[bytes]) -> Iterator[dict | None]:
    """The events of a server-sent-events reply (an OpenAI-style stream): each ``data:`` line's
    JSON, and None for ``[DONE]``."""
    for raw in response:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        yield None if data == "[DONE]" else json.loads(data)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def busy_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a listening socket holds for the ``with`` block."""
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        yield busy.getsockname()[1]


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free on 127.0.0.1 (checked by binding them all)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"free_port_run needs n >= 1 ports, got {n!r}")
    for _ in range(200):
        base = free_port()
        if base + n > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind((LOOPBACK, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found on {LOOPBACK}")


# --------------------------------------------------------------------------- binaries


def find_binary(*names: str) -> str | None:
    """The path of the first of ``names`` on PATH or in /usr/bin, else None."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
        if Path("/usr/bin", name).exists():
            return str(Path("/usr/bin", name))
    return None


def missing(message: str) -> None:
    """Fail under CI=true; otherwise skip loudly (stderr, a warning and the skip reason)."""
    if IN_CI:
        pytest.fail(message)
    print(f"\n*** WARNING: {message} ***", file=sys.stderr)
    warnings.warn(message, stacklevel=2)
    pytest.skip(f"*** {message} ***")


def mlx_before_0_32() -> bool:
    """mlx 0.31.x, the line the second run uses (make test-mlx-031)."""
    import mlx.core as mx

    return tuple(int(p) for p in mx.__version__.split(".")[:2]) < (0, 32)


def mlx_says_evaluated(array) -> bool:
    """MLX's own answer, not the watchdog's: ``mx.get_array_buffer_size`` refuses an unevaluated
    array (mlx 0.32.4); without it, ``mx.export_to_dot`` writes an array that has no primitive
    (evaluated, or scheduled) as a source."""
    import mlx.core as mx

    if hasattr(mx, "get_array_buffer_size"):
        try:
            mx.get_array_buffer_size(array)
            return True
        except ValueError:
            return False
    text: list[str] = []
    mx.export_to_dot(SimpleNamespace(write=text.append), n0=array)
    return '{ rank=source; "n0"; }' in "".join(text)


def needs_model_type(model_type: str) -> pytest.MarkDecorator:
    """Skip, saying why, where the installed mlx-lm does not ship ``model_type`` (``deepseek_v41``
    came in mlx-lm 0.32; the tests also run on mlx-lm 0.31)."""
    from mlx_watchdog import tiny

    reason = tiny.missing_model_types().get(model_type)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def model_type_params(model_types: Iterable[str]) -> list:
    """``model_types`` as pytest parameters, each skipped where the installed mlx-lm lacks it."""
    return [pytest.param(t, marks=needs_model_type(t)) for t in model_types]


def exact_counter():
    """The exact live-buffer counter (tests/exact_buffers.py); skips loudly (fails in CI) when it
    cannot be installed."""
    import exact_buffers

    try:
        return exact_buffers.install()
    except RuntimeError as exc:
        missing(f"the exact live-buffer counter cannot be installed: {exc}")


def batched_tokens(model, steps: int, prompts) -> list[list[int]]:
    """Decode ``prompts`` together through mlx-lm's ``BatchGenerator`` for ``steps`` tokens: the
    tokens of each step, in the batch's order."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=steps)
    gen.insert(prompts)
    tokens = []
    while responses := gen.next_generated():
        tokens.append([r.token for r in responses])
    gen.close()
    return tokens


def require_binary(*names: str) -> str:
    """The path of the first of ``names`` found; skips loudly (fails in CI) when none is."""
    if not names:
        raise ValueError("require_binary needs at least one binary name")
    path = find_binary(*names)
    if path:
        return path
    packages = sorted({_PACKAGES.get(name, name) for name in names})
    missing(
        f"{' / '.join(names)} NOT INSTALLED: this test cannot run. Install Debian's "
        f"{' and '.join(f'`{p}`' for p in packages)} package (make system-deps); "
        "under CI=true this is a failure."
    )
    raise AssertionError("unreachable")  # missing() always raises


# --------------------------------------------------------------------------- processes


def log_tail(path: Path, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_process(cmd: Sequence[str], log: Path, *, new_session: bool = False) -> subprocess.Popen:
    """Start ``cmd`` with stdout and stderr going to ``log`` and no stdin."""
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [str(c) for c in cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=new_session,
        )


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30, log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200; fail the test (after stopping ``proc``) if the process
    exits first or ``timeout`` seconds pass. ``log`` is quoted in the failure."""
    name = Path(str(proc.args[0])).name if isinstance(proc.args, (list, tuple)) else str(proc.args)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"{name} exited with {proc.returncode} before {url} was ready:\n"
                f"{log_tail(log) if log else ''}"
            )
        try:
            if http_get(url, timeout=1)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    stop_process(proc)
    pytest.fail(f"{name} not ready at {url} after {timeout} s:\n{log_tail(log) if log else ''}")


def stop_process(proc: subprocess.Popen | None, timeout: float = 10, *, group: bool = False) -> None:
    """Stop ``proc``: terminate, wait up to ``timeout`` s, then kill. With ``group=True`` (a process
    started with ``new_session=True`` that has children, e.g. a launcher) kill its whole process
    group at once: a launcher may not pass SIGTERM on to its children."""
    if proc is None or proc.poll() is not None:
        return  # already exited and reaped: its pid may belong to someone else now
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout)
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


# --------------------------------------------------------------------------- Prometheus, Alertmanager


def start_prometheus(
    tmp_path: Path,
    targets: Iterable[str] = (),
    *,
    rule_files: Iterable[Path] = (),
    alertmanager_url: str | None = None,
    extra_flags: Sequence[str] = (),
    storage: Path | None = None,
    interval: str = "1s",
    timeout: float = 30,
) -> tuple[subprocess.Popen, str]:
    """Start Prometheus on a free loopback port with a config written to
    ``tmp_path/prometheus.yml``: job ``mlx-watchdog`` scraping ``targets`` (host:port) every
    ``interval``, rules evaluated every ``interval``, alerts sent to ``alertmanager_url``.
    Waits for ``/-/ready``. Returns (process, base URL); the caller stops the process
    (``stop_process``). The log is ``tmp_path/prometheus.log``."""
    binary = require_binary("prometheus")
    tmp_path = Path(tmp_path)
    targets = list(targets)
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}] if targets else [],
    }
    rule_files = [str(p) for p in rule_files]
    if rule_files:
        config["rule_files"] = rule_files
    if alertmanager_url:
        host = urllib.parse.urlsplit(alertmanager_url).netloc
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [host]}]}]}
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    port = free_port()
    log = tmp_path / "prometheus.log"
    proc = start_process(
        [
            binary,
            f"--config.file={path}",
            f"--storage.tsdb.path={storage or tmp_path / 'data'}",
            f"--web.listen-address={LOOPBACK}:{port}",
            *extra_flags,
        ],
        log,
    )
    base = f"http://{LOOPBACK}:{port}"
    wait_ready(base + "/-/ready", proc, timeout, log)
    return proc, base


def start_alertmanager(tmp_path: Path, config: Path, timeout: float = 30) -> tuple[subprocess.Popen, str]:
    """Start Alertmanager on a free loopback port with ``config``, clustering off, its state in
    ``tmp_path/alertmanager``. Waits for ``/-/ready``; returns (process, base URL). The log is
    ``tmp_path/alertmanager.log``."""
    binary = require_binary("prometheus-alertmanager", "alertmanager")
    storage = Path(tmp_path) / "alertmanager"
    storage.mkdir(exist_ok=True)
    port = free_port()
    log = Path(tmp_path) / "alertmanager.log"
    proc = start_process(
        [
            binary,
            f"--config.file={config}",
            f"--storage.path={storage}",
            f"--web.listen-address={LOOPBACK}:{port}",
            "--cluster.listen-address=",
        ],  # empty: no gossip port, no peers
        log,
    )
    base = f"http://{LOOPBACK}:{port}"
    wait_ready(base + "/-/ready", proc, timeout, log)
    return proc, base


# --------------------------------------------------------------------------- HTTP


def http_get(url: str, timeout: float = 5, context=None) -> tuple[int, bytes]:
    """(status, body); an HTTP error status is returned, not raised (its body is the reason).
    Connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def prom_api(base: str, path: str, *, method: str = "POST", timeout: float = 10, **params) -> dict:
    """Call a Prometheus HTTP API path with ``params`` (form-encoded for POST, in the URL for
    GET; some paths, e.g. /api/v1/rules, are GET only). The JSON reply, errors included (a bad
    query answers 400 with ``status: error``)."""
    encoded = urllib.parse.urlencode(params, doseq=True)
    if method == "GET":
        request = urllib.request.Request(base + path + (f"?{encoded}" if encoded else ""), method="GET")
    elif method == "POST":
        request = urllib.request.Request(base + path, data=encoded.encode(), method="POST")
    else:
        raise ValueError(f"method must be GET or POST, got {method!r}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return json.loads(body)
        except ValueError:  # not the API's JSON error (e.g. 405 Method Not Allowed)
            return {
                "status": "error",
                "errorType": f"http {exc.code}",
                "error": body.decode(errors="replace"),
            }


def prom_query(base: str, expr: str, **params) -> list[dict]:
    """The result list of an instant query; fails the test with Prometheus' error if any."""
    reply = prom_api(base, "/api/v1/query", query=expr, **params)
    assert reply.get("status") == "success", f"query {expr!r}: {reply}"
    return reply["data"]["result"]


class Scheduler:
    """What a server keeps of each step outside the model's cache, never evaluated (Rapid-MLX's
    #2834): the tokens so far as one array, and a running score. Each chain holds one more buffer
    a step (the token's array; the step's log-probabilities)."""

    def __init__(self):
        import mlx.core as mx

        self.history = mx.array([0])
        self.score = mx.array(0.0)
        self.steps = 0
        mx.eval(self.history, self.score)

    def step(self, token: int, logprobs: Any) -> None:
        import mlx.core as mx

        self.history = mx.concatenate([self.history, mx.array([token])])
        self.score = self.score + logprobs.max()
        self.steps += 1
