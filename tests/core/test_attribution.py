"""Source attribution: the line that rebinds a leaking attribute, found by a one-step probe that
gives the class back exactly what it had.

The truths: the exact live-buffer count (the rate), the layers of the model (how many caches
leak), and mlx-lm's own source text at the line the probe names."""

from __future__ import annotations

import gc
import linecache
import logging
import re
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import ArraysCache

from mlx_watchdog import Watchdog
from mlx_watchdog.attach.model import unwatch_model, watch_model
from mlx_watchdog.core import attribution
from mlx_watchdog.core.forecast import Forecast, Leak
from mlx_watchdog.tiny import build_model, tiny_prompts

ADVANCE = re.compile(r"^mlx_lm/models/cache\.py:(\d+) ArraysCache\.advance$")


def _source_line(source: str) -> str:
    """The text of the line a source names, read from the installed file."""
    where, _ = source.split(" ", 1)
    path, line = where.rsplit(":", 1)
    filename = mlx_cache.__file__ if path == "mlx_lm/models/cache.py" else path
    return linecache.getline(filename, int(line)).strip()


def _batched(model, watchdog, steps, on_step=None):
    watch_model(model, watchdog)
    generator = BatchGenerator(model, max_tokens=steps)
    generator.insert(tiny_prompts(2, 6, seed=3))
    try:
        while generator.next_generated():
            if on_step is not None:
                on_step()
    finally:
        generator.close()
        unwatch_model(model)


@pytest.fixture(autouse=True)
def _collect():
    # Models and watchdogs die in reference cycles: their buffers go now, not in a later test's
    # count (the exact counter is process-wide once installed).
    yield
    gc.collect()


def test_the_batched_leak_is_traced_to_arrays_cache_advance(counter):
    model = build_model("qwen3_next", layers=8)
    leaking = sum(isinstance(c, ArraysCache) for c in model.make_cache()) - 1  # the linear layers less one
    _batched(model, Watchdog(export=False), 8)  # unwatched-equivalent warm-up: mlx-lm's own one-offs
    before = dict(vars(ArraysCache))
    attached = []  # per reading: is a probe on the class?
    wd = Watchdog(export=False, on_forecast=lambda f: attached.append("__setattr__" in vars(ArraysCache)))
    truth = []
    _batched(
        model,
        wd,
        80,
        on_step=lambda: wd.steps in (30, 70) and truth.append((wd.steps, counter.live(collect=True))),
    )
    f = wd.forecast()
    (s0, n0), (s1, n1) = truth
    assert (n1 - n0) / (s1 - s0) == pytest.approx(leaking, abs=0.05)  # the leak is real
    assert f.leaks[0].site == "ArraysCache.left_padding"
    assert f.leaks[0].buffers_per_step == pytest.approx(leaking, abs=0.05)
    match = ADVANCE.match(f.leaks[0].source or "")
    assert match, f.leaks[0].source
    assert _source_line(f.leaks[0].source) == "self.left_padding -= N"
    assert f.leaks[0].source in f.describe()
    # One probe, for one reading's step, and the class is given back exactly what it had.
    assert sum(attached) == 1 and not attached[-1]
    assert dict(vars(ArraysCache)) == before


def test_the_warning_log_names_the_source_line(caplog):
    model = build_model("qwen3_next", layers=8)
    wd = Watchdog(export=False, warn_within=10**9)
    with caplog.at_level(logging.WARNING, logger="mlx_watchdog"):
        _batched(model, wd, 60)
    warnings = [r.getMessage() for r in caplog.records if "resource limit forecast" in r.getMessage()]
    assert warnings and "ArraysCache.advance" in warnings[-1]


def test_a_leak_free_decode_probes_nothing():
    model = build_model("llama", layers=4)
    wd = Watchdog(export=False)
    probed = []
    _batched(model, wd, 40, on_step=lambda: probed.append(bool(wd._attribution._probes)))
    assert wd.forecast().leaks == () and not any(probed)


# --------------------------------------------------------------------------- the probe alone


class Slotted:
    __slots__ = ("x", "y")


class OwnSetattr:
    def __setattr__(self, name, value):
        object.__setattr__(self, name, ("seen", value))


