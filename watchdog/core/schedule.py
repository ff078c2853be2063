"""When to walk: densely as each epoch starts, then by decode time, within a lifetime budget.

An *epoch* is a stretch of steps over one set of live caches (see ``caches.py``): a new decode,
a request joining a busy batch, a cache dying, a batch changed in place, the first fix. A new
decode's growth is measured from its own readings, so it is walked at its steps 0, 1, 2, 4, ...,
64: a leak there is read within 64 steps of its first step. An epoch whose caches partly go on (a
busy batch that changed) keeps the growth measured so far: it needs one reading of its new level,
taken one step after the change, so that the changes of one request joining (its prompt's caches,
the batch it is built in, the batch it is merged into: three in three steps) cost one walk, not
three. While the growth is not measured yet, such an epoch is walked densely like a new decode.
After that a walk is due every ``walk_interval`` seconds of decode (by default 0.5 s, or longer
when walks are dear, so that they take 0.1% of decode).

Every walk must also fit the budget: the watchdog's own time (all of ``observe``, on the decode
thread, the fix included) stays within ``overhead_budget`` of the decode's wall time over the
watchdog's lifetime, with a small start-up credit as a floor. A walk that does not fit waits until
one does (a dense walk is taken at the first step it fits), except the walks owed whatever the
budget says now: three of each new decode, two of a busy batch that changed before its growth was
read. Charged like the others, they are paid back by the routine walks, which give way (and leave
a share of the budget to the walks that measure). A busy batch's changes are no new decodes, so
owed walks are few. One-off costs (first calls, imports) are paid when the watchdog is made, not
charged here.

No reading stays stale for good, whatever spent the budget (the fix and every step's own time fill
it in a busy ``--fix`` server, where the routine walks then never ran: a reading froze while
requests came and went). Two more walks are owed, sized by the walks' own CPU work, so that they
cost a bounded share of decode whatever the budget says:

* the caches changed since the last reading (a request joined, left, a batch changed in place):
  the walk of the change is owed once the decode since the last walk has paid for it at
  ``REFRESH_SHARE`` of the budget;
* nothing changed: the interval walk is owed at ``STALE_STRETCH`` times its interval.

Those are the walks the budget gives up first, and they are few: the fix, spaced out when the
budget cannot pay for it, gives way to them.
"""

from __future__ import annotations

import collections
import math
import statistics

