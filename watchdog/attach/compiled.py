"""``instrument()``: every function compiled with ``mx.compile`` from then on is counted: the
traces MLX runs, the input signatures its cache keeps an entry for, and the buffers those
entries hold (``mlx_watchdog.core.compiled``). A function fed many signatures is a leak site
named after it (``compiled:mlx_lm.tuner.trainer.step``) in every watchdog of the process.

    from mlx_watchdog.attach import compiled

    compiled.instrument()            # before the program compiles (mlx-watchdog run: at start)
    step = mx.compile(step_fn)       # counted
    compiled.uninstrument()          # mx.compile is the function it was before

Like ``distributed.instrument()``, it wraps functions of ``mlx.core`` and unwraps them again,
exactly: ``mx.compile``, plus ``mx.disable_compile``/``mx.enable_compile`` (whether MLX caches
at all) and the transforms ``mx.grad``, ``mx.value_and_grad``, ``mx.vmap``, ``mx.vjp``,
``mx.jvp`` (inside them, and inside another compiled function's trace, MLX calls a compiled
function's Python code directly, keeping no entry: those calls are no trace). Importing this
module patches nothing; while ``mlx.core`` is not imported yet, ``instrument()`` waits for the
program to import it (an import hook) and patches it right after it executes.

What a compiled function becomes: ``mx.compile`` gets a wrapper of the function that records each
trace and its signature (it runs only when MLX traces: nothing per call), and the program gets a
wrapper of the compiled function that calls it. That one costs an attribute test per call,
except on the calls it watches: those whose trace it measures (the first few, then one in each
doubling of the traces: the arguments' signature is computed on such calls, and their inputs
listed, until the trace comes), and the calls of a training step (``training.py`` observes there).
A function compiled while instrumented is counted until it dies, after ``uninstrument()`` too.

Two ``mx.compile`` calls on the same Python function share MLX's cache (it is keyed by the
function); instrumented, each has its own (each wraps the function anew). Outputs are the same;
such a function may be traced once more per signature.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from ..core import compiled as registry
from ..core.compiled import CompiledFunction, argument_signature, captured_signature, flat_arrays
from .imports import PostImportHook

logger = logging.getLogger("mlx_watchdog")

MODULE = "mlx.core"
ARMED_CALLS = 64  # calls of known signatures after which a function stops looking for a trace to measure
MAX_NAME = 72  # characters of a function's name in its site (a Prometheus label)

_lock = threading.RLock()
_active = False
_import_hook: PostImportHook | None = None
_wrapped: dict[str, tuple[Any, Callable]] = {}  # name in mlx.core -> (as found, our wrapper)
_module: types.ModuleType | None = None
_local = threading.local()  # .depth > 0: inside a trace or a transform on this thread
_compile_enabled = True
_compile_hooks: list[Callable] = []
_calls_of: weakref.WeakKeyDictionary[Callable, _Calls] = weakref.WeakKeyDictionary()


class CallHook(Protocol):
    """Runs around each call of one compiled function (a training step: ``training.py``)."""

    def before(self) -> None:
        """Before the call; may raise to stop the program's loop."""
        ...

    def after(self, result: Any) -> None:
        """After the call returned ``result``."""
        ...

    def ended(self) -> None:
        """The compiled function died."""
        ...


# --------------------------------------------------------------------------- on and off


def instrument() -> bool:
    """Count every function compiled with ``mx.compile`` from now on (see the module docstring).
    Idempotent; returns whether this call instrumented."""
    global _active, _import_hook
    with _lock:
        if _active:
            return False
        _active = True
        module = sys.modules.get(MODULE)
        if module is not None:
            _patch(module)
        else:
            _import_hook = PostImportHook({MODULE}, _patch)
            _import_hook.install()
        return True


def uninstrument() -> None:
    """Undo :func:`instrument`: every function it wrapped is the one it found again (one wrapped
    again since by someone else is left as it is, with a warning), and the import hook is gone.
    A no-op when not instrumented."""
    global _active, _import_hook, _module
    with _lock:
        if not _active:
            return
        _active = False
        if _import_hook is not None:
            _import_hook.remove()
            _import_hook = None
        module, _module = _module, None
        wrapped = dict(_wrapped)
        _wrapped.clear()
        if module is None:
            return
        for name, (original, ours) in wrapped.items():
            if module.__dict__.get(name) is ours:
                setattr(module, name, original)
            else:
                logger.warning(
                    "mlx-watchdog: mx.%s was wrapped again after instrument(); left as it is", name
                )


