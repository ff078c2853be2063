"""A busy ``mlx-watchdog serve`` against the unwatched ``mlx_lm.server``, on the same requests.

Several clients keep one continuous batch busy: each sends requests one after the other, of
30-250 tokens, with prompts of varied length, some streamed; they start staggered, so requests
join and leave the running batch every second or so. The request sequence is drawn once from a
seed: every arm serves the same one.

Arms (each a fresh server process on a tiny random-weight qwen3_next, the leaking hybrid):

- ``plain``: ``python -m mlx_lm.server``, the reference; ``aa``: the same again, the A/A control;
- ``watched``: ``mlx-watchdog serve`` with its default options;
- ``fix``: ``mlx-watchdog serve --fix``.

A round runs every arm once, for ``--seconds`` of load each, in an order drawn afresh every round;
each arm is compared with ``plain`` of the same round (minutes apart, not hours), and the A/A row
says how far two runs of the same server differ. Per arm: requests served and tokens per second
(the paired ratio against ``plain``, with a bootstrap interval over rounds), p50/p99 request
latency, failed requests; for the watched arms, scraped from their metrics every second: the
watchdog's own time (``mlx_watchdog_overhead_seconds_total``) over the arm's wall time and over
the server's life, and ``mlx_watchdog_rate_known`` on the scrapes taken while decoding.

    python benchmarks/serve_busy.py --seconds 75 --rounds 3 --out results/serve_busy.md
    python benchmarks/serve_busy.py --smoke      # seconds: what the tests run
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_stats import emit, paired_ratio  # noqa: E402

ARMS = ("plain", "aa", "watched", "fix")
WORDS = (
    "buffer cache graph lazy chain decode batch request token metal limit watchdog leak fix "
    "server prompt layer state array evaluate pending resident forecast step rate memory"
).split()
STARTUP_SECONDS = 120
SCRAPE_SECONDS = 1.0


# --------------------------------------------------------------------------- the load


def request_sequence(seed: int, client: int, count: int, low: int, high: int) -> list[dict]:
    """A client's requests, the same for every arm: varied prompt lengths, 30-250 tokens,
    every other one streamed (at random)."""
    rng = random.Random(f"{seed}-{client}")
    out = []
    for i in range(count):
        words = rng.randint(3, 80)
        prompt = f"client {client} request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        out.append({"prompt": prompt, "max_tokens": rng.randint(low, high), "stream": rng.random() < 0.5})
    return out


def _send(port: int, request: dict, no_eos: dict) -> tuple[int, str]:
    """One completion; returns (tokens, finish_reason). Streamed: the chunks that carry text."""
    body = {
        "model": "default_model",
        "prompt": request["prompt"],
        "max_tokens": request["max_tokens"],
        "stream": request["stream"],
        "logit_bias": no_eos,  # a random model may say EOS anywhere: keep the lengths drawn
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        if not request["stream"]:
            answer = json.loads(response.read())
            usage = answer.get("usage") or {}
            return int(usage.get("completion_tokens", 0)), answer["choices"][0].get("finish_reason")
        tokens, finish = 0, None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            choice = json.loads(data)["choices"][0]
            tokens += 1 if choice.get("text") else 0
            finish = choice.get("finish_reason") or finish
        return tokens, finish
    finally:
        connection.close()


def run_load(port: int, clients: list[list[dict]], seconds: float, stagger: float, no_eos: dict) -> dict:
    """Each client sends its requests one after the other until ``seconds`` have passed (the
    requests in flight then finish). Returns the served requests' records and the load's span."""
    records: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()
    started = time.perf_counter()
    deadline = started + seconds

    def client(c: int, sequence: list[dict]) -> None:
        time.sleep(c * stagger)
        for request in sequence:
            if time.perf_counter() >= deadline:
                return
            t0 = time.perf_counter()
            try:
                tokens, finish = _send(port, request, no_eos)
            except Exception as exc:
                with lock:
                    failures.append(f"client {c}: {exc!r}")
                continue
            with lock:
                records.append(
                    {"client": c, "tokens": tokens, "finish": finish, "seconds": time.perf_counter() - t0}
                )

    threads = [threading.Thread(target=client, args=(c, seq), daemon=True) for c, seq in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"records": records, "failures": failures, "span": time.perf_counter() - started}


# --------------------------------------------------------------------------- the servers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One arm's server process."""

    WATCHED = ["-m", "mlx_watchdog.commands.serve"]  # how a watched arm is started (a diagnostic may wrap it)

    def __init__(self, arm: str, model_dir: Path, workdir: Path) -> None:
        self.arm = arm
        self.port = _free_port()
        self.metrics_port = _free_port() if arm in ("watched", "fix") else None
        server_args = ["--model", str(model_dir), "--port", str(self.port), "--host", "127.0.0.1"]
        server_args += ["--prompt-cache-size", "2"]
        if self.metrics_port is None:
            command = [sys.executable, "-m", "mlx_lm.server", *server_args]
        else:
            watchdog = ["--metrics-port", str(self.metrics_port)] + (["--fix"] if arm == "fix" else [])
            command = [sys.executable, *self.WATCHED, *watchdog, "--", *server_args]
        self.log = workdir / f"{arm}-{self.port}.log"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir
            )
        self.started = time.perf_counter()
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{arm}: server exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"{arm}: server not up after {STARTUP_SECONDS} s")

    def metrics(self) -> dict[str, float]:
        """The watchdog's samples by name (one model, one watchdog)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("mlx_watchdog_") and "site" not in s.labels and "reason" not in s.labels
        }

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)


class Scraper(threading.Thread):
    """Scrapes a watched server's metrics every second while the load runs, as Prometheus would."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.rows: list[dict] = []
        self.errors = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SCRAPE_SECONDS):
            try:
                row = self.server.metrics()
            except Exception:
                self.errors += 1
                continue
            row["time"] = time.perf_counter()
            self.rows.append(row)


