"""The epochs: which set of live caches the readings are of, and the roots a step was given.

An *epoch* is one set of live caches (``caches.py``'s scope at one version): a request joining a
busy batch, or a cache dying, starts the next, and readings of two epochs make no growth line
(``growth.py``). The roots of the last step are known by the identity of a few of their items
(the same caches skip the scope) and a weak reference to the first one (dead, the ids may be
reused)."""

from __future__ import annotations

import weakref


class Epochs:
    def __init__(self) -> None:
        self.number = 0  # the current epoch
        self.version = -1  # the scope's version it began at (-1: a new one is due)
        self.members: tuple[weakref.ref, ...] = ()  # the caches of the current epoch
        # Identity of the last roots: the same caches skip the scope.
        self.root_ids: tuple[int, ...] | None = None
        self.anchor_ref: weakref.ref | None = None  # their first cache: dead, the ids may be reused

    def continuing(self) -> bool:
        """Does any cache of the current epoch live on?"""
        return any(ref() is not None for ref in self.members)

    def start(self, members: tuple[weakref.ref, ...], version: int) -> None:
        """The next epoch: the caches followed now, at the scope's ``version``."""
        self.number += 1
        self.members = members
        self.version = version

    def forget(self) -> None:
        """A new epoch is due at the next step (after a pause, or a reset)."""
        self.version = -1

    def follow(self, ids: tuple[int, ...], anchor_ref: weakref.ref | None) -> tuple[int, ...] | None:
        """Other roots from here on (their ids, a weak reference to their first cache); returns
        the ids of the last ones."""
        before, self.root_ids, self.anchor_ref = self.root_ids, ids, anchor_ref
        return before
