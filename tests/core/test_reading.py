"""A reading as a value (``core/reading.py``): ``read()`` on synthetic walks, no MLX graph. What
the walk and the sampler found goes in (arrays by site and cache, evaluated or not, what each
pending one retains); what must come out follows from the definitions: resident is parameters +
evaluated + retained + compiled, every array counted once by its site and once by its cache, a
fix-mode sample counts an evaluated buffer where the fix cuts a chain. The readings of real
decodes are checked against the exact live-buffer count in tests/test_readings.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.core.reading import MAX_PATHS_PER_SITE, Reading, read


@dataclasses.dataclass(frozen=True)
class Found:
    site: str
    path: str
    root: int = 0


class Cache:
    """A cache object: what the scope follows by weak reference."""


SITES = ["A.keys", "A.values", "B.left_padding", "kept:B.left_padding"]


@st.composite
def walks(draw, max_arrays=40):
    """A walk: caches (some followed, some kept), arrays spread over them and over sites, each
    evaluated or pending with the buffers its graph retains, and the sampler's walked indices."""
    caches = [Cache() for _ in range(draw(st.integers(1, 4)))]
    followed = [draw(st.booleans()) for _ in caches]
    refs = {id(c): (weakref.ref(c) if f else None) for c, f in zip(caches, followed)}
    roots = draw(st.integers(1, 3))  # root 0 the step's, the others caches walked alone
    kept = [False] + [draw(st.booleans()) for _ in range(roots - 1)]
    n = draw(st.integers(0, max_arrays))
    found, keys, evaluated, retained = [], [], [], []
    for i in range(n):
        cache = draw(st.sampled_from(caches))
        found.append(Found(draw(st.sampled_from(SITES)), f"[{i}].x", draw(st.integers(0, roots - 1))))
        keys.append((id(cache), (("item", i),)))
        done = draw(st.booleans())
        evaluated.append(done)
        retained.append(0.0 if done else draw(st.sampled_from([0.0, 1.0, 2.5, 7.0, 40.0])))
    pending = [i for i in range(n) if not evaluated[i]]
    walked = (
        None if draw(st.booleans()) else set(draw(st.lists(st.sampled_from(pending)))) if pending else set()
    )
    return dict(
        caches=caches,
        found=found,
        evaluated=evaluated,
        retained=retained,
        keys=keys,
        refs=refs,
        walked=walked,
        kept=kept,
    )


COMPILED = st.dictionaries(
    st.sampled_from(["compiled:step", "compiled:loss"]), st.tuples(st.integers(0, 50), st.integers(0, 5))
)


def _read(walk, **options):
    return read(
        walk["found"],
        walk["evaluated"],
        walk["retained"],
        step=options.pop("step", 10),
        keys=walk["keys"],
        refs=walk["refs"],
        walked=walk["walked"],
        kept=walk["kept"],
        **options,
    )


@settings(max_examples=300, deadline=None)
@given(walk=walks(), parameters=st.integers(0, 500), compiled=COMPILED)
def test_resident_is_parameters_evaluated_retained_and_compiled(walk, parameters, compiled):
    reading = _read(walk, parameters=parameters, compiled=compiled)
    evaluated = sum(walk["evaluated"])
    retained = sum(walk["retained"])
    compiled_buffers = sum(buffers for buffers, _ in compiled.values())
    assert reading.resident == pytest.approx(parameters + evaluated + retained + compiled_buffers)
    assert reading.walked == reading.resident
    assert reading.cache_buffers == evaluated
    assert reading.pending_arrays == len(walk["found"]) - evaluated
    assert reading.retained == round(retained)
    assert reading.mlx_cached == 0
    if walk["found"]:
        assert reading.sample == reading.resident  # watching: every buffer is a sample of growth
    else:
        assert reading.sample is None and reading.kept is None  # an empty cache is no sample


@settings(max_examples=300, deadline=None)
@given(walk=walks(), parameters=st.integers(0, 500), compiled=COMPILED)
def test_a_fix_mode_sample_counts_an_evaluated_buffer_where_the_fix_cuts_a_chain(walk, parameters, compiled):
    watching = _read(walk, parameters=parameters, compiled=compiled)
    fixing = _read(walk, parameters=parameters, compiled=compiled, fixing=True, fixed_at=7)
    assert fixing.resident == watching.resident  # what is resident now does not change...
    if not walk["found"]:
        assert fixing.sample is None
        return
    pending = len(walk["found"]) - sum(walk["evaluated"])
    # ...what grows once the fix has cut the chains does: each pending array is one buffer then.
    assert fixing.sample == pytest.approx(watching.sample - sum(walk["retained"]) + pending)
    # A kept cache's arrays are one buffer each once cut, evaluated or not.
    kept_arrays = sum(walk["kept"][f.root] for f in walk["found"])
    assert fixing.kept == pytest.approx(kept_arrays)
    assert fixing.fixed_at == 7


@settings(max_examples=300, deadline=None)
@given(walk=walks())
def test_sites_sum_to_their_caches(walk):
    for cache in walk["caches"]:  # every cache followed: each appears in by_cache
        walk["refs"][id(cache)] = weakref.ref(cache)
    reading = _read(walk)
    sites = sum(tally.held + tally.retained for tally in reading.by_site.values())
    caches = sum(cache.buffers for cache in reading.by_cache)
    assert sites == pytest.approx(caches)
    assert sum(cache.retained for cache in reading.by_cache) == pytest.approx(sum(walk["retained"]))
    assert sum(tally.arrays for tally in reading.by_site.values()) == len(walk["found"])
    assert reading.resident == pytest.approx(caches)  # no parameters, nothing compiled


