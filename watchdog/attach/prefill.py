"""Prefill guard: measure a prefill chunk's lazy graph before it runs, and size chunks to fit.

A watched model (``watch_model``) calls the guard right after a forward pass of more than one
token, *before* anyone evaluates its output. The guard walks the chunk's lazy graph
(``graph_size`` over the output and the cache's arrays), at most once per distinct chunk length:
the first chunk and any chunk longer than all walked so far; shorter lengths are predicted, and
walked only while the limit is near (to refine the fit). It fits graph nodes and evaluated
input buffers per token (least squares over the walked lengths). Installed on the watchdog
(``install``), it gives the watchdog's forecast two readings:

* ``prefill_graph_nodes`` (the guard's ``graph_nodes``): pending nodes of the last measured chunk;
* ``max_safe_prefill_tokens`` (its ``safe_tokens``): the largest chunk whose predicted buffers
  stay under ``safety * limit - resident``.

What is compared with the limit (an estimate; README.md, section "Prefill guard: the largest
prefill chunk that stays under the limit", says how sure it is): the buffers one chunk's
evaluation could hold at once = its pending graph nodes (each primitive output may allocate a
buffer) + the distinct evaluated arrays it reads. MLX frees intermediates while it evaluates,
so this is an upper bound; the evaluated inputs include the parameters and cache arrays that
are also counted as resident, a conservative double count of at most ``resident`` buffers.

With ``stop_within`` set on the watchdog, a chunk predicted over ``limit - resident`` raises
:class:`ResourceLimitForecast` (reason ``"prefill"``) before it is evaluated, and the message
names the safe ``prefill_step_size``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..core import clock
from ..core.actions import ResourceLimitForecast
from ..core.chunks import (
    FLAT_SPREAD,
    UNBOUNDED_TOKENS,
    LineFit,
    Measurement,
    fit_line,
    largest_safe_chunk,
    measure_chunk,
)
from ..core.limits import resolve_limit
from ..core.watchdog import Watchdog
from .model import state_watched_by, watched_state

logger = logging.getLogger("mlx_watchdog")

DEFAULT_SAFETY = 0.5
# Distinct live lengths walked before the fit is trusted for lengths between them (no walk).
MIN_POINTS = 3
# More lengths are walked only while the safe size is within this factor of the chunks seen:
# far from the limit, one walk per guard is enough and the fit need not be precise.
NEAR_FACTOR = 4
TRUST_R2 = 0.99
# Walks per guard are bounded: a server sees many remainder-chunk lengths.
MAX_MEASURED_LENGTHS = 16
# The shortest calibration chunk added to a guard's first measurement (at most 16 tokens).
COMPANION_TOKENS = 4


def _chunk_tokens(inputs: Any) -> int:
    shape = getattr(inputs, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(f"prefill inputs need a (batch, tokens) shape, got {shape!r}")
    return int(shape[1])


def _check_lengths(lengths: Sequence[int], what: str) -> list[int]:
    try:
        values = sorted(set(lengths))
    except TypeError:
        raise ValueError(f"{what} must be a sequence of token counts, got {lengths!r}") from None
    if not values or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in values):
        raise ValueError(
            f"{what} must be a non-empty sequence of ints >= 2 (a prefill chunk), got {lengths!r}"
        )
    return values


def _check_safety(safety: float) -> float:
    if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not 0 < safety <= 1:
        raise ValueError(f"safety must be a fraction of the limit in (0, 1], got {safety!r}")
    return float(safety)


def _unwatched_forward(model: Any) -> Callable[[mx.array, Any], Any]:
    """The model's own forward, without the watchdog's observe and hooks (measuring a
    calibration chunk must not count as a decode step)."""
    state = watched_state(model)
    cls = state.original_class if state is not None else type(model)
    return lambda inputs, cache: cls.__call__(model, inputs, cache=cache)


def _measure_fresh(model: Any, tokens: int) -> Measurement:
    """Build one chunk's forward on a fresh cache and measure it; nothing is evaluated."""
    from mlx_lm.models.cache import make_prompt_cache

    start = clock.wall()
    cache = make_prompt_cache(model)
    output = _unwatched_forward(model)(mx.zeros((1, tokens), dtype=mx.int32), cache)
    measured = measure_chunk(tokens, output, cache)
    # The seconds include building the forward: all of it is the guard's cost.
    return dataclasses.replace(measured, live=False, seconds=clock.wall() - start)


