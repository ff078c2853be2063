"""The benchmark scripts still run (tiny, seconds), and what they print holds: every variant of the
decode benchmark gives the unwatched tokens on the CPU backend, and the fix leaves no leak."""

import os
import subprocess
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import json  # noqa: E402
import random  # noqa: E402

import observe_stall  # noqa: E402
import paired_speed  # noqa: E402
import paired_stats  # noqa: E402
import pytest  # noqa: E402

# paired_speed.py at its smallest: a 4-layer hybrid (batch of 2), 24 steps in chunks of 8.
SMALL_RUN = ["--model", "qwen3_next", "--layers", "4", "--steps", "24", "--chunk", "8", "--warmup", "4"]


def test_diagnostic_variants_take_apart_what_they_say(monkeypatch):
    """``nowalk`` observes every step and walks twice, at the prompt (its caches empty) and at the
    first step (which arms what a step that walks nothing still runs: the look at the batch's rows,
    as ``watched`` has it), and never after, on the path of a step that walks nothing (it never even asks whether a walk is due);
    ``wrapped`` observes nothing; ``watched`` walks (a ``nowalk`` that shadowed a renamed method
    would be ``watched`` under another name). None of them has an internal error: that would be
    an error path measured under the variant's name."""
    import mlx.core as mx
    from decode_variants import watchdog_for
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.core.schedule import Schedule
    from mlx_watchdog.tiny import build_model

    asked = []
    real_due = Schedule.due

    def due(self, *args, **kwargs):
        asked.append(1)
        return real_due(self, *args, **kwargs)

    monkeypatch.setattr(Schedule, "due", due)
    model = build_model("llama", layers=2)
    seen, armed = {}, {}
    for variant in ("nowalk", "wrapped", "watched"):
        wd = watchdog_for(variant)
        watch_model(model, wd)
        asked.clear()
        for _ in generate_step(
            mx.array([1, 2, 3]), model, max_tokens=12, prompt_cache=make_prompt_cache(model)
        ):
            pass
        unwatch_model(model)
        seen[variant] = (wd.steps, wd.walks, len(asked), wd.internal_errors)
        armed[variant] = wd._rows.probe is not None  # (private: what the per-step path looks at)
    assert seen["nowalk"][0] >= 10 and seen["nowalk"][1:] == (2, 2, 0), seen
    assert seen["wrapped"] == (0, 0, 0, 0), seen
    assert seen["watched"][0] == seen["nowalk"][0] and seen["watched"][1] >= 3, seen
    assert seen["watched"][2] >= seen["watched"][1] and seen["watched"][3] == 0, seen
    assert armed == {"nowalk": True, "wrapped": False, "watched": True}, armed


@pytest.fixture(scope="module")
def tiny_models():
    from decode_variants import make_model

    return {
        "plain": make_model("llama", 2, 0, 512, "float32", 8),
        "batched": make_model("qwen3_next", 4, 0, 512, "float32", 8),
    }


@pytest.mark.parametrize("path", ["plain", "batched"])
def test_every_decode_variant_runs_without_an_internal_error(tiny_models, path):
    """Every variant of the decode benchmark (those gpu_speed.sh runs among them), a few steps on
    the CPU backend: a watchdog's internal error is caught and counted, and the decode goes on,
    so a variant with one measures an error path under its name (a ``nowalk`` that shadowed a
    method with the wrong signature raised at every step, and its run looked like any other)."""
    from decode_variants import VARIANTS, interleaved, internal_errors, prompts_for

    prompts = prompts_for(2 if path == "batched" else 1, 8, 512)
    runs = interleaved(tiny_models[path], list(VARIANTS), path, prompts, steps=12, chunk=4)
    watched = {r.variant: r for r in runs if r.internal_errors is not None}
    assert {"watched", "fix", "nowalk", "wrapped", "fixlow"} <= set(watched), [r.variant for r in runs]
    assert internal_errors(runs) == {}, internal_errors(runs)
    assert all(r.tokens >= 12 for r in runs)


