"""One data-parallel CPU step per rank (run under `ember launch` or `mpiexec -n N`): every rank
trains the MLP from the same weights on its shard of a global batch of B, rank 0 also runs one
rank on the whole batch, and writes {"max_rel": ..., "ranks_equal": ...} to argv[1]."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import mlp, params_of, train_graph  # noqa: E402

import ember.runtime  # noqa: E402,F401
from ember.passes.data_parallel import data_parallel  # noqa: E402
from ember.passes.pipeline import run_passes  # noqa: E402
from ember.runtime import comm as C  # noqa: E402
from ember.runtime.cpu import CpuExecutor  # noqa: E402
from ember.runtime.executor import HostStorage  # noqa: E402


def planned(graph):
    return run_passes(graph, ember.runtime.target("cpu").passes())


def main(out: str, batch: int = 12, steps: int = 1) -> None:
    comm = C.from_env()
    rank, size = comm.rank, comm.size
    if os.environ.get("EMBER_TEST_PIDDIR"):
        pid_file = os.path.join(os.environ["EMBER_TEST_PIDDIR"], str(rank))
        with open(pid_file + ".tmp", "w") as f:  # renamed whole: the test reads it as soon as it exists
            f.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
    if os.environ.get("EMBER_TEST_FAIL_RANK") == str(rank):
        os._exit(3)  # not sys.exit: mpi4py's atexit MPI_Finalize would wait for the other ranks
    if os.environ.get("EMBER_TEST_HANG"):
        import time
        time.sleep(600)
    rng = np.random.default_rng(1)
    x = rng.random((batch, 784), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    m = mlp(seed=rank)  # different weights on every rank: the broadcast from rank 0 must fix them
    params = {k: v.copy() for k, v in params_of(m).items()}
    C.broadcast_parameters(comm, params)
    start = {k: v.copy() for k, v in params.items()}
    shard = batch // size
    step = planned(data_parallel(train_graph(m, (shard, 784), lr=0.5), size, bucket_bytes=4096))
    ex = CpuExecutor(step, HostStorage(params), name=f"dp{size}", communicator=comm)
    sl = slice(rank * shard, (rank + 1) * shard)
    losses = [float(ex({"x": x[sl], "y": y[sl]})["loss"]) for _ in range(steps)]
    digest = np.frombuffer(C.state_digest(sorted(params.items())), np.uint8).astype(np.float64)
    ref = digest.copy()
    comm.broadcast(ref, 0)
    same = np.array([float(np.array_equal(digest, ref))])
    comm.all_reduce(same, "sum")
    # the same through the public API: compile(communicator=) broadcasts rank 0's weights itself
    from ember.frontends import compile as ember_compile
    from ember.frontends import nn
    from ember.passes.optimizer import SGD
    m2 = mlp(seed=10 + rank)
    ts = ember_compile(m2, nn.CrossEntropyLoss(), SGD(lr=0.5), (x[sl], y[sl]), device="cpu", communicator=comm)
    start2 = {k: v.copy() for k, v in params_of(m2).items()}
    api_loss = ts(x[sl], y[sl])
    if rank == 0:
        m3 = mlp()
        for k, p in m3.named_parameters():
            p.data[...] = start2[k]
        one3 = ember_compile(m3, nn.CrossEntropyLoss(), SGD(lr=0.5), (x, y), device="cpu")
        want3 = one3(x, y)
        got2, want2 = params_of(m2), params_of(m3)
        api_rel = max(float(np.abs(got2[k] - want2[k]).max() / max(np.abs(want2[k] - start2[k]).max(), 1e-30))
                      for k in got2)
        api_loss_rel = abs(api_loss - want3) / abs(want3)
    if rank == 0:
        whole = {k: v.copy() for k, v in start.items()}
        one = CpuExecutor(planned(train_graph(m, (batch, 784), lr=0.5)), HostStorage(whole), name="dp1")
        want_losses = [float(one({"x": x, "y": y})["loss"]) for _ in range(steps)]
        rel = max(float(np.abs(params[k] - whole[k]).max() / max(np.abs(whole[k] - start[k]).max(), 1e-30))
                  for k in params)
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
        with open(out, "w") as f:
            json.dump({"size": size, "max_rel": rel, "loss_rel": loss_rel, "ranks_equal": bool(same[0] == size),
                       "comm_seconds": ex.comm_seconds,
                       "api_rel": api_rel, "api_loss_rel": api_loss_rel, "segments": len(ex.source.segments)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
