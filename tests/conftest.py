"""Suite-wide test setup: GPU tests skip where there is no GPU; a private compile cache per run."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # shared helpers (models.py) importable from every test folder

# Compiled artefacts go to a cache private to this test session unless the caller chose one,
# so the suite never depends on (or pollutes) a user's ~/.cache/ember.
os.environ.setdefault("EMBER_CACHE_DIR", tempfile.mkdtemp(prefix="ember-test-cache-"))


def _has_cuda() -> bool:
    try:
        import cupy  # noqa: F401
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy (run on the lent H200)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
