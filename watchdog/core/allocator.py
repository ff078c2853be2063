"""The C allocator's deferred work: paid before a walk, and not counted as the walk's.

glibc's ``malloc`` keeps freed small blocks in per-size lists ("fastbins") and merges them only
when a block of 1 KB or more is next asked for. Scheduling a decode step's graph frees its nodes:
on a 48-layer tiny llama on the CPU backend, ~13,000 small blocks (780 KB) a step, and the
program's next forward merges them itself (``mallinfo2``: fastbins back to ~300 blocks after
it). A walk that runs first pays that merge instead: 1-1.5 ms of a 2.8 ms walk there. Charged to
the walk, it spaced walks out as if they cost twice their work and counted the program's own
work as the watchdog's. Other allocators (macOS's) defer nothing here: the call costs ~0.2 us.
"""

from __future__ import annotations

import time

SETTLE_BYTES = 4096  # above glibc's small-block range (1 KB) and below its mmap threshold (128 KB)


def settle() -> float:
    """Make the allocator do the merge the program's next large allocation would have done;
    returns the seconds it took (the program's work, moved, not added)."""
    start = time.perf_counter()
    bytearray(SETTLE_BYTES)
    return time.perf_counter() - start