def instrumented() -> bool:
    """Is :func:`instrument` in effect?"""
    return _active


def compiled_function(fn: Any) -> CompiledFunction | None:
    """The record of a function compiled while instrumented (what ``mx.compile`` returned), or None."""
    try:
        calls = _calls_of.get(fn)
    except TypeError:
        return None
    return calls.function if calls is not None else None


def add_compile_hook(hook: Callable[..., CallHook | None]) -> None:
    """``hook(fun, inputs, outputs)`` runs at each ``mx.compile`` while instrumented, with its
    arguments; a :class:`CallHook` it returns runs around each call of the compiled function."""
    with _lock:
        if hook not in _compile_hooks:
            _compile_hooks.append(hook)


def remove_compile_hook(hook: Callable[..., CallHook | None]) -> None:
    with _lock:
        while hook in _compile_hooks:
            _compile_hooks.remove(hook)


def _patch(module: types.ModuleType) -> None:
    """Wrap the functions of ``mlx.core`` (imported just now, or already)."""
    global _module, _compile_enabled
    with _lock:
        if not _active or _module is not None:
            return
        _module = module
        _compile_enabled = "MLX_DISABLE_COMPILE" not in os.environ  # MLX reads it as set or not
        factories: dict[str, Callable[[Any], Callable]] = {
            "compile": _compile_wrapper,
            "disable_compile": functools.partial(_mode_wrapper, enabled=False),
            "enable_compile": functools.partial(_mode_wrapper, enabled=True),
            "grad": _transform_wrapper,
            "value_and_grad": _transform_wrapper,
            "vmap": _transform_wrapper,
            "vjp": _tracing_wrapper,
            "jvp": _tracing_wrapper,
        }
        for name, factory in factories.items():
            original = module.__dict__.get(name)
            if callable(original):
                ours = factory(original)
                setattr(module, name, ours)
                _wrapped[name] = (original, ours)


# --------------------------------------------------------------------------- the wrappers


def _compile_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile(fun, inputs=None, outputs=None, shapeless=False):
        if not callable(fun) or not _active:
            return original(fun, inputs=inputs, outputs=outputs, shapeless=shapeless)
        try:
            calls = _Calls(CompiledFunction(function_name(fun), bool(shapeless)), inputs, outputs)
            traced = _traced(fun, calls)
        except Exception as exc:  # the program's compile as it would be
            logger.warning("mlx-watchdog: a compiled function is not counted: %r", exc)
            return original(fun, inputs=inputs, outputs=outputs, shapeless=shapeless)
        compiled = original(traced, inputs=inputs, outputs=outputs, shapeless=shapeless)
        call = _caller(compiled, calls)
        try:
            functools.update_wrapper(call, fun)
        except Exception:
            pass
        try:
            _calls_of[call] = calls
            registry.register(calls.function)
            weakref.finalize(call, _died, calls).atexit = False
            for hook in list(_compile_hooks):
                installed = hook(fun, inputs, outputs)
                if installed is not None:
                    calls.hook = installed
                    calls.update()
                    break
        except Exception as exc:
            calls.function.errors += 1
            logger.warning("mlx-watchdog: %s is counted, not watched: %r", calls.function.name, exc)
        return call

    return compile


def _traced(fun: Callable, calls: _Calls) -> Callable:
    """What MLX calls when it traces: the program's function, and the trace recorded."""

    def traced(*args, **kwargs):
        if getattr(_local, "replaying", False):
            raise _Refused  # a measurement's replay missed the cache: the program's code does not run
        depth = getattr(_local, "depth", 0)
        # Inside another trace or a transform MLX calls the function directly, keeping no entry.
        # The signature is MLX's: read before the function runs (it may add captured arrays,
        # an optimizer's state on its first update).
        signature = calls.signature(args, kwargs) if depth == 0 and _compile_enabled else None
        _local.depth = depth + 1
        try:
            result = fun(*args, **kwargs)
        finally:
            _local.depth = depth
        if signature is not None:
            try:
                calls.traced(signature)
            except Exception as exc:
                logger.debug("mlx-watchdog: a trace of %s is not counted: %r", calls.function.name, exc)
        return result

    return traced


