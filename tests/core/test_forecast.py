"""The growth-rate fit (Theil-Sen) against a plain reference, and the limit arithmetic."""

import math
import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.core.forecast import (
    RECENT_POINTS,
    RECENT_SPAN,
    epoch_slope,
    robust_slope,
    seconds_from_steps,
    steps_to_limit,
)


def reference_slope(points):
    slopes = [
        (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :] if x2 > x1
    ]
    return statistics.median(slopes) if slopes else 0.0


steps = st.integers(min_value=0, max_value=10**6)
values = st.integers(min_value=0, max_value=10**6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(steps, values), max_size=64))
def test_robust_slope_is_the_median_of_pairwise_slopes(points):
    points = sorted(points)
    assert math.isclose(robust_slope(points), reference_slope(points), rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.lists(steps, min_size=2, max_size=64, unique=True), values)
def test_a_flat_series_has_slope_zero(xs, level):
    assert robust_slope([(x, level) for x in sorted(xs)]) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=8, max_value=40), st.integers(min_value=2, max_value=200), st.integers(0, 10**4))
def test_bursty_growth_gives_the_long_run_rate(bursts, period, offset):
    # A chain that grows +1/step for `period` steps, then loses half of it: 0.5/step in the long
    # run. Sampled at 64 evenly spread steps (as sampled walks see it), the fit finds that rate.
    def level(step):
        return (step // period) * period / 2 + step % period

    span = bursts * period
    points = [(offset + k * span // 64, level(k * span // 64)) for k in range(64)]
    assert abs(robust_slope(points) - 0.5) <= 0.2


def test_limit_arithmetic():
    assert steps_to_limit(100, 1000, 0.0) == math.inf
    assert steps_to_limit(100, 1000, 3.0) == 300
    assert steps_to_limit(1000, 1000, 3.0) == 0.0
    assert seconds_from_steps(300, 10.0) == 30.0
    assert seconds_from_steps(math.inf, 10.0) == math.inf


def reference_level_cut(points):
    """Each epoch cut after its biggest rise above the median rise, when that excess is half of
    all the excess or more and two readings or more lie on each side: the cut part is an epoch
    of its own."""
    out = []
    for epoch in dict.fromkeys(e for _, _, e in points):
        member = [p for p in points if p[2] == epoch]
        if len(member) >= 4:
            rises = [b[1] - a[1] for a, b in zip(member, member[1:])]
            typical = statistics.median(rises)
            excess = [r - typical for r in rises]
            k = excess.index(max(excess))
            if excess[k] > 0 and excess[k] >= 0.5 * sum(excess) and 2 <= k + 1 <= len(member) - 2:
                member = member[: k + 1] + [(x, y, (epoch, "cut")) for x, y, _ in member[k + 1 :]]
        out += member
    return out


def reference_epoch_slope(points):
    """Pairs of one epoch only; the latest epoch alone once it spans RECENT_SPAN steps."""
    latest = [p for p in points if p[2] == points[-1][2]]
    if len(latest) >= RECENT_POINTS and latest[-1][0] - latest[0][0] >= RECENT_SPAN:
        points = latest
    points = reference_level_cut(points)
    slopes = [
        (y2 - y1) / (x2 - x1)
        for i, (x1, y1, e1) in enumerate(points)
        for x2, y2, e2 in points[i + 1 :]
        if x2 > x1 and e1 == e2
    ]
    return statistics.median(slopes) if slopes else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(steps, st.sampled_from([5, 5, 7, 1000]), st.integers(0, 3)), max_size=64))
def test_epoch_slope_pairs_points_of_one_epoch(points):
    # Steps increase and epochs never come back, as the watchdog records them.
    points = sorted(points, key=lambda p: (p[2], p[0]))
    got, want = epoch_slope(points), reference_epoch_slope(points)
    assert (got is None) == (want is None)
    if want is not None:
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)


def test_a_jump_between_epochs_is_no_growth():
    before = [(s, 100.0, 0) for s in range(10)]
    after = [(s, 5000.0, 1) for s in range(10, 20)]  # a request joined: more buffers, none growing
    assert epoch_slope(before + after) == 0.0
    assert robust_slope([(s, y) for s, y, _ in before + after]) > 0  # what pairing across epochs reads


def test_a_level_shift_inside_an_epoch_is_no_growth():
    """One rise between two readings (a batch filtered in place moves the level once) is not a
    slope, whatever share of the window's pairs straddle it; steady growth keeps its slope
    however it is read (every step, sparsely, in steps of 4, with a shift on top)."""
    shift = [(x, 100 + (64 if x >= 50 else 0), 0) for x in range(20, 84)]  # half the pairs straddle
    assert epoch_slope(shift) == 0.0
    assert epoch_slope([(x, 100 + 3 * x, 0) for x in range(100)]) == 3.0
    assert epoch_slope([(x, 100 + 3 * x, 0) for x in (0, 1, 2, 4, 8, 16, 32, 64, 110, 150, 190)]) == 3.0
    assert epoch_slope([(x, 100 + 4 * (x // 4), 0) for x in range(64)]) == 1.0
    assert epoch_slope([(x, 100 + 2 * x + (64 if x >= 50 else 0), 0) for x in range(20, 84)]) == 2.0
    assert epoch_slope([(x, 5 * x, 0) for x in [*range(65), 200, 210]]) == 5.0


def test_describe_says_when_the_limit_comes_or_that_it_does_not():
    from mlx_watchdog.core.forecast import Forecast

    flat = Forecast(
        step=10,
        resident_buffers=100,
        limit=1000,
        buffers_per_step=0.0,
        steps_to_limit=math.inf,
        seconds_to_limit=math.inf,
    )
    assert "the limit is not approached" in flat.describe() and "never" not in flat.describe()
    rising = Forecast(
        step=10,
        resident_buffers=100,
        limit=1000,
        buffers_per_step=5.0,
        steps_to_limit=steps_to_limit(100, 1000, 5.0),
        seconds_to_limit=18.0,
    )
    assert "limit in 180 steps (18 s)" in rising.describe()
