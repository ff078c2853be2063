"""Hostile and odd object graphs: the walk runs none of the program's code, one bad
member costs only itself, every real array that is reachable is counted, and a walk is bounded.

Every hostile method records its call in ``CALLS`` once ``ARMED`` (building a graph may hash
keys, print it, ...), then raises, raises ``KeyboardInterrupt``/``SystemExit``, or blocks (on an
Event with a timeout, so that a test that fails cannot hang). The truth is what the test placed:
the arrays put into ``__dict__`` entries, slots and containers, not those that only a property or
``__getattr__`` returns.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import tracemalloc

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_watchdog import Watchdog, find_arrays, materialize
from mlx_watchdog.core import arrays as introspect
from mlx_watchdog.core.arrays import resolve, scan
from mlx_watchdog.core.graph import account, is_evaluated

CALLS: list[str] = []
ARMED = [False]
BLOCK = threading.Event()  # never set
HOW = ("raise", "interrupt", "exit", "block")
WALK_BYTES = 16 << 20

# MLX warns when an uninitialized array is touched: the walk does so once, to tell it apart.
pytestmark = pytest.mark.filterwarnings("ignore:nanobind. attempted to access an uninitialized instance")


def act(what: str, how: str) -> None:
    """What a hostile method does once armed."""
    CALLS.append(what)
    if how == "raise":
        raise RuntimeError(f"hostile {what}")
    if how == "interrupt":
        raise KeyboardInterrupt(f"hostile {what}")
    if how == "exit":
        raise SystemExit(f"hostile {what}")
    BLOCK.wait(0.5)


class armed:
    """Arms the hostile methods; a KeyboardInterrupt or SystemExit that escapes is a failure
    (not the end of the test session)."""

    def __enter__(self):
        CALLS.clear()
        ARMED[0] = True

    def __exit__(self, kind, exc, tb):
        ARMED[0] = False
        if kind is not None and not issubclass(kind, Exception):
            pytest.fail(f"{kind.__name__} raised by a walked object escaped: {exc}")


def hook(base: type, name: str, how: str):
    """A method ``name`` that misbehaves once armed and otherwise does what ``base``'s does."""
    normal = getattr(base, name, None)
    label = f"{base.__name__}.{name}"

    def method(self, *args, **kwargs):
        if ARMED[0]:
            act(label, how)
        if normal is None:  # __getattr__, __missing__, __len__ of an object...
            raise (KeyError if name == "__missing__" else AttributeError)(name)
        return normal(self, *args, **kwargs)

    return method


def hostile_property(name: str, how: str, normal=None):
    def get(self):
        if ARMED[0]:
            act(f"property {name}", how)
        return normal(self) if normal else DECOY

    return property(get)


DECOY = mx.array(-1)  # what properties return: never counted

OBJECT_HOOKS = (
    "__getattribute__",
    "__getattr__",
    "__repr__",
    "__str__",
    "__eq__",
    "__hash__",
    "__format__",
    "__len__",
    "__bool__",
    "__iter__",
    "__dir__",
    "__sizeof__",
    "__reduce_ex__",
)
CONTAINER_HOOKS = {
    list: (
        "__iter__",
        "__getitem__",
        "__len__",
        "__bool__",
        "copy",
        "__reversed__",
        "__repr__",
        "__getattribute__",
        "__eq__",
        "__contains__",
    ),
    tuple: ("__iter__", "__getitem__", "__len__", "__repr__", "__getattribute__", "__eq__", "__hash__"),
    dict: (
        "items",
        "keys",
        "values",
        "__iter__",
        "__getitem__",
        "get",
        "copy",
        "__len__",
        "__missing__",
        "__repr__",
        "__getattribute__",
        "__eq__",
        "__contains__",
    ),
    collections.OrderedDict: ("items", "keys", "values", "__iter__", "__getitem__", "__len__", "__repr__"),
}


class HostileMeta(type):
    """A metaclass whose every hook misbehaves once armed: reading a class through it would run it."""


