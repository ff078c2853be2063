"""Read an object's members without running any of its code.

Attribute access (``o.x``, ``o.__dict__``, ``o.__class__``, ``isinstance``), iteration, ``len``,
``repr``, hashing and comparison can all run code of the watched program: a property, an
overridden ``__getattribute__``, ``__iter__`` or ``items``, a key's ``__eq__``. Any of it may
raise, block, allocate or have side effects. So the walk reads only at the level of types:

* ``type(o)`` and the slots of ``type`` itself (its MRO, its ``__dict__``, its name), read
  through ``type``'s own descriptors so that a metaclass cannot intercept them;
* an instance's ``__dict__`` through the builtin descriptor its class got from CPython (a
  property named ``__dict__`` is skipped, not called), and its ``__slots__`` through their
  member descriptors, found in the class dicts along the MRO (private ``_Cls__x`` included);
* containers, subclasses included, through the unbound methods of the builtin they derive from
  (``dict.items``, ``list.copy``, ``tuple.__iter__``...), which read the storage directly. Not
  ``dict.copy`` nor ``dict.__getitem__``: on a subclass they call its ``keys`` / ``__missing__``.

Reading must not change the program's speed either. From CPython 3.11 an instance keeps its
attributes inline, with no dict object, until something asks for its ``__dict__``; from then on it
carries a real dict, and every attribute access the program makes on it is slower for good
(docs/internals.md has the cost). So instance attributes are read by name, with
``object.__getattribute__`` (it reads inline values as they are), the names being those the class's
own code assigns. The garbage collector's view of the object (``gc.get_referents``: its values,
nameless, read in C) tells whether those names read all it holds; only an object holding something
they miss has its ``__dict__`` read, and its names are learnt for the other instances of its class.
"""

from __future__ import annotations

import collections
import dis
import gc
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import mlx.core as mx

_mro = type.__dict__["__mro__"].__get__
_type_dict = type.__dict__["__dict__"].__get__
_type_name = type.__dict__["__name__"].__get__
_dict_offset = type.__dict__["__dictoffset__"].__get__
_GETSET = types.GetSetDescriptorType
_MEMBER = types.MemberDescriptorType

# What a type is to the walk; kinds above OPAQUE may hold arrays.
ATOM, OPAQUE, ARRAY, DICT, SEQUENCE, SET, OBJECT = range(7)

# Values that cannot hold arrays, and code/library objects that are not data.
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
# (base, its unbound snapshot function, its unbound len); a subclass is read as its base.
_CONTAINERS = (
    (dict, DICT, lambda d: list(dict.items(d)), dict.__len__),
    (list, SEQUENCE, list.copy, list.__len__),
    (tuple, SEQUENCE, lambda t: list(tuple.__iter__(t)), tuple.__len__),
    (collections.deque, SEQUENCE, lambda d: list(collections.deque.__iter__(d)), collections.deque.__len__),
    (set, SET, lambda s: list(set.__iter__(s)), set.__len__),
    (frozenset, SET, lambda s: list(frozenset.__iter__(s)), frozenset.__len__),
)
_GETITEM: dict[type | None, Callable[[Any, int], Any]] = {
    list: list.__getitem__,
    tuple: tuple.__getitem__,
    collections.deque: collections.deque.__getitem__,
}

CODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}\Z")  # an attribute or key that names code
_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,46}\Z")  # keeps "Class.attribute" within 80
_MODULE = ("Module", "mlx.nn.layers.base")  # nn.Module: a dict whose keys are its attributes
MAX_TYPES = 4096  # types remembered; the table starts again when full
MAX_NAMES = 256  # attribute names read by name per class; past that, the instance __dict__ is read
# Inline attribute values (CPython 3.11+): reading __dict__ would turn them into a dict for good.
# False: every instance's __dict__ is read (a test sets it, to show what that does).
INLINE_VALUES = sys.version_info >= (3, 11)
_getattribute = object.__getattribute__


class TypeInfo:
    """What the walk needs to know of one type, found once per type."""

    __slots__ = (
        "cls",
        "kind",
        "name",
        "snapshot",
        "length",
        "base",
        "attrs_dict",
        "hidden_dict",
        "slots",
        "keys_are_names",
        "_candidates",
        "_names",
        "_checked",
    )

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = code_name(_type_name(cls), _CLASS_NAME) or "<class>"
        self.snapshot: Callable[[Any], list] | None = None
        self.length: Callable[[Any], int] | None = None
        self.base: type | None = None
        self.attrs_dict: Any = None  # the builtin descriptor of the instances' __dict__
        self.hidden_dict = False  # instances have a __dict__ that no builtin descriptor reaches
        self.slots: tuple = ()  # (name, member descriptor) along the MRO
        self.keys_are_names = False
        self._candidates: list[str] | None = None  # names that may be instance attributes
        self._names: list[tuple[str, Any]] = []  # of them, those read by name now (see names)
        self._checked = -1  # the walk they were checked at
        self.kind = self._kind(cls)
        if self.kind in (DICT, OBJECT):
            self._find_members(cls)

    def _kind(self, cls: type) -> int:
        # issubclass with builtin classes reads the MRO in C (PyType_IsSubtype); isinstance()
        # would read the object's __class__, which a property can fake.
        if issubclass(cls, mx.array):
            return ARRAY
        if issubclass(cls, _ATOMS):
            return ATOM
        if issubclass(cls, _OPAQUE):
            return OPAQUE
        for base, kind, snapshot, length in _CONTAINERS:
            if issubclass(cls, base):
                self.base, self.snapshot, self.length = base, snapshot, length
                return kind
        return OBJECT

    def _find_members(self, cls: type) -> None:
        slots: list[tuple[str, Any]] = []
        for klass in _mro(cls):
            for name, value in list(types.MappingProxyType.items(_type_dict(klass))):
                kind = type(value)
                if type(name) is not str:
                    continue
                if name == "__dict__":
                    # The first builtin one of this class's own line: a property named __dict__
                    # is user code, a descriptor copied from another class does not apply.
                    if (
                        self.attrs_dict is None
                        and (kind is _GETSET or kind is _MEMBER)
                        and _derives(cls, value.__objclass__)
                    ):
                        self.attrs_dict = value
                elif kind is _MEMBER and name != "__weakref__" and all(value is not s for _, s in slots):
                    slots.append((name, value))  # a slot a subclass shadows is still read
                elif (
                    name == "__module__"
                    and type(value) is str
                    and value == _MODULE[1]
                    and code_name(_type_name(klass)) == _MODULE[0]
                ):
                    self.keys_are_names = True
        self.slots = tuple(slots)
        self.hidden_dict = self.attrs_dict is None and _dict_offset(cls) != 0

    @property
    def names(self) -> list[tuple[str, Any]]:
        """(name, class-level default or _MISSING) of the instance attributes read by name: those
        the class's code assigns (found once, in its bytecode), then those learnt from a
        ``__dict__`` read. Only names ``object.__getattribute__`` reads without running code,
        checked again at each walk: a property added to the class since would run."""
        if self._checked != _walks:
            readable = [(n, _class_default(self.cls, n)) for n in self._candidate_names()]
            self._names = [(n, d) for n, d in readable if d is not _UNREADABLE]
            self._checked = _walks
        return self._names

    def learn(self, keys: list) -> None:
        """Names found in an instance ``__dict__`` (one the names read missed)."""
        with _learn_lock:
            candidates = self._candidate_names()
            known = set(candidates)
            new = [k for k in keys if type(k) is str and k not in known]  # builtin str: no code hashed
            if new and len(known) < MAX_NAMES:
                self._candidates = candidates + new[: MAX_NAMES - len(known)]
                self._checked = -1

    def _candidate_names(self) -> list[str]:
        # Found on first use, learnt or read: a __dict__ read first must not drop the class's names.
        if self._candidates is None:
            self._candidates = _assigned_names(self.cls)
        return self._candidates


_walks = 0  # walks begun (begin_walk): TypeInfo re-checks its names once per walk
_learn_lock = threading.Lock()


