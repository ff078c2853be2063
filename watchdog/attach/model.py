"""``watch_model``: every forward pass of a model that is given a cache is observed, whoever
makes it (``generate_step``, ``BatchGenerator``, speculative decoding, a server's own loop).

Like OpenTelemetry's instrumentors, attaching and detaching are symmetric and mlx-lm's classes
are left untouched: ``watch_model`` gives the *instance* a subclass of its own class whose
``__call__`` observes first, and ``unwatch_model`` gives the original class back. The watchdog
lives on that subclass, not in the model (an ``nn.Module`` is a dict: attributes set on it
would become parameters). ``Watching`` watches a model for the duration of a block (the
decorator's unit).
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

from ..core.options import WatchdogOptions
from ..core.watchdog import Watchdog, input_tokens

_STATE = "_mlx_watchdog_state"
_NEWOBJ = tuple(vars(copyreg)[name] for name in ("__newobj__", "__newobj_ex__"))  # pickle's constructors
_attach_lock = threading.RLock()


class _ModelState:
    """What a watched model carries on its per-instance subclass."""

    __slots__ = (
        "watchdog",
        "original_class",
        "last_output",
        "prefill_hooks",
        "prefill_cache",
        "blocks",
        "restore_to",
    )

    def __init__(self, watchdog: Watchdog, original_class: type):
        self.watchdog = watchdog
        self.original_class = original_class
        self.last_output: Any = None
        self.prefill_hooks: list[Callable] = []  # fn(watchdog, inputs, output) after a multi-token forward
        self.prefill_cache: Any = None  # the forward's cache, set only while the prefill hooks run
        self.blocks: list[_Block] = []  # open @watch calls, oldest first (threads may overlap)
        self.restore_to: Watchdog | None = None  # the watchdog found before the first of them


@dataclasses.dataclass
class _Block:
    """The open ``Watching`` blocks of one watchdog on a model."""

    watchdog: Watchdog
    count: int = 1


def _observed_call(state: _ModelState) -> Callable:
    """The watching subclass's ``__call__``, its state bound once. Every forward runs it, right
    after the program's own work has left the CPU's caches cold, where each step of it costs
    (docs/internals.md, the per-step path): it reads no array (the forward's inputs go to
    ``observe``, which looks at them only when the roots changed)."""
    original = state.original_class

    def __call__(self, *args, **kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        cache = kwargs["cache"] if "cache" in kwargs else (args[1] if len(args) > 1 else None)
        if cache is None:
            return original.__call__(self, *args, **kwargs)
        watchdog = state.watchdog
        last, state.last_output = state.last_output, None  # hold the output for one step only
        watchdog.observe(cache, last_output=last, inputs=inputs)
        del last
        output = original.__call__(self, *args, **kwargs)
        # Only the fix reads it (it waits until the program has evaluated its last output); held
        # otherwise, a prefill chunk's logits (tokens x vocabulary) would stay alive a step longer.
        state.last_output = output if watchdog.fix else None
        if state.prefill_hooks and input_tokens(inputs) > 1:
            state.prefill_cache = cache  # hooks may walk the cache too; not held past this call
            try:
                for hook in state.prefill_hooks:
                    hook(watchdog, inputs, output)
            finally:
                state.prefill_cache = None
        return output

    return __call__


def check_options(options: dict) -> None:
    """Check ``Watchdog`` keyword options now, as the watchdog they will make checks them
    (``WatchdogOptions``), without making one: ``ValueError`` naming a bad option, ``TypeError``
    for an unknown one."""
    WatchdogOptions(**{name: value for name, value in options.items() if name != "model"})


def watchdog_from(watchdog: Watchdog | None, options: dict) -> Watchdog:
    """The given watchdog, or a new one built from Watchdog options (never both)."""
    if watchdog is not None and options:
        raise ValueError("pass either watchdog= or Watchdog options, not both")
    return watchdog if watchdog is not None else Watchdog(**options)


def watched_state(model: Any) -> _ModelState | None:
    return type(model).__dict__.get(_STATE)


def watch_model(model, watchdog: Watchdog | None = None, **options):
    """Observe every forward pass of ``model`` that is given a cache. Returns the same model
    object, still an instance of its class. ``options`` create a :class:`Watchdog` when none
    is given. Watching an already watched model swaps its watchdog."""
    _watch(model, watchdog_from(watchdog, options))
    return model


def state_watched_by(model: Any, watchdog: Watchdog) -> _ModelState:
    """The model's watch state; a model not watched yet is watched by ``watchdog`` first."""
    state = watched_state(model)
    return state if state is not None else _watch(model, watchdog)


