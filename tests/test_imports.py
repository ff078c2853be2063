"""The package's import graph, read from its source with ast: no import circle, no private name of
one module used in another, and the layers (core knows nothing of how it is attached, run from the
command line or exported).

Modules are named as they are installed: pyproject.toml's package-dir maps watchdog/ onto
``mlx_watchdog`` and exporters/ onto ``mlx_watchdog.exporters``.

What is read, and why:

* Circles, two ways. First among the imports that run when a module is loaded (module level,
  inside ``try``/``if`` too; not under ``if TYPE_CHECKING:``, which never runs): a circle there
  makes loading depend on which module comes first (a name read from a half-loaded module).
  Then with function-local imports too: they run at call time, once the modules are loaded, so
  they cannot break loading (which is why moving one import of a circle into a function seems to
  fix it), but the two modules still need each other: the circle is in the design. Both fail.
  Function-local and TYPE_CHECKING imports count for the layers and private names as any import
  does: deferring an import does not change what a module depends on.
* An edge goes to the module whose code must run (the one named, and the packages above it that
  the importer is not itself inside: those are already loading) and, for ``from pkg import name``,
  to the module whose namespace is read. Constant ``importlib.import_module`` calls count
  (``f"{__package__}.x"`` too).
* A private name is ``_x`` (not ``__x__``). It is used across modules when it is:
  ``from m import _x``; ``m._x`` where ``m`` is bound to another module of the package;
  ``Cls._x`` where ``Cls`` is imported from another module; ``obj._x`` where ``obj``'s class is
  another module's and is known from the code itself: a parameter or variable annotated with it,
  a variable or ``self`` attribute assigned an instance of it (``Cls(...)``), or ``self`` in a
  subclass that uses a private name its base class (in another module) defines; also
  ``getattr``/``setattr``/``hasattr``/``delattr`` with a constant name. An object whose class
  the code does not state (an unannotated parameter, a function's return value) is out of reach:
  that would need a type checker's inference.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mlx_watchdog"
CORE = f"{PACKAGE}.core"
ATTACH = f"{PACKAGE}.attach"
COMMANDS = f"{PACKAGE}.commands"
EXPORTERS = f"{PACKAGE}.exporters"
TINY = f"{PACKAGE}.tiny"
DYNAMIC_IMPORTS = {"import_module", "__import__"}
NAME_BY_STRING = {"getattr", "setattr", "hasattr", "delattr"}


def is_private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def parents(module: str) -> list[str]:
    """The packages above ``module``, outermost first."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


# --------------------------------------------------------------------------- the modules


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject.toml's package-dir: package name -> folder."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in setuptools["package-dir"].items()}