def begin_walk() -> None:
    global _walks
    _walks += 1


_UNREADABLE = object()


def _class_default(cls: type, name: str) -> Any:
    """What ``object.__getattribute__(instance, name)`` finds on the class when the instance has no
    such attribute: _MISSING (nothing), a plain value (a class-level default), or _UNREADABLE
    when it is a descriptor (a property, a method): reading it could run the program's code."""
    for klass in _mro(cls):
        found = types.MappingProxyType.get(_type_dict(klass), name, _MISSING)
        if found is not _MISSING:
            described = any("__get__" in _type_dict(k) for k in _mro(type(found)))
            return _UNREADABLE if described else found
    return _MISSING


def _assigned_names(cls: type) -> list[str]:
    """The attribute names the class's functions (along its MRO) assign, in the order first seen:
    ``self.keys = ...`` in ``__init__`` is STORE_ATTR ``keys`` in its bytecode. None found (an
    odd class): its instances' ``__dict__`` is read, and the names learnt there."""
    try:
        return _stored_names(cls)
    except Exception:
        return []


def _stored_names(cls: type) -> list[str]:
    codes: list[types.CodeType] = []
    for klass in _mro(cls):
        for value in list(types.MappingProxyType.values(_type_dict(klass))):
            kind = type(value)
            if kind is staticmethod or kind is classmethod:
                value, kind = value.__func__, type(value.__func__)
            functions = (value.fget, value.fset, value.fdel) if kind is property else (value,)
            codes.extend(f.__code__ for f in functions if type(f) is types.FunctionType)
    names: dict[str, None] = {}
    while codes and len(names) < MAX_NAMES:
        code = codes.pop(0)
        codes.extend(c for c in code.co_consts if type(c) is types.CodeType)  # closures, comprehensions
        for instruction in dis.get_instructions(code):
            if instruction.opname == "STORE_ATTR" and type(instruction.argval) is str:
                names.setdefault(instruction.argval, None)
    return list(names)[:MAX_NAMES]


def _derives(cls: type, base: Any) -> bool:
    # Not issubclass(): with a class of the program as its second argument it calls that class's
    # metaclass's __subclasscheck__.
    return any(klass is base for klass in _mro(cls))


_types: dict[int, TypeInfo] = {}  # by id: hashing a class could run its metaclass's __hash__


def info(cls: type) -> TypeInfo:
    entry = _types.get(id(cls))
    if entry is None or entry.cls is not cls:
        if len(_types) >= MAX_TYPES:
            _types.clear()
        entry = _types[id(cls)] = TypeInfo(cls)
    return entry


def type_name(value: Any) -> str:
    """The name of ``value``'s class, or a placeholder when it is not a plain identifier."""
    return info(type(value)).name


def code_name(value: Any, pattern: re.Pattern = CODE_NAME) -> str | None:
    """``value`` when it is a builtin ``str`` that looks like a name in code, else None."""
    if type(value) is str and pattern.match(value):
        return value
    return None


def attributes(value: Any, t: TypeInfo, limit: int) -> list[tuple[str, Any, Any]] | None:
    """(name, step key, value) of each instance attribute and each set slot (the step key of a
    slot is its descriptor: a subclass may reuse its name); None past ``limit``."""
    out = []
    for name, slot in t.slots:
        try:
            out.append((name, slot, slot.__get__(value, t.cls)))
        except (AttributeError, TypeError):  # an unset slot; one copied from an unrelated class
            continue
    if t.attrs_dict is None:
        return out
    entries = _named_attributes(value, t, [child for _, _, child in out], limit) if INLINE_VALUES else None
    if entries is None:  # read by name is off (INLINE_VALUES), or the names missed something
        attrs = _instance_dict(value, t)
        if attrs is None:
            return out
        if dict.__len__(attrs) > limit:
            return None
        entries = list(dict.items(attrs))
        t.learn([key for key, _ in entries])
    elif len(entries) > limit:
        return None
    return [(key, key, child) for key, child in entries] + out