DENSE_OFFSETS = (0, 1, 2, 4, 8, 16, 32, 64)  # steps into a new decode that are walked
# After them, walks at steps counted from the decode's start, each BEAT_RATIO times the last (96,
# 144, 216, ...), first in the budget: a sawtooth of period P (a program that evaluates its caches
# every P steps) is seen cut by two of them within 1.5 P steps, whatever the machine's speed, at a
# cost that grows with the log of the steps. Walks by decode time come on top.
FIRST_BEAT = 96
BEAT_RATIO = 1.5
# A beat is owed whatever the budget while a walk's work (its CPU time) is below this: on a loaded
# machine a walk's wall time is mostly its wait for a core, and one spent credit would put the
# beats off past the sawtooth they are there to see. Dearer walks wait for the budget.
BEAT_CPU_SECONDS = 0.01
# Walks of a new decode taken even when the budget is spent now (they are charged, and the routine
# walks after them give way): one for its level, two 16 steps apart for its rate. Without them a
# server whose budget one slow walk had spent was blind to the next batch, and let requests run
# past the limit. The first step's reading is no point of the growth: what the prompt's last
# forward left pending is still there then.
OWED_OFFSETS = (0, 16, 32)
# A busy batch that changed before its growth was read: two walks owed in its new epoch, once the
# change has settled, for the rate (a batch that changes every second would otherwise put the
# owed walks of its new decode off for good).
OWED_CHANGE_OFFSETS = (1, 16)
# A busy batch that changed: one walk, a step after the change (a burst of changes settles first).
CHANGE_OFFSETS = (1,)
# Budget granted up front (a floor, not added): a young watchdog must read the first requests of a
# server as they come, not spend its first seconds' budget on one batch and miss the next changes.
# Past 25 s of decode the 1% holds.
WALK_CREDIT_SECONDS = 0.25
AUTO_WALK_INTERVAL = 0.5  # seconds of decode between walks after the dense ones (walk_interval=None)...
AUTO_WALK_SHARE = 0.001  # ...or more, so that they take at most this share of decode time
# The fix is charged to the budget, but a fix that alone spends it (fix_every=1 on a slow host)
# must not blind the watchdog: the walks keep the start-up credit (while it is what is allowed),
# then this share of the budget, for themselves.
WALK_FLOOR_SHARE = 0.1
# A fix the budget cannot pay for now waits until it can, but at most this many times its interval
# (fix_every): a busy server's fixes alone took it past its budget. The chains it cuts grow that
# much longer meanwhile, and a stop decision fixes first whatever the budget.
FIX_STRETCH = 4
# Walks that measure a growth not known yet (a new decode's) come first: the others (the walk at
# a change of a busy batch whose growth is known, the interval walks) leave this share of the
# budget to them. A server whose batch empties now and then must read each new batch's growth
# within a few steps, whatever the changes before it spent.
ROUTINE_SHARE = 0.75
# The caches changed since the last reading: its walk is owed, whatever the budget, once the decode
# since the last walk has paid for one at this share of the overhead budget (by the walks' CPU work,
# not their wall time: a loaded machine must not make readings rarer). Owed at each change, it keeps
# a busy server's reading within about a request of the count.
REFRESH_SHARE = 0.25
# The interval walk the budget cannot pay for waits, but at most this many times its interval
# (the reading of a steady decode, whose growth the forecast extrapolates meanwhile).
STALE_STRETCH = 4
MAX_STEP_SECONDS = 1.0  # a longer gap between two steps is idle time, not decode time
# What the next walk will cost: the median of the last few. One walk descheduled on a loaded
# machine would otherwise hold every walk back until the decode had earned it.
COST_WINDOW = 5