@settings(max_examples=300, deadline=None)
@given(walk=walks())
def test_each_cache_holds_its_evaluated_arrays_and_what_its_chains_retain(walk):
    reading = _read(walk)
    ids = [key[0] for key in walk["keys"]]
    by_id = {id(cache.ref()): cache for cache in reading.by_cache}
    followed = {cid for cid, ref in walk["refs"].items() if ref is not None and cid in ids}
    assert set(by_id) == followed  # a cache not followed has no tally (its arrays still count)
    for cid, cache in by_id.items():
        mine = [i for i, c in enumerate(ids) if c == cid]
        pending = [walk["retained"][i] for i in mine if not walk["evaluated"][i]]
        assert cache.retained == pytest.approx(sum(pending))
        assert cache.buffers == pytest.approx(sum(walk["evaluated"][i] for i in mine) + sum(pending))


@settings(max_examples=300, deadline=None)
@given(walk=walks(max_arrays=80))
def test_each_array_is_a_chain_of_its_site(walk):
    reading = _read(walk)
    for name, tally in reading.by_site.items():
        mine = [i for i, f in enumerate(walk["found"]) if f.site == name]
        assert tally.arrays == len(tally.chains) == len(mine)
        assert tally.held == sum(walk["evaluated"][i] for i in mine)
        for i, (key, ref, retained, walked) in zip(mine, tally.chains):
            assert key == walk["keys"][i] and ref is walk["refs"][key[0]]
            assert retained == (0.0 if walk["evaluated"][i] else walk["retained"][i])
            # an evaluated array is read as it is; a pending one was walked, or is an estimate
            assert walked == (walk["evaluated"][i] or walk["walked"] is None or i in walk["walked"])
        # the paths named: pending arrays that retain something, in order, a few at most
        named = [walk["found"][i].path for i in mine if not walk["evaluated"][i] and walk["retained"][i]]
        assert tally.paths == tuple(named[:MAX_PATHS_PER_SITE])


@settings(max_examples=200, deadline=None)
@given(walk=walks(), compiled=COMPILED)
def test_compiled_entries_are_resident_and_sites_of_every_reading_but_a_probe_s(walk, compiled):
    reading = _read(walk, compiled=compiled)
    probe = _read(walk, compiled=compiled, compiled_sites=False)
    assert probe.resident == reading.resident
    for site, (buffers, entries) in compiled.items():
        assert reading.by_site[site].held == buffers and reading.by_site[site].arrays == entries
        assert site not in probe.by_site
    assert set(reading.by_site) - set(probe.by_site) == set(compiled)


@settings(max_examples=200, deadline=None)
@given(walk=walks(), live=st.integers(0, 10_000), cached=st.integers(0, 100))
def test_mlx_s_own_count_is_what_is_resident(walk, live, cached):
    reading = _read(walk, parameters=40, mlx_count=(live, cached), fixing=True)
    assert (reading.resident, reading.walked, reading.mlx_cached) == (live, live, cached)
    # MLX's count is the process's: what the fix cuts is in it already, nothing is taken out
    assert reading.sample == (live if walk["found"] else None)


def test_a_kept_cache_s_buffers_and_its_last_forward():
    found = [
        Found("A.keys", "[0].keys"),
        Found("kept:A.keys", "<A#0>.keys", 1),
        Found("kept:A.x", "<A#0>.x", 1),
    ]
    cache = Cache()
    keys = [(1, ()), (id(cache), (("attr", "keys"),)), (id(cache), (("attr", "x"),))]
    reading = read(
        found,
        [True, False, True],
        [0.0, 5.0, 0.0],
        step=3,
        keys=keys,
        refs={id(cache): weakref.ref(cache)},
        kept=[False, True],
        kept_since=2,
    )
    assert reading.kept == 6.0 and reading.kept_since == 2  # the pending array's 5, the evaluated one
    assert reading.resident == 7.0


def test_the_fix_s_cut_leaves_the_reading_and_the_cache():
    a, b = Cache(), Cache()
    reading = read(
        [Found("A.x", "[0].x"), Found("A.x", "[1].x")],
        [False, False],
        [10.0, 4.0],
        step=5,
        keys=[(id(a), ()), (id(b), ())],
        refs={id(a): weakref.ref(a), id(b): weakref.ref(b)},
    )
    after = reading.less_freed({id(a): 6.0, id(b): 9.0})
    assert after.resident == reading.resident - 15.0
    assert [(c.buffers, c.retained) for c in after.by_cache] == [(4.0, 4.0), (0.0, 0.0)]  # never below 0
    assert [(c.buffers, c.retained) for c in reading.by_cache] == [(10.0, 10.0), (4.0, 4.0)]  # a value


def test_a_dead_cache_takes_its_buffers_and_its_share_of_the_growth():
    a, b = Cache(), Cache()
    reading = read(
        [Found("A.x", "[0].x"), Found("A.y", "[0].y"), Found("A.x", "[1].x")],
        [False, True, False],
        [3.0, 0.0, 1.0],
        step=5,
        keys=[(id(a), (1,)), (id(a), (2,)), (id(b), (1,))],
        refs={id(a): weakref.ref(a), id(b): weakref.ref(b)},
    )
    assert reading.gone() == (0.0, 1.0)
    del a
    assert reading.gone() == (4.0, 0.25)  # its 3 + 1 buffers; it held 3 of the 4 growing
    del b
    assert reading.gone() == (5.0, 0.0)


def test_a_reading_is_a_value():
    reading = Reading(step=3, resident=12.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        reading.resident = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        reading.by_site["x"] = None  # type: ignore[index]


def test_reading_imports_no_mlx():
    code = "import sys, mlx_watchdog.core.reading\nprint([m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr
