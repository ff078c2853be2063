"""Scrape cost: does a Prometheus scrape pause the decode thread, and for how long (the aim: under 1 ms)?

A tiny hybrid qwen3_next decodes through mlx-lm's BatchGenerator (the leaking path, so the
exposition carries leak series) on the main thread, watched by a Watchdog. The metrics server
(start_metrics_server on prometheus_client's global registry, as a user would run it) answers
on its own threads; a scraper thread fetches /metrics the way Prometheus does (OpenMetrics
Accept header, gzip) over a raw loopback socket, so the client adds almost no Python work.

Measurements, each with its own control:

1. ``alone``: Watchdog.forecast() (the one call that takes the watchdog's lock), the collector's
   collect() and the whole OpenMetrics exposition of the global registry, timed with nothing
   else running; process CPU time per scrape over HTTP (server and client threads; nearly all
   of it Python under the GIL).
2. ``paired`` (the pause): every 16th step, the decode thread tells the scraper to scrape as the
   step starts. pause = (time of that step + the next) - 2 x median of the 6 neighbouring steps
   (3 before, 3 after). Control: the same statistic 8 steps later, where no scrape runs. Load
   changes slowly compared with 16 steps, so pairing cancels most machine noise.
3. ``blocks`` (throughput): blocks of steps with the scraper off and on (back-to-back scrapes,
   the worst case), interleaved off/on, on/off, ...; median step time per block.
4. ``gil_probe`` (worst case): the main thread spins in pure Python (a decode thread that never
   releases the GIL); per scrape, the longest time our other threads kept it off the GIL,
   counted in their CPU time (so other processes' load does not count), against the same
   statistic in windows of the same length without a scrape.

    python benchmarks/scrape_pause.py --scrapes 300 --reps 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import watch_model
from mlx_watchdog.exporters.prometheus import register_collector, start_metrics_server
from mlx_watchdog.tiny import build_model, tiny_prompts

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
CYCLE = 16  # steps per paired measurement: scrape at SCRAPE_AT, control at SCRAPE_AT + 8
SCRAPE_AT = 4


class Scraper(threading.Thread):
    """Scrapes on request (``trigger``) or back-to-back while ``loop`` is set; records windows."""

    def __init__(self, port: int):
        super().__init__(daemon=True, name="scraper")
        self.request = (
            f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: {PROMETHEUS_ACCEPT}\r\n"
            "Accept-Encoding: gzip\r\nUser-Agent: Prometheus/2.42.0\r\nConnection: close\r\n\r\n"
        ).encode()
        self.port = port
        self.go = threading.Event()
        self.loop = False
        self.idle = threading.Event()
        self.idle.set()
        self.stopped = False
        self.windows: list[tuple[float, float]] = []

    def run(self) -> None:
        while not self.stopped:
            if not self.go.wait(0.05):
                continue
            self.idle.clear()
            start = time.perf_counter()
            self.fetch()
            self.windows.append((start, time.perf_counter()))
            if not self.loop:
                self.go.clear()
            self.idle.set()

    def fetch(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port)) as conn:
            conn.sendall(self.request)
            while conn.recv(65536):
                pass

    def wait_for(self, count: int, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while len(self.windows) < count:
            if time.perf_counter() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def trigger(self) -> None:
        self.go.set()

    def start_loop(self) -> None:
        self.loop = True
        self.go.set()

    def stop_loop(self) -> None:
        self.loop = False
        self.go.clear()
        self.idle.wait(5)

    def close(self) -> None:
        self.stopped = True
        self.join(2)


def step(gen: BatchGenerator) -> float:
    start = time.perf_counter()
    if not gen.next_generated():
        raise RuntimeError("the decode ended; raise max_tokens")
    return time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary_ms(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values) * 1e3, 3),
        "p90": round(pct(values, 0.9) * 1e3, 3),
        "p99": round(pct(values, 0.99) * 1e3, 3),
        "max": round(max(values) * 1e3, 3),
        "n": len(values),
    }


def time_calls(fn, n: int) -> dict:
    """CPU time of this thread per call: preemption by other processes does not count."""
    times = []
    for _ in range(n):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return summary_ms(times)


def cpu_per_scrape(scraper: Scraper, seconds: float) -> dict:
    first = len(scraper.windows)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    scraper.start_loop()
    time.sleep(seconds)
    scraper.stop_loop()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = len(scraper.windows) - first
    return {
        "scrapes": n,
        "cpu_ms_per_scrape": round(cpu / n * 1e3, 3),
        "wall_ms_per_scrape": round(wall / n * 1e3, 3),
    }


def paired(gen: BatchGenerator, scraper: Scraper, scrapes: int) -> dict:
    pauses, controls, spilled = [], [], 0

    def excess(times: list[float], at: int) -> float:
        reference = statistics.median(times[at - 3 : at] + times[at + 2 : at + 5])
        return times[at] + times[at + 1] - 2 * reference

    for _ in range(scrapes):
        times = []
        for i in range(CYCLE + 1):  # one step past the cycle: the control's last neighbour
            if i == SCRAPE_AT:
                first = len(scraper.windows)
                scraper.trigger()
            times.append(step(gen))
            if i == SCRAPE_AT + 1:
                pair_end = time.perf_counter()
                if not scraper.wait_for(first + 1, 5) or scraper.windows[first][1] > pair_end:
                    spilled += 1  # the scrape outlasted the two steps measured
        pauses.append(excess(times, SCRAPE_AT))
        controls.append(excess(times, SCRAPE_AT + 8))

    def over(xs):
        return round(sum(x > 1e-3 for x in xs) / len(xs), 3)

    return {
        "scrapes": scrapes,
        "scrapes_longer_than_two_steps": spilled,
        "step_median_ms": None,
        "pause_ms": summary_ms(pauses),
        "control_ms": summary_ms(controls),
        "pause_minus_control_median_ms": round(
            (statistics.median(pauses) - statistics.median(controls)) * 1e3, 3
        ),
        "pause_mean_ms": round(statistics.fmean(pauses) * 1e3, 3),
        "control_mean_ms": round(statistics.fmean(controls) * 1e3, 3),
        "fraction_over_1ms": {"pause": over(pauses), "control": over(controls)},
    }


def blocks(gen: BatchGenerator, scraper: Scraper, steps: int, reps: int) -> dict:
    medians = {"off": [], "on": []}
    per_scrape = []
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            first = len(scraper.windows)
            if mode == "on":
                scraper.start_loop()
            times = [step(gen) for _ in range(steps)]
            if mode == "on":
                scraper.stop_loop()
            medians[mode].append(statistics.median(times))
            if mode == "on":
                per_scrape.append((sum(times), len(scraper.windows) - first))
    off = statistics.median(medians["off"])
    return {
        "steps_per_block": steps,
        "reps": reps,
        "off_block_medians_ms": [round(x * 1e3, 3) for x in medians["off"]],
        "on_block_medians_ms": [round(x * 1e3, 3) for x in medians["on"]],
        "off_median_ms": round(off * 1e3, 3),
        "on_median_ms": round(statistics.median(medians["on"]) * 1e3, 3),
        "scrapes_per_on_block": [n for _, n in per_scrape],
    }


def gil_probe(scraper: Scraper, seconds: float, reps: int, pace: float = 0.05) -> dict:
    """The main thread spins in pure Python (a decode thread that never releases the GIL). For
    every gap in its loop, the CPU time our other threads used meanwhile (process CPU minus this
    thread's) is how long they kept it off the GIL; other processes' CPU does not count, so the
    machine's load hardly matters. It slightly overstates: it includes the scrape's GIL-free
    work (syscalls, zlib) on the other core."""

    def spin(until: float) -> list[tuple[float, float, float]]:
        gaps, process, thread = [], time.process_time, time.thread_time
        last, last_other = time.perf_counter(), process() - thread()
        while last < until:
            now, other = time.perf_counter(), process() - thread()
            if now - last > 20e-6:
                gaps.append((last, now, other - last_other))
            last, last_other = now, other
        return gaps

    def longest(gaps, a, b):
        return max((cpu for s, e, cpu in gaps if s < b and e > a), default=0.0)

    per_scrape, per_control, lengths = [], [], []
    for rep in range(reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            start = time.perf_counter()
            if mode == "on":
                first = len(scraper.windows)
                # Scrapes at a fixed pace from a helper thread, while this thread spins.
                pacer = threading.Thread(target=_pace, args=(scraper, start + seconds, pace), daemon=True)
                pacer.start()
            gaps = spin(start + seconds)
            if mode == "on":
                pacer.join()
                scraper.idle.wait(5)
                windows = scraper.windows[first:]
                lengths += [b - a for a, b in windows]
                per_scrape += [longest(gaps, a, b) for a, b in windows]
            else:
                width = statistics.median(lengths) if lengths else 0.005
                t = start + 0.01
                while t + width < start + seconds:
                    per_control.append(longest(gaps, t, t + width))
                    t += pace
    return {
        "pace_s": pace,
        "scrape_wall_ms": summary_ms(lengths),
        "longest_hold_per_scrape_ms": summary_ms(per_scrape),
        "longest_hold_control_ms": summary_ms(per_control),
    }


def _pace(scraper: Scraper, until: float, pace: float) -> None:
    while time.perf_counter() + pace < until:
        time.sleep(pace)
        scraper.idle.wait(5)
        scraper.trigger()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300, help="paired scrapes")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per throughput block")
    parser.add_argument("--reps", type=int, default=6, help="off/on block pairs")
    parser.add_argument("--probe-seconds", type=float, default=2.0, help="per block of the GIL probe")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--own-registry", action="store_true", help="serve a registry holding only the watchdog collector"
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    model = build_model("qwen3_next", layers=args.layers)
    wd = Watchdog(name="bench")  # default budget and limit, as a user would run it
    watch_model(model, wd)
    total = args.scrapes * (CYCLE + 1) + 2 * args.reps * args.steps + 400
    gen = BatchGenerator(model, max_tokens=total)
    gen.insert(tiny_prompts(2, 6, 512))  # equal lengths: the left_padding leak
    warm = [step(gen) for _ in range(100)]  # the leak and its forecast exist before measuring
    own = CollectorRegistry()  # only the watchdog collector: what a dedicated registry costs
    register_collector(own)
    # Default: the global registry, with prometheus_client's process, platform and GC collectors.
    server = start_metrics_server(0, registry=own if args.own_registry else None)
    scraper = Scraper(server.port)
    scraper.start()

    load_before = os.getloadavg()
    results = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, load average {load_before[0]:.2f} at start",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "served_registry": "own (watchdog collector only)"
        if args.own_registry
        else "prometheus_client.REGISTRY",
        "gil_switch_interval_ms": sys.getswitchinterval() * 1e3,
        "cpu_ms_alone": "thread CPU time per call, nothing else running",
        "forecast_alone_ms": time_calls(wd.forecast, 300),
        "collector_collect_alone_ms": time_calls(lambda: list(register_collector(REGISTRY).collect()), 300),
        "openmetrics_exposition_alone_ms": time_calls(lambda: generate_openmetrics(REGISTRY), 300),
        "openmetrics_exposition_own_registry_alone_ms": time_calls(lambda: generate_openmetrics(own), 300),
        "cpu_per_scrape": cpu_per_scrape(scraper, 3.0),
        "paired": paired(gen, scraper, args.scrapes),
        "blocks": blocks(gen, scraper, args.steps, args.reps),
        "gil_probe": gil_probe(scraper, args.probe_seconds, args.reps),
    }
    results["paired"]["step_median_ms"] = round(statistics.median(warm[50:]) * 1e3, 3)
    results["loadavg_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    results["forecast_at_end"] = wd.forecast().describe()
    if wd.internal_errors:  # caught and counted, the decode went on: the pauses are an error path's
        raise SystemExit(f"scrape_pause.py: the watchdog had {wd.internal_errors} internal errors")
    scraper.close()
    server.close()
    gen.close()
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
