"""What the metrics of `mlx-watchdog run` cost: the snapshot writer in a decoding process, the
supervisor's scrape of 1, 4 and 16 process files, how stale a merged reading can be, and why not
prometheus_client's multiprocess mode (an experiment).

    python benchmarks/run_metrics.py --out run_metrics.md          # ~2 min on 2 cores
    python benchmarks/run_metrics.py --smoke                       # seconds

Markdown on stdout (and appended to --out).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from prometheus_client import CollectorRegistry, generate_latest

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.exporters.processes import (
    ProcessesCollector,
    SnapshotWriter,
    snapshot_path,
    start_processes_server,
)
from mlx_watchdog.tiny import build_model, tiny_prompts


def quantiles(xs: list[float]) -> str:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) >= 2 else [xs[0]] * 9
    return f"{statistics.median(xs):.2f} (p10 {q[0]:.2f}, p90 {q[-1]:.2f}, max {xs[-1]:.2f})"


def decoder(layers: int, seed: int = 0):
    model = build_model("qwen3_next", layers=layers)
    watchdog = Watchdog(name=f"qwen3_next-{layers}")
    watch_model(model, watchdog)
    gen = BatchGenerator(model, max_tokens=10**9)
    gen.insert(tiny_prompts(2, 6, seed=seed))
    return model, watchdog, gen


def writer_cost(layers: int, seconds: float, folder: Path) -> dict:
    """Each write's wall and thread CPU time while a watched leaking decode runs on the main thread
    (the writer's thread forced to write every 0.1 s, 10x the default, to collect samples)."""
    model, watchdog, gen = decoder(layers)
    folder.mkdir(parents=True, exist_ok=True)
    writer = SnapshotWriter(folder)
    walls, cpus, sizes = [], [], []
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.1):
            t, c = time.perf_counter(), time.thread_time()
            if writer.write(force=True):
                walls.append((time.perf_counter() - t) * 1e3)
                cpus.append((time.thread_time() - c) * 1e3)
                sizes.append(writer.path.stat().st_size)

    for _ in range(200):  # the growth measured before timing
        gen.next_generated()
    thread = threading.Thread(target=loop, daemon=True)
    steps, t0 = 0, time.perf_counter()
    thread.start()
    while time.perf_counter() - t0 < seconds:
        gen.next_generated()
        steps += 1
    stop.set()
    thread.join()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    template = writer.path.read_text().split("\n", 1)[1]  # a real decoding snapshot, for the scrape
    writer.stop()
    gen.close()
    unwatch_model(model)
    watchdog.export = False
    if watchdog.internal_errors:  # caught and counted, the decode went on: an error path's numbers
        raise SystemExit(f"run_metrics.py: the watchdog had {watchdog.internal_errors} internal errors")
    return {
        "wall": walls,
        "cpu": cpus,
        "size": statistics.median(sizes),
        "step_ms": step_ms,
        "steps": steps,
        "template": template,
    }


def paired_decode(layers: int, rounds: int, block: int, folder: Path) -> dict:
    """Blocks of ``block`` steps, writer off / off again (A/A) / on at the default rate, in a
    random order each round: tokens/s of each against off."""
    model, watchdog, gen = decoder(layers, seed=1)
    folder.mkdir(parents=True, exist_ok=True)
    for _ in range(200):
        gen.next_generated()
    writer = SnapshotWriter(folder)  # default interval: 1 s
    ratios: dict[str, list[float]] = {"aa": [], "on": []}
    for _ in range(rounds):
        order = ["off", "aa", "on"]
        random.shuffle(order)
        seconds = {}
        for variant in order:
            if variant == "on":
                writer.start()
            t = time.perf_counter()
            for _ in range(block):
                gen.next_generated()
            seconds[variant] = time.perf_counter() - t
            if variant == "on":
                writer.stop(remove=False)
                writer = SnapshotWriter(folder)
        for variant in ("aa", "on"):
            ratios[variant].append(seconds["off"] / seconds[variant])
    writer.stop()
    gen.close()
    unwatch_model(model)
    watchdog.export = False
    if watchdog.internal_errors:  # caught and counted, the decode went on: an error path's numbers
        raise SystemExit(f"run_metrics.py: the watchdog had {watchdog.internal_errors} internal errors")
    return ratios


