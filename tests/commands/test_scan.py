"""``mlx-watchdog scan`` on a few tiny families, each in its child process.

The truths: the layers of each model (how many caches leak: ArraysCache layers less one on the
batched path, one per attention layer without RoPE), mlx-lm's source text at the line named,
and the exit status."""

from __future__ import annotations

import json
import re

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from mlx_watchdog.commands import decode, scan
from mlx_watchdog.commands import main as cli
from mlx_watchdog.tiny import families

ADVANCE = re.compile(r"^mlx_lm/models/cache\.py:\d+ ArraysCache\.advance$")
OFFSET = re.compile(r"^mlx_lm/models/cache\.py:\d+ BatchKVCache\.update_and_fetch$")


def _scan(capsys, *argv):
    status = cli.main(["scan", *argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def _run(family: dict, path: str) -> dict:
    return next(run for run in family["runs"] if run["path"] == path)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One scan: a leaking family, a leak-free one and one that does not exist."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_watchdog",
            "scan",
            "qwen3_next",
            "llama",
            "no_such_family",
            "--layers",
            "8",
            "--steps",
            "48",
            "--paths",
            "plain,batched",
            "--jobs",
            "2",
            "--json",
            "--fail-on-leak",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode, json.loads(out.stdout), out.stderr


def test_a_leaking_family_is_found_at_its_rate_and_line(report):
    status, doc, _ = report
    assert status == cli.EXIT_LEAK  # --fail-on-leak
    qwen = next(f for f in doc["families"] if f["family"] == "qwen3_next")
    model, _ = families.build("qwen3_next", layers=8)
    leaking = sum(isinstance(c, ArraysCache) for c in model.make_cache()) - 1
    batched = _run(qwen, "batched")
    assert qwen["status"] == "ok" and qwen["layers"] == 8
    assert batched["leak"] and batched["buffers_per_step"] == pytest.approx(leaking, abs=0.05)
    top = batched["leaks"][0]
    assert top["site"] == "ArraysCache.left_padding" and ADVANCE.match(top["source"]), top
    fix = batched["fix"]
    assert fix["cures"] and fix["tokens_identical"] and fix["buffers_per_step"] < scan.LEAK_MIN_GROWTH
    assert batched["limit_step"] == pytest.approx(
        (scan.LIMIT - batched["resident_buffers"]) / leaking + 48, rel=0.01
    )
    assert not _run(qwen, "plain")["leak"]  # generate_step does not leak


def test_a_leak_free_family_is_clean_and_a_missing_one_is_listed(report):
    _, doc, stderr = report
    llama = next(f for f in doc["families"] if f["family"] == "llama")
    assert llama["status"] == "ok"
    for run in llama["runs"]:
        assert not run["leak"] and run["leaks"] == [] and run["limit_step"] is None and run["fix"] is None
    missing = next(f for f in doc["families"] if f["family"] == "no_such_family")
    assert (
        missing["status"] == "build_error"
        and "No module named 'mlx_lm.models.no_such_family'" in missing["error"]
    )
    assert doc["summary"] == {
        "families": 3,
        "built": 2,
        "leaking": ["qwen3_next"],
        "failed": ["no_such_family"],
        "path_errors": [],
    }
    assert "no_such_family" in scan.markdown(doc)  # listed, never hidden


def test_an_attention_layer_without_rope_leaks_its_offset():
    # nemotron_h at 14 layers: Mamba2 blocks at even places, attention (no RoPE) at place 7.
    model, config = families.build("nemotron_h", layers=14)
    pattern = config["hybrid_override_pattern"]
    caches = model.make_cache()
    assert pattern.count("*") == sum(isinstance(c, KVCache) for c in caches) == 1
    run = scan.scan_path(model, "batched", steps=48)
    sites = {leak["site"]: leak for leak in run["leaks"]}
    assert sites["BatchKVCache.offset"]["buffers_per_step"] == pytest.approx(pattern.count("*"), abs=0.05)
    assert OFFSET.match(sites["BatchKVCache.offset"]["source"]), sites
    assert sites["ArraysCache.left_padding"]["buffers_per_step"] == pytest.approx(
        pattern.count("M") - 1, abs=0.05
    )
    assert run["fix"]["cures"]


def test_without_a_leak_the_exit_status_is_0_and_a_slow_family_is_stopped(capsys):
    status, doc = _scan(
        capsys, "llama", "--layers", "2", "--steps", "8", "--paths", "plain", "--fail-on-leak"
    )
    assert status == cli.EXIT_OK and doc["summary"]["leaking"] == []
    status, doc = _scan(capsys, "llama", "--steps", "8", "--timeout", "0.5", "--fail-on-error")
    assert status == cli.EXIT_LEAK
    assert doc["families"][0]["status"] == "timeout" and doc["families"][0]["seconds"] < 5


def test_bad_options_are_usage_errors(capsys):
    assert cli.main(["scan", "llama", "--paths", "plain,sideways"]) == cli.EXIT_USAGE
    assert "sideways" in capsys.readouterr().err


def test_a_batch_that_shrinks_in_place_reads_flat_as_the_exact_count(counter):
    """mamba through BatchGenerator with a request joining: when the first two requests end, the
    batch is filtered in place (the same caches: no new epoch) and the level moves once. Read at
    every step, that step must not pass for growth: the exact count stays flat."""
    from mlx_watchdog import tiny
    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.core.watchdog import Watchdog

    model = families.build("mamba")
    model = model[0] if isinstance(model, tuple) else model
    steps = 100
    prompts = [p[:n] for p, n in zip(tiny.tiny_prompts(3, 11, seed=1), scan.PROMPT_LENGTHS["join"])]
    wd = Watchdog(scan.LIMIT, export=False, overhead_budget=0.25, walk_interval=0)
    watch_model(model, wd)
    readings = []
    try:
        for step, _new in enumerate(decode.token_steps(model, "join", prompts, steps), 1):
            if step == decode.join_step(steps) + decode.JOIN_SETTLE:
                wd.reset()
            if step > steps + 3:  # only the joined request is left: the batch was filtered
                # collected first: uncollected cycles (the harness's) move the count
                readings.append((counter.live(collect=True), wd.forecast().buffers_per_step))
    finally:
        unwatch_model(model)
    readings = readings[:-1]  # the last step: BatchGenerator drops the caches as it yields it
    assert len(readings) >= 20
    truth = [live for live, _ in readings]
    assert max(truth) - min(truth) <= 4  # flat in truth (a temporary or two in flight)...
    assert max(rate for _, rate in readings) < 0.05, readings  # ...and read flat
