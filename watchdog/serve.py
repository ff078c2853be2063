"""``mlx-watchdog serve``: the real ``mlx_lm.server``, in this process, with every model it loads
watched, and the watchdogs' metrics on a separate port.

    mlx-watchdog serve --fix --stop-within 2000 -- --model mlx-community/Qwen3-Next-80B-A3B-4bit

How it attaches (mlx-lm is not edited; :class:`ServerHooks` installs three class-level wrappers
and puts the originals back on exit):

* ``ModelProvider._load``: after mlx-lm loads a model (plain, sharded or draft), the model gets
  its own :class:`~mlx_watchdog.core.Watchdog` through ``watch_model``; a model the provider
  drops has its watchdog retired (no longer exported).
* ``ResponseGenerator._next_request``: each request the generation thread takes is handed on
  with a :class:`_Channel` in place of its response queue. The channel forwards everything and
  remembers whether the request started streaming and whether it ended.
* ``ResponseGenerator._generate`` (the worker thread's loop): when the watchdog raises
  :class:`~mlx_watchdog.core.ResourceLimitForecast` from a forward pass, the exception leaves
  mlx-lm's loop (which has no handler for it and would let the thread die). The wrapper ends every
  started request with a final chunk whose ``finish_reason`` is ``"resource_limit"``, puts the
  requests that had not started back in the queue, drops the stopped batch and its caches, and
  runs the loop again: later requests are served on a fresh batch.

Before mlx_lm.server starts listening, its parsed arguments are checked (``server.run`` is
wrapped while ``serve`` runs): a local ``--model`` (``--adapter-path``, ``--draft-model``) that
does not exist and an API port that is in use (or the metrics port) end ``serve`` with one line
and exit status 2, instead of mlx_lm.server's traceback and a server that hangs or answers 503.

The non-batched path (``_serve_single``: seeds, ``--kv-bits``, draft models, images) catches
exceptions itself and puts them on the response queue; the channel turns a stop found there into
the same final chunk.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import inspect
import logging
import os
import signal
import sys
import threading
import traceback
import weakref
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from .attach import unwatch_model, watch_model, watched_state
from .cli_common import (EXIT_USAGE, PROG, UsageError, fraction, local_model_problem, port_number,
                         port_problem, positive_int, seconds, split_server_argv, step_count)
from .core import ResourceLimitForecast, Watchdog
from .options import checked_fraction, checked_port, checked_positive_int, checked_steps, checked_walk_interval

logger = logging.getLogger("mlx_watchdog")

DEFAULT_METRICS_PORT = 9464
DEFAULT_METRICS_ADDR = "127.0.0.1"
# The finish_reason of a completion the watchdog cut short (OpenAI clients pass unknown values on).
STOP_FINISH_REASON = "resource_limit"
# The flags' defaults are the Watchdog's own.
DEFAULTS = {name: p.default for name, p in inspect.signature(Watchdog).parameters.items()}
SERVER_PROG = "mlx_lm.server"

# Where mlx_lm.server is hooked: (class name, method name).
_HOOK_POINTS = (
    ("ModelProvider", "_load"),
    ("ResponseGenerator", "_next_request"),
    ("ResponseGenerator", "_generate"),
)


# --------------------------------------------------------------------------- arguments

def default_metrics_port() -> int:
    """The exporter's default (9464, plus the rank in a distributed job) when it is installed."""
    try:
        from .exporters.prometheus import default_metrics_port as exporter_default
    except ImportError:
        return DEFAULT_METRICS_PORT
    try:
        return exporter_default()
    except Exception:
        return DEFAULT_METRICS_PORT


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the watchdog options of ``serve`` to ``parser`` (the server's own go after ``--``)."""
    group = parser.add_argument_group("watchdog")
    group.add_argument("--fix", action=argparse.BooleanOptionalAction, default=False,
                       help="materialize the pending cache arrays every --fix-every decode steps "
                            f"({DEFAULTS['fix_every']} unless set), cutting the lazy chains that leak "
                            "buffers; default: --no-fix, only watch")
    group.add_argument("--fix-every", type=positive_int, default=DEFAULTS["fix_every"], metavar="N",
                       help="run the fix every N decode steps (default: %(default)s)")
    group.add_argument("--limit", type=positive_int, default=None, metavar="N",
                       help="buffer limit to forecast against (default: the device's Metal "
                            "resource limit, else 499000)")
    group.add_argument("--warn-within", type=step_count, default=None, metavar="STEPS",
                       help="log a warning when the limit is forecast within STEPS decode steps")
    group.add_argument("--stop-within", type=step_count, default=None, metavar="STEPS",
                       help="end the running requests (finish_reason \"resource_limit\") when the "
                            "limit is forecast within STEPS decode steps; the server goes on")
    group.add_argument("--overhead-budget", type=fraction, default=DEFAULTS["overhead_budget"],
                       metavar="FRACTION",
                       help="share of the decode's wall time the watchdog may spend measuring "
                            "(default: %(default)s); raise it on a busy machine to measure more often")
    group.add_argument("--walk-interval", type=seconds, default=DEFAULTS["walk_interval"], metavar="SECONDS",
                       help="seconds of decode between two graph walks once a decode's first walks "
                            "are done (default: 0.5, or longer where walks are dear, so that they "
                            "take 0.1%% of decode time; 0: as often as the budget allows)")
    group.add_argument("--adapt-prefill", action="store_true", default=False,
                       help="shrink the server's prefill chunks to what the watchdog measures as safe "
                            "(needs mlx_watchdog.prefill)")
    group.add_argument("--metrics-port", type=port_number, default=default_metrics_port(), metavar="PORT",
                       help="port of the Prometheus /metrics endpoint (default: %(default)s; "
                            "0 picks a free one)")
    group.add_argument("--metrics-addr", default=DEFAULT_METRICS_ADDR, metavar="ADDR",
                       help="address the metrics endpoint binds (default: %(default)s, loopback only)")
    group.add_argument("--no-metrics", action="store_true", default=False,
                       help="do not serve metrics")
    return parser


def build_parser(prog: str = "mlx-watchdog serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [watchdog options] -- [mlx_lm.server arguments]",
        description="Run mlx_lm.server with every model it loads watched by mlx-watchdog.",
        epilog="Everything after `--` goes to mlx_lm.server, e.g. "
               "`-- --model PATH --host 127.0.0.1 --port 8080`.",
    )
    return add_arguments(parser)


def parse_args(argv: Sequence[str], parser: Optional[argparse.ArgumentParser] = None
               ) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``[watchdog options] -- [server arguments]``; argparse exits (status 2) on bad input."""
    parser = parser or build_parser()
    ours, server_argv = split_server_argv(argv)
    args, unknown = parser.parse_known_args(ours)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} "
                     "(mlx_lm.server's own arguments go after `--`)")
    return args, server_argv


def watchdog_options(args: argparse.Namespace) -> dict:
    """The ``Watchdog`` keyword options from parsed arguments. Raises ``ValueError`` naming the
    option when a value is bad (for a Namespace built without the parser)."""
    def get(name, default=None):
        return getattr(args, name, default)

    limit = get("limit")
    if limit is not None:
        checked_positive_int(limit, "--limit")
    interval = checked_walk_interval(get("walk_interval", DEFAULTS["walk_interval"]), "--walk-interval")
    if not get("no_metrics", False):
        checked_port(get("metrics_port", DEFAULT_METRICS_PORT), "--metrics-port")
        addr = get("metrics_addr", DEFAULT_METRICS_ADDR)
        if not isinstance(addr, str) or not addr.strip():
            raise ValueError(f"--metrics-addr must be a host name or IP address, got {addr!r}")
    return {
        "limit": limit,
        "fix": bool(get("fix", False)),
        "fix_every": checked_positive_int(get("fix_every", DEFAULTS["fix_every"]), "--fix-every"),
        "warn_within": checked_steps(get("warn_within"), "--warn-within"),
        "stop_within": checked_steps(get("stop_within"), "--stop-within"),
        "overhead_budget": checked_fraction(get("overhead_budget", DEFAULTS["overhead_budget"]),
                                            "--overhead-budget"),
        "walk_interval": interval,
    }


# --------------------------------------------------------------------------- the response channel

class _Channel:
    """Stands in for one request's response queue on the generation thread.

    Forwards every ``put`` to the queue the HTTP handler reads, and remembers whether the request
    started (its ``GenerationContext`` went out: the client has a 200 and maybe a stream) and
    whether it ended (``None`` or an error went out). A :class:`ResourceLimitForecast` put here
    (mlx-lm's non-batched path does that with any exception) becomes the watchdog's final chunk.
    """

    def __init__(self, hooks: "ServerHooks", queue: Any, item: tuple):
        self._hooks = hooks
        self.queue = queue
        self.item = item  # what the generation thread took, to put back when not started
        self.context: Any = None
        self.finished = False
        self.last_token = 0
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self.context is not None

    @property
    def abandoned(self) -> bool:
        # mlx-lm's handler sets _should_stop when it stops reading (client gone, or done).
        return bool(getattr(self.context, "_should_stop", False))

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if isinstance(obj, ResourceLimitForecast):
            self._hooks._stopped([self], obj)
            return
        with self._lock:
            if obj is None or isinstance(obj, BaseException):
                self.finished = True
            elif isinstance(obj, self._hooks.server.GenerationContext):
                self.context = obj
            elif isinstance(obj, self._hooks.server.Response):
                self.last_token = obj.token
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
            final = self._hooks.server.Response("", self.last_token, 0.0, STOP_FINISH_REASON, ())
            self.queue.put(final)
            self.queue.put(None)
        else:  # the handler answers with {"error": ...}
            self.queue.put(RuntimeError(str(exc)))
        return True


# --------------------------------------------------------------------------- the hooks

class ServerHooks:
    """Attach the watchdog to ``mlx_lm.server`` (see the module docstring) and detach it again.

    ``options`` are the ``Watchdog`` keyword options every loaded model's watchdog gets. Use as a
    context manager, or ``attach()`` / ``detach()``; detaching restores the exact original
    functions, unwatches the models still alive and stops exporting their watchdogs."""

    def __init__(self, options: Optional[dict] = None, *, adapt_prefill: bool = False,
                 server_module: Any = None):
        self.options = dict(options or {})
        Watchdog(**self.options, export=False)  # validate the options now, not at the first load
        self.adapt_prefill = bool(adapt_prefill)
        self.server = server_module if server_module is not None else importlib.import_module("mlx_lm.server")
        for cls_name, method in _HOOK_POINTS:
            cls = getattr(self.server, cls_name, None)
            if cls is None or not callable(cls.__dict__.get(method)):
                raise RuntimeError(f"mlx_lm.server has no {cls_name}.{method}: this mlx-lm version is "
                                   "not supported by `mlx-watchdog serve`")
        for name in ("GenerationContext", "Response"):
            if not isinstance(getattr(self.server, name, None), type):
                raise RuntimeError(f"mlx_lm.server has no {name} class: this mlx-lm version is not "
                                   "supported by `mlx-watchdog serve`")
        self._lock = threading.Lock()
        self._originals: dict[tuple[str, str], Callable] = {}
        self._watched: list[tuple[weakref.ref, Watchdog]] = []
        self._channels: dict[int, list[_Channel]] = {}  # id(ResponseGenerator) -> its requests
        self._prefill_unavailable_logged = False
        self._user_prefill_step: dict[int, int] = {}

    # ------------------------------------------------------------------ attach / detach

    @property
    def attached(self) -> bool:
        return bool(self._originals)

    def attach(self) -> "ServerHooks":
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
        return self

    def detach(self) -> None:
        with self._lock:
            originals, self._originals = self._originals, {}
            for (cls_name, method), original in originals.items():
                setattr(getattr(self.server, cls_name), method, original)
            watched, self._watched = self._watched, []
            self._channels.clear()
        for ref, watchdog in watched:
            self._retire(ref(), watchdog)

    def __enter__(self) -> "ServerHooks":
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
                # The streams MLX made for this thread outlive it otherwise, and their destruction
                # at interpreter exit aborts the process (`terminate called without an active
                # exception`, exit 134: 6 of 15 SIGTERMs after a request, 0 of 15 with this).
                _clear_thread_streams()

        return _generate

    # ------------------------------------------------------------------ models

    def _watch(self, model: Any, name: str, provider: Any) -> None:
        watchdog = Watchdog(**self.options, name=name)
        watch_model(model, watchdog)
        with self._lock:
            self._watched = [(r, wd) for r, wd in self._watched if r() is not None]
            self._watched.append((weakref.ref(model), watchdog))
        logger.info("mlx-watchdog: watching %s (limit %d buffers, fix=%s, stop_within=%s)",
                    name, watchdog.limit, watchdog.fix, watchdog.stop_within)
        if self.adapt_prefill:
            self._install_prefill(watchdog, model, provider)

    def _retire_models(self, models: list) -> None:
        with self._lock:
            keep, gone = [], []
            for ref, wd in self._watched:
                model = ref()
                (gone if model is None or any(model is m for m in models) else keep).append((ref, wd))
            self._watched = keep
        for ref, wd in gone:
            self._retire(ref(), wd)

    @staticmethod
    def _retire(model: Any, watchdog: Watchdog) -> None:
        watchdog.export = False  # its series leave /metrics: the model is gone
        if model is not None and watched_state(model) is not None and watched_state(model).watchdog is watchdog:
            unwatch_model(model)

    def _install_prefill(self, watchdog: Watchdog, model: Any, provider: Any) -> None:
        try:
            prefill = importlib.import_module(f"{__package__}.prefill")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.prefill":
                raise
            prefill = None
        install = getattr(prefill, "install", None)
        if not callable(install):
            if not self._prefill_unavailable_logged:
                self._prefill_unavailable_logged = True
                logger.warning("mlx-watchdog: --adapt-prefill: mlx_watchdog.prefill.install is not "
                               "available in this version; prefill chunks are not adapted")
            return
        cli_args = provider.cli_args
        user_step = self._user_prefill_step.setdefault(id(provider), int(cli_args.prefill_step_size))

        def on_safe_size(tokens) -> None:
            # mlx-lm reads cli_args.prefill_step_size when it makes a batch generator or serves
            # a request alone: later batches use the new size.
            size = max(1, min(user_step, int(tokens)))
            if size != cli_args.prefill_step_size:
                logger.info("mlx-watchdog: prefill step size %d -> %d tokens (safe size %s)",
                            cli_args.prefill_step_size, size, tokens)
                cli_args.prefill_step_size = size

        try:
            install(watchdog, model, on_safe_size)
        except Exception as exc:  # the server runs on without it
            logger.warning("mlx-watchdog: --adapt-prefill could not be installed: %r", exc)

    # ------------------------------------------------------------------ requests and stops

    def _track(self, generator: Any, channel: _Channel) -> None:
        with self._lock:
            live = [c for c in self._channels.get(id(generator), ()) if not c.finished and not c.abandoned]
            live.append(channel)
            self._channels[id(generator)] = live

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
        logger.error("mlx-watchdog: ended %d request(s) with finish_reason=%r: %s; the server goes on",
                     ended, STOP_FINISH_REASON, exc)
        for watchdog in self.watchdogs():
            watchdog.reset()  # the stopped batch and its caches are gone


def _clear_thread_streams() -> None:
    try:
        mx.clear_streams()
    except Exception as exc:  # an MLX without it, or a stream still in use: exit as before
        logger.debug("mlx-watchdog serve: mx.clear_streams() failed: %r", exc)


def _model_label(model_path: Any) -> str:
    """A readable watchdog name: a local folder's name, else the repository id as given."""
    text = str(model_path)
    if os.path.isdir(text):
        return os.path.basename(os.path.normpath(text)) or text
    return text


# --------------------------------------------------------------------------- running

def _start_metrics(args: argparse.Namespace):
    from .exporters.prometheus import start_metrics_server

    try:
        return start_metrics_server(args.metrics_port, addr=args.metrics_addr)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--metrics-port/--metrics-addr: {exc} (or pass --no-metrics)") from exc


def preflight(cli_args: argparse.Namespace, host: str, port: int, metrics: Any = None) -> None:
    """Check what mlx_lm.server parsed before it starts; raise ``UsageError`` naming the flag."""
    for flag in ("model", "adapter_path", "draft_model"):
        spec = getattr(cli_args, flag, None)
        problem = local_model_problem(str(spec)) if spec else None
        if problem is not None:
            raise UsageError(f"{problem} (mlx_lm.server's --{flag.replace('_', '-')})")
    metrics_port = getattr(metrics, "port", None)
    if metrics_port == port:
        raise UsageError(f"mlx_lm.server's --port {port} is the metrics port: choose another "
                         "--port or --metrics-port")
    problem = port_problem(host, port)
    if problem is not None:
        raise UsageError(f"mlx_lm.server's --host/--port: {problem} (another server there? choose "
                         "another --port)")


class _Preflight:
    """While active, ``server.run(host, port, model_provider)`` runs ``preflight`` first."""

    def __init__(self, server: Any, metrics: Any):
        self.server, self.metrics, self.original = server, metrics, None

    def __enter__(self):
        original = self.original = self.server.run

        @functools.wraps(original)
        def run(host, port, model_provider, *args, **kwargs):
            preflight(model_provider.cli_args, host, port, self.metrics)
            return original(host, port, model_provider, *args, **kwargs)

        self.server.run = run
        return self

    def __exit__(self, *exc):
        self.server.run = self.original
        return False


def run(args: argparse.Namespace, server_argv: Sequence[str]) -> int:
    """Run ``mlx_lm.server`` with ``server_argv`` in this process, watched as ``args`` say.

    Returns the exit status: 0 after a clean shutdown (Ctrl-C or SIGTERM), the server's own
    status when its argument parser exits. Raises ``UsageError`` (exit status 2 from the command
    line) when the metrics endpoint cannot start or ``preflight`` finds a problem."""
    options = watchdog_options(args)
    server_argv = [str(a) for a in server_argv]
    hooks = ServerHooks(options, adapt_prefill=getattr(args, "adapt_prefill", False))
    metrics = None
    if not getattr(args, "no_metrics", False):
        metrics = _start_metrics(args)
        print(f"mlx-watchdog: metrics at {getattr(metrics, 'url', args.metrics_port)}", file=sys.stderr, flush=True)
    saved_argv = sys.argv
    restore_signal = _terminate_as_interrupt()
    try:
        with hooks, _Preflight(hooks.server, metrics):
            sys.argv = [SERVER_PROG, *server_argv]
            hooks.server.main()
        return 0
    except SystemExit as exc:  # mlx_lm.server's argument parser (e.g. --help, a bad option)
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the server's own loop caught it
        return 0
    finally:
        sys.argv = saved_argv
        restore_signal()
        if metrics is not None and hasattr(metrics, "close"):
            metrics.close()


def _terminate_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM stop the server like Ctrl-C does (mlx-lm shuts down on KeyboardInterrupt).
    Returns the function that puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except (ValueError, OSError):
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m mlx_watchdog.serve [watchdog options] -- [mlx_lm.server arguments]``."""
    try:
        args, server_argv = parse_args(sys.argv[1:] if argv is None else argv,
                                       build_parser("python -m mlx_watchdog.serve"))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return run(args, server_argv)
    except (UsageError, ValueError) as exc:
        print(f"{PROG} serve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
