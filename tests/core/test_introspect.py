"""find_arrays / scan: every reachable array once, with a path, on any object graph."""

import dataclasses
import gc
import sys

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog import find_arrays
from mlx_watchdog.core.arrays import resolve, scan


class Slotted:
    __slots__ = ("keys", "rows", "unset")

    def __init__(self):
        self.keys = mx.zeros((2,))
        self.rows = [mx.ones((1,))]


@dataclasses.dataclass
class Meta:
    pos: mx.array
    name: str = "m"


class Exploding:
    """An object whose attribute access raises: the walk must not."""

    def __init__(self):
        self.ok = mx.array(1)

    @property
    def state(self):  # properties are never invoked
        raise AssertionError("property was invoked")


class HostileDict:
    @property
    def __dict__(self):
        raise RuntimeError("no dict for you")


def test_paths_sites_and_no_property_calls():
    cache = [Slotted(), {"meta": Meta(mx.array(3))}, Exploding()]
    found = {f.path: f for f in scan(cache).found}
    assert set(found) == {"[0].keys", "[0].rows[0]", "[1]['meta'].pos", "[2].ok"}
    assert found["[0].keys"].site == "Slotted.keys"
    assert found["[0].rows[0]"].site == "Slotted.rows"
    assert found["[1]['meta'].pos"].site == "Meta.pos"
    for f in found.values():
        assert resolve(cache, f.steps) is f.array


def test_shared_arrays_and_cycles_counted_once():
    a = mx.array([1.0])
    node = {"a": a, "b": a}
    node["self"] = node
    lst = [node, node, [a]]
    lst.append(lst)
    assert [p for p, _ in find_arrays(lst)] == ["[0]['a']"]


def test_opaque_objects_and_hostile_access_do_not_break_the_walk():
    import math

    roots = [math, len, int, print, HostileDict(), Exploding(), (x for x in range(3))]
    result = scan(roots)
    assert [f.path for f in result.found] == ["[5].ok"]
    assert result.cut == {}  # the hostile __dict__ property is never called, so nothing fails


def test_deep_and_wide_graphs_are_bounded_and_reported():
    deep = mx.array(0)
    for _ in range(500):
        deep = [deep]
    result = scan(deep, max_depth=64)
    assert result.found == [] and result.cut["depth"] == 1

    wide = [[mx.array(i)] for i in range(2000)]
    result = scan(wide, max_objects=100)
    assert result.truncated and result.cut["objects"] > 0
    assert len(result.found) == 99  # root list + 99 inner lists were walked


def test_module_roots_are_walked_as_dicts():
    import mlx.nn as nn

    layer = nn.Linear(2, 3)
    paths = {p for p, _ in find_arrays(layer)}
    assert paths == {"['weight']", "['bias']"}


# ---------------------------------------------------------------- property-based


def _structures():
    leaves = st.one_of(
        st.integers(),
        st.text(max_size=3),
        st.none(),
        st.builds(lambda v: mx.array(v), st.integers(-5, 5)),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.tuples(children, children),
            st.dictionaries(st.text(min_size=1, max_size=3), children, max_size=4),
            st.builds(_Obj, children, children),
        ),
        max_leaves=25,
    )


class _Obj:
    def __init__(self, left, right):
        self.left, self.right = left, right


def _expected_arrays(obj, seen=None):
    """Reference: a plain recursive walk (arrays by identity)."""
    seen = set() if seen is None else seen
    if isinstance(obj, mx.array):
        return {id(obj)}
    if id(obj) in seen or isinstance(obj, (int, str, type(None))):
        return set()
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, _Obj):
        items = [obj.left, obj.right]
    else:
        items = []
    out = set()
    for item in items:
        out |= _expected_arrays(item, seen)
    return out


@settings(max_examples=150, deadline=None)
@given(_structures(), st.data())
def test_find_arrays_matches_reference_walk_with_cycles(structure, data):
    root = [structure]
    # Add cycles: make some containers point back to the root.
    containers = [o for o in _containers(structure) if isinstance(o, (list, dict, _Obj))]
    for c in containers[: data.draw(st.integers(0, 3))]:
        if isinstance(c, list):
            c.append(root)
        elif isinstance(c, dict):
            c["cycle"] = root
        else:
            c.back = root
    found = find_arrays(root)
    ids = [id(a) for _, a in found]
    assert len(ids) == len(set(ids)), "each array once"
    assert set(ids) == _expected_arrays(root) | _cycle_free_extra(root)
    result = scan(root)
    for f in result.found:
        assert resolve(root, f.steps) is f.array


def _cycle_free_extra(root):
    return set()  # `back` attributes only point at the root, which adds no new arrays


def _containers(obj, seen=None):
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (int, str, type(None), mx.array)):
        return []
    seen.add(id(obj))
    out = [obj]
    children = (
        obj.values()
        if isinstance(obj, dict)
        else obj
        if isinstance(obj, (list, tuple))
        else ([obj.left, obj.right] if isinstance(obj, _Obj) else [])
    )
    for child in list(children):
        out += _containers(child, seen)
    return out


def test_scan_rejects_nothing_and_handles_empty_roots():
    assert find_arrays(None) == []
    assert find_arrays([]) == []
    assert find_arrays(mx.array(1))[0][0] == "<root>"


