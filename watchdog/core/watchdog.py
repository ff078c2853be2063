"""The watchdog: observe a decode step, account its graph, forecast the limit, fix and act.

One ``Watchdog`` follows one model's decode. ``observe(roots)`` runs once per step, at the
*entry* of the step: whatever is still pending in the cache then was left behind by the
previous step (observing right after the forward would walk the whole forward graph).

What it reads is every cache of the model alive in the process (``caches.py``), not one
decode: a busy batch that outlives its requests, a prompt filled beside it, two decodes at once.
When it reads is ``schedule.py``'s: densely as each set of caches starts, then by decode time,
within a lifetime budget. How much of the graph one reading walks is ``sampling.py``'s: all of it,
or a sample of each site's pending chains when walking all would stall the decode. Between
readings the forecast extrapolates.

Two things may be attached to a watchdog, and its forecast asks them for their readings: a
coordinator (``coordinator``: the ranks of a distributed job, ``coordination.py``) and a prefill
guard (``prefill_guard``). Core defines what it asks of them; ``mlx_watchdog.attach`` provides them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import types
import weakref
from collections.abc import Callable
from threading import get_ident
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
from mlx.utils import tree_flatten

from . import allocator, clock, compiled, graph
from . import forecast as fc
from .actions import ResourceLimitForecast, Stop, Warnings, remedy
from .arrays import Found, scan_all, steps_key
from .attribution import Attribution
from .caches import KEPT_MARK, Scope, member_of
from .census import Census
from .census import advice as outside_advice
from .coordination import Coordinator, launched, new_coordinator
from .counters import Counters, PartAttribute
from .epochs import Epochs
from .fix import Fixer, Probe, evaluated_output, schedule_evaluation
from .growth import Growth
from .limits import BufferCounter, find_buffer_counter, resolve_limit, unseen_margin
from .live import LIVE
from .live import live_watchdogs as live_watchdogs  # its home before live.py
from .objects import type_name
from .options import (
    WatchdogOptions,
    checked_bool,
    checked_fraction,
    checked_name,
    checked_positive_int,
    checked_walk_interval,
)
from .pace import IDLE_SECONDS, StepClock
from .process_count import ProcessCounter
from .process_count import counter as process_counter
from .reading import Reading, SiteCount, read
from .rows import EVERY as ROWS_EVERY
from .rows import RowsWatch
from .sampling import Sampler, warm_up
from .schedule import FIX_STRETCH, ROUTINE_SHARE, Schedule
from .snapshot import Snapshot

logger = logging.getLogger("mlx_watchdog")

DEFAULTS = WatchdogOptions()


def input_tokens(inputs: Any) -> int:
    """Tokens a forward's inputs (batch x tokens) hold: more than one is a prefill."""
    shape = getattr(inputs, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) >= 2 else 1


def _buffer_counter(process_count: bool | str) -> tuple[BufferCounter | ProcessCounter | None, str | None]:
    """The count of live buffers a watchdog reads: MLX's own, where it has one (Metal); else the
    process count (``process_count.py``), where it is on. With why the process count is not read
    (None while it is)."""
    counter = find_buffer_counter()
    if counter is not None:
        return counter, f"MLX's own counter is read ({counter.name})"
    return process_counter(process_count)


@runtime_checkable
class PrefillReadings(Protocol):
    """What ``forecast()`` reads from the prefill guard installed on the watchdog
    (``mlx_watchdog.attach.prefill``); ``None`` until measured."""

    @property
    def graph_nodes(self) -> int | None:
        """Pending graph nodes of the last prefill chunk measured."""
        ...

    @property
    def safe_tokens(self) -> int | None:
        """The largest prefill chunk predicted to stay within the limit."""
        ...


@dataclasses.dataclass(frozen=True)
class _Gone:
    """What the caches dead since a reading took with them; recounted when the scope changes."""

    reading: Reading | None = None
    version: int = -1  # the scope's version it was counted at
    buffers: float = 0.0  # the dead caches' buffers
    alive_share: float = 1.0  # the share of the growth that goes on in the live caches


