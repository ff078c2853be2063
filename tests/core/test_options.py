"""The options record (``core/options.py``): every option checked once, where it is built, with
errors that name the option; the command line, ``instrument()``, ``@watch`` and serve's hooks
build the same record, so they refuse the same values, and none of them makes a watchdog (or
imports MLX) to check them."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.commands import watch_options
from mlx_watchdog.core.options import DEFAULT_METRICS_PORT, WatchdogOptions, flag

# Bad values of each option, and why each is bad.
BAD = {
    "limit": [0, -5, 1.5, "100", True, math.nan],
    "name": ["", "  ", ["a"], 3],
    "fix": ["false", 1, None],
    "fix_every": [0, -1, 2.0, "4", False],
    "warn_within": [-1, math.nan, math.inf, True, "10"],
    "stop_within": [-0.5, math.nan, -math.inf, False, "0"],
    "on_forecast": ["print", 42],
    "overhead_budget": [0, 1.5, -0.1, math.nan, True, "0.01"],
    "walk_interval": [-1, math.inf, math.nan, True, "0.5"],
    "export": ["false", None, 0],
    "max_objects": [0, -3, 1e5, "100"],
    "max_depth": [0, 2.5, True],
    "process_count": ["on", "yes", 1, None],
    "census": ["off", "no", 0, None],
}


def test_every_option_has_bad_values_here():
    assert set(BAD) == {field.name for field in dataclasses.fields(WatchdogOptions)}


@pytest.mark.parametrize("option, bad", [(option, bad) for option, values in BAD.items() for bad in values])
def test_a_bad_value_is_refused_naming_the_option_and_the_value(option, bad):
    with pytest.raises(ValueError) as refused:
        WatchdogOptions(**{option: bad})
    message = str(refused.value)
    assert message.startswith(f"{option} must be ") and message.endswith(f"got {bad!r}")
    with pytest.raises(ValueError) as flagged:
        WatchdogOptions(**{option: bad}, flags=True)
    assert str(flagged.value) == message.replace(option, flag(option), 1)


def test_values_come_out_normalized():
    import numpy as np

    options = WatchdogOptions(
        limit=np.int64(1000),
        fix=np.bool_(True),
        fix_every=np.int32(4),
        warn_within=7,
        stop_within=np.float32(2.5),
        overhead_budget=1,
        walk_interval=0,
        process_count=np.bool_(False),
    )
    assert (options.limit, options.fix, options.fix_every, options.process_count) == (1000, True, 4, False)
    assert [type(v) for v in (options.limit, options.fix, options.fix_every, options.process_count)] == [
        int,
        bool,
        int,
        bool,
    ]
    assert (options.warn_within, options.stop_within, options.overhead_budget, options.walk_interval) == (
        7.0,
        2.5,
        1.0,
        0.0,
    )
    assert all(
        type(v) is float for v in (options.warn_within, options.overhead_budget, options.walk_interval)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.fix = False  # type: ignore[misc]


def test_keywords_are_the_options_that_differ_from_the_defaults():
    assert WatchdogOptions().keywords() == {}
    options = WatchdogOptions(fix=True, fix_every=16, stop_within=0, name="m")
    assert options.keywords() == {"fix": True, "stop_within": 0.0, "name": "m"}
    assert WatchdogOptions(**options.keywords()) == options


def test_the_watchdog_s_defaults_are_the_record_s():
    from mlx_watchdog import Watchdog

    signature = inspect.signature(Watchdog).parameters
    for field in dataclasses.fields(WatchdogOptions):
        assert signature[field.name].default == field.default, field.name
    assert set(signature) - {field.name for field in dataclasses.fields(WatchdogOptions)} == {"model"}
    assert watch_options.DEFAULTS == {f.name: f.default for f in dataclasses.fields(WatchdogOptions)}


@pytest.mark.parametrize("option, bad", [(option, values[0]) for option, values in BAD.items()])
def test_the_watchdog_refuses_what_the_record_refuses(option, bad):
    from mlx_watchdog import Watchdog

    with pytest.raises(ValueError) as refused:
        WatchdogOptions(**{option: bad})
    with pytest.raises(ValueError) as by_watchdog:
        Watchdog(**{option: bad})
    assert str(by_watchdog.value) == str(refused.value)


# --------------------------------------------------------------------------- the command line

# The flags that take a number: argparse's conversion of their text.
NUMERIC = {
    "limit": int,
    "fix_every": int,
    "warn_within": float,
    "stop_within": float,
    "overhead_budget": float,
    "walk_interval": float,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    watch_options.add_watchdog_arguments(parser, "stop")
    return parser


def _command_line_takes(option: str, text: str) -> bool:
    try:
        _parser().parse_args([flag(option), text])
    except SystemExit:
        return False
    return True


def _namespace_takes(option: str, value) -> bool:
    args = argparse.Namespace(**vars(_parser().parse_args([])), no_metrics=True)
    setattr(args, option, value)
    try:
        watch_options.watchdog_options(args)
    except ValueError as exc:
        assert str(exc).startswith(f"{flag(option)} must be "), exc
        return False
    return True


def _python_takes(option: str, value) -> bool:
    try:
        WatchdogOptions(**{option: value})
    except ValueError:
        return False
    return True


NUMBERS = st.one_of(
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.0, -0.0, 0.5, 1.0, 2.0, 1.5, math.inf, -math.inf, math.nan]),
)


@pytest.mark.parametrize("option", NUMERIC)
@settings(max_examples=150, deadline=None)
@given(value=NUMBERS)
def test_the_command_line_and_python_refuse_the_same_values(option, value):
    python = _python_takes(option, value)
    assert _namespace_takes(option, value) == python  # serve's Namespace path
    text = repr(value)
    try:
        converted = NUMERIC[option](text)
    except ValueError:  # no number of the flag's kind: argparse refuses the text...
        assert not _command_line_takes(option, text)
        assert not python  # ...and Python the value (a float where a whole number is wanted)
        return
    assert _command_line_takes(option, text) == _python_takes(option, converted)
    if converted == value and type(converted) is type(value):
        assert _command_line_takes(option, text) == python


def test_the_command_line_s_options_are_the_record_s():
    args = _parser().parse_args(
        ["--fix", "--fix-every", "3", "--limit", "900", "--stop-within", "4", "--process-count", "on"]
    )
    options = watch_options.watchdog_options(args)
    assert WatchdogOptions(**options) == WatchdogOptions(
        fix=True, fix_every=3, limit=900, stop_within=4, process_count=True
    )


@pytest.mark.parametrize("option, bad", [("fix", "yes"), ("process_count", "maybe"), ("limit", 0)])
def test_a_namespace_s_bad_value_names_the_flag(option, bad):
    assert not _namespace_takes(option, bad)


def test_the_default_port_is_written_once():
    from mlx_watchdog.commands import demo
    from mlx_watchdog.exporters import prometheus

    assert DEFAULT_METRICS_PORT == 9464
    assert watch_options.DEFAULT_METRICS_PORT is DEFAULT_METRICS_PORT
    assert prometheus.DEFAULT_PORT == DEFAULT_METRICS_PORT
    assert demo.DEFAULT_METRICS_PORT is DEFAULT_METRICS_PORT


# --------------------------------------------------------------------------- no watchdog made to check


@pytest.fixture
def no_watchdog(monkeypatch):
    """A watchdog made from here on fails the test."""
    from mlx_watchdog import Watchdog, live_watchdogs

    before = len(live_watchdogs(unexported=True))

    def refuse(self, *args, **kwargs):
        raise AssertionError("a Watchdog was made to check options")

    monkeypatch.setattr(Watchdog, "__init__", refuse)
    yield
    assert len(live_watchdogs(unexported=True)) == before


def test_watch_checks_its_options_without_a_watchdog(no_watchdog):
    from mlx_watchdog import watch

    decorate = watch(fix=True, fix_every=4, stop_within=10, walk_interval=0)  # no watchdog yet
    assert callable(decorate)
    with pytest.raises(ValueError, match="fix_every"):
        watch(fix_every=0)
    with pytest.raises(ValueError, match="on_forecast"):
        watch(on_forecast="print")
    with pytest.raises(TypeError, match="no_such_option"):
        watch(no_such_option=1)


def test_server_hooks_check_their_options_without_a_watchdog(no_watchdog):
    from mlx_watchdog.attach.server import ServerHooks

    with pytest.raises(ValueError, match="overhead_budget"):
        ServerHooks({"overhead_budget": 2.0}, server_module=object())
    mlx_lm_server = pytest.importorskip("mlx_lm.server")
    hooks = ServerHooks({"fix": True, "stop_within": 50.0}, server_module=mlx_lm_server)
    assert not hooks.attached


def test_options_are_checked_before_mlx_is_imported():
    # instrument() checks its options in a process that has not imported MLX (mlx-watchdog run's
    # bootstrap): the record, and with it the check, imports nothing of MLX or of the core.
    code = (
        "import sys\n"
        "from mlx_watchdog.core.options import WatchdogOptions\n"
        "import mlx_watchdog\n"
        "WatchdogOptions(fix=True, limit=10, stop_within=5)\n"
        "try:\n"
        "    mlx_watchdog.instrument(fix_every=0)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_watchdog.core.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "fix_every must be a positive integer, got 0",
        "['mlx_watchdog.core.options']",
    ]