def test_paired_speed_fails_on_an_internal_error(tmp_path, monkeypatch, capsys):
    """An internal error of the watchdog in any variant fails the run (exit status 1), before
    its time is spent."""
    from mlx_watchdog.core import watchdog as core

    def broken(self, *args, **kwargs):
        raise RuntimeError("a bug in the walk")

    monkeypatch.setattr(core.Watchdog, "_walk", broken)
    monkeypatch.setattr(sys, "argv", ["paired_speed.py"])
    records = tmp_path / "chunks.jsonl"
    status = paired_speed.main([*SMALL_RUN, "--variants", "unwatched,aa,watched", "--jsonl", str(records)])
    assert status == 1
    err = capsys.readouterr().err
    assert "internal errors (watched: " in err and "aa" not in err.split("internal errors")[1], err
    kinds = [json.loads(line)["type"] for line in records.read_text().splitlines()]
    assert kinds == ["run"], kinds  # failed at the warm-up: nothing timed


def test_observe_stall_benchmark_runs(capsys):
    assert observe_stall.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    assert "crash scale (stall)" in text and "(= exact)" in text


def test_paired_ratio_finds_a_known_slowdown_and_sets_stalls_aside():
    """Synthetic rounds whose machine speed swings 2x: a variant 2% slower than the reference is
    read at -2% with an interval holding it, an identical one holds 0, and a one-off stall of one
    round is listed and left out."""
    rng = random.Random(0)
    table = {"unwatched": {}, "aa": {}, "slow": {}}
    for r in range(200):
        speed = rng.uniform(0.5, 1.0)  # the machine, the same for the whole round
        for v, cost in (("unwatched", 1.0), ("aa", 1.0), ("slow", 1.02)):
            table[v][("run", 0, r)] = (16, 16 * cost / speed * rng.uniform(0.99, 1.01))
    table["aa"][("run", 0, 7)] = (16, 40.0)  # a kernel's first compile, say
    stalls = paired_stats.stalls(table)
    assert stalls == {("run", 0, 7): "aa"}
    slow = paired_stats.paired_ratio(table, "slow", "unwatched", skip=stalls)
    same = paired_stats.paired_ratio(table, "aa", "unwatched", skip=stalls)
    assert slow.low < 1 / 1.02 < slow.high and slow.high < 1
    assert same.low < 1 < same.high and same.within(0.01)
    assert not slow.excludes_loss(0.01) and slow.excludes_loss(0.03)


def test_the_interval_holds_what_differs_between_repetitions():
    """An A/A pair whose decodes differ by a random +/-1% for a whole repetition (each repetition
    builds its own), over 10 repetitions of quiet rounds: drawing only rounds, the interval is
    narrow around the repetitions' mean offset and misses the true ratio of 1; drawing
    repetitions too, it holds it."""
    rng = random.Random(3)
    table = {"unwatched": {}, "aa": {}}
    offsets = [rng.gauss(0, 0.01) for _ in range(10)]
    offsets = [o - sum(offsets) / 10 + 0.004 for o in offsets]  # a mean 0.4% off, as a sample may be
    for rep, offset in enumerate(offsets):
        for r in range(40):
            speed = rng.uniform(0.8, 1.0)
            table["unwatched"][("run", rep, r)] = (16, 16 / speed * rng.uniform(0.998, 1.002))
            table["aa"][("run", rep, r)] = (16, 16 * (1 + offset) / speed * rng.uniform(0.998, 1.002))
    rounds_only = paired_stats.paired_ratio(table, "aa", "unwatched", levels=1)
    both = paired_stats.paired_ratio(table, "aa", "unwatched")
    assert not rounds_only.low < 1 < rounds_only.high
    assert both.low < 1 < both.high and both.high - both.low > 2 * (rounds_only.high - rounds_only.low)