def run_arm(arm: str, model_dir: Path, workdir: Path, clients: list[list[dict]], args, no_eos: dict) -> dict:
    server = Server(arm, model_dir, workdir)
    try:
        _send(server.port, {"prompt": "warm up", "max_tokens": 8, "stream": False}, no_eos)
        scraper = None
        if server.metrics_port is not None:
            before = server.metrics()
            before["time"] = time.perf_counter()
            scraper = Scraper(server)
            scraper.start()
        load = run_load(server.port, clients, args.seconds, args.stagger, no_eos)
        result = {"arm": arm, **load}
        if scraper is not None:
            scraper.done.set()
            scraper.join()
            after = server.metrics()
            after["time"] = time.perf_counter()
            overhead = "mlx_watchdog_overhead_seconds_total"
            busy = [r for r in scraper.rows if r.get("mlx_watchdog_decoding") == 1]
            result.update(
                own_share=(after[overhead] - before[overhead]) / (after["time"] - before["time"]),
                own_share_life=after[overhead] / (after["time"] - server.started),
                scrapes_decoding=len(busy),
                rate_known=sum(1 for r in busy if r.get("mlx_watchdog_rate_known") == 1),
                internal_errors=after.get("mlx_watchdog_internal_errors_total", 0.0),
                steps=after.get("mlx_watchdog_steps_total", 0.0),
            )
        code = server.stop()
        result["exit"] = code
        return result
    except BaseException:
        server.stop()
        print(server.log.read_text()[-3000:], file=sys.stderr)
        raise


# --------------------------------------------------------------------------- the report


def _summary(results: list[dict]) -> dict:
    """One arm over its rounds."""
    latencies = [r["seconds"] for res in results for r in res["records"]]
    return {
        "requests": sum(len(res["records"]) for res in results),
        "failed": sum(len(res["failures"]) for res in results),
        "short": sum(1 for res in results for r in res["records"] if r["finish"] != "length"),
        "p50": float(np.percentile(latencies, 50)) if latencies else float("nan"),
        "p99": float(np.percentile(latencies, 99)) if latencies else float("nan"),
    }