class PrefillGuard:
    """Measures prefill chunks of one watched model; see the module docstring.

    Two kinds of points: *live* chunks (what the program runs, walked once per length) and
    *calibration* chunks (built on a fresh ``make_prompt_cache`` cache, never evaluated). The
    two may lie on different lines: mlx-lm's batched caches add ops per token. So calibration
    points only fill in until two live lengths are known.

    Args:
        watchdog: the model's watchdog (its ``limit``, ``stop_within`` and forecast).
        safety: the fraction of the limit a chunk's predicted buffers may use (with what is
            resident) for the safe size.
        on_safe_size: ``fn(tokens)``, called when the safe chunk size changes.
        max_lengths: at most this many distinct live chunk lengths are ever walked.
    """

    def __init__(
        self,
        watchdog: Watchdog,
        safety: float = DEFAULT_SAFETY,
        on_safe_size: Callable[[int], Any] | None = None,
        *,
        max_lengths: int = MAX_MEASURED_LENGTHS,
        ceiling: int = UNBOUNDED_TOKENS,
    ):
        if not isinstance(watchdog, Watchdog):
            raise ValueError(f"PrefillGuard needs a Watchdog, got {type(watchdog).__name__}")
        if on_safe_size is not None and not callable(on_safe_size):
            raise ValueError(f"on_safe_size must be callable, got {on_safe_size!r}")
        for label, value in (("max_lengths", max_lengths), ("ceiling", ceiling)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an int >= 1, got {value!r}")
        self.watchdog = watchdog
        self.safety = _check_safety(safety)
        self.on_safe_size = on_safe_size
        self.max_lengths = max_lengths
        self.ceiling = ceiling
        self._lock = threading.Lock()
        self._live: dict[int, Measurement] = {}
        self._calibration: dict[int, Measurement] = {}
        self._fits: tuple[LineFit, LineFit] | None = None
        self._reported: int | None = None
        self._state: Any = None  # the watched model's state, whose prefill_cache the hook reads
        self._model: weakref.ref | None = None  # for a calibration point (see _check)
        self.safe_tokens: int | None = None  # the largest chunk predicted to fit (see _assess)
        self.graph_nodes: int | None = None  # pending nodes of the last chunk measured
        self.chunks = 0  # live prefill chunks seen
        self.walks = 0  # graph walks, live and calibration
        self.walk_seconds = 0.0
        self.internal_errors = 0

    # ------------------------------------------------------------------ readings

    @property
    def measurements(self) -> list[Measurement]:
        """Every measured chunk, live and calibration, by length."""
        with self._lock:
            points = list(self._calibration.values()) + list(self._live.values())
        return sorted(points, key=lambda m: (m.tokens, m.live))

    def _fit_points(self) -> list[Measurement]:
        if len(self._live) >= 2:
            return list(self._live.values())
        return list({**self._calibration, **self._live}.values())

    @property
    def nodes_fit(self) -> LineFit | None:
        fits = self._fits
        return fits[0] if fits else None

    @property
    def buffers_fit(self) -> LineFit | None:
        fits = self._fits
        return fits[1] if fits else None

    def predicted_buffers(self, tokens: int) -> float | None:
        """Buffers a chunk of ``tokens`` would hold at once (nodes + inputs): the live
        measurement of that length when there is one, else the fit."""
        with self._lock:
            measured = self._live.get(tokens)
            fits = self._fits
        if measured is not None:
            return float(measured.predicted_buffers)
        if fits is None:
            return None
        return max(0.0, fits[0].at(tokens)) + max(0.0, fits[1].at(tokens))

    # ------------------------------------------------------------------ measuring

    def record(self, measurement: Measurement) -> None:
        """Add one measurement and refit."""
        with self._lock:
            (self._live if measurement.live else self._calibration)[measurement.tokens] = measurement
            points = self._fit_points()
            self._fits = (
                fit_line([(m.tokens, m.nodes) for m in points]),
                fit_line([(m.tokens, m.buffers) for m in points]),
            )
            self.walks += 1
            self.walk_seconds += measurement.seconds
            if measurement.live or not self._live:
                self.graph_nodes = measurement.nodes

    def calibrate(self, model: Any, lengths: Sequence[int] = (32, 64, 128)) -> int | None:
        """Measure chunks of ``lengths`` on a fresh cache (built, never evaluated), so the safe
        size is known before the first real prefill. Returns the safe size."""
        for tokens in _check_lengths(lengths, "calibrate lengths"):
            self.record(_measure_fresh(model, tokens))
        safe, _ = self._assess(None)
        self._report(safe)
        return safe

    def _should_walk(self, tokens: int) -> bool:
        with self._lock:
            live = self._live
            if tokens in live or len(live) >= self.max_lengths:
                return False
            if not live or tokens > max(live):
                return True  # the first chunk, or an extrapolation upwards (the risky side)
            # A shorter chunk than one already walked: predicted. Refine the fit only when
            # the safe size is close to the chunks the program runs.
            safe = self.safe_tokens
            if safe is None or safe >= NEAR_FACTOR * max(live):
                return False
            if len(live) < MIN_POINTS:
                return True
            nodes = [m.nodes for m in live.values()]
            flat = max(nodes) - min(nodes) <= FLAT_SPREAD * max(nodes)
            fits = self._fits
            return not (flat or (fits is not None and fits[0].r2 >= TRUST_R2))

    def _assess(self, tokens: int | None) -> tuple[int | None, float | None]:
        """(safe chunk size, predicted buffers of a chunk of ``tokens``); keeps the safe size."""
        fits = self._fits
        if fits is None:
            return None, None
        resident = self.watchdog.forecast().resident_buffers
        budget = self.safety * self.watchdog.limit - resident
        safe = largest_safe_chunk(fits[0], fits[1], budget, self.ceiling)
        self.safe_tokens = safe
        return safe, (self.predicted_buffers(tokens) if tokens is not None else None)

    def _over_budget(self, measurement: Measurement) -> bool:
        resident = self.watchdog.forecast().resident_buffers
        return measurement.predicted_buffers > self.safety * self.watchdog.limit - resident

    def _report(self, safe: int | None) -> None:
        if safe is None or safe == self._reported:
            return
        self._reported = safe
        logger.debug("mlx-watchdog: safe prefill chunk for %s: %d tokens", self.watchdog.name, safe)
        if self.on_safe_size is not None:
            try:
                self.on_safe_size(safe)
            except Exception as exc:  # the caller's callback must not break the prefill
                self._internal_error("on_safe_size callback", exc)

    # ------------------------------------------------------------------ the hook

    def hook(self, watchdog: Watchdog, inputs: Any, output: Any) -> None:
        """The ``prefill_hooks`` entry: ``fn(watchdog, inputs, output)``."""
        state = self._state
        cache = state.prefill_cache if state is not None else None
        self.check_chunk(inputs, output, cache)

    def check_chunk(self, inputs: Any, output: Any, cache: Any = None) -> None:
        """Measure (when due) and judge one prefill chunk whose ``output`` is not evaluated yet.

        Never raises, except :class:`ResourceLimitForecast` when the watchdog has
        ``stop_within`` set and the chunk is predicted over the limit."""
        start = clock.wall()
        try:
            verdict = self._check(inputs, output, cache)
        except Exception as exc:
            self._internal_error("prefill guard", exc)
            verdict = None
        finally:
            self.watchdog.record_overhead(clock.wall() - start)
        if verdict is not None:
            raise verdict

    def _check(self, inputs: Any, output: Any, cache: Any) -> ResourceLimitForecast | None:
        tokens = _chunk_tokens(inputs)
        with self._lock:
            self.chunks += 1
            alone = not self._live and not self._calibration
        if self._should_walk(tokens):
            measurement = measure_chunk(tokens, output, cache)
            self.record(measurement)
            model = self._model() if self._model is not None else None
            if (
                alone
                and model is not None
                and tokens >= 2 * COMPANION_TOKENS
                and self._over_budget(measurement)
            ):
                # One point fits a line through the origin: above the point it over-predicts
                # (conservative), below it it under-predicts a graph with a fixed part (a flat
                # dense or MoE graph most of all). The chunk does not fit, so the safe size lies
                # below it: add a short calibration chunk (built, never evaluated) for the line.
                self.record(_measure_fresh(model, max(COMPANION_TOKENS, min(16, tokens // 8))))
        safe, predicted = self._assess(tokens)
        self._report(safe)
        wd = self.watchdog
        if wd.stop_within is None or predicted is None:
            return None
        forecast = wd.forecast()
        room = wd.limit - forecast.resident_buffers
        if predicted <= room:
            return None
        wd.record_stop("prefill", forecast)
        if safe:
            advice = (
                f"retry with prefill_step_size={safe} (the largest chunk predicted under "
                f"{self.safety:.0%} of the limit)"
            )
        else:
            advice = (
                "no chunk size fits: free resident buffers (Watchdog(fix=True) cuts leaked "
                "chains) or raise the limit"
            )
        message = (
            f"mlx-watchdog stopped the prefill before evaluating it: a chunk of {tokens} tokens is "
            f"predicted to hold {predicted:.0f} buffers at once (graph nodes + inputs), more than the "
            f"{room} left under the limit of {wd.limit} ({forecast.resident_buffers} resident); "
            f"{advice}. The prompt cache holds this chunk's unevaluated update: rebuild or trim it "
            f"before retrying."
        )
        logger.error("%s", message)
        exc = ResourceLimitForecast(forecast, reason="prefill")
        exc.args = (message,)
        exc.chunk_tokens = tokens
        exc.predicted_buffers = predicted
        exc.safe_prefill_tokens = safe
        return exc

    def _internal_error(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.internal_errors += 1
        self.watchdog.record_internal_error(where, exc)

    def remove(self) -> None:
        """Stop guarding: take the hook off the model it was installed on."""
        state, self._state = self._state, None
        if state is not None:
            state.prefill_hooks[:] = [
                h for h in state.prefill_hooks if getattr(h, "__self__", None) is not self
            ]

    def __repr__(self) -> str:
        fit = self.nodes_fit
        per_token = f"{fit.slope:.1f}" if fit else "?"
        return (
            f"PrefillGuard({self.watchdog.name!r}, nodes/token={per_token}, "
            f"safe_tokens={self.safe_tokens}, walks={self.walks}, chunks={self.chunks})"
        )


def install(
    watchdog: Watchdog,
    model: Any,
    on_safe_size: Callable[[int], Any] | None = None,
    *,
    safety: float = DEFAULT_SAFETY,
    calibrate: Sequence[int] = (),
) -> PrefillGuard:
    """Guard ``model``'s prefill chunks with ``watchdog`` (the model is watched first when it is
    not), and install the guard on the watchdog (``watchdog.prefill_guard``: its forecast reads
    the guard's measurements). A guard installed earlier on the same model is replaced.
    ``calibrate``: chunk lengths to measure now on a fresh cache (never evaluated), so
    ``on_safe_size`` hears the safe size before the first request."""
    guard = PrefillGuard(watchdog, safety, on_safe_size)
    state = state_watched_by(model, watchdog)
    state.prefill_hooks[:] = [
        h for h in state.prefill_hooks if not isinstance(getattr(h, "__self__", None), PrefillGuard)
    ]
    guard._state = state  # noqa: SLF001 (this module's class)
    guard._model = weakref.ref(model)  # noqa: SLF001 (this module's class)
    state.prefill_hooks.append(guard.hook)
    watchdog.prefill_guard = guard
    if calibrate:
        guard.calibrate(model, calibrate)
    return guard


def installed_guard(model: Any) -> PrefillGuard | None:
    """The guard installed on ``model``, if any."""
    state = watched_state(model)
    for hook in state.prefill_hooks if state is not None else ():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, PrefillGuard):
            return owner
    return None


# --------------------------------------------------------------------------- a one-off measurement


def safe_prefill_report(
    model: Any,
    limit: int | None = None,
    lengths: Sequence[int] = (32, 64, 128),
    *,
    safety: float = DEFAULT_SAFETY,
    resident_buffers: int | None = None,
) -> dict:
    """Measure the forward graph of prefill chunks of ``lengths`` tokens and compute the safe
    prefill step size for ``limit`` (default: the device's). Each chunk is built on a fresh
    cache and never evaluated; a length already predicted over the limit is not even built.

    ``resident_buffers`` defaults to the model's parameter arrays. Returns a dict with
    ``nodes_per_token``, ``buffers_per_token``, ``max_safe_prefill_tokens`` (``UNBOUNDED_TOKENS``
    when no chunk up to that size reaches the budget: ``bounded`` False; 0 when not even one
    token fits), ``measurements`` and the fit's details."""
    values = _check_lengths(lengths, "lengths")
    safety = _check_safety(safety)
    limit = resolve_limit(limit)
    if resident_buffers is None:
        flat: list[tuple[str, Any]] = []
        tree_flatten(model.parameters() if hasattr(model, "parameters") else {}, destination=flat)
        resident_buffers = len({id(a) for _, a in flat if isinstance(a, mx.array)})
    elif isinstance(resident_buffers, bool) or not isinstance(resident_buffers, int) or resident_buffers < 0:
        raise ValueError(f"resident_buffers must be an int >= 0, got {resident_buffers!r}")
    measured: list[Measurement] = []
    skipped: list[int] = []
    for tokens in values:
        if measured:
            nodes = fit_line([(m.tokens, m.nodes) for m in measured])
            buffers = fit_line([(m.tokens, m.buffers) for m in measured])
            if nodes.at(tokens) + buffers.at(tokens) > limit - resident_buffers:
                skipped.append(tokens)
                continue
        measured.append(_measure_fresh(model, tokens))
    nodes = fit_line([(m.tokens, m.nodes) for m in measured])
    buffers = fit_line([(m.tokens, m.buffers) for m in measured])
    budget = safety * limit - resident_buffers
    safe = largest_safe_chunk(nodes, buffers, budget)
    return {
        "nodes_per_token": nodes.slope,
        "buffers_per_token": buffers.slope,
        "max_safe_prefill_tokens": safe,
        "bounded": safe < UNBOUNDED_TOKENS,
        "nodes_intercept": nodes.intercept,
        "buffers_intercept": buffers.intercept,
        "nodes_r2": nodes.r2,
        "flat": nodes.flat,
        "limit": limit,
        "safety": safety,
        "resident_buffers": resident_buffers,
        "measurements": [dataclasses.asdict(m) for m in measured],
        "skipped_lengths": skipped,
    }