def test_paired_speed_writes_each_chunk_as_it_ends_and_reports_from_the_records(tmp_path, monkeypatch):
    records = tmp_path / "chunks.jsonl"
    monkeypatch.setattr(sys, "argv", ["paired_speed.py"])
    assert (
        paired_speed.main(
            [*SMALL_RUN, "--variants", "unwatched,aa,fix", "--compare", "fix:aa", "--jsonl", str(records)]
        )
        == 0
    )
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    chunks = [r for r in lines if r["type"] == "chunk"]
    assert sorted((r["variant"], r["round"]) for r in chunks) == sorted(
        (v, k) for v in ("unwatched", "aa", "fix") for k in range(3)
    )  # 24 steps in chunks of 8
    assert all(r["tokens"] == 8 * 2 and r["seconds"] > 0 for r in chunks)  # batch of 2
    ends = {r["variant"]: r for r in lines if r["type"] == "end"}
    assert all(e["identical"] for e in ends.values())
    assert ends["fix"]["retained_at_end"] < ends["unwatched"]["retained_at_end"]  # the fix cut the leak
    text = paired_speed.report([str(records)], [])
    assert "| fix | aa |" in text and "| fix | unwatched |" in text  # --compare kept in the record


def test_every_decode_variant_gives_the_unwatched_tokens_and_the_fix_cuts_the_leak(tmp_path, monkeypatch):
    records = tmp_path / "chunks.jsonl"
    variants = ("unwatched", "aa", "handfix", "watched", "fix", "wrapped", "nowalk")
    monkeypatch.setattr(sys, "argv", ["paired_speed.py"])
    assert paired_speed.main([*SMALL_RUN, "--variants", ",".join(variants), "--jsonl", str(records)]) == 0
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    ends = {r["variant"]: r for r in lines if r["type"] == "end"}
    assert set(ends) == set(variants)
    assert all(e["identical"] for e in ends.values()), ends  # tokens identical
    assert all(not e["internal_errors"] for e in ends.values()), ends  # none measured an error path
    retained = {v: e["retained_at_end"] for v, e in ends.items()}
    assert retained["unwatched"] == retained["watched"] > retained["fix"]  # the leak, and the fix cutting it
    assert retained["wrapped"] == retained["nowalk"] == retained["unwatched"]
    chunks = [r for r in lines if r["type"] == "chunk"]
    assert sorted((r["variant"], r["round"]) for r in chunks) == sorted(
        (v, k) for v in variants for k in range(3)
    )  # 24 steps in chunks of 8: 3 pairs a variant


def _run_script(name: str, *args: str) -> str:
    """Run a benchmark in a process of its own (one that serves metrics must not register on this
    process's global registry)."""
    done = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, name), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_prefill_cost_benchmark_runs():
    text = _run_script(
        "prefill_cost.py",
        "--models",
        "llama",
        "--layers",
        "2",
        "--tokens",
        "96",
        "--step",
        "32",
        "--reps",
        "1",
    )
    (row,) = [line for line in text.splitlines() if line.startswith("| llama |")]
    assert row.split("|")[5].strip() == "1"  # one walk a prompt: the limit is far


def test_scrape_pause_benchmark_runs():
    text = _run_script(
        "scrape_pause.py",
        "--scrapes",
        "4",
        "--steps",
        "10",
        "--reps",
        "1",
        "--probe-seconds",
        "0.2",
        "--layers",
        "4",
    )
    results = json.loads(text)
    assert results["paired"]["step_median_ms"] > 0 and results["blocks"] and results["gil_probe"]
    assert "ArraysCache.left_padding" in results["forecast_at_end"]  # the leak was live while it scraped


