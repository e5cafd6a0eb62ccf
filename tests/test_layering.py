"""The packages stand on floors (DESIGN.md): each imports only packages below it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = ["ir", "passes", "codegen", "runtime", "frontends"]


def _ember_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "ember" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", FLOORS)
def test_package_imports_only_packages_below_it(package):
    allowed = set(FLOORS[: FLOORS.index(package) + 1])
    for path in sorted((REPO / package).rglob("*.py")):
        bad = _ember_imports(path) - allowed
        assert not bad, f"{path.relative_to(REPO)} imports ember.{sorted(bad)}, above {package!r}"


def test_cpu_path_never_imports_cupy():
    for package in FLOORS:
        for path in (REPO / package).rglob("*.py"):
            assert "import cupy" not in path.read_text() or "cuda" in path.name, path