def scrape_time(template: str, counts: list[int], reps: int) -> dict:
    """The supervisor's scrape (collect + exposition, and over HTTP) with N live process files,
    each a copy of a real decoding snapshot (``template``) under the pid of a live process."""
    import psutil

    results = {}
    for n in counts:
        state = Path(tempfile.mkdtemp(prefix="run-metrics-scrape-"))
        sleepers = [
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(n)
        ]
        try:
            for p in sleepers:
                started = psutil.Process(p.pid).create_time()
                header = f"# mlx-watchdog snapshot pid={p.pid} started={started!r}\n"
                snapshot_path(state, p.pid).write_text(header + template)
            registry = CollectorRegistry()
            registry.register(ProcessesCollector(state))

            def rewrite(state: Path = state) -> None:  # every process wrote since the last scrape
                for path in state.glob("*.prom"):
                    tmp = path.with_name("." + path.name)
                    tmp.write_text(path.read_text())
                    os.replace(tmp, path)

            changed, unchanged = [], []
            for _ in range(reps):
                rewrite()
                t = time.perf_counter()
                body = generate_latest(registry)
                changed.append((time.perf_counter() - t) * 1e3)
                t = time.perf_counter()
                generate_latest(registry)
                unchanged.append((time.perf_counter() - t) * 1e3)
            server = start_processes_server(state, 0)
            over_http = []
            try:
                for _ in range(reps):
                    rewrite()
                    t = time.perf_counter()
                    with urllib.request.urlopen(server.url, timeout=10) as r:
                        r.read()
                    over_http.append((time.perf_counter() - t) * 1e3)
            finally:
                server.close()
            results[n] = {"changed": changed, "unchanged": unchanged, "http": over_http, "bytes": len(body)}
        finally:
            for p in sleepers:
                p.kill()
                p.wait()
    return results


def staleness(layers: int, samples: int, folder: Path) -> list[float]:
    """Seconds from a step to the first merged scrape that shows it (the writer at its default
    rate, the scrape polled every 10 ms): the bound is the writer's interval plus one write."""
    model, watchdog, gen = decoder(layers, seed=2)
    folder.mkdir(parents=True, exist_ok=True)
    for _ in range(100):
        gen.next_generated()
    writer = SnapshotWriter(folder).start()
    registry = CollectorRegistry()
    registry.register(ProcessesCollector(folder, process_metrics=False))
    pid = str(os.getpid())
    delays = []

    def seen_steps() -> float:
        for family in registry.collect():
            for s in family.samples:
                if s.name == "mlx_watchdog_steps_total" and s.labels.get("pid") == pid:
                    return s.value
        return -1.0

    for _ in range(samples):
        time.sleep(random.uniform(0.0, 1.0))  # a random phase against the writer's ticks
        gen.next_generated()
        target, t = watchdog.steps, time.perf_counter()
        while seen_steps() < target:
            time.sleep(0.01)
        delays.append(time.perf_counter() - t)
    writer.stop()
    gen.close()
    unwatch_model(model)
    watchdog.export = False
    if watchdog.internal_errors:  # caught and counted, the decode went on: an error path's numbers
        raise SystemExit(f"run_metrics.py: the watchdog had {watchdog.internal_errors} internal errors")
    return delays


