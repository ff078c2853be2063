"""Fixtures shared by the test files. A test file that defines a fixture of the same name uses its
own (pytest's nearest definition wins).

pyproject.toml puts tests/ on sys.path (pytest's ``pythonpath``) for this file and the test files
of every folder below (tests/core/, tests/attach/, ...): ``import support``, ``import
exact_buffers`` work from all of them. mlx_watchdog is imported inside the fixtures, not here:
a test file decides what is imported first (environment variables set before mlx-lm loads, the
distributed tests' order of imports).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import FakeClock, exact_counter

# The suite reads the walk of the caches alone unless a test asks for the process-wide count
# (process_count=True, or this variable set to auto or on, in tests/core/test_process_count.py): many
# tests keep an array a step of their own (tokens, log-probabilities to compare), which that count
# reads, rightly, as growth. MLX_WATCHDOG_PROCESS_COUNT=auto make test runs them all with it.
os.environ.setdefault("MLX_WATCHDOG_PROCESS_COUNT", "off")
# The same for the census of the program's objects outside the caches (census=True, or this
# variable set to auto or on, in tests/core/test_census.py): tests keep lazy arrays of their own on
# objects (test_process_count.py's scheduler reads as unattributed growth there, on purpose), and a
# census at each watchdog's first walks costs the suite a pass over its objects each.
os.environ.setdefault("MLX_WATCHDOG_CENSUS", "off")

# The server tests' model: its folder's name is the watchdog's name in their metrics.
SERVED_MODEL = "tiny-qwen3-next"
SERVED_LAYERS = 8  # 6 of them linear attention: 5 buffers leaked per batched step


@pytest.fixture(scope="session")
def counter():
    """The exact live-buffer counter (tests/exact_buffers.py), the truth readings are checked
    against. Process-wide once installed; skips loudly (fails under CI=true) where it cannot be.
    Session-scoped, so a test that asks for it and for a module's model gets the counter first."""
    return exact_counter()


@pytest.fixture
def fake_clock(monkeypatch):
    """The watchdog's wall and CPU clocks, moved by the test alone (support.FakeClock)."""
    return FakeClock().install(monkeypatch)


@pytest.fixture(scope="module")
def _hybrid12():
    from mlx_watchdog.tiny import build_model

    # 12 layers, full attention every 4th: 9 linear-attention layers -> 8 leaked buffers/step.
    return build_model("qwen3_next", layers=12, full_attention_interval=4)


@pytest.fixture
def hybrid(_hybrid12):
    """The tiny hybrid model (built once per module), unwatched after each test."""
    from mlx_watchdog.attach.model import unwatch_model

    yield _hybrid12
    unwatch_model(_hybrid12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The server tests' model folder: tiny random-weight qwen3_next, SERVED_LAYERS layers."""
    from mlx_watchdog.tiny import save_model_dir

    return save_model_dir(tmp_path_factory.mktemp("model") / SERVED_MODEL, "qwen3_next", layers=SERVED_LAYERS)


@pytest.fixture
def start_server(request, model_dir, tmp_path):
    """``start(*watchdog_args, **options)``: a running server of the test module's ``SERVER``
    class on ``model_dir``, made as ``SERVER(model_dir, tmp_path, list(watchdog_args),
    **options)``; every server started is stopped after the test."""
    server_class = getattr(request.module, "SERVER", None)
    if server_class is None:
        pytest.fail(f"{request.module.__name__} uses start_server but names no SERVER class")
    started = []

    def start(*watchdog_args: str, **options):
        served = server_class(model_dir, tmp_path, list(watchdog_args), **options)
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()
