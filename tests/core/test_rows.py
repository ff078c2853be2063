"""rows.py: a batch filtered or extended in place (the same caches, another number of rows) is seen
between two walks, from one array of the roots.

The roots here are caches made by the test, of a batch size it sets and changes: the truth is that
size, never what the watchdog read before. Arrays are found by the watchdog's own walk
(``scan_all``), as at a reading.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_watchdog.core.arrays import resolve, scan_all
from mlx_watchdog.core.rows import EVERY, RUN_LIMIT, RowsWatch


class Cache:
    """A cache of ``batch`` rows, as mlx-lm's: keys and values (batch, heads, tokens, dims), a
    left padding per row (one dimension: no batch to read from it)."""

    def __init__(self, batch: int, tokens: int = 5):
        self.keys = mx.zeros((batch, 2, tokens, 4))
        self.values = mx.zeros((batch, 2, tokens, 4))
        self.left_padding = mx.zeros((batch,))

    def filter(self, rows: int) -> None:
        """Keep the first ``rows`` rows, in place (a request ended)."""
        self.keys, self.values, self.left_padding = (
            self.keys[:rows],
            self.values[:rows],
            self.left_padding[:rows],
        )

    def extend(self, rows: int) -> None:
        """``rows`` more rows, in place (a request joined)."""
        self.keys = mx.concatenate([self.keys, mx.zeros((rows, *self.keys.shape[1:]))])
        self.values = mx.concatenate([self.values, mx.zeros((rows, *self.values.shape[1:]))])
        self.left_padding = mx.concatenate([self.left_padding, mx.zeros((rows,))])


class Program:
    """Roots whose arrays of two dimensions or more are mostly not the batch: rows of a history
    that grows every step (one more row each, no batch) and one more array of each."""

    def __init__(self, batch: int, histories: int = 3):
        self.histories = [mx.zeros((1, 4)) for _ in range(histories)]
        self.keys = mx.zeros((batch, 8))

    def step(self) -> None:
        self.histories = [mx.concatenate([h, mx.zeros((1, 4))]) for h in self.histories]


def armed(roots, epoch: int = 0, watch: RowsWatch | None = None) -> RowsWatch:
    watch = watch or RowsWatch()
    watch.arm(scan_all([(roots, "")]).found, epoch)
    return watch


def rows_watched(watch: RowsWatch, roots) -> int:
    """The first dimension of the array the watch follows, read here from the roots."""
    assert watch.probe is not None
    return resolve(roots, watch.probe[0]).shape[0]


def test_the_batch_is_read_from_the_arrays_most_of_which_share_it():
    caches = [Cache(4) for _ in range(3)]
    caches[0].other = mx.zeros((7, 3))  # one array of another first dimension: the minority
    watch = armed(caches)
    assert watch.probe is not None
    assert watch.probe[1] == 4 == rows_watched(watch, caches)
    assert watch.changed(caches, EVERY) is False


def test_one_dimensional_arrays_are_no_batch():
    # Many vectors of 9 items, few arrays of the batch of 2: the batch is 2.
    cache = Cache(2)
    cache.offsets = [mx.zeros((9,)) for _ in range(10)]
    watch = armed([cache])
    assert watch.probe is not None and watch.probe[1] == 2


def test_a_batch_filtered_in_place_is_seen_once():
    caches = [Cache(4) for _ in range(3)]
    watch = armed(caches)
    for cache in caches:
        cache.filter(3)
    assert watch.changed(caches, EVERY) is True
    assert watch.probe is not None and watch.probe[1] == 3 == rows_watched(watch, caches)
    assert watch.changed(caches, 2 * EVERY) is False  # the same batch since


def test_a_batch_extended_in_place_is_seen():
    caches = [Cache(2) for _ in range(2)]
    watch = armed(caches)
    assert watch.changed(caches, EVERY) is False
    for cache in caches:
        cache.extend(3)
    assert watch.changed(caches, 2 * EVERY) is True
    assert watch.probe is not None and watch.probe[1] == 5


def test_an_array_whose_rows_changed_between_two_walks_of_an_epoch_is_not_followed():
    program = Program(batch=5)
    watch = armed(program, epoch=0)
    # One walk sees no change yet: the most common first dimension wins, a history's (1 row).
    assert watch.probe is not None and watch.probe[1] == 1
    program.step()
    armed(program, epoch=0, watch=watch)  # the next walk of the same epoch: the histories grew
    assert watch.probe is not None and watch.probe[1] == 5 == rows_watched(watch, program)
    program.step()
    assert watch.changed(program, EVERY) is False  # the batch did not change


def test_an_array_that_changes_at_every_look_is_dropped():
    program = Program(batch=2)
    watch = armed(program, epoch=0)  # a history is followed (no second walk of this epoch yet)
    assert watch.probe is not None
    followed = watch.probe[0]
    looks = []
    for step in range(EVERY, 10 * EVERY, EVERY):
        if watch.probe is None:  # the watchdog looks only while the watch follows an array
            break
        program.step()
        looks.append(watch.changed(program, step))
    # Its rows changed at every look: at RUN_LIMIT changes in a row it is no batch.
    assert looks == [True] * (RUN_LIMIT - 1) + [False]
    armed(program, epoch=1, watch=watch)  # another epoch: the dropped array is not chosen again
    assert watch.probe is not None and watch.probe[0] != followed


def test_an_array_that_is_gone_is_a_change_and_the_watch_waits_for_a_walk():
    caches = [Cache(4) for _ in range(3)]
    watch = armed(caches)
    path = watch.probe[0] if watch.probe else ()
    del caches[int(path[0][1]) :]  # the cache it followed, and those after it, died
    assert watch.changed(caches, EVERY) is True
    assert watch.probe is None


def test_forget_drops_what_was_followed():
    caches = [Cache(4)]
    watch = armed(caches)
    watch.forget()
    assert watch.probe is None
    assert armed(caches, watch=watch).probe is not None
