"""``mlx-watchdog run -- COMMAND`` and ``instrument()`` / ``uninstrument()``: a program watched with
no line of it changed, its child processes too, their metrics merged with a ``pid`` label.

The end-to-end runs decode tiny random-weight models (``mlx_watchdog.tiny``) in a program written
here; the growth they read is checked against the exact live-buffer count of the program's own
process (``exact_buffers``), not against the watchdog's numbers alone."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, http_get, log_tail, missing, stop_process

import mlx_watchdog
from mlx_watchdog.attach import loaders
from mlx_watchdog.attach.model import watched_state
from mlx_watchdog.bootstrap import ENV, FOLDER
from mlx_watchdog.commands import main as cli
from mlx_watchdog.commands import run as run_command
from mlx_watchdog.exporters.processes import ProcessesCollector, SnapshotWriter, snapshot_path
from mlx_watchdog.exporters.prometheus import WatchdogCollector
from mlx_watchdog.tiny import save_model_dir

TESTS = Path(__file__).resolve().parents[1]  # tests/, for exact_buffers
PYTHON = sys.executable
LEAK = 5  # 8 layers, full attention every 4th: 6 linear-attention layers leak 5 buffers a step
STEPS = 300  # decode steps before the program reports; its growth is read from step 100 on


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("run-models")
    return {
        "qwen": save_model_dir(root / "qwen3_next-8", "qwen3_next", layers=8),
        "llama": save_model_dir(root / "llama-4", "llama", layers=4),
    }


@pytest.fixture
def clean_instrumentation():
    yield
    loaders.uninstrument()


def supervisor(
    tmp_path: Path, *args, name: str = "run", env: dict | None = None
) -> tuple[subprocess.Popen, Path]:
    """``python -m mlx_watchdog run ARGS`` in a session of its own (the test can end the group)."""
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [PYTHON, "-m", "mlx_watchdog", "run", *map(str, args)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    return proc, log


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def by_pid(text: str, name: str, pid: int, **labels) -> list[float]:
    return [
        v
        for lab, v in samples(text, name)
        if lab.get("pid") == str(pid) and all(lab.get(k) == w for k, w in labels.items())
    ]


# --------------------------------------------------------------------------- the program

APP = textwrap.dedent(
    f"""
    import json, multiprocessing, os, sys, time

    def decode(path, tag, out, release):
        sys.path.insert(0, {str(TESTS)!r})
        try:
            import exact_buffers
            counter = exact_buffers.install()
        except RuntimeError as exc:
            counter, why = None, str(exc)
        from mlx_lm import load
        from mlx_lm.generate import BatchGenerator

        model, _ = load(path)
        gen = BatchGenerator(model, max_tokens=1_000_000)
        gen.insert([[5, 6, 7, 8, 9, 10]] * 2)  # equal lengths
        tokens, live = [], {{}}
        for step in range(1, {STEPS} + 1):
            responses = sorted(gen.next_generated(), key=lambda r: r.uid)
            tokens.append([r.token for r in responses])
            if counter is not None and step in (100, {STEPS}):
                live[step] = counter.live()
        slope = (live[{STEPS}] - live[100]) / ({STEPS} - 100) if counter is not None else None
        report = {{"pid": os.getpid(), "tokens": tokens, "slope": slope, "why": None if counter else why}}
        with open(os.path.join(out, tag + ".tmp"), "w") as f:
            json.dump(report, f)
        os.replace(os.path.join(out, tag + ".tmp"), os.path.join(out, tag + ".json"))
        while not os.path.exists(release):  # still decoding, slowly, until the test has scraped
            gen.next_generated()
            time.sleep(0.05)

    if __name__ == "__main__":
        qwen, llama, out, release, with_child = sys.argv[1:]
        child = None
        if with_child == "1":
            child = multiprocessing.get_context("spawn").Process(target=decode, args=(llama, "child", out, release))
            child.start()
        decode(qwen, "main", out, release)
        if child is not None:
            child.join()
            sys.exit(child.exitcode)
    """
)


def run_program(tmp_path: Path, model_dirs, *options, with_child: bool) -> dict:
    """Run APP under ``mlx-watchdog run OPTIONS``; once it has decoded and the merged endpoint
    reads a measured rate for every decoding process, scrape, release it and return what was seen."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    app, out, release = tmp_path / "app.py", tmp_path / "out", tmp_path / "release"
    app.write_text(APP)
    out.mkdir()
    port = free_port()
    proc, log = supervisor(
        tmp_path,
        "--metrics-port",
        port,
        *options,
        "--",
        PYTHON,
        app,
        model_dirs["qwen"],
        model_dirs["llama"],
        out,
        release,
        int(with_child),
        name="run",
    )
    tags = ["main", "child"] if with_child else ["main"]
    try:
        reports = {}
        deadline = time.monotonic() + 240
        while len(reports) < len(tags):
            assert proc.poll() is None, f"run exited with {proc.returncode}:\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"the program did not report:\n{log_tail(log)}"
            for tag in tags:
                if tag not in reports and (out / f"{tag}.json").exists():
                    reports[tag] = json.loads((out / f"{tag}.json").read_text())
            time.sleep(0.2)
        for report in reports.values():
            if report["slope"] is None:
                missing(f"the exact live-buffer counter cannot be installed: {report['why']}")
        pids = [reports[tag]["pid"] for tag in tags]
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 120
        while True:
            status, body = http_get(url)
            text = body.decode()
            ready = status == 200 and all(
                by_pid(text, "mlx_watchdog_rate_known", pid) == [1.0]
                and by_pid(text, "mlx_watchdog_decoding", pid) == [1.0]
                for pid in pids
            )
            if ready:
                break
            assert proc.poll() is None, f"run exited with {proc.returncode}:\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"no measured rate for {pids}:\n{text}\n{log_tail(log)}"
            time.sleep(0.5)
        release.write_text("")
        status = proc.wait(timeout=120)
        return {"reports": reports, "text": text, "status": status, "log": log.read_text()}
    finally:
        release.write_text("")
        stop_process(proc, group=True)


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory, model_dirs):
    return run_program(tmp_path_factory.mktemp("run-watched"), model_dirs, with_child=True)


