"""The command line: `mlx-watchdog demo`, `diagnose` (incl. --to-the-limit) and the `serve` dispatch.

Everything runs offline on tiny random-weight models written by the tests (mlx_watchdog.tiny).
Most commands run in-process through `cli.main([...])`; one real `mlx-watchdog demo` runs as a
subprocess through the installed console script, and `--to-the-limit` starts its own child.
"""

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import pytest
from rich.console import Console
from support import busy_port, free_port, needs_model_type

from mlx_watchdog import tiny
from mlx_watchdog.commands import demo, diagnose, to_the_limit
from mlx_watchdog.commands import main as cli

REPO = Path(__file__).resolve().parents[2]
JSON_PAGE = REPO / "docs" / "diagnose.md"  # the keys and types of diagnose's JSON documents
LEFT_PADDING = "ArraysCache.left_padding"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A leaky hybrid (qwen3_next, 8 layers: 6 linear -> +5 buffers/step batched), a smaller one
    for the runs to the limit (4 layers: +2/step), a dense llama, and a model type mlx-lm lacks."""
    root = tmp_path_factory.mktemp("models")
    dirs = {
        "hybrid": tiny.save_model_dir(root / "hybrid", "qwen3_next", layers=8),
        "hybrid4": tiny.save_model_dir(root / "hybrid4", "qwen3_next", layers=4),
        "llama": tiny.save_model_dir(root / "llama", "llama", layers=2),
    }
    unknown = root / "unknown"
    shutil.copytree(dirs["llama"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "gpt9"
    (unknown / "config.json").write_text(json.dumps(config))
    dirs["unknown"] = unknown
    return dirs


def to_the_limit_argv(model_dirs, limit: int, *more) -> tuple:
    """``diagnose --to-the-limit`` on the 4-layer hybrid's batched path, up to ``--limit``."""
    return (
        "diagnose",
        "--to-the-limit",
        "--model",
        model_dirs["hybrid4"],
        "--path",
        "batched",
        "--limit",
        limit,
        *more,
    )


