"""When to walk: densely as each epoch starts, then by decode time, within a lifetime budget.

An *epoch* is a stretch of steps over one set of live caches (see ``caches.py``): a new decode,
a request joining a busy batch, a cache dying, the first fix. Its growth is measured from its
own readings, so each epoch is walked at its steps 0, 1, 2, 4, ..., 64: a leak there is read
within 64 steps of its first step. After that a walk is due every ``walk_interval`` seconds of
decode (by default 0.5 s, or longer when walks are dear, so that they take 0.1% of decode).

Every walk must also fit the budget: the watchdog's own time (all of ``observe``, on the decode
thread) stays within ``overhead_budget`` of the decode's wall time over the watchdog's lifetime,
with a small start-up credit as a floor. One-off costs (first calls, imports) are paid when the
watchdog is made, not charged here.
"""

from __future__ import annotations

import math

DENSE_OFFSETS = (0, 1, 2, 4, 8, 16, 32, 64)  # steps into an epoch that are walked
# Walks of a new decode taken even when the budget is spent: one for its level, two 16 steps apart
# for its rate. The first step's reading is no point of the growth: what the prompt's last forward
# left pending is still there then, and a slope from it reads high.
OWED_OFFSETS = (0, 16, 32)  # the first reads the new level only: it is no point of the growth
# Budget granted up front (a floor, not added): a young watchdog must read the first requests of a
# server as they come, not spend its first seconds' budget on one batch and miss the next changes.
# Past 25 s of decode the 1% holds.
WALK_CREDIT_SECONDS = 0.25
AUTO_WALK_INTERVAL = 0.5  # seconds of decode between walks after the dense ones (walk_interval=None)...
AUTO_WALK_SHARE = 0.001  # ...or more, so that they take at most this share of decode time


class Schedule:
    def __init__(self, overhead_budget: float, walk_interval: float | None) -> None:
        self.overhead_budget = overhead_budget
        self.walk_interval = walk_interval
        self.decode_seconds = 0.0  # sum of the (capped) gaps between observed steps
        self.spent = 0.0  # seconds of observe() charged to the budget
        self.last_cost = 0.0  # seconds of the last walk
        self._epoch_start = 0
        self._dense = 0  # index into DENSE_OFFSETS of the next dense walk of the epoch
        self._owed = len(OWED_OFFSETS)  # index into OWED_OFFSETS of the next walk owed whatever the budget
        self._continuing = False  # the epoch's caches partly go on from the last one
        # Below both, no walk is wanted and due() is False: observe() skips the call (it runs on
        # every step, after the forward has left the CPU's caches cold; see Watchdog._observe).
        # wake_decode is the decode time of the last walk plus the gap to the next.
        self.wake_step: float = 0
        self.wake_decode = AUTO_WALK_INTERVAL if walk_interval is None else walk_interval
        self._arm()

    def _arm(self) -> None:
        """wake_step: the epoch's next owed or dense walk."""
        offsets = [OWED_OFFSETS[self._owed]] if self._owed < len(OWED_OFFSETS) else []
        if self._dense < len(DENSE_OFFSETS):
            offsets.append(DENSE_OFFSETS[self._dense])
        self.wake_step = self._epoch_start + min(offsets) if offsets else math.inf

    def new_epoch(self, step: int, continuing: bool = False) -> None:
        """A new epoch at ``step``. One whose caches partly go on (a request joined a busy batch)
        keeps the growth measured so far: it needs one reading of its new level, not the
        dense ones of a new decode (a busy server has two such epochs per request)."""
        self._epoch_start = step
        self._continuing = continuing
        self._dense = len(DENSE_OFFSETS) - 1 if continuing else 0
        if continuing:  # its first step, whatever the offset
            self._epoch_start = step - DENSE_OFFSETS[-1]
        else:
            # A server whose budget earlier requests spent would otherwise be blind to a new
            # decode for hundreds of steps. Its first walks are cheap (its chains are new), and
            # there are three per decode.
            self._owed = 0
        self._arm()

    def due(self, step: int) -> bool:
        """Is a walk due at ``step``, and does it fit the budget? (Every step: kept cheap.)"""
        offset = step - self._epoch_start
        if self._owed < len(OWED_OFFSETS) and offset >= OWED_OFFSETS[self._owed]:
            return True
        dense = self._dense < len(DENSE_OFFSETS) and offset >= DENSE_OFFSETS[self._dense]
        if dense and self._continuing:
            # The one walk that sees what a change of a busy batch added (the merged request's
            # buffers): unseen, each change leaves the reading low until the next walk. It may
            # overdraw the budget up to twice.
            return self.affordable(overdraft=2.0)
        wanted = dense or self.decode_seconds >= self.wake_decode
        return wanted and self.affordable()

    def affordable(self, overdraft: float = 1.0) -> bool:
        # Everything observe() spends counts, not only walks (wall time: that is what the decode
        # loses). The budget runs over the watchdog's lifetime: a server has a new epoch with every
        # change of its batch, and a credit per epoch would let short requests cost more than the
        # budget. The credit is a floor: past WALK_CREDIT_SECONDS / overhead_budget of decode,
        # at most overhead_budget is spent.
        allowed = max(self.overhead_budget * self.decode_seconds, WALK_CREDIT_SECONDS)
        return self.spent + self.last_cost <= overdraft * allowed

    def charge(self, seconds: float) -> None:
        """The watchdog's own seconds, against the budget. (``observe`` inlines this: every step.)"""
        self.spent += seconds

    def refund(self, seconds: float) -> None:
        """Seconds charged that were not the watchdog's to pay (the program's deferred work, the
        fix the user asked for)."""
        self.spent -= seconds

    def first_of_decode(self, step: int) -> bool:
        """Is ``step`` the first of a new decode? Its reading is a level, not a point of the growth:
        what the prompt's last forward left pending is still there then."""
        return not self._continuing and step == self._epoch_start

    def walked(self, step: int, cost: float, cpu_cost: float | None = None) -> None:
        """A walk at ``step`` took ``cost`` seconds (wall: what the decode lost) and ``cpu_cost``
        of CPU (its work: a walk that waited for a core must not space the next ones out)."""
        self.last_cost = cost
        offset = step - self._epoch_start
        while self._owed < len(OWED_OFFSETS) and OWED_OFFSETS[self._owed] <= offset:
            self._owed += 1
        while self._dense < len(DENSE_OFFSETS) and DENSE_OFFSETS[self._dense] <= offset:
            self._dense += 1
        if self.walk_interval is not None:
            gap = self.walk_interval
        else:
            work = cost if cpu_cost is None else min(cost, cpu_cost)  # (the walk and its waiter run in turn)
            gap = max(AUTO_WALK_INTERVAL, work / AUTO_WALK_SHARE)
        self.wake_decode = self.decode_seconds + gap
        self._arm()