def _watch(model: Any, watchdog: Watchdog) -> _ModelState:
    if not callable(model):
        raise TypeError(f"watch_model needs a callable model, got {type(model).__name__}")
    with _attach_lock:
        state = watched_state(model)
        if state is not None:
            state.watchdog = watchdog
        else:
            original = type(model)
            state = _ModelState(watchdog, original)
            try:
                subclass = type(
                    original.__name__,
                    (original,),
                    {
                        "__slots__": (),  # same memory layout, so classes with __slots__ work too
                        "__call__": _observed_call(state),
                        _STATE: state,
                        "__module__": original.__module__,
                        "__qualname__": original.__qualname__,
                        "__reduce_ex__": _reduce_unwatched,
                    },
                )
                model.__class__ = subclass
            except TypeError as exc:
                raise TypeError(
                    f"watch_model needs an instance of a Python class (an nn.Module), got "
                    f"{type(model).__name__} ({exc}); wrap a bare function with watch_step"
                ) from None
    if watchdog.name_is_default:
        watchdog.name = _model_name(model)
    if not watchdog.parameter_buffers:
        watchdog.count_parameters(model)
    return state


def unwatch_model(model):
    """Give the model its original class back. Returns the model."""
    with _attach_lock:
        state = watched_state(model)
        if state is not None:
            model.__class__ = state.original_class
            state.last_output = None
    return model


def _reduce_unwatched(self, protocol):
    # Pickles (and deep copies) see the original class: a copy is not watched.
    state: _ModelState = type(self).__dict__[_STATE]
    cls = self.__class__
    try:
        self.__class__ = state.original_class
        reduced = self.__reduce_ex__(protocol)
    finally:
        self.__class__ = cls
    if isinstance(reduced, tuple) and reduced and reduced[0] in _NEWOBJ:
        # pickle refuses a __newobj__ whose class is not type(self) (the watching subclass);
        # the same call through a partial is not checked and still names only the original class.
        reduced = (functools.partial(reduced[0], *reduced[1]), ()) + tuple(reduced[2:])
    return reduced


def _model_name(model) -> str:
    args = getattr(model, "args", None)
    name = getattr(args, "model_type", None) or getattr(model, "model_type", None)
    return str(name) if name else type(model).__name__


class Watching:
    """Watch a model for the duration of a block; restore what was there before.

    Blocks may overlap (two threads calling the same decorated function on one model): the
    model is given back only when the last block using this watchdog ends."""

    def __init__(self, model, watchdog: Watchdog):
        self.model, self.watchdog = model, watchdog

    def __enter__(self):
        with _attach_lock:
            state = watched_state(self.model)
            before = state.watchdog if state is not None else None
            blocks = state.blocks if state is not None else []
            state = _watch(self.model, self.watchdog)
            if not blocks:
                state.restore_to = before
            for block in blocks:
                if block.watchdog is self.watchdog:
                    block.count += 1
                    break
            else:
                blocks.append(_Block(self.watchdog))
            state.blocks = blocks
        return self.model

    def __exit__(self, *exc):
        with _attach_lock:
            state = watched_state(self.model)
            if state is None:
                return False
            for block in state.blocks:
                if block.watchdog is self.watchdog:
                    block.count -= 1
                    if block.count == 0:
                        state.blocks.remove(block)
                        self.watchdog.generation_ended()  # its last call returned: nothing steps
                    break
            if state.blocks:  # blocks still open: the most recent one's watchdog watches
                _watch(self.model, state.blocks[-1].watchdog)
            elif state.restore_to is None:
                unwatch_model(self.model)
            else:
                _watch(self.model, state.restore_to)
        return False
