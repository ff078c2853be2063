"""``watch_step``: a bare step function, observed at each call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..core.watchdog import Watchdog
from .model import watchdog_from


def watch_step(fn: Callable, cache: Any, watchdog: Watchdog | None = None, **options) -> Callable:
    """Wrap a bare step function: each call observes ``cache`` first."""
    watchdog = watchdog_from(watchdog, options)
    if not callable(fn):
        raise TypeError(f"watch_step needs a callable, got {fn!r}")
    last: list[Any] = [None]

    @functools.wraps(fn)
    def step(*args, **kwargs):
        previous, last[0] = last[0], None
        watchdog.observe(cache, last_output=previous)
        result = fn(*args, **kwargs)
        last[0] = result
        return result

    step.__dict__["watchdog"] = watchdog
    return step