for _name in (
    "__getattribute__",
    "__repr__",
    "__eq__",
    "__hash__",
    "__instancecheck__",
    "__subclasscheck__",
    "__len__",
    "__iter__",
    "mro",
):
    setattr(HostileMeta, _name, hook(type, _name, "raise"))


def hostile_class(base: type, hooks, how: str, spoof: bool, meta: bool, hide_dict: bool):
    ns = {name: hook(base, name, how) for name in hooks}
    ns["state"] = hostile_property("state", how)  # like mlx-lm's LayerCache.state: never read
    if spoof:  # isinstance(o, mx.array) would say True
        ns["__class__"] = hostile_property("__class__", how, normal=lambda self: mx.array)
    if hide_dict:
        ns["__dict__"] = hostile_property("__dict__", how, normal=lambda self: {})
    return (HostileMeta if meta else type)(f"Hostile{base.__name__.title()}", (base,), ns)


class Slotted:
    __slots__ = ("plain", "__private", "shadowed", "__weakref__")


class ShadowsASlot(Slotted):
    """A subclass property over a parent's slot: the slot's value is what the object holds."""

    __slots__ = ()
    shadowed = hostile_property("shadowed", "raise")


class ArraySubclass(mx.array):
    """A real array (mx.array's C++ object is there) whose Python methods misbehave."""

    __repr__ = hook(mx.array, "__repr__", "raise")
    __getattribute__ = hook(mx.array, "__getattribute__", "raise")
    __eq__ = hook(mx.array, "__eq__", "raise")


class NeverInitialized(mx.array):
    def __init__(self):  # skips mx.array's: no C++ array behind it
        pass


class HostileKey:
    """A dict key whose hash, equality and repr misbehave once armed."""

    def __init__(self, n):
        self.n = n

    __hash__ = hook(object, "__hash__", "raise")
    __eq__ = hook(object, "__eq__", "raise")
    __repr__ = hook(object, "__repr__", "raise")


# --------------------------------------------------------------------------- graph builder


