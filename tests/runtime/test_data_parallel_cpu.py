"""Data parallel on the CPU: the segmented step (collectives between compiled segments), the
communicators, and 2 and 3 ranks over MPI (`mpiexec` directly and `ember launch`): from the same
weights, N ranks x batch B/N make the same update as one rank x batch B (relative difference
<= 1e-5 of the largest update of each tensor), bit-identical on every rank."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ember.runtime  # noqa: F401
from ember.passes.data_parallel import data_parallel
from ember.passes.pipeline import run_passes
from ember.runtime import comm as C
from ember.runtime.cpu import CpuExecutor
from ember.runtime.executor import HostStorage
from models import mlp, params_of, train_graph

SCRIPT = Path(__file__).with_name("dp_step_script.py")
BIN = Path(sys.executable).parent


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    return found


def _planned(graph):
    return run_passes(graph, ember.runtime.target("cpu").passes())


def test_segmented_step_on_one_process_equals_the_plain_step():
    m = mlp()
    x = np.random.default_rng(0).random((8, 784), dtype=np.float32)
    y = np.arange(8) % 10
    dp = _planned(data_parallel(train_graph(m, (8, 784)), 2, bucket_bytes=4096))
    a, b = {k: v.copy() for k, v in params_of(m).items()}, {k: v.copy() for k, v in params_of(m).items()}
    ex = CpuExecutor(dp, HostStorage(a), communicator=C.SingleProcess())
    assert len(ex.source.segments) >= 2 and ex.source.collectives
    assert "ember_segment" in ex.source.code and "void ember_step" not in ex.source.code
    plain = CpuExecutor(_planned(train_graph(m, (8, 784))), HostStorage(b))
    assert "ember_segment" not in plain.source.code  # single-process steps are unchanged
    la, lb = ex({"x": x, "y": y})["loss"], plain({"x": x, "y": y})["loss"]
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6 * np.abs(b[k]).max())


def test_world_from_env():
    assert C.world_from_env({}) == (0, 1, 0)
    assert C.world_from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == (2, 4, 0)
    assert C.world_from_env({"PMI_RANK": "1", "PMI_SIZE": "3"}) == (1, 3, 1)
    with pytest.raises(ValueError, match="outside"):
        C.world_from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_all_reduce_many_on_one_process_is_the_identity():
    bufs = [np.arange(3, dtype=np.float32), np.ones((2, 2), np.float32)]
    C.all_reduce_many(C.SingleProcess(), bufs, "mean")
    assert bufs[0].tolist() == [0, 1, 2]


def _check(out: Path, size: int) -> None:
    res = json.loads(out.read_text())
    assert res["size"] == size and res["ranks_equal"]
    assert res["max_rel"] <= 1e-5, res
    assert res["loss_rel"] <= 1e-5, res


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_mpiexec_ranks_equal_one_rank_on_the_whole_batch(tmp_path, size):
    out = tmp_path / "res.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([_mpiexec(), "-n", str(size), sys.executable, str(SCRIPT), str(out)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(out, size)
