"""One watchdog's state as the exporters show it, read at one moment (``Watchdog.snapshot()``).

The forecast, the counters, the stops and the held stop are read together under the watchdog's
lock, so that a scrape never pairs a forecast with counters or stops of another moment (a stop
recorded between two reads, its count without its forecast).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .actions import Stop
from .forecast import Forecast


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """A watchdog's state at one moment (the mappings are read-only copies)."""

    name: str  # the watchdog label
    fix: bool
    rank: int
    world_size: int
    forecast: Forecast | None  # None: it failed (counted in internal_errors)
    steps: int  # the forecast's step when there is one
    materialized_arrays: int
    fix_failures: int
    reclaimed_buffers: float
    overhead_seconds: float
    internal_errors: int
    stops: Mapping[str, int]  # stops by reason
    last_stops: Mapping[str, Stop]  # the last stop of each reason
    held_stop: Stop | None  # see Watchdog.held_stop
