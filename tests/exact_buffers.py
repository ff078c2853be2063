"""An exact live-buffer counter for MLX's CPU backend: an independent oracle for tests.

    from tests import exact_buffers          # or `import exact_buffers` with tests/ on sys.path
    counter = exact_buffers.install()        # RuntimeError if gcc / libmlx / the symbol is missing
    before = counter.live()
    ...                                      # MLX work
    assert counter.live() - before == 3

How it works: tests/exact_buffers.c is compiled with gcc (once per source hash, cached under
tempfile.gettempdir()) and loaded with ctypes.  install() asks libmlx.so for
``mlx::core::allocator::allocator()`` (the process-wide CommonAllocator on Linux / no-GPU builds),
checks its vtable's typeinfo really is ``CommonAllocator``, and swaps vtable slots 0 (malloc) and
1 (free) for wrappers that keep an exact set of live buffer pointers.

Semantics to keep in mind:

* Process-wide.  The hook stays for the rest of the process (uninstall() exists, but tests
  should not need it); the wrappers are thread-safe and call MLX's originals, so other tests in the
  same pytest process keep working.  Installing twice returns the same counter.
* Only buffers allocated AFTER install are counted.  A free of an older buffer just goes to the
  original free (see ``untracked_frees()``).  Compare counts before/after an operation (deltas),
  or install before creating any arrays if you need absolute values.
* ``live()`` counts NON-EMPTY buffers (requested size > 0), like Metal's resident-buffer count;
  ``live_all()`` includes zero-size ones.  Every reader calls ``mx.synchronize()`` first:
  MLX's worker threads allocate and free in-flight temporaries until the stream is idle.
* ``live_bytes()`` sums MLX's own accounting per buffer (the allocator's size(), which is what
  ``mx.get_active_memory()`` adds and subtracts), so with nothing older alive it equals
  ``mx.get_active_memory()``; with the buffer cache on (default) a reused cached buffer counts at
  its cached size, exactly as MLX accounts it.
* Arrays kept alive by Python reference cycles are live until the GC runs; pass
  ``collect=True`` to the readers to run ``gc.collect()`` first.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

_SRC = Path(__file__).with_name("exact_buffers.c")
_ALLOCATOR_SYMBOL = "_ZN3mlx4core9allocator9allocatorEv"  # mlx::core::allocator::allocator()
_lock = threading.Lock()
_counter: ExactBufferCounter | None = None
_lib: ctypes.CDLL | None = None  # kept forever: the vtable points into it


def _build() -> Path:
    """Compile the shim (once per source/platform hash) and return the .so path."""
    src = _SRC.read_bytes()
    cc = os.environ.get("CC") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("exact_buffers: gcc not found on PATH (needed to build tests/exact_buffers.c)")
    key = hashlib.sha256(src + platform.machine().encode() + cc.encode()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / "mlx_watchdog_exact_buffers"
    out = out_dir / f"exact_buffers_{key}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".build_{key}_{os.getpid()}_{threading.get_ident()}.so"
    cmd = [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SRC), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"exact_buffers: building the shim failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)  # atomic: concurrent builders (xdist workers) never see half a file
    return out


def _libmlx_path() -> str:
    """The libmlx.so this process has loaded (mlx.core must be imported first)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path) == "libmlx.so":
                    return path
    except OSError:
        pass
    import mlx

    for base in mlx.__path__:
        cand = Path(base) / "lib" / "libmlx.so"
        if cand.exists():
            return str(cand)
    raise RuntimeError("exact_buffers: libmlx.so not found (not loaded and not under mlx/lib/)")


def _load_shim() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(_build()))
        lib.install.argtypes = [ctypes.c_void_p]
        lib.install.restype = ctypes.c_int
        lib.uninstall.restype = ctypes.c_int
        lib.installed.restype = ctypes.c_int
        for name in ("live_count", "live_nonempty_count", "untracked_frees", "malloc_calls", "free_calls"):
            getattr(lib, name).restype = ctypes.c_long
        lib.live_bytes.restype = ctypes.c_size_t
        _lib = lib
    return _lib


