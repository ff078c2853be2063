"""The benchmark scripts still run (tiny, seconds), and what they print holds: every variant of the
decode benchmark gives the unwatched tokens on the CPU backend, and the fix leaves no leak."""

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import decode_tokens_per_s  # noqa: E402
import observe_cost  # noqa: E402
import walk_and_fix_cost  # noqa: E402
import walk_charge  # noqa: E402


def table_rows(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if (
            line.startswith("| ")
            and len(cells) > 3
            and not cells[0].startswith(("variant", "---", "what", "llama"))
        ):
            rows[cells[0]] = cells
    return rows


def test_decode_benchmark_runs_and_every_variant_gives_the_same_tokens(tmp_path, capsys, monkeypatch):
    out = tmp_path / "decode.md"
    monkeypatch.setattr(sys, "argv", ["decode_tokens_per_s.py"])
    assert (
        decode_tokens_per_s.main(
            [
                "--model",
                "qwen3_next",
                "--layers",
                "4",
                "--steps",
                "24",
                "--reps",
                "1",
                "--chunk",
                "8",
                "--variants",
                "unwatched,aa,handfix,watched,fix,wrapped,nowalk",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = table_rows(out.read_text())
    assert set(rows) == {"unwatched", "aa", "handfix", "watched", "fix", "wrapped", "nowalk"}
    assert all(cells[-1] == "yes" for cells in rows.values()), rows  # tokens identical
    retained = {v: int(cells[-2]) for v, cells in rows.items()}
    assert retained["unwatched"] == retained["watched"] > retained["fix"]  # the leak, and the fix cutting it
    assert retained["wrapped"] == retained["nowalk"] == retained["unwatched"]
    assert "gave the same tokens in every repetition" in out.read_text()
    assert rows["aa"][6].endswith(", 3") and rows["unwatched"][6] == ""  # 24 steps in chunks of 8: 3 pairs


def test_diagnostic_variants_take_apart_what_they_say():
    """``nowalk`` observes every step and never walks; ``wrapped`` observes nothing; ``watched``
    walks. (From c468ed7 to here ``nowalk`` shadowed a method that no longer existed and was
    ``watched`` under another name.)"""
    import mlx.core as mx
    from decode_variants import watchdog_for
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog.attach.model import unwatch_model, watch_model
    from mlx_watchdog.tiny import build_model

    model = build_model("llama", layers=2)
    seen = {}
    for variant in ("nowalk", "wrapped", "watched"):
        wd = watchdog_for(variant)
        watch_model(model, wd)
        for _ in generate_step(
            mx.array([1, 2, 3]), model, max_tokens=12, prompt_cache=make_prompt_cache(model)
        ):
            pass
        unwatch_model(model)
        seen[variant] = (wd.steps, wd.walks)
    assert seen["nowalk"][0] >= 10 and seen["nowalk"][1] == 0
    assert seen["wrapped"] == (0, 0)
    assert seen["watched"][0] == seen["nowalk"][0] and seen["watched"][1] >= 3, seen


def test_observe_cost_runs(capsys):
    assert observe_cost.main(["--layers", "2", "--calls", "50", "--repeats", "1", "--in-decode"]) == 0
    rows = table_rows(capsys.readouterr().out)
    (cells,) = rows.values()
    assert all(float(c) > 0 for c in cells[2:])


def test_observe_versions_compares_two_trees_in_one_decode(capsys):
    import observe_versions

    root = os.path.dirname(BENCHMARKS)
    assert (
        observe_versions.main(
            ["--version", f"a={root}", "--version", f"b={root}", "--layers", "2", "--steps", "100"]
        )
        == 0
    )
    rows = {name: cells for name, cells in table_rows(capsys.readouterr().out).items() if name != "version"}
    assert set(rows) == {"a", "b"} and all(float(cells[1]) > 0 for cells in rows.values())


def test_fix_breakdown_finds_the_chains_it_schedules(capsys):
    import fix_breakdown

    assert fix_breakdown.main(["--layers", "4", "--batch", "2", "--steps", "40"]) == 0
    text = capsys.readouterr().out
    rows = table_rows(text)
    assert int(rows["fix: async_eval of the chains"][2]) >= 2  # fix_every 16: at steps 16 and 32 at least
    assert "pending nodes on average" in text


def test_walk_and_fix_cost_runs(capsys):
    assert walk_and_fix_cost.main(["--layers", "4", "--vocab", "512", "--depth", "4", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "fix, chains 4 deep, in flight" in text and "walk: account(), synced" in text


import observe_stall  # noqa: E402


def test_walk_charge_compares_two_trees(capsys):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert (
        walk_charge.main(
            [
                "--version",
                f"a={root}",
                "--version",
                f"b={root}",
                "--layers",
                "2",
                "--steps",
                "40",
                "--reps",
                "1",
            ]
        )
        == 0
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| a |", "| b |"))]
    assert len(rows) == 2 and all(int(row.split("|")[3]) > 0 for row in rows)  # the dense walks of a decode


def test_observe_stall_benchmark_runs(capsys):
    assert observe_stall.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    assert "crash scale (stall)" in text and "(= exact)" in text


import json  # noqa: E402
import random  # noqa: E402

import paired_speed  # noqa: E402
import paired_stats  # noqa: E402


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
            [
                "--model",
                "qwen3_next",
                "--layers",
                "4",
                "--steps",
                "24",
                "--chunk",
                "8",
                "--warmup",
                "4",
                "--variants",
                "unwatched,aa,fix",
                "--compare",
                "fix:aa",
                "--jsonl",
                str(records),
            ]
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


def test_round_diff_tells_a_cost_of_every_round_from_one_of_few(tmp_path, capsys, monkeypatch):
    """A variant 2 ms slower in every round and one 20 ms slower in a tenth of them have the
    same mean difference; only the first moves the median."""
    import json
    import random

    import round_diff

    rng = random.Random(0)
    path = tmp_path / "records.jsonl"
    with open(path, "w") as f:
        for k in range(200):
            base = 0.2 + rng.uniform(-0.004, 0.004)
            for variant, extra in (("ref", 0.0), ("steady", 0.002), ("rare", 0.02 if k % 10 == 0 else 0.0)):
                f.write(
                    json.dumps(
                        {
                            "type": "chunk",
                            "run": "r1",
                            "rep": 0,
                            "round": k,
                            "variant": variant,
                            "tokens": 25,
                            "seconds": base + extra + rng.uniform(-0.001, 0.001),
                        }
                    )
                    + "\n"
                )
    monkeypatch.setattr(sys, "argv", ["round_diff.py", str(path), "steady:ref", "rare:ref"])
    round_diff.main()
    rows = {
        r[0]: r for r in (line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()[2:])
    }
    median = {v: float(rows[f" {v} "][4]) for v in ("steady", "rare")}
    mean = {v: float(rows[f" {v} "][5]) for v in ("steady", "rare")}
    assert abs(median["steady"] - 2.0) < 0.3 and abs(median["rare"]) < 0.3
    assert abs(mean["steady"] - mean["rare"]) < 0.3


def test_inline_attributes_benchmark_runs(capsys):
    import inline_attributes

    inline_attributes.pure()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == [
        "untouched",
        "untouched again (A/A)",
        "__dict__ read once",
        "gc.get_referents",
        "object.__getattribute__",
    ]
    assert all(float(r.split("|")[2]) > 0 for r in rows)