class Graph:
    """Builds one hostile graph and the truth: the arrays placed where the program holds them."""

    def __init__(self, data):
        self.data = data
        self.truth: dict[int, mx.array] = {}
        self.containers: list = []  # where back edges can go
        self.mutable: list = []  # plain containers a thread may mutate while walked
        self.counter = itertools.count()

    def array(self):
        n = next(self.counter)
        kind = self.data.draw(st.sampled_from(["evaluated", "pending", "subclass", "uninitialized"]))
        if kind == "uninitialized":
            return NeverInitialized()  # not a real array: not counted, not fatal
        a = mx.array(n) if kind != "subclass" else ArraySubclass(n)
        if kind == "pending":
            a = a + 1
        else:
            mx.eval(a)
        self.truth[id(a)] = a
        return a

    def node(self, depth: int):
        draw = self.data.draw
        if depth >= 5:
            return self.array() if draw(st.booleans()) else draw(st.sampled_from([0, "s", None, 1.5]))
        kind = draw(
            st.sampled_from(
                [
                    "array",
                    "atom",
                    "list",
                    "tuple",
                    "dict",
                    "deque",
                    "object",
                    "slots",
                    "list_sub",
                    "tuple_sub",
                    "dict_sub",
                    "ordered",
                    "huge",
                    "decoy",
                ]
            )
        )
        if kind == "array":
            return self.array()
        if kind == "atom":
            return draw(st.sampled_from([0, -7, "text", b"b", None, 2.5, True, range(3)]))
        if kind == "huge":  # no arrays in it: skipped whole, quickly
            return list(range(introspect.MAX_ITEMS + 1))
        if kind == "decoy":  # only reachable through a property or __getattr__: not held
            return hostile_class(object, ("__getattr__",), "raise", False, False, False)()
        children = [self.node(depth + 1) for _ in range(draw(st.integers(0, 4)))]
        how = draw(st.sampled_from(HOW))
        if kind in ("list", "tuple", "deque", "dict"):
            value = self._plain(kind, children)
        elif kind in ("list_sub", "tuple_sub", "dict_sub", "ordered"):
            value = self._subclass(kind, children, how)
        elif kind == "slots":
            value = ShadowsASlot() if draw(st.booleans()) else Slotted()
            for name, child in zip(("plain", "_Slotted__private", "shadowed"), children):
                Slotted.__dict__[name].__set__(value, child)
            for child in children[3:]:
                self._untruth(child)  # no slot for it
        else:
            cls = hostile_class(
                object,
                draw(st.sets(st.sampled_from(OBJECT_HOOKS), max_size=5)),
                how,
                spoof=draw(st.booleans()),
                meta=draw(st.booleans()),
                hide_dict=draw(st.booleans()),
            )
            value = cls()
            for i, child in enumerate(children):
                object.__setattr__(value, f"a{i}" if i % 2 else f"_{cls.__name__}__p{i}", child)
        if kind != "tuple" and kind != "tuple_sub":
            self.containers.append(value)
        return value

    def _plain(self, kind, children):
        if kind == "dict":
            keys = self.data.draw(
                st.sampled_from([["pos", "keys", "values", "x", "y"], ["a b", "7", "é", "k", "__x"]])
            )
            value = dict(zip(keys, children))
            for child in children[len(keys) :]:
                self._untruth(child)
        else:
            value = {"list": list, "tuple": tuple, "deque": collections.deque}[kind](children)
        if kind in ("list", "dict") and self.data.draw(st.booleans()):
            self.mutable.append(value)
        return value

    def _subclass(self, kind, children, how):
        base = {"list_sub": list, "tuple_sub": tuple, "dict_sub": dict, "ordered": collections.OrderedDict}[
            kind
        ]
        hooks = self.data.draw(st.sets(st.sampled_from(CONTAINER_HOOKS[base]), min_size=1))
        cls = hostile_class(
            base, hooks, how, spoof=False, meta=self.data.draw(st.booleans()), hide_dict=False
        )
        if base is list:
            value = cls()
            list.extend(value, children)
            return value
        if base is tuple:
            return tuple.__new__(cls, children)
        value = cls()
        for i, child in enumerate(children):
            key = [HostileKey(i), f"alice{i}@example.com: my password is hunter{i}", i, f"k{i}"][i % 4]
            dict.__setitem__(value, key, child)
        return value

    def _untruth(self, child):
        """``child`` was not placed after all: its arrays are not in the truth (unless placed twice)."""
        for _, a in find_arrays([child]):
            self.truth.pop(id(a), None)

    def build(self):
        root = self.node(0)
        holder = [root]
        for c in self.containers[: self.data.draw(st.integers(0, 3))]:  # cycles back to the root
            if type(c) is list:
                c.append(holder)
            elif type(c) is dict:
                c["back"] = holder
        return holder if self.data.draw(st.booleans()) else root


class Mutator:
    """A thread that mutates plain containers of the graph (adding and removing ints) while walked."""

    def __init__(self, containers):
        self.containers, self.stop = containers, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            for c in self.containers:
                if type(c) is list:
                    c.append(0)
                    c.pop()
                else:
                    c[12345] = 0
                    del c[12345]
            time.sleep(0)

    def __enter__(self):
        if self.containers:
            self.thread.start()

    def __exit__(self, *exc):
        self.stop.set()
        if self.containers:
            self.thread.join(5)


def bounded_walk(walk):
    """The walk's peak memory is bounded. (Its time is not a test's: a blocking call it made is
    in CALLS, whatever the machine's speed.)"""
    tracemalloc.start()
    try:
        result = walk()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < WALK_BYTES, peak
    return result