def test_run_watches_the_program_and_its_spawned_child_with_a_pid_label(watched_run, model_dirs):
    main, child = watched_run["reports"]["main"], watched_run["reports"]["child"]
    text = watched_run["text"]
    assert watched_run["status"] == 0, watched_run["log"]
    assert main["pid"] != child["pid"]
    # The truth, counted by the allocator in each process: the hybrid leaks, the llama does not.
    assert main["slope"] == pytest.approx(LEAK, abs=0.3)
    assert child["slope"] == pytest.approx(0, abs=0.3)
    # One endpoint, each process under its own pid label, each reading its own truth.
    assert by_pid(text, "mlx_watchdog_buffers_per_step", main["pid"], watchdog="qwen3_next-8") == [
        pytest.approx(main["slope"], abs=0.5)
    ]
    assert by_pid(text, "mlx_watchdog_buffers_per_step", child["pid"], watchdog="llama-4") == [
        pytest.approx(child["slope"], abs=0.5)
    ]
    assert by_pid(
        text, "mlx_watchdog_leak_buffers_per_step", main["pid"], site="ArraysCache.left_padding"
    ) == [pytest.approx(LEAK, abs=0.5)]
    assert {lab["pid"] for lab, _ in samples(text, "mlx_watchdog_steps_total")} == {
        str(main["pid"]),
        str(child["pid"]),
    }
    errors = samples(text, "mlx_watchdog_internal_errors_total")
    assert len(errors) == 2 and all(v == 0 for _, v in errors), errors
    for pid in (main["pid"], child["pid"]):  # each process's own memory, read at scrape time
        assert by_pid(text, "process_resident_memory_bytes", pid)[0] > 0
    log = watched_run["log"]
    assert "mlx-watchdog run: watching every model" in log and "(label pid)" in log
    assert f"watching qwen3_next-8 (pid {main['pid']})" in log
    assert f"watching llama-4 (pid {child['pid']})" in log
    assert "NOTHING IS WATCHED" not in log


def test_run_fix_removes_the_growth_with_the_same_tokens(tmp_path, watched_run, model_dirs):
    fixed = run_program(tmp_path, model_dirs, "--fix", with_child=False)
    main = fixed["reports"]["main"]
    assert fixed["status"] == 0, fixed["log"]
    assert main["tokens"] == watched_run["reports"]["main"]["tokens"]  # greedy, bit for bit
    assert abs(main["slope"]) < 0.6  # the truth: no growth left (a sawtooth of fix_every steps)
    text = fixed["text"]
    assert by_pid(text, "mlx_watchdog_buffers_per_step", main["pid"]) == [pytest.approx(0, abs=0.5)]
    assert by_pid(
        text, "mlx_watchdog_fixed_leak_buffers_per_step", main["pid"], site="ArraysCache.left_padding"
    ) == [pytest.approx(LEAK, abs=0.5)]
    assert by_pid(text, "mlx_watchdog_materialized_arrays_total", main["pid"])[0] > 0
    assert by_pid(text, "mlx_watchdog_internal_errors_total", main["pid"]) == [0]


# --------------------------------------------------------------------------- before the program imports mlx_lm


