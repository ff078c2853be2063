"""Metrics of several processes on one endpoint (``mlx-watchdog run``): each process writes a
snapshot of its own exposition to a folder; the supervisor serves them merged, with a ``pid``
label on every sample.

    # in each process that watches models
    SnapshotWriter(folder).start()            # <folder>/<pid>.prom, when its watchdogs change
    # in the supervisor
    start_processes_server(folder, 9464)      # /metrics: every live process's families, pid="..."

A process writes what its own ``WatchdogCollector`` exports, from a daemon thread, at most once
per ``interval`` and only when its watchdogs changed (a step, one retired or added, the decode
going idle); the file is replaced atomically. At exit it writes once more, so that its last word
(a stop, its forecast) is in the file. At each scrape the supervisor reads every file, merges the
families by name and adds ``pid``. The file of a process that exited is served ``keep_exited``
seconds more from when a scrape first found it gone (a training run stopped a second in is still
seen by a scrape a minute apart), then removed.
It adds each process's standard ``process_*`` metrics (memory, CPU, open files) itself, read
through psutil at scrape time: they are always fresh, while a snapshot of an idle process is
rewritten only when something changes.

Not prometheus_client's multiprocess mode: that mode merges metric objects (``Gauge``,
``Counter``) that write their values to memory-mapped files as they change; it does not see a
collector that builds its families at scrape time, as ``WatchdogCollector`` does, and a label set
once written to those files cannot be removed (a leak site that stopped, a retired watchdog,
would be exported for ever; prometheus_client warns "Removal of labels has not been implemented
in multi-process mode yet").
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from ..core.live import hide_inherited, live_watchdogs
from .collector import WatchdogCollector
from .server import DEFAULT_PORT, MetricsServer, start_metrics_server

logger = logging.getLogger("mlx_watchdog")

DEFAULT_INTERVAL = 1.0  # seconds between two looks at the watchdogs (a write only when they changed)
# Seconds an exited process's last snapshot is served: two scrapes at Prometheus's default 1 minute.
KEEP_EXITED_SECONDS = 120.0
LAST_WRITE_SECONDS = 2.0  # the most a process's exit waits for its last snapshot
SUFFIX = ".prom"
PID_LABEL = "pid"
_HEADER = "# mlx-watchdog snapshot pid={pid} started={started!r}\n"
_HEADER_RE = re.compile(r"# mlx-watchdog snapshot pid=(\d+) started=([0-9.e+-]+)\n")
_START_TOLERANCE = 0.5  # seconds: a process with this pid started then is the one that wrote the file


def snapshot_path(folder: str | os.PathLike, pid: int) -> Path:
    return Path(folder) / f"{pid}{SUFFIX}"


# --------------------------------------------------------------------------- the writer

_writers: weakref.WeakSet[SnapshotWriter] = weakref.WeakSet()


class SnapshotWriter:
    """Writes this process's exposition to ``<folder>/<pid>.prom`` (see the module docstring).

    ``registry``: what to write (default: a registry holding one ``WatchdogCollector``, every
    live exported watchdog). A process that has no exported watchdog writes no file."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        interval: float = DEFAULT_INTERVAL,
        registry: CollectorRegistry | None = None,
    ):
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.folder = Path(folder)
        self.interval = float(interval)
        if registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(WatchdogCollector())
        self.registry = registry
        self.writes = 0
        self.errors = 0
        self._reset_process_state()
        _writers.add(self)
        atexit.register(_last_at_exit, weakref.ref(self))

    def _reset_process_state(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple | None = None
        self._header: str | None = None
        self._closed = False

    @property
    def path(self) -> Path:
        return snapshot_path(self.folder, os.getpid())

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> SnapshotWriter:
        """Write now, then from a daemon thread every ``interval`` when something changed."""
        with self._lock:
            if self._closed or self.running:
                return self
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="mlx-watchdog-snapshot", daemon=True)
            self._thread.start()
        return self

    def stop(self, remove: bool = True) -> None:
        """Stop writing; ``remove``: delete this process's file too."""
        self._halt_thread()
        with self._lock:
            self._closed = True
            if remove:
                _unlink(self.path)

    def _halt_thread(self) -> None:
        """End the writing thread (waiting for a write under way, two intervals at most)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, 2 * self.interval))

    def finish(self, timeout: float = LAST_WRITE_SECONDS) -> None:
        """Stop writing after one last snapshot (at exit: a stop made just before is in it). The
        file stays for the supervisor, which serves it a while and then removes it. Waits at most
        ``timeout`` for it: a daemon thread of the program may hold a watchdog mid-walk."""
        self._halt_thread()

        def last() -> None:
            try:
                self.write(force=True)
            except Exception:  # the folder is gone (the supervisor ended), or the exposition failed
                pass

        writing = threading.Thread(target=last, name="mlx-watchdog-snapshot", daemon=True)
        writing.start()
        writing.join(timeout)
        self._closed = True  # (not under the lock: a write still waiting may hold it)

    def write(self, force: bool = False) -> bool:
        """Write the snapshot if the watchdogs changed since the last one (``force``: anyway).
        Returns whether a file was written."""
        with self._lock:
            if self._closed:
                return False
            watchdogs = live_watchdogs()
            if not watchdogs:
                if self._last is not None:
                    _unlink(self.path)
                self._last = None
                return False
            # A stop or a caught error changes the exposition without a step: written too.
            signature = tuple(
                (id(wd), wd.name, wd.steps, wd.decoding(), sum(dict(wd.stops).values()), wd.internal_errors)
                for wd in watchdogs
            )
            if signature == self._last and not force:
                return False
            text = self._header_line() + generate_latest(self.registry).decode()
            path = self.path
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
            self._last = signature
            self.writes += 1
            return True

    def _run(self) -> None:
        while True:
            try:
                self.write()
            except FileNotFoundError:  # the folder is gone: the supervisor ended
                logger.debug("mlx-watchdog: snapshot folder %s is gone; no more snapshots", self.folder)
                return
            except Exception as exc:  # counted; the program goes on
                self.errors += 1
                if self.errors <= 3:
                    logger.warning("mlx-watchdog: cannot write the metrics snapshot %s: %r", self.path, exc)
            if self._stop.wait(self.interval):
                return

    def _header_line(self) -> str:
        if self._header is None:
            pid = os.getpid()
            self._header = _HEADER.format(pid=pid, started=_start_time(pid))
        return self._header

    def _after_fork_in_child(self) -> None:
        # The thread did not survive the fork; it was running if it was started and not stopped.
        was_running = self._thread is not None and not self._stop.is_set() and not self._closed
        self._reset_process_state()
        if was_running:
            self.start()


def _last_at_exit(ref: weakref.ref) -> None:
    writer = ref()
    if writer is not None:
        writer.finish()


def _after_fork_in_child() -> None:
    # Only this thread survives a fork: locks, the thread and the file name are the parent's.
    writers = list(_writers)
    if any(not writer._closed for writer in writers):  # noqa: SLF001 (this module's class)
        # The parent's file shows the watchdogs it had: here each only once it steps here.
        hide_inherited()
    for writer in writers:
        writer._after_fork_in_child()  # noqa: SLF001 (this module's class)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --------------------------------------------------------------------------- the supervisor


class ProcessesCollector:
    """A prometheus_client collector: the families of every live process's snapshot in
    ``folder``, merged by name, each sample with a ``pid`` label; plus the standard ``process_*``
    metrics of those processes (``process_metrics=False`` leaves them out).

    A file is parsed again only when it was replaced: an idle process costs a scrape no parse."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        process_metrics: bool = True,
        keep_exited: float = KEEP_EXITED_SECONDS,
    ):
        if not keep_exited >= 0:
            raise ValueError(f"keep_exited must be a number of seconds >= 0, got {keep_exited!r}")
        self.folder = Path(folder)
        self.process_metrics = process_metrics
        self.keep_exited = float(keep_exited)
        self._exited: dict[Path, float] = {}  # a gone process's file -> when a scrape first saw it gone
        self._warned: set[str] = set()
        self._parsed: dict[Path, _Snapshot] = {}
        self._lock = threading.Lock()  # scrapes may come on several server threads at once

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families, pids = self._merged()
        yield from families.values()
        if self.process_metrics and pids:
            yield from _process_families(pids)

    def _merged(self) -> tuple[dict[str, Metric], list[int]]:
        families: dict[str, Metric] = {}
        pids = []
        seen = set()
        for pid, path in self._snapshots():
            snapshot = self._snapshot(pid, path)
            if snapshot is None:
                continue
            if _alive(pid, snapshot.started):
                pids.append(pid)  # (its process_* metrics: read now, from the live process)
                self._exited.pop(path, None)  # (a new process with a gone one's pid)
            elif not self._served_after_exit(path):
                continue
            seen.add(path)
            for family in snapshot.families:
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                elif merged.type != family.type:
                    self._warn(
                        f"type-{family.name}",
                        "mlx-watchdog: %s is a %s in one process and a %s in another; pid %d's left out",
                        family.name,
                        merged.type,
                        family.type,
                        pid,
                    )
                    continue
                merged.samples.extend(family.samples)
        for path in [p for p in self._parsed if p not in seen]:
            del self._parsed[path]
        for path in [p for p in self._exited if p not in seen]:
            del self._exited[path]
        return families, pids

    def _served_after_exit(self, path: Path) -> bool:
        """Is the file of a process that exited still served (``keep_exited``)? Removed once not."""
        now = time.monotonic()
        gone_since = self._exited.setdefault(path, now)
        if now - gone_since < self.keep_exited:
            return True
        _unlink(path)
        return False

    def _snapshot(self, pid: int, path: Path) -> _Snapshot | None:
        """The file's families with the pid label, parsed again only when the file changed."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)  # a write replaces the file: a new inode
        cached = self._parsed.get(path)
        if cached is not None and cached.key == key:
            return cached
        text = _read(path)
        if text is None:
            return None
        try:
            label = str(pid)
            families = []
            for family in text_string_to_metric_families(text):
                family.samples = [s._replace(labels={**s.labels, PID_LABEL: label}) for s in family.samples]
                families.append(family)
        except Exception as exc:
            self._warn(f"parse-{pid}", "mlx-watchdog: cannot parse %s: %r", path, exc)
            return None
        match = _HEADER_RE.match(text)
        snapshot = _Snapshot(key, float(match.group(2)) if match else None, families)
        self._parsed[path] = snapshot
        return snapshot

    def _snapshots(self) -> list[tuple[int, Path]]:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            stem, suffix = os.path.splitext(name)
            if suffix == SUFFIX and stem.isdigit():
                found.append((int(stem), self.folder / name))
        return sorted(found)

    def _warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    key: tuple  # the file's inode, modification time and size when it was parsed
    started: float | None  # its process's start time, from the header
    families: list[Metric]  # the samples labelled with the pid


class ProcessesRegistry(CollectorRegistry):
    """The supervisor's registry. It has no watchdog of its own: the exporter's
    ``WatchdogCollector``, which ``start_metrics_server`` registers, is left out (its empty
    families would repeat the names of the merged ones)."""

    def register(self, collector: Any) -> None:
        if isinstance(collector, WatchdogCollector):
            return
        super().register(collector)


def start_processes_server(
    folder: str | os.PathLike,
    port: int = DEFAULT_PORT,
    addr: str = "127.0.0.1",
    *,
    keep_exited: float = KEEP_EXITED_SECONDS,
    **options: Any,
) -> MetricsServer:
    """Serve ``/metrics`` with the snapshots in ``folder`` merged (:class:`ProcessesCollector`).
    ``options`` go to :func:`~mlx_watchdog.exporters.server.start_metrics_server` (TLS, limits)."""
    registry = ProcessesRegistry()
    registry.register(ProcessesCollector(folder, keep_exited=keep_exited))
    return start_metrics_server(port, addr, registry=registry, **options)


# --------------------------------------------------------------------------- helpers


def _process_families(pids: list[int]) -> Iterator[Metric]:
    try:
        import psutil
    except ImportError:
        return
    labels = [PID_LABEL]
    rss = GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.", labels=labels)
    vms = GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.", labels=labels)
    started = GaugeMetricFamily(
        "process_start_time_seconds", "Start time of the process since unix epoch in seconds.", labels=labels
    )
    cpu = CounterMetricFamily(
        "process_cpu_seconds",
        "Total user and system CPU time spent in seconds.",
        labels=labels,
        unit="seconds",
    )
    fds = GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", labels=labels)
    for pid in pids:
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                memory, times, created = process.memory_info(), process.cpu_times(), process.create_time()
                open_fds = process.num_fds() if hasattr(process, "num_fds") else None
        except Exception:  # gone since, or not ours to read
            continue
        label = [str(pid)]
        rss.add_metric(label, memory.rss)
        vms.add_metric(label, memory.vms)
        started.add_metric(label, created)
        cpu.add_metric(label, times.user + times.system)
        if open_fds is not None:
            fds.add_metric(label, open_fds)
    yield from (rss, vms, started, cpu, fds)


def _start_time(pid: int) -> float:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:
        return 0.0


def _alive(pid: int, started: float | None) -> bool:
    """Does the process that started at ``started`` still run (not a later process with its pid)?"""
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        if not started:  # no start time written: the pid alone says
            return True
        return abs(process.create_time() - started) < _START_TOLERANCE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to read: it runs
        return True


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