class Watchdog:
    """Counts the buffers each decode step leaves resident, names where they come from,
    forecasts when the limit is hit, and optionally fixes the leak or stops before the limit.

    Args:
        limit: the buffer limit; ``None`` takes the device's ``resource_limit`` where MLX reports
            one (Metal), else 499,000.
        name: the ``watchdog`` label of exported metrics (default: set from the model, else "default").
        fix: materialize pending cache arrays (``mx.async_eval``: cuts lazy chains, no wait on
            the device): those of the sites seen growing, and every pending one each
            ``fix.FULL_SWEEP_FIXES``-th fix and before a stop (``fix.py``).
        fix_every: run the fix every N observed steps, or less often (at most 4N) while the
            overhead budget cannot pay for it.
        warn_within: log a warning when the limit is forecast within this many steps (at most once a minute).
        stop_within: raise :class:`ResourceLimitForecast` when the limit is forecast within this many steps.
        on_forecast: called with each new :class:`Forecast` (after each graph walk).
        overhead_budget: ceiling on the fraction of decode wall time the watchdog may spend (default 1%).
        walk_interval: seconds of decode between two graph walks once an epoch's dense walks are
            done (``schedule.py``). ``None`` (default): 0.5 s, or longer where one walk
            costs more than 0.5 ms, so that walks take 0.1% of decode time. 0: walk whenever the
            budget allows.
        export: publish this watchdog through the exporters (``start_metrics_server``).
        model: the watched model, to count its parameters as resident buffers.
        process_count: read the growth of the whole process, not only of the caches walked, from
            a count of MLX's live buffers kept at its allocator (``process_count.py``): growth the
            named sites do not explain is reported as ``Forecast.unattributed_buffers_per_step``.
            ``"auto"`` (default): as ``$MLX_WATCHDOG_PROCESS_COUNT`` says (on, off; unset or auto:
            on where its self-check passes); ``True``: on where its self-check passes, a failure
            logged as a warning; ``False``: off. Where MLX has a buffer counter of its own, that one
            is read instead. When it is off, ``process_count_off`` says why.
        census: find the program's own objects that hold pending arrays outside the caches (a
            server's per-step outputs kept lazily), from the garbage collector's view, within a
            share of the budget, and read their attributes as sites ``outside:<module>.<Class>.<attr>``
            (``census.py``). ``"auto"`` (default): as ``$MLX_WATCHDOG_CENSUS`` says (on unless
            off); ``True``: on; ``False``: off. ``census.off`` says why it is off.
    """

    def __init__(
        self,
        limit: int | None = None,
        *,
        name: str | None = None,
        fix: bool = DEFAULTS.fix,
        fix_every: int = DEFAULTS.fix_every,
        warn_within: float | None = None,
        stop_within: float | None = None,
        on_forecast: Callable[[fc.Forecast], Any] | None = None,
        overhead_budget: float = DEFAULTS.overhead_budget,
        walk_interval: float | None = None,
        export: bool = DEFAULTS.export,
        model: Any = None,
        max_objects: int = DEFAULTS.max_objects,
        max_depth: int = DEFAULTS.max_depth,
        process_count: bool | str = DEFAULTS.process_count,
        census: bool | str = DEFAULTS.census,
    ):
        options = WatchdogOptions(
            limit=limit,
            name=name,
            fix=fix,
            fix_every=fix_every,
            warn_within=warn_within,
            stop_within=stop_within,
            on_forecast=on_forecast,
            overhead_budget=overhead_budget,
            walk_interval=walk_interval,
            export=export,
            max_objects=max_objects,
            max_depth=max_depth,
            process_count=process_count,
            census=census,
        )
        self.limit = resolve_limit(options.limit)
        # Why the process count is not read (None while it is): the counter, whoever's it is.
        self.process_count_off: str | None
        self._counter, self.process_count_off = _buffer_counter(options.process_count)
        self._unseen = unseen_margin(self._counter)
        self._name = options.name  # None: "default", until an attachment names it after its model
        self.fix = options.fix
        self.warn_within = options.warn_within
        self.stop_within = options.stop_within
        self.on_forecast = options.on_forecast
        self.max_objects = options.max_objects
        self.max_depth = options.max_depth

        self.counters = Counters()  # monotonic; read by exporters at scrape time
        self._last_stops: dict[str, Stop] = {}  # the last stop of each reason
        self._held_stop: Stop | None = None  # see held_stop

        # What is attached to it: forecast() asks them for their readings.
        self._coordinator: Coordinator | None = None
        self._prefill_guard: PrefillReadings | None = None

        self._lock = threading.RLock()
        self._parameter_buffers = 0
        self._pace = StepClock()  # when the steps came: their rate, and idleness
        self._scope = Scope()
        # The program's objects outside the caches that hold pending arrays (census.py).
        self.census = Census(options.census)
        self._schedule = Schedule(options.overhead_budget, options.walk_interval, beats=not options.fix)
        self._sampler = Sampler()
        self._epochs = Epochs()  # the sets of live caches, and the roots of the last step
        # A batch filtered or extended in place (the same caches, other rows) is seen by the rows
        # (first dimension) of one array of the roots, looked at every few steps (rows.py).
        self._rows = RowsWatch()
        self._fixer = Fixer(options.fix_every)
        self._warnings = Warnings()
        self._last = Reading()  # between readings the forecast extrapolates from it
        self._attribution = Attribution()  # the source line of each leak site, probed once
        self._gone = _Gone()
        self._empty_walks = 0
        self._reset_series()
        self._start(model, options.export)

    # ----------------------------------------------------------------- public API

    # The counters (``counters.py``), each also an attribute of the watchdog.
    steps = PartAttribute[int]("counters")
    walks = PartAttribute[int]("counters")
    overhead_seconds = PartAttribute[float]("counters")
    materialized_arrays = PartAttribute[int]("counters")
    fix_failures = PartAttribute[int]("counters")
    reclaimed_buffers = PartAttribute[float]("counters")
    internal_errors = PartAttribute[int]("counters")
    stops = PartAttribute[collections.Counter[str]]("counters")
    # A gap between two steps shorter than this is never idle: set by an attachment whose steps
    # are known to be slow (a training step of several seconds: a first gap longer than
    # IDLE_SECONDS would otherwise read as a pause, at every step).
    min_idle_seconds = PartAttribute[float]("_pace")

    @property
    def name(self) -> str:
        """The ``watchdog`` label of its metrics."""
        return self._name or "default"

    @name.setter
    def name(self, value: str) -> None:
        self._name = checked_name(value)

    @property
    def name_is_default(self) -> bool:
        """No name was given: an attachment names it after its model."""
        return self._name is None

    @property
    def export(self) -> bool:
        """Shown on the metrics endpoint (``live.py`` keeps it: a retired model's watchdog, one
        inherited through fork, are not). Set True to show it, False to retire it."""
        return LIVE.shown(self)

    @export.setter
    def export(self, value: bool) -> None:
        if checked_bool(value, "export"):
            LIVE.show(self)
        else:
            LIVE.retire(self)

    @property
    def overhead_budget(self) -> float:
        return self._schedule.overhead_budget

    @overhead_budget.setter
    def overhead_budget(self, value: float) -> None:
        self._schedule.set_overhead_budget(checked_fraction(value, "overhead_budget"))

    @property
    def fix_every(self) -> int:
        return self._fixer.every

    @fix_every.setter
    def fix_every(self, value: int) -> None:
        self._fixer.every = checked_positive_int(value, "fix_every")

    @property
    def walk_interval(self) -> float | None:
        return self._schedule.walk_interval

    @walk_interval.setter
    def walk_interval(self, value: float | None) -> None:
        self._schedule.set_walk_interval(checked_walk_interval(value))

    @property
    def coordinator(self) -> Coordinator | None:
        """The hook of a distributed job (``coordination.py``): asked at every step for the group's
        steps to the limit, and by ``forecast()`` for the rank and world size."""
        return self._coordinator

    @coordinator.setter
    def coordinator(self, value: Coordinator | None) -> None:
        if value is not None and not isinstance(value, Coordinator):
            raise ValueError(f"coordinator must have rank, world_size and worst(), got {value!r}")
        self._coordinator = value

    @property
    def prefill_guard(self) -> PrefillReadings | None:
        """The prefill guard installed on this watchdog: ``forecast()`` reads its measurements."""
        return self._prefill_guard

    @prefill_guard.setter
    def prefill_guard(self, value: PrefillReadings | None) -> None:
        if value is not None and not isinstance(value, PrefillReadings):
            raise ValueError(f"prefill_guard must have graph_nodes and safe_tokens, got {value!r}")
        self._prefill_guard = value

    @property
    def rank(self) -> int:
        """This process's rank: its coordinator's, else the launcher's (0 when not launched)."""
        return self._ranks()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks: its coordinator's, else the launcher's (1 when not launched)."""
        return self._ranks()[1]

    @property
    def parameter_buffers(self) -> int:
        """The model's parameter arrays, counted once (``count_parameters``)."""
        return self._parameter_buffers

    def count_parameters(self, model: Any) -> int:
        """Count the model's parameter arrays (once) as resident buffers."""
        try:
            params = model.parameters() if hasattr(model, "parameters") else model
            flat: list[tuple[str, Any]] = []
            tree_flatten(params, destination=flat)
            arrays = {id(a): a for _, a in flat if isinstance(a, mx.array)}
            self._parameter_buffers = len(arrays)
            if self.counters.walks == 0:  # nothing read yet: the parameters are what is known to be resident
                self._last = Reading(resident=float(self._parameter_buffers))
        except Exception as exc:
            self.record_internal_error("count_parameters", exc)
        return self._parameter_buffers

    def observe(
        self, roots: Any, *, last_output: Any = None, prefill: bool = False, inputs: Any = None
    ) -> None:
        """Observe one decode step. Call it at the entry of each step (before the forward).

        ``roots``: any object graph holding the cache(s). ``last_output``: the previous step's
        output, when known; the fix only runs once the program has evaluated (or scheduled) it,
        so the watchdog never computes what the program itself would not have.
        ``prefill=True`` marks a multi-token forward: it is observed when it runs on the cache
        being followed (speculative verification does), but a prompt processed on other caches
        beside a running batch (``BatchGenerator``) does not start a new series. ``inputs``: the
        forward's input tokens (batch x tokens), instead of ``prefill``: a forward of more than
        one token is a prefill. They are looked at only when the roots are not last step's.

        Never raises, except :class:`ResourceLimitForecast` when ``stop_within`` says so."""
        start = clock.wall()
        try:
            self._observe(roots, last_output, prefill, start, inputs)
        except ResourceLimitForecast:
            raise
        except Exception as exc:
            self.record_internal_error("observe", exc)
        finally:  # self._charge(start), inlined: this runs on every step
            spent = clock.wall() - start
            self.counters.overhead_seconds += spent
            self._schedule.charge(spent)

    def generation_ended(self) -> None:
        """Say that nothing steps for now (a generation ended, a server has no request): the
        forecast reads not decoding at once, instead of after ``IDLE_SECONDS``. Call it on the
        thread that ran the steps (the attachment points do): it reads the caches that are still
        alive once more, when the budget allows, so what stays resident is what they hold now."""
        if not self._pace.end():  # it had ended already
            return
        start = clock.wall()
        try:
            self._attribution.finish()  # a probe still attached gives its class back now
            # Only on the thread that stepped (a generator closed by the garbage collector may end
            # anywhere): MLX's graph is not read beside a thread that may be changing it.
            routine = self._schedule.affordable(share=ROUTINE_SHARE)  # a level, no growth to measure
            if self.counters.walks and routine and threading.get_ident() == self._pace.thread:
                if self._scope.version != self._epochs.version:
                    self._new_epoch(self.counters.steps)
                self._walk(None, self.counters.steps)  # every live cache
                self._fixer.forget_paths()  # they are the roots' paths
        except Exception as exc:
            self.record_internal_error("generation_ended", exc)
        finally:
            self._charge(start)

    def forecast(self) -> fc.Forecast:
        """The current forecast (thread-safe; cheap: no graph walk)."""
        with self._lock:
            step = self.counters.steps
            growth, last = self._growth, self._last
            rate = growth.rate + self._outside_rate()
            resident = self._resident_now(step)
            # A sawtooth comes back to its peak: the headroom is counted from there.
            peak = resident + growth.peak_excess
            reserved = self._reserved()
            stl = fc.steps_to_limit(peak + reserved, self.limit, rate)
            decoding = self.decoding()
            step_rate = self._pace.step_rate() if decoding else 0.0
            rank, world_size = self._ranks()
            guard = self._prefill_guard
            leaks = compiled.annotate(self._attribution.annotate(growth.leaks))
            # A count of the whole process: the growth no named site explains is shown, never hidden.
            unattributed = self._outside_rate()
            if isinstance(self._counter, BufferCounter) and growth.known:
                unattributed = fc.unattributed_rate(rate, leaks)
            elif isinstance(self._counter, ProcessCounter) and not self._counter.measured:
                unattributed = math.nan  # not measured yet: no "0/step" that reads as no leak
            return fc.Forecast(
                step=step,
                resident_buffers=int(round(resident)),
                limit=self.limit,
                buffers_per_step=max(0.0, rate),
                steps_to_limit=stl,
                seconds_to_limit=fc.seconds_from_steps(stl, step_rate),
                leaks=leaks,
                step_rate=step_rate,
                source="estimate" if self._counter is None else self._counter.name,
                unattributed_buffers_per_step=unattributed,
                process_count_off=self.process_count_off,
                parameter_buffers=self._parameter_buffers,
                cache_buffers=last.cache_buffers,
                retained_buffers=last.retained,
                pending_graph_nodes=last.pending_nodes,
                measured_step=last.step,
                prefill_graph_nodes=None if guard is None else guard.graph_nodes,
                max_safe_prefill_tokens=None if guard is None else guard.safe_tokens,
                rank=rank,
                world_size=world_size,
                rate_known=growth.known,
                decoding=decoding,
                sampled=last.sampled,
                reserved_buffers=reserved,
                bounded=self._attribution.annotate(growth.bounded),
                peak_resident_buffers=int(round(peak)),
            )

    def snapshot(self) -> Snapshot:
        """What the exporters show, read at once under the lock: the forecast with the counters,
        stops and held stop of the same moment. Never raises: a forecast that fails is counted
        (``internal_errors``) and the snapshot has none."""
        with self._lock:
            try:
                forecast: fc.Forecast | None = self.forecast()
            except Exception as exc:
                self.record_internal_error("snapshot", exc)
                forecast = None
            try:
                rank, world_size = (int(n) for n in self._ranks())
            except Exception:
                rank, world_size = 0, 1
            return Snapshot(
                name=self.name,
                fix=self.fix,
                rank=rank,
                world_size=world_size,
                forecast=forecast,
                steps=self.steps if forecast is None else forecast.step,
                materialized_arrays=self.materialized_arrays,
                fix_failures=self.fix_failures,
                reclaimed_buffers=self.reclaimed_buffers,
                overhead_seconds=self.overhead_seconds,
                internal_errors=self.internal_errors,
                stops=types.MappingProxyType(dict(self.stops)),
                last_stops=types.MappingProxyType(dict(self._last_stops)),
                held_stop=self._held_stop,
            )

    def decoding(self) -> bool:
        """Is anything stepping? False after ``generation_ended()`` or an idle gap."""
        return self._pace.stepping()

    def reset(self) -> None:
        """Forget the growth measured so far (a new generation starts); what is resident stays."""
        with self._lock:
            self._reset_series()
        self._epochs.forget()

    def record_stop(self, reason: str, forecast: fc.Forecast | None = None) -> Stop:
        """Count a stop and keep the forecast that caused it (default: the forecast now): see
        ``last_stops`` and ``held_stop``."""
        if forecast is None:
            forecast = self.forecast()
        stop = Stop(reason, forecast, clock.now())
        rank = self.rank
        with self._lock:
            self.counters.stops[reason] += 1
            self._last_stops[reason] = stop
            if forecast.rate_known and forecast.rank == rank:  # a measured forecast, of this process
                self._held_stop = stop
        return stop

    @property
    def last_stops(self) -> dict[str, Stop]:
        """The last stop of each reason (a copy), with the forecast that caused it."""
        with self._lock:
            return dict(self._last_stops)

    @property
    def held_stop(self) -> Stop | None:
        """The last stop whose forecast no reading has replaced yet, else None. A stop ends the
        caches that grew (and an attachment may forget the growth then): until a reading taken on
        a decode step since measures the growth again, the stop's forecast is the last measured
        one, and the exporters publish its rate, sites and steps to the limit."""
        return self._held_stop

    def record_internal_error(self, where: str, exc: BaseException) -> None:
        """Count and log an error caught on the watchdog's behalf (the decode goes on)."""
        with self._lock:
            self.counters.internal_errors += 1
            count = self.counters.internal_errors
        if count <= 3 or count % 1000 == 0:
            logger.warning(
                "mlx-watchdog internal error #%d in %s: %r (the decode goes on)",
                count,
                where,
                exc,
                exc_info=count <= 1,
            )

    def record_overhead(self, seconds: float) -> None:
        """Seconds of the watchdog's work outside ``observe`` (the prefill guard's walks): in
        ``overhead_seconds``, not against the walks' budget."""
        self.counters.overhead_seconds += seconds

    def __repr__(self) -> str:
        return (
            f"Watchdog(name={self.name!r}, limit={self.limit}, fix={self.fix}, steps={self.counters.steps})"
        )

    # ----------------------------------------------------------------- the step

    def _start(self, model: Any, export: bool) -> None:
        """Count the model's parameters, pay the one-off costs now (the walker thread, MLX's first
        export, numpy's median), join the live watchdogs, and take the coordinator an
        instrumented distributed job gives it (coordination.py)."""
        if model is not None:
            self.count_parameters(model)
        try:
            warm_up()
        except Exception as exc:
            self.record_internal_error("warm_up", exc)
        LIVE.add(self, shown=export)
        try:
            coordinator = new_coordinator(self)
            if coordinator is not None:
                self.coordinator = coordinator
        except Exception as exc:
            self.record_internal_error("coordinator", exc)

    def _observe(self, roots: Any, last_output: Any, prefill: bool, start: float, inputs: Any = None) -> None:
        # Every decode step runs this, just after the forward left the CPU's caches cold, where
        # each Python call and object touched costs: a step that neither walks nor fixes runs
        # this function alone.
        cls = type(roots)  # exact types: a subclass's len() or [] would run the program's code
        ids: tuple[int, ...]
        if (cls is list or cls is tuple) and roots:  # its first, middle and last items
            anchor = roots[0]
            ids = (id(roots), len(roots), id(anchor), id(roots[len(roots) // 2]), id(roots[-1]))
        else:
            anchor, ids = roots, (id(roots),)
        epochs = self._epochs
        anchor_ref = epochs.anchor_ref
        if (
            ids != epochs.root_ids or (anchor_ref is not None and anchor_ref() is not anchor)
        ) and not self._follow(roots, ids, anchor, prefill or input_tokens(inputs) > 1):
            return
        # Written by the decode thread alone, without the lock: a reader racing a step sees
        # the step count before or after it.
        pace = self._pace
        gap = start - pace.last
        schedule = self._schedule
        if gap > 0:
            schedule.stepped(gap)  # decode time
        if pace.ended or (gap > IDLE_SECONDS and gap > pace.idle_seconds()):
            self._resume()  # after idle: a new epoch (a new decode if none of the caches lives on)
        pace.last = start
        counters = self.counters
        step = counters.steps = counters.steps + 1
        pace.times.append((step, start))
        counter = self._counter
        if isinstance(counter, ProcessCounter):  # (the resident count between walks)
            counter.step()
        pace.thread = get_ident()
        fixer = self._fixer
        # A probe's end looks at the rows too: a batch filtered in place within its 1-3 steps
        # would read as growth of its own (a batch evaluated shorter: as a chain the program drains).
        look = not step % ROWS_EVERY or (fixer.probe is not None and step >= fixer.probe.end)
        if look and self._rows.probe is not None and self._rows.changed(roots, step):
            self._scope.changed()
        if self._scope.version != epochs.version:
            self._new_epoch(step)

        # In fix mode a walk that saw a pending graph starts a probe (fix.py), a second walk 1-3
        # steps later ends it. With nothing pending there is nothing to measure or cut.
        walked_pending = None
        if fixer.probe is not None:
            probe = fixer.end_probe(step)
            if probe is not None:
                walked_pending = self._walk(roots, step, probe)
        elif (
            (step >= schedule.wake_step or schedule.decode_seconds >= schedule.wake_decode)
            and not fixer.backlog  # long chains are being cut: a walk now reads them half cut
            and schedule.due(step, self._growth.known)
        ):
            walked_pending = self._walk(roots, step)
            # A probe's second walk is taken whatever the budget: it must fit now, with this one.
            # Until a probe has measured what the fix cuts, one is owed: without it the fix's
            # sawtooth (up to 4x fix_every steps of chains when the budget spaces the fixes) is not
            # followed between walks (a busy serve --fix: 233 buffers under after a new decode).
            if (
                self.fix
                and self._last.pending_nodes
                and fixer.wants_probe()
                and (schedule.affordable(walks=2) or self._growth.probed is None)
            ):
                fixer.start_probe(step, self._growth.site_buffers())
        # (Fixer.due is False before fix_every steps since the last fix, backlog aside: not asked.)
        if self.fix and (fixer.backlog or step - fixer.last_step >= fixer.every):
            backlog = fixer.backlog
            if fixer.due(step, last_output, schedule.fix_affordable, FIX_STRETCH):
                self._fix(roots, walked_pending, step)
            if backlog and not fixer.backlog:  # the long chains are cut, or their shares gave up
                schedule.owe_walk()  # either way the last reading is stale
        if self.stop_within is not None or self.warn_within is not None or self._coordinator is not None:
            self._act(roots, last_output, step)

    def _follow(self, roots: Any, ids: tuple[int, ...], anchor: Any, prefill: bool) -> bool:
        """Other roots than last step's: their caches join the scope. False when this forward is
        no step (a prompt filling other caches beside the running decode)."""
        if prefill and self._epochs.root_ids is not None and not self._scope.current(anchor):
            # A prompt filling its own caches (BatchGenerator does that before they join the
            # batch): they hold buffers, so they are read; but the decode being followed goes on.
            # Its ids are not kept, or its next chunk would pass for a step of that decode.
            self._scope.add(roots, self.counters.steps)
            return False
        self._scope.follow(roots, self.counters.steps + 1)  # the step this forward is
        anchor_ref: weakref.ref | None = None
        try:  # arrays are rebound every step, and some objects take no weak reference
            anchor_ref = None if issubclass(type(anchor), mx.array) else weakref.ref(anchor)
        except TypeError:
            pass
        before = self._epochs.follow(ids, anchor_ref)
        self._fixer.forget_paths()
        if before is None or before[1:] != ids[1:]:  # other caches (not a list made anew each step)
            self._rows.forget()  # armed again by the next walk (a look of its own cost ~1 ms a join)
        return True

    def _new_epoch(self, step: int) -> None:
        """Another set of live caches from here on: readings before and after are no growth line.
        While some caches go on (a request joined a busy batch), the growth measured so far still
        holds, and so do the readings toward it; when none does, this is a new decode, measured
        afresh."""
        epochs = self._epochs
        continuing = epochs.continuing()
        if epochs.members and not continuing:
            self.reset()
        # A probe measures what steps add to one set of caches: across a change it would read the
        # change (a batch rebuilt shorter reads as a chain the program drains: no leak to cut).
        self._fixer.cancel_probe()
        epochs.start(self._scope.refs(), self._scope.version)
        # A busy batch changes every second or so: were the growth forgotten at a change while it
        # is still unknown, it would never be read (each change would start a new decode).
        self._schedule.new_epoch(step, continuing=continuing, measured=self._growth.known)

    def _resume(self) -> None:
        """The first step after idle starts a new epoch: a new generation is measured afresh when
        none of the caches before the pause lives on (``_new_epoch``); a batch that goes on keeps
        its growth."""
        self._pace.resume()  # the idle gap is no step time
        self._epochs.forget()

    def _walk(self, roots: Any, step: int, probe: Probe | None = None) -> list[tuple[str, mx.array]]:
        """Read every live cache (``roots`` and the others; None: no roots, only the caches
        followed); returns the roots' arrays found pending, with their sites. ``probe``: the
        fix-mode probe this reading ends."""
        t0, cpu0 = self._start_walk()
        given = roots is not None
        roots = () if roots is None else roots
        others, kept, kept_since = self._walk_scope(step, given)
        found, owners = self._scan(roots, others, kept)
        if given:
            self._rows.arm(found, self._epochs.number)
        keys = [(id(m), steps_key(rest)) for m, rest in owners]
        measured = self._sampler.read(found, step, [0] + [id(c) for c in others], keys)
        pending = [f for f, done in zip(found, measured.evaluated) if not done and f.root == 0]
        self._fixer.remember_paths(found, pending)
        # What the fix frees when it cuts a pending array of a cache other than the roots' (kept).
        self._fixer.remember_kept(
            {
                id(f.array): held
                for f, done, held in zip(found, measured.evaluated, measured.retained)
                if f.root and not done
            }
        )
        reading = read(
            found,
            measured.evaluated,
            measured.retained,
            step=step,
            keys=keys,
            refs=self._followed(owners),
            walked=measured.walked_indices,
            kept=kept,
            kept_since=kept_since,
            pending_nodes=measured.pending_nodes,
            sampled=measured.sampled,
            parameters=self._parameter_buffers,
            # The compiled functions' cache entries: not sites of a probe's reading (the fix cuts none).
            compiled=compiled.tallies(),
            compiled_sites=probe is None,
            mlx_count=self._counter.read() if isinstance(self._counter, BufferCounter) else None,
            fixing=self.fix and self._fixer.fixed_once,
            fixed_at=self._fixer.last_step,
        )
        del owners, keys
        reading = self._with_census(reading, found, probe)
        if isinstance(
            self._counter, ProcessCounter
        ):  # what the process holds beyond the walk, and its growth
            reading = dataclasses.replace(reading, resident=self._counter.reading(step, reading.walked))
        self._record(reading, probe, given)
        # Once per leaking site: a probe of its class for the step that starts now (attribution.py).
        self._attribution.consider(self._growth.leaks, found, [roots] + others, self.census.owners)
        self._schedule.walked(step, clock.wall() - t0, graph.cpu_clock() - cpu0)
        self._call_back()
        return [(f.site, f.array) for f in pending]

    def _start_walk(self) -> tuple[float, float]:
        """Settle the allocator, start the walk's clocks (wall, CPU) and mark the process count."""
        self._disown(allocator.settle())  # the program's deferred frees, merged before the clock starts
        started = clock.wall(), graph.cpu_clock()
        if isinstance(self._counter, ProcessCounter):
            self._counter.mark()  # the reading is the lowest count over the walk (process_count.py)
        return started

    def _walk_scope(self, step: int, given: bool) -> tuple[list[Any], list[bool], int | None]:
        """The caches a walk reads besides the roots (given: the others in scope; else all of
        them), whether each root is a server's kept cache (``caches.py``: their arrays are under
        sites of their own), and the last forward of the newest kept one."""
        scope = self._scope
        others = scope.others() if given else scope.members()
        kept = [False] + [scope.kept(c, step) for c in others]
        kept_since = max((scope.last_used(c, step) for c, k in zip(others, kept[1:]) if k), default=None)
        return others, kept, kept_since

    def _scan(
        self, roots: Any, others: list[Any], kept: list[bool]
    ) -> tuple[list[Found], list[tuple[Any, tuple]]]:
        """Every array of the roots and the other caches, and each array's owner: its cache and
        its steps from it (the same whether the cache is walked as part of the roots or alone,
        as generation_ended reads every cache). Warns once of roots that hold nothing, or of a
        walk the bounds cut."""
        result = scan_all(
            [(roots, "")] + [(c, f"<{type_name(c)}#{k}>") for k, c in enumerate(others)],
            max_objects=self.max_objects,
            max_depth=self.max_depth,
            marks=[KEPT_MARK if k else "" for k in kept],
        )
        self._empty_walks = 0 if result.found else self._empty_walks + 1
        if self._empty_walks == 3:  # a fresh cache is empty on its first step; three in a row is not
            self._warnings.once(
                "empty",
                "mlx-watchdog: the observed roots hold no mx.array; nothing to watch (%r)",
                type_name(roots),
            )
        if result.truncated:
            self._warnings.once(
                "cut", "mlx-watchdog: walk of the roots was bounded, not walked: %s", result.cut
            )
        members = [None] + others
        owners = [(members[f.root], f.steps) if f.root else member_of(roots, f.steps) for f in result.found]
        return result.found, owners

    def _followed(self, owners: list[tuple[Any, tuple]]) -> dict[int, weakref.ref | None]:
        """The weak reference of each cache that owns an array, by its id (None: not followed)."""
        refs: dict[int, weakref.ref | None] = {}
        for member, _ in owners:
            if id(member) not in refs:
                refs[id(member)] = self._scope.ref(member)
        return refs

    def _record(self, reading: Reading, probe: Probe | None, given: bool) -> None:
        """The reading into the growth and the leak sites, and kept as the last one."""
        step = reading.step
        # The first reading of a new decode pairs with no other (-1 is no epoch): see schedule.py.
        epoch = -1 if self._schedule.first_of_decode(step) else self._epochs.number
        fixing = self.fix and self._fixer.fixed_once
        with self._lock:
            self._growth.record(reading, epoch, probe, fixing)
            self._growth.update_leaks(fixing)
            self._last = reading
            self.counters.walks += 1
            if given and self._growth.known:  # a decode step's reading measured the growth
                self._held_stop = None

    def _call_back(self) -> None:
        """``on_forecast`` with the forecast of the reading just taken; its errors are counted."""
        if self.on_forecast is not None:
            try:
                self.on_forecast(self.forecast())
            except Exception as exc:
                self.record_internal_error("on_forecast callback", exc)

    def _fix(
        self, roots: Any, walked_pending: list[tuple[str, mx.array]] | None, step: int, sweep: bool = False
    ) -> None:
        fixer = self._fixer
        self._disown(allocator.settle())
        fix_started = clock.wall()
        failed = 0
        try:
            pending = fixer.pending(
                roots, walked_pending, self._growth.growing, sweep, self.max_objects, self.max_depth
            )
            if not sweep:
                last = self._last
                walked_since_fix = last.step > fixer.last_step or not fixer.fixed_once
                nodes = last.pending_nodes / max(1, last.pending_arrays) if walked_since_fix else None
                pending = fixer.share(pending, nodes, walked=walked_pending is not None, step=step)
                if not pending and fixer.backlog:  # postponed to a step that walks nothing
                    return
            # A server's kept caches: their chains, at the sites seen leaking while they stepped.
            leaking = self._growth.growing
            if leaking is None:
                leaking = {leak.site for leak in self._growth.leaks}
            kept: list[mx.array] = []
            freed: dict[int, float] = {}
            if leaking:  # (the kept caches are listed only then: a fix may run every step)
                kept, freed = fixer.kept_pending(
                    self._scope.kept_caches(step), leaking, self.max_objects, self.max_depth
                )
            pending += kept
            if pending:
                failed = schedule_evaluation(pending, mx.async_eval)
        except Exception as exc:  # counted and logged; the decode goes on
            self.record_internal_error("materialize", exc)
            return
        finally:
            # Charged with the rest of observe(); the schedule keeps the walks a floor of the
            # budget when the fix alone would spend it (fix_every=1 on a slow host).
            self._schedule.charge_fix(clock.wall() - fix_started)
        if failed:
            with self._lock:
                self.counters.fix_failures += failed
            self._warnings.once(
                "fix",
                "mlx-watchdog: the fix could not schedule %d pending arrays (counted in "
                "fix_failures; the others were scheduled)",
                failed,
            )
            if failed == len(pending):  # nothing was scheduled, so nothing is fixed
                return
        with self._lock:
            growth = self._growth
            # What the cut chains would have kept: the growth the probes measured, per step.
            per_step = growth.probed if growth.probed is not None else max(0.0, growth.rate)
            self.counters.materialized_arrays += len(pending) - failed
            if len(pending) > len(kept):
                self.counters.reclaimed_buffers += per_step * (step - fixer.last_step)
            if freed:  # freed now, and out of the reading until the next walk (kept caches do not grow back)
                self._forget_freed(freed)
            if fixer.ran(step):  # the series' first fix
                growth.fixed()
                growth.update_leaks(fixing=True)

    def _act(self, roots: Any, last_output: Any, step: int) -> None:
        with self._lock:  # cheap arithmetic; the full Forecast only when a threshold is crossed
            growth = self._growth
            stl = fc.steps_to_limit(
                self._resident_now(step) + growth.peak_excess + self._reserved(),
                self.limit,
                growth.rate + self._outside_rate(),
            )
        coordinator = self._coordinator
        if coordinator is not None:
            stl = coordinator.worst(step, stl)
        near = (self.stop_within is not None and stl <= self.stop_within) or (
            self.warn_within is not None and stl <= self.warn_within
        )
        if not near:
            return
        forecast = self.forecast()
        if self.stop_within is not None and stl <= self.stop_within:
            if self.fix and evaluated_output(last_output):
                # Try the fix first: materialize everything now and measure again.
                self._fixer.cancel_probe()
                self._fix(roots, None, step, sweep=True)
                self._walk(roots, step)
                forecast = self.forecast()
                stl = forecast.steps_to_limit
                if coordinator is not None:
                    stl = coordinator.worst(step, stl)
            if stl <= self.stop_within and self._release_cache():
                forecast = self.forecast()  # MLX's cached buffers freed: what is left is what counts
                stl = forecast.steps_to_limit
                if coordinator is not None:
                    stl = coordinator.worst(step, stl)
            if stl <= self.stop_within:
                self.record_stop("forecast", forecast)
                logger.error("mlx-watchdog: stopping the generation: %s", forecast.describe())
                raise ResourceLimitForecast(forecast)
        # While a probe looks for a leak's source line (a step or two), the warning waits for it.
        if (
            self.warn_within is not None
            and stl <= self.warn_within
            and not self._attribution.probing
            and self._warnings.due()
        ):
            logger.warning(
                "mlx-watchdog: resource limit forecast: %s (%s)",
                forecast.describe(),
                compiled.advice(forecast.leaks)
                or outside_advice(forecast.leaks)
                or remedy(self.fix, self._fixer.fixed_once),
            )

    # ----------------------------------------------------------------- helpers

    def _reserved(self) -> int:
        """Buffers of the limit the forecast keeps for what its count does not include: MLX's
        cached buffers, read from MLX's counter, or a margin for buffers in flight on Metal."""
        return self._last.mlx_cached if self._counter is not None else self._unseen

    def _release_cache(self) -> bool:
        """Before a stop: free MLX's cached buffers (MLX would release them before it fails) and,
        with MLX's counter, read the count again. True when the reading changed."""
        try:
            mx.clear_cache()
            if not isinstance(self._counter, BufferCounter):  # the process count has no cache in it
                return False
            live, cached = self._counter.read()
        except Exception as exc:
            self.record_internal_error("clear_cache", exc)
            return False
        with self._lock:
            self._last = dataclasses.replace(self._last, resident=float(live), mlx_cached=cached)
        return True

    def _forget_freed(self, freed: dict[int, float]) -> None:
        """The fix cut chains of kept caches (by id, the buffers it freed): out of the last
        reading, and of those caches' tallies (they would leave twice when the caches die)."""
        self.counters.reclaimed_buffers += sum(freed.values())
        self._last = self._last.less_freed(freed)

    def _reset_series(self) -> None:
        """Forget the growth measured so far. The last reading of what is resident stays: those
        buffers are still held (a finished request's chains until its caches die)."""
        self._growth = Growth()
        self._last = dataclasses.replace(
            self._last, step=self.counters.steps
        )  # nothing is extrapolated past it
        self._fixer.reset(self.counters.steps)
        self._sampler.forget()  # what it walked before names other arrays now
        self._empty_walks = 0

    def _with_census(self, reading: Reading, found: list, probe: Probe | None) -> Reading:
        """The reading with what the program's own objects hold outside the caches (census.py),
        under sites of their own (not in a probe's reading: the fix cuts none of them)."""
        counts: dict[str, SiteCount] | None = {} if probe is None else None
        held = self.census.read(reading.step, found, self._schedule, counts, self._outside_rate())
        if self.census.fresh:  # the readings before counted other arrays there: no growth line
            self._growth.samples.clear()
        if isinstance(self._counter, BufferCounter):  # MLX's own count has them already
            held = 0.0
        return reading.with_outside(held, {site: count.tally() for site, count in (counts or {}).items()})

    def _resident_now(self, step: int) -> float:
        counter = self._counter
        if isinstance(counter, ProcessCounter):  # the count has followed every buffer since the reading
            now = counter.resident_now()
            if now is not None:
                return max(float(self._parameter_buffers), now)
        last = self._last
        gone = self._gone
        if gone.reading is not last or gone.version != self._scope.version:  # a cache died since: recount
            gone = self._gone = _Gone(last, self._scope.version, *last.gone())
        # The growth since goes on in the caches that live: with a cache gone, so is its share.
        growth = max(0.0, self._growth.rate) * (step - last.step) * gone.alive_share
        growth += self._outside_rate() * (step - last.step)  # and outside them, in the process
        fixer, cut = self._fixer, self._growth.probed
        if self.fix and fixer.fixed_once:
            cut_chains = max(0.0, last.retained - last.pending_arrays)  # what the next fix cuts of it
            if cut is None:  # no probe yet: the chains' growth since the fix before the reading
                cut = cut_chains / (last.step - last.fixed_at) if last.step > last.fixed_at else 0.0
            # Between two fixes the chains it cuts grow back (a sawtooth, up to 4x fix_every steps
            # high when the budget spaces the fixes), at the rate the probes saw. A fix since the
            # reading cut what the chains it saw retained (less the arrays it left evaluated): the
            # reading says so, where a model of it from the probes' rate, not measured yet in a
            # new decode, left a reading at the sawtooth's peak after the fix.
            since = step - last.step
            if fixer.last_step != last.fixed_at and not fixer.backlog:  # fixed after the reading
                growth -= cut_chains * gone.alive_share
                since = step - fixer.last_step
            growth += cut * since * gone.alive_share
        return max(float(self._parameter_buffers), last.resident - gone.buffers + growth)

    def _outside_rate(self) -> float:
        """What the process grows a step outside the caches read (the process count's; else 0)."""
        counter = self._counter
        return counter.rate if isinstance(counter, ProcessCounter) else 0.0

    def _ranks(self) -> tuple[int, int]:
        coordinator = self._coordinator
        if coordinator is not None:
            return coordinator.rank, coordinator.world_size
        return launched()

    def _charge(self, start: float) -> None:
        """The watchdog's own time since ``start``: in its overhead and against its budget."""
        spent = clock.wall() - start
        self.counters.overhead_seconds += spent
        self._schedule.charge(spent)

    def _disown(self, seconds: float) -> None:
        """Seconds spent inside ``observe`` on the program's work, not the watchdog's
        (``allocator.py``): out of its overhead and its budget (``observe`` adds its whole time)."""
        self.counters.overhead_seconds -= seconds
        self._schedule.refund(seconds)
