"""Graph accounting over mx.export_to_dot."""

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_watchdog.core.graph import account, graph_size, is_evaluated


def _evaluated(*shape_values):
    arrays = [mx.array(v) for v in shape_values]
    mx.eval(arrays)
    return arrays


def test_pending_chain_retains_one_buffer_per_python_scalar():
    (x,) = _evaluated(10)
    start = x
    for _ in range(7):
        x = x - 1
    r = account([x])
    # The 7 scalar operands plus the original evaluated `start` are kept alive by the chain.
    assert r.retained_buffers == 8 and r.retained_by_array == [8]
    assert r.pending_arrays == 1 and r.evaluated_arrays == 0
    assert r.pending_nodes >= 7
    del start


def test_shared_buffers_are_counted_once_and_attributed_to_one_array():
    a, b = _evaluated([1.0, 2.0], [3.0, 4.0])
    p = a * b  # retains a and b
    q = (a + b) * 2  # retains a and b (already counted) and the scalar 2
    r = account([p, q])
    assert r.retained_buffers == 3
    assert sum(r.retained_by_array) == 3
    assert r.retained_by_array[0] == 2


def test_evaluated_roots_are_cache_buffers_not_retained():
    a, b = _evaluated([1.0], [2.0])
    c = a + b  # depends on two of the walked arrays
    r = account([a, b, c])
    assert r.evaluated_arrays == 2 and r.pending_arrays == 1
    assert r.retained_buffers == 0  # a and b are walked arrays, counted once as such
    assert r.evaluated_by_array == [True, True, False]


def test_scheduled_arrays_count_as_evaluated():
    (a,) = _evaluated([1.0, 2.0])
    b = a * 3
    assert not is_evaluated(b)
    mx.async_eval(b)
    assert is_evaluated(b)
    assert account([b]).retained_buffers == 0


def test_graph_size_grows_with_the_graph():
    (a,) = _evaluated([1.0])
    small = graph_size([a + 1])
    big = a
    for _ in range(50):
        big = big * 2 + 1
    assert graph_size([big])[0] > 10 * small[0]


def test_empty_input():
    r = account([])
    assert r.retained_buffers == 0 and r.pending_nodes == 0


# --------------------------------------------------------------------------- telling evaluated arrays


def _source_in_export(array) -> bool:
    """MLX's own answer, independent of the checks: its export writes an array that has no
    primitive (evaluated, or scheduled and detached) as a source."""
    text = []
    mx.export_to_dot(SimpleNamespace(write=text.append), n0=array)
    return '{ rank=source; "n0"; }' in "".join(text)


def _arrays_in_every_state():
    """(name, array) in every state a cache can leave them: made from data, pending (short and
    deep chains, views, siblings, random, compiled, in-place updated, 0-d and 11-d, several
    dtypes), evaluated, scheduled."""
    import mlx.nn as nn

    made = mx.array([[1, 2, 3], [4, 5, 6]], dtype=mx.int16)
    ready = mx.arange(12, dtype=mx.float32) * 2
    mx.eval(ready)
    chain = ready
    for _ in range(1000):
        chain = chain - 1
    kept = chain * 1
    mx.eval(kept)
    quotient, remainder = mx.divmod(ready, 5)
    halves = mx.split(ready * 3, 2)
    mx.eval(halves[0])  # evaluates its sibling too
    scheduled = ready + 7
    mx.async_eval(scheduled)
    updated = mx.array(ready)
    updated[0] = 5
    compiled = mx.compile(lambda x: x * 2 + 1)(ready)
    linear = nn.Linear(12, 4)
    mx.eval(linear.parameters())
    many_dims = mx.zeros((1,) * 11)
    many_dims_ready = mx.ones((1,) * 11)
    mx.eval(many_dims_ready)
    arrays = {
        "made": made,
        "scalar made": mx.array(1.5),
        "evaluated": ready,
        "pending": ready + 1,
        "chain of 1000": chain,
        "evaluated chain": kept,
        "view pending": ready[2:5],
        "view evaluated": mx.eval(v := ready[3:]) or v,
        "sibling pending": quotient,
        "other sibling pending": remainder,
        "sibling evaluated": halves[0],
        "other sibling evaluated": halves[1],
        "scheduled": scheduled,
        "zeros pending": mx.zeros((3, 4)),
        "random pending": mx.random.normal((2, 2)),
        "updated in place": updated,
        "compiled output": compiled,
        "layer weight": linear.weight,
        "layer output": linear(ready[None]),
        "11-d pending": many_dims,
        "11-d evaluated": many_dims_ready,
        "0-d pending": mx.array(2) - 1,
        "bfloat16 pending": ready.astype(mx.bfloat16),
        "complex evaluated": mx.eval(z := ready.astype(mx.complex64)) or z,
        "bool pending": ready > 3,
    }
    return list(arrays.items())


def test_every_check_tells_what_mlx_s_export_shows_without_evaluating():
    from mlx_watchdog.core import graph

    cases = _arrays_in_every_state()
    in_use = graph.evaluated_check()
    try:
        for check in graph.EVALUATED_CHECKS:
            try:
                graph.use_evaluated_check(check)
            except ValueError:
                assert check == "buffer size" and not hasattr(mx, "get_array_buffer_size")
                continue
            told = {name: is_evaluated(array) for name, array in cases}
            truth = {name: _source_in_export(array) for name, array in cases}  # after: none evaluated by it
            assert told == truth, check
    finally:
        graph.use_evaluated_check(in_use)
    assert 8 <= sum(truth.values()) <= len(cases) - 8  # both states are tried
    if hasattr(mx, "get_array_buffer_size"):  # a second truth, where MLX has it
        for name, array in cases:
            try:
                mx.get_array_buffer_size(array)
                held = True
            except ValueError:
                held = False
            assert held == truth[name], name


def test_the_check_in_use_is_never_the_export():
    # mlx 0.32.4 has get_array_buffer_size; mlx 0.31.x has the descriptor this layout reads. The
    # export costs a walk of each array's graph: a reading of deep chains would block the decode.
    from mlx_watchdog.core import graph

    expected = "buffer size" if hasattr(mx, "get_array_buffer_size") else "descriptor"
    assert graph.evaluated_check() == expected


def test_the_descriptor_reads_on_the_mlx_versions_supported():
    from mlx_watchdog.core import descriptor

    version = tuple(int(p) for p in mx.__version__.split(".")[:3] if p.isdigit())
    read = descriptor.reader()
    if read is None and version > (0, 32, 4):
        pytest.skip(
            f"mlx {mx.__version__}: the descriptor's layout was checked up to 0.32.4 (get_array_buffer_size tells here)"
        )
    assert read is not None, f"mlx {mx.__version__}: the layout of mlx/array.h 0.31-0.32.4 did not read back"
    pending = mx.array([1.0]) + 1
    assert read(pending) is False and read(mx.array([1.0])) is True
    assert read(object()) is None and read(3) is None  # not an mx.array: told another way


def test_memory_is_read_without_a_crash_where_nothing_is_mapped():
    import ctypes

    from mlx_watchdog.core.descriptor import read_memory

    data = ctypes.create_string_buffer(b"mlx-watchdog", 12)
    assert read_memory(ctypes.addressof(data), 12) == b"mlx-watchdog"
    assert read_memory(8, 8) is None  # the first page is never mapped: EFAULT, not SIGSEGV
    assert read_memory(0, 8) is None
