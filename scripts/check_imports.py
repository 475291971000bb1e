"""Checks that the modules of the package use one another through public names.

Rule 1, private names (always): no module under the root imports a name
starting with one underscore from another module,

    from toast.hf.capture.states import _forward_inputs      # flagged
    from .save import _fsync_path                     # flagged (relative)
    def f(): from toast.io.save import _plan          # flagged (inside a function)

and none reaches into another module's objects for one,

    fitter._closed_form(...)                          # flagged, unless this module defines it

Allowed: importing a private *module* (``from toast import _validation``,
``import toast._lazy``: the module is the unit of privacy, its file name says
it is the package's own), ``from toast import _core`` (the C extension),
``__future__`` and dunder names (``__version__``). Other distributions'
private names (``transformers.utils...._active_collector``) are outside
this rule: it keeps the package's own modules apart.

The attribute rule is deliberately simple and conservative, since a static
check cannot know an object's class: ``obj._name`` is flagged when ``obj`` is
not ``self``/``cls``, another module of the package defines ``_name`` (as a
function, method, class, assignment, ``obj._name = ...`` or a name in
``__slots__``) and this module does not. A module that defines ``_name``
may use it on any object (e.g. ``other._closed_form`` in the class's own
``__eq__``); the methods of named tuples (``_replace``, ``_asdict``...) are
public API. Names no Python module of the package defines are not flagged:
third-party internals (``module._buffers``) and the private methods of the
C extension's types (``Moments._get_data``), which a static check of the
Python sources cannot attribute to one module.

Rule 2, method boundaries (``--strict``): modules under the boundary
packages (``toast.frontier``, ``toast.cli``) import from ``toast.methods``
only ``toast.methods`` itself and the framework's modules (``base``,
``stages``, ``runner``, ``pipeline``: the registry and the stage API),
never a method's own modules (``toast.methods.<name>.<module>``); and the
methods never import each other: a module of one method's package
(``toast/methods/<name>/``, every folder there being one method's) imports
no module of another's. The packages are found on disk, so a new method
is covered with no list to edit.

Usage: python scripts/check_imports.py [--strict] [ROOT]   (exit 1 and a list on failure)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# ``from toast import _core``: the compiled extension, private by its name but
# the one module the package's own ``__init__`` must load.
ALLOWED_PRIVATE = {("toast", "_core")}
# Named tuples' public methods carry an underscore only to avoid field names.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_field_defaults", "_make"}
OWN_OBJECTS = {"self", "cls"}
BOUNDARY_PACKAGES = ("toast.frontier", "toast.cli")
#: The framework's own modules: the registry, the stage API, the calibration,
#: the choice among plans and the one driver of every method's stages, the
#: runner and the folder pipeline. A method's package (``toast.methods.<name>``) is not among them.
METHODS_PUBLIC = {
    "toast.methods",
    "toast.methods.base",
    "toast.methods.stages",
    "toast.methods.runner",
    "toast.methods.pipeline",
    "toast.methods.calibrate",
    "toast.methods.choice",
    "toast.methods.driver",
}


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def is_private(name: str) -> bool:
    """One leading underscore, not a dunder (``__version__``) nor ``_``."""
    return name.startswith("_") and not name.startswith("__") and name != "_"


def module_name(path: Path, root: Path) -> str:
    """``root/hf/capture/states.py`` → ``toast.hf.capture.states`` (the root is the package)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    base = current.split(".")
    # ``from . import x`` in a package's __init__ means the package itself
    drop = node.level - 1 if is_package else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join(base + ([node.module] if node.module else []))


def is_module(name: str, root: Path) -> bool:
    """Whether ``name`` (``toast.x.y``) is a module or package under ``root``."""
    parts = name.split(".")
    if parts[0] != root.name:
        return False
    rel = root.joinpath(*parts[1:])
    return (
        rel.with_suffix(".py").is_file()
        or (rel / "__init__.py").is_file()
        or any(rel.parent.glob(f"{rel.name}.*.so"))
    )


def defined_names(tree: ast.AST) -> set[str]:
    """Every name the module itself defines, at any depth: what it may use
    as ``obj._name`` on any object, since the attribute is its own."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return names


def private_imports(
    tree: ast.AST, current: str, is_package: bool, root: Path
) -> Iterator[tuple[int, str, str]]:
    """(line, name, defining module) for each private name imported from another module."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        source = resolve(node, current, is_package)
        for alias in node.names:
            name = alias.name
            if not is_private(name) or (source, name) in ALLOWED_PRIVATE:
                continue
            if source.split(".")[0] != root.name:
                continue  # another distribution's privates: outside this rule
            if source == current or is_module(f"{source}.{name}", root):
                continue  # its own name, or a private module (the module is the unit)
            yield node.lineno, name, source


