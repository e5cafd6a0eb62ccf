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
    assert res["api_rel"] <= 1e-5 and res["api_loss_rel"] <= 1e-5, res  # compile(communicator=) too


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_overlapped_all_reduces_give_the_bits_of_blocking_ones(tmp_path, size):
    out = tmp_path / "res.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([_mpiexec(), "-n", str(size), sys.executable, str(SCRIPT.with_name("dp_overlap_script.py")),
                        str(out)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["size"] == size and res["bit_identical"], res
    # the 4 KiB buckets: the loss, the last layer's gradients and the first layer's weight
    # gradient (a bucket alone) start at different boundaries and are all waited for only
    # before the updates, so the first layer's backward runs while the last layer's reduce
    starts = sorted({g[1] for g in res["groups"]})
    assert len(res["groups"]) == 3 and len(starts) == 3, res
    assert any(wait > start + 1 for _, start, wait in res["groups"]), res


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_mpiexec_ranks_equal_one_rank_on_the_whole_batch(tmp_path, size):
    out = tmp_path / "res.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([_mpiexec(), "-n", str(size), sys.executable, str(SCRIPT), str(out)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    _check(out, size)


def _ember(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.frontends.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env | extra


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_ember_launch_ranks_equal_one_rank_on_the_whole_batch(tmp_path, size):
    _mpiexec()
    out = tmp_path / "res.json"
    r = _ember("launch", "--nproc-per-node", str(size), "--", sys.executable, str(SCRIPT), str(out), env=_clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    _check(out, size)


def test_launch_sets_the_torchrun_variables(tmp_path):
    code = ("import os; k='RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT'.split(); "
            f"open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write(' '.join(os.environ[x] for x in k))")
    r = _ember("launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
               "--master-port", "1234", "--", sys.executable, "-c", code, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "2").read_text() == "2 0 4 2 10.0.0.1 1234"
    assert (tmp_path / "3").read_text() == "3 1 4 2 10.0.0.1 1234"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_one_rank_failing_stops_the_launch_within_30s(tmp_path, how):
    import signal
    import time
    _mpiexec()
    pids = tmp_path / "pids"
    pids.mkdir()
    env = _clean_env(EMBER_TEST_PIDDIR=str(pids), EMBER_TEST_HANG="1")
    if how == "exit":
        env["EMBER_TEST_FAIL_RANK"] = "1"
    p = subprocess.Popen([sys.executable, "-m", "ember.frontends.cli", "launch", "--nproc-per-node", "3", "--",
                          sys.executable, str(SCRIPT), str(tmp_path / "res.json")], env=env,
                         stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    if how == "kill":
        while len([f for f in pids.iterdir() if f.suffix != ".tmp"]) < 3 and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        os.kill(int((pids / "1").read_text()), signal.SIGKILL)
        t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=150 if how == "exit" else 30)
    finally:
        if p.poll() is None:
            p.kill()
    assert time.monotonic() - t0 < 30 or how == "exit"
    assert p.returncode != 0
    assert "rank 1 failed" in err, err
    assert ("exit code 3" if how == "exit" else "SIGKILL") in err, err


@pytest.mark.slow
def test_mnist_over_two_ranks_rank0_alone_writes_metrics(tmp_path):
    from models import MNIST_DIR
    if not MNIST_DIR.exists():
        pytest.skip(f"no MNIST at {MNIST_DIR}")
    _mpiexec()
    metrics = tmp_path / "m.jsonl"
    r = _ember("launch", "--nproc-per-node", "2", "--", sys.executable, "-m", "ember.frontends.cli", "mnist",
               "--model", "mlp", "--device", "cpu", "--epochs", "1", "--limit-steps", "4", "--log-every", "2",
               "--data", str(MNIST_DIR), "--metrics-file", str(metrics), "--no-progress", "--eval-batch-size", "5000",
               "--bucket-bytes", "4096", env=_clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ember mnist: mlp") == 1  # rank 0 alone prints
    assert "global batch 128" in r.stdout and "0 dropped" in r.stdout
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    runs = [x for x in recs if x["type"] == "run"]
    assert len(runs) == 1 and runs[0]["world_size"] == 2 and runs[0]["global_batch_size"] == 128
    # the MLP's gradients in 4 KiB buckets: the last layer's and the first bias, the first weight alone
    assert (runs[0]["bucket_bytes"], runs[0]["buckets"]) == (4096, 2)
    assert "2 bucket(s) of at most 4096 bytes" in r.stdout
    assert [x["step"] for x in recs if x["type"] == "step"] == [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("mpi", [True, False], ids=["mpi", "no-mpi"])
def test_sigint_reaches_every_rank(tmp_path, mpi):
    import signal
    import time
    if mpi:
        _mpiexec()
    code = ("import os, sys, time\n"  # the 'up' file inside the try: a SIGINT right after it is still seen
            f"try:\n    open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write('up')\n    time.sleep(120)\n"
            "except KeyboardInterrupt:\n"
            f"    open(os.path.join({str(tmp_path)!r}, 'int' + os.environ['RANK']), 'w').write('x'); sys.exit(130)\n")
    args = ["launch", "--nproc-per-node", "2"] + ([] if mpi else ["--no-mpi"]) + ["--", sys.executable, "-c", code]
    p = subprocess.Popen([sys.executable, "-m", "ember.frontends.cli", *args], env=_clean_env(),
                         stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not all((tmp_path / r).exists() for r in "01") and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert (tmp_path / "int0").exists() and (tmp_path / "int1").exists()  # each rank saw its KeyboardInterrupt
