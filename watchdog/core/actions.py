"""Actions on a forecast: stop the generation before the limit, warn (at most once a minute)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from . import clock
from . import forecast as fc
from .limits import limit_phrase

logger = logging.getLogger("mlx_watchdog")

WARN_INTERVAL_SECONDS = 60.0


class ResourceLimitForecast(RuntimeError):
    """Raised from an observed step when the forecast puts the buffer limit within ``stop_within``
    steps: the generation ends cleanly while the process and the device are still healthy."""

    # Set by the stop that raised it: a distributed stop (the ranks' agreement) or a prefill one.
    agreement: Any = None
    chunk_tokens: int | None = None
    predicted_buffers: float | None = None
    safe_prefill_tokens: int | None = None

    def __init__(self, forecast: fc.Forecast, reason: str = "forecast"):
        self.forecast = forecast
        self.reason = reason
        super().__init__(
            f"mlx-watchdog stopped the generation ({reason}): {limit_phrase(forecast.limit)} is "
            f"forecast within {forecast.steps_to_limit:.0f} steps. {forecast.describe()}"
        )


@dataclasses.dataclass(frozen=True)
class Stop:
    """A stop of the generation: why, when, and the forecast that caused it."""

    reason: str  # "forecast", "prefill"
    forecast: fc.Forecast
    time: float  # seconds since the epoch (time.time())


class Warnings:
    """The resource-limit warning at most once a minute; the others once per watchdog."""

    def __init__(self) -> None:
        self._last = -math.inf
        self._said: set[str] = set()

    def once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message, *args)

    def due(self) -> bool:
        now = clock.wall()
        if now - self._last >= WARN_INTERVAL_SECONDS:
            self._last = now
            return True
        return False


def remedy(fix: bool, fixed_once: bool) -> str:
    """What to do about a forecast limit, given the fix's state."""
    if not fix:
        return "fix: Watchdog(fix=True) or `mlx-watchdog serve --fix`"
    if not fixed_once:
        return "the fix is on and has not run yet"
    return "the fix is on; this growth is not one it cuts"
