"""The bounds of the watchdog's options, each written once.

Two kinds of check use them: ``Watchdog``'s (and ``serve``'s, for a Namespace built without the
parser), on Python values, whose errors name the parameter or serve's flag; and the command
line's argparse types, on text. Written once, the two cannot drift apart (a NaN threshold,
which never fires, must fail both).
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
