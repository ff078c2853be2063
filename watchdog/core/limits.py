"""The device's buffer limit, and MLX's own buffer counter where one exists."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import mlx.core as mx

# Metal's default resource limit on Apple silicon (`[metal::malloc] Resource limit (499000) exceeded`).
DEFAULT_LIMIT = 499_000

# Buffers the count cannot see on Metal when MLX has no counter of its own: command buffers in
# flight keep their inputs alive until they complete, and MLX's commit rule (a command buffer is
# committed after a maximum of ops or megabytes, about ten in flight) bounds them to roughly two
# thousand whatever the step. The forecast keeps that much of the limit in reserve there.
IN_FLIGHT_MARGIN = 2048

# MLX 0.32 has no public buffer counter. Two have been proposed upstream, each as a total (live
# and cached buffers: Metal's num_resources_, what it compares with the limit) and the cached
# part; the later spelling first.
_SPELLINGS = (
    ("get_active_buffer_count", "get_cache_buffer_count"),
    ("get_active_resource_count", "get_cache_count"),
)


@dataclasses.dataclass(frozen=True)
class BufferCounter:
    """MLX's own count of Metal buffer objects."""

    name: str  # where it was found, e.g. "mx.get_active_buffer_count"
    total: Callable[[], int]  # live and cached buffers
    cached: Callable[[], int] | None  # the buffers MLX's cache holds (None: not offered)

    def read(self) -> tuple[int, int]:
        """(live, cached): live buffers are what a leak grows; cached ones still count against
        the limit until MLX releases them."""
        total = int(self.total())
        cached = int(self.cached()) if self.cached is not None else 0
        return max(0, total - cached), min(cached, total)


def find_buffer_counter() -> BufferCounter | None:
    """MLX's buffer counter under either proposed spelling, in ``mx`` or ``mx.metal``; None
    where this MLX has none or the device is not Metal (other back-ends return 0 from it: their
    limits are bytes, not buffers)."""
    metal = getattr(mx, "metal", None)
    try:
        on_metal = bool(metal is not None and metal.is_available())
    except Exception:
        on_metal = False
    if not on_metal:
        return None
    for label, module in (("mx", mx), ("mx.metal", metal)):
        for total_name, cached_name in _SPELLINGS:
            total = getattr(module, total_name, None)
            if callable(total):
                cached = getattr(module, cached_name, None)
                return BufferCounter(f"{label}.{total_name}", total, cached if callable(cached) else None)
    return None


def unseen_margin(counter: object | None) -> int:
    """Buffers the forecast keeps in reserve for what its count does not include: none with a
    count (MLX's counter, or the process count: both count buffers in flight) or off Metal (no
    buffer limit to reach there)."""
    if counter is not None:
        return 0
    try:
        return IN_FLIGHT_MARGIN if mx.metal.is_available() else 0
    except Exception:
        return 0


def device_resource_limit() -> int | None:
    """``mx.device_info()["resource_limit"]`` where the backend reports one (Metal)."""
    try:
        info = mx.device_info()
    except Exception:
        return None
    value = info.get("resource_limit") if isinstance(info, dict) else None
    return int(value) if isinstance(value, numbers.Integral) and value > 0 else None


def backend() -> str:
    """The backend whose allocator holds MLX's buffers: ``"metal"``, ``"cuda"`` or ``"cpu"``
    (Metal's allocator holds every array, a CPU stream's too). Only Metal has a buffer-count
    limit; elsewhere the limit is the watchdog's own (configured, or the default)."""
    for name in ("metal", "cuda"):
        module = getattr(mx, name, None)
        try:
            if module is not None and module.is_available():
                return name
        except Exception:
            continue
    return "cpu"


def limit_phrase(limit: int, on: str | None = None) -> str:
    """The limit as messages name it, for the backend ``on`` (default: this process's): Metal's
    resource limit only where it is the one counted against; elsewhere the configured one."""
    on = backend() if on is None else on
    if on == "metal":
        device = device_resource_limit()
        if device is None or device == limit:
            return f"the Metal resource limit of {limit} buffers"
        return f"the buffer limit (configured {limit}; Metal's resource limit is {device})"
    return f"the buffer limit (configured {limit}; MLX's {on} backend has no buffer-count limit)"


def device_name() -> str:
    try:
        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or mx.default_device())
    except Exception:
        return str(mx.default_device())


def resolve_limit(limit) -> int:
    """Validate a user's limit; ``None`` means the device's limit, else 499,000."""
    if limit is None:
        return device_resource_limit() or DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
        raise ValueError(f"limit must be a positive integer number of buffers, got {limit!r}")
    if limit <= 0:
        raise ValueError(f"limit must be a positive integer number of buffers, got {limit}")
    return int(limit)
