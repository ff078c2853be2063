"""mlx-watchdog's bootstrap: ``mlx-watchdog run`` puts this folder first on the program's
PYTHONPATH, so that every Python process of the program imports this module as it starts (``site``
imports ``sitecustomize``), its child processes too: they inherit the variable.

When ``MLX_WATCHDOG_RUN`` is set, it says hello to the supervisor (a file in the run's state
folder: a Python process started), then instruments the process (``mlx_watchdog.bootstrap``:
an import hook, nothing imported until the program imports mlx-lm or mlx-vlm itself). Then it
runs the ``sitecustomize`` this one shadows, the next on ``sys.path`` (Debian's Python has one).
Nothing here stops the program: a failure is reported once on stderr and the program runs on.

Standard library only, before mlx_watchdog is imported: a process whose Python cannot import
mlx_watchdog still says hello, and says why it is not watched.
"""

import os
import sys


def _bootstrap() -> None:
    raw = os.environ.get("MLX_WATCHDOG_RUN")  # mlx_watchdog.bootstrap.ENV
    if not raw:
        return
    try:
        import json

        config = json.loads(raw)
        _hello(config)
        from mlx_watchdog.bootstrap import start

        start(config)
    except Exception as exc:
        sys.stderr.write(
            f"mlx-watchdog run: process {os.getpid()} ({sys.executable}) is not watched: "
            f"{type(exc).__name__}: {exc}\n"
        )


def _hello(config: dict) -> None:
    """``<state>/hello-<pid>``: the supervisor learns that a Python process of the program started."""
    state = config.get("state")
    if state:
        path = os.path.join(state, f"hello-{os.getpid()}")  # mlx_watchdog.bootstrap.HELLO_PREFIX
        with open(path, "w") as f:
            f.write(sys.executable)


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, as ``site`` would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        import importlib.machinery
        import importlib.util

        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None:
            return
        ours = sys.modules.get("sitecustomize")
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            if ours is not None:
                sys.modules["sitecustomize"] = ours
            raise
    except Exception as exc:  # what site.py prints for a failing sitecustomize
        if sys.flags.verbose:
            sys.excepthook(type(exc), exc, exc.__traceback__)
        else:
            sys.stderr.write(
                f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n"
            )


if __name__ == "sitecustomize":  # imported by site, not as mlx_watchdog.bootstrap.sitecustomize
    _bootstrap()
    _chain()