def report(runs: list[dict], args, command: str) -> str:
    by_arm: dict[str, list[dict]] = {}
    for res in runs:
        by_arm.setdefault(res["arm"], []).append(res)
    requests = {
        a: {(0, 0, res["round"]): (len(res["records"]), res["span"]) for res in rs}
        for a, rs in by_arm.items()
    }
    tokens = {
        a: {(0, 0, res["round"]): (sum(r["tokens"] for r in res["records"]), res["span"]) for res in rs}
        for a, rs in by_arm.items()
    }
    p50 = {
        a: {res["round"]: statistics.median([r["seconds"] for r in res["records"]]) for res in rs}
        for a, rs in by_arm.items()
    }
    lines = [
        f"## serve_busy: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"`{command}`",
        "",
        f"{len(args.clients_list)} clients, requests of {args.low}-{args.high} tokens, {args.seconds:.0f} s of load "
        f"per arm, {args.rounds} rounds (arms in a random order each round); {os.cpu_count()} CPUs. "
        "Ratios are paired with `plain` of the same round: the arm's total over the rounds against plain's, "
        "with a 95% bootstrap interval over rounds. Read the `aa` row first: it is the noise.",
        "",
        "| arm | requests/s vs plain | 95% interval | tokens/s vs plain | 95% interval | p50 latency vs plain (per round) "
        "| requests | failed | p50 / p99 latency (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in [a for a in ARMS if a in by_arm]:
        s = _summary(by_arm[arm])
        cells = []
        for table in (requests, tokens):
            ratio = paired_ratio(table, arm, "plain") if arm != "plain" else None
            cells += [ratio.percent(), ratio.interval()] if ratio else ["-", "-"]
        rounds = sorted(set(p50[arm]) & set(p50.get("plain", {})))
        lat = [p50[arm][k] / p50["plain"][k] - 1 for k in rounds] if arm != "plain" else []
        lat_cell = (
            f"{100 * statistics.median(lat):+.1f}% ({100 * min(lat):+.1f} .. {100 * max(lat):+.1f})"
            if lat
            else "-"
        )
        lines.append(
            f"| {arm} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {lat_cell} | {s['requests']} "
            f"| {s['failed']} | {s['p50']:.2f} / {s['p99']:.2f} |"
        )
    lines += [
        "",
        "The watchdog's own time (`overhead_seconds_total`) over wall time, and `rate_known` on the scrapes "
        "taken while decoding (one a second), per round:",
        "",
        "| arm | round | own time / load wall | own time / server life | rate known while decoding | steps | internal errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ("watched", "fix"):
        for res in by_arm.get(arm, []):
            lines.append(
                f"| {arm} | {res['round']} | {100 * res['own_share']:.2f}% | {100 * res['own_share_life']:.2f}% "
                f"| {res['rate_known']} of {res['scrapes_decoding']} "
                f"({100 * res['rate_known'] / max(1, res['scrapes_decoding']):.0f}%) | {res['steps']:.0f} "
                f"| {res['internal_errors']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=75.0, help="load per arm (default 75)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--low", type=int, default=30, help="fewest tokens a request asks for")
    parser.add_argument("--high", type=int, default=250, help="most tokens a request asks for")
    parser.add_argument("--stagger", type=float, default=0.4, help="seconds between the clients' starts")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", help="append each arm's result here as it ends")
    parser.add_argument("--out", help="append the report here")
    parser.add_argument("--smoke", action="store_true", help="a few seconds per arm, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds, args.high = 4.0, 1, 60
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - set(ARMS)
    if unknown or "plain" not in arms:
        parser.error(f"--arms takes plain (required), {', '.join(ARMS[1:])}; got {args.arms}")

    from mlx_watchdog import tiny

    no_eos = {str(tiny.EOS_ID): -100}
    args.clients_list = [
        request_sequence(args.seed, c, 2000, args.low, args.high) for c in range(args.clients)
    ]
    command = "python benchmarks/serve_busy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    with tempfile.TemporaryDirectory(prefix="serve_busy-") as tmp:
        workdir = Path(tmp)
        model_dir = tiny.save_model_dir(workdir / "tiny-qwen3-next", "qwen3_next", layers=args.layers)
        order_rng = random.Random(args.seed)
        for rnd in range(args.rounds):
            order = arms[:]
            order_rng.shuffle(order)
            for arm in order:
                result = run_arm(arm, model_dir, workdir, args.clients_list, args, no_eos)
                result["round"] = rnd
                runs.append(result)
                brief = {k: v for k, v in result.items() if k not in ("records",)}
                brief["requests"] = len(result["records"])
                print(json.dumps(brief), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(result) + "\n")
    emit(report(runs, args, command), args.out)
    broken = [
        f"{r['arm']} round {r['round']}: {r['internal_errors']:.0f}" for r in runs if r.get("internal_errors")
    ]
    if broken:  # caught and counted, the server went on: those arms measured an error path
        print("serve_busy.py: the watchdog had internal errors: " + ", ".join(broken), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
