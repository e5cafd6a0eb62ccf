"""The packages stand on floors (ARCHITECTURE.md): each imports only packages below it; inside
`frontends`, three layers stand the same way; application code uses only the public API.

    ir  <-  passes  <-  codegen  <-  runtime  <-  frontends
                                                  api (frontends/*.py)  <-  training  <-  cli

Imports are read from the source (ast), relative ones resolved to absolute names, including
imports inside functions; `importlib.import_module` with a computed name is not seen (the CLI
loads its own subcommands that way, all inside `ember.frontends.cli`).
"""
from __future__ import annotations

import ast
import importlib
import types
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = ["ir", "passes", "codegen", "runtime", "frontends"]

# The layers inside `frontends`: a module's layer is its subpackage; the modules directly in
# `frontends/` are the compiler API.
API, TRAINING, CLI = "api", "training", "cli"
FRONTEND_LAYERS = [API, TRAINING, CLI]


def _module_name(path: Path) -> str:
    """`frontends/training/trainer.py` -> `ember.frontends.training.trainer` (package-dir mapping)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["ember", *parts])


def _is_module(name: str) -> bool:
    """Whether the absolute `ember.` name is a module or package in this tree."""
    parts = name.split(".")
    if parts[0] != "ember" or len(parts) < 2:
        return False
    base = REPO.joinpath(*parts[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports_module(package: str, name: str) -> bool:
    """Whether `from package import name` binds a module, as Python decides it: the package's
    attribute if it has one (`ember.frontends.compile` is the function, not `compile.py`),
    else the submodule."""
    if not _is_module(f"{package}.{name}"):
        return False
    try:
        value = getattr(importlib.import_module(package), name)
    except (ImportError, AttributeError):
        return True
    return isinstance(value, types.ModuleType)


@cache
def _imports(path: Path) -> tuple[tuple[str, str | None, int], ...]:
    """Every `ember` import of a file as (module, imported name or None, line): `import a.b` gives
    ("a.b", None); `from a import b` gives ("a.b", None) if `a.b` is a module, else ("a", "b")."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "ember"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "ember":
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.append((sub, None, node.lineno) if _imports_module(module, alias.name)
                             else (module, alias.name, node.lineno))
    return tuple(found)


def _files(folder: Path):
    return sorted(p for p in folder.rglob("*.py"))


def _frontend_layer(module: str) -> str | None:
    """The frontends layer of an absolute module name, or None outside `ember.frontends`."""
    parts = module.split(".")
    if parts[:2] != ["ember", "frontends"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in (TRAINING, CLI) else API


@cache
def _public_api() -> tuple[frozenset[str], frozenset[str]]:
    """What "public" means: the names in `ember.frontends.__all__`, and among them the public
    modules (`nn`, `optim`, `functional`), which may also be imported from directly."""
    import ember.frontends as api

    names = frozenset(api.__all__)
    modules = frozenset(n for n in names if isinstance(getattr(api, n), types.ModuleType))
    return names, modules


# ---- floors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("package", FLOORS)
def test_package_imports_only_packages_below_it(package):
    allowed = set(FLOORS[: FLOORS.index(package) + 1])
    for path in _files(REPO / package):
        for module, _, line in _imports(path):
            floor = module.split(".")[1] if "." in module else None
            assert floor in allowed, f"{path.relative_to(REPO)}:{line} imports {module}, above {package!r}"


def test_frontends_layers_import_only_layers_below():
    """api imports neither training nor cli; training does not import cli."""
    for path in _files(REPO / "frontends"):
        own = _frontend_layer(_module_name(path))
        allowed = set(FRONTEND_LAYERS[: FRONTEND_LAYERS.index(own) + 1])
        for module, _, line in _imports(path):
            layer = _frontend_layer(module)
            assert layer is None or layer in allowed, \
                f"{path.relative_to(REPO)}:{line} ({own} layer) imports {module} ({layer} layer, above it)"


def test_application_code_uses_only_the_public_api():
    """`frontends/training` and `frontends/cli` reach the compiler API only through public names:
    `from ember.frontends import <name in __all__>` (or `from .. import <name>`), or from a public
    module (`from ember.frontends.nn import Module`); never `ember.frontends.compile`,
    `.tensor`, `.tracing` or any other module of the API layer directly."""
    names, modules = _public_api()
    checked = 0
    for layer in (TRAINING, CLI):
        for path in _files(REPO / "frontends" / layer):
            for module, name, line in _imports(path):
                if _frontend_layer(module) != API:
                    continue
                checked += 1
                where = f"{path.relative_to(REPO)}:{line}"
                if module == "ember.frontends":
                    assert name in names, f"{where} imports {name!r} from ember.frontends, not in its __all__"
                else:
                    sub = module.split(".")[2]
                    assert sub in modules, (f"{where} imports {module}: not public; use "
                                            f"`from ember.frontends import ...` (public: {sorted(names)})")
    assert checked, "no import of the API layer found: the test reads nothing"


def test_public_api_names_exist():
    import ember.frontends as api

    names, modules = _public_api()
    assert {"compile", "nn", "optim", "functional", "trace", "spec"} <= names
    assert modules == {"nn", "optim", "functional", "checkpoint"}
    for name in names:
        assert hasattr(api, name), name


def test_no_private_names_across_packages():
    """No module takes an underscore name from another top-level package (`frontends` from
    `runtime`'s internals, say): what crosses a floor is public."""
    for package in FLOORS:
        for path in _files(REPO / package):
            for module, name, line in _imports(path):
                if module.split(".")[1] == package:
                    continue
                private = [p for p in (*module.split(".")[2:], name or "") if p.startswith("_") and p != "__init__"]
                assert not private, f"{path.relative_to(REPO)}:{line} imports private {module}.{name or ''}"


def test_no_executor_table_left():
    """Executors come from the target registry (`Target.executor`); the old private table
    (`_EXEC...`) must not come back anywhere, in the packages or in the tests."""
    table = "_EXEC" + "UTORS"  # spelled apart so this file does not find itself
    for folder in (*FLOORS, "tests"):
        for path in _files(REPO / folder):
            assert table not in path.read_text(), f"{path.relative_to(REPO)} mentions {table}"


def test_cpu_path_never_imports_cupy():
    for package in FLOORS:
        for path in (REPO / package).rglob("*.py"):
            assert "import cupy" not in path.read_text() or "cuda" in path.name, path
