"""The device's buffer limit, and MLX's exact live-buffer counter where one exists."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import mlx.core as mx

# Metal's default resource limit on Apple silicon (`[metal::malloc] Resource limit (499000) exceeded`).
DEFAULT_LIMIT = 499_000

# MLX 0.32 has no public live-buffer counter. Should one appear under one of these names
# (the ones proposed upstream), the watchdog uses it instead of its own estimate.
_COUNTER_NAMES = (
    "get_num_buffers",
    "get_buffer_count",
    "get_live_buffers",
    "get_active_buffers",
    "get_num_resources",
)


def _find_counter() -> tuple[str | None, Callable[[], int] | None]:
    for module_name, module in (("mx", mx), ("mx.metal", getattr(mx, "metal", None))):
        for name in _COUNTER_NAMES:
            fn = getattr(module, name, None) if module is not None else None
            if callable(fn):
                return f"{module_name}.{name}", fn
    return None, None


EXACT_COUNTER_NAME, EXACT_COUNTER = _find_counter()


def device_resource_limit() -> int | None:
    """``mx.device_info()["resource_limit"]`` where the backend reports one (Metal)."""
    try:
        info = mx.device_info()
    except Exception:
        return None
    value = info.get("resource_limit") if isinstance(info, dict) else None
    return int(value) if isinstance(value, numbers.Integral) and value > 0 else None


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
