"""The live watchdogs of the process, and which of them its metrics endpoint shows.

Every ``Watchdog`` joins when it is made and leaves when it is collected (weak references).
*Shown* is what the exporters publish by default: ``Watchdog(export=True)``, until one of these
says otherwise. Visibility is this module's alone; the layers above ask it for changes:

- ``retire(wd)``: its model is gone (unloaded, collected): its series leave the endpoint, though
  the object may live on.
- ``hide_inherited()``: in a forked child, whose parent exports the watchdogs it inherited: each
  is hidden until it steps in this process, and from then on this process shows it.

``wd.export`` reads and sets the same state (set ``True``: shown; ``False``: retired).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .watchdog import Watchdog


class LiveSet:
    """The live watchdogs and their visibility (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[Watchdog] = weakref.WeakSet()
        self._shown: weakref.WeakSet[Watchdog] = weakref.WeakSet()
        # watchdog -> its steps when it was inherited through fork: hidden until they change
        self._inherited: weakref.WeakKeyDictionary[Watchdog, int] = weakref.WeakKeyDictionary()

    def add(self, wd: Watchdog, *, shown: bool) -> None:
        """A new watchdog: live, and shown or not (its ``export=``)."""
        with self._lock:
            self._live.add(wd)
            if shown:
                self._shown.add(wd)

    def watchdogs(self, *, hidden: bool = False) -> list[Watchdog]:
        """The live watchdogs shown (``hidden=True``: every live one)."""
        with self._lock:
            self._reveal_stepped()
            return [wd for wd in list(self._live) if hidden or wd in self._shown]

    def shown(self, wd: Watchdog) -> bool:
        with self._lock:
            self._reveal_stepped()
            return wd in self._shown

    def show(self, wd: Watchdog) -> None:
        """Shown from now on (an inherited one too, stepped here or not)."""
        with self._lock:
            self._inherited.pop(wd, None)
            if wd in self._live:
                self._shown.add(wd)

    def retire(self, wd: Watchdog) -> None:
        """Its series leave the endpoint for good, even if it steps again (``show`` brings it back)."""
        with self._lock:
            self._inherited.pop(wd, None)
            self._shown.discard(wd)

    def hide_inherited(self) -> None:
        """Every watchdog shown now is hidden until it steps (``wd.steps`` changes): call it in a
        forked child whose parent exports the watchdogs it inherited."""
        with self._lock:
            for wd in list(self._shown):
                self._inherited[wd] = wd.steps
            self._shown.clear()

    def after_fork_in_child(self) -> None:
        # Only the forking thread survives: a lock another thread held is held for ever.
        self._lock = threading.Lock()

    def _reveal_stepped(self) -> None:
        for wd, steps in list(self._inherited.items()):
            if wd.steps != steps:  # it steps in this process: this process shows it
                del self._inherited[wd]
                self._shown.add(wd)


LIVE = LiveSet()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LIVE.after_fork_in_child)


def live_watchdogs(*, unexported: bool = False) -> list[Watchdog]:
    """Every live watchdog the metrics endpoint shows (created with ``export=True`` and not
    retired: what exporters publish by default); ``unexported=True``: every live watchdog."""
    return LIVE.watchdogs(hidden=unexported)


def retire(wd: Watchdog) -> None:
    """``wd``'s model is gone: its series leave the metrics endpoint (the object may live on)."""
    LIVE.retire(wd)


def hide_inherited() -> None:
    """In a forked child: the watchdogs inherited from the parent, which the parent exports, are
    hidden until they step in this process."""
    LIVE.hide_inherited()
