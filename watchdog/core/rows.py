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

from .arrays import Found, resolve
from .fix import resolvable

EVERY = 4  # steps between two looks at the rows
# Read through mx.array's own descriptors: a subclass's attribute code is the program's.
_shape = mx.array.__dict__["shape"].__get__
_ndim = mx.array.__dict__["ndim"].__get__
RUN_LIMIT = 3  # an array whose rows changed at this many looks in a row is no batch


class RowsWatch:
    def __init__(self) -> None:
        self.probe: tuple[tuple, int] | None = None  # (path from the roots, rows at the last look)
        self._seen: dict[tuple, int] = {}  # path -> rows, at the last walk of this epoch
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
        rows = {}
        for f in found:
            if f.root == 0 and _ndim(f.array) >= 2 and f.steps not in self._dropped and resolvable(f.steps):
                rows[f.steps] = _shape(f.array)[0]
        seen = self._seen if epoch == self._epoch else {}
        self._seen, self._epoch = rows, epoch
        steady = {path: n for path, n in rows.items() if seen.get(path, n) == n}
        if not steady:
            self.probe = None
            return
        batch = collections.Counter(steady.values()).most_common(1)[0][0]
        # The shortest path: it is followed at every step.
        self.probe = min(((path, n) for path, n in steady.items() if n == batch), key=lambda p: len(p[0]))

    def changed(self, roots: Any, step: int) -> bool:
        """Every ``EVERY`` steps: has the watched array another number of rows than it had?"""
        path, rows = self.probe  # type: ignore[misc]
        try:
            now = _shape(resolve(roots, path))[0]
        except Exception:  # the structure changed: gone until the next walk
            self.probe = None
            return True
        if now == rows:
            return False
        self._run = self._run + 1 if step - self._last_change <= EVERY else 1
        self._last_change = step
        if self._run >= RUN_LIMIT:
            self._dropped.add(path)
            self.probe = None
            return False
        self.probe = (path, now)
        return True