def test_nothing_of_mlx_or_the_core_is_imported_before_the_program_imports_mlx_lm(tmp_path):
    code = (
        "import json, sys\n"
        "before = sorted(sys.modules)\n"
        "import mlx_lm.utils as u\n"
        "print(json.dumps({'before': before, 'wrapped': u.load_model.__wrapped__.__module__}))\n"
    )
    proc, log = supervisor(tmp_path, "--no-metrics", "--", PYTHON, "-c", code)
    assert proc.wait(timeout=120) == 0, log_tail(log)
    report = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))
    before = report["before"]
    heavy = [
        m for m in before if m.split(".")[0] in ("mlx", "mlx_lm", "mlx_vlm", "numpy", "prometheus_client")
    ]
    assert heavy == []
    ours = {m for m in before if m.startswith("mlx_watchdog")}
    # The instrumentors and the bootstrap (standard library only), the options' bounds, the
    # registry of compiled functions and the clock (the same).
    assert ours == {
        "mlx_watchdog",
        "mlx_watchdog.attach",
        "mlx_watchdog.attach.compiled",
        "mlx_watchdog.attach.imports",
        "mlx_watchdog.attach.loaders",
        "mlx_watchdog.attach.training",
        "mlx_watchdog.bootstrap",
        "mlx_watchdog.core",
        "mlx_watchdog.core.clock",
        "mlx_watchdog.core.compiled",
        "mlx_watchdog.core.options",
    }, ours
    assert report["wrapped"] == "mlx_lm.utils"  # patched right after the program imported it


def test_run_and_its_bootstrap_do_not_import_the_entry_point_and_the_bootstrap_imports_no_mlx():
    code = (
        "import sys, mlx_watchdog.bootstrap\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'numpy')))\n"
        "import mlx_watchdog.commands.run\n"
        "print('mlx_watchdog.commands.main' in sys.modules)\n"
    )
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["[]", "False"], done.stderr


# --------------------------------------------------------------------------- what cannot be watched


@pytest.mark.parametrize(
    "args, flag",
    [
        (["-I", "app.py"], "I"),
        (["-E", "app.py"], "E"),
        (["-S", "-m", "mlx_vlm.server"], "S"),
        (["-bIS", "app.py"], "I"),
        (["-W", "ignore", "-E", "app.py"], "E"),
        (["-Wignore", "-X", "dev", "-s", "-I", "app.py"], "I"),
        (["--check-hash-based-pycs", "always", "-E", "app.py"], "E"),
        (["-u", "app.py", "-I"], None),  # the program's own argument
        (["-c", "print(1)", "-I"], None),
        (["-cI"], None),
        (["-m", "mlx_lm.server", "-E"], None),
        (["-s", "-B", "app.py"], None),
    ],
)
def test_blocking_interpreter_flags_are_found(args, flag):
    assert run_command.blocking_flag(args) == flag


def test_python_started_isolated_is_refused_at_start(tmp_path, capsys):
    app = tmp_path / "app.py"
    app.write_text("print('ran')\n")
    status = cli.main(["run", "--no-metrics", "--", PYTHON, "-I", str(app)])
    err = capsys.readouterr().err
    assert status == 2
    assert "cannot watch" in err and "-I" in err and "isolated mode" in err and "--allow-unwatched" in err
    # A script whose #! line has the flag: the same.
    script = tmp_path / "tool"
    script.write_text(f"#!{PYTHON} -E\nprint('ran')\n")
    script.chmod(0o755)
    status = cli.main(["run", "--no-metrics", "--", str(script)])
    err = capsys.readouterr().err
    assert status == 2 and "-E" in err and f"the #! line of {script}" in err
    script.write_text(f"#!/usr/bin/env -S {PYTHON} -S\nprint('ran')\n")
    assert cli.main(["run", "--no-metrics", "--", str(script)]) == 2
    assert "-S" in capsys.readouterr().err


def test_allow_unwatched_runs_it_and_says_so(tmp_path, capfd):
    app = tmp_path / "app.py"
    app.write_text("import sys; print('ran'); sys.exit(3)\n")
    status = cli.main(["run", "--no-metrics", "--allow-unwatched", "--", PYTHON, "-I", str(app)])
    out, err = capfd.readouterr()
    assert status == 3 and "ran" in out and "runs UNWATCHED" in err and "-I" in err


def test_a_program_that_is_not_python_is_said_to_be_unwatched(monkeypatch, capfd):
    monkeypatch.setattr(run_command, "HELLO_SECONDS", 0.5)
    assert cli.main(["run", "--no-metrics", "--", "sh", "-c", "sleep 2"]) == 0
    assert "NOTHING IS WATCHED" in capfd.readouterr().err
    # A Python program says hello at once: no such line.
    assert cli.main(["run", "--no-metrics", "--", PYTHON, "-c", "import time; time.sleep(2)"]) == 0
    assert "NOTHING IS WATCHED" not in capfd.readouterr().err


