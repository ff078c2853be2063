"""``instrument()``: every model a program loads through mlx-lm's or mlx-vlm's loader is watched,
with no line of the program changed (``mlx-watchdog run`` calls it in each process it starts).

    import mlx_watchdog
    mlx_watchdog.instrument(fix=True, stop_within=2000)   # before or after mlx_lm is imported
    model, tokenizer = mlx_lm.load("mlx-community/...")   # watched
    mlx_watchdog.uninstrument()                           # the loaders as they were

Like OpenTelemetry's instrumentors it wraps one function per library and unwraps it again:
``mlx_lm.utils.load_model`` and ``mlx_vlm.utils.load_model``. Every loader of those libraries
(``load``, the servers built on them) reaches ``load_model`` through the module's attribute at
call time, and a name copied at import (``from mlx_lm import load``) is ``load``, which looks
``load_model`` up when it runs. A module already imported is wrapped at once; one not imported
yet is wrapped right after it executes, by a ``sys.meta_path`` finder: nothing is imported, and
nothing patched, before the program imports the library itself. This module imports the
standard library only; the core (and with it MLX) is imported in the wrapper, when the library
has loaded MLX already.

The wrapper returns exactly what the loader returns, then watches the object the program calls
once per step with ``cache=``: the mlx-lm model itself; for mlx-vlm ``model.language_model`` (the
outer model is not called per step). Each gets a :class:`~mlx_watchdog.Watchdog` of its own,
named after the model's folder (or Hugging Face repository). Models are held weakly: when one
dies, its watchdog is retired (no longer exported), so a model loaded to be inspected and dropped
leaves nothing behind. Nothing raised after the loader returned reaches the program: it is logged
and counted (``Instrumentor.errors``).

A stop (``stop_within``) raises :class:`~mlx_watchdog.ResourceLimitForecast` from the model's
forward; the servers fail their running requests and go on. The core keeps the growth it measured
after a stop, so the next forward would be stopped at once from readings of the batch that was
just failed; these watchdogs forget it when they raise (``reset()``) and measure afresh.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import PurePath
from typing import Any

from .imports import PostImportHook

logger = logging.getLogger("mlx_watchdog")

# module -> the library whose loader it holds
TARGETS = {"mlx_lm.utils": "mlx_lm", "mlx_vlm.utils": "mlx_vlm"}
LOADER = "load_model"

# The Watchdog options instrument() takes (name, model and export are the instrumentor's).
OPTIONS = (
    "limit",
    "fix",
    "fix_every",
    "warn_within",
    "stop_within",
    "on_forecast",
    "overhead_budget",
    "walk_interval",
    "max_objects",
    "max_depth",
    "process_count",
    "census",
)

OnWatch = Callable[[Any, Any], Any]  # on_watch(watched object, its watchdog)

_lock = threading.RLock()
_current: Instrumentor | None = None
_watchdog_class: type | None = None


def instrument(
    *, on_watch: OnWatch | None = None, exit_on_training_stop: bool = False, **options: Any
) -> Instrumentor:
    """Watch every model loaded from now on through ``mlx_lm.utils.load_model`` or
    ``mlx_vlm.utils.load_model`` (and the loaders that call them: ``mlx_lm.load``,
    ``mlx_vlm.load``, servers built on them), each with a ``Watchdog(**options)`` of its own,
    and every training step compiled from now on (``training.py``: mlx-lm's trainer, step by step;
    a stop saves the adapters, then raises, or with ``exit_on_training_stop`` exits the process).

    ``on_watch(model, watchdog)`` is called after each model is watched (``model`` is the
    object observed: for mlx-vlm its ``language_model``). Idempotent: while instrumented, a
    second call returns the running instrumentor (a warning says when its options differ).
    Raises ``ValueError`` (``TypeError`` for an unknown option) before anything is patched."""
    global _current
    checked = _checked_options(options)
    if on_watch is not None and not callable(on_watch):
        raise ValueError(f"on_watch must be callable, got {on_watch!r}")
    with _lock:
        if _current is not None:
            if (
                checked != _current.options
                or on_watch is not _current.on_watch
                or bool(exit_on_training_stop) != _current.exit_on_training_stop
            ):
                logger.warning(
                    "mlx-watchdog: already instrumented; the options of this instrument() call "
                    "are ignored (uninstrument() first to change them)"
                )
            return _current
        current = Instrumentor(checked, on_watch, exit_on_training_stop=exit_on_training_stop)
        current.start()
        _current = current
        return current


def uninstrument() -> None:
    """Undo :func:`instrument`: the loaders are the original functions again (where nobody
    wrapped them after us), the import hook is gone, and the models still alive are unwatched
    and their watchdogs retired. A no-op when not instrumented."""
    global _current
    with _lock:
        current, _current = _current, None
        if current is not None:
            current.stop()


def instrumentor() -> Instrumentor | None:
    """The running instrumentor, or None."""
    return _current


class Instrumentor:
    """What :func:`instrument` runs: the wrapped loaders, the import hook and the models watched."""

    def __init__(
        self, options: dict[str, Any], on_watch: OnWatch | None = None, *, exit_on_training_stop: bool = False
    ):
        self.options = dict(options)
        self.on_watch = on_watch
        self.exit_on_training_stop = bool(exit_on_training_stop)
        self._training = False  # whether training.instrument() was ours to undo
        self.errors = 0  # failures after a loader returned: logged, never raised
        self.active = False
        self._finder = PostImportHook(TARGETS, self._patch_imported)
        # module name -> (module, original loader, our wrapper)
        self._patched: dict[str, tuple[types.ModuleType, Callable, Callable]] = {}
        # token -> (the model, weakly; its watchdog; what retires it when the model dies)
        self._watched: dict[int, tuple[Callable[[], Any], Any, weakref.finalize | None]] = {}
        self._tokens = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ on and off

    def start(self) -> None:
        with self._lock:
            self.active = True
            self._finder.install()
            for name in TARGETS:
                module = sys.modules.get(name)
                if module is not None:
                    self.patch(module)
            from . import training

            self._training = training.instrument(
                watch=self.watch_trained, exit_on_stop=self.exit_on_training_stop, **self.options
            )

    def stop(self) -> None:
        with self._lock:
            self.active = False
            self._finder.remove()
            patched, self._patched = self._patched, {}
            for module, original, wrapper in patched.values():
                # Someone who wrapped it after us keeps their wrapper (ours then only passes through).
                if module.__dict__.get(LOADER) is wrapper:
                    setattr(module, LOADER, original)
            watched, self._watched = self._watched, {}
            if self._training:
                from . import training

                training.uninstrument()
                self._training = False
        from ..core.live import retire
        from .model import unwatch_model, watched_state

        for ref, watchdog, finalizer in watched.values():
            if finalizer is not None:
                finalizer.detach()
            model = ref()
            state = watched_state(model) if model is not None else None
            if state is not None and state.watchdog is watchdog:
                unwatch_model(model)
            retire(watchdog)

    def patch(self, module: types.ModuleType) -> None:
        """Wrap ``module.load_model`` (a module of ``TARGETS``, just executed or already there)."""
        library = TARGETS.get(module.__name__)
        with self._lock:
            if not self.active or library is None:
                return
            original = module.__dict__.get(LOADER)
            known = self._patched.get(module.__name__)
            if not callable(original) or (known is not None and original is known[2]):
                return
            wrapper = self._wrap(original, library)
            setattr(module, LOADER, wrapper)
            self._patched[module.__name__] = (module, original, wrapper)

    # ------------------------------------------------------------------ models

    def watchdogs(self) -> list:
        """The watchdogs of the models loaded and still alive."""
        with self._lock:
            return [watchdog for ref, watchdog, _ in self._watched.values() if ref() is not None]

    def _wrap(self, original: Callable, library: str) -> Callable:
        instrumentor = self

        @functools.wraps(original)
        def load_model(*args, **kwargs):
            if instrumentor.active:
                instrumentor._count_early()
            result = original(*args, **kwargs)
            if instrumentor.active:
                instrumentor._loaded(library, result, args, kwargs)
            return result

        return load_model

    def _count_early(self) -> None:
        """Start the process count before the model's buffers are made: it is then every buffer
        (``process_count.start_early``). Never raises: the program loads its model."""
        try:
            from ..core.process_count import start_early

            start_early(self.options.get("process_count", "auto"))
        except Exception as exc:
            logger.info("mlx-watchdog: the process count was not started early: %r", exc)

    def _loaded(self, library: str, result: Any, args: Sequence, kwargs: dict) -> None:
        """Watch what a loader returned. Never raises: the program has its model."""
        try:
            model = result[0] if library == "mlx_lm" and isinstance(result, tuple) else result
            self.watch(_per_step_object(library, model), _model_name(args, kwargs))
        except Exception as exc:
            with self._lock:
                self.errors += 1
                count = self.errors
            logger.warning(
                "mlx-watchdog: a model loaded through %s.utils.%s is not watched: %r",
                library,
                LOADER,
                exc,
                exc_info=count == 1,
            )

    def watch(self, model: Any, name: str | None = None) -> Any:
        """Watch ``model`` with a watchdog of its own (none when it is watched already); returns
        the watchdog, or None."""
        from .model import watch_model, watched_state

        if watched_state(model) is not None:  # the same model again, or watched by the program itself
            return None
        watchdog = _stop_resetting_watchdog()(**self.options, name=name)
        watch_model(model, watchdog)
        with self._lock:
            self._tokens += 1
            token = self._tokens
            try:
                finalizer: weakref.finalize | None = weakref.finalize(model, self._retire, token)
                ref: Callable[[], Any] = weakref.ref(model)
            except TypeError:  # not weakly referable: watched as long as the program holds it
                finalizer, ref = None, _strong_ref(model)
            if finalizer is not None:
                finalizer.atexit = False
            self._watched[token] = (ref, watchdog, finalizer)
        logger.info(
            "mlx-watchdog: watching %s (limit %d buffers, fix=%s, stop_within=%s)",
            watchdog.name,
            watchdog.limit,
            watchdog.fix,
            watchdog.stop_within,
        )
        if self.on_watch is not None:
            self.on_watch(model, watchdog)
        return watchdog

    def watch_trained(self, model: Any) -> Any:
        """The watchdog of a model a training step trains: its own, or a new one (``watch``)."""
        from .model import watched_state

        watchdog = self.watch(model)
        if watchdog is None:
            state = watched_state(model)
            watchdog = state.watchdog if state is not None else None
        return watchdog

    def _patch_imported(self, module: types.ModuleType) -> None:
        """A module of ``TARGETS`` just executed (the import hook): wrap its loader."""
        try:
            self.patch(module)
        except Exception as exc:  # the import succeeded; the program goes on unwatched
            self.errors += 1
            logger.warning("mlx-watchdog: cannot wrap %s.%s: %r", module.__name__, LOADER, exc)

    def _retire(self, token: int) -> None:
        """The model died: its watchdog leaves the exporters and the instrumentor."""
        with self._lock:
            entry = self._watched.pop(token, None)
        if entry is not None:
            from ..core.live import retire

            retire(entry[1])


# --------------------------------------------------------------------------- helpers


def _stop_resetting_watchdog() -> type:
    """``Watchdog`` whose ``observe`` forgets the measured growth when it stops the generation
    (the core keeps it: the next forward would be stopped again from the failed batch's readings).
    Made on first use: the core imports MLX."""
    global _watchdog_class
    if _watchdog_class is None:
        from ..core.actions import ResourceLimitForecast
        from ..core.watchdog import Watchdog

        class LoadedModelWatchdog(Watchdog):
            def observe(
                self, roots: Any, *, last_output: Any = None, prefill: bool = False, inputs: Any = None
            ) -> None:
                try:
                    super().observe(roots, last_output=last_output, prefill=prefill, inputs=inputs)
                except ResourceLimitForecast:
                    self.reset()  # the program fails the running requests and goes on
                    raise

        _watchdog_class = LoadedModelWatchdog
    return _watchdog_class


def _checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options, checked by the record ``Watchdog`` builds (``WatchdogOptions``), before
    anything is patched: those given, normalized. The options module imports the standard library
    only."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(
            f"instrument() got unexpected option(s) {', '.join(unknown)}; it takes {', '.join(OPTIONS)}"
        )
    from ..core.options import WatchdogOptions

    checked = WatchdogOptions(**options)
    return {name: getattr(checked, name) for name in options}


def _per_step_object(library: str, model: Any) -> Any:
    """What the program calls once per step with ``cache=``: mlx-vlm's text model, else the model."""
    if library == "mlx_vlm":
        language_model = getattr(model, "language_model", None)
        if callable(language_model):
            return language_model
    return model


def _model_name(args: Sequence, kwargs: dict) -> str | None:
    """The watchdog's name: the model folder's name; in Hugging Face's cache
    (``.../models--org--name/snapshots/<revision>``) the repository id."""
    path = args[0] if args else kwargs.get("model_path")
    if path is None:
        return None  # watch_model names it after the model's type
    parts = PurePath(str(path)).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/", 1)
    return (parts[-1] if parts else "") or str(path)


def _strong_ref(model: Any) -> Callable[[], Any]:
    return lambda: model
