"""The C allocator's deferred work: paid before a walk, and not counted as the walk's.

glibc's ``malloc`` keeps the small blocks a decode step frees aside and merges them at the next
allocation of 1 KB or more, which a walk at the start of a step would make. ``settle()`` makes it
before the walk's clock starts: the merge is the program's work, and charged to the walk it would
space walks out as if they cost more. Allocators that defer nothing make it a no-op.
"""

from __future__ import annotations

from . import clock

SETTLE_BYTES = 4096  # above glibc's small-block range (1 KB) and below its mmap threshold (128 KB)


def settle() -> float:
    """Make the allocator do the merge the program's next large allocation would have done;
    returns the seconds it took (the program's work, moved, not added)."""
    start = clock.wall()
    bytearray(SETTLE_BYTES)
    return clock.wall() - start