# --------------------------------------------------------------------------- the property test


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(st.data())
def test_hostile_graphs_are_walked_without_their_code_and_every_placed_array_is_counted(data):
    graph = Graph(data)
    root = graph.build()
    truth = graph.truth
    pending = [a for a in truth.values() if not is_evaluated(a)]
    exact = account(list(truth.values())) if truth else None
    wd = Watchdog(limit=10**6, export=False)
    with Mutator(graph.mutable):
        with armed():
            found = bounded_walk(lambda: find_arrays(root))
            result = scan(root)
            wd.observe(root)
            scheduled = bounded_walk(lambda: materialize(root))
    assert CALLS == [], "the walk ran the program's code"
    ids = [id(a) for _, a in found]
    assert len(ids) == len(set(ids)) and set(ids) == set(truth)
    for f in result.found:  # every path leads back to its array, still without user code
        if all(kind in ("attr", "item") for kind, _ in f.steps):
            with armed():
                assert resolve(root, f.steps) is f.array
    assert CALLS == []
    assert wd.steps == 1 and wd.walks == 1 and wd.internal_errors == 0
    if exact is not None:
        assert wd.forecast().resident_buffers == exact.evaluated_arrays + exact.retained_buffers
    assert scheduled == len(pending) and all(is_evaluated(a) for a in truth.values())


# --------------------------------------------------------------------------- cases one by one


def test_a_list_of_3_million_ints_is_skipped_quickly_counted_and_logged(caplog):
    class Cache:
        def __init__(self):
            self.tokens = list(range(3_000_000))
            self.keys = mx.array(1) + 1

    cache = Cache()
    caplog.set_level(logging.WARNING, logger="mlx_watchdog")
    introspect._logged.clear()
    result = bounded_walk(lambda: scan([cache]))
    assert [f.path for f in result.found] == ["[0].keys"]
    assert result.cut == {"huge": 1} and result.skipped == ["[0].tokens (list: 3,000,000 items)"]
    assert any("not walked" in r.getMessage() and "[0].tokens" in r.getMessage() for r in caplog.records)
    wd = Watchdog(limit=10**6, export=False)
    bounded_walk(lambda: wd.observe([cache]))
    assert wd.walks == 1 and wd.internal_errors == 0 and wd.forecast().resident_buffers == 2


def test_the_walk_stops_looking_once_its_item_budget_is_spent(monkeypatch):
    monkeypatch.setattr(introspect, "MAX_WALK_ITEMS", 1000)
    first, second = mx.array(1), mx.array(2)
    roots = [[first] + [0] * 600, [second] + [0] * 600]  # 601 + 601 items: the second does not fit
    result = scan(roots)
    assert [id(f.array) for f in result.found] == [id(first)]
    assert result.cut == {"items": 1}


def test_a_dict_subclass_is_read_without_its_methods_and_its_keys_stay_out_of_the_labels():
    class Rows(collections.OrderedDict):
        pass

    for name in CONTAINER_HOOKS[collections.OrderedDict] + ("get", "copy", "__missing__", "__contains__"):
        setattr(Rows, name, hook(collections.OrderedDict, name, "raise"))

    class Cache:
        def __init__(self):
            self.rows = Rows()
            self.meta = {"pos": mx.array(0), "alice@example.com": mx.array(1)}

    cache = Cache()
    secret = "alice0@example.com: my password is hunter0"
    placed = [mx.array(i) for i in range(4)]
    for key, a in zip([secret, HostileKey(1), 12345, "bob"], placed):
        dict.__setitem__(cache.rows, key, a)
    with armed():
        found = scan([cache]).found
    assert CALLS == []
    assert {id(f.array) for f in found} >= {id(a) for a in placed}
    by_path = {f.path: f.site for f in found}
    assert by_path == {
        "[0].rows[<key 0>]": "Cache.rows",
        "[0].rows[<key 1>]": "Cache.rows",
        "[0].rows[<key 2>]": "Cache.rows",
        "[0].rows[<key 3>]": "Cache.rows",
        "[0].meta['pos']": "Cache.meta",
        "[0].meta[<key 1>]": "Cache.meta",
    }
    # At the root, a user dict's keys are no site either; a plain dict's identifier keys are.
    assert {f.site for f in scan(cache.rows).found} == {"Rows[]"}
    assert {f.site for f in scan(cache.meta).found} == {"dict.pos", "dict[]"}


