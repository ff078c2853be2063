"""mlx_lm.server, watched: every model it loads gets a watchdog, and a stop ends the running
requests cleanly while the server goes on (``mlx-watchdog serve`` runs it; ``ServerHooks`` is the
same in code).

How it attaches (mlx-lm is not edited; :class:`ServerHooks` installs three class-level wrappers
and puts the originals back on exit):

* ``ModelProvider._load``: after mlx-lm loads a model (plain, sharded or draft), the model gets
  its own :class:`~mlx_watchdog.Watchdog` through ``watch_model``; a model the provider
  drops has its watchdog retired (no longer exported).
* ``ResponseGenerator._next_request``: each request the generation thread takes is handed on
  with a :class:`_Channel` in place of its response queue. The channel forwards everything and
  remembers whether the request started streaming and whether it ended.
* ``ResponseGenerator._generate`` (the worker thread's loop): when the watchdog raises
  :class:`~mlx_watchdog.ResourceLimitForecast` from a forward pass, the exception leaves
  mlx-lm's loop (which has no handler for it and would let the thread die). The wrapper ends every
  started request with a final chunk whose ``finish_reason`` is ``"resource_limit"``, puts the
  requests that had not started back in the queue, drops the stopped batch and its caches, and
  runs the loop again: later requests are served on a fresh batch. When the loop ends, the
  thread's MLX state is freed (``mx.clear_streams()``) and ``detach`` waits for the thread's exit
  (see :func:`wait_for_thread_exit`).

The non-batched path (``_serve_single``: seeds, ``--kv-bits``, draft models, images) catches
exceptions itself and puts them on the response queue; the channel turns a stop found there into
the same final chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import logging
import os
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..core.actions import ResourceLimitForecast
from ..core.live import retire
from ..core.watchdog import Watchdog
from . import distributed, prefill
from .model import check_options, unwatch_model, watch_model, watched_state

logger = logging.getLogger("mlx_watchdog")

# The finish_reason of a completion the watchdog cut short (OpenAI clients pass unknown values on).
STOP_FINISH_REASON = "resource_limit"

# Where mlx_lm.server is hooked: (class name, method name).
_HOOK_POINTS = (
    ("ModelProvider", "_load"),
    ("ResponseGenerator", "_next_request"),
    ("ResponseGenerator", "_generate"),
)


# --------------------------------------------------------------------------- the response channel


class _Channel:
    """Stands in for one request's response queue on the generation thread.

    Forwards every ``put`` to the queue the HTTP handler reads, and remembers whether the request
    started (its ``GenerationContext`` went out: the client has a 200 and maybe a stream) and
    whether it ended (``None`` or an error went out). A :class:`ResourceLimitForecast` put here
    (mlx-lm's non-batched path does that with any exception) becomes the watchdog's final chunk.
    """

    def __init__(self, hooks: ServerHooks, queue: Any, item: tuple):
        self._hooks = hooks
        self.queue = queue
        self.item = item  # what the generation thread took, to put back when not started
        self.context: Any = None
        self.finished = False
        self.last: Any = None  # the last Response sent (its token and, on mlx-lm 0.31, its state)
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self.context is not None

    @property
    def abandoned(self) -> bool:
        # mlx-lm's handler sets _should_stop when it stops reading (client gone, or done).
        return bool(getattr(self.context, "_should_stop", False))

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(obj, ResourceLimitForecast):
            self._hooks._stopped([self], obj)  # noqa: SLF001 (this module's class)
            return
        with self._lock:
            if obj is None or isinstance(obj, BaseException):
                self.finished = True
            elif isinstance(obj, self._hooks.server.GenerationContext):
                self.context = obj
            elif isinstance(obj, self._hooks.server.Response):
                self.last = obj
        self.queue.put(obj, block, timeout)

    def stop(self, exc: ResourceLimitForecast) -> bool:
        """End the request because of ``exc``. Returns whether anything was sent."""
        with self._lock:
            if self.finished:
                return False
            self.finished = True
            started = self.started
        if started:
            # A last chunk with no text and the watchdog's finish_reason, then the end of stream.
            final = stop_response(self._hooks.server.Response, self.last)
            self.queue.put(final)
            self.queue.put(None)
        else:  # the handler answers with {"error": ...}
            self.queue.put(RuntimeError(str(exc)))
        return True


# --------------------------------------------------------------------------- the hooks


class ServerHooks:
    """Attach the watchdog to ``mlx_lm.server`` (see the module docstring) and detach it again.

    ``options`` are the ``Watchdog`` keyword options every loaded model's watchdog gets. Use as a
    context manager, or ``attach()`` / ``detach()``. Attaching also instruments
    ``mx.distributed`` (``distributed.instrument()``: a server launched on several ranks stops
    them together); detaching restores the exact original functions, unwatches the models still
    alive and stops exporting their watchdogs."""

    def __init__(
        self, options: dict | None = None, *, adapt_prefill: bool = False, server_module: Any = None
    ):
        self.options = dict(options or {})
        check_options(self.options)  # now, not at the first load
        self.adapt_prefill = bool(adapt_prefill)
        self.server = server_module if server_module is not None else importlib.import_module("mlx_lm.server")
        for cls_name, method in _HOOK_POINTS:
            cls = getattr(self.server, cls_name, None)
            if cls is None or not callable(cls.__dict__.get(method)):
                raise RuntimeError(
                    f"mlx_lm.server has no {cls_name}.{method}: this mlx-lm version is "
                    "not supported by `mlx-watchdog serve`"
                )
        for name in ("GenerationContext", "Response"):
            if not isinstance(getattr(self.server, name, None), type):
                raise RuntimeError(
                    f"mlx_lm.server has no {name} class: this mlx-lm version is not "
                    "supported by `mlx-watchdog serve`"
                )
        stop_response(self.server.Response, None)  # a Response this version cannot take fails now
        self._lock = threading.Lock()
        self._originals: dict[tuple[str, str], Callable] = {}
        self._watched: list[tuple[weakref.ref, Watchdog]] = []
        self._channels: dict[int, list[_Channel]] = {}  # id(ResponseGenerator) -> its requests
        self._user_prefill_step: dict[int, int] = {}
        self._instrumented = False  # this attach instrumented mx.distributed (detach undoes it)
        self._ended_threads: list[int] = []  # native ids of generation threads whose loop ended

    # ------------------------------------------------------------------ attach / detach

    @property
    def attached(self) -> bool:
        return bool(self._originals)

    def attach(self) -> ServerHooks:
        with self._lock:
            if self._originals:
                raise RuntimeError("these hooks are already attached")
            wrappers = {
                ("ModelProvider", "_load"): self._wrap_load,
                ("ResponseGenerator", "_next_request"): self._wrap_next_request,
                ("ResponseGenerator", "_generate"): self._wrap_generate,
            }
            for (cls_name, method), wrap in wrappers.items():
                cls = getattr(self.server, cls_name)
                original = cls.__dict__[method]
                self._originals[(cls_name, method)] = original
                setattr(cls, method, wrap(original))
            # A server launched on several ranks (mlx.launch): their watchdogs stop together.
            self._instrumented = distributed.instrument()
        return self

    def detach(self) -> None:
        with self._lock:
            originals, self._originals = self._originals, {}
            for (cls_name, method), original in originals.items():
                setattr(getattr(self.server, cls_name), method, original)
            if self._instrumented:
                self._instrumented = False
                distributed.uninstrument()
            watched, self._watched = self._watched, []
            self._channels.clear()
            ended, self._ended_threads = self._ended_threads, []
        for ref, watchdog in watched:
            self._retire(ref(), watchdog)
        if ended and not wait_for_thread_exit(ended, THREAD_EXIT_SECONDS):
            logger.debug(
                "mlx-watchdog serve: a generation thread had not exited after %s s", THREAD_EXIT_SECONDS
            )

    def __enter__(self) -> ServerHooks:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def watchdogs(self) -> list[Watchdog]:
        """The watchdogs of the models loaded and still held."""
        with self._lock:
            return [wd for ref, wd in self._watched if ref() is not None]

    # ------------------------------------------------------------------ wrappers

    def _wrap_load(self, original: Callable) -> Callable:
        hooks = self

        @functools.wraps(original)
        def _load(provider, model_path, adapter_path=None, draft_model_path=None):
            previous = [m for m in (provider.model, provider.draft_model) if m is not None]
            try:
                return original(provider, model_path, adapter_path, draft_model_path)
            finally:
                current = [provider.model, provider.draft_model]
                hooks._retire_models([m for m in previous if not any(m is c for c in current)])
                name = _model_label(model_path)
                for model, label in ((provider.model, name), (provider.draft_model, f"{name}:draft")):
                    if model is not None and watched_state(model) is None:
                        hooks._watch(model, label, provider)

        return _load

    def _wrap_next_request(self, original: Callable) -> Callable:
        hooks = self

        @functools.wraps(original)
        def _next_request(generator, timeout=None):
            item = original(generator, timeout)
            if item is None:
                if timeout is not None:  # mlx-lm waits for a request only when no batch has work
                    hooks._idle()
                return None
            channel = _Channel(hooks, item[0], tuple(item))
            hooks._track(generator, channel)
            return (channel, *item[1:])

        return _next_request

    def _wrap_generate(self, original: Callable) -> Callable:
        hooks = self

        @functools.wraps(original)
        def _generate(generator):
            try:
                while True:
                    try:
                        return original(generator)
                    except ResourceLimitForecast as exc:
                        hooks._after_batch_stop(generator, exc)
                        del exc
                        # mlx-lm's loop again: the model is loaded already, the next request gets a new batch.
            finally:
                # Free this thread's MLX state while it holds the GIL (see _clear_thread_streams),
                # then let detach() wait for the thread's own exit.
                _clear_thread_streams()
                hooks._generation_ended(threading.get_native_id())

        return _generate

    # ------------------------------------------------------------------ models

    def _watch(self, model: Any, name: str, provider: Any) -> None:
        watchdog = Watchdog(**self.options, name=name)
        watch_model(model, watchdog)
        with self._lock:
            self._watched = [(r, wd) for r, wd in self._watched if r() is not None]
            self._watched.append((weakref.ref(model), watchdog))
        logger.info(
            "mlx-watchdog: watching %s (limit %d buffers, fix=%s, stop_within=%s)",
            name,
            watchdog.limit,
            watchdog.fix,
            watchdog.stop_within,
        )
        if self.adapt_prefill:
            self._install_prefill(watchdog, model, provider)

    def _retire_models(self, models: list) -> None:
        with self._lock:
            keep: list[tuple[weakref.ref, Watchdog]] = []
            gone: list[tuple[weakref.ref, Watchdog]] = []
            for ref, wd in self._watched:
                model = ref()
                (gone if model is None or any(model is m for m in models) else keep).append((ref, wd))
            self._watched = keep
        for ref, wd in gone:
            self._retire(ref(), wd)

    @staticmethod
    def _retire(model: Any, watchdog: Watchdog) -> None:
        retire(watchdog)  # its series leave /metrics: the model is gone
        state = watched_state(model) if model is not None else None
        if state is not None and state.watchdog is watchdog:
            unwatch_model(model)

    def _install_prefill(self, watchdog: Watchdog, model: Any, provider: Any) -> None:
        # The guard lowers the provider's cli_args.prefill_step_size, never above what the user
        # gave for this provider (a model loaded later must not start from a lowered size).
        cli_args = provider.cli_args
        user_step = self._user_prefill_step.setdefault(id(provider), int(cli_args.prefill_step_size))
        try:
            prefill.install(watchdog, model, ServerPrefillAdapter(cli_args, user_step))
        except Exception as exc:  # the server runs on without it
            logger.warning("mlx-watchdog: --adapt-prefill could not be installed: %r", exc)

    # ------------------------------------------------------------------ requests and stops

    def _track(self, generator: Any, channel: _Channel) -> None:
        with self._lock:
            live = [c for c in self._channels.get(id(generator), ()) if not c.finished and not c.abandoned]
            live.append(channel)
            self._channels[id(generator)] = live

    def _generation_ended(self, native_id: int) -> None:
        with self._lock:
            self._ended_threads.append(native_id)

    def _idle(self) -> None:
        for watchdog in self.watchdogs():
            watchdog.generation_ended()

    def _after_batch_stop(self, generator: Any, exc: ResourceLimitForecast) -> None:
        """The batched loop ended with a stop: end its started requests, requeue the others, and
        free the batch (its frames hold the batch generator and its caches)."""
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc.__traceback__ = None
        with self._lock:
            channels = [c for c in self._channels.pop(id(generator), ()) if not c.finished]
        started = [c for c in channels if c.started]
        waiting = [c for c in channels if not c.started]
        self._stopped(started, exc)
        for channel in waiting:
            channel.finished = True  # this channel is done; the request gets a new one
            generator.requests.put(channel.item)
        if waiting:
            logger.info("mlx-watchdog: %d waiting request(s) put back in the queue", len(waiting))
        gc.collect()

    def _stopped(self, channels: list[_Channel], exc: ResourceLimitForecast) -> None:
        ended = sum(channel.stop(exc) for channel in channels)
        logger.error(
            "mlx-watchdog: ended %d request(s) with finish_reason=%r: %s; the server goes on",
            ended,
            STOP_FINISH_REASON,
            exc,
        )
        for watchdog in self.watchdogs():
            watchdog.reset()  # the stopped batch and its caches are gone


def stop_response(response_class: type, last: Any) -> Any:
    """The final chunk of a stopped request, an instance of mlx_lm.server's ``Response`` built by
    field name: no text, the last token again, the watchdog's ``finish_reason``. mlx-lm 0.31's
    ``Response`` also carries the text state machine's ``state`` (the last one, so the handler
    closes no reasoning or tool span on its own) and ``match`` (None: no stop sequence to hide).
    Raises RuntimeError for a ``Response`` with a required field not known here."""
    values: dict[str, Any] = {
        "text": "",
        "token": getattr(last, "token", 0),
        "logprob": 0.0,
        "finish_reason": STOP_FINISH_REASON,
        "top_tokens": (),
        "state": getattr(last, "state", "normal"),
        "match": None,
    }
    if not dataclasses.is_dataclass(response_class):
        raise RuntimeError(
            "mlx_lm.server's Response is not a dataclass: this mlx-lm version is not supported by "
            "`mlx-watchdog serve`"
        )
    fields = [f for f in dataclasses.fields(response_class) if f.init]
    unknown = [
        f.name
        for f in fields
        if f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if unknown:
        raise RuntimeError(
            f"mlx_lm.server's Response has fields {unknown} not known to mlx-watchdog: this mlx-lm "
            "version is not supported by `mlx-watchdog serve`"
        )
    return response_class(**{f.name: values[f.name] for f in fields if f.name in values})


def _clear_thread_streams() -> None:
    """Free the calling thread's MLX state: its streams and, from mlx 0.32, its random key and
    compile cache. Their C++ ``thread_local`` destructors take the GIL when the thread exits
    (after ``Thread.join()`` has returned); freed here, they have nothing left to release.

    mlx 0.31 clears a thread's compile cache only from the cleanup that the thread's first
    ``mx.compile`` call registers. A thread that ran compiled functions made on another thread
    (a model module imported by the main thread) has none, and its cache's destructor releases
    Python objects without the GIL at the thread's exit: "PyThreadState_Get: the function must
    be called with the GIL held", abort. One ``mx.compile`` call here clears the cache now and
    registers that cleanup (on mlx 0.32 it only makes a compiled function, dropped at once)."""
    try:
        mx.compile(_same)
    except Exception as exc:
        logger.debug("mlx-watchdog serve: mx.compile() failed: %r", exc)
    try:
        mx.clear_streams()
    except Exception as exc:  # an MLX without it, or a stream still in use: exit as before
        logger.debug("mlx-watchdog serve: mx.clear_streams() failed: %r", exc)


def _same(x: Any) -> Any:
    return x


# How long detach() waits for a generation thread to be gone (it exits within milliseconds).
THREAD_EXIT_SECONDS = 5.0
_TASKS = "/proc/self/task"  # Linux: one entry per thread of this process, gone when it exits


def wait_for_thread_exit(native_ids: list[int], timeout: float) -> bool:
    """Sleep (the GIL free) until the threads of ``native_ids`` have exited, at most ``timeout``
    seconds; True when they have, or where this system cannot tell (no ``/proc/self/task``).

    ``Thread.join()`` returns when a thread's Python part is done, before its C++
    ``thread_local`` destructors run. MLX's Python module has such destructors that take the GIL
    (mlx 0.31: the thread's random key and its ``mx.compile`` cleanup; 0.32 too while
    ``mx.clear_streams()`` has not freed them). If the interpreter is finalizing by then, taking
    the GIL ends the thread with ``pthread_exit``, whose unwinding through the ``noexcept``
    destructor calls ``std::terminate``: "terminate called without an active exception" and
    SIGABRT, after a clean shutdown. Waiting here keeps finalization after the thread's exit."""
    if not os.path.isdir(_TASKS):
        return True
    deadline = time.monotonic() + timeout
    pending = list(native_ids)
    while True:
        pending = [tid for tid in pending if os.path.exists(f"{_TASKS}/{tid}")]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)