class Schedule:
    def __init__(self, overhead_budget: float, walk_interval: float | None, beats: bool = True) -> None:
        self._budget = overhead_budget
        self.walk_interval = walk_interval
        self.decode_seconds = 0.0  # sum of the (capped) gaps between observed steps
        self.spent = 0.0  # seconds of observe() charged to the budget, the fix's included
        self.fix_spent = 0.0  # of which the fix's
        self._costs: collections.deque[float] = collections.deque(
            maxlen=COST_WINDOW
        )  # the last walks' seconds
        self.last_cost = 0.0  # what the next walk is expected to cost
        self._works: collections.deque[float] = collections.deque(maxlen=COST_WINDOW)  # their CPU work
        self.work = 0.0  # what the next walk is expected to cost in CPU work
        self.walk_step = -1  # the step of the last walk (-1: none yet)
        self.walk_decode = 0.0  # decode_seconds at the last walk
        self._interval = max(AUTO_WALK_INTERVAL, walk_interval or 0.0)  # when a late one is owed
        self._fix_costs: collections.deque[float] = collections.deque(maxlen=COST_WINDOW)
        self.fix_cost = 0.0  # what the next fix is expected to cost
        self._epoch_start = 0
        self._offsets: tuple[int, ...] = DENSE_OFFSETS  # the epoch's walks, as steps into it
        self._next = 0  # index into _offsets of the next one
        self._continuing = False  # the epoch's caches partly go on from the last one
        self._owed_offsets: tuple[int, ...] = OWED_OFFSETS  # the epoch's walks owed whatever the budget
        self._owed = len(OWED_OFFSETS)  # index into _owed_offsets of the next one
        self._owed_next = False  # a walk owed at the next step (owe_walk)
        # The walks at steps counted from the decode's start (not in fix mode: the fix cuts the
        # chains itself, and its probes measure what it cuts).
        self._first_beat: float = FIRST_BEAT if beats else math.inf
        self._decode_start = 0  # the step the decode began at (its first epoch's)
        self._beat = self._first_beat  # the next, as steps into the decode
        # Below both, no walk is wanted and due() is False: observe() skips the call (it runs on
        # every step, after the forward has left the CPU's caches cold; see Watchdog._observe).
        # interval_decode is the decode time of the last walk plus the gap to the next; wake_decode
        # the first decode time at which a walk may be wanted or owed (that one, or a refresh).
        self.wake_step: float = 0
        self.interval_decode = AUTO_WALK_INTERVAL if walk_interval is None else walk_interval
        self.wake_decode = self.interval_decode
        self._off = False  # switch_off(): no walk is ever due
        self._slept = False  # the marks are due()'s, set past the walks the budget holds back
        self._arm()

    @property
    def overhead_budget(self) -> float:
        return self._budget

    @overhead_budget.setter
    def overhead_budget(self, value: float) -> None:
        self._budget = value
        self._arm()  # what fits the budget now is another matter

    def _arm(self) -> None:
        """wake_step: the epoch's next walk, or owed walk; wake_decode: the next interval walk,
        or owed refresh."""
        self._slept = False
        owed = self._owed_offsets
        offsets = [owed[self._owed]] if self._owed < len(owed) else []
        if self._next < len(self._offsets):
            offsets.append(self._offsets[self._next])
        changed = self._epoch_start > self.walk_step
        if changed:  # the walk of the change, when it comes owed
            offsets.append(CHANGE_OFFSETS[0])
        self.wake_step = min(
            self._epoch_start + min(offsets) if offsets else math.inf, self._decode_start + self._beat
        )
        if self._owed_next:
            self.wake_step = 0
        self.wake_decode = min(self.interval_decode, self.stale_decode())
        if changed:
            self.wake_decode = min(self.wake_decode, self.refresh_decode())
        if self._off:
            self.wake_step = self.wake_decode = math.inf

    def refresh_decode(self) -> float:
        """The decode time from which the walk of a change of the caches is owed: when the decode
        since the last walk has paid for one at ``REFRESH_SHARE`` of the budget."""
        share = REFRESH_SHARE * self._budget
        return self.walk_decode + self.work / share if share > 0 else math.inf

    def stale_decode(self) -> float:
        """The decode time from which the interval walk is owed: ``STALE_STRETCH`` intervals
        after the last walk."""
        return self.walk_decode + STALE_STRETCH * self._interval

    def new_epoch(self, step: int, continuing: bool = False, measured: bool = True) -> None:
        """A new epoch at ``step``. One whose caches partly go on (``continuing``: a request
        joined a busy batch) keeps the growth measured so far: when it is ``measured``, it needs
        one reading of its new level, not the dense ones of a new decode (a busy server has two
        such epochs per request or more)."""
        self._epoch_start = step
        self._continuing = continuing
        self._owed = 0
        if not continuing:
            self._decode_start, self._beat = step, self._first_beat
            self._offsets, self._owed_offsets = DENSE_OFFSETS, OWED_OFFSETS
        else:
            self._owed_offsets = (
                () if measured else OWED_CHANGE_OFFSETS
            )  # its level after the change settles; densely while the growth is unknown
            self._offsets = CHANGE_OFFSETS if measured else DENSE_OFFSETS[1:]
        self._next = 0
        self._arm()

    def due(self, step: int, measured: bool = True) -> bool:
        """Is a walk due at ``step``, and does it fit the budget? ``measured``: the growth is known
        (the walk is routine). (Every step: kept cheap.)"""
        if self._off:
            return False
        offset = step - self._epoch_start
        owed = self._owed_offsets
        if self._owed_next or (self._owed < len(owed) and offset >= owed[self._owed]):
            return True
        beat = step - self._decode_start >= self._beat
        if beat and (self.work < BEAT_CPU_SECONDS or self.affordable()):  # first in the budget
            return True
        decode = self.decode_seconds
        if decode >= self.stale_decode():  # the interval walk, late too long
            return True
        changed = self._epoch_start > self.walk_step and offset >= CHANGE_OFFSETS[0]
        if changed and decode >= self.refresh_decode():  # the caches changed since the reading
            return True
        dense = self._next < len(self._offsets) and offset >= self._offsets[self._next]
        share = ROUTINE_SHARE if measured else 1.0
        if (dense or decode >= self.interval_decode) and self.affordable(share=share):
            return True
        self._sleep(step, beat, dense, share)
        return False

    def _sleep(self, step: int, beat: bool, dense: bool, share: float) -> None:
        """No walk at ``step``: the marks move to the first step and decode time at which ``due``
        may say otherwise, so that the steps until then do not ask (a walk the budget holds back
        would have every step ask, ~180 bytecodes each, until the decode has paid for it). They
        hold while nothing but the step and the time the decode and the watchdog spend moves on:
        a walk, a new epoch, an owed walk, a refund, a fix and a new budget arm them again."""
        offset = step - self._epoch_start
        steps = [self._decode_start + self._beat] if not beat else []
        owed = self._owed_offsets
        if self._owed < len(owed):
            steps.append(self._epoch_start + owed[self._owed])
        if self._next < len(self._offsets) and not dense:
            steps.append(self._epoch_start + self._offsets[self._next])
        if self._epoch_start > self.walk_step and offset < CHANGE_OFFSETS[0]:
            steps.append(self._epoch_start + CHANGE_OFFSETS[0])
        routine = self.affordable_from(share)
        decode = min(self.stale_decode(), routine if dense else max(self.interval_decode, routine))
        if beat:  # a beat held back by the budget (its walks cost BEAT_CPU_SECONDS or more)
            decode = min(decode, self.affordable_from(1.0))
        if self._epoch_start > self.walk_step:
            decode = min(decode, self.refresh_decode())
        self.wake_step = min(steps) if steps else math.inf
        self.wake_decode = decode
        self._slept = True

    def affordable_from(self, share: float = 1.0) -> float:
        """The decode time from which one more walk may fit ``share`` of the budget (``affordable``):
        now, where it does; else a bound that holds while the seconds spent only grow (until a
        refund or a fix, which arm the marks again)."""
        if self.affordable(share=share):
            return self.decode_seconds
        if self._budget <= 0:
            return math.inf  # only the credit is allowed, and it is spent
        cost = self.last_cost
        return (1 - 1e-9) * min(  # (a hair early: rounding must not put it past the walk)
            (self.spent + cost) / (share * self._budget),  # within share of the budget
            (self.spent - self.fix_spent + cost) / (WALK_FLOOR_SHARE * self._budget),  # the walks' floor
        )

    def affordable(self, walks: int = 1, share: float = 1.0) -> bool:
        """Do ``walks`` more walks (at the last one's cost) fit ``share`` of the budget?"""
        # Everything observe() spends counts, not only walks (wall time: that is what the decode
        # loses). The budget runs over the watchdog's lifetime: a server has a new epoch with every
        # change of its batch, and a credit per epoch would let short requests cost more than the
        # budget. The credit is a floor: past WALK_CREDIT_SECONDS / overhead_budget of decode,
        # at most overhead_budget is spent.
        allowed = max(self._budget * self.decode_seconds, WALK_CREDIT_SECONDS)
        cost = walks * self.last_cost
        if self.spent + cost <= share * allowed:
            return True
        # While the credit is what is allowed, the walks keep all of it; after that, a tenth of the
        # budget (the credit kept for good lets the fix and the walks together overspend a busy
        # server's first minutes).
        floor = allowed if allowed == WALK_CREDIT_SECONDS else WALK_FLOOR_SHARE * allowed
        return self.spent - self.fix_spent + cost <= floor

    def owe_walk(self) -> None:
        """A walk at the next step, whatever the budget: what the last one read is stale (a fix
        of long chains, spread over steps, has just cut them)."""
        self._owed_next = True
        self._arm()

    def switch_off(self) -> None:
        """No walk is ever due from now on, owed ones included: a step runs observe()'s per-step
        path alone (a diagnostic: what that path costs without the walks; a watchdog so switched
        reads nothing)."""
        self._off = True
        self.wake_decode = math.inf
        self._arm()

    def stepped(self, gap: float) -> None:
        """A step came ``gap`` seconds after the last one: decode time, the gap capped at
        ``MAX_STEP_SECONDS`` so that idle time (a server between requests, a program doing other
        work) banks no walking budget. (Every step: kept cheap.)"""
        self.decode_seconds += gap if gap < MAX_STEP_SECONDS else MAX_STEP_SECONDS

    def charge(self, seconds: float) -> None:
        """The watchdog's own seconds, against the budget. (Every step: kept cheap.)"""
        self.spent += seconds

    def set_overhead_budget(self, overhead_budget: float) -> None:
        """Another overhead budget, from now on."""
        self.overhead_budget = overhead_budget

    def set_walk_interval(self, walk_interval: float | None) -> None:
        """Another walk interval, from the next walk on."""
        self.walk_interval = walk_interval

    def charge_fix(self, seconds: float) -> None:
        """Of the seconds charged, those the fix took (``observe`` has charged them already)."""
        self.fix_spent += seconds
        self._fix_costs.append(seconds)
        self.fix_cost = statistics.median(self._fix_costs)
        if self._slept:  # the walks' floor has more room
            self._arm()

    def fix_affordable(self) -> bool:
        """Does one more fix (at the last ones' cost) fit the budget? (Asked once a fix is due.)"""
        allowed = max(self._budget * self.decode_seconds, WALK_CREDIT_SECONDS)
        return self.spent + self.fix_cost <= allowed

    def refund(self, seconds: float) -> None:
        """Seconds charged that were not the watchdog's to pay (the program's deferred work)."""
        self.spent -= seconds
        if self._slept and seconds > 0:  # the budget has more room
            self._arm()

    def first_of_decode(self, step: int) -> bool:
        """Is ``step`` the first of a new decode? Its reading is a level, not a point of the growth:
        what the prompt's last forward left pending is still there then."""
        return not self._continuing and step == self._epoch_start

    def walked(self, step: int, cost: float, cpu_cost: float | None = None) -> None:
        """A walk at ``step`` took ``cost`` seconds (wall: what the decode lost) and ``cpu_cost``
        of CPU (its work: a walk that waited for a core must not space the next ones out)."""
        self._costs.append(cost)
        self.last_cost = statistics.median(self._costs)
        work = cost if cpu_cost is None else min(cost, cpu_cost)  # (the walk and its waiter run in turn)
        self._works.append(work)
        self.work = statistics.median(self._works)
        self.walk_step, self.walk_decode = step, self.decode_seconds
        self._owed_next = False
        offset = step - self._epoch_start
        while self._owed < len(self._owed_offsets) and self._owed_offsets[self._owed] <= offset:
            self._owed += 1
        while self._next < len(self._offsets) and self._offsets[self._next] <= offset:
            self._next += 1
        while self._beat <= step - self._decode_start:
            self._beat = math.ceil(self._beat * BEAT_RATIO)
        if self.walk_interval is not None:
            gap = self.walk_interval
        else:
            gap = max(AUTO_WALK_INTERVAL, work / AUTO_WALK_SHARE)
        # The interval walk owed when late: no sooner than a thousandth of decode pays for it
        # (walk_interval=0 asks for walks as often as the budget allows, not for every step).
        self._interval = max(gap, AUTO_WALK_INTERVAL, work / AUTO_WALK_SHARE)
        self.interval_decode = self.decode_seconds + gap
        self._arm()
