"""A hook that runs right after a module executes, the first time the program imports it.

    hook = PostImportHook({"mlx.core"}, patch)   # patch(module) once mlx.core has executed
    hook.install()                               # first on sys.meta_path
    hook.remove()

Nothing is imported here: the finder finds the module through the finders after it and hands
it a loader that runs the module's own loader, then the callback. The module keeps its own
loader (``__loader__``, ``__spec__.loader``). A callback that fails is logged; the import
succeeds and the program goes on.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

logger = logging.getLogger("mlx_watchdog")


class PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``on_import(module)`` right after a module named in ``names`` executes."""

    def __init__(self, names: Iterable[str], on_import: Callable[[ModuleType], Any]):
        self.names = frozenset(names)
        self.on_import = on_import
        self._finding = threading.local()

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _RunAfterExec(spec.loader, self.on_import)
        return spec


class _RunAfterExec(importlib.abc.Loader):
    """Runs the module's own loader, then the callback."""

    def __init__(self, loader: Any, on_import: Callable[[ModuleType], Any]):
        self.loader = loader
        self._on_import = on_import

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        try:
            self._on_import(module)
        except Exception as exc:  # the import succeeded; the program goes on
            logger.warning("mlx-watchdog: cannot instrument %s: %r", module.__name__, exc)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)
