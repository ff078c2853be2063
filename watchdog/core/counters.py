"""The watchdog's counters, in one small object: monotonic, written by the decode thread (and the
fix, the stops, errors caught), read by the exporters at scrape time (``Watchdog.counters``; each
is also an attribute of the watchdog, e.g. ``Watchdog.steps``)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class Counters:
    steps: int = 0  # observed steps
    walks: int = 0  # readings taken
    overhead_seconds: float = 0.0  # the watchdog's own wall time, observe() and its other work
    materialized_arrays: int = 0  # pending arrays the fix scheduled
    fix_failures: int = 0  # pending arrays the fix could not schedule (made on another thread's stream...)
    reclaimed_buffers: float = 0.0  # buffers the fix kept from leaking (estimated)
    internal_errors: int = 0  # errors caught on the watchdog's behalf (the decode went on)
    stops: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by reason


class PartAttribute(Generic[T]):
    """An attribute of one of an object's parts, read and written as the object's own:
    ``steps = PartAttribute[int]("counters")`` makes ``wd.steps`` ``wd.counters.steps``."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> PartAttribute[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(getattr(obj, self.part), self.name, value)
