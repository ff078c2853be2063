"""pytest plugin for tests/test_mlx_lm_suite.py: runs inside mlx-lm's own test suite.

Loaded with ``-p mlx_lm_suite_plugin``. Both runs (plain and watched) import every
``mlx_lm.models.<name>`` module up front, so the only difference between them is the watch.
With ``MLX_WATCHDOG_SUITE_WATCH=1`` each model class's ``__init__`` is wrapped: when the
outermost construction of a model returns, ``watch_model(model, Watchdog(fix=True))`` runs.
At the end the outcome of every test and subtest, the watchdog counters and the peak RSS
are written as JSON to ``MLX_WATCHDOG_SUITE_REPORT``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import pkgutil
import resource
import threading

WATCH = os.environ.get("MLX_WATCHDOG_SUITE_WATCH") == "1"
REPORT = os.environ.get("MLX_WATCHDOG_SUITE_REPORT")

_outcomes: dict[str, str] = {}
_watchdogs: list = []  # strong references: the counters are read at the end
_watched_types: dict[str, int] = {}
_import_failures: dict[str, str] = {}
_construction = threading.local()  # depth of nested model __init__ calls


def _model_classes():
    import mlx_lm.models

    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        name = f"mlx_lm.models.{info.name}"
        try:
            module = importlib.import_module(name)
        except BaseException as exc:  # olmo calls sys.exit(1) without ai2-olmo
            _import_failures[name] = repr(exc)
            continue
        cls = getattr(module, "Model", None)
        # Aliases (solar_open.Model is glm4_moe.Model) are wrapped once, where they are defined.
        if inspect.isclass(cls) and cls.__module__ == name:
            yield cls


def _wrap_init(cls) -> None:
    from mlx_watchdog import Watchdog
    from mlx_watchdog.attach.model import watch_model

    original = cls.__init__  # its own, or the one it inherits (qwen3_5_moe's is qwen3_5's)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        # A subclass's __init__ calls its parent's, and a model may build another model
        # inside: only the outermost construction watches, once the object is complete.
        depth = getattr(_construction, "depth", 0)
        _construction.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _construction.depth = depth
        if depth == 0:
            watchdog = Watchdog(fix=True)
            watch_model(self, watchdog)
            _watchdogs.append(watchdog)
            key = type(self).__module__.rsplit(".", 1)[-1]
            _watched_types[key] = _watched_types.get(key, 0) + 1

    cls.__init__ = __init__


def pytest_configure(config):
    for cls in list(_model_classes()):
        if WATCH:
            _wrap_init(cls)


def pytest_runtest_logreport(report):
    context = getattr(report, "context", None)  # pytest's SubtestReport
    if context is not None:
        _outcomes[f"{report.nodeid} {report._sub_test_description()}"] = report.outcome
        return
    # One test's outcome over its phases: failed beats skipped beats passed.
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    previous = _outcomes.get(report.nodeid, "passed")
    _outcomes[report.nodeid] = max(previous, report.outcome, key=rank.__getitem__)


def pytest_unconfigure(config):
    if not REPORT:
        return
    import mlx_lm

    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {
        "watch": WATCH,
        "mlx_lm_file": mlx_lm.__file__,
        "outcomes": _outcomes,
        "watched_models": len(_watchdogs),
        "watched_types": _watched_types,
        "observed_steps": sum(wd.steps for wd in _watchdogs),
        "walks": sum(wd.walks for wd in _watchdogs),
        "materialized_arrays": sum(wd.materialized_arrays for wd in _watchdogs),
        "internal_errors": sum(wd.internal_errors for wd in _watchdogs),
        "import_failures": _import_failures,
        "max_rss_kb": usage.ru_maxrss,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
    }
    with open(REPORT, "w") as f:
        json.dump(report, f, indent=1)
