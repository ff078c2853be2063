"""The C allocator's deferred work (``allocator.py``): merged by ``settle``, as glibc's own
counters show, and not charged to the walk that pays it."""

from __future__ import annotations

import ctypes
import ctypes.util

import mlx.core as mx
import pytest

from mlx_watchdog import Watchdog
from mlx_watchdog.core import allocator


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


libc = _glibc()


@pytest.mark.skipif(libc is None, reason="glibc's mallinfo2 (glibc >= 2.33) is the independent count")
def test_settle_merges_the_small_blocks_freed_before_it():
    # (mallinfo2 sums every thread's arena; settle merges the calling thread's, where these were freed)
    before = libc.mallinfo2().smblks
    blocks = [libc.malloc(48) for _ in range(20_000)]  # what a step's graph leaves when it is cut
    for block in blocks:
        libc.free(block)
    freed = libc.mallinfo2().smblks
    assert freed - before > 15_000  # freed, not yet merged
    allocator.settle()
    assert libc.mallinfo2().smblks < freed - 15_000


def test_a_walk_is_not_charged_for_the_merge(monkeypatch, fake_clock):
    # On the fake clock the merge takes 50 ms and nothing else takes any time: all the watchdog
    # may count is the merge.
    def slow_settle():
        fake_clock.work(0.05)
        return 0.05

    monkeypatch.setattr(allocator, "settle", slow_settle)
    x = mx.zeros((2,))
    mx.eval(x)
    cache = {"x": x - 1}
    wd = Watchdog(limit=10**6, export=False)
    wd.observe(cache)  # the first step walks
    assert wd.walks == 1
    assert wd.overhead_seconds < 0.05 and wd._schedule.last_cost < 0.05 and wd._schedule.spent < 0.05
