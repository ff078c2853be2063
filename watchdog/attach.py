"""Attachment points: decide *when* ``Watchdog.observe`` runs and *what* the roots are.

* ``watch_model(model)``: every ``model(inputs, cache=...)`` call is observed, whoever makes it
  (``generate_step``, ``BatchGenerator``, speculative decoding, a custom loop).
* ``@watch(...)``: a generate function with mlx-lm's calling convention, for one call.
* ``watch_step(fn, cache=...)``: a bare step function.

Like OpenTelemetry's instrumentors, attaching and detaching are symmetric and mlx-lm's classes
are left untouched: ``watch_model`` gives the *instance* a subclass of its own class whose
``__call__`` observes first, and ``unwatch_model`` gives the original class back. The watchdog
lives on that subclass, not in the model (an ``nn.Module`` is a dict: attributes set on it
would become parameters).
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import threading
from typing import Any, Callable, Optional

from .core import Watchdog

_STATE = "_mlx_watchdog_state"
_attach_lock = threading.RLock()


class _ModelState:
    """What a watched model carries on its per-instance subclass."""

    def __init__(self, watchdog: Watchdog, original_class: type):
        self.watchdog = watchdog
        self.original_class = original_class
        self.last_output: Any = None
        self.prefill_hooks: list[Callable] = []  # fn(watchdog, inputs, output) after a multi-token forward
        self.prefill_cache: Any = None  # the forward's cache, set only while the prefill hooks run
        self.blocks: list = []  # open @watch calls: [watchdog, count], oldest first (threads may overlap)
        self.restore_to: Optional[Watchdog] = None  # the watchdog found before the first of them


def _observed_call(self, *args, **kwargs):
    state: _ModelState = type(self).__dict__[_STATE]
    watchdog = state.watchdog
    inputs = args[0] if args else kwargs.get("inputs")
    cache = kwargs["cache"] if "cache" in kwargs else (args[1] if len(args) > 1 else None)
    if cache is not None:
        last, state.last_output = state.last_output, None  # hold the output for one step only
        watchdog.observe(cache, last_output=last, prefill=_tokens(inputs) > 1)
        del last
    output = state.original_class.__call__(self, *args, **kwargs)
    if cache is not None:
        # Only the fix reads it (it waits until the program has evaluated its last output); held
        # otherwise, a prefill chunk's logits (tokens x vocabulary) would stay alive a step longer.
        state.last_output = output if watchdog.fix else None
        if state.prefill_hooks and _tokens(inputs) > 1:
            state.prefill_cache = cache  # hooks may walk the cache too; not held past this call
            try:
                for hook in state.prefill_hooks:
                    hook(watchdog, inputs, output)
            finally:
                state.prefill_cache = None
    return output


def _tokens(inputs: Any) -> int:
    shape = getattr(inputs, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) >= 2 else 1


def _watchdog_from(watchdog: Optional[Watchdog], options: dict) -> Watchdog:
    """The given watchdog, or a new one built from Watchdog options (never both)."""
    if watchdog is not None and options:
        raise ValueError("pass either watchdog= or Watchdog options, not both")
    return watchdog if watchdog is not None else Watchdog(**options)


def watched_state(model: Any) -> Optional[_ModelState]:
    return type(model).__dict__.get(_STATE)


def watch_model(model, watchdog: Optional[Watchdog] = None, **options):
    """Observe every forward pass of ``model`` that is given a cache. Returns the same model
    object, still an instance of its class. ``options`` create a :class:`Watchdog` when none
    is given. Watching an already watched model swaps its watchdog."""
    watchdog = _watchdog_from(watchdog, options)
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
                subclass = type(original.__name__, (original,), {
                    "__slots__": (),  # same memory layout, so classes with __slots__ work too
                    "__call__": _observed_call,
                    _STATE: state,
                    "__module__": original.__module__,
                    "__qualname__": original.__qualname__,
                    "__reduce_ex__": _reduce_unwatched,
                })
                model.__class__ = subclass
            except TypeError as exc:
                raise TypeError(
                    f"watch_model needs an instance of a Python class (an nn.Module), got "
                    f"{type(model).__name__} ({exc}); wrap a bare function with watch_step") from None
    if watchdog.name_is_default:
        watchdog.name = _model_name(model)
        watchdog.name_is_default = False
    if not watchdog._parameter_buffers:
        watchdog.count_parameters(model)
    return model


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
    if isinstance(reduced, tuple) and reduced and reduced[0] in (copyreg.__newobj__, copyreg.__newobj_ex__):
        # pickle refuses a __newobj__ whose class is not type(self) (the watching subclass);
        # the same call through a partial is not checked and still names only the original class.
        reduced = (functools.partial(reduced[0], *reduced[1]), ()) + tuple(reduced[2:])
    return reduced


def _model_name(model) -> str:
    args = getattr(model, "args", None)
    name = getattr(args, "model_type", None) or getattr(model, "model_type", None)
    return str(name) if name else type(model).__name__


def watch_step(fn: Callable, cache: Any, watchdog: Optional[Watchdog] = None, **options) -> Callable:
    """Wrap a bare step function: each call observes ``cache`` first."""
    watchdog = _watchdog_from(watchdog, options)
    if not callable(fn):
        raise TypeError(f"watch_step needs a callable, got {fn!r}")
    last: list[Any] = [None]

    @functools.wraps(fn)
    def step(*args, **kwargs):
        previous, last[0] = last[0], None
        watchdog.observe(cache, last_output=previous)
        result = fn(*args, **kwargs)
        last[0] = result
        return result

    step.watchdog = watchdog
    return step


def watch(fn: Optional[Callable] = None, *, watchdog: Optional[Watchdog] = None,
          metrics_port: Optional[int] = None, metrics_addr: str = "127.0.0.1", **options):
    """Decorator for generate functions with mlx-lm's convention
    ``fn(model, tokenizer, prompt, ..., prompt_cache=None, ...)``.

    Every forward pass of the call is observed. When the caller passes no ``prompt_cache`` and
    the function accepts one, the cache is built here with the model's own rules
    (``make_prompt_cache``), so the watchdog sees it from the first step. Works for plain
    functions and generators (the watchdog steps as items are consumed and detaches when the
    generator is closed). ``watchdog=`` shares one watchdog; otherwise one is created from
    ``options`` for the decorated function. ``metrics_port`` starts the metrics server once."""
    if fn is None:
        # Bad options fail here, at @watch(...), not later when a function is decorated.
        if watchdog is None:
            Watchdog(**{**options, "export": False})  # a throw-away, to check the options
        else:
            _watchdog_from(watchdog, options)
        return functools.partial(watch, watchdog=watchdog, metrics_port=metrics_port,
                                 metrics_addr=metrics_addr, **options)
    watchdog = _watchdog_from(watchdog, options)
    metrics_server = None
    if metrics_port is not None:
        from .exporters.prometheus import start_metrics_server

        metrics_server = start_metrics_server(metrics_port, addr=metrics_addr)
    signature = inspect.signature(fn)
    var_keyword = next((p.name for p in signature.parameters.values()
                        if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    takes_cache = "prompt_cache" in signature.parameters or var_keyword is not None

    def prepare(args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        # Options passed on through **kwargs (generate -> stream_generate) are given too.
        given = {**bound.arguments.get(var_keyword, {}), **bound.arguments} if var_keyword else bound.arguments
        model = given.get("model", args[0] if args else None)
        if model is None:
            raise TypeError(f"{fn.__name__}() was called without a model")
        if takes_cache and given.get("prompt_cache") is None and hasattr(model, "layers"):
            from mlx_lm.models.cache import make_prompt_cache

            draft = given.get("draft_model")
            if draft is not None:
                # Speculative decoding takes one list: the model's caches, then the draft's.
                cache = make_prompt_cache(model) + make_prompt_cache(draft)
            else:
                cache = make_prompt_cache(model, max_kv_size=given.get("max_kv_size"))
            if "prompt_cache" in signature.parameters:
                bound.arguments["prompt_cache"] = cache
            else:
                bound.arguments[var_keyword] = {**bound.arguments.get(var_keyword, {}), "prompt_cache": cache}
            return model, bound.args, bound.kwargs
        return model, args, kwargs

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def generator_wrapper(*args, **kwargs):
            model, args, kwargs = prepare(args, kwargs)
            with _Watching(model, watchdog):
                yield from fn(*args, **kwargs)

        generator_wrapper.watchdog = watchdog
        generator_wrapper.metrics_server = metrics_server  # its .port, when port 0 picked one
        return generator_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        model, args, kwargs = prepare(args, kwargs)
        with _Watching(model, watchdog):
            return fn(*args, **kwargs)

    wrapper.watchdog = watchdog
    wrapper.metrics_server = metrics_server
    return wrapper


class _Watching:
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
            watch_model(self.model, self.watchdog)
            state = watched_state(self.model)
            if not blocks:
                state.restore_to = before
            for entry in blocks:
                if entry[0] is self.watchdog:
                    entry[1] += 1
                    break
            else:
                blocks.append([self.watchdog, 1])
            state.blocks = blocks
        return self.model

    def __exit__(self, *exc):
        with _attach_lock:
            state = watched_state(self.model)
            if state is None:
                return False
            for entry in state.blocks:
                if entry[0] is self.watchdog:
                    entry[1] -= 1
                    if entry[1] == 0:
                        state.blocks.remove(entry)
                        self.watchdog.generation_ended()  # its last call returned: nothing steps
                    break
            if state.blocks:  # blocks still open: the most recent one's watchdog watches
                watch_model(self.model, state.blocks[-1][0])
            elif state.restore_to is None:
                unwatch_model(self.model)
            else:
                watch_model(self.model, state.restore_to)
        return False


