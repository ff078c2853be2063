"""Process-wide readings the collector adds to every watchdog's series at a scrape: MLX's memory,
the functions compiled with ``mx.compile`` and the entries they keep, the versions and device.
Each is guarded on its own: one that fails is left out, never the scrape."""

from __future__ import annotations

import importlib.metadata
import logging

import mlx.core as mx

from .. import __version__
from ..core import compiled
from ..core.limits import backend, device_name

logger = logging.getLogger("mlx_watchdog")

# (metric name, reader)
_MEMORY_READERS = (
    ("mlx_watchdog_memory_active_bytes", lambda: mx.get_active_memory()),
    ("mlx_watchdog_memory_peak_bytes", lambda: mx.get_peak_memory()),
    ("mlx_watchdog_memory_cache_bytes", lambda: mx.get_cache_memory()),
    ("mlx_watchdog_memory_limit_bytes", lambda: mx.get_memory_limit()),
)


def read_memory() -> dict[str, float]:
    """MLX's memory readings by metric name; a backend without one leaves it out."""
    readings = {}
    for name, read in _MEMORY_READERS:
        try:
            readings[name] = float(read())
        except Exception as exc:
            logger.debug("mlx-watchdog exporter: %s unavailable: %r", name, exc)
    return readings


def read_compiled(limit: int) -> list[tuple[str, int, float | None]]:
    """(function, signatures, buffers per entry) of the compiled functions that keep an entry,
    the most signatures first, at most ``limit``; functions of one name summed."""
    by_name: dict[str, list] = {}
    try:
        for function in compiled.functions():
            entries = function.entries
            if not entries:
                continue
            total = by_name.setdefault(function.name, [0, 0, False])
            total[0] += entries
            total[1] += function.buffers
            total[2] = total[2] or function.entry_buffers is not None
    except Exception as exc:
        logger.debug("mlx-watchdog exporter: compiled functions unavailable: %r", exc)
        return []
    ranked = sorted(by_name.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]
    return [
        (name, entries, buffers / entries if measured else None)
        for name, (entries, buffers, measured) in ranked
    ]


def compiled_rows(functions: list[tuple[str, int, float | None]], base: tuple) -> list[tuple]:
    """The samples of ``read_compiled``'s functions, labelled ``base`` and the function."""
    rows: list[tuple] = []
    for name, signatures, per_entry in functions:
        rows.append(("mlx_watchdog_compiled_signatures", base + (name,), float(signatures)))
        if per_entry is not None:
            rows.append(("mlx_watchdog_compiled_entry_buffers", base + (name,), float(per_entry)))
    return rows


def read_static() -> dict[str, str]:
    """The labels of ``mlx_watchdog_info`` that do not change while the process runs."""
    try:
        device = device_name()
    except Exception:
        device = "unknown"
    try:
        on = backend()
    except Exception:
        on = "unknown"
    return {
        "version": __version__,
        "mlx_version": str(getattr(mx, "__version__", "unknown")),
        "mlx_lm_version": _package_version("mlx-lm"),
        "device": device,
        "backend": on,
    }


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return "unknown"
