"""What a watchdog looks at: every cache it has seen in a forward pass that is still alive.

A decode is not the unit: a busy server's batch outlives every request, a request joins on a
cache list of its own for one forward, two decodes may share a model. Buffers are held by all
of those at once, so a reading walks them all. Caches are held by weak reference (the watchdog
must not keep a finished request's buffers alive), and the set has a version that changes when
a cache joins or dies, or its batch changes in place: readings of two versions are not points of
one growth line.

A cache that no forward has used for ``KEPT_STEPS`` steps and that is still alive is *kept*: a
server's prefix or prompt cache holds it by reference after its request (a decoding batch, or
decodes taking turns, pass theirs every step or every few). Its arrays are read under their site
with the mark ``KEPT_MARK`` (``"ArraysCache.left_padding (kept)"``): they no longer grow, but
every request may leave one more of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from . import objects
from .objects import ARRAY, info

MAX_MEMBERS = 4096  # caches followed at once; more are walked only while they are the roots
# Steps without a forward after which a live cache is kept: decodes taking turns (a few) pass
# theirs far more often, and a kept cache is named as such within this many steps of the next request.
KEPT_STEPS = 16
KEPT_MARK = " (kept)"  # appended to the site of a kept cache's arrays


def kept_site(site: str) -> bool:
    """Is ``site`` the site of kept caches' arrays?"""
    return site.endswith(KEPT_MARK)


def live_site(site: str) -> str:
    """The site without its kept mark: where the arrays were rebound while the cache stepped."""
    return site[: -len(KEPT_MARK)] if site.endswith(KEPT_MARK) else site


class Scope:
    def __init__(self) -> None:
        self._members: dict[int, weakref.ref] = {}  # id -> weak reference, in the order seen
        self.version = 0  # changes when a cache joins or dies
        self._current: frozenset[int] = frozenset()  # ids of the last roots' members
        # id -> the last step a forward used it; the current roots' members are used every step
        self._used: dict[int, int] = {}

    def follow(self, roots: Any, step: int = 0) -> bool:
        """Make ``roots`` the current roots at ``step``, adding their caches. Returns whether the
        set grew."""
        grew, ids = self._add(roots, step)
        for key in self._current.difference(ids):  # used by every step until this one
            if key in self._used:
                self._used[key] = max(self._used[key], step - 1)
        self._current = frozenset(ids)
        return grew

    def add(self, roots: Any, step: int = 0) -> bool:
        """Add the caches of ``roots`` (a prompt filled beside the current roots) at ``step``."""
        return self._add(roots, step)[0]

    def kept(self, member: Any, step: int) -> bool:
        """Is ``member`` kept at ``step``: alive, followed, and unused by any forward for
        ``KEPT_STEPS`` steps?"""
        return step - self.last_used(member, step) >= KEPT_STEPS

    def current(self, member: Any) -> bool:
        """Is ``member`` one of the current roots' caches (not a new object that took its id)?"""
        ref = self._members.get(id(member))
        return id(member) in self._current and ref is not None and ref() is member

    def last_used(self, member: Any, step: int) -> int:
        """The last step a forward used ``member`` (``step`` for the current roots' caches)."""
        key = id(member)
        return step if key in self._current else self._used.get(key, step)

    def kept_caches(self, step: int) -> list[tuple[Any, int]]:
        """(cache, its last forward's step) of every cache kept at ``step``."""
        out = []
        for key, ref in self._members.copy().items():  # a copy: callbacks may remove entries
            if key in self._current:
                continue
            used = self._used.get(key, step)
            member = ref() if step - used >= KEPT_STEPS else None
            if member is not None:
                out.append((member, used))
        return out

    def ref(self, member: Any) -> weakref.ref | None:
        """The weak reference to ``member`` when it is followed."""
        ref = self._members.get(id(member))
        return ref if ref is not None and ref() is member else None

    def refs(self) -> tuple[weakref.ref, ...]:
        """Weak references to the caches followed now (to ask later whether any of them lives)."""
        return tuple(self._members.copy().values())

    def _add(self, roots: Any, step: int) -> tuple[bool, list[int]]:
        ids = []
        grew = False
        for member in _members(roots):
            key = id(member)
            ids.append(key)
            ref = self._members.get(key)
            if ref is not None and ref() is member:
                self._used[key] = step
                continue
            if len(self._members) >= MAX_MEMBERS:
                continue
            try:
                self._members[key] = weakref.ref(member, self._gone(key))
            except TypeError:  # takes no weak reference: walked only as part of the roots
                continue
            self._used[key] = step
            grew = True
        if grew:
            self.version += 1
        return grew, ids

    def changed(self) -> None:
        """A cache changed in place (a batch filtered or extended: the same objects, other rows):
        readings before and after are no more points of one growth line than across a join."""
        self.version += 1

    def others(self) -> list[Any]:
        """The live caches that are not part of the current roots."""
        return self._live(self._current)

    def members(self) -> list[Any]:
        """Every live cache."""
        return self._live(frozenset())

    def _live(self, skip: frozenset) -> list[Any]:
        out = []
        for key, ref in self._members.copy().items():  # a copy: callbacks may remove entries
            if key in skip:
                continue
            member = ref()
            if member is not None:
                out.append(member)
        return out

    def __len__(self) -> int:
        return len(self._members)

    def _gone(self, key: int):
        def forget(ref: weakref.ref) -> None:  # may run on any thread, at any allocation
            if self._members.get(key) is ref:
                del self._members[key]
                self._used.pop(key, None)
                self.version += 1

        return forget


def member_of(roots: Any, steps: tuple) -> tuple[Any, tuple]:
    """The cache (as ``_members`` finds them) that holds the array reached by ``steps``, and the
    steps from that cache to the array."""
    value, depth = roots, 0
    for kind, key in steps:
        if depth >= 2 or kind != "item" or not _container(info(type(value))):
            break
        value, depth = objects.item(value, key), depth + 1
    return value, steps[depth:]


def _container(t: objects.TypeInfo) -> bool:
    return t.base is list or t.base is tuple or t.cls is dict  # list and tuple subclasses too


def _items(value: Any) -> list | None:
    """The items of a list, tuple or plain dict, read without their code (``objects.py``); None
    for anything else."""
    t = info(type(value))
    snapshot = t.snapshot
    if not _container(t) or snapshot is None:  # a container always has a snapshot
        return None
    return [v for _, v in snapshot(value)] if t.cls is dict else snapshot(value)


def _members(roots: Any, depth: int = 0) -> Iterator[Any]:
    """The cache objects in ``roots``: the items of a list, tuple or dict of caches (one level of
    nesting: a model's caches and its draft's), or the roots themselves."""
    if info(type(roots)).kind == ARRAY:
        return
    items = _items(roots) if depth < 2 else None
    if items is None:
        yield roots
        return
    for item in items:
        yield from _members(item, depth + 1)
