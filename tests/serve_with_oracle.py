"""``python tests/serve_with_oracle.py [watchdog options] -- [mlx_lm.server args]``: the real
``mlx-watchdog serve`` with the exact live-buffer counter (tests/exact_buffers.py) installed
first, so that a test can compare what the watchdog exports with the truth.

The counter is installed before mlx_lm or mlx_watchdog is imported: every buffer of the
server (parameters, caches, lazy chains, BatchGenerator's own arrays, MLX's random key) is
counted. The oracle is exposed two ways, both optional:

* ``ORACLE_LOG=path``: a JSON-lines file. It gets
    - ``{"event": "start", ...}`` once;
    - ``{"event": "sample", "time", "live", "synced": false}`` every ``ORACLE_INTERVAL``
      seconds (default 0.2) from a background thread. That thread never calls MLX (a stream
      made on another thread aborts the interpreter at exit, and ``mx.synchronize()`` there
      waits on that thread's own stream only), so a sample may include a step's in-flight
      temporaries: a trace, not a measurement;
    - ``{"event": "stop", "true", "forecast_resident", "limit", ...}`` at every stop the
      watchdog makes (``ResourceLimitForecast.__init__`` is wrapped). It is written on the thread
      that raises, the generation thread, after ``mx.synchronize()``: the exact count then;
    - ``{"event": "probe", ...}`` for every reading of the endpoint below.
* ``ORACLE_PORT=port``: ``GET http://127.0.0.1:port/live`` answers
  ``{"true": n, "steps": s, "where": "step" | "idle", "time": t}`` (at a step also
  ``"forward": "decode" | "prefill"``, ``"batch"``, the batch size of that forward's cache,
  ``"measured"``, the step of the watchdog's last reading: how old it is, and ``"decode_start"``,
  the step of its last ``reset()``: where the decode it measures now began, its growth unknown
  until read afresh). The reading is taken on the
  generation thread at the entry of its next forward pass, once the watchdog has observed it
  (``Watchdog.observe`` is wrapped: synchronized, exact, aligned with the watchdog's own step count
  ``steps``, and a scrape that waited for it reads what the watchdog made of that step); when no
  forward pass comes within ``ORACLE_WAIT`` seconds (default 1.0) and no watchdog is decoding
  (the server is idle, nothing is in flight) it is read at once without MLX (``where: "idle"``).
  While one is decoding (a forward in flight, a long prefill on a loaded machine: its temporaries
  are no resident count) the reading waits for the next forward, up to 30 s.

Exit status 3 when the counter cannot be installed (no gcc, not a Linux CPU build of MLX).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import exact_buffers  # noqa: E402  (imports mlx.core only when install() runs)

EXIT_NO_ORACLE = 3

try:
    COUNTER = exact_buffers.install()  # first thing: before mlx_lm or the watchdog allocates
except RuntimeError as _exc:
    print(f"serve_with_oracle: the exact buffer counter cannot be installed: {_exc}", file=sys.stderr)
    sys.exit(EXIT_NO_ORACLE)

_log_lock = threading.Lock()
_LOG_PATH = os.environ.get("ORACLE_LOG")


def record(event: str, **fields) -> None:
    """Append one JSON line to ORACLE_LOG (nothing when it is not set)."""
    if not _LOG_PATH:
        return
    line = json.dumps({"event": event, "time": time.time(), **fields})
    with _log_lock, open(_LOG_PATH, "a") as log:
        log.write(line + "\n")


# --------------------------------------------------------------------------- readings on the generation thread


class _Probes:
    """Readings asked for by the endpoint, answered by the next observed forward pass."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[dict] = []  # {"event": threading.Event, "result": None | dict}

    def ask(self, wait: float, busy_wait: float = 30.0) -> dict:
        probe = {"event": threading.Event(), "result": None}
        with self.lock:
            self.waiting.append(probe)
        answered = probe["event"].wait(wait)
        deadline = time.monotonic() + busy_wait
        while not answered and _decoding() and time.monotonic() < deadline:
            # A forward is in flight (a long prefill on a loaded machine): what it holds now,
            # its temporaries included, is no count of what stays resident; its next one reads it.
            answered = probe["event"].wait(0.05)
        if not answered:
            with self.lock:
                if probe["result"] is None:  # not taken by a forward pass: idle, read it here
                    self.waiting.remove(probe)
                    probe["result"] = {
                        "true": COUNTER.live(sync=False),
                        "steps": _steps(),
                        "where": "idle",
                        "time": time.time(),
                    }
                    probe["event"].set()
        probe["event"].wait()
        return probe["result"]

    def answer(self, watchdog, roots, prefill: bool) -> None:
        """On the generation thread, at the entry of a forward pass once observed (``roots``: its cache)."""
        with self.lock:
            if not self.waiting:
                return
            waiting, self.waiting = self.waiting, []
            result = {
                "true": COUNTER.live(),
                "steps": watchdog.steps,
                "where": "step",
                "watchdog": watchdog.name,
                "time": time.time(),
                "forward": "prefill" if prefill else "decode",
                "batch": _batch_size(roots),
                "measured": _measured(watchdog),
                "decode_start": DECODE_STARTS.get(id(watchdog), 0),
            }
            for probe in waiting:
                probe["result"] = result
                probe["event"].set()


