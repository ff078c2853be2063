"""mlx-lm's own model test suite gives the same results with every model watched.

``tests/test_models.py`` from mlx-lm's PyPI source distribution (``make sdist`` puts it in
``$MLX_LM_SDIST``, default ``.cache/mlx-lm-sdist``) builds over a hundred architectures from
``ModelArgs``, calls them with and without caches, deep-copies them and checks dtypes and
shapes. It runs twice in subprocesses, plain and with every model wrapped by
``watch_model(model, Watchdog(fix=True))`` (see ``mlx_lm_suite_plugin.py``), and every test
and subtest must end the same way. Some of its tests build full-size default configurations
lazily and never evaluate them: a watchdog that computed what the program never asked for
would run the machine out of memory, so the resident memory of both runs is bounded here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
MLX_LM_VERSION = importlib.metadata.version("mlx-lm")
SDIST = Path(os.environ.get("MLX_LM_SDIST", ROOT / ".cache" / "mlx-lm-sdist"))
if not SDIST.is_absolute():
    SDIST = ROOT / SDIST
SUITE = SDIST / f"mlx_lm-{MLX_LM_VERSION}" / "tests" / "test_models.py"

RUN_TIMEOUT_S = 600
# Both runs peak near 0.65 GB here; evaluating the suite's lazily built full-size models
# (tens of billions of parameters) would take far more.
MAX_RSS_BYTES = 6 * 2**30
MIN_WATCHED_MODELS = 100


def _suite_path() -> Path:
    if SUITE.is_file():
        return SUITE
    message = (
        f"mlx-lm {MLX_LM_VERSION} source distribution not found at {SUITE}: "
        f"run `make sdist` (MLX_LM_SDIST={SDIST})"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    print(f"\nSKIPPING mlx-lm suite comparison: {message}", file=sys.stderr)
    pytest.skip(message)


class _Run:
    """One pytest subprocess over the suite, with its peak resident memory sampled."""

    def __init__(self, suite: Path, workdir: Path, watch: bool):
        self.watch = watch
        self.report_path = workdir / f"report-{'watched' if watch else 'plain'}.json"
        self.log_path = workdir / f"log-{'watched' if watch else 'plain'}.txt"
        ini = workdir / "pytest.ini"  # keeps this project's pytest settings out of the suite
        ini.write_text("[pytest]\n")
        env = dict(os.environ)
        env.update(
            MLX_WATCHDOG_SUITE_WATCH="1" if watch else "0",
            MLX_WATCHDOG_SUITE_REPORT=str(self.report_path),
            PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])),
            HF_HUB_OFFLINE="1",
        )
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "mlx_lm_suite_plugin",
            "-c",
            str(ini),
            "--rootdir",
            str(suite.parent),
            "--confcutdir",
            str(suite.parent),  # no conftest.py of this project above the sdist
            str(suite),
        ]
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        # cwd is a scratch folder: `python -m pytest` puts cwd on sys.path, and the sdist's
        # root holds an `mlx_lm` source tree that must not shadow the installed package.
        self.process = subprocess.Popen(
            command, cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.peak_rss = 0
        self.killed_for_memory = False
        self.seconds = None
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        try:
            proc = psutil.Process(self.process.pid)
            while self.process.poll() is None:
                rss = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
                self.peak_rss = max(self.peak_rss, rss)
                if rss > MAX_RSS_BYTES:
                    self.killed_for_memory = True
                    self.process.kill()
                    return
                time.sleep(0.2)
        except psutil.Error:
            pass  # the process ended between two samples

    def wait(self) -> dict:
        try:
            self.process.wait(timeout=RUN_TIMEOUT_S - (time.monotonic() - self.started))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"{self.name} run of mlx-lm's suite exceeded {RUN_TIMEOUT_S} s:\n{self.tail()}")
        finally:
            self.seconds = time.monotonic() - self.started
            self._sampler.join(timeout=5)
            self.log.close()
        assert not self.killed_for_memory, (
            f"{self.name} run of mlx-lm's suite went over {MAX_RSS_BYTES / 2**30:.0f} GiB resident "
            f"(something evaluated the lazily built full-size models)"
        )
        assert self.report_path.is_file(), f"{self.name} run wrote no report:\n{self.tail()}"
        return json.loads(self.report_path.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if not self.log.closed:
            self.log.close()

    @property
    def name(self) -> str:
        return "watched" if self.watch else "plain"

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def suite_runs(tmp_path):
    suite = _suite_path()
    runs = []
    try:
        # Concurrently: the suite leaves a core idle much of the time.
        for watch in (False, True):
            workdir = tmp_path / ("watched" if watch else "plain")
            workdir.mkdir()
            runs.append(_Run(suite, workdir, watch))
        yield runs
    finally:
        for run in runs:
            run.stop()


def test_mlx_lm_model_suite_same_results_when_watched(suite_runs):
    plain_run, watched_run = suite_runs
    plain, watched = plain_run.wait(), watched_run.wait()
    summary = (
        f"plain: {plain_run.seconds:.1f} s ({plain['cpu_seconds']:.1f} s CPU), peak RSS {plain_run.peak_rss / 2**20:.0f} MiB "
        f"(ru_maxrss {plain['max_rss_kb'] / 1024:.0f} MiB); "
        f"watched: {watched_run.seconds:.1f} s ({watched['cpu_seconds']:.1f} s CPU), peak RSS {watched_run.peak_rss / 2**20:.0f} MiB "
        f"(ru_maxrss {watched['max_rss_kb'] / 1024:.0f} MiB); "
        f"{watched['watched_models']} models watched, {watched['observed_steps']} steps observed, "
        f"{watched['walks']} walks, {watched['materialized_arrays']} arrays materialized"
    )
    print("\nmlx-lm suite:", summary)

    import mlx_lm

    # The suite tested the installed mlx-lm, not the source tree next to it in the sdist.
    assert plain["mlx_lm_file"] == watched["mlx_lm_file"] == mlx_lm.__file__
    assert plain["outcomes"], f"the plain run collected no tests:\n{plain_run.tail()}"
    assert plain["watched_models"] == 0
    # The wrapping really happened: the suite's models were watched and their cached calls observed.
    assert watched["watched_models"] >= MIN_WATCHED_MODELS, summary
    assert len(watched["watched_types"]) >= MIN_WATCHED_MODELS, sorted(watched["watched_types"])
    assert watched["observed_steps"] >= watched["watched_models"], summary
    assert watched["internal_errors"] == 0, f"the watchdog hit internal errors: {summary}"

    # Exactly the same outcome for every test and subtest id.
    assert set(watched["outcomes"]) == set(plain["outcomes"]), (
        f"only plain: {sorted(set(plain['outcomes']) - set(watched['outcomes']))}; "
        f"only watched: {sorted(set(watched['outcomes']) - set(plain['outcomes']))}"
    )
    changed = {
        test: (plain["outcomes"][test], outcome)
        for test, outcome in watched["outcomes"].items()
        if plain["outcomes"][test] != outcome
    }
    assert not changed, f"outcomes changed by watching (plain, watched): {changed}\n{watched_run.tail()}"
