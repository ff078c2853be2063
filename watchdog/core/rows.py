"""A batch changed in place: the same cache objects, another number of rows.

mlx-lm's ``BatchGenerator`` filters its caches when a request ends and extends them when one
joins: no cache joins or dies, so the scope (``caches.py``) sees no change, yet the buffers held
jump at once. Every ``EVERY`` steps the watchdog reads one array of the roots (a path followed
without a walk: a few microseconds, too many for every step of the per-step path) and compares its
first dimension, the batch, with what it was: another count is a change of the batch, read one
step later as a change of the scope is.

Which array: a cache's state arrays share the batch as their first dimension, so of the roots'
arrays of two dimensions or more, one of the first dimension most of them have; and not one whose
first dimension changed between two walks of one epoch (a chain of rows that grows every step,
whose first dimension is no batch). One that still changes at every step is dropped.
"""

from __future__ import annotations

import collections
from typing import Any

import mlx.core as mx

from .arrays import Found, resolve, steps_key
from .fix import resolvable
from .objects import INLINE_VALUES, array_shape, info

_mro = type.__dict__["__mro__"].__get__
_type_dict = type.__dict__["__dict__"].__get__
_getattribute = object.__getattribute__
_shape = mx.array.__dict__["shape"].__get__

EVERY = 4  # steps between two looks at the rows
RUN_LIMIT = 3  # an array whose rows changed at this many looks in a row is no batch


class RowsWatch:
    def __init__(self) -> None:
        self.probe: tuple[tuple, int] | None = None  # (path from the roots, rows at the last look)
        self._seen: dict[tuple, int] = {}  # steps_key(path) -> rows, at the last walk of this epoch
        self._epoch = -1
        self._dropped: set[tuple] = set()
        self._last_change = -EVERY - 1  # step
        self._run = 0
        # The probe's path as the types met along it (_route), for the look; made at its first look.
        self._route: tuple | None = None
        self._route_path: tuple | None = None

    def forget(self) -> None:
        """Other roots: their paths lead elsewhere."""
        self.probe = None
        self._seen = {}
        self._dropped = set()

    def arm(self, found: list[Found], epoch: int) -> None:
        """At a walk of the roots (``found``, root 0): choose the array to watch."""
        rows, paths = {}, {}  # keyed by steps_key: a path's own keys may be the program's objects
        for f in found:
            if f.root != 0 or not resolvable(f.steps):
                continue
            shape, key = array_shape(f.array), steps_key(f.steps)
            if len(shape) >= 2 and key not in self._dropped:
                rows[key], paths[key] = shape[0], f.steps
        seen = self._seen if epoch == self._epoch else {}
        self._seen, self._epoch = rows, epoch
        steady = {key: n for key, n in rows.items() if seen.get(key, n) == n}
        if not steady:
            self.probe = None
            return
        batch = collections.Counter(steady.values()).most_common(1)[0][0]
        # The shortest path: it is followed at every step.
        self.probe = min(
            ((paths[key], n) for key, n in steady.items() if n == batch), key=lambda p: len(p[0])
        )

    def changed(self, roots: Any, step: int) -> bool:
        """Every ``EVERY`` steps: has the watched array another number of rows than it had?"""
        path, rows = self.probe  # type: ignore[misc]
        try:
            route = self._route
            if route is None or self._route_path is not path:
                route = self._route = _route(roots, path)
                self._route_path = path
            now = _rows_by_route(roots, route) if route else None
            if now is None:
                now = array_shape(resolve(roots, path))[0]
        except Exception:  # the structure changed: gone until the next walk
            self.probe = None
            return True
        if now == rows:
            return False
        self._run = self._run + 1 if step - self._last_change <= EVERY else 1
        self._last_change = step
        if self._run >= RUN_LIMIT:
            self._dropped.add(steps_key(path))
            self.probe = None
            return False
        self.probe = (path, now)
        return True


# The look at the rows runs on the per-step path (every EVERY steps), where ``resolve`` costs what
# its generality does (each step's type looked up, a class's attributes checked along its MRO: ~300
# bytecodes for ``[3].keys``). A route is the path as the types it met at its first look; a look
# reads by it while every object along it has the type it had then, and reads the same objects
# ``resolve`` would, by the same rules: an item of a builtin list or tuple, an attribute that no
# class along the (unchanged) MRO defines, read from the instance without running its class's code.
# Anything else (another type, a class that since defines the name) goes through ``resolve``.


def _route(roots: Any, path: tuple) -> tuple:
    """(item?, key, type, its MRO, the MRO's dicts) for each step of ``path`` from ``roots``;
    () when a step is not one a route reads (the look then takes ``resolve`` every time)."""
    route: list[tuple[bool, Any, type, Any, tuple]] = []
    value = roots
    for kind, key in path:
        cls = type(value)
        if kind == "item" and (cls is list or cls is tuple) and type(key) is int:
            route.append((True, key, cls, None, ()))
            value = value[key]
        elif kind == "attr" and type(key) is str and INLINE_VALUES and info(cls).attrs_dict is not None:
            mro = _mro(cls)
            dicts = tuple(_type_dict(klass) for klass in mro)
            if any(key in d for d in dicts):  # a class attribute: resolve tells it from the instance's
                return ()
            route.append((False, key, cls, mro, dicts))
            value = _getattribute(value, key)
        else:
            return ()
    return tuple(route) if type(value) is mx.array else ()


def _rows_by_route(roots: Any, route: tuple) -> int | None:
    """The first dimension of the array ``route`` leads to, or None where it does not hold."""
    value = roots
    try:
        for item, key, cls, mro, dicts in route:
            if type(value) is not cls:
                return None
            if not item:
                if _mro(cls) is not mro:
                    return None
                for d in dicts:
                    if key in d:
                        return None
                value = _getattribute(value, key)
            else:
                value = value[key]  # a builtin list's or tuple's
    except (IndexError, AttributeError):  # not there now: resolve says so
        return None
    if type(value) is not mx.array:
        return None
    return _shape(value)[0]
