"""The benchmark scripts still run (tiny, seconds), and what they print holds: every variant of the
decode benchmark gives the unwatched tokens on the CPU backend, and the fix leaves no leak."""

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import decode_tokens_per_s  # noqa: E402
import observe_cost  # noqa: E402
import walk_and_fix_cost  # noqa: E402


def table_rows(text: str) -> dict:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 3 and not cells[0].startswith(("variant", "---", "what", "llama")):
            rows[cells[0]] = cells
    return rows


def test_decode_benchmark_runs_and_every_variant_gives_the_same_tokens(tmp_path, capsys, monkeypatch):
    out = tmp_path / "decode.md"
    monkeypatch.setattr(sys, "argv", ["decode_tokens_per_s.py"])
    assert decode_tokens_per_s.main(["--model", "qwen3_next", "--layers", "4", "--steps", "24", "--reps", "1",
                                     "--chunk", "8", "--variants", "unwatched,aa,handfix,watched,fix,wrapped,nowalk",
                                     "--out", str(out)]) == 0
    rows = table_rows(out.read_text())
    assert set(rows) == {"unwatched", "aa", "handfix", "watched", "fix", "wrapped", "nowalk"}
    assert all(cells[-1] == "yes" for cells in rows.values()), rows  # tokens identical
    retained = {v: int(cells[-2]) for v, cells in rows.items()}
    assert retained["unwatched"] == retained["watched"] > retained["fix"]  # the leak, and the fix cutting it
    assert retained["wrapped"] == retained["nowalk"] == retained["unwatched"]
    assert "gave the same tokens in every repetition" in out.read_text()
    assert rows["aa"][6].endswith(", 3") and rows["unwatched"][6] == ""  # 24 steps in chunks of 8: 3 pairs


def test_observe_cost_runs(capsys):
    assert observe_cost.main(["--layers", "2", "--calls", "50", "--repeats", "1", "--in-decode"]) == 0
    rows = table_rows(capsys.readouterr().out)
    (cells,) = rows.values()
    assert all(float(c) > 0 for c in cells[2:])


def test_walk_and_fix_cost_runs(capsys):
    assert walk_and_fix_cost.main(["--layers", "4", "--vocab", "512", "--depth", "4", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert "fix, chains 4 deep, in flight" in text and "walk: account(), synced" in text


import observe_stall  # noqa: E402


def test_observe_stall_benchmark_runs(capsys):
    assert observe_stall.main(["--smoke"]) == 0
    text = capsys.readouterr().out
    assert "crash scale (stall)" in text and "(= exact)" in text
