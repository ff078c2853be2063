"""How often ``mlx-watchdog serve`` exits cleanly when stopped by SIGINT or SIGTERM after a request.

Each run starts ``python -m mlx_watchdog serve --no-metrics`` on a tiny random-weight qwen3_next
(8 layers, the test suite's model), waits for ``/health``, streams one completion, sends the
signal and waits for the process. A run is

- ``clean``: exit status 0 and neither ``terminate called`` nor ``Fatal Python error`` in its output;
- ``abort``: killed by SIGABRT at exit (``terminate called without an active exception``);
- ``hang``: still running ``--wait`` seconds after the signal (then sent SIGABRT, which prints its
  threads' stacks, and SIGKILL);
- ``other``: any other exit status or output.

The signals alternate (``--signals SIGINT,SIGTERM``). ``--inherit-sigint ignored`` starts the
server the way a shell starts a background job (``serve ... &`` in a script, a CI step run in
the background): with SIGINT ignored. ``--load N`` runs N busy loops (niced) beside it.
``--jobs N`` runs N servers at a time. ``--python`` is the interpreter that runs the server (another environment, e.g. another mlx);
``--source DIR`` runs the ``mlx_watchdog`` of a checkout at DIR instead of the installed one
(its ``watchdog/`` folder), to measure a base revision:

    python benchmarks/serve_shutdown.py --runs 50 --load 2 --out results/serve_shutdown.md
    git archive BASE watchdog | tar -x -C /tmp/base
    python benchmarks/serve_shutdown.py --runs 50 --source /tmp/base
    python benchmarks/serve_shutdown.py --runs 1 --signals SIGINT   # one run: what the tests run

Failed runs keep their output in ``--logs`` (a temporary folder by default).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

STARTUP_SECONDS = 120
OUTCOMES = ("clean", "abort", "hang", "other")
PROMPT = "The watchdog counts buffers"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen) -> bool:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def stream_completion(port: int, max_tokens: int, eos_id: int) -> int:
    """Stream one completion (EOS forbidden, so it runs to ``max_tokens``); returns the bytes read."""
    body = {
        "model": "default_model",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "logit_bias": {str(eos_id): -100},
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"completion: HTTP {response.status}")
        return len(response.read())
    finally:
        connection.close()


def classify(code: int | None, output: str) -> str:
    if code is None:
        return "hang"
    if code == 0 and "terminate called" not in output and "Fatal Python error" not in output:
        return "clean"
    if code in (-signal.SIGABRT, 128 + signal.SIGABRT) and "terminate called" in output:
        return "abort"
    return "other"


def one_run(args: argparse.Namespace, index: int, sig: signal.Signals, model: Path, logs: Path, eos: int):
    port = free_port()
    log = logs / f"run-{index:03d}-{sig.name}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    if args.source:
        alias = logs / "source"  # mlx_watchdog -> the checkout's watchdog/ folder
        alias.mkdir(exist_ok=True)
        if not (alias / "mlx_watchdog").exists():
            (alias / "mlx_watchdog").symlink_to(Path(args.source).resolve() / "watchdog")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(alias), env.get("PYTHONPATH")]))
    # A shell's background job: SIGINT ignored (`trap "" INT` before exec), which exec keeps.
    shell = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"] if args.inherit_sigint == "ignored" else []
    command = [
        *shell,
        args.python,
        "-m",
        "mlx_watchdog",
        "serve",
        "--no-metrics",
        "--",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=logs,
        )
    code: int | None = None
    try:
        if not wait_healthy(port, process):
            raise RuntimeError(f"server not up (exit {process.poll()}): see {log}")
        stream_completion(port, 8 + index % 8, eos)
        process.send_signal(sig)
        try:
            code = process.wait(args.wait)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)  # its threads' stacks go to the log
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log.read_text(errors="replace")
    outcome = classify(code, output)
    if outcome == "clean":
        log.unlink()
    return outcome, code, log


def markdown(args: argparse.Namespace, counts: dict, seconds: float, versions: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"## serve_shutdown: {now}",
        "",
        f"`python benchmarks/serve_shutdown.py {' '.join(sys.argv[1:])}`",
        "",
        f"{versions}; SIGINT inherited {args.inherit_sigint}; {args.jobs} server(s) at a time; "
        f"{args.load} busy loop(s) beside them; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end; {seconds / 60:.1f} min.",
        "",
        "| signal | runs | " + " | ".join(OUTCOMES) + " |",
        "|---|---|" + "---|" * len(OUTCOMES),
    ]
    for name, outcome_counts in counts.items():
        runs = sum(outcome_counts.values())
        lines.append(f"| {name} | {runs} | " + " | ".join(str(outcome_counts[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per signal (default 50)")
    parser.add_argument("--signals", default="SIGINT,SIGTERM", help="alternated (default SIGINT,SIGTERM)")
    parser.add_argument("--inherit-sigint", choices=("default", "ignored"), default="default")
    parser.add_argument("--load", type=int, default=0, help="busy loops beside the server")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs serve")
    parser.add_argument("--source", help="a checkout whose watchdog/ is run as mlx_watchdog")
    parser.add_argument("--jobs", type=int, default=1, help="servers run at the same time (default 1)")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the exit")
    parser.add_argument("--logs", help="folder for the failed runs' output (default: a new temporary one)")
    parser.add_argument("--out", help="append the markdown report to this file")
    args = parser.parse_args(argv)

    from mlx_watchdog import tiny

    # The servers inherit SIG_DFL from here (Python's own handler), even where this benchmark was
    # started with SIGINT ignored; --inherit-sigint ignored sets it in their shell.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    signals = [signal.Signals[name.strip()] for name in args.signals.split(",")]
    logs = Path(args.logs or tempfile.mkdtemp(prefix="serve-shutdown-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = logs / "tiny-qwen3-next"
    if not model.exists():
        tiny.save_model_dir(model, "qwen3_next", layers=8)
    versions = subprocess.run(
        [
            args.python,
            "-c",
            "import mlx.core as mx, mlx_lm; print(f'mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}')",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    busy = [
        subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while 1: pass"])
        for _ in range(args.load)
    ]
    counts: dict[str, collections.Counter] = {s.name: collections.Counter() for s in signals}
    started = time.monotonic()
    lock = threading.Lock()

    def run(index: int) -> None:
        sig = signals[index % len(signals)]
        outcome, code, log = one_run(args, index, sig, model, logs, tiny.EOS_ID)
        with lock:
            counts[sig.name][outcome] += 1
        note = "" if outcome == "clean" else f" (exit {code}; {log})"
        print(f"run {index + 1}: {sig.name} {outcome}{note}", file=sys.stderr, flush=True)

    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(run, i) for i in range(args.runs * len(signals))]:
                future.result()
    finally:
        for process in busy:
            process.kill()
            process.wait()
    report = markdown(args, counts, time.monotonic() - started, versions)
    print(report)
    if args.out:
        with open(args.out, "a") as out:
            out.write("\n" + report)
    return 0 if all(c["clean"] == sum(c.values()) for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