MULTIPROCESS_CHECK = textwrap.dedent(
    """
    import os, sys, tempfile, warnings
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
    from prometheus_client import CollectorRegistry, Gauge, generate_latest
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.multiprocess import MultiProcessCollector

    class Built:  # what WatchdogCollector is: families built at scrape time
        def collect(self):
            g = GaugeMetricFamily("built_at_scrape", "a collector's family", labels=["watchdog"])
            g.add_metric(["qwen"], 5.0)
            yield g

    local = CollectorRegistry()
    local.register(Built())
    site = Gauge("leak_buffers_per_step", "per site", ["site"], registry=local, multiprocess_mode="all")
    site.labels("ArraysCache.left_padding").set(5)
    site.labels("KVCache.offset").set(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        site.remove("ArraysCache.left_padding")
    in_process = sorted(s.labels["site"] for f in local.collect() if f.name == "leak_buffers_per_step" for s in f.samples)
    merged = CollectorRegistry()
    MultiProcessCollector(merged, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    text = generate_latest(merged).decode()
    print("in-process sites after remove():", in_process)
    print("merged view has the collector's family:", "built_at_scrape" in text)
    print("merged view still has the removed site:", "ArraysCache.left_padding" in text)
    print("warning:", "; ".join(str(w.message) for w in caught) or "none")
    """
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="decode time of the writer-cost run")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the paired decode")
    parser.add_argument("--block", type=int, default=400, help="steps per variant and round")
    parser.add_argument("--reps", type=int, default=50, help="scrapes per process count")
    parser.add_argument("--stale", type=int, default=20, help="staleness samples")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds, args.rounds, args.block, args.reps, args.stale = 1.0, 1, 20, 3, 2
    lines = [
        f"## run metrics ({time.strftime('%Y-%m-%d %H:%M')}, mlx {mx.__version__}, "
        f"{os.cpu_count()} CPUs, {args.layers}-layer tiny qwen3_next, batch 2)",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="run-metrics-") as tmp:
        folder = Path(tmp)
        cost = writer_cost(args.layers, args.seconds, folder / "cost")
        paired = paired_decode(args.layers, args.rounds, args.block, folder / "paired")
        scrape = scrape_time(cost["template"], [1, 4, 16], args.reps)
        stale = staleness(args.layers, args.stale, folder / "stale")
    share = statistics.median(cost["wall"]) / 1000.0  # one write a second at most
    lines += [
        f"Writer, one write (render + tmp file + os.replace), {len(cost['wall'])} writes during "
        f"{cost['steps']} decode steps of {cost['step_ms']:.2f} ms:",
        "",
        f"- wall ms: {quantiles(cost['wall'])}",
        f"- thread CPU ms: {quantiles(cost['cpu'])}",
        f"- file: {cost['size']:.0f} bytes",
        "- share of decode time at the default rate (at most one write a second): "
        f"{statistics.median(cost['cpu']) / 1000.0:.3%} by the writer's CPU time, {share:.3%} by its wall "
        "time (which counts waiting for a core)",
        "",
        f"Paired decode, blocks of {args.block} steps, {args.rounds} rounds, tokens/s against the "
        "writer off (A/A: off again):",
        "",
        f"- A/A: {quantiles(paired['aa'])}",
        f"- writer on (1 s): {quantiles(paired['on'])}",
        "",
        "Supervisor scrape (ms) with N live process files:",
        "",
        "| N | every file rewritten since the last scrape | none rewritten (idle processes) "
        "| over HTTP, every file rewritten | body bytes |",
        "|---|---|---|---|---|",
    ]
    for n, r in scrape.items():
        lines.append(
            f"| {n} | {quantiles(r['changed'])} | {quantiles(r['unchanged'])} | {quantiles(r['http'])} "
            f"| {r['bytes']} |"
        )
    lines += [
        "",
        f"Staleness, a step to the first merged reading that shows it ({len(stale)} samples, s): "
        f"{quantiles(stale)}",
        "",
        "prometheus_client multiprocess mode:",
        "",
        "```text",
    ]
    done = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS_CHECK], capture_output=True, text=True, timeout=120
    )
    lines += done.stdout.strip().splitlines() + ["```", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