def private_attributes(
    tree: ast.AST, owners: dict[str, set[str]], current: str
) -> Iterator[tuple[int, str, str, str]]:
    """(line, attribute, object, defining modules) for each ``obj._name``
    that another module of the package defines and this one does not."""
    own = defined_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        if node.attr in own or node.attr in NAMEDTUPLE_API:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in OWN_OBJECTS:
            continue
        others = owners.get(node.attr, set()) - {current}
        if others:
            yield node.lineno, node.attr, ast.unparse(node.value), ", ".join(sorted(others))


def parse_all(root: Path) -> list[tuple[Path, str, ast.AST]]:
    """(path, module name, syntax tree) of every module under ``root``."""
    return [
        (path, module_name(path, root), ast.parse(path.read_text(), filename=str(path)))
        for path in sorted(root.rglob("*.py"))
    ]


def private_owners(modules: list[tuple[Path, str, ast.AST]]) -> dict[str, set[str]]:
    """Private name → the modules that define it."""
    owners: dict[str, set[str]] = {}
    for _, current, tree in modules:
        for name in defined_names(tree):
            if is_private(name):
                owners.setdefault(name, set()).add(current)
    return owners


def private_violations(root: Path) -> list[Violation]:
    """Rule 1 over every module under ``root``."""
    modules = parse_all(root)
    owners = private_owners(modules)
    found = []
    for path, current, tree in modules:
        is_package = path.name == "__init__.py"
        for line, name, source in private_imports(tree, current, is_package, root):
            found.append(
                Violation(
                    path,
                    line,
                    f"imports private name {name!r} from {source}: "
                    f"make it public in {source} or move the code",
                )
            )
        for line, attr, obj, where in private_attributes(tree, owners, current):
            found.append(
                Violation(
                    path,
                    line,
                    f"uses private attribute {obj}.{attr}, defined in {where}: "
                    f"make it public in {where} or move the code",
                )
            )
    return sorted(found, key=lambda v: (str(v.path), v.line, v.message))


def imported_modules(
    tree: ast.AST, current: str, is_package: bool, root: Path
) -> Iterator[tuple[int, str]]:
    """(line, module) for every module an import statement loads, a
    ``from package import submodule`` counting as the submodule."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node, current, is_package)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield node.lineno, sub if is_module(sub, root) else source


def boundary_violations(root: Path) -> list[Violation]:
    """Rule 2: the boundary packages use the methods through their stage API only."""
    found = []
    for path in sorted(root.rglob("*.py")):
        current = module_name(path, root)
        if not any(current == p or current.startswith(p + ".") for p in BOUNDARY_PACKAGES):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        seen = set(imported_modules(tree, current, path.name == "__init__.py", root))
        for line, module in sorted(seen):
            if module.startswith("toast.methods.") and module not in METHODS_PUBLIC:
                found.append(
                    Violation(
                        path,
                        line,
                        f"imports {module}: {current} may use only the framework modules "
                        f"{sorted(METHODS_PUBLIC)}; expose what it needs there",
                    )
                )
    return found


def method_package(module: str, packages: set[str]) -> str | None:
    """The method package ``module`` belongs to (None: none)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["toast", "methods"] and parts[2] in packages:
        return parts[2]
    return None


def independence_violations(root: Path) -> list[Violation]:
    """Rule 3: no method's package imports another's."""
    base = root / "methods"
    packages = {p.name for p in base.iterdir() if (p / "__init__.py").is_file()}
    found = []
    for path in sorted(base.rglob("*.py")):
        current = module_name(path, root)
        own = method_package(current, packages)
        if own is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in sorted(
            set(imported_modules(tree, current, path.name == "__init__.py", root))
        ):
            other = method_package(module, packages)
            if other is not None and other != own:
                found.append(
                    Violation(
                        path,
                        line,
                        f"imports {module}: the method {own!r} may not use the method {other!r}; "
                        "move what both need into the framework (toast.methods.base, stages, "
                        "driver) or below",
                    )
                )
    return found


def main(argv: list[str]) -> int:
    args = argv[1:]
    strict = "--strict" in args
    rest = [a for a in args if a != "--strict"]
    root = Path(rest[0]) if rest else Path(__file__).resolve().parents[1] / "toast"
    if strict:
        found = boundary_violations(root) + independence_violations(root)
    else:
        found = private_violations(root)
    for violation in found:
        print(violation)
    rule = "method boundaries and independence" if strict else "private names"
    print(f"imports ({rule}): {len(found)} violation(s) under {root}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