def test_no_key_text_of_a_user_dict_reaches_the_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from mlx_watchdog.exporters.prometheus import WatchdogCollector

    class Sessions(dict):
        pass

    class Cache:
        def __init__(self):
            self.by_user = Sessions(
                {f"alice{i}@example.com: my password is hunter{i}": mx.array(0) for i in range(3)}
            )
            self.by_user["alice"] = mx.array(0)  # looks like a name, but is a user dict's key
            self.by_user[7] = mx.array(0)

        def step(self):
            for key, value in list(dict.items(self.by_user)):
                self.by_user[key] = value - 1  # a leak: +5 buffers a step

    cache = Cache()
    wd = Watchdog(limit=10**6, export=False, overhead_budget=1.0, walk_interval=0, name="labels")
    for _ in range(40):
        wd.observe(cache)
        cache.step()
    leaks = wd.forecast().leaks
    assert [leak.site for leak in leaks] == ["Cache.by_user"]
    assert leaks[0].buffers_per_step == pytest.approx(5)
    assert not any("alice" in p or "hunter" in p or "7" in p for p in leaks[0].paths), leaks[0].paths
    registry = CollectorRegistry()
    registry.register(WatchdogCollector([wd]))
    text = generate_latest(registry).decode()
    assert 'site="Cache.by_user"' in text
    assert "alice" not in text and "hunter" not in text and "example.com" not in text


def test_slots_private_and_shadowed_are_read_where_the_object_holds_them():
    obj = ShadowsASlot()
    plain, private, shadowed = mx.array(1), mx.array(2), mx.array(3)
    for name, a in zip(("plain", "_Slotted__private", "shadowed"), (plain, private, shadowed)):
        Slotted.__dict__[name].__set__(obj, a)
    with armed():
        found = {f.path: f for f in scan(obj).found}
    assert CALLS == []
    assert {p: f.array for p, f in found.items()} == {
        "plain": plain,
        "_Slotted__private": private,
        "shadowed": shadowed,
    }
    assert found["shadowed"].site == "ShadowsASlot.shadowed"
    assert resolve(obj, found["shadowed"].steps) is shadowed  # the slot, not the property (DECOY)


def test_an_object_that_spoofs_mx_array_or_hides_its_dict_is_walked_as_an_object():
    cls = hostile_class(
        object, ("__getattribute__", "__repr__"), "raise", spoof=True, meta=True, hide_dict=True
    )
    obj = cls()
    inside = mx.array(5)
    object.__setattr__(obj, "keys", inside)
    wd = Watchdog(limit=10**6, export=False)
    with armed():
        found = find_arrays([obj, mx.array(6)])
        wd.observe([obj])
    assert CALLS == []
    assert [(p, a) for p, a in found if a is inside] == [("[0].<hidden 0>", inside)]
    assert len(found) == 2
    assert wd.walks == 1 and wd.internal_errors == 0 and wd.forecast().resident_buffers == 1


def test_a_keyboard_interrupt_or_exit_in_a_walked_object_cannot_escape_observe():
    for how in ("interrupt", "exit"):
        cls = hostile_class(list, CONTAINER_HOOKS[list], how, spoof=False, meta=False, hide_dict=False)
        roots = cls()
        list.extend(roots, [hostile_class(object, OBJECT_HOOKS, how, True, True, False)(), mx.array(1) + 1])
        with armed():
            assert materialize(roots) == 1
        wd = Watchdog(limit=10**6, export=False, fix=True, fix_every=1)
        for _ in range(12):
            with armed():
                wd.observe(roots)
            list.__setitem__(roots, 1, list.__getitem__(roots, 1) + 1)  # the program's step
        assert CALLS == [] and wd.steps == 12 and wd.walks >= 1 and wd.internal_errors == 0
        assert wd.materialized_arrays >= 1


