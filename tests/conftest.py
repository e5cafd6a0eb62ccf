"""Suite-wide test setup: GPU tests skip where there is no GPU; a private compile cache per run;
tests needing the MNIST files skip where they are missing, except under CI=true where they fail."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # shared helpers (models.py) importable from every test folder

# Compiled artefacts go to a cache private to this test session unless the caller chose one,
# so the suite never depends on (or pollutes) a user's ~/.cache/ember.
# A folder this process made is removed at the end of the session (the cache of a whole suite
# run is ~100 MB; left behind, a shared machine's /tmp filled run after run).
_OWN_CACHE = None
if "EMBER_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember-test-cache-")
# Tests check every graph fully after every pass (type rules, fused subgraphs); compile() by
# default checks structure only (ember.ir.Graph.verify).
os.environ.setdefault("EMBER_VERIFY", "1")
# Tests patch passes, targets and code generators: every compile runs them (the plan cache's own
# tests turn it on, tests/frontends/test_plan_cache.py).
os.environ.setdefault("EMBER_PLAN_CACHE", "0")
# Under pytest-xdist every test process would start its own NVRTC workers (half the cores each):
# the processes are the parallelism there. tests/runtime/test_nvrtc_workers.py tests the workers.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("EMBER_NVRTC_WORKERS", "0")


def pytest_sessionfinish(session, exitstatus):
    # (under pytest-xdist the workers inherit the folder and the controller, which made it, ends last)
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
        if item.get_closest_marker("cuda") is not None:  # the marker, not a test id that says cuda
            item.add_marker(skip)


def require_mnist() -> Path:
    """The MNIST folder; skips the calling test when its files are missing, but FAILS it when
    CI=true, so a CI run without the data cannot pass by skipping what it was meant to check."""
    from ember.runtime.data import MNIST_FILES, find_mnist_file
    from models import MNIST_DIR

    missing = [s for pair in MNIST_FILES.values() for s in pair if find_mnist_file(MNIST_DIR, s) is None]
    if missing:
        msg = f"MNIST not found at {MNIST_DIR} (missing {', '.join(missing)})"
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(f"{msg}; CI=true, so the MNIST tests must run")
        pytest.skip(msg)
    return MNIST_DIR


@pytest.fixture
def mnist_dir() -> Path:
    return require_mnist()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """PyTorch's intra-op thread count set to n inside, restored after: a module-level
    torch.set_num_threads would make figures depend on which test files run together."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """Undoes a torch.set_num_threads made by code under test (e.g. ember align's `threads`)."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)
