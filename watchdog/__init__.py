"""mlx-watchdog: see, name, forecast and fix the lazy-graph buffer leaks that crash long MLX decodes.

    from mlx_watchdog import Watchdog
    wd = Watchdog(fix=True, stop_within=1000)
    for step in ...:
        wd.observe(cache)          # at the entry of each decode step
    print(wd.forecast().describe())
"""

from .actions import ResourceLimitForecast
from .core import Watchdog, live_watchdogs
from .fix import materialize
from .forecast import Forecast, Leak
from .introspect import find_arrays

__version__ = "0.1.0"

__all__ = [
    "Watchdog",
    "Forecast",
    "Leak",
    "ResourceLimitForecast",
    "find_arrays",
    "materialize",
    "live_watchdogs",
    "__version__",
]