def _named_attributes(value: Any, t: TypeInfo, covered: list, limit: int) -> list[tuple[str, Any]] | None:
    """The instance attributes read by name, or None when the object holds something else that
    may hold arrays (set by code outside its class, under a name not seen yet). ``covered``:
    what the caller reads otherwise (slots)."""
    length = t.length  # set with snapshot, for containers
    if t.snapshot is not None and length is not None and length(value) > limit:
        return None  # a huge container subclass: not copied twice
    entries, read = [], {id(child) for child in covered}
    for name, default in t.names:
        try:
            child = _getattribute(value, name)
        except AttributeError:  # not set on this instance
            continue
        except Exception:  # an extension type's own lookup refused it
            return None
        if child is not default:  # not the class-level default
            entries.append((name, child))
            read.add(id(child))
    if t.snapshot is not None:  # a container subclass: its items are read as items
        for item in t.snapshot(value):
            read.update(map(id, item) if t.kind == DICT else (id(item),))
    for held in gc.get_referents(value):  # values, slots, items, the class (3.11+: no dict made)
        if held is not t.cls and id(held) not in read and info(type(held)).kind > OPAQUE:
            return None
    return entries


def hidden_values(value: Any, limit: int) -> list[Any] | None:
    """The values of an instance ``__dict__`` hidden behind a property: what the garbage
    collector sees the object hold (C code, no names), less its class; None past ``limit``."""
    cls = type(value)
    held = gc.get_referents(value)
    return None if len(held) > limit else [v for v in held if v is not cls]


_ndim = mx.array.__dict__["ndim"].__get__
_shape = mx.array.__dict__["shape"].__get__


def array_shape(array: mx.array) -> tuple[int, ...]:
    """The array's shape through ``mx.array``'s own descriptor: a subclass's attribute hooks
    (``__getattribute__``, a ``shape`` property) are the program's code, never run by a walk."""
    return tuple(_shape(array))


def usable_array(value: Any) -> bool:
    """Is this array's C++ object there? A subclass whose ``__init__`` skips ``mx.array``'s
    makes every MLX call that gets it fail (one such array would fail a whole graph export)."""
    try:
        _ndim(value)
        return True
    except Exception:
        return False


def item(container: Any, key: Any) -> Any:
    """``container[key]`` for a builtin container or a subclass, without its code: a str key is
    looked up, any other key is found by identity (hashing or comparing it could run its code)."""
    t = info(type(container))
    if t.kind == DICT:
        if type(key) is str:
            value = dict.get(container, key, _MISSING)
            if value is not _MISSING:
                return value
        else:
            for k, value in dict.items(container):
                if k is key:
                    return value
        raise KeyError("no such key")
    getitem = _GETITEM.get(t.base)
    if getitem is None or type(key) is not int:
        raise LookupError(f"{t.name} is no sequence")
    return getitem(container, key)


def attribute(value: Any, step: Any) -> Any:
    """The attribute an ``("attr", name)`` or ``("slot", descriptor)`` step names."""
    t = info(type(value))
    if type(step) is _MEMBER:
        return step.__get__(value, t.cls)
    if INLINE_VALUES and type(step) is str and t.attrs_dict is not None:
        default = _class_default(t.cls, step)  # checked now: the fix follows paths between walks
        if default is not _UNREADABLE:  # read by name, as the walk found it (no __dict__ made)
            try:
                found = _getattribute(value, step)
            except AttributeError:
                raise AttributeError("no such attribute") from None
            if found is default:  # the class's own value, not the instance's
                raise AttributeError("no such attribute")
            return found
    attrs = _instance_dict(value, t)
    found = _MISSING if attrs is None else dict.get(attrs, step, _MISSING)
    if found is _MISSING:
        raise AttributeError("no such attribute")
    return found


def _instance_dict(value: Any, t: TypeInfo) -> dict | None:
    if t.attrs_dict is None:
        return None
    attrs = t.attrs_dict.__get__(value, t.cls)
    return attrs if issubclass(type(attrs), dict) else None  # may be a dict subclass: read as a dict


_MISSING = object()
