"""MLX's own buffer counter (proposed upstream under two spellings, in no released MLX yet): found
through a stand-in exposing it, read as the exact source (growth from live buffers, headroom from
live and cached), and the cache released before a stop decision. Without one, on Metal, the
forecast keeps a margin for buffers in flight."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlx_watchdog import ResourceLimitForecast, Watchdog
from mlx_watchdog.core import limits

SPELLINGS = [
    ("get_active_buffer_count", "get_cache_buffer_count"),
    ("get_active_resource_count", "get_cache_count"),
]


class StandIn:
    """What MLX's allocator would report: live buffers and the cached ones beside them."""

    def __init__(self, live: int, cached: int):
        self.live, self.cached = live, cached
        self.clears = 0

    def total(self) -> int:  # live and cached: Metal's num_resources_
        return self.live + self.cached

    def cache(self) -> int:
        return self.cached

    def clear_cache(self) -> None:
        self.clears += 1
        self.cached = 0


class Chain:
    """A cache whose attribute is rebound each step to a new lazy array."""

    def __init__(self):
        self.x = mx.array(0)
        mx.eval(self.x)

    def step(self):
        self.x = self.x + 1


@pytest.fixture
def metal(monkeypatch):
    """Pretend the device is Metal (the counter is used only there)."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    for total, cached in SPELLINGS:
        for module in (mx, mx.metal):
            monkeypatch.delattr(module, total, raising=False)
            monkeypatch.delattr(module, cached, raising=False)
    return monkeypatch


def expose(monkeypatch, module, spelling, stand_in):
    total, cached = spelling
    monkeypatch.setattr(module, total, stand_in.total, raising=False)
    monkeypatch.setattr(module, cached, stand_in.cache, raising=False)


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("where", ["mx", "mx.metal"])
def test_either_spelling_is_found_in_either_module(metal, spelling, where):
    stand_in = StandIn(live=100, cached=30)
    module = mx if where == "mx" else mx.metal
    expose(metal, module, spelling, stand_in)
    counter = limits.find_buffer_counter()
    assert counter is not None and counter.name == f"{where}.{spelling[0]}"
    assert counter.read() == (100, 30)
    assert limits.unseen_margin(counter) == 0  # MLX's count includes what is in flight


def test_the_later_spelling_wins_and_none_is_found_off_metal(metal):
    newer, older = StandIn(10, 1), StandIn(20, 2)
    expose(metal, mx, SPELLINGS[1], older)
    expose(metal, mx, SPELLINGS[0], newer)
    assert limits.find_buffer_counter().read() == (10, 1)
    metal.setattr(mx.metal, "is_available", lambda: False)  # CPU, CUDA: their limits are bytes
    assert limits.find_buffer_counter() is None
    assert limits.unseen_margin(None) == 0


def test_without_a_counter_metal_keeps_a_margin_for_buffers_in_flight(metal):
    wd = Watchdog(limit=100_000, export=False, walk_interval=0, process_count=False)  # no count at all
    chain = Chain()
    for _ in range(40):
        wd.observe(chain)
        chain.step()
    f = wd.forecast()
    assert f.source == "estimate" and f.reserved_buffers == limits.IN_FLIGHT_MARGIN
    assert f.buffers_per_step == pytest.approx(1.0, abs=0.01)
    expected = (f.limit - f.resident_buffers - limits.IN_FLIGHT_MARGIN) / f.buffers_per_step
    assert f.steps_to_limit == pytest.approx(expected, rel=0.01)


def test_the_counter_is_the_exact_source(metal):
    """The walk reads one buffer a step; MLX's count says three live ones and a cache of 500:
    the forecast follows MLX's count, growth from live buffers, headroom from live and cached."""
    stand_in = StandIn(live=1000, cached=500)
    expose(metal, mx, SPELLINGS[0], stand_in)
    wd = Watchdog(limit=100_000, export=False, walk_interval=0)
    chain = Chain()
    for _ in range(64):
        wd.observe(chain)
        chain.step()
        stand_in.live += 3
    f = wd.forecast()
    assert f.source == "mx.get_active_buffer_count"
    assert f.buffers_per_step == pytest.approx(3.0, abs=0.01)
    assert f.reserved_buffers == 500
    assert abs(f.resident_buffers - stand_in.live) <= 3 * (f.step - f.measured_step) + 3
    expected = (f.limit - f.resident_buffers - 500) / 3.0
    assert f.steps_to_limit == pytest.approx(expected, rel=0.01)


def test_a_stop_is_decided_after_mlx_releases_its_cache(metal, fake_clock):
    """A cache holding most of the headroom would stop the generation; MLX releases it before it
    fails, so the watchdog releases it first and reads again: no stop. A leak that reaches the
    limit anyway still stops."""
    stand_in = StandIn(live=1000, cached=8700)
    expose(metal, mx, SPELLINGS[0], stand_in)
    metal.setattr(mx, "clear_cache", stand_in.clear_cache)
    wd = Watchdog(limit=10_000, export=False, walk_interval=0, stop_within=500)
    chain = Chain()
    for _ in range(64):
        fake_clock.now += 0.01  # a step's time on the watchdog's clock, on any machine
        wd.observe(chain)
        chain.step()
        stand_in.live += 1
    assert stand_in.clears >= 1 and stand_in.cached == 0
    assert wd.stops["forecast"] == 0 and math.isfinite(wd.forecast().steps_to_limit)

    with pytest.raises(ResourceLimitForecast):
        for _ in range(10_000):
            fake_clock.now += 0.01
            wd.observe(chain)
            chain.step()
            stand_in.live += 50
    assert wd.stops["forecast"] == 1 and stand_in.live < 10_000