def run_main(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


# --------------------------------------------------------------------------- demo


class _ScrapingFile(io.StringIO):
    """The demo's console output; scrapes /metrics once when pass 2 starts (pass 1's watchdog
    is alive and measured then), so the test reads the endpoint while the demo runs."""

    def __init__(self):
        super().__init__()
        self.url = None
        self.scraped = None

    def write(self, text):
        if self.url is None:
            match = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", text)
            if match:
                self.url = match.group(1)
        if "pass 2/2" in text and self.url and self.scraped is None:
            with urllib.request.urlopen(self.url, timeout=10) as reply:
                self.scraped = reply.read().decode()
        return super().write(text)


def test_demo_leaks_then_fix_keeps_tokens_and_serves_metrics():
    args = cli.build_parser(load_serve=False).parse_args(
        ["demo", "--max-tokens", "40", "--metrics-port", "0"]
    )
    out = _ScrapingFile()
    outcome = demo.run_demo(args, Console(file=out, highlight=False, markup=False, soft_wrap=True, width=200))
    text = out.getvalue()

    # Pass 1 leaks (12 layers, 9 linear: 8 buffers/step), pass 2 is flat, the tokens are the same.
    assert outcome.first.decode_steps == 40 and outcome.first.stopped is None
    assert outcome.first.forecast.buffers_per_step == pytest.approx(8.0)
    assert outcome.first.forecast.leaks[0].site == LEFT_PADDING
    assert outcome.second.forecast.buffers_per_step < 0.01
    assert outcome.second.watchdog.materialized_arrays > 0
    assert [len(t) for t in outcome.first.tokens] == [40, 40]
    assert outcome.first.tokens == outcome.second.tokens
    assert outcome.exit_status == 0

    # The terminal output: not a TTY here, so plain periodic lines, no escape codes.
    assert "\x1b[" not in text
    assert f"top leak site: {LEFT_PADDING} +8 buffers/step" in text
    assert "tokens identical (80 compared)" in text
    assert "VERDICT: the fix removes the leak" in text
    assert re.search(r"crash: step 1,2\d\d", text), text  # (10,000 - ~270) / 8 + a few
    assert "scaled down from the real 499,000" in text

    # /metrics was served on loopback while the demo ran, and closed after it.
    assert outcome.metrics_url == out.url
    assert out.scraped is not None
    growth = re.search(r'mlx_watchdog_buffers_per_step\{watchdog="demo-qwen3_next"\} (\S+)', out.scraped)
    assert growth and float(growth.group(1)) == pytest.approx(8.0)
    with pytest.raises(OSError):
        urllib.request.urlopen(out.url, timeout=2)


def test_demo_stops_at_the_scaled_limit_and_compares_what_was_decoded():
    args = cli.build_parser(load_serve=False).parse_args(
        ["demo", "--max-tokens", "300", "--limit", "600", "--no-metrics"]
    )
    out = io.StringIO()
    outcome = demo.run_demo(args, Console(file=out, markup=False, soft_wrap=True, width=200))
    # (600 - ~273 resident at the start) / 8 per step: stopped after ~40 of the 300 steps.
    assert outcome.first.stopped is not None
    assert 30 <= outcome.first.decode_steps <= 50
    assert outcome.second.decode_steps == outcome.first.decode_steps
    assert outcome.first.tokens == outcome.second.tokens
    assert outcome.exit_status == 0
    text = out.getvalue()
    assert "the estimate reached the limit of 600 buffers" in text
    steps = outcome.first.decode_steps
    assert f"after {steps:,} of 300 steps" in text
    assert f"pass 2/2: Watchdog(fix=True), {steps:,} steps (not 300)" in text


@needs_model_type("deepseek_v41")
def test_demo_of_a_model_mlx_lm_cannot_batch_names_the_plain_path():
    args = cli.build_parser(load_serve=False).parse_args(
        ["demo", "--model-type", "deepseek_v41", "--max-tokens", "30", "--no-metrics"]
    )
    out = io.StringIO()
    demo.run_demo(args, Console(file=out, markup=False, soft_wrap=True, width=200))
    text = out.getvalue()
    header = text.splitlines()[0]
    assert "generate_step (plain path, one sequence)" in header and "BatchGenerator" not in header, header
    assert "has no merge()" in text
    assert text.count("pass 1/2: watch only") == 1, text


def test_demo_console_script_runs_in_a_subprocess():
    script = Path(sys.executable).with_name("mlx-watchdog")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mlx_watchdog"]
    done = subprocess.run(
        [*command, "demo", "--max-tokens", "40", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^metrics: http://127\.0\.0\.1:\d+/metrics", done.stdout, re.M)
    assert LEFT_PADDING in done.stdout
    assert "tokens identical (80 compared)" in done.stdout
    assert "VERDICT: the fix removes the leak" in done.stdout


def test_demo_metrics_port_in_use_is_a_clear_error(capsys):
    with busy_port() as port:
        status, out, err = run_main(capsys, "demo", "--max-tokens", "5", "--metrics-port", port)
    assert status == 2
    assert f"127.0.0.1:{port}" in err and "--metrics-port" in err
    assert "Traceback" not in err


def test_demo_bad_options(capsys):
    status, _, err = run_main(capsys, "demo", "--model-type", "gpt9")
    assert status == 2 and "unknown --model-type 'gpt9'" in err and "qwen3_next" in err
    status, _, err = run_main(capsys, "demo", "--layers", "2", "--no-metrics")
    assert status == 2 and "full_attention_interval" in err
    status, _, err = run_main(capsys, "demo", "--max-tokens", "0")
    assert status == 2 and "--max-tokens: must be a positive integer, got '0'" in err


# --------------------------------------------------------------------------- diagnose


def _doc_blocks(page: Path = JSON_PAGE) -> dict:
    """The ``key  type`` blocks in the text blocks of ``page``: {block: {key: type}}."""
    blocks: dict = {}
    for fence in re.findall(r"^```text\n(.*?)^```", page.read_text(), re.S | re.M):
        current = None
        for line in fence.splitlines():
            header = re.match(r"^(\w+):$", line)
            if header:
                current = blocks.setdefault(header.group(1), {})
                continue
            if line and not line.startswith(" "):
                current = None
            entry = re.match(r"^  (\w+)\s+(\S+)", line)
            if current is not None and entry:
                current[entry.group(1)] = entry.group(2)
    return blocks


def _check(value, kind: str, blocks: dict, where: str) -> None:
    """Check ``value`` against a documented type: str int float bool, [x], {block}, x|null."""
    if kind.endswith("|null"):
        if value is None:
            return
        kind = kind[: -len("|null")]
    if kind.startswith("[") and kind.endswith("]"):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            _check(item, kind[1:-1], blocks, f"{where}[{i}]")
    elif kind.startswith("{") and kind.endswith("}"):
        _check_object(value, kind[1:-1], blocks, where)
    elif kind == "str":
        assert isinstance(value, str), where
    elif kind == "int":
        assert isinstance(value, int) and not isinstance(value, bool), where
    elif kind == "float":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
        assert math.isfinite(value), where
    elif kind == "bool":
        assert isinstance(value, bool), where
    else:
        raise AssertionError(f"undocumented type {kind!r} at {where}")


def _check_object(value, block: str, blocks: dict, where: str) -> None:
    assert isinstance(value, dict), where
    schema = blocks[block]
    assert set(value) == set(schema), f"{where}: keys {sorted(value)} vs documented {sorted(schema)}"
    for key, kind in schema.items():
        _check(value[key], kind, blocks, f"{where}.{key}")


def test_docs_page_documents_both_json_objects():
    blocks = _doc_blocks()
    assert {
        "diagnose",
        "run",
        "leak",
        "fix",
        "versions",
        "to_the_limit",
        "failure",
        "forecast",
        "checkpoint",
        "child",
    } <= set(blocks)
    assert blocks["run"]["limit_step"] == "float|null"


def test_diagnose_leaky_hybrid_json_schema_and_exit_1(capsys, model_dirs):
    status, out, _ = run_main(
        capsys, "diagnose", "--model", model_dirs["hybrid"], "--max-tokens", 60, "--json"
    )
    report = json.loads(out)
    _check_object(report, "diagnose", _doc_blocks(), "report")
    assert status == report["exit_status"] == 1
    assert report["schema"] == diagnose.SCHEMA and report["model_type"] == "qwen3_next"
    assert report["leak"] is True and report["leak_sites"] == [LEFT_PADDING]
    assert report["limit"] == 499_000 or mx.metal.is_available()
    runs = {r["path"]: r for r in report["runs"]}
    assert list(runs) == ["batched", "plain"]
    batched, plain = runs["batched"], runs["plain"]
    # 8 layers, 6 linear-attention: 5 buffers per step on the batched path, none on the plain one.
    assert batched["leak"] and batched["buffers_per_step"] == pytest.approx(5.0)
    assert batched["leaks"][0]["site"] == LEFT_PADDING
    assert "[0].left_padding" in batched["leaks"][0]["paths"]
    assert batched["batch_size"] == 2 and batched["decode_steps"] == 60
    assert batched["limit_step"] == pytest.approx(
        60 + (report["limit"] - batched["resident_buffers"]) / 5.0, rel=1e-3
    )
    assert batched["fix"]["removes_leak"] and batched["fix"]["tokens_identical"]
    assert batched["fix"]["buffers_per_step"] < 0.01 and batched["fix"]["compared_tokens"] == 120
    assert 0 < batched["watchdog_overhead"] < 1
    assert not plain["leak"] and plain["limit_step"] is None and plain["batch_size"] == 1
    assert plain["fix"]["tokens_identical"]
    assert report["fix_removes_leak"] is True
    assert report["fix_command"] == f"mlx-watchdog serve --fix -- --model {model_dirs['hybrid']}"


def test_diagnose_leaky_hybrid_report_names_site_and_fix_command(capsys, model_dirs):
    status, out, _ = run_main(
        capsys, "diagnose", "--model", model_dirs["hybrid"], "--path", "batched", "--max-tokens", 50
    )
    assert status == 1
    assert f"LEAK on the batched path: +5 buffers/step, site {LEFT_PADDING}" in out
    assert "the fix (Watchdog(fix=True)) removes it" in out and "tokens identical" in out
    assert re.search(r"crashes after [\d,]+ tokens per sequence", out)
    assert "watchdog overhead (self-timed)" in out
    assert f"mlx-watchdog serve --fix -- --model {model_dirs['hybrid']}" in out
    assert "plain path" not in out  # --path batched: only the batched path


def test_diagnose_dense_llama_exit_0(capsys, model_dirs):
    status, out, _ = run_main(
        capsys, "diagnose", "--model", model_dirs["llama"], "--max-tokens", 60, "--json"
    )
    report = json.loads(out)
    _check_object(report, "diagnose", _doc_blocks(), "report")
    assert status == report["exit_status"] == 0
    assert report["leak"] is False and report["leak_sites"] == [] and report["fix_removes_leak"] is None
    for run in report["runs"]:
        assert run["buffers_per_step"] < 0.01 and run["leaks"] == [] and run["limit_step"] is None
        assert run["fix"]["tokens_identical"]


def test_diagnose_errors_are_clear(capsys, model_dirs, tmp_path):
    missing = tmp_path / "no-such-model"
    status, _, err = run_main(capsys, "diagnose", "--model", missing)
    assert status == 2 and f"model path does not exist: {missing}" in err
    status, _, err = run_main(capsys, "diagnose", "--model", model_dirs["unknown"], "--max-tokens", 5)
    assert status == 2 and "unknown model type 'gpt9'" in err and str(model_dirs["unknown"]) in err
    status, _, err = run_main(capsys, "diagnose", "--model", model_dirs["llama"], "-m", 0)
    assert status == 2 and "--max-tokens: must be a positive integer, got '0'" in err
    status, _, err = run_main(capsys, "diagnose", "--max-tokens", 5)
    assert status == 2 and "--model PATH_OR_HF_ID is required" in err
    status, _, err = run_main(capsys, "diagnose", "--model", "nobody/no-such-model-here", "--max-tokens", 5)
    assert status == 2 and "cannot load model nobody/no-such-model-here" in err
    (tmp_path / "empty").mkdir()
    status, _, err = run_main(capsys, "diagnose", "--model", tmp_path / "empty")
    assert status == 2 and "no config.json" in err
    status, _, err = run_main(capsys, "diagnose", "--model", model_dirs["llama"], "--", "--port", "8080")
    assert status == 2 and "only `serve` takes them" in err and "Traceback" not in err


# --------------------------------------------------------------------------- --to-the-limit


def test_to_the_limit_forecast_at_one_percent_within_one_percent(capsys, model_dirs):
    # hybrid4: 3 linear layers, +2 buffers/step; the estimate crosses 1,100 after ~500 steps.
    status, out, _ = run_main(capsys, *to_the_limit_argv(model_dirs, 1100, "--json"))
    report = json.loads(out)
    _check_object(report, "to_the_limit", _doc_blocks(), "report")
    assert status == report["exit_status"] == 0
    failure = report["failure"]
    assert failure["kind"] == "estimate_crossed_limit" and report["limit_source"] == "--limit"
    assert 400 <= failure["step"] <= 600
    assert report["child"]["exit_status"] == 0 and report["steps_recorded"] == failure["step"]
    forecast = report["forecast"]
    assert 1.0 <= forecast["made_at_percent"] <= 2.0
    assert forecast["made_at_step"] <= 0.02 * failure["step"] + 1
    assert abs(forecast["limit_step"] - failure["step"]) <= 0.01 * failure["step"]
    assert report["error_percent"] == pytest.approx(
        100 * (forecast["limit_step"] - failure["step"]) / failure["step"], abs=1e-3
    )
    assert abs(report["error_percent"]) < 1.0
    assert [c["percent"] for c in report["checkpoints"]] == [1.0, 5.0, 10.0, 25.0, 50.0]


def test_to_the_limit_child_crash_does_not_fail_the_parent(capsys, model_dirs):
    # The child dies like an uncaught Metal error kills a process (SIGABRT, no report of its own):
    # the parent takes the failing step from the stream and the error from the child's stderr.
    status, out, err = run_main(capsys, *to_the_limit_argv(model_dirs, 1100, "--crash-at-limit"))
    assert status == 0, out + err
    assert re.search(r"child process (was killed by signal \d+|exited with status -?\d+)", out)
    match = re.search(
        r"real failure at step ([\d,]+): \[metal::malloc\] Resource limit \(1100\) exceeded", out
    )
    assert match, out
    fail_step = int(match.group(1).replace(",", ""))
    forecast = re.search(
        r"forecast made at step (\d+) \(([\d.]+)% of the run\): limit at step ([\d,]+); "
        r"actual failing step ([\d,]+); error ([+-][\d.]+)%",
        out,
    )
    assert forecast, out
    assert int(forecast.group(4).replace(",", "")) == fail_step
    assert 1.0 <= float(forecast.group(2)) <= 2.0
    assert abs(float(forecast.group(5))) < 1.0


def test_to_the_limit_needs_a_limit_without_metal(capsys):
    if mx.metal.is_available():
        pytest.skip("Metal has a real resource limit: --to-the-limit runs into it without --limit")
    status, _, err = run_main(capsys, "diagnose", "--to-the-limit")
    assert status == 2 and "pass --limit N" in err


def test_to_the_limit_reports_children_that_end_without_a_failing_step():
    def outcome(records, events, returncode, stderr="", stalled=False):
        return to_the_limit.ChildOutcome(records, events, returncode, stderr, stalled)

    config = {"limit": 1000}
    records = [(s, 100 + 2 * s, 450.0) for s in range(1, 101)]
    cap = to_the_limit.limit_report(
        outcome(records, [{"event": "cap", "step": 100}], 0), config, "m", "batched"
    )
    assert cap["failure"]["kind"] == "step_cap" and cap["exit_status"] == 1 and cap["forecast"] is None
    died = to_the_limit.limit_report(outcome(records, [], 1, "Segmentation fault\n"), config, "m", "batched")
    assert died["failure"] == {
        "kind": "child_died",
        "step": None,
        "error": "exit status 1: Segmentation fault",
    }
    assert died["exit_status"] == 1
    stuck = to_the_limit.limit_report(outcome(records, [], -9, stalled=True), config, "m", "batched")
    assert stuck["failure"]["kind"] == "stalled"
    usage = to_the_limit.limit_report(
        outcome([], [{"event": "error", "usage": True, "error": "x"}], 2), config, "m", "batched"
    )
    assert usage["exit_status"] == 2
    # Metal's real error in the stderr of a child that aborted after step 100: it failed in step 101.
    real = to_the_limit.limit_report(
        outcome(records, [], -6, "libc++abi: [metal::malloc] Resource limit (499000) exceeded.\n"),
        config,
        "m",
        "batched",
    )
    assert real["failure"]["kind"] == "resource_limit_error" and real["failure"]["step"] == 101
    # The only forecast (450) was made from step 1 on, so the 1% one is at step 2 (1.98%).
    assert real["forecast"] == {"made_at_step": 2, "made_at_percent": 1.98, "limit_step": 450.0}
    assert real["error_percent"] == pytest.approx(100 * (450 - 101) / 101, abs=1e-3)
    blocks = _doc_blocks()
    for report in (cap, died, stuck, usage, real):
        _check_object(report, "to_the_limit", blocks, "report")


# --------------------------------------------------------------------------- serve dispatch


def test_serve_gets_its_options_and_the_server_argv(monkeypatch):
    from mlx_watchdog.commands import serve

    seen = {}

    def fake_run(args, server_argv):
        seen.update(args=args, server_argv=server_argv)
        return 0

    monkeypatch.setattr(serve, "run", fake_run)
    assert cli.main(["serve", "--fix", "--no-metrics", "--", "--model", "m", "--port", "8080"]) == 0
    assert seen["server_argv"] == ["--model", "m", "--port", "8080"]
    assert seen["args"].fix is True and seen["args"].no_metrics is True


def test_demo_and_diagnose_work_without_serve(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_import_serve", lambda: (None, "ModuleNotFoundError: no serve"))
    status, _, err = run_main(capsys, "serve", "--", "--model", "m")
    assert status == 2 and "`serve` is not available" in err and "no serve" in err
    status, out, _ = run_main(capsys, "demo", "--help")
    assert status == 0 and "--metrics-port" in out
    status, out, _ = run_main(capsys, "--help")
    assert status == 0 and "diagnose" in out and "serve" in out


# --------------------------------------------------------------------------- flags, JSON, plots


def _parse(*argv):
    return cli.build_parser(load_serve=False).parse_args([str(a) for a in argv])


def test_flags_follow_mlx_lm(capsys):
    args = _parse("demo", "-m", 7, "--batch-size", 3)
    assert (args.max_tokens, args.batch_size) == (7, 3)
    assert capsys.readouterr().err == ""
    args = _parse("diagnose", "--model", "m", "--max-tokens", 5, "-p", "hi", "--path", "plain")
    assert (args.max_tokens, args.prompt, diagnose.selected_paths(args)) == (5, ["hi"], ["plain"])
    assert diagnose.selected_paths(_parse("diagnose", "--path", "batched")) == ["batched"]
    assert diagnose.selected_paths(_parse("diagnose")) == ["batched", "plain"]
    capsys.readouterr()
    status, out, _ = run_main(capsys, "diagnose", "--help")
    assert "--max-tokens" in out and "--steps" not in out
    # The old spellings of 0.1's development (--steps, diagnose --plain/--batch) are gone.
    for argv in (
        ["demo", "--steps", 9],
        ["diagnose", "--steps", 9],
        ["diagnose", "--plain"],
        ["diagnose", "--batch"],
    ):
        status, _, err = run_main(capsys, *argv)
        assert status == 2 and "deprecated" not in err, (argv, err)
    status, _, err = run_main(capsys, "diagnose", "--path", "sideways")
    assert status == 2 and "invalid choice: 'sideways'" in err
    status, _, err = run_main(capsys, "demo", "--plot", "picture.jpg")
    assert status == 2 and "must be a file name ending in .png or .svg, got 'picture.jpg'" in err


def test_serve_without_the_double_dash_gets_a_hint(capsys):
    status, out, err = run_main(capsys, "serve", "--fix", "--model", "m", "--port", "8080")
    assert status == 2 and out == ""
    assert "unrecognized arguments: --model m --port 8080" in err
    assert "mlx-watchdog serve [watchdog options] -- --model m --port 8080" in err


def test_demo_json_is_one_document_and_its_plot_has_the_data(capsys, tmp_path):
    from mlx_watchdog.commands import plot

    picture = tmp_path / "demo.svg"
    status, out, err = run_main(capsys, "demo", "-m", 40, "--no-metrics", "--json", "--plot", picture)
    report = json.loads(out)  # the whole of stdout: one document
    assert status == report["exit_status"] == 0
    assert report["schema"] == demo.SCHEMA and report["leak_sites"] == [LEFT_PADDING]
    assert report["fix_removes_leak"] is True and report["real_limit"] >= report["limit"] == 10_000
    run = report["runs"][0]
    assert run["path"] == "batched" and run["buffers_per_step"] == pytest.approx(8.0)
    assert report["real_limit_step"] == pytest.approx(
        run["limit_step"] + (report["real_limit"] - report["limit"]) / 8.0, rel=1e-6
    )
    assert "VERDICT: the fix removes the leak" in err  # the display went to stderr
    # An SVG document, with the readings in it: a PNG/SVG by its header, data checked below.
    root = __import__("xml.etree.ElementTree", fromlist=["parse"]).parse(picture).getroot()
    assert root.tag.endswith("svg")
    _check_figure(plot.figure(report), run, report["limit"])


def _check_figure(figure, run: dict, limit: float) -> None:
    """The plotted data: readings, the fitted line's slope, the limit and the crash step."""
    measured, forecast = figure.axes[:2]
    lines = {line.get_label(): line for line in measured.get_lines()}
    watched = next(line for label, line in lines.items() if label.startswith("watched:"))
    assert LEFT_PADDING in watched.get_label()  # top leak site in the legend
    assert [list(p) for p in zip(watched.get_xdata(), watched.get_ydata())] == run["readings"]
    fixed = next(line for label, line in lines.items() if label.startswith("Watchdog(fix=True)"))
    assert [list(p) for p in zip(fixed.get_xdata(), fixed.get_ydata())] == run["fix"]["readings"]
    fit = lines[f"fit {run['buffers_per_step']:+.3g} buffers/step"]
    (x0, x1), (y0, y1) = fit.get_xdata(), fit.get_ydata()
    assert (y1 - y0) / (x1 - x0) == pytest.approx(run["buffers_per_step"])
    # The fit runs through the readings: the last one is on the line (within a step's growth).
    step, resident = run["readings"][-1]
    assert abs(y0 + (step - x0) * run["buffers_per_step"] - resident) <= run["buffers_per_step"] + 1
    others = {line.get_label(): line for line in forecast.get_lines()}
    assert list(others[f"limit {limit:,.0f} buffers"].get_ydata()) == [limit, limit]
    crash = others[f"forecast crash: step {run['limit_step']:,.0f}"]
    assert list(crash.get_xdata()) == [run["limit_step"]] * 2
    growth = others[f"watched: {run['buffers_per_step']:+.3g}/step"]
    assert growth.get_xdata()[-1] == pytest.approx(run["limit_step"])  # meets the limit at the crash
    assert growth.get_ydata()[-1] == pytest.approx(limit)


def test_diagnose_plot_png_and_table_not_cut_at_80_columns(capsys, model_dirs, tmp_path):
    from mlx_watchdog.commands import plot

    picture = tmp_path / "leak.png"
    status, out, _ = run_main(
        capsys, "diagnose", "--model", model_dirs["hybrid"], "-m", 40, "--plot", picture
    )
    assert status == 1 and f"plot: {picture}" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    row = next(line for line in out.splitlines() if line.startswith("│ batched"))
    assert f"{LEFT_PADDING} +5" in row and "…" not in out and len(row) > 80
    status, out, _ = run_main(capsys, "diagnose", "--model", model_dirs["hybrid"], "-m", 40, "--json")
    report = json.loads(out)
    figure = plot.figure(report)
    assert len(figure.axes) == 4  # two paths, measured and forecast each
    _check_figure(figure, report["runs"][0], report["limit"])


def test_diagnose_shows_a_progress_bar_per_pass_on_a_terminal(model_dirs):
    model = tiny.build_model("qwen3_next", layers=4)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with diagnose.PassProgress(console) as progress:
        report = diagnose.diagnose_model(
            model,
            tiny.tiny_prompts(1, 8),
            paths=["batched"],
            steps=12,
            limit=None,
            batch_size=2,
            model_spec="tiny",
            model_type="qwen3_next",
            progress=progress,
        )
    text = out.getvalue()
    assert report["runs"][0]["decode_steps"] == 12
    assert "batched path, watch only" in text and "batched path, Watchdog(fix=True)" in text
    assert "12/12" in text


def test_plot_without_matplotlib_is_one_line_and_fails_before_decoding(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from mlx_watchdog.commands import main as cli\n"
        f"sys.exit(cli.main(['demo', '--no-metrics', '--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "mlx-watchdog demo: error: --plot needs matplotlib, which is not "
        "installed: pip install 'mlx-watchdog[plot]'"
    )
    assert "pass 1/2" not in done.stdout and not (tmp_path / "x.png").exists()  # before decoding


# --------------------------------------------------------------------------- imports


@pytest.mark.parametrize(
    "module",
    [
        "commands.common",
        "commands.decode",
        "commands.demo",
        "commands.diagnose",
        "commands.load",
        "commands.plot",
        "commands.scan",
        "commands.serve",
        "commands.to_the_limit",
    ],
)
def test_subcommand_modules_do_not_import_the_entry_point(module):
    code = f"import sys, mlx_watchdog.{module}; print('mlx_watchdog.commands.main' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_attachment_points_import_lazily_from_the_package():
    code = (
        "import sys, mlx_watchdog\n"
        "print('mlx_watchdog.attach.model' in sys.modules)\n"
        "from mlx_watchdog import watch, watch_model, unwatch_model, watch_step\n"
        "from mlx_watchdog.attach import decorator, model, step\n"
        "print(decorator.watch is watch and model.watch_model is watch_model "
        "and model.unwatch_model is unwatch_model and step.watch_step is watch_step)\n"
        "print(set(mlx_watchdog.__all__) <= set(dir(mlx_watchdog)))\n"
        "try:\n    mlx_watchdog.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == [
        "False",
        "True",
        "True",
        "module 'mlx_watchdog' has no attribute 'no_such_name'",
    ], done.stderr


# --------------------------------------------------------------------------- serve fails fast


def _serve(*argv, timeout=120):
    script = Path(sys.executable).with_name("mlx-watchdog")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mlx_watchdog"]
    return subprocess.run(
        [*command, "serve", *map(str, argv)], capture_output=True, text=True, timeout=timeout
    )


def test_serve_fails_fast_on_a_missing_model_and_a_busy_port(model_dirs, tmp_path):
    missing = tmp_path / "no-such-model"
    done = _serve("--no-metrics", "--", "--model", missing)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"mlx-watchdog serve: error: model path does not exist: {missing} (mlx_lm.server's --model)"
    ]
    with busy_port() as port:
        # mlx_lm.server alone hangs here with a traceback; serve checks before it starts.
        done = _serve("--no-metrics", "--", "--model", model_dirs["hybrid4"], "--port", port)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--port" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1  # its one line, not a server's log
        done = _serve("--metrics-port", port, "--", "--model", model_dirs["hybrid4"])
        assert done.returncode == 2 and f"{port}" in done.stderr and "--no-metrics" in done.stderr
        assert "Traceback" not in done.stderr
    free = free_port()
    done = _serve("--metrics-port", free, "--", "--model", model_dirs["hybrid4"], "--port", free)
    assert done.returncode == 2 and f"--port {free} is the metrics port" in done.stderr


def test_to_the_limit_shows_progress_on_a_terminal(monkeypatch, model_dirs):
    """On a terminal the child's run is a progress bar toward the forecast limit step (stderr)."""
    out = io.StringIO()
    bar_console = Console(file=out, force_terminal=True, width=120)
    args = _parse(*to_the_limit_argv(model_dirs, 700, "--json"))
    report_console = Console(file=io.StringIO(), width=200)
    monkeypatch.setattr(to_the_limit, "print_json", lambda document: out.write(json.dumps(document)))
    assert to_the_limit.run(args, report_console, bar_console) == 0
    text = out.getvalue()
    assert "child: resident ~" in text and "steps to the forecast limit" in text
    assert '"failure": {"kind": "estimate_crossed_limit"' in text
