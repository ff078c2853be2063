"""Rank-aware watchdogs for distributed MLX jobs (``mlx.launch``, mlx-lm's sharded loading).

Each rank has its own buffers, its own limit and possibly its own leak; a rank that stops alone
leaves the others failing in their next collective operation. Here the ranks agree, through
one small MLX collective (``mx.distributed.all_gather``) every ``every`` steps, on the worst
(smallest) steps-to-limit of the group and on the step at which to stop, so every rank raises
:class:`~mlx_watchdog.ResourceLimitForecast` at the same step. The fix stays local.

    import mlx.core as mx
    import mlx_watchdog
    from mlx_watchdog.attach import distributed

    distributed.instrument()                 # before mx.distributed.init()
    group = mx.distributed.init()            # or mlx-lm's sharded_load, which calls it
    wd = mlx_watchdog.Watchdog(stop_within=1000)   # wd.coordinator: a Coordinator

``instrument()`` wraps ``mx.distributed.init`` to record the group the program initializes, and
installs a factory (``core/coordination.py``) that gives every new watchdog a coordinator once
that group exists; watchdogs made before ``init`` join when it returns. ``uninstrument()`` puts
``mx.distributed.init`` back. Importing this module changes nothing.

Schedule: a round starts at every step that is a multiple of ``every`` (a pure function of the
step count, so every rank calls the collective at the same steps) and is read one step later
(``READ_LAG``): the collective runs while the step computes, so waiting for it costs almost
nothing when the ranks are in lockstep. Between rounds the agreed value counts down one per step.

Requirement: every rank observes the same decode steps (true for pipeline and tensor parallel
decoding, where the model's own collectives keep the ranks in lockstep). A rank whose watchdog
stops stepping while another's keeps going leaves that one waiting in its next round.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx

from ..core import clock, coordination
from ..core import forecast as fc
from ..core.actions import ResourceLimitForecast
from ..core.watchdog import Watchdog, live_watchdogs

logger = logging.getLogger("mlx_watchdog")

# A round every 32 steps keeps the agreement's cost well inside the 1% budget the graph walks
# share; a stop comes at most every + READ_LAG steps after the leak is measurable.
DEFAULT_EVERY = 32
READ_LAG = 1  # a round started at step s is read at step s + READ_LAG
ENV_DISABLE = "MLX_WATCHDOG_COORDINATE"  # "0" turns automatic coordination off (labels stay)

_FIELDS = ("step", "steps_to_limit", "resident_buffers", "buffers_per_step", "limit", "stop_within")

_lock = threading.RLock()
_group: Any = None  # the global group of size > 1 that the program initialized, once seen
_wrapped: tuple[Callable, Callable] | None = None  # (mx.distributed.init as found, our wrapper)


# --------------------------------------------------------------------------- instrumenting


def instrument() -> bool:
    """Coordinate the watchdogs of this process with the other ranks: wrap ``mx.distributed.init``
    so the group the program initializes is recorded (the wrapper returns exactly what ``init``
    returns), and give watchdogs a coordinator once that group exists, those made before it
    (when ``init`` returns, if they have not stepped yet) and after it. Call it before
    ``mx.distributed.init()``. Idempotent; returns whether this call instrumented."""
    global _wrapped
    with _lock:
        if _wrapped is not None:
            return False
        original = mx.distributed.init

        @functools.wraps(original)
        def init(*args, **kwargs):
            group = original(*args, **kwargs)
            _record(group)
            return group

        mx.distributed.init = init
        _wrapped = (original, init)
        coordination.set_factory(_new_watchdog)
        return True


def uninstrument() -> None:
    """Undo ``instrument()``: ``mx.distributed.init`` is the function it was before, and new
    watchdogs get no coordinator. Watchdogs already coordinated stay so (``detach`` ends that)."""
    global _wrapped
    with _lock:
        if _wrapped is None:
            return
        original, wrapper = _wrapped
        _wrapped = None
        if mx.distributed.init is wrapper:
            mx.distributed.init = original
        else:  # wrapped again since by someone else: unwrapping would drop their wrapper
            logger.warning(
                "mlx-watchdog: mx.distributed.init was wrapped again after instrument(); left as it is"
            )
        previous = coordination.set_factory(None)
        if previous is not _new_watchdog:  # another's since: leave it
            coordination.set_factory(previous)


def instrumented() -> bool:
    """Is ``instrument()`` in effect?"""
    return _wrapped is not None


def current_group() -> Any:
    """The distributed group of size > 1 this process initialized, when ``mx.distributed.init()``
    ran instrumented; else ``None``. Never calls ``init`` itself: launched, that joins the ring
    and blocks until every rank joins."""
    return _group


def _record(group: Any) -> None:
    global _group
    try:
        if _group is not None or group.size() <= 1:
            return
        with _lock:
            if _group is not None:
                return
            _group = group
        _attach_waiting(group)
    except Exception as exc:  # the program's init call must never fail because of us
        logger.warning("mlx-watchdog: could not record the distributed group: %r", exc)


def _attach_waiting(group: Any) -> None:
    """Watchdogs created before ``init`` (a decorator at import time) join once it returns, if they
    have not stepped yet: their step counts then start together on every rank."""
    if not _coordination_enabled():
        return
    for wd in live_watchdogs(unexported=True):
        if wd.coordinator is not None:
            continue
        if wd.steps == 0:
            attach(wd, group)
        else:
            logger.warning(
                "mlx-watchdog: %r stepped before mx.distributed.init(): its stops are not "
                "coordinated; call mlx_watchdog.attach.distributed.attach(wd) on every rank "
                "at the same step",
                wd,
            )


def _new_watchdog(watchdog: Watchdog) -> Coordinator | None:
    """The factory ``instrument()`` installs: a coordinator for a watchdog made once the group
    exists. Never initializes anything, never raises."""
    try:
        group = _group
        if group is not None and _coordination_enabled():
            return _coordinator(watchdog, group, DEFAULT_EVERY)
    except Exception as exc:
        logger.warning("mlx-watchdog: distributed attach failed (the watchdog works locally): %r", exc)
    return None


def _coordination_enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1").strip().lower() not in ("0", "false", "no", "off")


# --------------------------------------------------------------------------- attaching


def attach(watchdog: Watchdog, group: Any = None, *, every: int = DEFAULT_EVERY) -> Coordinator | None:
    """Make ``watchdog`` rank-aware and coordinate its forecast and stops with the other ranks.

    ``group``: an ``mx.distributed.Group``; ``None`` takes the recorded group, else
    ``mx.distributed.init()`` (which joins the launched group: call this on every rank).
    ``every``: steps between agreements. Call it on every rank at the same step count.
    Returns the :class:`Coordinator`, or ``None`` for a group of size 1."""
    if not isinstance(watchdog, Watchdog):
        raise ValueError(f"attach needs a mlx_watchdog.Watchdog, got {type(watchdog).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        raise ValueError(f"every must be a positive integer number of steps, got {every!r}")
    if group is None:
        group = _group if _group is not None else mx.distributed.init()
    if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
        raise ValueError(f"group must be an mx.distributed.Group, got {type(group).__name__}")
    coordinator = _coordinator(watchdog, group, every)
    watchdog.coordinator = coordinator
    return coordinator


def _coordinator(watchdog: Watchdog, group: Any, every: int) -> Coordinator | None:
    if int(group.size()) <= 1:
        return None
    if watchdog.stop_within is not None and watchdog.stop_within < every + READ_LAG:
        logger.warning(
            "mlx-watchdog: stop_within=%s is shorter than the agreement interval (%d steps "
            "+ %d): a leak that starts between agreements may reach the limit first",
            watchdog.stop_within,
            every,
            READ_LAG,
        )
    return Coordinator(watchdog, group, every)


def detach(watchdog: Watchdog) -> None:
    """Stop coordinating (do it on every rank at the same step); the rank and world size are the
    launcher's again."""
    watchdog.coordinator = None


