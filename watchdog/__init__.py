"""mlx-watchdog: see, name, forecast and fix the lazy-graph buffer leaks that crash long MLX decodes.

    from mlx_watchdog import Watchdog
    wd = Watchdog(fix=True, stop_within=1000)
    for step in ...:
        wd.observe(cache)          # at the entry of each decode step
    print(wd.forecast().describe())

The attachment points (``watch``, ``watch_model``, ``unwatch_model``, ``watch_step``,
``instrument``, ``uninstrument``) are importable from here too. Every name is loaded on first use
(module ``__getattr__``): ``import mlx_watchdog`` imports neither MLX nor the core, so that
``mlx-watchdog run``'s bootstrap can wait for the program to import mlx-lm itself.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from .attach.decorator import watch
    from .attach.loaders import instrument, uninstrument
    from .attach.model import unwatch_model, watch_model
    from .attach.step import watch_step
    from .core.actions import ResourceLimitForecast
    from .core.arrays import find_arrays
    from .core.fix import materialize
    from .core.forecast import Bounded, Forecast, Leak
    from .core.watchdog import Watchdog, live_watchdogs

__version__ = "0.1.0"

__all__ = [
    "Watchdog",
    "Bounded",
    "Forecast",
    "Leak",
    "ResourceLimitForecast",
    "find_arrays",
    "materialize",
    "live_watchdogs",
    "watch",
    "watch_model",
    "unwatch_model",
    "watch_step",
    "instrument",
    "uninstrument",
    "__version__",
]

# name -> module that defines it, imported on first access
_LAZY = {
    "Watchdog": "core.watchdog",
    "live_watchdogs": "core.watchdog",
    "Bounded": "core.forecast",
    "Forecast": "core.forecast",
    "Leak": "core.forecast",
    "ResourceLimitForecast": "core.actions",
    "find_arrays": "core.arrays",
    "materialize": "core.fix",
    "instrument": "attach.loaders",
    "uninstrument": "attach.loaders",
    "watch": "attach.decorator",
    "watch_model": "attach.model",
    "unwatch_model": "attach.model",
    "watch_step": "attach.step",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
