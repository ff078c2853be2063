"""Training loops watched per optimizer step: every compiled training step is observed at each
call, its growth forecast in steps and seconds, and a stop saves the adapters first.

    from mlx_watchdog.attach import training
    training.instrument(stop_within=500)    # before the trainer compiles its step
    mlx_lm.tuner.trainer.train(model, optimizer, ...)   # watched, step by step

``mlx-watchdog run`` and ``mlx_watchdog.instrument()`` call it. A training step is found where
it is compiled: mlx-lm's trainer (``mlx_lm.tuner.trainer.train``), mlx-lm-lora's trainers, and
MLX's own examples all compile it with the state they update captured::

    state = [model.state, optimizer.state, mx.random.state]
    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch, prev_grad, do_update): ...

So a function compiled with ``inputs=`` holding a model (an ``nn.Module``, ``model.state`` is
the model itself) and with ``outputs=`` is a training step, whatever trainer compiles it, and
each call of it is one step (with gradient accumulation, one micro-batch). The model's forward
runs only while MLX traces the step: a model watched for decoding never sees a training step.

Each call first observes (``Watchdog.observe``) the captured state other than the model: the
optimizer's state, MLX's random state; the model's parameters are counted once, at the first
step (LoRA adds its own after loading). The watchdog is the model's own when it is watched (a
model loaded through mlx-lm under ``instrument()``), else a new one. The trainer evaluates that
state every step, so what grows is what the step's compiled function keeps: one cache entry per
input signature (``compiled.py``), a site ``compiled:<function>`` of the forecast.

A stop (``stop_within``) comes at the entry of a step, before it runs: the state is that of the
last step. The trainable parameters are saved to the trainer's adapter file first, as mlx-lm
saves them at its save points (``mx.save_safetensors(args.adapter_file,
dict(tree_flatten(model.trainable_parameters())))``, on rank 0), the file named by the
``args.adapter_file`` of the function that calls the step (mlx-lm's and mlx-lm-lora's trainers
both have one). Then ``TrainingStopped`` is raised (a ``ResourceLimitForecast``), or, with
``exit_on_stop`` (``mlx-watchdog run``), the process exits with status ``EXIT_STOPPED`` and one
message saying where the adapters are and how to resume.
"""

from __future__ import annotations

import collections
import logging
import statistics
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..core import clock
from . import compiled

logger = logging.getLogger("mlx_watchdog")

EXIT_STOPPED = 3  # the exit status of a training stopped before the limit (exit_on_stop)
IDLE_STEPS = 8  # typical steps without a step: a pause (the core's rule for decode steps)
GAPS_KEPT = 8  # the gaps between the last steps, for the typical one

_lock = threading.RLock()
_active = False
_instrumented_compile = False  # whether compiled.instrument() was ours to undo
_options: dict[str, Any] = {}
_watch: Callable[[Any], Any] | None = None
_exit_on_stop = False


_training_stopped: type | None = None
_kept_at_exit: list[Any] = []  # models of trainings stopped by exiting (see TrainingWatch.stop)


def _stopped_class() -> type[BaseException]:
    from ..core.actions import ResourceLimitForecast

    return ResourceLimitForecast


def training_stopped_class() -> type:
    """:class:`TrainingStopped`, made on first use (the core imports numpy: a process under
    ``mlx-watchdog run`` that never trains does not pay for it)."""
    global _training_stopped
    if _training_stopped is None:
        base = _stopped_class()

        class TrainingStopped(base):  # type: ignore[valid-type,misc]
            """Raised from a training step when the forecast puts the buffer limit within
            ``stop_within`` steps, after the adapters were saved: a ``ResourceLimitForecast``.
            ``adapter_file``: where the trainable parameters were saved (None: not saved)."""

            def __init__(self, message: str, forecast: Any, adapter_file: str | None):
                super().__init__(forecast, reason="training")
                self.args = (message,)
                self.adapter_file = adapter_file

            def __str__(self) -> str:
                return str(self.args[0])

        TrainingStopped.__module__ = __name__
        _training_stopped = TrainingStopped
    return _training_stopped


