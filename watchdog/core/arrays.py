"""Find every ``mx.array`` reachable from an object graph, with its path and its site.

A *path* is where one array lives, from the root: ``"[7].left_padding"``, ``"meta['pos']"``.
A *site* groups paths over layers by the class that owns the attribute:
``"ArraysCache.left_padding"``. Sites and paths carry code names only: class and attribute
names, positions, and the keys of a plain ``dict`` or an ``nn.Module`` when they look like
identifiers. Any other key is a placeholder (``[<key 3>]``): keys are often data (user names,
prompts), and sites become a Prometheus label.

The walk reads objects through their types only (``objects.py``): no property, ``__getattr__``,
``__iter__``, ``__repr__``, ``__eq__`` or ``__hash__`` of the program runs, so nothing walked can
raise, block or change state. It is iterative and bounded (depth, objects, items per container
and per walk), so cycles, deep, wide or huge graphs cannot hang it; what a bound cuts is counted
in ``Scan.cut``, by reason.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from . import objects
from .objects import ARRAY, DICT, OBJECT, OPAQUE, SEQUENCE, SET, code_name, info
from .options import MAX_DEPTH, MAX_OBJECTS

logger = logging.getLogger("mlx_watchdog")

MAX_ITEMS = 100_000  # a container with more is skipped whole (a vocabulary, a token list)
MAX_WALK_ITEMS = 1_000_000  # items looked at in one walk, over all its containers
MAX_SITE_LEN = 80
MAX_SKIPPED = 16  # containers named in Scan.skipped
_logged: set = set()  # (reason, class) already logged: a walk repeats every few steps
MAX_LOGGED = 64


@dataclasses.dataclass(frozen=True)
class Found:
    """One reachable array."""

    path: str
    site: str
    array: mx.array
    # How to reach it again from the root without a new walk: ("attr", name or slot
    # descriptor), ("item", key or position), or ("set"/"hidden", None): not re-resolvable.
    steps: tuple[tuple[str, Any], ...]
    root: int = 0  # which of the roots given to scan_all it was found from


@dataclasses.dataclass
class Scan:
    """The result of one walk: the arrays found and what the bounds cut off."""

    found: list[Found]
    objects: int
    # reason -> how many objects were not walked: "depth", "objects", "huge" (a container of
    # more than MAX_ITEMS), "items" (the walk's MAX_WALK_ITEMS spent), "error" (unreadable)
    cut: dict[str, int]
    skipped: list[str] = dataclasses.field(default_factory=list)  # "path (what, why)", the first few

    @property
    def truncated(self) -> bool:
        return bool(self.cut)


def find_arrays(obj: Any) -> list[tuple[str, mx.array]]:
    """Every ``mx.array`` reachable from ``obj``, each once, with its path from ``obj``.
    Never raises: what a bound or an unreadable object cut off is left out (``scan`` counts it)."""
    return [(f.path, f.array) for f in scan(obj).found]


def scan(obj: Any, *, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH) -> Scan:
    """Walk ``obj`` and return every reachable array with path, site and access steps."""
    return scan_all([(obj, "")], max_objects=max_objects, max_depth=max_depth)


def scan_all(
    roots: list[tuple[Any, str]],
    *,
    max_objects: int = MAX_OBJECTS,
    max_depth: int = MAX_DEPTH,
    marks: Sequence[str] = (),
) -> Scan:
    """Walk several roots, each ``(object, path prefix)``, as one: an array reachable from two
    of them is found once. ``Found.root`` is the index of the root it was found from.
    ``marks[i]``: appended to the site of every array found from root ``i`` (``caches.KEPT_MARK``)."""
    walk = _Walk(max_objects, max_depth, marks)
    objects.begin_walk()
    try:
        walk.run(roots)
    except Exception as exc:  # a bug of ours: what was found so far stands
        walk.skip("error", "", "the walk", type(exc).__name__)
    return Scan(walk.found, walk.objects, dict(walk.cut), walk.skipped)


class _Walk:
    def __init__(self, max_objects: int, max_depth: int, marks: Sequence[str] = ()) -> None:
        self.max_objects, self.max_depth = max_objects, max_depth
        self.marks = marks
        self.found: list[Found] = []
        self.cut: collections.Counter[str] = collections.Counter()
        self.skipped: list[str] = []
        self.objects = 0
        self.items = 0

    def run(self, roots: list[tuple[Any, str]]) -> None:
        found, seen, max_depth, marks = self.found, set(), self.max_depth, self.marks
        # Stack entries: (object, its type's info, path, site, steps, depth, root). Reversed
        # pushes keep natural order.
        stack: list[tuple[Any, objects.TypeInfo, str, str, tuple, int, int]] = [
            (obj, info(type(obj)), prefix, "root", (), 0, i)
            for i, (obj, prefix) in reversed(list(enumerate(roots)))
        ]
        while stack:
            value, t, path, site, steps, depth, root = stack.pop()
            kind = t.kind
            if kind == ARRAY:
                if id(value) not in seen:
                    seen.add(id(value))
                    if objects.usable_array(value):
                        if root < len(marks) and marks[root]:
                            site += marks[root]
                        found.append(Found(path or "<root>", site, value, steps, root))
                    else:
                        self.skip("error", path, t.name, "an mx.array never initialized")
                continue
            if id(value) in seen:
                continue
            if depth >= max_depth:
                self.cut["depth"] += 1
                continue
            if self.objects >= self.max_objects:
                self.cut["objects"] += 1 + len(stack)
                break
            seen.add(id(value))
            self.objects += 1
            try:
                children = self.children(value, t, path, site)
            except Exception as exc:  # a container mutated by another thread, a C descriptor that fails
                self.skip("error", path, t.name, type(exc).__name__)
                continue
            for child, ct, child_path, child_site, step in reversed(children):
                stack.append((child, ct, child_path, child_site, steps + (step,), depth + 1, root))

    def children(self, value: Any, t: objects.TypeInfo, path: str, site: str) -> list[tuple]:
        """(child, its type info, path, site, step) for each child that may hold arrays."""
        if t.kind == OBJECT:
            return self.members(value, t, path, site)
        length, snapshot = t.length, t.snapshot
        if length is None or snapshot is None:  # a root that is no container
            raise TypeError(f"{t.name} holds no items")
        size = length(value)
        if size > MAX_ITEMS or self.items + size > MAX_WALK_ITEMS:
            self.skip("huge" if size > MAX_ITEMS else "items", path, t.name, f"{size:,} items")
            return []
        self.items += size
        out: list[tuple] = []
        contents = snapshot(value)  # a copy made in C: another thread cannot change it under us
        if t.kind == SEQUENCE:
            for i, child in enumerate(contents):
                ct = info(type(child))
                if ct.kind > OPAQUE:
                    out.append((child, ct, f"{path}[{i}]", site, ("item", i)))
        elif t.kind == SET:
            for child in contents:  # no stable key: reachable, not re-resolvable
                ct = info(type(child))
                if ct.kind > OPAQUE:
                    out.append((child, ct, f"{path}{{}}", site, ("set", None)))
        else:
            plain = t.cls is dict
            for pos, (key, child) in enumerate(contents):
                ct = info(type(child))
                if ct.kind <= OPAQUE:
                    continue
                name = code_name(key) if plain or t.keys_are_names else None
                child_path = f"{path}[{name!r}]" if name else f"{path}[<key {pos}>]"
                if t.keys_are_names:  # nn.Module: its keys are its attributes
                    child_site = _site(t, name)
                elif site == "root":  # a root dict names its keys (structure); below, the attribute does
                    child_site = f"dict.{name}" if name else f"{t.name}[]"
                else:
                    child_site = site
                out.append((child, ct, child_path, child_site, ("item", key)))
        if t.kind == DICT and t.cls is not dict:
            out.extend(self.members(value, t, path, site))  # a subclass may have attributes too
        return out

    def members(self, value: Any, t: objects.TypeInfo, path: str, site: str) -> list[tuple]:
        """The instance dict and slots of an object, and what a hidden __dict__ holds."""
        out: list[tuple] = []
        attrs = objects.attributes(value, t, MAX_ITEMS)
        if attrs is None:
            self.skip("huge", path, t.name, f"more than {MAX_ITEMS:,} attributes")
            return out
        self.items += len(attrs)
        for pos, (key, step, child) in enumerate(attrs):
            ct = info(type(child))
            if ct.kind <= OPAQUE:
                continue
            name = code_name(key)
            child_path = (f"{path}.{name}" if path else name) if name else f"{path}.<attr {pos}>"
            out.append((child, ct, child_path, _site(t, name), ("attr", step)))
        hidden = objects.hidden_values(value, MAX_ITEMS) if t.hidden_dict else []
        if hidden is None:
            self.skip("huge", path, t.name, f"more than {MAX_ITEMS:,} members")
            return out
        for pos, child in enumerate(hidden):
            ct = info(type(child))
            if ct.kind > OPAQUE:
                out.append((child, ct, f"{path}.<hidden {pos}>", f"{t.name}.<hidden>", ("hidden", None)))
        return out

    def skip(self, reason: str, path: str, what: str, detail: str) -> None:
        self.cut[reason] += 1
        where = f"{path or '<root>'} ({what}: {detail})"
        if len(self.skipped) < MAX_SKIPPED:
            self.skipped.append(where)
        if (reason, what) not in _logged and len(_logged) < MAX_LOGGED:
            _logged.add((reason, what))
            logger.warning("mlx-watchdog: not walked (%s): %s", _REASONS[reason], where)


_REASONS = {  # why a container was not walked, as logged
    "huge": f"a container of more than {MAX_ITEMS:,} items",
    "items": f"the walk looked at {MAX_WALK_ITEMS:,} items already",
    "error": "it could not be read",
}


def _site(owner: objects.TypeInfo, name: Any) -> str:
    return f"{owner.name}.{name}"[:MAX_SITE_LEN] if name else f"{owner.name}[]"


def steps_key(steps: tuple) -> tuple:
    """``steps`` as a dictionary key that hashes no object of the program's: a key that is not
    exactly a str or an int (a dict's key object may define ``__hash__``) goes by its id."""
    return tuple((kind, key if type(key) in (str, int) else id(key)) for kind, key in steps)


def resolve(root: Any, steps: tuple[tuple[str, Any], ...]) -> Any:
    """Follow the access steps recorded by :func:`scan` from ``root`` to its array (no walk, no
    user code)."""
    value = follow(root, steps)
    if info(type(value)).kind != ARRAY:  # the structure changed: what is there now is not ours to read
        raise LookupError("no array at this path now")
    return value


def follow(root: Any, steps: tuple[tuple[str, Any], ...]) -> Any:
    """Whatever object the access steps lead to from ``root`` (a prefix of a path ends at the
    object holding an array)."""
    value = root
    for kind, key in steps:
        if kind == "attr":
            value = objects.attribute(value, key)
        elif kind == "item":
            value = objects.item(value, key)
        else:
            raise LookupError(f"{kind} members cannot be re-resolved")
    return value
