"""A count of the live MLX buffers of the whole process, read at MLX's allocator.

The graph walk counts what hangs off the caches it is handed; a leak anywhere else in the process
(a server's own per-step outputs kept lazily, a compiled function's cache entry per input shape)
is invisible to it. This count sees every buffer MLX makes and frees: ``process_count.c``, built
with the system C compiler at first use (once per source and platform, in a per-user cache
folder) and loaded with ctypes, swaps the malloc and free slots of the vtable of MLX's allocator
object for wrappers that move one atomic counter (non-empty buffers made minus those freed).

It counts from its install on (the first ``Watchdog`` that asks for it): buffers made before are
not known, and their frees count -1. So it is read as the watchdog reads growth: at each walk,
what the process holds beyond what the walk counted in the caches, from the first reading on.
A launcher (``serve``, ``run``, ``instrument()`` as mlx-lm's loader is imported) installs it
before the program loads its model (``start_early``): where MLX then holds next to nothing (a
random key), it counts every buffer, and what the process holds beyond the caches is read whole
from the first reading, not only what it gains after it (a server's own arrays, its prompt
cache, what MLX holds with no Python reference: 46-53 buffers in a busy tiny server). The
walk's own rate stays its own (exact for the caches); this part's growth is added to it, as
growth no named site explains (``Forecast.unattributed_buffers_per_step``).

It checks itself once, at install: the allocator's symbol found, its class one of ``ACCEPTED``
(read from its vtable's typeinfo), and a self-test (an array made and freed moves the count by
+1, then back, through both wrappers). Anything that fails turns it off for the process, says why
once (a log line, and ``process_count_off`` on every watchdog that asked), and never raises.

Reading it is an atomic load: no ``mx.synchronize()``, so it never waits for the program's
stream. At the entry of a step the step before may still be computing (mlx-lm evaluates a step
while the next one's graph is built), its temporaries alive. So a reading is the lowest count
over the walk (``mark`` as it starts, read once the walk has looked at the caches): what that
step frees meanwhile is not in it. What it still holds when the walk ends only adds to a
reading, now and then; ``outside_rate`` reads the growth under such spikes, and reports it only
once it stands out of them. (A window reaching further back, from the step before, would hold no
temporaries but would lag: it would miss what a step still computing then made, a prompt's
caches, until the next reading: a jump read as growth.)
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

from . import forecast as fc

logger = logging.getLogger("mlx_watchdog")

# Allocator classes (mangled, from the vtable's typeinfo) the count is on for, and why.
ACCEPTED = {
    # Checked against tests/exact_buffers.py's count of every buffer (mlx 0.32.4, Linux x86-64).
    "N3mlx4core9allocator15CommonAllocatorE": "MLX's CPU allocator (Linux, no GPU)",
    # Read from mlx/backend/metal/allocator.h (malloc and free are virtual, called through the
    # vtable), never run here: on only where the self-test passes.
    "N3mlx4core5metal14MetalAllocatorE": "MLX's Metal allocator (unverified: on where the self-test passes)",
}
# Not accepted, and why (mlx/backend/cuda/allocator.h): most of its buffers are made by
# malloc_async, a plain member function that never goes through the vtable.
REFUSED = {
    "N3mlx4core2cu13CudaAllocatorE": "MLX's CUDA allocator makes most buffers with malloc_async, "
    "outside the vtable: this count would miss them",
}

_ALLOCATOR_SYMBOL = "_ZN3mlx4core9allocator9allocatorEv"  # mlx::core::allocator::allocator()
_SOURCE = "process_count.c"
PROBE_ELEMENTS = 12_289  # float32: a 49,156-byte probe, a size nothing else is likely to ask for
SELF_TEST_TRIES = 5  # the count moves with other threads' work: a busy process may need a retry
FREE_WAIT_SECONDS = 0.5  # MLX's worker may drop its last reference to the probe just after eval
COMPILE_TIMEOUT = 60.0
ENV = "MLX_WATCHDOG_PROCESS_COUNT"  # on, off or auto: what process_count="auto" does
# Readings kept of what the process holds beyond the caches (as many as the growth fit keeps): a
# leak that starts is read once it has grown over half of their steps.
OUTSIDE_WINDOW = 64
OUTSIDE_READINGS = 5  # its growth is read from this many readings (two in each half of their steps)...
OUTSIDE_SPAN = 48  # ...spanning this many steps: a busy machine's spikes can last a few dense readings
# A decode's first steps make a few buffers once (its first tokens, the sampler's state): readings
# of the steps just after the first are left out of the growth.
OUTSIDE_SETTLE = 8
OUTSIDE_RISE = (
    4  # buffers its floor must rise by over each half of them at least (a decode's start makes a few)
)
LEVEL_READINGS = 3  # what it holds now: the lowest of the last readings
# At most this many bytes alive in MLX when a launcher installs the count (importing mlx-lm makes
# an 8-byte random key): it then counts every buffer, but for a few.
EARLY_BYTES = 1024

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None  # kept for the process's life once installed: the vtable points into it
_failure: str | None = None  # why the count is off for this process (set once)
_told = False
_whole = False  # installed by start_early while MLX held next to nothing: the count is every buffer


class ProcessCounter:
    """One watchdog's reader of the process count (the shim is shared by all of a process's
    watchdogs; each reads it against its own walks).

    At each walk it reads how far the process count is beyond the walk's own count of the caches
    (both from their first reading): what the process holds outside the caches read. ``rate`` is
    that part's growth per step, read through the noise of a step still computing at the walk
    (``outside_rate``); the walk's own rate stays its own, exact for the caches."""

    name = "process"  # Forecast.source

    def __init__(self, lib: ctypes.CDLL, whole: bool = False):
        self._lib = lib
        self._marked = False
        self.last_raw = 0  # the raw count of the last reading
        # Beyond the walk at the first reading, not known to be growth (0: the count is every
        # buffer, so all that the process holds beyond the caches is resident).
        self._origin: float | None = 0.0 if whole else None
        self._first_step = 0
        self.outside: collections.deque[tuple[int, float]] = collections.deque(maxlen=OUTSIDE_WINDOW)
        # The highest spike above the floor each reading saw (noise, for the readings after it).
        self.spikes: collections.deque[float] = collections.deque(maxlen=2 * OUTSIDE_WINDOW)
        self.rate = 0.0  # buffers per step the process grows outside the caches read
        self.measured = False  # its readings span enough steps for a rate (outside_rate's 0 is one)
        # (resident, raw count) of the last reading, one tuple: the exporter's thread reads it
        self._base: tuple[float, int] | None = None
        # Called at the entry of each step (an atomic store; the C function itself, no Python
        # frame: every step): the count between walks is the lowest since then, so what the step
        # before made is in it and its temporaries, freed, are not.
        self.step: Callable[[], object] = lib.low_reset
        lib.low_reset()

    def resident_now(self) -> float | None:
        """The resident count now, from any thread: the last reading's, moved as the count moved
        since (a request joined or left, caches died, the fix cut chains: all of it as it happens,
        with no walk), by the lowest count since this step's entry. None before a reading."""
        base = self._base
        if base is None:
            return None
        return base[0] + int(self._lib.low()) - base[1]

    def raw(self) -> int:
        """Non-empty buffers made minus those freed since the install (may be negative)."""
        return int(self._lib.live())

    def mark(self) -> None:
        """Start a reading: the next ``reading`` is the lowest count since."""
        self._lib.low_reset()
        self._marked = True

    def reading(self, step: int, walked: float) -> float:
        """One reading at a walk of ``step`` that counted ``walked`` buffers: the buffers of the
        process, never fewer than ``walked`` (the walk's arrays are alive), and ``rate`` updated."""
        raw = self.last_raw = int(self._lib.low() if self._marked else self._lib.live())
        self._marked = False
        beyond = raw - walked
        if self._origin is None:
            self._origin = beyond
        if not self.outside:
            self._first_step = step
        if step - self._first_step >= OUTSIDE_SETTLE or not self.outside:
            self.outside.append((step, beyond - self._origin))
        self.rate, spike = outside_rate(self.outside, max(self.spikes, default=0.0))
        self.measured = spanned(self.outside)
        self.spikes.append(spike)
        # A spike of temporaries in the latest reading is not held: the lowest of the last few.
        level = min(value for _, value in list(self.outside)[-LEVEL_READINGS:])
        resident = walked + max(0.0, level)
        self._base = (resident, raw)
        return resident


