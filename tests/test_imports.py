"""What the import rules of docs/contributing.md need beyond the tools that check them.

The tools, configured in pyproject.toml and run by ``make lint``:

* import-linter (``[tool.importlinter]``): the layers (the core imports nothing above it, the
  exporters only the core), the tiny models for the command line only, no import circle among
  the modules of a package; every import counts, function-local and TYPE_CHECKING ones included.
* ruff: ``PLC2701`` (``from mlx_watchdog.x import _y``) and ``SLF001`` (``obj._y`` on anything but
  ``self`` or ``cls``).

What they do not see, checked here by reading the source with ``ast`` (pyproject.toml's
package-dir maps watchdog/ onto ``mlx_watchdog`` and exporters/ onto ``mlx_watchdog.exporters``):

* A relative import of a private name (``from .x import _y``): ruff's PLC2701 skips relative
  imports, and every import inside the package is relative.
* A private name of a base class in another module used through ``self``, ``cls`` or
  ``super()`` in a subclass: SLF001 exempts ``self``.
* A circle through a package's own ``__init__`` (a module that imports the package it is in,
  whose ``__init__`` imports it back): import-linter's ``acyclic_siblings`` compares sibling
  modules only. Imports under ``if TYPE_CHECKING:`` never run and close no circle.
* Imports by ``importlib``: grimp reads import statements only. The package root loads its names
  lazily that way; its TYPE_CHECKING imports must name the same modules, so that the contracts
  see them. No other module of the package imports one of the package by name.
* The imports a contract ignores: the exporters' import of the package root reads
  ``__version__`` and nothing else (another name would load the attachment points lazily), and
  an import the circle contract ignores is one under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mlx_watchdog"
DYNAMIC_IMPORTS = {"import_module", "__import__"}


def is_private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module of the package it imports
    names: tuple[str, ...]  # names read from target's namespace (from target import ...)
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs


class Package:
    """The modules of the package as installed, their syntax trees and their imports."""

    def __init__(self, root: Path):
        self.root = root
        self.config = tomllib.loads((root / "pyproject.toml").read_text())
        self.files: dict[str, Path] = {}
        for package, folder in self.config["tool"]["setuptools"]["package-dir"].items():
            for path in sorted((root / folder).rglob("*.py")):
                parts = path.relative_to(root / folder).with_suffix("").parts
                self.files[".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, path in self.files.items()}
        self.imports = [imp for name in self.files for imp in self._imports_of(name)]

    def where(self, module: str, line: int) -> str:
        return f"{self.files[module].relative_to(self.root)}:{line}"

    def absolute(self, module: str, name: str | None, level: int) -> str:
        if level == 0:
            return name or ""
        base = module if self.files[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(level - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{name}" if name else base

    def _imports_of(self, module: str) -> Iterator[Import]:
        for node, type_checking in _import_nodes(self.trees[module]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.files:
                        yield Import(module, alias.name, (), node.lineno, type_checking)
                continue
            source = self.absolute(module, node.module, node.level)
            if source not in self.files:
                continue
            names = []
            for alias in node.names:
                if f"{source}.{alias.name}" in self.files:
                    yield Import(module, f"{source}.{alias.name}", (), node.lineno, type_checking)
                else:
                    names.append(alias.name)
            if names:
                yield Import(module, source, tuple(names), node.lineno, type_checking)

    def origin(self, module: str, name: str, seen: frozenset[str] = frozenset()) -> tuple[str, str]:
        """Where ``module``'s ``name`` is defined, following its from-imports (re-exports)."""
        for node, _ in _import_nodes(self.trees[module]):
            if isinstance(node, ast.ImportFrom) and module not in seen:
                source = self.absolute(module, node.module, node.level)
                for alias in node.names:
                    if (alias.asname or alias.name) == name and source in self.files:
                        return self.origin(source, alias.name, seen | {module})
        return module, name

    def contract(self, kind: str) -> dict:
        (found,) = [c for c in self.config["tool"]["importlinter"]["contracts"] if c["type"] == kind]
        return found


