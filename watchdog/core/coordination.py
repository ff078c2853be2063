"""The processes a watchdog runs with: the one hook core offers them, and the launcher's rank.

``Watchdog.coordinator`` holds a :class:`Coordinator` (or ``None``). At every observed step core
asks it for the group's steps to the limit; ``forecast()`` asks it for the rank and world size.
New watchdogs ask the factory installed here for theirs (``set_factory``). Core knows nothing
more of distributed jobs: ``mlx_watchdog.attach.distributed`` provides the coordinator and
installs the factory (``instrument()``).

Without a coordinator a watchdog's rank and world size are the launcher's (``launch_env``), so
that a launched job's metrics carry ranks before (or without) any coordination.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .watchdog import Watchdog

# Launchers set these: mlx.launch (ring, nccl, jaccl) MLX_RANK, JACCL's own launch JACCL_RANK,
# Open MPI OMPI_COMM_WORLD_*, MPICH and PMIx PMI_* / PMIX_RANK. mlx.launch's ring backend sets no
# size: its hostfile (MLX_HOSTFILE) lists one entry per rank.
RANK_VARIABLES = ("MLX_RANK", "JACCL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
SIZE_VARIABLES = ("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
HOSTFILE_VARIABLE = "MLX_HOSTFILE"


@runtime_checkable
class Coordinator(Protocol):
    """What a watchdog asks of the processes it runs with."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def worst(self, step: int, steps_to_limit: float) -> float:
        """Called at every observed step with this process's steps to the limit: the group's.
        May raise :class:`~mlx_watchdog.ResourceLimitForecast` (a stop the group agreed on)."""
        ...


Factory = Callable[["Watchdog"], "Coordinator | None"]
_factory: Factory | None = None


def set_factory(factory: Factory | None) -> Factory | None:
    """Install what a new ``Watchdog`` asks for its coordinator (``None``: nothing). Returns the
    factory installed before, so that an instrumentor can put it back."""
    global _factory
    previous, _factory = _factory, factory
    return previous


def new_coordinator(watchdog: Watchdog) -> Coordinator | None:
    """The coordinator of a watchdog being made: the installed factory's, if any."""
    factory = _factory
    return None if factory is None else factory(watchdog)


# --------------------------------------------------------------------------- the launcher


def launch_rank() -> int | None:
    """This process's rank as the launcher set it, or ``None``."""
    return _env_int(RANK_VARIABLES)


def launch_env() -> tuple[int, int] | None:
    """``(rank, size)`` from the launcher's environment (mlx.launch, mpirun), without touching
    MLX's distributed state; ``None`` when this process was not launched as one of several."""
    rank = launch_rank()
    size = _env_int(SIZE_VARIABLES)
    if size is None:
        size = _hostfile_size()
    if rank is None or size is None or size <= 1 or not 0 <= rank < size:
        return None
    return rank, size


@functools.cache
def launched() -> tuple[int, int]:
    """``launch_env()`` read once (the environment a process was launched with stays), else
    ``(0, 1)``: the rank and world size of a watchdog without a coordinator."""
    return launch_env() or (0, 1)


def _env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def _hostfile_size() -> int | None:
    path = os.environ.get(HOSTFILE_VARIABLE, "").strip()
    if not path:
        return None
    try:
        with open(path) as f:
            hosts = json.load(f)
        return len(hosts) if isinstance(hosts, list) else None
    except (OSError, ValueError):
        return None