def spanned(readings: Sequence[tuple[int, float]]) -> bool:
    """Do ``(step, buffers)`` readings span enough for a rate: ``OUTSIDE_READINGS`` steps at least,
    ``OUTSIDE_SPAN`` steps apart from first to last?"""
    steps = {at for at, _ in readings}
    return len(steps) >= OUTSIDE_READINGS and max(steps) - min(steps) >= OUTSIDE_SPAN


def outside_rate(readings: Sequence[tuple[int, float]], noise: float = 0.0) -> tuple[float, float]:
    """The growth per step of ``(step, buffers)`` readings whose noise only adds (temporaries of a
    step in flight, now and then, sometimes for several readings in a row on a busy machine), and
    the highest spike above their floor. The rate is the slope of their floor (``floor_slope``),
    which a spike does not raise, the last reading left out (nothing after it says whether it is
    one). Growth when the floor, over all the readings and over each half of their steps, rises by
    ``forecast.UNATTRIBUTED_THRESHOLD`` a step or more, in each half by more than twice the highest
    spike seen (here, or ``noise``: seen before) and ``OUTSIDE_RISE`` buffers at least: a one-off
    allocation (a jump, flat on either side; a few buffers as a decode starts) or a run of spikes is
    none. 0 before ``OUTSIDE_READINGS`` readings spanning ``OUTSIDE_SPAN`` steps."""
    points = sorted(dict(sorted(readings, key=lambda p: -p[1])).items())  # one per step, its lowest
    if len(points) < 2:
        return 0.0, 0.0
    hull = lower_hull(points)
    spike = max(y - floor_at(hull, x) for x, y in points)
    if not spanned(points):
        return 0.0, spike
    # Halves of the steps (the first readings are dense), sharing the reading nearest the middle.
    middle = (points[0][0] + points[-1][0]) / 2
    k = max(i for i, (step, _) in enumerate(points) if step <= middle)
    halves = (points[: k + 1], points[k:])
    if min(len(half) for half in halves) < 2 or floor_slope(points, hull) < fc.UNATTRIBUTED_THRESHOLD:
        return 0.0, spike
    for half in halves:
        rate = floor_slope(half, lower_hull(half))
        rise = rate * (half[-1][0] - half[0][0])
        if rate < fc.UNATTRIBUTED_THRESHOLD or rise <= max(OUTSIDE_RISE, 2 * max(noise, spike)):
            return 0.0, spike
    verified = points[:-1]
    rate = floor_slope(verified, lower_hull(verified))
    return (rate if rate >= fc.UNATTRIBUTED_THRESHOLD else 0.0), spike


