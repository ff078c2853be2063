"""The truth inside a peer server's process (test only): the exact live-buffer count
(tests/exact_buffers.py) read at the entry of every forward pass, appended to a file the test reads.

The test puts this folder on the server's PYTHONPATH; ``mlx-watchdog run`` puts its bootstrap
before it, and the bootstrap runs this one after its own work, as it runs any sitecustomize it
shadows. Active only when ``MLX_WATCHDOG_PEERS_TRUTH`` names the file, in the processes ``run``
starts.

A forward pass is the outermost call of an ``mlx.nn.Module`` whose own ``__call__`` takes a
``cache`` argument: what a server calls once per step (mlx-lm's model, mlx-vlm's
``language_model``), whatever its class, found as the model modules define their classes. Each
line of the file: ``{"pid", "t" (time.monotonic(), one clock for every process), "live" (live
non-empty buffers after mx.synchronize()), "shape" (the input's)}``.
"""

import inspect
import json
import os
import sys
import threading
import time

ENV = "MLX_WATCHDOG_PEERS_TRUTH"


def _install(path: str) -> None:
    sys.path.insert(0, os.environ["MLX_WATCHDOG_PEERS_TESTS"])  # tests/, for exact_buffers
    try:
        import exact_buffers
    finally:
        sys.path.pop(0)
    import mlx.nn as nn

    counter = exact_buffers.install()
    out = open(path, "a", buffering=1)
    lock = threading.Lock()
    depth = threading.local()

    def record(args):
        shape = list(getattr(args[0], "shape", ())) if args else []
        line = json.dumps({"pid": os.getpid(), "t": time.monotonic(), "live": counter.live(), "shape": shape})
        with lock:
            out.write(line + "\n")

    def wrap(call):
        def __call__(self, *args, **kwargs):
            outer = not getattr(depth, "inside", False)
            if outer:
                record(args)
                depth.inside = True
            try:
                return call(self, *args, **kwargs)
            finally:
                if outer:
                    depth.inside = False

        __call__.__wrapped__ = call
        return __call__

    def init_subclass(cls, **kwargs):
        call = cls.__dict__.get("__call__")
        if call is not None and not hasattr(call, "__wrapped__"):
            try:
                takes_cache = "cache" in inspect.signature(call).parameters
            except (TypeError, ValueError):
                takes_cache = False
            if takes_cache:
                cls.__call__ = wrap(call)

    nn.Module.__init_subclass__ = classmethod(init_subclass)


# Only in the program's processes (``run`` marks them), not in the supervisor.
if os.environ.get(ENV) and os.environ.get("MLX_WATCHDOG_RUN"):
    _install(os.environ[ENV])