def _caller(compiled: Callable, calls: _Calls) -> Callable:
    """What the program gets from ``mx.compile``."""

    def call(*args, **kwargs):
        if calls.slow:
            return calls.call(compiled, args, kwargs)
        return compiled(*args, **kwargs)

    return call


def _mode_wrapper(original: Callable, enabled: bool) -> Callable:
    @functools.wraps(original)
    def mode(*args, **kwargs):
        global _compile_enabled
        result = original(*args, **kwargs)
        _compile_enabled = enabled
        return result

    return mode


def _transform_wrapper(original: Callable) -> Callable:
    """``mx.grad`` and kin: the function they return runs marked as a transform."""

    @functools.wraps(original)
    def transform(*args, **kwargs):
        transformed = original(*args, **kwargs)

        def run(*a, **k):
            depth = getattr(_local, "depth", 0)
            _local.depth = depth + 1
            try:
                return transformed(*a, **k)
            finally:
                _local.depth = depth

        try:
            functools.update_wrapper(run, transformed)
        except Exception:
            pass
        return run

    return transform


def _tracing_wrapper(original: Callable) -> Callable:
    """``mx.vjp``, ``mx.jvp``: they run the function now, as a transform."""

    @functools.wraps(original)
    def tracing(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            return original(*args, **kwargs)
        finally:
            _local.depth = depth

    return tracing


def _died(calls: _Calls) -> None:
    registry.unregister(calls.function)
    hook, calls.hook = calls.hook, None
    if hook is not None:
        try:
            hook.ended()
        except Exception as exc:
            logger.debug("mlx-watchdog: %s ended: %r", calls.function.name, exc)


class _Calls:
    """One compiled function's calls: whether a call takes the slow path (a trace to measure, a
    hook to run), and that path."""

    __slots__ = ("function", "inputs", "outputs", "slow", "armed", "idle", "hook")

    def __init__(self, function: CompiledFunction, inputs: Any, outputs: Any):
        self.function = function
        self.inputs = inputs  # the captured trees (mx.compile's inputs= and outputs=)
        self.outputs = outputs
        self.armed = True  # the next trace is to be measured
        self.idle = 0  # calls since armed that could not trace
        self.hook: CallHook | None = None
        self.slow = True

    def update(self) -> None:
        self.slow = self.armed or self.hook is not None

    def signature(self, args: tuple, kwargs: dict) -> tuple[tuple, int] | None:
        """A trace's signature: its arguments' (MLX's tracers, shaped as the call's arrays) and
        its captured arrays'."""
        function = self.function
        try:
            arguments = argument_signature(args, kwargs, function.shapeless)
            return arguments, captured_signature(self.inputs, function.shapeless)
        except Exception as exc:
            self._error("trace", exc)
            return None

    def traced(self, signature: tuple[tuple, int]) -> None:
        """A trace that went through: a cache entry for ``signature``."""
        if self.function.traced(*signature) and not self.armed:
            self.armed, self.idle = True, 0
            self.update()

    def call(self, compiled: Callable, args: tuple, kwargs: dict) -> Any:
        hook = self.hook
        if hook is not None:
            hook.before()  # a stop raises here, before the step runs
        inputs = self._inputs(args, kwargs) if self.armed else None
        function = self.function
        traces = function.traces
        result = compiled(*args, **kwargs)
        if inputs is not None and function.traces != traces:
            self._measure(compiled, inputs, args, kwargs, result)
        if hook is not None:
            hook.after(result)
        return result

    def _inputs(self, args: tuple, kwargs: dict) -> list | None:
        """The arrays a call that will trace reads (its arguments, the captured inputs); None
        when it will not trace (a known signature, inside a trace or a transform)."""
        if getattr(_local, "depth", 0) or not _compile_enabled:
            return None
        function = self.function
        try:
            if function.knows(argument_signature(args, kwargs, function.shapeless)):
                self.idle += 1
                if self.idle >= ARMED_CALLS:  # it keeps its signatures: stop looking (a new trace re-arms)
                    self.armed = False
                    self.update()
                return None
            if self.outputs is None:
                return []  # measured on a replay of its own (_replay)
            # Lazy arguments are walked too (a batch sliced or drawn for the step: small graphs);
            # a lazy captured state would be the previous step's whole graph: not measured then.
            captured = flat_arrays(self.inputs)
            if not all(_evaluated(a) for a in captured):
                return None
            return flat_arrays(args) + flat_arrays(kwargs) + captured
        except Exception as exc:
            self._error("inputs", exc)
            return None

    def _measure(self, compiled: Callable, inputs: list, args: tuple, kwargs: dict, result: Any) -> None:
        """The buffers of the entry the call just made. With captured outputs (a training step,
        its captured state evaluated), from the call's own outputs; else from a replay of the entry on
        placeholder inputs: arguments that are lazy would make the walk cover their graphs (a
        forward pass, when a model calls a compiled helper), and the replay's are a node each."""
        function = self.function
        try:
            if self.outputs is not None:
                buffers = registry.measure_entry(inputs, flat_arrays(result) + flat_arrays(self.outputs))
            else:
                buffers = self._replay(compiled, args, kwargs)
            if buffers is not None:
                function.measured(buffers)
        except Exception as exc:
            self._error("measure", exc)
        finally:
            self.armed, self.idle = function.wants_measure(), 0
            self.update()

    def _replay(self, compiled: Callable, args: tuple, kwargs: dict) -> int | None:
        """The entry's constants, counted on a second call with placeholders (``mx.zeros`` of the
        same shapes and dtypes, the other arguments as they were): the same signature, so MLX
        replays the entry it just made and calls no Python code. Should it trace all the same,
        the trace is refused before the program's function runs. Nothing is evaluated."""
        module = _module
        if module is None:
            return None
        placeholders: list = []
        dummy_args = _placeholders(args, module, placeholders)
        dummy_kwargs = _placeholders(kwargs, module, placeholders)
        traces = self.function.traces
        _local.replaying = True
        try:
            outputs = compiled(*dummy_args, **dummy_kwargs)
        except _Refused:
            return None
        finally:
            _local.replaying = False
        if self.function.traces != traces:
            return None
        captured = flat_arrays(self.inputs) if self.inputs is not None else []
        return registry.measure_entry(placeholders + captured, flat_arrays(outputs))

    def _error(self, where: str, exc: Exception) -> None:
        self.function.errors += 1
        if self.function.errors <= 1:
            logger.warning("mlx-watchdog: counting %s (%s) failed: %r", self.function.name, where, exc)


class _Refused(Exception):
    """A replay that would have traced: refused before the program's function runs."""


def _evaluated(array: Any) -> bool:
    """Does the array hold its buffer (evaluated)? O(1): MLX refuses a lazy one at once."""
    module = _module
    try:
        module.get_array_buffer_size(array)  # type: ignore[union-attr]
        return True
    except Exception:
        return False


def _placeholders(tree: Any, module: types.ModuleType, made: list) -> Any:
    """``tree`` with each array replaced by ``zeros`` of its shape and dtype (added to ``made``);
    lists, tuples and dicts rebuilt, every other value as it was."""
    if isinstance(tree, module.array):
        zeros = module.zeros(tuple(tree.shape), dtype=tree.dtype)
        made.append(zeros)
        return zeros
    if isinstance(tree, (list, tuple)):
        items = [
            _placeholders(item, module, made)
            for item in (list(tree) if isinstance(tree, list) else tuple.__iter__(tree))
        ]
        return items if isinstance(tree, list) else tuple(items)
    if isinstance(tree, dict):
        return {key: _placeholders(value, module, made) for key, value in dict.items(tree)}
    return tree


# --------------------------------------------------------------------------- names


def function_name(fun: Any) -> str:
    """``module.function`` of what is compiled: ``mlx_lm.tuner.trainer.step`` for the function
    ``step`` that ``train()`` defines; a method keeps its class (``Model.decode``), a partial and
    a callable object are named after what they call."""
    target = fun
    for _ in range(8):
        if isinstance(target, functools.partial):
            target = target.func
        elif isinstance(target, types.MethodType):
            target = target.__func__
        else:
            break
    if not isinstance(target, (types.FunctionType, types.BuiltinFunctionType)):
        target = type(target)
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or "?"
    if not isinstance(module, str) or not isinstance(qualname, str):
        return "?"
    qualname = qualname.rsplit("<locals>.", 1)[-1]
    name = f"{module}.{qualname}"
    return name if len(name) <= MAX_NAME else "..." + name[-(MAX_NAME - 3) :]