def lower_hull(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull of ``(step, value)`` points, steps increasing: the floor under them."""
    hull: list[tuple[int, float]] = []
    for x, y in points:
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0) > 0:  # a left turn: (x1, y1) stays
                break
            hull.pop()
        hull.append((x, y))
    return hull


def floor_at(hull: Sequence[tuple[int, float]], x: float) -> float:
    """The floor's value at step ``x`` (within the hull's steps)."""
    for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return hull[0][1]


def floor_slope(points: Sequence[tuple[int, float]], hull: Sequence[tuple[int, float]]) -> float:
    """The slope of the floor (``hull``, ``lower_hull(points)``) at the middle step of ``points``.
    A spike lies above the floor, except at either end, where every point is on it: a spike at the
    end steepens the last edge, one at the start flattens the first. So where the middle is a
    corner of the hull, the flatter of its two edges."""
    if len(hull) < 2:
        return 0.0
    middle = (points[0][0] + points[-1][0]) / 2
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in zip(hull, hull[1:])]
    at = [k for k, ((x0, _), (x1, _)) in enumerate(zip(hull, hull[1:])) if x0 <= middle <= x1]
    return min(slopes[k] for k in at)


def counter(mode: bool | str = "auto") -> tuple[ProcessCounter | None, str | None]:
    """A reader of the process count, or None and why not. ``mode``: ``True`` (wanted: a failure
    is logged as a warning), ``"auto"`` (as ``$MLX_WATCHDOG_PROCESS_COUNT`` says: on, off, or by
    default auto: on where the self-check passes, a failure logged at info level) or ``False``
    (off). Never raises."""
    if mode == "auto":
        setting = os.environ.get(ENV, "auto").strip().lower()
        if setting in ("off", "0", "false", "no"):
            return None, f"off ({ENV}={os.environ[ENV]})"
        if setting in ("on", "1", "true", "yes"):
            mode = True
    if mode is False:
        return None, "off (process_count=False)"
    with _lock:
        if _lib is None and _failure is None:
            _start()
        lib, failure = _lib, _failure
        _tell(failure, loud=mode is True)
    if lib is None:
        return None, failure
    return ProcessCounter(lib, whole=_whole), None


def start_early(mode: bool | str = "auto") -> None:
    """Install the count now, before the program loads its model (a launcher's first step), as
    ``counter(mode)`` would: where MLX holds next to nothing yet, the count is then every buffer
    of the process. Never raises."""
    global _whole
    try:
        import mlx.core as mx

        before = mx.get_active_memory()
    except Exception:  # no MLX: counter() says why when a watchdog asks
        return
    with _lock:
        fresh = _lib is None and _failure is None
    if not fresh:
        return
    counter(mode)
    with _lock:
        _whole = _lib is not None and before <= EARLY_BYTES


def status() -> str:
    """ "on", "not started" or "off: <why>", for this process."""
    if _lib is not None:
        return "on"
    return "not started" if _failure is None else f"off: {_failure}"


def _tell(failure: str | None, loud: bool) -> None:
    global _told
    if failure is None or _told:
        return
    _told = True
    log = logger.warning if loud else logger.info
    log(
        "mlx-watchdog: the process-wide buffer count is off: %s (the forecast reads the caches only)", failure
    )


def _start() -> None:
    """Build, load, check and install the shim; on any failure leave ``_failure`` saying why."""
    global _lib, _failure
    try:
        lib = load_shim(build_shim())
        failure = _install(lib)
    except Exception as exc:  # whatever happens, the program goes on without the count
        failure = f"{type(exc).__name__}: {exc}"
    if failure is None:
        _lib = lib
    else:
        _failure = failure


# ----------------------------------------------------------------------------- the build


def cache_dir() -> Path:
    """Where the built shim is kept: ``$MLX_WATCHDOG_CACHE_DIR``, else the user's cache folder."""
    env = os.environ.get("MLX_WATCHDOG_CACHE_DIR")
    if env:
        return Path(env)
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "mlx-watchdog"


def _compiler() -> list[str]:
    env = os.environ.get("CC")
    if env:
        return shlex.split(env)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise RuntimeError("no C compiler found (cc, gcc or clang on PATH, or CC) to build the count")


def _private(folder: Path) -> bool:
    """Ours and writable by us alone: a library loaded from it cannot have been swapped by another user."""
    try:
        st = folder.stat()
    except OSError:
        return False
    getuid = getattr(os, "getuid", None)
    return (getuid is None or st.st_uid == getuid()) and not st.st_mode & 0o022


def build_shim() -> Path:
    """Compile ``process_count.c`` (once per source, compiler and platform) and return the
    library's path. Raises when no compiler is found or the build fails."""
    source = resources.files(__package__).joinpath(_SOURCE).read_bytes()
    cc = _compiler()
    key = hashlib.sha256(source + "\0".join([*cc, sys.platform, platform.machine()]).encode()).hexdigest()[
        :16
    ]
    folder = cache_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        pass
    if not _private(folder):  # not ours, or others may write there: built afresh, for this process only
        folder = Path(tempfile.mkdtemp(prefix="mlx-watchdog-"))
    out = folder / f"process_count-{key}.so"
    if out.exists():
        return out
    stem = f".build-{key}-{os.getpid()}-{threading.get_ident()}"
    src, tmp = folder / f"{stem}.c", folder / f"{stem}.so"
    src.write_bytes(source)
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"building the count failed: {exc}") from None
    finally:
        src.unlink(missing_ok=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"building the count failed ({shlex.join(cmd)}): {tail}")
    os.replace(tmp, out)  # atomic: another process building at once never loads half a file
    return out


