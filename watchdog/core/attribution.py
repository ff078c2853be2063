"""Source attribution: the file, line and function that rebind a leaking attribute.

Once a site is known to leak (``"ArraysCache.left_padding"``), one short probe finds where the
program rebinds it: ``mlx_lm/models/cache.py:685 ArraysCache.advance``. The probe gives that one
class a ``__setattr__`` of its own that performs the assignment exactly as before, then notes the
caller's frame when the attribute receives a pending ``mx.array`` (what a lazy chain grows by).
It stays for one step: it ends when an instance it already saw is assigned again (the next step),
after ``MAX_RECORDS`` assignments, or when the watchdog ends it (its next walk, the end of the
generation, its own death). Then the class is given back its own ``__setattr__`` (or none, as
before): attaching and detaching are symmetric. Each site is probed once per watchdog, so the
steady path never pays for it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import mlx.core as mx

from .arrays import MAX_SITE_LEN, follow
from .caches import kept_site, live_site
from .census import is_outside_site
from .graph import is_evaluated

MAX_RECORDS = 256  # assignments noted before a probe ends itself (a step of a very deep model)
_MISSING = object()
_type_dict = type.__dict__["__dict__"].__get__
_type_getattribute = type.__getattribute__
# One probe per class at a time, whichever watchdog asks: two stacked hooks could not both be
# taken off exactly.
_active: dict[int, SetattrProbe] = {}  # by id: a program's metaclass may hash as it likes
_active_lock = threading.Lock()


def describe_frame(frame) -> str:
    """``package/module.py:LINE Class.function`` for a frame (the path from its top package)."""
    code = frame.f_code
    return f"{short_path(code.co_filename)}:{frame.f_lineno} {getattr(code, 'co_qualname', code.co_name)}"


def short_path(filename: str) -> str:
    """A file's path from the top-level package that holds it (``mlx_lm/models/cache.py``)."""
    parts = os.path.abspath(filename).split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(marker) :])
    for path in sorted((p for p in sys.path if p), key=len, reverse=True):
        root = os.path.abspath(path) + os.sep
        if filename.startswith(root):
            return os.path.relpath(filename, root).replace(os.sep, "/")
    return os.path.basename(filename)


def _pending(value: Any) -> bool:
    if isinstance(value, mx.array):
        return not is_evaluated(value)
    if isinstance(value, (list, tuple)):  # a list attribute (ArraysCache.cache) rebound whole
        return any(isinstance(v, mx.array) and not is_evaluated(v) for v in value)
    return False


class SetattrProbe:
    """A temporary ``__setattr__`` on ``cls`` that notes where ``attr`` is rebound to pending arrays."""

    def __init__(self, cls: type, attr: str, site: str | None = None, on_done=None):
        # on_done(probe) runs once it detached; a WeakMethod does not keep its owner alive
        # (the class holds the hook, the hook this probe, while attached).
        self.cls, self.attr, self.on_done = cls, attr, on_done
        self.site = site or f"{cls.__name__}.{attr}"[:MAX_SITE_LEN]  # where its source is filed
        self.records: collections.Counter = collections.Counter()
        self.order: list[str] = []  # first seen first: breaks ties
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._hook: Callable[..., None] | None = None
        self._saved: Any = _MISSING
        self.error: str | None = None
        self.busy = False  # not attached: another probe was on the class

    @property
    def attached(self) -> bool:
        return self._hook is not None

    def attach(self) -> bool:
        cls, attr = self.cls, self.attr
        # Read as type reads them: a metaclass's __getattribute__ (the program's code) never runs.
        saved = _type_dict(cls).get("__setattr__", _MISSING)
        original: Callable[..., None] = _type_getattribute(cls, "__setattr__")  # its own or inherited
        probe = self

        def __setattr__(obj, name, value):
            original(obj, name, value)  # the assignment itself, unchanged
            if name == attr and probe._hook is not None and type(obj) is cls and _pending(value):
                probe._note(obj, sys._getframe(1))

        with _active_lock:
            if id(cls) in _active:  # another watchdog probes it now: try again later
                self.busy = True
                return False
            try:
                type.__setattr__(cls, "__setattr__", __setattr__)
            except (TypeError, AttributeError) as exc:  # a built-in or extension type: no probe
                self.error = f"{type(exc).__name__}: {exc}"
                return False
            self._saved, self._hook = saved, __setattr__
            _active[id(cls)] = self
        return True

    def _note(self, obj: Any, frame) -> None:
        with self._lock:
            if self._hook is None:
                return
            again = id(obj) in self._seen
            if not again:
                self._seen.add(id(obj))
                where = describe_frame(frame)
                if where not in self.records:
                    self.order.append(where)
                self.records[where] += 1
        if again or sum(self.records.values()) >= MAX_RECORDS:
            self.detach()

    def detach(self) -> None:
        """Give the class back what it had: its own ``__setattr__``, or none. Idempotent."""
        with self._lock:
            hook, self._hook = self._hook, None
            if hook is None:
                return
            cls = self.cls
            if _type_dict(cls).get("__setattr__") is hook:  # someone else's hook since: leave theirs
                if self._saved is _MISSING:
                    type.__delattr__(cls, "__setattr__")
                else:
                    type.__setattr__(cls, "__setattr__", self._saved)
            self._saved = _MISSING
            with _active_lock:
                if _active.get(id(cls)) is self:
                    del _active[id(cls)]
            self._seen.clear()
        done = self.on_done() if isinstance(self.on_done, weakref.WeakMethod) else self.on_done
        if done is not None:
            done(self)

    @property
    def source(self) -> str | None:
        """The line that rebound the attribute most often (the first one seen on a tie)."""
        if not self.records:
            return None
        top = max(self.records.values())
        return next(where for where in self.order if self.records[where] == top)