def test_a_bootstrap_that_fails_says_so_and_the_program_runs_on(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": FOLDER,
        ENV: json.dumps({"options": {"fix_every": 0}, "state": str(tmp_path)}),
    }
    done = subprocess.run(
        [PYTHON, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert done.stderr.count("is not watched") == 1 and "fix_every must be a positive integer" in done.stderr
    assert any(p.name.startswith("hello-") for p in tmp_path.iterdir())  # it still said hello


def test_an_existing_sitecustomize_later_on_pythonpath_still_runs(tmp_path, monkeypatch, capfd):
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text("import sys\nsys.stdout.write('chained sitecustomize ran\\n')\n")
    monkeypatch.setenv("PYTHONPATH", str(custom))
    code = "import sitecustomize, sys; print(sitecustomize.__file__); print('mlx_watchdog.attach.loaders' in sys.modules)"
    assert cli.main(["run", "--no-metrics", "--", PYTHON, "-c", code]) == 0
    out = capfd.readouterr().out.splitlines()
    assert out == ["chained sitecustomize ran", str(custom / "sitecustomize.py"), "True"]


def test_a_stop_under_mlx_lm_server_points_to_serve(capfd):
    assert run_command.runs_mlx_lm_server(["python3", "-m", "mlx_lm.server", "--model", "m"])
    assert run_command.runs_mlx_lm_server(["python3", "-u", "-m", "mlx_lm", "server"])
    assert run_command.runs_mlx_lm_server(["/venv/bin/mlx_lm.server", "--port", "8080"])
    assert not run_command.runs_mlx_lm_server(["vllm-mlx", "serve", "m"])
    assert not run_command.runs_mlx_lm_server(["python", "-m", "mlx_vlm.server"])
    command = [PYTHON, "-c", "import sys", "-m", "mlx_lm.server"]  # -m here is the program's
    assert cli.main(["run", "--no-metrics", "--stop-within", "10", "--", *command]) == 0
    assert "mlx-watchdog serve` ends stopped requests" not in capfd.readouterr().err


def test_the_state_folder_goes_with_the_run(capfd):
    code = "import json, os; print(json.loads(os.environ['MLX_WATCHDOG_RUN'])['state'])"
    assert cli.main(["run", "--metrics-port", "0", "--", PYTHON, "-c", code]) == 0
    state = Path(capfd.readouterr().out.strip())
    assert state.name.startswith("mlx-watchdog-run-") and not state.exists()


# --------------------------------------------------------------------------- exit status and signals


def test_exit_status_passes_through(capfd):
    assert cli.main(["run", "--no-metrics", "--", PYTHON, "-c", "import sys; sys.exit(7)"]) == 7
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert cli.main(["run", "--no-metrics", "--", PYTHON, "-c", kill]) == 128 + signal.SIGKILL
    assert cli.main(["run", "--no-metrics", "--", "no-such-command-here"]) == 127
    assert "no-such-command-here: command not found" in capfd.readouterr().err
    assert cli.main(["run", "--no-metrics"]) == 2
    assert "no command to run" in capfd.readouterr().err
    assert cli.main(["run", "--no-metrics", PYTHON, "app.py"]) == 2
    assert "the command goes after `--`" in capfd.readouterr().err
    for bad in ("-1", "nan", "soon"):
        assert cli.main(["run", "--linger", bad, "--", PYTHON, "-c", "pass"]) == 2
        assert (
            f"argument --linger: must be a finite number of seconds >= 0, got {bad!r}"
            in capfd.readouterr().err
        )


@pytest.mark.parametrize("signame, status", [("SIGTERM", 3), ("SIGHUP", 128 + signal.SIGHUP)])
def test_sigterm_and_sighup_reach_the_program(tmp_path, signame, status):
    ready, got = tmp_path / "ready", tmp_path / "got"
    code = textwrap.dedent(
        f"""
        import os, signal, sys, time
        def on_term(signum, frame):
            open({str(got)!r}, "w").write(str(signum)); sys.exit(3)
        signal.signal(signal.SIGTERM, on_term)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        """
    )
    proc, log = supervisor(tmp_path, "--no-metrics", "--", PYTHON, "-c", code)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log_tail(log)
            time.sleep(0.1)
        os.kill(proc.pid, getattr(signal, signame))  # the supervisor only, not its group
        assert proc.wait(timeout=30) == status, log_tail(log)
        if signame == "SIGTERM":
            assert got.read_text() == str(int(signal.SIGTERM))
    finally:
        stop_process(proc, group=True)


# --------------------------------------------------------------------------- instrument() in code


def test_instrument_and_uninstrument_restore_the_loaders_and_the_model(model_dirs, clean_instrumentation):
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.utils

    original = mlx_lm.utils.load_model
    original_compile = mx.compile
    plain, _ = mlx_lm.load(str(model_dirs["qwen"]))
    original_class = type(plain)
    finders = list(sys.meta_path)

    instrumentor = mlx_watchdog.instrument(fix=True)
    assert mlx_watchdog.instrument(fix=True) is instrumentor  # idempotent
    assert mlx_lm.utils.load_model is not original and mlx_lm.utils.load_model.__wrapped__ is original
    assert mx.compile is not original_compile and mx.compile.__wrapped__ is original_compile  # training steps
    model, _ = mlx_lm.load(str(model_dirs["qwen"]))
    assert type(model) is not original_class and isinstance(model, original_class)
    (watchdog,) = instrumentor.watchdogs()
    assert watchdog.name == "qwen3_next-8" and watchdog.fix and watched_state(model).watchdog is watchdog
    assert watchdog in mlx_watchdog.live_watchdogs()

    mlx_watchdog.uninstrument()
    assert mlx_lm.utils.load_model is original and mx.compile is original_compile
    assert type(model) is original_class and watched_state(model) is None
    assert watchdog not in mlx_watchdog.live_watchdogs()
    assert sys.meta_path == finders
    mlx_watchdog.uninstrument()  # twice: nothing to undo


def test_a_model_loaded_to_be_probed_and_dropped_leaves_nothing(model_dirs, clean_instrumentation):
    import mlx_lm.utils

    instrumentor = mlx_watchdog.instrument()
    model, _ = mlx_lm.utils.load_model(Path(model_dirs["llama"]), lazy=True)  # as LM Studio's probe
    (watchdog,) = instrumentor.watchdogs()
    assert watchdog in mlx_watchdog.live_watchdogs()
    del model
    gc.collect()
    assert instrumentor.watchdogs() == []
    assert watchdog not in mlx_watchdog.live_watchdogs()
    registry = CollectorRegistry()
    registry.register(WatchdogCollector())
    assert 'watchdog="llama-4"' not in generate_latest(registry).decode()


def test_models_in_the_hugging_face_cache_are_named_by_repository(
    tmp_path, model_dirs, clean_instrumentation
):
    import mlx_lm

    snapshot = tmp_path / "hub" / "models--mlx-community--Tiny-Qwen-4bit" / "snapshots" / "0123abcd"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(model_dirs["llama"])
    instrumentor = mlx_watchdog.instrument()
    model, _ = mlx_lm.load(str(snapshot))
    assert [wd.name for wd in instrumentor.watchdogs()] == ["mlx-community/Tiny-Qwen-4bit"]


def test_mlx_vlm_text_model_is_the_one_watched(tmp_path, monkeypatch, clean_instrumentation):
    """mlx-vlm's loader (a stand-in package here) returns the model only; what is called per step
    is ``model.language_model``. The module is imported after instrument(): the import hook wraps it."""
    package = tmp_path / "fake" / "mlx_vlm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(
        textwrap.dedent(
            """
            import mlx.nn as nn
            from mlx_watchdog.tiny import build_model

            class Model(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.language_model = build_model("llama", layers=2)

            def load_model(model_path, lazy=False, **kwargs):
                return Model()
            """
        )
    )
    for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    instrumentor = mlx_watchdog.instrument()
    try:
        import mlx_vlm.utils
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        assert mlx_vlm.utils.load_model.__module__ == "mlx_vlm.utils"
        assert hasattr(mlx_vlm.utils.load_model, "__wrapped__")
        model = mlx_vlm.utils.load_model(Path("/models/Qwen2-VL-2B"))
        assert type(model).__name__ == "Model" and watched_state(model) is None
        (watchdog,) = instrumentor.watchdogs()
        assert watched_state(model.language_model).watchdog is watchdog and watchdog.name == "Qwen2-VL-2B"
        import mlx.core as mx

        text = model.language_model
        for _ in zip(
            range(6), generate_step(mx.array([1, 2, 3]), text, prompt_cache=make_prompt_cache(text))
        ):
            pass
        assert watchdog.steps >= 5
        original = mlx_vlm.utils.load_model.__wrapped__
        mlx_watchdog.uninstrument()
        assert mlx_vlm.utils.load_model is original
    finally:
        for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
            del sys.modules[name]


def test_import_hook_wraps_a_module_imported_later_and_goes_away(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import mlx_watchdog
        mlx_watchdog.instrument(stop_within=100)
        assert 'mlx_lm' not in sys.modules
        import mlx_lm.utils
        wrapped = mlx_lm.utils.load_model
        assert wrapped.__wrapped__.__module__ == 'mlx_lm.utils'
        assert mlx_lm.utils.__loader__.__class__.__name__ == 'SourceFileLoader'  # its own loader
        mlx_watchdog.uninstrument()
        assert mlx_lm.utils.load_model is wrapped.__wrapped__
        assert not any(type(f).__module__ == 'mlx_watchdog.attach.loaders' for f in sys.meta_path)
        print('ok')
        """
    )
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout == "ok\n", done.stderr


def test_instrument_checks_its_options_before_patching(clean_instrumentation):
    import mlx_lm.utils

    original = mlx_lm.utils.load_model
    with pytest.raises(ValueError, match="fix_every must be a positive integer"):
        mlx_watchdog.instrument(fix_every=0)
    with pytest.raises(TypeError, match="unexpected option.*name"):
        mlx_watchdog.instrument(name="x")
    assert mlx_lm.utils.load_model is original and loaders.instrumentor() is None


def test_after_a_stop_the_next_forward_is_not_stopped_again_from_stale_readings(
    model_dirs, clean_instrumentation
):
    """The core keeps the growth it measured after a stop: a plain watchdog stops the very next
    forward again (a server that goes on with the same batch, as one does, fails every request
    that joins it). The instrumentor's watchdogs measure afresh after the stop they raised."""
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    from mlx_watchdog import ResourceLimitForecast, Watchdog
    from mlx_watchdog.attach.model import unwatch_model, watch_model

    def stops(model) -> list[int]:
        gen = BatchGenerator(model, max_tokens=1_000_000)
        gen.insert([[5, 6, 7, 8, 9, 10]] * 2)
        stopped = []
        for step in range(60):
            try:
                gen.next_generated()
            except ResourceLimitForecast:
                stopped.append(step)
        gen.close()
        return stopped

    model, _ = mlx_lm.load(str(model_dirs["qwen"]))
    watch_model(model, Watchdog(stop_within=1e9, export=False))
    plain = stops(model)
    unwatch_model(model)
    assert len(plain) > 2 and plain[1] == plain[0] + 1  # stopped again at once

    mlx_watchdog.instrument(stop_within=1e9)
    model, _ = mlx_lm.load(str(model_dirs["qwen"]))
    instrumented = stops(model)
    assert len(instrumented) >= 2  # the leak goes on: stopped again, once measured again
    assert all(b - a >= 2 for a, b in zip(instrumented, instrumented[1:])), instrumented


STOP_APP = textwrap.dedent(
    f"""
    import gc, json, os, statistics, sys, time
    sys.path.insert(0, {str(TESTS)!r})
    try:
        import exact_buffers
        counter, why = exact_buffers.install(), None
    except RuntimeError as exc:
        counter, why = None, str(exc)
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    path, out, release = sys.argv[1:]
    model, _ = load(path)
    gen = BatchGenerator(model, max_tokens=1_000_000)
    gen.insert([[5, 6, 7, 8, 9, 10]] * 2)  # equal lengths: leaks
    live, message = [], None
    for step in range(2000):
        try:
            gen.next_generated()
        except RuntimeError as exc:  # as a server does: the requests fail, the program goes on
            message = str(exc)
            break
        if counter is not None:
            live.append(counter.live())
    gen.close()
    del gen
    gc.collect()  # the batch is gone
    # the exact count's growth per step (a step's blip, a buffer freed late, is not growth)
    slope = statistics.median(b - a for a, b in zip(live, live[1:])) if counter is not None else None
    with open(os.path.join(out, "stop.tmp"), "w") as f:
        json.dump({{"pid": os.getpid(), "slope": slope, "message": message, "why": why}}, f)
    os.replace(os.path.join(out, "stop.tmp"), os.path.join(out, "stop.json"))
    while not os.path.exists(release):
        time.sleep(0.05)
    """
)


def test_after_a_stop_the_merged_endpoint_keeps_its_forecast(tmp_path, model_dirs):
    """``run --limit 800 --stop-within 50``: the program catches the stop and goes on idle, its
    batch gone. The merged endpoint still reads the stop's rate (the exact count's), leak site and
    steps to the limit, and the stop itself, until a new reading replaces them."""
    import mlx.core as mx

    app, out, release = tmp_path / "stop_app.py", tmp_path / "out", tmp_path / "release"
    app.write_text(STOP_APP)
    out.mkdir()
    port = free_port()
    proc, log = supervisor(
        tmp_path, "--metrics-port", port, "--limit", 800, "--stop-within", 50,
        "--", PYTHON, app, model_dirs["qwen"], out, release,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (out / "stop.json").exists():
            assert proc.poll() is None, f"run exited with {proc.returncode}:\n{log_tail(log)}"
            assert time.monotonic() < deadline, f"the program did not report:\n{log_tail(log)}"
            time.sleep(0.2)
        report = json.loads((out / "stop.json").read_text())
        if report["slope"] is None:
            missing(f"the exact live-buffer counter cannot be installed: {report['why']}")
        pid, slope = report["pid"], report["slope"]
        assert slope == LEAK  # the truth: it leaked
        assert report["message"] and "configured 800" in report["message"], report
        assert ("Metal" in report["message"]) == bool(mx.metal.is_available()), report
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:  # the stop, and then idle: nothing steps, nothing measures the growth again
            status, body = http_get(url)
            text = body.decode()
            # The program's snapshot is written every interval: one from before its decode (idle,
            # no stop yet) may still be the one served when the stop is reported.
            stopped = by_pid(text, "mlx_watchdog_stops_total", pid, reason="forecast") == [1.0]
            if stopped and by_pid(text, "mlx_watchdog_decoding", pid) == [0.0]:
                break
            assert time.monotonic() < deadline, f"never idle:\n{text}\n{log_tail(log)}"
            time.sleep(0.5)
        assert by_pid(text, "mlx_watchdog_stops_total", pid, reason="forecast") == [1.0]
        assert by_pid(text, "mlx_watchdog_stop_forecast_held", pid) == [1.0]
        assert by_pid(text, "mlx_watchdog_rate_known", pid) == [1.0]
        assert by_pid(text, "mlx_watchdog_buffers_per_step", pid) == [pytest.approx(slope, abs=0.5)]
        site = {"site": "ArraysCache.left_padding"}
        assert by_pid(text, "mlx_watchdog_leak_buffers_per_step", pid, **site) == [
            pytest.approx(slope, abs=0.5)
        ]
        (steps,) = by_pid(text, "mlx_watchdog_steps_to_limit", pid)
        assert 0 < steps <= 50
        stop = {"reason": "forecast"}
        assert by_pid(text, "mlx_watchdog_last_stop_steps_to_limit", pid, **stop) == [steps]
        assert by_pid(text, "mlx_watchdog_last_stop_leak_buffers_per_step", pid, **stop, **site) == [
            pytest.approx(slope, abs=0.5)
        ]
        (when,) = by_pid(text, "mlx_watchdog_last_stop_timestamp_seconds", pid, **stop)
        assert time.time() - 300 < when < time.time()
        release.write_text("")
        assert proc.wait(timeout=60) == 0, log_tail(log)
    finally:
        release.write_text("")
        stop_process(proc, group=True)


# --------------------------------------------------------------------------- the snapshots


def test_snapshot_writer_writes_on_change_and_removes_its_file(tmp_path):
    from mlx_watchdog import Watchdog

    writer = SnapshotWriter(tmp_path, interval=0.05)
    path = snapshot_path(tmp_path, os.getpid())
    wd = Watchdog(name="snap")
    try:
        assert writer.write() and path.exists()
        assert not writer.write()  # nothing changed
        wd.steps += 1
        assert writer.write()
        text = path.read_text()
        assert text.startswith(f"# mlx-watchdog snapshot pid={os.getpid()} ")
        assert 'mlx_watchdog_steps_total{watchdog="snap"} 1.0' in text
        assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        # a stop, or a caught error, without a step after it: written too
        wd.record_stop("forecast")
        assert writer.write()
        assert 'mlx_watchdog_stops_total{reason="forecast",watchdog="snap"} 1.0' in path.read_text()
        wd.record_internal_error("a test", RuntimeError("caught"))
        assert writer.write()
        assert 'mlx_watchdog_internal_errors_total{watchdog="snap"} 1.0' in path.read_text()
    finally:
        wd.export = False
        writer.stop()
    assert not path.exists()


def test_merged_collector_labels_every_sample_and_drops_dead_processes(tmp_path):
    from mlx_watchdog import Watchdog

    wd = Watchdog(name="merge")
    writer = SnapshotWriter(tmp_path)
    sleeper = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([PYTHON, "-c", "pass"])
    gone.wait()
    try:
        writer.write(force=True)
        mine = snapshot_path(tmp_path, os.getpid()).read_text()
        body = mine.split("\n", 1)[1]
        import psutil

        started = psutil.Process(sleeper.pid).create_time()
        header = f"# mlx-watchdog snapshot pid={sleeper.pid} started={started!r}\n"
        snapshot_path(tmp_path, sleeper.pid).write_text(header + body)
        snapshot_path(tmp_path, gone.pid).write_text(mine.replace(str(os.getpid()), str(gone.pid)))
        (tmp_path / "notes.txt").write_text("not a snapshot")
        registry = CollectorRegistry()
        registry.register(ProcessesCollector(tmp_path, keep_exited=0))
        text = generate_latest(registry).decode()
        steps = samples(text, "mlx_watchdog_steps_total")
        assert sorted(lab["pid"] for lab, _ in steps) == sorted([str(os.getpid()), str(sleeper.pid)])
        assert all(lab["watchdog"] == "merge" for lab, _ in steps)
        assert text.count("# TYPE mlx_watchdog_steps_total counter") == 1  # one family, merged
        assert not snapshot_path(tmp_path, gone.pid).exists()  # a dead process's file is dropped
        assert {lab["pid"] for lab, _ in samples(text, "process_cpu_seconds_total")} == {
            str(os.getpid()),
            str(sleeper.pid),
        }
        # A later process with a dead one's pid is not it: its start time differs.
        snapshot_path(tmp_path, sleeper.pid).write_text(mine.replace(str(os.getpid()), str(sleeper.pid)))
        generate_latest(registry)
        assert not snapshot_path(tmp_path, sleeper.pid).exists()
    finally:
        sleeper.kill()
        sleeper.wait()
        wd.export = False
        writer.stop()


def test_an_exited_process_s_last_snapshot_is_served_a_while_then_removed(tmp_path, monkeypatch):
    """A process writes its last snapshot at exit; the supervisor serves it ``keep_exited`` seconds
    from the scrape that first found the process gone (its process_* metrics no longer), then
    removes it."""
    from mlx_watchdog.exporters import processes

    code = textwrap.dedent(
        f"""
        from mlx_watchdog import Watchdog
        from mlx_watchdog.exporters.processes import SnapshotWriter
        wd = Watchdog(name="exited")
        SnapshotWriter({str(tmp_path)!r}, interval=60).start()  # its first write: no stop yet
        wd.steps += 3
        wd.record_stop("forecast")  # just before the exit: only the last snapshot has it
        """
    )
    child = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".prom"]
    pid = path.stem
    now = [1000.0]
    monkeypatch.setattr(processes.time, "monotonic", lambda: now[0])
    registry = CollectorRegistry()
    registry.register(ProcessesCollector(tmp_path, keep_exited=60))
    for later in (0, 30, 59):
        now[0] = 1000.0 + later
        text = generate_latest(registry).decode()
        assert samples(text, "mlx_watchdog_stops_total") == [
            ({"reason": "forecast", "watchdog": "exited", "pid": pid}, 1.0)
        ]
        assert [v for _, v in samples(text, "mlx_watchdog_steps_total")] == [3.0]
        assert not samples(text, "process_cpu_seconds_total")  # no process to read them from
    now[0] = 1060.0
    text = generate_latest(registry).decode()
    assert not samples(text, "mlx_watchdog_steps_total") and not path.exists()


def test_a_forked_child_exports_inherited_watchdogs_only_once_they_step_there(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, sys, time
        from mlx_watchdog import Watchdog
        from mlx_watchdog.exporters.processes import SnapshotWriter, snapshot_path
        folder = {str(tmp_path)!r}
        wd = Watchdog(name="inherited")
        writer = SnapshotWriter(folder, interval=0.05).start()
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            time.sleep(0.5)
            hidden = not snapshot_path(folder, os.getpid()).exists() and not wd.export
            wd.steps += 1  # it steps here: this process exports it now
            time.sleep(0.5)
            shown = snapshot_path(folder, os.getpid()).exists() and wd.export
            print("child", hidden, shown, flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", snapshot_path(folder, os.getpid()).exists() and wd.export, flush=True)
        """
    )
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert sorted(done.stdout.split("\n")[:2]) == ["child True True", "parent True"], done.stderr


# --------------------------------------------------------------------------- metrics endpoint options


def test_run_serves_its_metrics_over_tls(tmp_path):
    from support import find_binary

    openssl = find_binary("openssl")
    if openssl is None:
        missing("openssl NOT INSTALLED: the TLS test cannot run")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=run", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    import ssl

    port = free_port()
    proc, log = supervisor(
        tmp_path, "--metrics-port", port, "--metrics-certfile", cert, "--metrics-keyfile", key,
        "--", PYTHON, "-c", "import time; time.sleep(30)",
    )  # fmt: skip
    try:
        url = f"https://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _ = http_get(url, timeout=2, context=ssl.create_default_context(cafile=str(cert)))
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log_tail(log)
                time.sleep(0.2)
        assert status == 200
        assert f"metrics of every process at {url}" in log.read_text()
        with pytest.raises(OSError):
            http_get(url.replace("https", "http"), timeout=3)
    finally:
        stop_process(proc)  # SIGTERM, passed on: the run ends and cleans up
        stop_process(proc, group=True)


def test_serve_has_the_tls_options_too():
    from mlx_watchdog.commands import serve

    args, _ = serve.parse_args(
        ["--metrics-certfile", "c.pem", "--metrics-keyfile", "k.pem", "--", "--model", "m"]
    )
    assert (args.metrics_certfile, args.metrics_keyfile, args.metrics_client_cafile) == (
        "c.pem",
        "k.pem",
        None,
    )


def test_run_takes_serves_watchdog_options(tmp_path):
    parser = cli.build_parser(load_serve=False, load_run=True)
    args = parser.parse_args(
        ["run", "--fix", "--fix-every", "4", "--limit", "1000", "--warn-within", "10", "--stop-within", "5",
         "--overhead-budget", "0.05", "--walk-interval", "0", "--process-count", "on", "--census", "off",
         "--metrics-port", "0"]
    )  # fmt: skip
    from mlx_watchdog.commands.watch_options import watchdog_options

    assert watchdog_options(args) == {
        "limit": 1000,
        "fix": True,
        "fix_every": 4,
        "warn_within": 10.0,
        "stop_within": 5.0,
        "overhead_budget": 0.05,
        "walk_interval": 0.0,
        "process_count": True,
        "census": False,
    }