# --------------------------------------------------------------------------- agreement


@dataclasses.dataclass(frozen=True)
class RankReading:
    """What one rank contributed to a round (its local forecast at the round's step)."""

    rank: int
    step: int
    steps_to_limit: float
    resident_buffers: float
    buffers_per_step: float
    limit: float
    stop_within: float  # math.inf when that rank has no stop_within


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The outcome of one round, identical on every rank (computed from the same gathered data)."""

    step: int  # the step at which the readings were taken (a multiple of ``every``)
    steps_to_limit: float  # the worst (smallest) over the ranks at ``step``
    worst_rank: int
    stop_within: float | None  # the largest stop_within of any rank (the most cautious)
    stop_step: int | None  # the step at which every rank stops; None: no stop forecast
    readings: tuple[RankReading, ...]
    in_lockstep: bool

    def steps_to_limit_at(self, step: int) -> float:
        return self.steps_to_limit - (step - self.step)


def agree(rows: list[list[float]], step: int, lag: int = READ_LAG) -> Agreement:
    """The agreement every rank derives from the gathered rows (one row per rank, ``_FIELDS``).

    A pure function of its inputs: the ranks hold the same rows, so they agree without another
    exchange. Ties go to the lowest rank."""
    readings = tuple(RankReading(r, int(row[0]), *(float(v) for v in row[1:])) for r, row in enumerate(rows))
    worst = min(readings, key=lambda reading: (reading.steps_to_limit, reading.rank))
    cautious = [r.stop_within for r in readings if math.isfinite(r.stop_within)]
    stop_within = max(cautious) if cautious else None
    stop_step = None
    if stop_within is not None and math.isfinite(worst.steps_to_limit):
        # The first step at which the countdown is within stop_within, never before it is known.
        stop_step = step + max(lag, math.ceil(worst.steps_to_limit - stop_within))
    return Agreement(
        step,
        worst.steps_to_limit,
        worst.rank,
        stop_within,
        stop_step,
        readings,
        all(r.step == readings[0].step for r in readings),
    )


class Coordinator:
    """Installed on ``watchdog.coordinator`` (``core/coordination.py``); core calls :meth:`worst`
    on every observed step."""

    def __init__(self, watchdog: Watchdog, group: Any, every: int = DEFAULT_EVERY, lag: int = READ_LAG):
        self.watchdog = watchdog
        self.group = group
        self.every = every
        self.lag = lag
        self.rank = int(group.rank())
        self.world_size = int(group.size())
        self.agreement: Agreement | None = None
        self.rounds = 0  # rounds started (the collective was called)
        self.seconds = 0.0  # time spent in worst(), collective included
        self.errors = 0
        self._rounds_due_from = watchdog.steps // every  # attached mid-decode: count from here
        self._pending: tuple[int, mx.array] | None = None  # (step, gathered array)
        self._ignore_until = -1  # readings taken at or before a stop are stale
        self._broken = False
        self._warned: set[str] = set()
        self._all_gather = mx.distributed.all_gather  # the one collective (replaceable in tests)

    # ------------------------------------------------------------------ the hook

    def worst(self, step: int, steps_to_limit: float) -> float:
        """The group's steps-to-limit at ``step``; raises ResourceLimitForecast at the agreed stop step."""
        start = clock.wall()
        try:
            if self._broken:
                return steps_to_limit
            try:
                self._exchange(step, steps_to_limit)
            except Exception as exc:  # a peer died, the group is broken: the watchdog goes on locally
                self._broken = True
                self.errors += 1
                logger.error(
                    "mlx-watchdog: rank %d: the distributed agreement failed (%r); stops are "
                    "no longer coordinated",
                    self.rank,
                    exc,
                )
                return steps_to_limit
            agreement = self.agreement
            if agreement is None:
                return math.inf
            if agreement.stop_step is not None and step >= agreement.stop_step:
                self._stop(step, agreement)
            value = agreement.steps_to_limit_at(step)
            local = self.watchdog.stop_within
            if local is not None and value <= local:
                # Only the agreed stop step stops: keep core's own check from stopping one rank early.
                value = math.nextafter(float(local), math.inf)
            return value
        finally:
            self.seconds += clock.wall() - start

    def forecast(self, step: int | None = None) -> fc.Forecast | None:
        """The worst rank's forecast as agreed, counted down to ``step`` (default: now); fields the
        ranks do not exchange (graph nodes, cache split) are this rank's. ``None`` before the
        first agreement."""
        agreement = self.agreement
        return None if agreement is None else self._agreed(agreement, step)

    def _agreed(self, agreement: Agreement, step: int | None) -> fc.Forecast:
        local = self.watchdog.forecast()
        step = local.step if step is None else step
        worst = agreement.readings[agreement.worst_rank]
        stl = agreement.steps_to_limit_at(step)
        resident = worst.resident_buffers + max(0.0, worst.buffers_per_step) * (step - agreement.step)
        return dataclasses.replace(
            local,
            step=step,
            resident_buffers=int(round(resident)),
            limit=int(worst.limit),
            buffers_per_step=worst.buffers_per_step,
            steps_to_limit=max(0.0, stl),
            seconds_to_limit=fc.seconds_from_steps(max(0.0, stl), local.step_rate),
            leaks=local.leaks if worst.rank == self.rank else (),
            rank=worst.rank,
            world_size=self.world_size,
        )

    # ------------------------------------------------------------------ rounds

    def _exchange(self, step: int, steps_to_limit: float) -> None:
        if self._pending is not None and step >= self._pending[0] + self.lag:
            self._read()
        due = step // self.every - self._rounds_due_from
        while self.rounds < due:
            # Normally one round at each multiple of `every`. A step number that skipped one (a
            # call that never came) still makes up the missed rounds: the count of collectives
            # stays a function of the step number on every rank.
            if self._pending is not None:
                self._read()
            self._start(step, steps_to_limit)

    def _start(self, step: int, steps_to_limit: float) -> None:
        forecast = self.watchdog.forecast()
        stop_within = self.watchdog.stop_within
        row = [
            float(step),
            float(steps_to_limit),
            float(forecast.resident_buffers),
            float(forecast.buffers_per_step),
            float(forecast.limit),
            math.inf if stop_within is None else float(stop_within),
        ]
        gathered = self._all_gather(mx.array(row, dtype=mx.float32), group=self.group)
        mx.async_eval(gathered)
        self.rounds += 1
        self._pending = (step, gathered)

    def _read(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, gathered = pending
        values = cast("list[float]", gathered.tolist())  # waits for the collective (normally done by now)
        width = len(_FIELDS)
        if len(values) != width * self.world_size:
            raise RuntimeError(
                f"gathered {len(values)} values, expected {width} from each of {self.world_size} ranks"
            )
        rows = [values[i : i + width] for i in range(0, len(values), width)]
        agreement = agree(rows, step, self.lag)
        if not agreement.in_lockstep and "lockstep" not in self._warned:
            self._warned.add("lockstep")
            logger.warning(
                "mlx-watchdog: the ranks are not in lockstep (steps %s in one round): "
                "coordinated stops assume every rank observes the same decode steps",
                [r.step for r in agreement.readings],
            )
        if step <= self._ignore_until:
            return
        self.agreement = agreement

    def _stop(self, step: int, agreement: Agreement) -> None:
        forecast = self._agreed(agreement, step)
        # Forget what led here: a reading taken before the stop must not stop the next generation.
        self.agreement = None
        self._ignore_until = step
        self.watchdog.record_stop("forecast", forecast)
        logger.error(
            "mlx-watchdog: rank %d stops with all %d ranks at step %d (agreed at step %d): "
            "rank %d forecasts %s",
            self.rank,
            self.world_size,
            step,
            agreement.step,
            agreement.worst_rank,
            forecast.describe(),
        )
        exc = ResourceLimitForecast(forecast)
        exc.agreement = agreement
        raise exc

    def __repr__(self) -> str:
        return (
            f"Coordinator(rank={self.rank}, world_size={self.world_size}, every={self.every}, "
            f"rounds={self.rounds})"
        )