class Attribution:
    """Which line rebinds each leaking site: one probe per site, per watchdog."""

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}
        self._tried: set[str] = set()
        self._probes: list[SetattrProbe] = []
        self._annotated: tuple = (None, None, ())
        # A watchdog that dies with a probe attached still gives the classes back.
        self._finalizer = weakref.finalize(self, _detach_all, self._probes)

    def consider(
        self,
        leaks: Sequence,
        found: Sequence,
        roots: Sequence[Any],
        outside: Callable[[], Mapping[str, tuple[type, str]]] = dict,
    ) -> None:
        """After a walk: end the probes of the step before, start one for each leaking site not
        tried yet. ``found``: the walk's arrays; ``roots``: the objects their ``root`` indexes;
        ``outside()``: the class and attribute of each site the census follows (asked only when
        one of them is to be probed)."""
        self.finish()
        try:
            self._start(leaks, found, roots, outside)
        except Exception:  # an odd object graph: no source line, never a broken reading
            pass

    def _start(
        self,
        leaks: Sequence,
        found: Sequence,
        roots: Sequence[Any],
        outside: Callable[[], Mapping[str, tuple[type, str]]],
    ) -> None:
        owners: Mapping[str, tuple[type, str]] | None = None
        for leak in leaks:
            if leak.site in self._tried or kept_site(leak.site):  # a kept cache is rebound no more
                continue
            self._tried.add(leak.site)
            if is_outside_site(leak.site):
                owners = outside() if owners is None else owners
                target = owners.get(leak.site)
            else:
                target = _owner(leak.site, found, roots)
            if target is None:
                continue
            probe = SetattrProbe(*target, site=leak.site, on_done=weakref.WeakMethod(self._done))
            if probe.attach():
                self._probes.append(probe)
            elif probe.busy:
                self._tried.discard(leak.site)  # at the next reading

    @property
    def probing(self) -> bool:
        """A probe is attached (a source line may be found within a step)."""
        return bool(self._probes)

    def finish(self) -> None:
        """End every probe still attached (the step it was for is over)."""
        for probe in list(self._probes):
            probe.detach()

    def _done(self, probe: SetattrProbe) -> None:
        source = probe.source
        if source is not None:
            self.sources[probe.site] = source
        try:
            self._probes.remove(probe)
        except ValueError:
            pass

    def annotate(self, leaks: tuple) -> tuple:
        """``leaks`` with each one's ``source`` filled in where it is known. A kept cache's site
        (``caches.py``) has the source found while caches of its class stepped."""
        if not self.sources or not leaks:
            return leaks
        key = (leaks, len(self.sources))
        if self._annotated[:2] == key:
            return self._annotated[2]
        sources = self.sources
        out = tuple(
            dataclasses.replace(leak, source=sources[live_site(leak.site)])
            if leak.source is None and live_site(leak.site) in sources
            else leak
            for leak in leaks
        )
        self._annotated = (leaks, len(self.sources), out)
        return out


def _detach_all(probes: list) -> None:
    for probe in list(probes):
        probe.detach()


def _owner(site: str, found: Iterable, roots: Sequence[Any]) -> tuple[type, str] | None:
    """(class, attribute) of ``site``, from the first array found there: the object that holds
    the attribute (the last attribute step of its path), re-resolved without properties."""
    for f in found:
        if f.site != site:
            continue
        steps = f.steps
        last = max((i for i, (kind, _) in enumerate(steps) if kind == "attr"), default=None)
        if last is None or f.root >= len(roots):
            return None
        try:
            owner = follow(roots[f.root], steps[:last])
        except Exception:
            return None
        attr = steps[last][1]
        cls = type(owner)
        if f"{cls.__name__}.{attr}"[:MAX_SITE_LEN] != site:
            return None
        return cls, attr
    return None