def module_files(dirs: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, as installed. A folder inside another one that is mapped onto a
    package of its own is named by its own mapping."""
    mapped = {folder.resolve() for folder in dirs.values()}
    modules = {}
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if any(folder.joinpath(*parts[:i]).resolve() in mapped for i in range(1, len(parts))):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the module named
    line: int
    names: tuple[str, ...] = ()  # names read from target's namespace (from target import ...)
    local: bool = False  # inside a function: runs at call time
    type_checking: bool = False  # under `if TYPE_CHECKING:`: never runs

    def where(self, files: dict[str, Path], root: Path) -> str:
        return f"{_relative(files[self.module], root)}:{self.line}"


@dataclass(frozen=True)
class PrivateUse:
    module: str
    line: int
    owner: str  # the module whose private name is used
    name: str
    how: str


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


# What a name or expression is known to be.
@dataclass(frozen=True)
class ModuleRef:
    name: str  # a module of the package, or "" for anything outside it


@dataclass(frozen=True)
class ObjectRef:
    module: str  # where it is defined (re-exports followed)
    name: str


@dataclass(frozen=True)
class InstanceRef:
    module: str
    cls: str


Ref = ModuleRef | ObjectRef | InstanceRef


@dataclass
class Package:
    root: Path
    files: dict[str, Path]
    trees: dict[str, ast.Module] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    private_uses: list[PrivateUse] = field(default_factory=list)
    # (module, class) -> attribute -> what it holds; (module, class) -> private names it defines;
    # (module, class) -> its bases in the package
    attributes: dict[tuple[str, str], dict[str, Ref | _Ambiguous]] = field(default_factory=dict)
    defines: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    bases: dict[tuple[str, str], list[InstanceRef]] = field(default_factory=dict)
    # (module, id of a scope's node) -> what the first pass bound there
    scopes: dict[tuple[str, int], dict[str, Ref | None | _Ambiguous]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Package({self.root}, {len(self.files)} modules)"

    @classmethod
    def read(cls, root: Path) -> Package:
        package = cls(root, module_files(package_dirs(root)))
        for name, path in package.files.items():
            package.trees[name] = ast.parse(path.read_text(), filename=str(path))
        for reporting in (False, True):  # the first pass learns the classes' attributes
            for name in package.files:
                _Reader(package, name, reporting).visit(package.trees[name])
        return package

    def is_package(self, module: str) -> bool:
        return self.files[module].name == "__init__.py"

    def origin(self, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> ObjectRef:
        """Where ``module``'s name ``name`` is defined, following its from-imports (re-exports)."""
        if (module, name) in seen:
            return ObjectRef(module, name)
        for node in self.trees[module].body:
            if isinstance(node, ast.ImportFrom):
                source = _absolute(self, module, node.module, node.level)
                for alias in node.names:
                    if (alias.asname or alias.name) == name and source in self.files:
                        if f"{source}.{alias.name}" not in self.files:
                            return self.origin(source, alias.name, seen | {(module, name)})
        return ObjectRef(module, name)

    def is_class(self, ref: ObjectRef) -> bool:
        return any(
            isinstance(node, ast.ClassDef) and node.name == ref.name for node in self.trees[ref.module].body
        )


def _absolute(package: Package, module: str, name: str | None, level: int) -> str:
    if level == 0:
        return name or ""
    base = module if package.is_package(module) else module.rpartition(".")[0]
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{name}" if name else base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Ambiguous:
    """A name bound to two different things in one scope."""


AMBIGUOUS = _Ambiguous()


@dataclass
class _Scope:
    kind: str  # "module", "class" or "function"
    names: dict[str, Ref | None | _Ambiguous]


class _Reader(ast.NodeVisitor):
    """One module: its imports, the names it binds to modules, objects and instances of the
    package, and the private names it uses on them. Flow-insensitive: the second pass starts each
    scope with what the first pass bound there; a name bound to two different known things in one
    scope is unknown, and an assignment of something unknown keeps what a name is declared as."""

    def __init__(self, package: Package, module: str, reporting: bool):
        self.package = package
        self.module = module
        self.reporting = reporting
        self.scopes: list[_Scope] = []
        self.functions = 0
        self.type_checking = 0
        self.classes: list[str] = []

    # ----------------------------------------------------------------- bindings

    def push(self, kind: str, node: ast.AST) -> None:
        learnt = self.package.scopes.setdefault((self.module, id(node)), {})
        self.scopes.append(_Scope(kind, learnt if not self.reporting else dict(learnt)))

    def visit_Module(self, node: ast.Module) -> None:
        self.push("module", node)
        self.generic_visit(node)
        self.scopes.pop()

    def bind(self, name: str, ref: Ref | None) -> None:
        names = self.scopes[-1].names
        if name not in names:
            names[name] = ref
        elif ref is not None and names[name] != ref:
            names[name] = ref if names[name] is None else AMBIGUOUS

    def lookup(self, name: str) -> Ref | None:
        for i, scope in enumerate(reversed(self.scopes)):
            if scope.kind == "class" and i > 0:
                continue  # a class body's names are not seen from its methods
            if name in scope.names:
                found = scope.names[name]
                return None if isinstance(found, _Ambiguous) else found
        return None

    def resolve(self, node: ast.expr) -> Ref | None:
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            if isinstance(base, ModuleRef) and base.name:
                sub = f"{base.name}.{node.attr}"
                if sub in self.package.files:
                    return ModuleRef(sub)
                return self.package.origin(base.name, node.attr)
            if isinstance(base, InstanceRef):
                return self.attribute_of(base, node.attr)
            return None
        if isinstance(node, ast.Call):
            func = self.resolve(node.func)
            if isinstance(func, ObjectRef) and self.package.is_class(func):
                return InstanceRef(func.module, func.name)
            target = self.dynamic_import(node)
            if target is not None:
                return ModuleRef(target if target in self.package.files else "")
        return None

    def attribute_of(self, instance: InstanceRef, attr: str) -> Ref | None:
        key, seen = (instance.module, instance.cls), set()
        while key not in seen:
            seen.add(key)
            if attr in self.package.attributes.get(key, {}):
                found = self.package.attributes[key][attr]
                return None if isinstance(found, _Ambiguous) else found
            bases = self.package.bases.get(key, [])
            if len(bases) != 1:
                return None
            key = (bases[0].module, bases[0].cls)
        return None

    def annotation(self, node: ast.expr | None) -> Ref | None:
        """The one class of the package an annotation names (``X``, ``X | None``, ``Optional[X]``,
        ``"X"``), as an instance."""
        found = set(self._classes_in(node))
        return found.pop() if len(found) == 1 else None

    def _classes_in(self, node: ast.expr | None) -> Iterator[InstanceRef]:
        if node is None:
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                yield from self._classes_in(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            yield from self._classes_in(node.left)
            yield from self._classes_in(node.right)
        elif isinstance(node, ast.Subscript):
            head = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if head in ("Optional", "Union"):
                items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                for item in items:
                    yield from self._classes_in(item)
        else:
            ref = self.resolve(node)
            if isinstance(ref, ObjectRef) and self.package.is_class(ref):
                yield InstanceRef(ref.module, ref.name)

    # ----------------------------------------------------------------- imports

    def record(self, target: str, line: int, names: tuple[str, ...] = ()) -> None:
        if self.reporting and target in self.package.files:
            self.package.imports.append(
                Import(self.module, target, line, names, self.functions > 0, self.type_checking > 0)
            )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.record(alias.name, node.lineno)
            if alias.asname:
                self.bind(alias.asname, ModuleRef(alias.name if alias.name in self.package.files else ""))
            else:
                top = alias.name.partition(".")[0]
                self.bind(top, ModuleRef(top if top in self.package.files else ""))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = _absolute(self.package, self.module, node.module, node.level)
        inside = source in self.package.files
        names = []
        for alias in node.names:
            bound = alias.asname or alias.name
            sub = f"{source}.{alias.name}"
            if inside and sub in self.package.files:
                self.record(sub, node.lineno)
                self.bind(bound, ModuleRef(sub))
                continue
            names.append(alias.name)
            if not inside:
                self.bind(bound, ModuleRef(""))  # outside the package: nothing to check
            elif alias.name != "*":
                self.bind(bound, self.package.origin(source, alias.name))
                if is_private(alias.name):
                    self.use(node.lineno, source, alias.name, f"from {source} import {alias.name}")
        if inside and names:
            self.record(source, node.lineno, tuple(names))

    def dynamic_import(self, node: ast.Call) -> str | None:
        """The module a constant ``importlib.import_module(...)`` / ``__import__(...)`` names."""
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in DYNAMIC_IMPORTS or not node.args:
            return None
        text = self.constant_text(node.args[0])
        if text is None:
            return None
        if text.startswith("."):
            anchor = self.constant_text(node.args[1]) if len(node.args) > 1 else None
            if anchor is None:
                return None
            level = len(text) - len(text.lstrip("."))
            for _ in range(level - 1):
                anchor = anchor.rpartition(".")[0]
            text = f"{anchor}.{text.lstrip('.')}"
        return text

    def constant_text(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id == "__name__":
            return self.module
        if isinstance(node, ast.Name) and node.id == "__package__":
            return self.module if self.package.is_package(self.module) else self.module.rpartition(".")[0]
        if isinstance(node, ast.JoinedStr):
            parts = []
            for value in node.values:
                text = self.constant_text(value.value if isinstance(value, ast.FormattedValue) else value)
                if text is None:
                    return None
                parts.append(text)
            return "".join(parts)
        return None

    # ----------------------------------------------------------------- private names

    def use(self, line: int, owner: str, name: str, how: str) -> None:
        if self.reporting and owner != self.module:
            self.package.private_uses.append(PrivateUse(self.module, line, owner, name, how))

    def check_attribute(self, base: ast.expr, attr: str, line: int) -> None:
        if not is_private(attr):
            return
        ref = self.resolve(base)
        text = ast.unparse(base)
        if isinstance(ref, ModuleRef) and ref.name:
            self.use(line, ref.name, attr, f"{text}.{attr} (module {ref.name})")
        elif isinstance(ref, ObjectRef):
            self.use(line, ref.module, attr, f"{text}.{attr} ({ref.module}.{ref.name})")
        elif isinstance(ref, InstanceRef):
            owner = self.owner(ref, attr)
            if owner is not None:
                self.use(line, owner, attr, f"{text}.{attr} ({text}: {ref.module}.{ref.cls})")

    def owner(self, instance: InstanceRef, attr: str) -> str | None:
        """The module whose private name ``instance.attr`` is: the instance's class's module; for
        a class of this module that does not define ``attr``, the module of the base class that
        does."""
        if instance.module != self.module:
            return instance.module
        todo, seen = [instance], set()
        while todo:
            cls = todo.pop()
            key = (cls.module, cls.cls)
            if key in seen:
                continue
            seen.add(key)
            if attr in self.package.defines.get(key, set()):
                return cls.module
            todo += self.package.bases.get(key, [])
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.check_attribute(node.value, node.attr, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func, args = node.func, node.args
        if (
            isinstance(func, ast.Name)
            and func.id in NAME_BY_STRING
            and len(args) >= 2
            and isinstance(args[1], ast.Constant)
            and isinstance(args[1].value, str)
        ):
            self.check_attribute(args[0], args[1].value, node.lineno)
        target = self.dynamic_import(node)
        if target is not None:
            self.record(target, node.lineno)
        self.generic_visit(node)

    # ----------------------------------------------------------------- scopes and assignments

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self.type_checking += 1
        for child in node.body:
            self.visit(child)
        self.type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for child in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(child)
        self.bind(node.name, ObjectRef(self.module, node.name))
        key = (self.module, node.name)
        if not self.reporting:
            self.package.bases[key] = [
                InstanceRef(base.module, base.name)
                for base in map(self.resolve, node.bases)
                if isinstance(base, ObjectRef) and self.package.is_class(base)
            ]
            defines = self.package.defines.setdefault(key, set())
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    defines.add(child.name)
                for target in _assigned(child):
                    if isinstance(target, ast.Name):
                        defines.add(target.id)
                if isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name):
                    ref = self.annotation(child.annotation)
                    if ref is not None:
                        self.package.attributes.setdefault(key, {})[child.target.id] = ref
        self.classes.append(node.name)
        self.push("class", node)
        for child in node.body:
            self.visit(child)
        self.scopes.pop()
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args
        for child in [*node.decorator_list, node.returns, *args.defaults, *args.kw_defaults]:
            if child is not None:
                self.visit(child)
        method = self.scopes[-1].kind == "class"
        self.bind(node.name, ObjectRef(self.module, node.name))
        self.push("function", node)
        self.functions += 1
        positional = [*args.posonlyargs, *args.args]
        decorators = {getattr(d, "id", None) for d in node.decorator_list}
        for arg in [*positional, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is None:
                continue
            if method and arg is positional[0] and "staticmethod" not in decorators:
                cls = ObjectRef(self.module, self.classes[-1])
                self.bind(arg.arg, cls if "classmethod" in decorators else InstanceRef(cls.module, cls.name))
                continue
            if arg.annotation is not None:
                self.visit(arg.annotation)
            self.bind(arg.arg, self.annotation(arg.annotation))
        for child in node.body:
            self.visit(child)
        self.functions -= 1
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.push("function", node)
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1
        self.scopes.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        ref = self.resolve(node.value)
        for target in node.targets:
            self.assign(target, ref)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        ref = self.annotation(node.annotation)
        if ref is None and node.value is not None:
            ref = self.resolve(node.value)
        self.assign(node.target, ref)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.generic_visit(node)
        self.assign(node.target, None)

    visit_AsyncFor = visit_For

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        self.generic_visit(node)
        for item in node.items:
            if item.optional_vars is not None:
                self.assign(item.optional_vars, None)

    visit_AsyncWith = visit_With

    def assign(self, target: ast.expr, ref: Ref | None) -> None:
        if isinstance(target, ast.Name):
            self.bind(target.id, ref)
        elif isinstance(target, ast.Attribute):
            owner = self.resolve(target.value)
            if isinstance(owner, InstanceRef) and owner.module == self.module and not self.reporting:
                key = (owner.module, owner.cls)
                self.package.defines.setdefault(key, set()).add(target.attr)
                attributes = self.package.attributes.setdefault(key, {})
                known = attributes.get(target.attr)
                if ref is not None and known != AMBIGUOUS:
                    attributes[target.attr] = ref if known in (None, ref) else AMBIGUOUS
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.assign(element, None)


def _assigned(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


# --------------------------------------------------------------------------- the rules


def circles(package: Package, *, local: bool = False) -> list[str]:
    """Every import circle among the imports that run at load time (with ``local``, and those
    in functions), one line per circle."""
    graph: dict[str, dict[str, int]] = {name: {} for name in package.files}
    for imp in package.imports:
        if imp.type_checking or (imp.local and not local):
            continue
        above = set(parents(imp.module))
        for target in [*parents(imp.target), imp.target]:
            if target not in package.files or target == imp.module:
                continue
            if target in above and not (target == imp.target and imp.names):
                continue  # a package the importer is inside is loading already
            graph[imp.module].setdefault(target, imp.line)
    found = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _cycle_in(graph, component)
        steps = [
            f"{a} ({_relative(package.files[a], package.root)}:{graph[a][b]})"
            for a, b in zip(cycle, cycle[1:])
        ]
        found.append(" -> ".join([*steps, cycle[-1]]))
    return found


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    # Tarjan, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_in(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth first)."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in {component}")


def private_names(package: Package) -> list[str]:
    seen, found = set(), []
    for use in package.private_uses:
        key = (use.module, use.line, use.owner, use.name)
        if key not in seen:
            seen.add(key)
            where = f"{_relative(package.files[use.module], package.root)}:{use.line}"
            found.append(f"{where}: {use.module} uses {use.owner}'s {use.name}: {use.how}")
    return found


def layering(package: Package) -> list[str]:
    """core imports nothing of attach, commands, exporters or tiny; attach does not import
    commands; exporters import only core (and each other) and the package's __version__."""
    found = []
    for imp in package.imports:
        module, target = imp.module, imp.target
        breach = None
        if within(module, CORE) and any(within(target, p) for p in (ATTACH, COMMANDS, EXPORTERS, TINY)):
            breach = "core imports"
        elif within(module, ATTACH) and within(target, COMMANDS):
            breach = "attach imports"
        elif within(module, EXPORTERS) and not (
            within(target, CORE)
            or within(target, EXPORTERS)
            or (target == PACKAGE and imp.names == ("__version__",))
        ):
            breach = "an exporter imports"
        if breach:
            names = f" ({', '.join(imp.names)})" if imp.names else ""
            kind = " (function-local)" if imp.local else " (TYPE_CHECKING)" if imp.type_checking else ""
            found.append(
                f"{imp.where(package.files, package.root)}: {breach} {target}{names}: {module}{kind}"
            )
    return sorted(set(found))


# --------------------------------------------------------------------------- the package


@pytest.fixture(scope="module")
def package() -> Package:
    return Package.read(ROOT)


def test_the_modules_are_named_as_installed(package):
    assert package.files[PACKAGE] == ROOT / "watchdog" / "__init__.py"
    assert package.files[f"{CORE}.watchdog"] == ROOT / "watchdog" / "core" / "watchdog.py"
    assert package.files[EXPORTERS] == ROOT / "exporters" / "__init__.py"
    assert package.files[f"{EXPORTERS}.prometheus"] == ROOT / "exporters" / "prometheus.py"
    assert not any(name.startswith(f"{PACKAGE}.watchdog") for name in package.files)


def test_no_import_circle(package):
    found = circles(package)
    assert not found, "import circles:\n" + "\n".join(found)


def test_no_import_circle_through_a_function_local_import(package):
    # Deferring one import of a circle into a function lets the package load, but the two modules
    # still need each other: the circle is in the design.
    found = circles(package, local=True)
    assert not found, "import circles (function-local imports included):\n" + "\n".join(found)


def test_no_private_name_is_used_across_modules(package):
    found = private_names(package)
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_layers(package):
    found = layering(package)
    assert not found, "layering breaches:\n" + "\n".join(found)


# --------------------------------------------------------------------------- the checker itself


def _tree(root: Path, files: dict[str, str]) -> Package:
    """A package laid out as this one is (watchdog/ -> mlx_watchdog, exporters/ ->
    mlx_watchdog.exporters), with ``files`` (path -> source) and an empty __init__.py in every
    folder that has none."""
    (root / "pyproject.toml").write_text(
        "[tool.setuptools]\n"
        'package-dir = { "mlx_watchdog" = "watchdog", "mlx_watchdog.exporters" = "exporters" }\n'
    )
    for path, source in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(source))
    for folder in (
        "watchdog",
        "watchdog/core",
        "watchdog/attach",
        "watchdog/commands",
        "watchdog/tiny",
        "exporters",
    ):
        (root / folder).mkdir(parents=True, exist_ok=True)
        init = root / folder / "__init__.py"
        if not init.exists():
            init.write_text("")
    return Package.read(root)


CLEAN = {
    "watchdog/__init__.py": """
        from .core.watchdog import Watchdog
        __version__ = "1"
    """,
    "watchdog/core/watchdog.py": """
        import threading
        from . import forecast as fc
        from .forecast import Forecast

        _live = set()

        class Watchdog:
            def __init__(self):
                self._lock = threading.Lock()
                self.last = Forecast()
                _live.add(self)

            def forecast(self) -> Forecast:
                return fc.Forecast()

            def merge(self, other: "Watchdog"):
                with other._lock:  # another object of this module's class: its own business
                    self._internal_error()

            def _internal_error(self):
                pass
    """,
    "watchdog/core/forecast.py": """
        class Forecast:
            _ok = True
    """,
    "watchdog/attach/model.py": """
        import sys
        from ..core.watchdog import Watchdog

        def watch_model(model, watchdog: Watchdog | None = None):
            frame = sys._getframe(0)  # outside the package: not ours to judge
            def later():
                from ..core import forecast  # function-local
            return watchdog.forecast()
    """,
    "watchdog/commands/demo.py": """
        from ..attach.model import watch_model
        from ..core.watchdog import Watchdog

        def run():
            return watch_model(None, Watchdog())
    """,
    "watchdog/tiny/build.py": "def build_model():\n    pass\n",
    "exporters/prometheus.py": """
        from .. import __version__
        from ..core.watchdog import Watchdog
        from .http import serve

        def collect(wd: Watchdog):
            return wd.forecast(), __version__
    """,
    "exporters/http.py": "def serve():\n    pass\n",
}


def test_a_clean_tree_passes(tmp_path):
    package = _tree(tmp_path, CLEAN)
    assert set(package.files) >= {
        "mlx_watchdog",
        "mlx_watchdog.core.watchdog",
        "mlx_watchdog.tiny.build",
        "mlx_watchdog.exporters",
        "mlx_watchdog.exporters.http",
        "mlx_watchdog.exporters.prometheus",
    }
    assert len(package.imports) >= 10
    assert (circles(package), private_names(package), layering(package)) == ([], [], [])


def test_a_circle_is_caught(tmp_path):
    files = dict(CLEAN)
    files["watchdog/core/forecast.py"] = "from .graph import walk\nclass Forecast:\n    pass\n"
    files["watchdog/core/graph.py"] = "from . import watchdog\ndef walk():\n    pass\n"
    found = circles(_tree(tmp_path, files))
    assert len(found) == 1
    assert found[0].startswith("mlx_watchdog.core.forecast (watchdog/core/forecast.py:1) -> ")
    assert "mlx_watchdog.core.graph (watchdog/core/graph.py:1) -> " in found[0]
    assert "mlx_watchdog.core.watchdog (watchdog/core/watchdog.py:3) -> " in found[0]


def test_a_circle_through_a_package_namespace_is_caught(tmp_path):
    # mlx_watchdog/__init__ loads core.watchdog, which reads a name from the half-loaded package.
    files = dict(CLEAN)
    files["watchdog/core/forecast.py"] = "from mlx_watchdog import __version__\nclass Forecast:\n    pass\n"
    found = circles(_tree(tmp_path, files))
    assert len(found) == 1 and "mlx_watchdog (watchdog/__init__.py:2)" in found[0], found


def test_function_local_and_type_checking_imports_close_no_circle_but_count_as_dependencies(tmp_path):
    files = dict(CLEAN)
    files["watchdog/core/forecast.py"] = """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from ..attach.model import watch_model

        class Forecast:
            def describe(self):
                from .watchdog import Watchdog
                return Watchdog
    """
    files["watchdog/attach/model.py"] = CLEAN["watchdog/attach/model.py"].replace(
        "from ..core import forecast", "from ..commands import demo"
    )
    package = _tree(tmp_path, files)
    assert circles(package) == []
    assert circles(package, local=True) == [
        "mlx_watchdog.core.forecast (watchdog/core/forecast.py:8) -> "
        "mlx_watchdog.core.watchdog (watchdog/core/watchdog.py:3) -> mlx_watchdog.core.forecast",
        "mlx_watchdog.attach.model (watchdog/attach/model.py:8) -> "
        "mlx_watchdog.commands.demo (watchdog/commands/demo.py:2) -> mlx_watchdog.attach.model",
    ]
    assert layering(package) == [
        "watchdog/attach/model.py:8: attach imports mlx_watchdog.commands.demo: "
        "mlx_watchdog.attach.model (function-local)",
        "watchdog/core/forecast.py:4: core imports mlx_watchdog.attach.model (watch_model): "
        "mlx_watchdog.core.forecast (TYPE_CHECKING)",
    ]


def test_private_names_across_modules_are_caught(tmp_path):
    files = dict(CLEAN)
    files["watchdog/attach/distributed.py"] = """
        import importlib
        import mlx_watchdog.core.watchdog
        from ..core import watchdog as core
        from ..core.watchdog import Watchdog, _live
        from ..core.forecast import Forecast

        class Agreement:
            def __init__(self, watchdog: Watchdog):
                self.watchdog = watchdog
                self.forecast = Forecast()

            def check(self, other: "Watchdog | None", count):
                core._live_lock                             # a module's private name
                mlx_watchdog.core.watchdog._live            # through the full dotted name
                Watchdog._internal_error                    # an imported class's
                self.watchdog._internal_error()             # self's attribute, a Watchdog
                other._lock                                 # a parameter annotated with another module's class
                Watchdog()._forecast                        # an instance made here
                getattr(self.forecast, "_ok", None)         # through getattr
                importlib.import_module("mlx_watchdog.core.forecast")._ok
                count._private                              # unknown: not judged
    """
    found = private_names(_tree(tmp_path, files))
    where = "watchdog/attach/distributed.py"
    watchdog, forecast = "mlx_watchdog.core.watchdog", "mlx_watchdog.core.forecast"
    assert [line.split(": ", 1)[0] for line in found] == [
        f"{where}:{line}" for line in (5, 14, 15, 16, 17, 18, 19, 20, 21)
    ], found
    assert all(" uses mlx_watchdog.core." in line for line in found)
    assert f"uses {watchdog}'s _live: from {watchdog} import _live" in found[0]
    assert f"uses {watchdog}'s _live_lock: core._live_lock (module {watchdog})" in found[1]
    assert f"uses {watchdog}'s _internal_error: self.watchdog._internal_error" in found[4]
    assert f"uses {forecast}'s _ok: self.forecast._ok" in found[7]


def test_a_subclass_using_its_base_class_private_name_is_caught(tmp_path):
    files = dict(CLEAN)
    files["watchdog/attach/step.py"] = """
        from ..core.watchdog import Watchdog

        class StepWatchdog(Watchdog):
            def __init__(self):
                super().__init__()
                self._steps = 0

            def step(self):
                self._steps += 1         # its own
                self._internal_error()   # its base's, in core/watchdog.py
    """
    found = private_names(_tree(tmp_path, files))
    assert len(found) == 1 and found[0].startswith("watchdog/attach/step.py:11: "), found
    assert "uses mlx_watchdog.core.watchdog's _internal_error" in found[0]


def test_layering_breaches_are_caught(tmp_path):
    files = dict(CLEAN)
    files["watchdog/core/graph.py"] = "from ..attach import model\nfrom mlx_watchdog.tiny import build\n"
    files["exporters/prometheus.py"] = (
        "from mlx_watchdog import Watchdog, __version__\nfrom ..attach.model import watch_model\n"
    )
    found = layering(_tree(tmp_path, files))
    assert found == [
        "exporters/prometheus.py:1: an exporter imports mlx_watchdog (Watchdog, __version__): "
        "mlx_watchdog.exporters.prometheus",
        "exporters/prometheus.py:2: an exporter imports mlx_watchdog.attach.model (watch_model): "
        "mlx_watchdog.exporters.prometheus",
        "watchdog/core/graph.py:1: core imports mlx_watchdog.attach.model: mlx_watchdog.core.graph",
        "watchdog/core/graph.py:2: core imports mlx_watchdog.tiny.build: mlx_watchdog.core.graph",
    ], found