def __getattr__(name: str) -> Any:
    if name == "TrainingStopped":
        return training_stopped_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def instrument(
    *, watch: Callable[[Any], Any] | None = None, exit_on_stop: bool = False, **options: Any
) -> bool:
    """Watch every training step compiled from now on (see the module docstring). ``options``:
    the ``Watchdog`` options of a watchdog made for a model not watched yet; ``watch(model)``,
    when given, makes it instead (returns the model's watchdog). ``exit_on_stop``: a stop ends
    the process (status ``EXIT_STOPPED``) instead of raising. Idempotent; returns whether this
    call instrumented."""
    global _active, _instrumented_compile, _options, _watch, _exit_on_stop
    with _lock:
        if _active:
            return False
        _active = True
        _options, _watch, _exit_on_stop = dict(options), watch, bool(exit_on_stop)
        _instrumented_compile = compiled.instrument()
        compiled.add_compile_hook(_on_compile)
        return True


def uninstrument() -> None:
    """Undo :func:`instrument`: steps compiled from now on are not watched (those compiled before
    go on being watched while they live), and ``mx.compile`` is restored if this instrumented it."""
    global _active, _instrumented_compile, _watch
    with _lock:
        if not _active:
            return
        _active = False
        compiled.remove_compile_hook(_on_compile)
        if _instrumented_compile:
            compiled.uninstrument()
        _instrumented_compile = False
        _watch = None


def instrumented() -> bool:
    return _active


def training_model(inputs: Any, outputs: Any) -> Any:
    """The model a function compiled with ``inputs=``/``outputs=`` trains: an ``nn.Module`` among
    the captured inputs (``[model.state, optimizer.state, ...]``), when there are outputs too."""
    if outputs is None or inputs is None:
        return None
    nn = sys.modules.get("mlx.nn")
    module = getattr(nn, "Module", None)
    if module is None:
        return None
    return next((item for item in _items(inputs) if isinstance(item, module)), None)


def _items(inputs: Any) -> list:
    """The top-level items of a captured tree: a list's or tuple's, a plain dict's values, or
    the tree itself (a model given alone)."""
    if isinstance(inputs, (list, tuple)):
        return list(list.__iter__(inputs) if isinstance(inputs, list) else tuple.__iter__(inputs))
    if type(inputs) is dict:
        return list(dict.values(inputs))
    return [inputs]


def _on_compile(fun: Any, inputs: Any, outputs: Any) -> StepWatch | None:
    model = training_model(inputs, outputs)
    if model is None or not _active:
        return None
    roots = [item for item in _items(inputs) if item is not model]
    return StepWatch(model, roots, _options, _watch, _exit_on_stop)


