"""The program's side of ``mlx-watchdog run``: what each of its Python processes does at start.

``sitecustomize.py`` (this folder is put first on the program's PYTHONPATH) calls :func:`start`
with the run's configuration, read from the ``MLX_WATCHDOG_RUN`` variable (JSON: the watchdog
options, the run's state folder, whether metrics are served). :func:`start` instruments the
process (``mlx_watchdog.attach.loaders``: the loaders, and ``mx.compile`` for the training steps,
whose stop ends the process with ``EXIT_STOPPED`` once the adapters are saved); at the first model
watched it prints one line and
starts the process's snapshot writer (``mlx_watchdog.exporters.processes``), which the supervisor
merges into its /metrics. Importing this module imports the standard library and the
instrumentor only: MLX and the core come with the program's own import of mlx-lm or mlx-vlm.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from ..attach.loaders import instrument

ENV = "MLX_WATCHDOG_RUN"  # sitecustomize.py spells it too: it runs before mlx_watchdog is importable
HELLO_PREFIX = "hello-"  # <state>/hello-<pid>, written by sitecustomize.py
FOLDER = os.path.dirname(os.path.abspath(__file__))  # what goes first on PYTHONPATH

_lock = threading.Lock()
_writer: Any = None


def configuration(options: dict[str, Any], state: str, *, metrics: bool = True, interval: float = 1.0) -> str:
    """The value of ``MLX_WATCHDOG_RUN``: JSON the bootstrap of every process reads."""
    return json.dumps({"options": options, "state": state, "metrics": metrics, "interval": interval})


def environment(base: dict[str, str], config: str) -> dict[str, str]:
    """``base`` with this folder first on PYTHONPATH and ``MLX_WATCHDOG_RUN`` set. An empty or unset
    PYTHONPATH adds nothing else (an empty entry would put the working directory on sys.path)."""
    env = dict(base)
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([FOLDER, existing]) if existing else FOLDER
    env[ENV] = config
    return env


def start(config: dict[str, Any]) -> None:
    """Instrument this process as ``config`` (the decoded ``MLX_WATCHDOG_RUN``) says."""
    options = dict(config.get("options") or {})
    state = config.get("state")
    metrics = bool(config.get("metrics", True)) and bool(state)
    interval = float(config.get("interval", 1.0))

    def on_watch(model: Any, watchdog: Any) -> None:
        sys.stderr.write(f"mlx-watchdog run: watching {watchdog.name} (pid {os.getpid()})\n")
        if metrics:
            _start_writer(str(state), interval)

    instrument(on_watch=on_watch, exit_on_training_stop=True, **options)


def _start_writer(state: str, interval: float) -> None:
    global _writer
    with _lock:
        if _writer is None:
            from ..exporters.processes import SnapshotWriter

            _writer = SnapshotWriter(state, interval=interval)
        _writer.start()  # again after a fork: the child's thread