@pytest.mark.parametrize("bad", [0, -1])
def test_scan_bounds_must_be_positive_through_watchdog(bad):
    from mlx_watchdog import Watchdog

    with pytest.raises(ValueError, match="max_objects"):
        Watchdog(max_objects=bad)


# --- Reading leaves the program's objects as they were (no __dict__ made) ---------------------

INLINE_DETECTABLE = (3, 11) <= sys.version_info[:2] < (3, 13)  # 3.13 keeps the values beside the dict


def _dict_made(obj) -> bool:
    """Has ``obj`` been given a real ``__dict__``? On 3.11/3.12 the garbage collector then sees
    that dict instead of the inline values (an independent view: no reading of ours)."""
    return any(type(held) is dict for held in gc.get_referents(obj))


@pytest.mark.skipif(
    not INLINE_DETECTABLE, reason="inline attribute values are observable on CPython 3.11/3.12 only"
)
@pytest.mark.parametrize("inline", [True, False])
def test_walked_caches_keep_their_inline_attributes(inline, monkeypatch, fake_clock):
    """A decode's caches after the watchdog walked them and followed their paths: read through
    ``__dict__``, each would carry a dict for good and every attribute access of the forward
    would be slower (docs/internals.md, the walk). Reading ``__dict__`` (``inline=False``) shows
    that this test sees it. (mlx-lm's BatchGenerator gives its merged caches a dict itself.)"""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_watchdog import Watchdog, tiny, watch_model
    from mlx_watchdog.core import objects as rawread
    from mlx_watchdog.core.arrays import scan_all

    monkeypatch.setattr(rawread, "INLINE_VALUES", inline)
    monkeypatch.setattr(rawread, "_types", {})  # names learnt by earlier tests start again
    model = tiny.build_model("llama", layers=4)
    fake_clock.step_each_observe(monkeypatch, 0.01)  # its walks and fixes by the schedule, on any machine
    wd = Watchdog(export=False, fix=True, fix_every=2)
    watch_model(model, wd)
    cache = make_prompt_cache(model)
    assert not any(_dict_made(c) for c in cache)  # mlx-lm's KVCache, as generate_step makes it
    for _, _ in zip(range(20), generate_step(mx.array([1, 2, 3]), model, max_tokens=20, prompt_cache=cache)):
        pass
    assert wd.walks >= 3
    found = scan_all([(cache, "")]).found
    assert all(resolve(cache, f.steps) is f.array for f in found)  # what the fix follows
    assert len(found) == 2 * len(cache)
    assert [_dict_made(c) for c in cache] == [not inline] * len(cache)


class Assigned:
    default = None  # a class-level default, shadowed by some instances

    def __init__(self, n):
        self.a = mx.zeros((n,))
        self.rows = [mx.ones((1,))]

    def grow(self):
        self.later = mx.ones((2,))

    @property
    def view(self):  # a property of the same name as an instance entry is never called
        raise AssertionError("property was invoked")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["grow", "outside", "default", "del_a", "odd_key", "view_entry"]), max_size=5)
)
def test_attributes_read_by_name_are_the_instance_dict(changes):
    """Whatever the instance holds (attributes its class assigns, ones set from outside, a
    shadowed class default, a deleted one, a non-identifier key, an entry hidden behind a
    property), the walk reads exactly what ``vars()`` shows afterwards."""
    from mlx_watchdog.core import objects as rawread

    objs = []
    for i in range(3):  # several instances of one class: names learnt on one serve the others
        obj = Assigned(i + 1)
        for change in changes:
            if change == "grow":
                obj.grow()
            elif change == "outside":
                obj.outside = mx.full((1,), i)
            elif change == "default":
                obj.default = mx.ones((3,))
            elif change == "del_a":
                try:
                    del obj.a
                except AttributeError:  # deleted already
                    pass
            elif change == "odd_key":  # these two give the instance a real __dict__ first
                obj.__dict__["not a name"] = mx.zeros((1,))
            elif change == "view_entry":
                obj.__dict__["view"] = mx.zeros((4,))
        objs.append(obj)
    t = rawread.info(Assigned)
    for obj in objs:
        read = rawread.attributes(obj, t, 1000)
        truth = vars(obj)
        got = {(key, id(child)) for key, _, child in read if rawread.info(type(child)).kind > rawread.OPAQUE}
        want = {
            (key, id(child))
            for key, child in truth.items()
            if rawread.info(type(child)).kind > rawread.OPAQUE
        }
        assert got == want
        for key, step, child in read:  # and each is found again by its step (what the fix follows)
            if type(key) is str:
                assert rawread.attribute(obj, step) is child


def test_a_property_added_to_the_class_after_a_walk_is_never_called():
    """Names read by name are checked again at each walk, and before each path is followed: a
    property put on the class since (a monkeypatch) would run under object.__getattribute__."""
    from mlx_watchdog.core.arrays import scan_all

    class Late:
        def __init__(self):
            self.x = mx.zeros((2,))

    obj = Late()
    first = scan_all([(obj, "")]).found
    assert [f.path for f in first] == ["x"]

    calls = []
    Late.x = property(
        lambda self: calls.append("x") or mx.ones((1,))
    )  # noted, not raised: nothing may swallow it
    again = scan_all([(obj, "")]).found
    assert [f.path for f in again] == ["x"] and again[0].array is first[0].array
    assert resolve(obj, again[0].steps) is first[0].array
    assert calls == []