class StepWatch:
    """The calls of one compiled training step (``compiled.CallHook``)."""

    def __init__(
        self,
        model: Any,
        roots: list,
        options: dict[str, Any],
        watch: Callable[[Any], Any] | None,
        exit_on_stop: bool,
    ):
        self.model = model
        self.roots = roots  # the same list every step: the watchdog follows the same objects
        self.options = options
        self.watch = watch
        self.exit_on_stop = exit_on_stop
        self.watchdog: Any = None
        self.last: Any = None
        self.layout: tuple = ()
        self.failed = False
        self.called_at: float | None = None
        self.gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)

    def before(self) -> None:
        if self.failed:
            return
        try:
            watchdog = self.watchdog
            if watchdog is None:
                watchdog = self.watchdog = self._watchdog()
            # The optimizer makes its state at its first update (an array per parameter and
            # moment): a one-off, no growth. The series starts again once the state's layout settled.
            layout = _layout(self.roots)
            if layout != self.layout:
                if self.layout:
                    watchdog.reset()
                self.layout = layout
            # A step may take seconds: 8 typical steps without one are a pause, not fewer (the
            # median of the last gaps: a validation run between two steps is no typical step).
            now = clock.wall()  # the watchdog's clock
            if self.called_at is not None:
                self.gaps.append(now - self.called_at)
                watchdog.min_idle_seconds = IDLE_STEPS * statistics.median(self.gaps)
            self.called_at = now
        except Exception as exc:  # the training goes on, unwatched
            self.failed = True
            logger.warning("mlx-watchdog: a training step is not watched: %r", exc, exc_info=True)
            return
        last, self.last = self.last, None
        try:
            watchdog.observe(self.roots, last_output=last)
        except _stopped_class() as stop:
            self.stop(stop)

    def after(self, result: Any) -> None:
        watchdog = self.watchdog
        self.last = result if watchdog is not None and watchdog.fix else None

    def ended(self) -> None:
        """The compiled step died (``train()`` returned): nothing steps now."""
        watchdog, self.last = self.watchdog, None
        if watchdog is not None:
            watchdog.min_idle_seconds = 0.0
            watchdog.generation_ended()

    def _watchdog(self) -> Any:
        from ..core.watchdog import Watchdog
        from .model import watched_state

        state = watched_state(self.model)
        watchdog = state.watchdog if state is not None else None
        if watchdog is None and self.watch is not None:
            watchdog = self.watch(self.model)
        if watchdog is None:
            watchdog = Watchdog(**self.options, model=self.model)
            if watchdog.name_is_default:
                watchdog.name = type(self.model).__name__
        watchdog.count_parameters(self.model)  # LoRA layers come after the load
        logger.info("mlx-watchdog: watching the training steps of %s", watchdog.name)
        return watchdog

    def stop(self, stop: Any) -> None:
        """Save the adapters, then raise ``TrainingStopped`` or exit."""
        forecast = stop.forecast
        caller = _caller_locals()
        adapter_file = _adapter_file(caller.get("args"))
        iteration = caller.get("it")  # mlx-lm's and mlx-lm-lora's loops count their iterations so
        if not isinstance(iteration, int):
            iteration = forecast.step
        rank = caller.get("rank")
        if not isinstance(rank, int):
            rank = getattr(self.watchdog, "rank", 0)
        saved: str | None = None
        if adapter_file is None:
            where = "no adapter file was found (the trainer's args.adapter_file): nothing was saved"
        elif rank != 0:
            where = f"rank {rank} saves nothing (rank 0 saves the adapters to {adapter_file})"
        else:
            try:
                _save(self.model, adapter_file)
                saved = adapter_file
                where = (
                    f"the adapters of iteration {iteration - 1} are saved to {adapter_file} "
                    f"(mlx_lm lora: resume with --resume-adapter-file {adapter_file})"
                )
            except Exception as exc:
                where = f"saving the adapters to {adapter_file} FAILED: {exc!r}"
        from ..core.compiled import advice

        fix = advice(forecast.leaks)
        message = (
            f"mlx-watchdog stopped the training before iteration {iteration} "
            f"(the buffer limit of {forecast.limit} is forecast within "
            f"{forecast.steps_to_limit:.0f} steps): {forecast.describe()}. {where}."
            + (f" To fix it: {fix}." if fix else "")
        )
        if self.exit_on_stop:
            # Kept to the end: were the model freed as the exit unwinds, its watchdog would be
            # retired before the last metrics are written, and the stop lost with it.
            _kept_at_exit.append(self.model)
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            raise SystemExit(EXIT_STOPPED)
        logger.error("%s", message)
        raise training_stopped_class()(message, forecast, saved) from stop


def _layout(roots: list) -> tuple:
    """The number of items of each root container (the optimizer's state gains its keys at the
    first update): cheap, read through the containers' own types."""
    return tuple(
        dict.__len__(root) if isinstance(root, dict) else list.__len__(root) if isinstance(root, list) else -1
        for root in roots
    )


def _caller_locals() -> dict:
    """The local variables of the function that called the step (the trainer's loop): the first
    frame out of this package. Read, never called."""
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("mlx_watchdog."):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return {}
    try:
        return dict(frame.f_locals)
    except Exception:
        return {}


def _adapter_file(args: Any) -> str | None:
    """``args.adapter_file``, read without running the program's code (a dataclass field or a
    namespace attribute)."""
    if args is None:
        return None
    try:
        value = vars(args).get("adapter_file")
    except TypeError:
        return None
    return str(value) if value else None


def _save(model: Any, path: str) -> None:
    """The trainable parameters, saved as mlx-lm saves them at its save points."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(path), weights)
