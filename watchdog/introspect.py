"""Find every ``mx.array`` reachable from an object graph, with its path and its site.

A *path* is where one array lives, from the root: ``"[7].left_padding"``, ``"meta['pos']"``.
A *site* groups paths over layers by the class that owns the attribute:
``"ArraysCache.left_padding"``. Sites come from class and attribute names only, never from
data, so they stay few (they become a Prometheus label).

The walk reads ``__dict__`` entries and ``__slots__`` directly: properties are never invoked
(a property such as ``LayerCache.state`` builds new arrays each time it is read).
It is iterative and bounded, so cycles, deep or wide graphs and hostile objects cannot hang it.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import Any, Iterator

import mlx.core as mx

MAX_OBJECTS = 100_000
MAX_DEPTH = 64
MAX_SITE_LEN = 80

# Never descended into: values that cannot hold arrays, and code/library objects that are not data.
_ATOMS = (str, bytes, bytearray, memoryview, int, float, complex, bool, range, type(None))
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.CodeType,
    types.FrameType,
    types.GeneratorType,
    types.CoroutineType,
    types.TracebackType,
    mx.Dtype,
    mx.Device,
    mx.Stream,
)
_SEQUENCES = (list, tuple, collections.deque)
_SETS = (set, frozenset)


@dataclasses.dataclass(frozen=True)
class Found:
    """One reachable array."""

    path: str
    site: str
    array: mx.array
    # How to reach it again from the root without a new walk: ("attr", name) or ("item", key).
    steps: tuple[tuple[str, Any], ...]
    root: int = 0  # which of the roots given to scan_all it was found from


@dataclasses.dataclass
class Scan:
    """The result of one walk: the arrays found and what the bounds cut off."""

    found: list[Found]
    objects: int
    cut: dict[str, int]  # reason ("depth", "objects", "error") -> how many objects were not walked

    @property
    def truncated(self) -> bool:
        return bool(self.cut)


def find_arrays(obj: Any) -> list[tuple[str, mx.array]]:
    """Every ``mx.array`` reachable from ``obj``, each once, with its path from ``obj``."""
    return [(f.path, f.array) for f in scan(obj).found]


def scan(obj: Any, *, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH) -> Scan:
    """Walk ``obj`` and return every reachable array with path, site and access steps."""
    return scan_all([(obj, "")], max_objects=max_objects, max_depth=max_depth)


def scan_all(roots: list[tuple[Any, str]], *, max_objects: int = MAX_OBJECTS, max_depth: int = MAX_DEPTH) -> Scan:
    """Walk several roots, each ``(object, path prefix)``, as one: an array reachable from two
    of them is found once. ``Found.root`` is the index of the root it was found from."""
    found: list[Found] = []
    seen: set[int] = set()
    cut: collections.Counter[str] = collections.Counter()
    objects = 0
    # Stack entries: (object, path, site, steps, depth, root). Reversed pushes keep natural order.
    stack: list[tuple[Any, str, str, tuple, int, int]] = [
        (obj, prefix, "root", (), 0, i) for i, (obj, prefix) in reversed(list(enumerate(roots)))]
    while stack:
        value, path, site, steps, depth, root = stack.pop()
        if isinstance(value, mx.array):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(Found(path or "<root>", site, value, steps, root))
            continue
        if isinstance(value, _ATOMS) or isinstance(value, _OPAQUE):
            continue
        if id(value) in seen:
            continue
        if depth >= max_depth:
            cut["depth"] += 1
            continue
        if objects >= max_objects:
            cut["objects"] += 1 + len(stack)
            break
        seen.add(id(value))
        objects += 1
        try:
            children = list(_children(value, path, site))
        except Exception:  # a hostile __dict__, a container mutated by another thread, ...
            cut["error"] += 1
            continue
        for child, child_path, child_site, step in reversed(children):
            stack.append((child, child_path, child_site, steps + (step,), depth + 1, root))
    return Scan(found, objects, dict(cut))


def _children(value: Any, path: str, site: str) -> Iterator[tuple[Any, str, str, tuple]]:
    """(child, path, site, step) for each direct child of a container or object."""
    if isinstance(value, dict):
        owner = type(value)
        for key, child in list(value.items()):
            if owner is dict:
                child_site = _dict_site(site, key)
            else:  # a dict subclass such as nn.Module: its keys are its attributes
                child_site = _attr_site(owner, key)
            yield child, f"{path}[{_short_repr(key)}]", child_site, ("item", key)
    elif isinstance(value, _SEQUENCES):
        for i, child in enumerate(list(value)):
            yield child, f"{path}[{i}]", site, ("item", i)
    elif isinstance(value, _SETS):
        for child in list(value):  # no stable key: reachable, not re-resolvable
            yield child, f"{path}{{}}", site, ("set", None)
    if isinstance(value, (_SEQUENCES, _SETS)) or type(value) is dict:
        return
    owner = type(value)
    attrs = _instance_dict(value)
    for name, child in attrs.items():
        yield child, _join(path, name), _attr_site(owner, name), ("attr", name)
    for name in _slot_names(owner):
        if name in attrs or name in ("__dict__", "__weakref__"):
            continue
        try:
            child = object.__getattribute__(value, name)
        except AttributeError:  # an unset slot
            continue
        yield child, _join(path, name), _attr_site(owner, name), ("attr", name)


def resolve(root: Any, steps: tuple[tuple[str, Any], ...]) -> Any:
    """Follow the access steps recorded by :func:`scan` from ``root`` (no walk, no properties)."""
    value = root
    for kind, key in steps:
        if kind == "attr":
            attrs = _instance_dict(value)
            value = attrs[key] if key in attrs else object.__getattribute__(value, key)
        elif kind == "item":
            value = value[key]
        else:
            raise LookupError("set members cannot be re-resolved")
    return value


def _instance_dict(value: Any) -> dict:
    try:
        attrs = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return {}
    return dict(attrs) if isinstance(attrs, dict) else {}


_slot_cache: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    names = _slot_cache.get(cls)
    if names is None:
        collected: list[str] = []
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            if isinstance(slots, str):
                slots = (slots,)
            collected.extend(s for s in slots if s not in collected)
        names = _slot_cache[cls] = tuple(collected)
    return names


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _attr_site(owner: type, name: Any) -> str:
    return f"{owner.__name__}.{name}"[:MAX_SITE_LEN] if isinstance(name, str) else f"{owner.__name__}[]"


def _dict_site(site: str, key: Any) -> str:
    # A plain dict below an attribute keeps the attribute's site; a root dict names its keys only
    # when they look like identifiers (program structure, not data).
    if site != "root":
        return site
    if isinstance(key, str) and key.isidentifier() and len(key) <= 40:
        return f"dict.{key}"
    return "dict[]"


def _short_repr(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 40 else text[:37] + "..."
