"""Whether an ``mx.array`` is evaluated, read from its C++ descriptor: for MLX before 0.32.4.

mlx 0.32.4 says it with ``mx.get_array_buffer_size``, which refuses a pending array in O(1).
Earlier versions have nothing of the kind: their Python API evaluates an array to read more than
its shape, dtype and size, and ``mx.export_to_dot`` walks the whole graph behind it (milliseconds
for a chain of thousands of nodes, where a reading tells every array of a cache). So there the
field that ``mx::array::status()`` returns is read from memory:

* ``mx.array`` is a nanobind class: after the ``PyObject`` header comes an ``int32`` offset to
  the C++ object, then flags (``state``, 2 bits, 2 = ready; ``direct``, 1 bit: the object is
  inline at that offset);
* an ``mx::array`` is one ``std::shared_ptr<ArrayDesc>``: its first word points at the descriptor;
* ``ArrayDesc`` (mlx/array.h, the same from mlx 0.31.0 to 0.32.4, with GCC and with clang):
  ``shape`` (a ``SmallVector<int32_t>``: an empty allocator, begin, end and end-of-storage
  pointers, then 10 elements inline: 72 bytes), ``strides`` (the same of ``int64_t``: 112),
  ``size``, ``dtype`` (value, then the item size), the ``primitive`` pointer, then ``status``:
  0 unscheduled (pending), 1 evaluated (scheduled; detached from its graph), 2 available.

Nothing of that is taken on trust. Before the first reading the layout is checked on arrays made
for it (constants and pending arrays of several shapes and dtypes: their shape, strides, size,
item size, primitive and status must all read back), through a pipe: the kernel
copies the memory and answers a bad address with an error, never a crash. Where a check fails,
``reader()`` returns None and the caller tells arrays by another means.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections.abc import Callable

import mlx.core as mx

# Offsets in ArrayDesc (see the module's docstring).
_SHAPE = 0
_STRIDES = 72
_SIZE = 184
_ITEM_SIZE = 196  # the byte after the dtype's 4-byte value
_PRIMITIVE = 200
_STATUS = 216
_DESC_BYTES = 224
_INLINE = 32  # a SmallVector's inline elements, after its allocator and three pointers
_UNSCHEDULED, _AVAILABLE = 0, 2  # between them, 1: evaluated (scheduled, not yet done)

# nanobind's instance flags, after the offset: state == ready (2) and direct (bit 2).
_FLAGS_MASK = 0b111
_READY_DIRECT = 0b110


def read_memory(address: int, size: int) -> bytes | None:
    """``size`` bytes at ``address``, or None where they cannot be read: ``write`` to a pipe
    makes the kernel copy them, and it answers an unmapped address with EFAULT, not a signal."""
    if address <= 0 or size > 4096:
        return None
    r, w = os.pipe()
    try:
        if os.write(w, (ctypes.c_char * size).from_address(address)) != size:
            return None
        return os.read(r, size)
    except (OSError, ValueError, OverflowError):
        return None
    finally:
        os.close(r)
        os.close(w)


def _word(blob: bytes, at: int) -> int:
    return struct.unpack_from("<Q", blob, at)[0]


def _descriptor(array: mx.array, head: int) -> tuple[int, int, bytes] | None:
    """(offset of the inline ``mx::array``, address and bytes of its ArrayDesc), read checked;
    None where anything is off."""
    base = id(array)
    header = read_memory(base + head, 8)
    if header is None:
        return None
    offset, flags = struct.unpack("<iI", header)
    if (
        flags & _FLAGS_MASK != _READY_DIRECT
        or offset < head + 8
        or offset % 8
        or offset + 16 > type(array).__basicsize__
    ):
        return None
    inline = read_memory(base + offset, 8)
    if inline is None:
        return None
    address = _word(inline, 0)
    blob = read_memory(address, _DESC_BYTES)
    return None if blob is None else (offset, address, blob)


def _vector(blob: bytes, address: int, at: int, item: str, n: int) -> tuple[int, ...] | None:
    """The elements of the SmallVector at ``at``, where it holds ``n`` of them inline."""
    width = struct.calcsize(item)
    begin, end = _word(blob, at + 8), _word(blob, at + 16)
    if begin != address + at + _INLINE or end != begin + width * n:
        return None
    return struct.unpack_from(f"<{n}{item}", blob, at + _INLINE)


def _offset_if_read_back(array: mx.array, head: int, status: tuple[int, ...], primitive: bool) -> int | None:
    """The offset of ``array``'s ``mx::array`` where every field of its descriptor reads back."""
    read = _descriptor(array, head)
    if read is None:
        return None
    offset, address, blob = read
    shape = tuple(array.shape)
    strides: list[int] = []  # row-major, as ArrayDesc computes them for a new array
    size = 1
    for dim in reversed(shape):
        strides.insert(0, size)
        size *= dim
    holds = (
        _vector(blob, address, _SHAPE, "i", len(shape)) == shape
        and _vector(blob, address, _STRIDES, "q", len(shape)) == tuple(strides)
        and _word(blob, _SIZE) == array.size
        and blob[_ITEM_SIZE] == array.itemsize
        and (_word(blob, _PRIMITIVE) != 0) == primitive
        and struct.unpack_from("<i", blob, _STATUS)[0] in status
    )
    return offset if holds else None


def _checked_offset(head: int) -> int | None:
    """The offset of the inline ``mx::array`` in an ``mx.array``, where the layout reads back
    from arrays whose every field is known (the same offset for all); else None."""
    constant = mx.array([[1, 2, 3], [4, 5, 6]], dtype=mx.int16)  # made from data: available
    scalar = mx.array(2.5)
    # Nothing is evaluated here: an eval would wait for the program's work on the stream.
    pending = [constant + 1, scalar * 3, mx.reshape(constant, (1, 2, 3, 1)).astype(mx.float32)]
    offsets = {
        _offset_if_read_back(constant, head, (_AVAILABLE,), primitive=False),
        _offset_if_read_back(scalar, head, (_AVAILABLE,), primitive=False),
        *(_offset_if_read_back(p, head, (_UNSCHEDULED,), primitive=True) for p in pending),
    }
    return offsets.pop() if len(offsets) == 1 else None


def reader() -> Callable[[mx.array], bool | None] | None:
    """A function that tells whether an array is evaluated (or scheduled) in O(1), reading its
    descriptor: None for an object it cannot read (then tell it another way). None where the
    layout does not read back here (another interpreter, another MLX)."""
    if sys.implementation.name != "cpython" or sys.byteorder != "little" or sys.maxsize < 2**63 - 1:
        return None
    head = object.__basicsize__  # nanobind's offset field follows the PyObject header
    try:
        offset = _checked_offset(head)
    except Exception:  # an MLX whose calls differ: not this layout either
        return None
    if offset is None:
        return None

    offset_and_flags = ctypes.c_uint64.from_address
    pointer = ctypes.c_uint64.from_address
    status = ctypes.c_int32.from_address
    array_type = mx.array
    mask = (_FLAGS_MASK << 32) | 0xFFFFFFFF
    expected = (_READY_DIRECT << 32) | offset

    def is_evaluated(array: mx.array) -> bool | None:
        if type(array) is not array_type:
            return None
        base = id(array)
        if offset_and_flags(base + head).value & mask != expected:
            return None
        return status(pointer(base + offset).value + _STATUS).value != _UNSCHEDULED

    return is_evaluated