def test_process_count_cost_benchmark_runs(tmp_path):
    """Its three parts at their smallest, in a process of their own (they put hooks in and take
    them out of MLX's allocator): the tables come out, and the noise part reads the +2 leak."""
    out = tmp_path / "process_count.md"
    script = os.path.join(BENCHMARKS, "process_count_cost.py")
    for part in (
        ["alloc", "--rounds", "2", "--calls", "2000"],
        ["decode", "--layers", "2", "--reps", "1", "--rounds", "2", "--chunk", "4"],
        ["noise", "--layers", "2", "--steps", "200"],
    ):
        proc = subprocess.run(
            [sys.executable, script, *part, "--out", str(out)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "| `count` |" in text and "| `set` |" in text  # alloc
    assert "| `count` | CPU (all threads) |" in text  # decode
    noise = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert len(noise) == 1 and noise[0].endswith("| 2.000 |"), noise  # the exact rate: the two chains


def test_evaluated_check_benchmark_runs():
    text = _run_script(
        "evaluated_check.py", "--depths", "50", "--chains", "3", "--steps", "8", "--sweeps", "1"
    )
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ") and "50 |" in line]
    assert {r[1].strip() for r in rows} >= {"descriptor", "export"}, text
    for r in rows:  # the watchdog's resident buffers against the workload's own count
        read, truth = r[9].split("/")
        assert int(read) == int(truth) == 3 * (50 + 8 + 1) + 3, r


def test_serve_shutdown_benchmark_runs(tmp_path):
    # One server started as a shell's background job (SIGINT ignored), stopped by SIGINT: clean.
    text = _run_script(
        "serve_shutdown.py",
        "--runs",
        "1",
        "--signals",
        "SIGINT",
        "--inherit-sigint",
        "ignored",
        "--logs",
        str(tmp_path),
    )
    (row,) = [line for line in text.splitlines() if line.startswith("| SIGINT |")]
    assert [cell.strip() for cell in row.split("|")[2:7]] == ["1", "1", "0", "0", "0"], text


def test_census_cost_benchmark_runs(tmp_path):
    """Both parts at their smallest, in a process of their own (it grows the process's objects):
    the tables come out, every census named the scheduler's two chains, and the watched decode's
    census named them too."""
    out = tmp_path / "census_cost.md"
    script = os.path.join(BENCHMARKS, "census_cost.py")
    for part in (
        ["census", "--objects", "20000,40000", "--rounds", "2"],
        ["decode", "--program", "leak", "--objects", "20000", "--layers", "2", "--reps", "1", "--rounds", "2", "--chunk", "4"],
        ["budget", "--program", "leak", "--objects", "20000", "--layers", "2", "--checkpoints", "100,200"],
    ):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, script, *part, "--out", str(out)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.count("| history, score |") == 2  # census: each size, every census named both
    assert "| `census` | wall |" in text and "| `aa` | wall |" in text  # decode, with its A/A control
    assert "Scheduler.history" in text and "Scheduler.score" in text
    budget = [line.split("|") for line in text.splitlines() if line.startswith(("| 100 |", "| 200 |"))]
    assert len(budget) == 2 and all(float(row[3]) > 0 for row in budget), text  # its own time, read
    assert all(row[10].strip() == "+2.00" for row in budget), text  # the two chains, at their rate


def test_paired_speed_pairs_another_version_of_the_package_in_one_process(tmp_path):
    """``--base DIR``: the watched variants of another version (here this tree, copied) decode
    beside this one's, paired, each without an internal error."""
    root = os.path.dirname(BENCHMARKS)
    records = tmp_path / "chunks.jsonl"
    text = _run_script(
        "paired_speed.py",
        *("--model", "llama", "--layers", "2", "--steps", "16", "--chunk", "4", "--warmup", "4"),
        *("--base", root, "--variants", "unwatched,watched,watched@base,nowalk@base"),
        *("--compare", "watched:watched@base", "--jsonl", str(records)),
    )
    assert "| watched | watched@base |" in text and "| nowalk@base | unwatched |" in text, text
    ends = {r["variant"]: r for r in map(json.loads, records.read_text().splitlines()) if r["type"] == "end"}
    assert ends["watched@base"]["walks"] >= 3 and ends["nowalk@base"]["walks"] == 2, ends
    assert all(e["internal_errors"] == 0 for v, e in ends.items() if v != "unwatched"), ends


def test_step_cost_benchmark_runs():
    root = os.path.dirname(BENCHMARKS)
    text = _run_script(
        "step_cost.py",
        *("--version", f"one={root}", "--version", f"two={root}"),
        *("--layers", "2", "--steps", "40", "--skip", "8", "--fix"),
    )
    for row in ("| one~ | one |", "| two | one |", "| two+fix | one+fix |"):
        assert row in text, text
