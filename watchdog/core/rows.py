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

from .arrays import Found, resolve, steps_key
from .fix import resolvable
from .objects import array_shape

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