def _sync() -> None:
    import mlx.core as mx

    mx.synchronize()
    try:  # the CPU stream, in case the default device is not the CPU
        mx.synchronize(mx.default_stream(mx.cpu))
    except Exception:
        pass


class ExactBufferCounter:
    """Readers of the shim's counters. Get one with ``install()``."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def _read(self, name: str, sync: bool, collect: bool) -> int:
        if collect:
            gc.collect()
        if sync:
            _sync()
        return int(getattr(self._lib, name)())

    def live(self, *, sync: bool = True, collect: bool = False) -> int:
        """Live non-empty buffers allocated since install (after mx.synchronize())."""
        return self._read("live_nonempty_count", sync, collect)

    def live_all(self, *, sync: bool = True, collect: bool = False) -> int:
        """Live buffers allocated since install, zero-size ones included."""
        return self._read("live_count", sync, collect)

    def live_bytes(self, *, sync: bool = True, collect: bool = False) -> int:
        """Bytes (MLX's own accounting) of the live buffers allocated since install."""
        return self._read("live_bytes", sync, collect)

    def untracked_frees(self) -> int:
        """Frees of buffers that were allocated before install (passed straight through)."""
        return int(self._lib.untracked_frees())

    def stats(self, *, sync: bool = True) -> dict[str, int]:
        if sync:
            _sync()
        lib = self._lib
        return {
            "live": int(lib.live_nonempty_count()),
            "live_all": int(lib.live_count()),
            "live_bytes": int(lib.live_bytes()),
            "untracked_frees": int(lib.untracked_frees()),
            "malloc_calls": int(lib.malloc_calls()),
            "free_calls": int(lib.free_calls()),
        }

    @property
    def installed(self) -> bool:
        return bool(self._lib.installed())


def install() -> ExactBufferCounter:
    """Hook MLX's CPU allocator (process-wide, idempotent) and return the counter.

    Raises RuntimeError naming what is missing: gcc, libmlx.so, the allocator() symbol, or a
    non-CommonAllocator allocator (Metal / CUDA builds)."""
    global _counter
    with _lock:
        if _counter is not None and _counter.installed:
            return _counter
        import mlx.core as mx  # loads libmlx.so

        lib = _load_shim()
        path = _libmlx_path()
        mode = getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL
        try:
            mlx_lib = ctypes.CDLL(path, mode=mode)
        except OSError:
            mlx_lib = ctypes.CDLL(path)
        try:
            get_allocator = getattr(mlx_lib, _ALLOCATOR_SYMBOL)
        except AttributeError:
            raise RuntimeError(
                f"exact_buffers: symbol {_ALLOCATOR_SYMBOL} (mlx::core::allocator::allocator()) "
                f"not exported by {path}"
            ) from None
        get_allocator.argtypes = []
        get_allocator.restype = ctypes.c_void_p
        rc = lib.install(get_allocator())
        if rc == -1:
            raise RuntimeError(
                "exact_buffers: MLX's allocator is not mlx::core::allocator::CommonAllocator "
                f"(typeinfo N3mlx4core9allocator15CommonAllocatorE); mlx {mx.__version__} is not a "
                "Linux CPU build this shim understands"
            )
        if rc != 0:
            raise RuntimeError(f"exact_buffers: install failed (code {rc}: -2 mprotect, -3 out of memory)")
        _counter = ExactBufferCounter(lib)
        _self_check(_counter)
        return _counter


def _self_check(counter: ExactBufferCounter) -> None:
    """Prove the calls go through the wrappers: one fresh evaluated array = one more buffer."""
    import mlx.core as mx

    m0 = counter._lib.malloc_calls()
    before = counter.live_all()
    a = mx.arange(7, dtype=mx.int32) * 3
    mx.eval(a)
    grew = counter.live_all() - before
    calls = counter._lib.malloc_calls() - m0
    del a
    if calls < 1 or grew < 1:
        uninstall()
        raise RuntimeError("exact_buffers: installed, but MLX allocations do not reach the wrappers")


def uninstall() -> None:
    """Restore MLX's original vtable slots and forget all tracked pointers."""
    global _counter
    with _lock:
        if _lib is not None:
            _lib.uninstall()
        _counter = None
