"""The watchdog's options, each bound and each default written once.

``WatchdogOptions`` is every option of a ``Watchdog``, checked once when it is built, with errors
that name the parameter (or the command line's flag). ``Watchdog(**keywords)`` builds one, and so
do the places that check options before any watchdog exists: ``@watch(...)``, ``instrument()``,
``serve``'s hooks and the command line. The command line's argparse types check text against the
same bounds (``Bound``). Written once, the checks cannot drift apart (a NaN threshold, which never
fires, must fail all of them). This module imports the standard library only: options are checked
before MLX is imported.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Bound:
    what: str  # completes "must be ...", e.g. "a fraction in (0, 1]"
    holds: Callable[[Any], bool]  # on a number already converted


def _finite_non_negative(value) -> bool:
    return 0 <= value < math.inf  # false for NaN too


POSITIVE_INT = Bound("a positive integer", lambda value: value > 0)
PORT = Bound("a port number from 0 to 65535", lambda value: 0 <= value <= 65535)
STEPS = Bound("a finite number of steps >= 0", _finite_non_negative)
SECONDS = Bound("a finite number of seconds >= 0", _finite_non_negative)
FRACTION = Bound("a fraction in (0, 1]", lambda value: 0 < value <= 1)


def _is_number(value: Any, kinds: tuple = (numbers.Real,)) -> bool:
    """A number of ``kinds`` (numpy's integers and floats are numbers too), never a bool."""
    return not isinstance(value, bool) and isinstance(value, kinds)


def checked_positive_int(value: Any, label: str) -> int:
    if not _is_number(value, (numbers.Integral,)) or not POSITIVE_INT.holds(value):
        raise ValueError(f"{label} must be {POSITIVE_INT.what}, got {value!r}")
    return int(value)


def checked_port(value: Any, label: str) -> int:
    if not _is_number(value, (numbers.Integral,)) or not PORT.holds(value):
        raise ValueError(f"{label} must be {PORT.what}, got {value!r}")
    return int(value)


def checked_steps(value: Any, label: str) -> float | None:
    """A threshold in steps (``warn_within``, ``stop_within``), or None."""
    if value is not None and (not _is_number(value) or not STEPS.holds(value)):
        raise ValueError(f"{label} must be {STEPS.what} or None, got {value!r}")
    return None if value is None else float(value)


def checked_walk_interval(value: Any, label: str = "walk_interval") -> float | None:
    """``walk_interval`` as the watchdog keeps it: None (auto) or seconds as a float."""
    if value is None:
        return None
    if not _is_number(value) or not SECONDS.holds(value):
        raise ValueError(f"{label} must be {SECONDS.what} or None, got {value!r}")
    return float(value)


def checked_bool(value: Any, label: str) -> bool:
    """True or False (numpy's bool too): a string such as "false" is no switch that is off."""
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{label} must be True or False, got {value!r}")


def checked_process_count(value: Any, label: str = "process_count") -> bool | str:
    """True, False (numpy's bools too) or "auto"."""
    if isinstance(value, str) and value == "auto":
        return "auto"
    try:
        return checked_bool(value, label)
    except ValueError:
        raise ValueError(f'{label} must be True, False or "auto", got {value!r}') from None


def checked_name(value: Any, label: str = "name") -> str | None:
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise ValueError(f"{label} must be a non-empty string or None, got {value!r}")


def checked_fraction(value: Any, label: str) -> float:
    if not _is_number(value) or not FRACTION.holds(value):
        raise ValueError(f"{label} must be {FRACTION.what}, got {value!r}")
    return float(value)


def checked_limit(value: Any, label: str = "limit") -> int | None:
    """A buffer limit, or None (the device's)."""
    return None if value is None else checked_positive_int(value, label)


def checked_callable(value: Any, label: str) -> Any:
    """A callable, or None."""
    if value is not None and not callable(value):
        raise ValueError(f"{label} must be callable, got {value!r}")
    return value


DEFAULT_METRICS_PORT = 9464  # the port OpenTelemetry's Prometheus exporter uses by default
MAX_OBJECTS = 100_000  # objects one walk of the roots looks at, at most (arrays.py)
MAX_DEPTH = 64  # how deep it goes from the roots


def flag(name: str) -> str:
    """The command line's flag of an option: ``fix_every`` -> ``--fix-every``."""
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class WatchdogOptions:
    """Every option of a ``Watchdog`` (its keyword arguments but ``model``; ``Watchdog`` says what
    each does), checked once, here: a bad value raises ``ValueError`` naming the option, with
    ``flags=True`` the command line's flag (``--fix-every``) instead. Values come out normalized
    (numpy's numbers and bools as Python's, thresholds and seconds as floats). Building one
    imports nothing and creates no watchdog."""

    limit: int | None = None  # None: the device's resource limit, else 499,000
    name: str | None = None
    fix: bool = False
    fix_every: int = 16
    warn_within: float | None = None
    stop_within: float | None = None
    on_forecast: Callable[[Any], Any] | None = None
    overhead_budget: float = 0.01
    walk_interval: float | None = None
    export: bool = True
    max_objects: int = MAX_OBJECTS
    max_depth: int = MAX_DEPTH
    process_count: bool | str = "auto"
    census: bool | str = "auto"
    flags: dataclasses.InitVar[bool] = False

    def __post_init__(self, flags: bool) -> None:
        for field in dataclasses.fields(self):
            label = flag(field.name) if flags else field.name
            value = _CHECKS[field.name](getattr(self, field.name), label)
            object.__setattr__(self, field.name, value)

    def keywords(self) -> dict[str, Any]:
        """The options that differ from the defaults, as ``Watchdog`` keyword arguments."""
        return {
            field.name: value
            for field in dataclasses.fields(self)
            if (value := getattr(self, field.name)) != field.default
        }


_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "limit": checked_limit,
    "name": checked_name,
    "fix": checked_bool,
    "fix_every": checked_positive_int,
    "warn_within": checked_steps,
    "stop_within": checked_steps,
    "on_forecast": checked_callable,
    "overhead_budget": checked_fraction,
    "walk_interval": checked_walk_interval,
    "export": checked_bool,
    "max_objects": checked_positive_int,
    "max_depth": checked_positive_int,
    "process_count": checked_process_count,
    "census": checked_process_count,
}