def _import_nodes(node: ast.AST, type_checking: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement (function-local ones too), and whether it is under TYPE_CHECKING."""
    if isinstance(node, ast.If) and is_type_checking(node.test):
        for child in node.body:
            yield from _import_nodes(child, True)
        for child in node.orelse:
            yield from _import_nodes(child, type_checking)
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, type_checking
    for child in ast.iter_child_nodes(node):
        yield from _import_nodes(child, type_checking)


# --------------------------------------------------------------------------- the checks


def relative_private_imports(package: Package) -> list[str]:
    found = []
    for module, tree in package.trees.items():
        for node, _ in _import_nodes(tree):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue  # absolute ones: ruff's PLC2701
            source = package.absolute(module, node.module, node.level)
            for alias in node.names:
                if is_private(alias.name) and source != module:
                    found.append(
                        f"{package.where(module, node.lineno)}: {module} imports {source}'s {alias.name}"
                    )
    return found


def _defined_by(cls: ast.ClassDef) -> set[str]:
    """The names a class defines: in its body, and as attributes of ``self`` or ``cls``."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return names


def _classes(package: Package) -> dict[tuple[str, str], ast.ClassDef]:
    return {
        (module, node.name): node
        for module, tree in package.trees.items()
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }


def _bases(package: Package, module: str, cls: ast.ClassDef, classes: dict) -> list[tuple[str, str]]:
    """The classes of the package ``cls`` derives from directly, where its source names them."""
    found = []
    for base in cls.bases:
        if isinstance(base, ast.Name):
            key = package.origin(module, base.id)
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
            owner = package.origin(module, base.value.id)
            key = package.origin(".".join(owner), base.attr) if ".".join(owner) in package.files else owner
        else:
            continue
        if key in classes:
            found.append(key)
    return found


def inherited_private_names(package: Package) -> list[str]:
    """``self._x``, ``cls._x`` or ``super()._x`` in a class, where ``_x`` is defined by a base
    class of another module and not by the class itself or a base of its own module."""
    classes = _classes(package)
    found = []
    for (module, name), cls in classes.items():
        own, foreign, todo, seen = _defined_by(cls), {}, _bases(package, module, cls, classes), set()
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            for attr in _defined_by(classes[key]):
                if key[0] == module:
                    own.add(attr)
                else:
                    foreign.setdefault(attr, key)
            todo += _bases(package, key[0], classes[key], classes)
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
                continue
            through = node.value
            if not (
                (isinstance(through, ast.Name) and through.id in ("self", "cls"))
                or (isinstance(through, ast.Call) and getattr(through.func, "id", None) == "super")
            ):
                continue
            if node.attr in foreign and node.attr not in own:
                base_module, base = foreign[node.attr]
                found.append(
                    f"{package.where(module, node.lineno)}: {module}.{name} uses {node.attr} "
                    f"of its base class {base_module}.{base}"
                )
    return found


def circles_through_a_package(package: Package) -> list[str]:
    """A module that imports (at run time) a package it is in, whose ``__init__`` imports it back."""
    graph: dict[str, set[str]] = {name: set() for name in package.files}
    for imp in package.imports:
        if not imp.type_checking:
            graph[imp.module].add(imp.target)
    found = []
    for imp in package.imports:
        if imp.type_checking or not imp.module.startswith(imp.target + "."):
            continue
        reached, todo = set(), [imp.target]
        while todo:
            for following in graph[todo.pop()] - reached:
                reached.add(following)
                todo.append(following)
        if imp.module in reached:
            found.append(
                f"{package.where(imp.module, imp.line)}: {imp.module} imports {imp.target}, "
                f"whose __init__ imports {imp.module}"
            )
    return found


def lazy_names(package: Package) -> tuple[dict[str, str], dict[str, str]]:
    """The package root's names loaded on first use (its ``_LAZY`` table: name -> module), and
    the same read from its TYPE_CHECKING imports."""
    tree = package.trees[PACKAGE]
    (table,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_LAZY"]
    ]
    assert isinstance(table, ast.Dict)
    lazy = {ast.literal_eval(k): f"{PACKAGE}.{ast.literal_eval(v)}" for k, v in zip(table.keys, table.values)}
    typed = {
        name: imp.target
        for imp in package.imports
        if imp.module == PACKAGE and imp.type_checking
        for name in imp.names
    }
    return lazy, typed


def dynamic_imports(package: Package) -> list[str]:
    """``importlib.import_module`` / ``__import__`` of a module of the package by a constant name
    (the package root's lazy loader aside: ``lazy_names``)."""
    found = []
    for module, tree in package.trees.items():
        if module == PACKAGE:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            if (
                func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            ) not in DYNAMIC_IMPORTS:
                continue
            first = node.args[0]
            text = first.value if isinstance(first, ast.Constant) else None
            if (
                isinstance(first, ast.JoinedStr)
                and first.values
                and isinstance(first.values[0], ast.Constant)
            ):
                text = first.values[0].value
            if isinstance(text, str) and (text.startswith(".") or text.split(".")[0] == PACKAGE):
                found.append(f"{package.where(module, node.lineno)}: {module} imports {text!r} by name")
    return found


def _matches(pattern: str, module: str) -> bool:
    """import-linter's module expressions: ``*`` one level, ``**`` any number of levels."""
    regex = re.escape(pattern).replace(r"\*\*", r"[\w.]+").replace(r"\*", r"\w+")
    return re.fullmatch(regex, module) is not None


def _ignored(contract: dict) -> list[tuple[str, str]]:
    return [tuple(part.strip() for part in entry.split("->")) for entry in contract.get("ignore_imports", [])]


def root_names_read_where_the_layers_ignore_it(package: Package) -> list[str]:
    found = []
    for importer, imported in _ignored(package.contract("layers")):
        assert imported == PACKAGE, f"the layers contract ignores {importer} -> {imported}: say why here"
        for imp in package.imports:
            if imp.target == PACKAGE and _matches(importer, imp.module) and set(imp.names) != {"__version__"}:
                names = ", ".join(imp.names) or "the package itself"
                found.append(
                    f"{package.where(imp.module, imp.line)}: {imp.module} reads {names} of {PACKAGE}"
                )
    return found


def circle_ignores_that_run(package: Package) -> list[str]:
    found = []
    for importer, imported in _ignored(package.contract("acyclic_siblings")):
        imports = [imp for imp in package.imports if imp.module == importer and imp.target == imported]
        if not imports:
            found.append(f"{importer} -> {imported}: no such import")
        for imp in imports:
            if not imp.type_checking:
                found.append(f"{package.where(imp.module, imp.line)}: {importer} -> {imported} runs")
    return found


# --------------------------------------------------------------------------- the package


def test_the_modules_are_named_as_installed():
    package = Package(ROOT)
    assert package.files[PACKAGE] == ROOT / "watchdog" / "__init__.py"
    assert package.files[f"{PACKAGE}.core.watchdog"] == ROOT / "watchdog" / "core" / "watchdog.py"
    assert package.files[f"{PACKAGE}.exporters.prometheus"] == ROOT / "exporters" / "prometheus.py"
    assert len(package.imports) > 100


def test_no_private_name_crosses_a_module():
    package = Package(ROOT)
    found = relative_private_imports(package) + inherited_private_names(package)
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_circle_through_a_package_s_init():
    found = circles_through_a_package(Package(ROOT))
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_contracts_see_every_import():
    package = Package(ROOT)
    lazy, typed = lazy_names(package)
    assert lazy == typed, "the package root's _LAZY and its TYPE_CHECKING imports differ"
    assert len(lazy) >= 10
    found = dynamic_imports(package)
    assert not found, "imports import-linter cannot see:\n" + "\n".join(found)


def test_what_the_contracts_ignore_is_what_they_say():
    package = Package(ROOT)
    found = root_names_read_where_the_layers_ignore_it(package) + circle_ignores_that_run(package)
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------- the checks themselves


CONFIG = """
[tool.setuptools]
package-dir = { "mlx_watchdog" = "watchdog", "mlx_watchdog.exporters" = "exporters" }

[[tool.importlinter.contracts]]
type = "layers"
ignore_imports = ["mlx_watchdog.exporters.** -> mlx_watchdog"]

[[tool.importlinter.contracts]]
type = "acyclic_siblings"
ignore_imports = ["mlx_watchdog.core.forecast -> mlx_watchdog.core.watchdog"]
"""

CLEAN = {
    "watchdog/__init__.py": """
        import importlib
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .core.watchdog import Watchdog
        __version__ = "1"
        _LAZY = {"Watchdog": "core.watchdog"}
        def __getattr__(name):
            return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    """,
    "watchdog/core/__init__.py": "",
    "watchdog/core/watchdog.py": """
        from . import forecast

        class Watchdog:
            def __init__(self):
                self._lock = None

            def merge(self, other):
                with other._lock:
                    self._internal_error()

            def _internal_error(self):
                pass
    """,
    "watchdog/core/forecast.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .watchdog import Watchdog

        class Forecast:
            _ok = True
    """,
    "watchdog/attach/__init__.py": "from .model import watch_model\n",
    "watchdog/attach/model.py": """
        from ..core.watchdog import Watchdog

        class ModelWatchdog(Watchdog):
            def __init__(self):
                super().__init__()
                self._steps = 0

            def step(self):
                self._steps += 1

        def watch_model(model):
            from . import step  # function-local, not the package's __init__
            return ModelWatchdog()
    """,
    "watchdog/attach/step.py": "def watch_step():\n    pass\n",
    "exporters/__init__.py": "",
    "exporters/prometheus.py": "from .. import __version__\n",
}


def _package(root: Path, files: dict[str, str]) -> Package:
    (root / "pyproject.toml").write_text(CONFIG)
    for path, source in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(source))
    return Package(root)


def _checks(package: Package) -> list[list[str]]:
    lazy, typed = lazy_names(package)
    return [
        relative_private_imports(package),
        inherited_private_names(package),
        circles_through_a_package(package),
        [] if lazy == typed else [f"{lazy} != {typed}"],
        dynamic_imports(package),
        root_names_read_where_the_layers_ignore_it(package),
        circle_ignores_that_run(package),
    ]


def test_a_clean_tree_passes(tmp_path):
    package = _package(tmp_path, CLEAN)
    assert set(package.files) == {
        "mlx_watchdog",
        "mlx_watchdog.core",
        "mlx_watchdog.core.watchdog",
        "mlx_watchdog.core.forecast",
        "mlx_watchdog.attach",
        "mlx_watchdog.attach.model",
        "mlx_watchdog.attach.step",
        "mlx_watchdog.exporters",
        "mlx_watchdog.exporters.prometheus",
    }
    assert _checks(package) == [[]] * 7


BREACHES = {
    "watchdog/attach/model.py": """
        from ..core.watchdog import Watchdog
        from ..core import forecast as fc
        from ..core.forecast import _ok

        class ModelWatchdog(Watchdog):
            def step(self):
                self._internal_error()

        class Other(fc.Forecast):
            def read(self):
                return self._ok, super()._ok

            def check(self):
                self._internal_error()  # not a base class of Other's: not judged

        def watch_model(model):
            from . import step
    """,
    "watchdog/attach/step.py": "from . import watch_model\nimport mlx_watchdog.attach\n",
    "watchdog/__init__.py": CLEAN["watchdog/__init__.py"].replace(
        '"Watchdog": "core.watchdog"', '"Watchdog": "core.watchdog", "watch": "attach.decorator"'
    ),
    "watchdog/core/forecast.py": """
        import importlib
        from .watchdog import Watchdog
        from mlx_watchdog import __version__, Watchdog as W  # the core: not this check's
        importlib.import_module("mlx_watchdog.attach.model")
        importlib.import_module(f".step", "mlx_watchdog.attach")

        class Forecast:
            _ok = True
    """,
    "exporters/prometheus.py": "from .. import __version__, Watchdog\nimport mlx_watchdog\n",
}


def test_each_breach_is_caught(tmp_path):
    checks = _checks(_package(tmp_path, {**CLEAN, **BREACHES}))
    relative, inherited, circles, lazy, dynamic, root_names, ignores = checks
    model, forecast, pkg = "watchdog/attach/model.py", "watchdog/core/forecast.py", "mlx_watchdog"
    assert relative == [f"{model}:4: {pkg}.attach.model imports {pkg}.core.forecast's _ok"]
    assert inherited == [
        f"{model}:8: {pkg}.attach.model.ModelWatchdog uses _internal_error of its base class "
        f"{pkg}.core.watchdog.Watchdog",
        *[f"{model}:12: {pkg}.attach.model.Other uses _ok of its base class {pkg}.core.forecast.Forecast"]
        * 2,
    ], inherited
    assert circles == [
        f"watchdog/attach/step.py:{line}: {pkg}.attach.step imports {pkg}.attach, "
        f"whose __init__ imports {pkg}.attach.step"
        for line in (1, 2)
    ], circles
    assert lazy and "watch" in lazy[0]
    assert dynamic == [
        f"{forecast}:5: {pkg}.core.forecast imports 'mlx_watchdog.attach.model' by name",
        f"{forecast}:6: {pkg}.core.forecast imports '.step' by name",
    ], dynamic
    assert root_names == [
        f"exporters/prometheus.py:1: {pkg}.exporters.prometheus reads __version__, Watchdog of {pkg}",
        f"exporters/prometheus.py:2: {pkg}.exporters.prometheus reads the package itself of {pkg}",
    ], root_names
    assert ignores == [f"{forecast}:3: {pkg}.core.forecast -> {pkg}.core.watchdog runs"], ignores


def test_an_ignore_that_matches_no_import_is_caught(tmp_path):
    files = dict(CLEAN)
    files["watchdog/core/forecast.py"] = "class Forecast:\n    pass\n"
    assert circle_ignores_that_run(_package(tmp_path, files)) == [
        "mlx_watchdog.core.forecast -> mlx_watchdog.core.watchdog: no such import"
    ]