def load_shim(path: Path) -> ctypes.CDLL:
    """The built shim, its functions typed (a second load of the same path is the same library)."""
    lib = ctypes.CDLL(str(path))
    lib.install.argtypes = [ctypes.c_void_p]
    lib.install.restype = ctypes.c_int
    lib.uninstall.restype = ctypes.c_int
    lib.installed.restype = ctypes.c_int
    lib.type_name.argtypes = [ctypes.c_void_p]
    lib.type_name.restype = ctypes.c_char_p
    lib.live.restype = ctypes.c_long
    lib.low.restype = ctypes.c_long
    lib.set_probe.argtypes = [ctypes.c_size_t]
    lib.probe_mallocs.restype = ctypes.c_long
    lib.probe_frees.restype = ctypes.c_long
    return lib


# ----------------------------------------------------------------------------- the checks


def _libmlx() -> ctypes.CDLL:
    """The libmlx this process loaded (mlx.core imported first)."""
    import mlx

    names = ("libmlx.so", "libmlx.dylib")
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                candidate = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(candidate) in names:
                    path = candidate
                    break
    except OSError:
        pass
    if path is None:
        for base in mlx.__path__:
            for name in names:
                if (Path(base) / "lib" / name).exists():
                    path = str(Path(base) / "lib" / name)
    if path is None:
        raise RuntimeError("libmlx not found (not among the loaded libraries, nor under mlx/lib/)")
    mode = getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL
    try:
        return ctypes.CDLL(path, mode=mode)
    except OSError:
        return ctypes.CDLL(path)