class WithProperty:
    def __init__(self):
        self._x = None

    @property
    def x(self):
        return self._x

    @x.setter
    def x(self, value):
        self._x = value


def _pending():
    return mx.array(1) + 1  # not evaluated: what a lazy chain grows by


@pytest.mark.parametrize("cls", [Slotted, OwnSetattr, WithProperty])
def test_the_probe_sees_one_step_and_restores_the_class(cls):
    before = dict(vars(cls))
    a, b = cls(), cls()
    probe = attribution.SetattrProbe(cls, "x")
    assert probe.attach() and "__setattr__" in vars(cls)
    a.y = _pending() if cls is Slotted else 1  # another attribute: not noted
    a.x = 3  # not an array: not noted
    a.x = _pending()
    line = sys._getframe().f_lineno - 1  # the line above: the one the probe must name
    b.x = _pending()
    assert probe.attached  # two instances, once each: the step goes on
    a.x = _pending()  # the first one again: the next step, the probe ends itself
    assert not probe.attached
    assert dict(vars(cls)) == before  # exactly what it had: its own __setattr__ or none
    assert probe.source.endswith(
        f"test_attribution.py:{line} test_the_probe_sees_one_step_and_restores_the_class"
    )
    assert probe.records[probe.source] == 1 and sum(probe.records.values()) == 2
    if cls is OwnSetattr:
        assert a.__dict__["x"][0] == "seen"  # the class's own __setattr__ still ran, and runs now
    elif cls is WithProperty:
        assert isinstance(a._x, mx.array)
    probe.detach()  # idempotent
    assert dict(vars(cls)) == before


def test_two_probes_never_stack_on_one_class():
    before = dict(vars(Slotted))
    first, second = attribution.SetattrProbe(Slotted, "x"), attribution.SetattrProbe(Slotted, "y")
    assert first.attach() and not second.attach() and second.busy
    first.detach()
    assert dict(vars(Slotted)) == before
    assert second.attach()
    second.detach()
    assert dict(vars(Slotted)) == before


def test_a_builtin_type_gets_no_probe():
    probe = attribution.SetattrProbe(mx.array, "x")
    assert not probe.attach() and probe.error
    assert "__setattr__" not in vars(mx.array)


def test_a_dead_attribution_gives_the_class_back():
    before = dict(vars(WithProperty))
    att = attribution.Attribution()
    probe = attribution.SetattrProbe(WithProperty, "x", on_done=attribution.weakref.WeakMethod(att._done))
    assert probe.attach()
    att._probes.append(probe)
    del att, probe
    gc.collect()
    assert dict(vars(WithProperty)) == before


def test_leaks_keep_their_fields_and_gain_a_source():
    old = Leak("ArraysCache.left_padding", ("[0].left_padding",), 5.0, 10)
    assert old.source is None and old.cut is False
    new = Leak(
        "ArraysCache.left_padding",
        ("[0].left_padding",),
        5.0,
        10,
        source="mlx_lm/models/cache.py:685 ArraysCache.advance",
    )
    f = Forecast(
        step=10,
        resident_buffers=100,
        limit=1000,
        buffers_per_step=5.0,
        steps_to_limit=180,
        seconds_to_limit=1.0,
        leaks=(new,),
    )
    assert "[mlx_lm/models/cache.py:685 ArraysCache.advance]" in f.describe()
    assert attribution.short_path(mlx_cache.__file__) == "mlx_lm/models/cache.py"


def test_diagnose_reports_the_source_line(tmp_path, capsys):
    import json

    from mlx_watchdog import tiny
    from mlx_watchdog.commands import main as cli

    model_dir = tiny.save_model_dir(tmp_path / "hybrid", "qwen3_next", layers=8)
    assert cli.main(["diagnose", "--model", str(model_dir), "-m", "40", "--path", "batched", "--json"]) == 1
    leak = json.loads(capsys.readouterr().out)["runs"][0]["leaks"][0]
    assert leak["site"] == "ArraysCache.left_padding" and ADVANCE.match(leak["source"]), leak
    assert cli.main(["diagnose", "--model", str(model_dir), "-m", "40", "--path", "batched"]) == 1
    assert f"ArraysCache.left_padding is rebound at {leak['source']}" in capsys.readouterr().out