PROBES = _Probes()
DECODE_STARTS: dict[int, int] = {}  # id(watchdog) -> its step at its last reset(): a decode measured afresh


def _batch_size(roots) -> int | None:
    """The batch size of a forward's cache (its first layer's), from shapes only: no evaluation."""
    try:
        first = roots[0] if isinstance(roots, (list, tuple)) else roots
        size = getattr(first, "batch_size", None)
        return int(size) if size is not None else None
    except Exception:
        return None


def _measured(watchdog) -> int | None:
    """The step of the watchdog's last reading (its forecast's ``measured_step``)."""
    try:
        return watchdog.forecast().measured_step
    except Exception:
        return None


def _decoding() -> bool:
    """Is any watchdog decoding (``Watchdog.decoding``: false once the server said it is idle)?"""
    from mlx_watchdog.core.watchdog import live_watchdogs

    try:
        return any(wd.decoding() for wd in live_watchdogs())
    except Exception:
        return False


def _steps() -> int:
    from mlx_watchdog.core.watchdog import live_watchdogs

    return sum(wd.steps for wd in live_watchdogs())


def _install_hooks() -> None:
    from mlx_watchdog.core import watchdog as core

    original_observe = core.Watchdog.observe

    def observe(self, roots, *args, **kwargs):
        try:
            return original_observe(self, roots, *args, **kwargs)
        finally:  # once the watchdog has read this step: a scrape that waits for it sees its reading
            if PROBES.waiting:  # cheap unlocked check; answer() checks again under the lock
                PROBES.answer(self, roots, bool(kwargs.get("prefill", False)))

    observe.__wrapped__ = original_observe
    core.Watchdog.observe = observe

    original_reset = core.Watchdog.reset

    def reset(self, *args, **kwargs):
        DECODE_STARTS[id(self)] = self.steps  # (a new decode: reset at its first step)
        return original_reset(self, *args, **kwargs)

    reset.__wrapped__ = original_reset
    core.Watchdog.reset = reset

    original_init = core.ResourceLimitForecast.__init__

    def init(self, forecast, *args, **kwargs):
        original_init(self, forecast, *args, **kwargs)
        try:
            began = time.perf_counter()
            true = COUNTER.live()
            took = time.perf_counter() - began
            record(
                "stop",
                true=true,
                read_seconds=took,
                forecast_resident=forecast.resident_buffers,
                limit=forecast.limit,
                steps_to_limit=forecast.steps_to_limit,
                buffers_per_step=forecast.buffers_per_step,
                step=forecast.step,
                reason=getattr(self, "reason", None),
                thread=threading.current_thread().name,
            )
        except Exception as exc:  # the oracle must never change what the server does
            print(f"serve_with_oracle: recording a stop failed: {exc!r}", file=sys.stderr)

    core.ResourceLimitForecast.__init__ = init


# --------------------------------------------------------------------------- threads without MLX


def _sampler(interval: float) -> None:
    while True:
        time.sleep(interval)
        record("sample", live=COUNTER.live(sync=False), synced=False)


def _serve_endpoint(port: int, wait: float) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path.split("?")[0] != "/live":
                self.send_error(404)
                return
            try:
                result = PROBES.ask(wait)
                record("probe", **{k: v for k, v in result.items() if k != "time"})
            except Exception as exc:  # said, not a connection closed without a word
                self.send_error(500, f"oracle: {exc!r}")
                return
            body = json.dumps(result).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="oracle-endpoint", daemon=True).start()


def main(argv: list[str]) -> int:
    _install_hooks()
    record("start", live=COUNTER.live(), pid=os.getpid())
    if _LOG_PATH:
        interval = float(os.environ.get("ORACLE_INTERVAL", "0.2"))
        threading.Thread(target=_sampler, args=(interval,), name="oracle-sampler", daemon=True).start()
    port = os.environ.get("ORACLE_PORT")
    if port:
        _serve_endpoint(int(port), float(os.environ.get("ORACLE_WAIT", "1.0")))
    from mlx_watchdog.commands import serve

    return serve.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