def _model_label(model_path: Any) -> str:
    """A readable watchdog name: a local folder's name, else the repository id as given."""
    text = str(model_path)
    if os.path.isdir(text):
        return os.path.basename(os.path.normpath(text)) or text
    return text


# --------------------------------------------------------------------------- prefill chunks


def adapt_server_prefill(target: Any, safe_tokens: int, user_step: int) -> int:
    """Apply a safe prefill chunk size to mlx_lm.server (0.32) state; returns the size set:
    ``min(user_step, safe_tokens)``, at least 1 (a step of 0 would never advance).

    ``target`` is one of:

    * the server's ``cli_args`` namespace, or an object with ``.cli_args`` (``ModelProvider``,
      ``ResponseGenerator``): mlx-lm reads ``cli_args.prefill_step_size`` for each request served
      alone (``stream_generate``) and when it makes a new ``BatchGenerator``;
    * a live ``BatchGenerator``: it slices prompts by its own ``prefill_step_size`` and its
      pending ``PromptProcessingBatch`` chunks by its own copy; both are set, so the next
      chunk of a batch already running uses the new size.
    """
    for label, value in (("safe_tokens", safe_tokens), ("user_step", user_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{label} must be an int >= 0, got {value!r}")
    size = max(1, min(user_step, safe_tokens))
    if hasattr(target, "_prompt_batch") and hasattr(target, "prefill_step_size"):
        target.prefill_step_size = size
        prompt_batch = getattr(target, "_prompt_batch", None)
        if prompt_batch is not None and hasattr(prompt_batch, "prefill_step_size"):
            prompt_batch.prefill_step_size = size
        return size
    args = getattr(target, "cli_args", target)
    if not hasattr(args, "prefill_step_size"):
        raise ValueError(
            f"{type(target).__name__} has no prefill_step_size (expected mlx_lm.server's "
            "cli_args, ModelProvider, ResponseGenerator or a BatchGenerator)"
        )
    args.prefill_step_size = size
    return size


class ServerPrefillAdapter:
    """An ``on_safe_size`` callback for mlx_lm.server: lowers ``cli_args.prefill_step_size``
    and the step size of every live ``BatchGenerator`` the server made (never above the user's
    ``--prefill-step-size``).

    mlx-lm keeps its ``BatchGenerator`` in a local variable of ``ResponseGenerator._generate``;
    ``attach(server_module)`` swaps ``server_module.BatchGenerator`` for a subclass that
    registers each instance here (``detach`` puts the original back)."""

    def __init__(self, cli_args: Any, user_step: int | None = None):
        if not hasattr(cli_args, "prefill_step_size"):
            raise ValueError(f"cli_args has no prefill_step_size: {cli_args!r}")
        self.cli_args = cli_args
        self.user_step = int(cli_args.prefill_step_size if user_step is None else user_step)
        self.applied: int | None = None
        self._generators: weakref.WeakSet[Any] = weakref.WeakSet()
        self._patched: tuple[Any, Any] | None = None

    def attach(self, server_module: Any = None) -> ServerPrefillAdapter:
        if server_module is None:
            import mlx_lm.server as server_module
        original: Any = getattr(server_module, "BatchGenerator", None)
        if not isinstance(original, type):
            raise ValueError(f"{server_module!r} has no BatchGenerator class to track")
        adapter = self

        class BatchGenerator(original):  # same name: logs and reprs stay mlx-lm's
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                adapter.track(self)

        BatchGenerator.__qualname__ = original.__qualname__
        BatchGenerator.__module__ = original.__module__
        server_module.BatchGenerator = BatchGenerator
        self._patched = (server_module, original)
        return self

    def detach(self) -> None:
        patched, self._patched = self._patched, None
        if patched is not None:
            module, original = patched
            module.BatchGenerator = original

    def track(self, batch_generator: Any) -> None:
        self._generators.add(batch_generator)
        if self.applied is not None:
            adapt_server_prefill(batch_generator, self.applied, self.user_step)

    @property
    def generators(self) -> list:
        return list(self._generators)

    def __call__(self, safe_tokens: int) -> int:
        size = adapt_server_prefill(self.cli_args, int(safe_tokens), self.user_step)
        for generator in list(self._generators):
            adapt_server_prefill(generator, int(safe_tokens), self.user_step)
        if size != self.applied:
            logger.info(
                "mlx-watchdog: prefill step size -> %d tokens (safe size %d, configured %d)",
                size,
                safe_tokens,
                self.user_step,
            )
        self.applied = size
        return size
