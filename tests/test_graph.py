"""Graph accounting over mx.export_to_dot."""

import mlx.core as mx

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
