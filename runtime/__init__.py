"""ember.runtime: executors, storage, communicators, data loading; each backend registers its target.

Importing this package registers every backend listed in `BACKENDS` with `ember.passes.targets`
(a backend's module builds its `Target` record and calls `register`). A backend whose libraries
are missing (CuPy for cuda) still registers: its record says why it cannot run here.
"""
from __future__ import annotations

import importlib

from ember.passes import targets

# Backend modules, in the order their targets are listed (the first one is the reference).
BACKENDS = ("executor", "cpu", "cuda")

for _module in BACKENDS:
    importlib.import_module(f"{__name__}.{_module}")


def target(name: str) -> targets.Target:
    """The registered target `name` (a one-line ValueError naming the known ones otherwise); a
    device with an index, PyTorch's "cuda:1", names its target ("cuda")."""
    return targets.get(name.partition(":")[0] if isinstance(name, str) else name)


def target_names() -> list[str]:
    return targets.names()


__all__ = ["BACKENDS", "target", "target_names"]
