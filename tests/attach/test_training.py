"""``mlx-watchdog run -- python -m mlx_lm lora --train``: mlx-lm's trainer watched step by step, with
no line of it changed. Its compiled step keeps a cache entry per padded batch length; a dataset
whose batches all have other lengths makes it grow every step. The run counts the steps, serves
the growth and the compiled step's signatures, and stops before the limit, the adapters saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, http_get, log_tail, stop_process

from mlx_watchdog.attach.training import EXIT_STOPPED
from mlx_watchdog.tiny import build_tokenizer, save_model_dir

PYTHON = sys.executable
STEP = "mlx_lm.tuner.trainer.step"
BUCKETS = 32  # batch lengths, 32 tokens apart: the trainer pads to a multiple of 32
# The tiny model's step keeps 17 buffers per entry, a new one every step (its parameters and
# optimizer state ~40 more): (LIMIT - resident) / growth falls to STOP_WITHIN near iteration 23,
# before the lengths run out. (A limit of 340 stopped it at iteration 8, 1-2 s in: the snapshot
# the scrapes read, written once a second, showed 4 or 5 steps by chance.)
LIMIT = 600
STOP_WITHIN = 10
LINGER = 120  # seconds the endpoint stays after the trainer exits (the test ends it with SIGINT)
LINGERING = "its last metrics stay at"


def write_dataset(folder: Path) -> None:
    """Two samples per bucket of 32 tokens (a batch of 2 each after mlx-lm sorts them by length),
    and a short validation set."""
    tokenizer = build_tokenizer()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()

    def text_of(tokens: int, seed: int) -> str:
        out: list[str] = []
        while len(tokenizer.encode(" ".join(out)).ids) < tokens:
            out.append(words[(seed + len(out) * 7) % len(words)])
        return " ".join(out)

    folder.mkdir(parents=True)
    with open(folder / "train.jsonl", "w") as f:
        for bucket in range(BUCKETS):
            for seed in range(2):
                f.write(json.dumps({"text": text_of(32 * bucket + 10, seed)}) + "\n")
    with open(folder / "valid.jsonl", "w") as f:
        for seed in range(2):
            f.write(json.dumps({"text": text_of(8, seed)}) + "\n")


def scrape(url: str) -> dict:
    status, body = http_get(url)
    if status != 200:
        return {}
    values: dict = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = s.labels.get("function") or s.labels.get("site") or s.labels.get("reason")
            values[(s.name, key) if key else s.name] = s.value
    return values


def test_mlx_lm_lora_is_watched_per_step_and_stopped_with_its_adapters_saved(tmp_path):
    model = save_model_dir(tmp_path / "tiny-llama", "llama", layers=1)
    write_dataset(tmp_path / "data")
    adapters = tmp_path / "adapters"
    port = free_port()
    command = [
        PYTHON, "-m", "mlx_watchdog", "run", "--metrics-port", str(port),
        "--limit", str(LIMIT), "--stop-within", str(STOP_WITHIN), "--walk-interval", "0",
        "--linger", str(LINGER),
        "--", PYTHON, "-m", "mlx_lm", "lora", "--model", str(model), "--train",
        "--data", str(tmp_path / "data"), "--iters", "200", "--batch-size", "2", "--num-layers", "1",
        "--val-batches", "1", "--steps-per-report", "1000", "--steps-per-eval", "1000",
        "--save-every", "100000", "--adapter-path", str(adapters),
    ]  # fmt: skip
    log = tmp_path / "run.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}/metrics"
    seen: list[dict] = []
    try:
        deadline = time.monotonic() + 240
        while LINGERING not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"run exited without lingering:\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"the training did not stop:\n{log_tail(log)}"
            try:
                values = scrape(url)
            except OSError:
                values = {}
            if values.get("mlx_watchdog_steps_total"):
                seen.append(values)
            time.sleep(0.1)
        # The trainer has exited; its last snapshot (written at its exit) is still served.
        after = scrape(url)
        lingered = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: no need to wait the rest of the linger
        proc.wait(timeout=30)
        assert time.monotonic() - lingered < LINGER / 4, "SIGINT did not end the linger"
    finally:
        stop_process(proc, group=True)
    text = log.read_text()

    # The stop: before the limit, with its own status and one message; the adapters saved.
    assert proc.returncode == EXIT_STOPPED, log_tail(log)
    assert "mlx-watchdog stopped the training before iteration" in text, log_tail(log)
    assert f"compiled:{STEP} +" in text and "shapeless=True" in text
    saved = adapters / "adapters.safetensors"
    assert f"are saved to {saved}" in text and saved.exists()
    weights = mx.load(str(saved))
    assert weights and all(key.endswith((".lora_a", ".lora_b")) for key in weights), sorted(weights)
    assert not list(adapters.glob("*_adapters.safetensors"))  # no save point of mlx-lm's own was reached

    # Steps counted and served as decode steps are, the growth named after the compiled step.
    assert seen, f"no scrape saw a step:\n{log_tail(log)}"
    steps = [v["mlx_watchdog_steps_total"] for v in seen]
    assert steps == sorted(steps) and steps[-1] >= 5
    measured = [
        v for v in seen if v.get("mlx_watchdog_rate_known") == 1 and v.get("mlx_watchdog_decoding") == 1
    ]
    assert measured, seen[-1]
    last = measured[-1]
    assert last[("mlx_watchdog_compiled_signatures", STEP)] >= 5
    assert last[("mlx_watchdog_compiled_entry_buffers", STEP)] > 0
    assert last[("mlx_watchdog_leak_buffers_per_step", f"compiled:{STEP}")] > 0
    assert last["mlx_watchdog_buffers_per_step"] > 0
    assert 0 < last["mlx_watchdog_steps_to_limit"] < LIMIT
    assert 0 < last["mlx_watchdog_time_to_limit_seconds"] < float("inf")
    assert last["mlx_watchdog_resource_limit_buffers"] == LIMIT

    # After the exit (run --linger): the stop, the forecast that made it and every step, even a
    # stop that came between two of the snapshots written once a second.
    assert after.get(("mlx_watchdog_stops_total", "forecast")) == 1, sorted(after)
    assert after["mlx_watchdog_stop_forecast_held"] == 1
    assert after["mlx_watchdog_steps_total"] >= steps[-1]
    assert 0 < after[("mlx_watchdog_last_stop_steps_to_limit", "forecast")] <= STOP_WITHIN
    assert after[("mlx_watchdog_last_stop_leak_buffers_per_step", f"compiled:{STEP}")] > 0
