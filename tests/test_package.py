"""The distribution's metadata: version, license and extras, as a wheel's user sees them."""
from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import ember

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_distributions() -> None:
    assert ember.__version__ == importlib.metadata.version("ember")
    assert ember.__version__.count(".") >= 2


def test_license_and_extras() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    extras = meta["optional-dependencies"]
    # the user-facing torch extra is a range (any recent torch), only the test extra pins one
    assert any(r.startswith("torch>=") and "<" in r for r in extras["torch"])
    assert {"torch", "test", "plot", "mpi", "cuda12", "cuda13"} <= set(extras)