def demangle(name: str) -> str:
    """``N3mlx4core9allocator15CommonAllocatorE`` -> ``mlx::core::allocator::CommonAllocator``
    (nested names only: what an allocator class's typeinfo holds)."""
    if not (name.startswith("N") and name.endswith("E")):
        return name
    parts, i = [], 1
    while i < len(name) - 1:
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        if j == i:
            return name
        n = int(name[i:j])
        parts.append(name[j : j + n])
        i = j + n
    return "::".join(parts)


def allocator_address() -> int:
    """The address of MLX's allocator object (``mlx::core::allocator::allocator()``)."""
    import mlx.core  # noqa: F401  (loads libmlx)

    try:
        get_allocator = getattr(_libmlx(), _ALLOCATOR_SYMBOL)
    except AttributeError:
        raise RuntimeError(
            f"libmlx does not export {_ALLOCATOR_SYMBOL} (mlx::core::allocator::allocator())"
        ) from None
    get_allocator.argtypes = []
    get_allocator.restype = ctypes.c_void_p
    return int(get_allocator())


def _install(lib: ctypes.CDLL) -> str | None:
    """Install the shim on MLX's allocator and check it; None when it counts, else why not (the
    shim is then taken out again)."""
    import mlx.core as mx

    allocator = allocator_address()
    raw_name = lib.type_name(allocator)
    type_name = raw_name.decode("ascii", "replace") if raw_name else "(no typeinfo)"
    if type_name not in ACCEPTED:
        why = REFUSED.get(type_name, "not one this count was checked on")
        version = getattr(mx, "__version__", "?")
        return f"MLX's allocator is {demangle(type_name)} (mlx {version}): {why}"
    rc = lib.install(allocator)
    if rc != 0:
        return f"could not patch the allocator's vtable (mprotect failed, code {rc})"
    failure = _self_test(lib)
    if failure is not None:
        if lib.uninstall() != 0:  # another hook on top of it: it stays, unread
            failure += " (the hook stays in place: another one was installed on top of it)"
        return failure
    return None


def _self_test(lib: ctypes.CDLL) -> str | None:
    """An array made and freed, seen by both wrappers, moves the count by +1 and back."""
    import mlx.core as mx

    seen = ""
    for _ in range(SELF_TEST_TRIES):
        lib.set_probe(PROBE_ELEMENTS * 4)
        before = lib.live()
        probe = mx.arange(PROBE_ELEMENTS, dtype=mx.float32)
        mx.eval(probe)
        made, during = lib.probe_mallocs(), lib.live()
        del probe
        deadline = time.monotonic() + FREE_WAIT_SECONDS
        while lib.probe_frees() < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        freed, after = lib.probe_frees(), lib.live()
        lib.set_probe(0)
        if made == 0:
            return "MLX's allocations do not reach the hooked vtable (a test array was made without it)"
        if freed == 0:
            return "MLX's frees do not reach the hooked vtable (a test array was freed without it)"
        if made == 1 and freed == 1 and during - before == 1 and after == before:
            return None
        seen = f"+{during - before} for one array, then {after - before:+d} once freed"
    return f"the count did not follow a test array ({seen}, {SELF_TEST_TRIES} tries)"