def test_an_array_that_cannot_be_evaluated_here_costs_only_itself():
    # An array made on another thread's stream: MLX refuses to evaluate it on this thread.
    box = {}

    def make():
        with mx.stream(mx.new_stream(mx.cpu)):
            box["a"] = mx.array(1) + 1

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    with pytest.raises(RuntimeError):
        mx.async_eval(box["a"])
    others = [mx.array(i) + 1 for i in range(200)]
    assert materialize([others[:100], box["a"], others[100:]]) == 200  # the others are evaluated
    assert all(is_evaluated(a) for a in others) and not is_evaluated(box["a"])
    roots = [{"pos": box["a"]}, {"pos": mx.array(2) + 1}]
    roots[1]["pos"] = mx.array(3) + 1
    wd = Watchdog(limit=10**6, export=False, fix=True, fix_every=1)
    for _ in range(12):
        wd.observe(roots)
        roots[1]["pos"] = roots[1]["pos"] + 1
    assert wd.steps == 12 and wd.walks >= 1 and wd.internal_errors == 0
    assert wd.fix_failures >= 1 and wd.materialized_arrays >= 1
    from mlx_watchdog.exporters.prometheus import WatchdogCollector

    exported = {s.name: s.value for family in WatchdogCollector([wd]).collect() for s in family.samples}
    assert exported["mlx_watchdog_fix_failures_total"] == wd.fix_failures  # and a scrape says so


def test_an_array_never_initialized_is_skipped_alone():
    roots = [NeverInitialized(), mx.array(1) + 1]
    result = scan(roots)
    assert [id(f.array) for f in result.found] == [id(roots[1])] and result.cut == {"error": 1}
    wd = Watchdog(limit=10**6, export=False)
    wd.observe(roots)
    assert wd.walks == 1 and wd.internal_errors == 0 and wd.forecast().resident_buffers == 2


def test_more_than_1024_arrays_are_read_exactly_through_observe(monkeypatch, fake_clock):
    # mx.export_to_dot takes at most 1,024 keyword arguments: 3,000 arrays are walked in batches.
    import exact_buffers
    from support import missing

    class Layer:
        def __init__(self, i):
            self.keys = mx.array([i, i])  # evaluated: 1 buffer
            self.offset = mx.array(i) + 1  # pending: holds mx.array(i) and the 1, 2 buffers
            mx.eval(self.keys)

        def step(self):
            self.offset = self.offset - 1  # strands one more scalar

    try:
        counter = exact_buffers.install()
    except RuntimeError as exc:
        counter = None
        reason = f"the exact live-buffer counter cannot be installed: {exc}"
    wd = Watchdog(limit=10**7, export=False, overhead_budget=1.0, walk_interval=0)
    baseline = counter.live(collect=True) if counter else 0
    layers = [Layer(i) for i in range(1500)]
    readings = []
    # A new decode is walked densely at first (schedule.py): on the fake clock (steps 10 ms apart,
    # walks free) 18 steps hold six readings on any machine. (Timed for real, a loaded machine's
    # walks of 1,500 layers spent the budget: two readings.)
    fake_clock.step_each_observe(monkeypatch, 0.01)
    for step in range(18):
        wd.observe(layers)
        if wd.forecast().measured_step == wd.steps:
            truth = counter.live() - baseline if counter else None
            readings.append((step, wd.forecast().resident_buffers, truth))
        for layer in layers:
            layer.step()
    assert wd.internal_errors == 0 and len(readings) >= 3, (readings, wd.walks)
    assert [r for _, r, _ in readings] == [4500 + 1500 * step for step, _, _ in readings]  # by construction
    assert wd.forecast().buffers_per_step == 1500
    if counter is None:
        missing(reason)
    assert [t for _, _, t in readings] == [r for _, r, _ in readings]  # and by MLX's allocator
