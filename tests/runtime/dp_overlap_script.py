"""Overlapped against blocking all-reduces on one data-parallel CPU step (run under `mpiexec -n N`
or `ember launch`): every rank trains the MLP, in buckets of 4 KiB, 3 steps with each bucket's
all-reduce started non-blocking after its last gradient and waited before its first reader, and
3 steps from the same weights with every all-reduce blocking at its boundary; rank 0 writes
whether the losses and the parameters are bit-identical, and the plan, to argv[1]."""
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


def main(out: str, batch: int = 8, steps: int = 3) -> None:
    comm = C.from_env()
    rng = np.random.default_rng(comm.rank)  # every rank its own shard
    xs = rng.random((steps, batch, 784), dtype=np.float32)
    ys = rng.integers(0, 10, (steps, batch))
    m = mlp()
    graph = run_passes(data_parallel(train_graph(m, (batch, 784), lr=0.5), comm.size, bucket_bytes=4096),
                       ember.runtime.target("cpu").passes())
    result = {}
    for overlap in (True, False):
        params = {k: v.copy() for k, v in params_of(m).items()}
        ex = CpuExecutor(graph, HostStorage(params), name="dp_overlap", communicator=comm, overlap=overlap)
        losses = [float(ex({"x": xs[i], "y": ys[i]})["loss"]) for i in range(steps)]
        result[overlap] = (losses, params, ex)
    (la, pa, ex), (lb, pb, _) = result[True], result[False]
    same = float(la == lb and all(np.array_equal(pa[k], pb[k]) for k in pa))
    flag = np.array([same])
    comm.all_reduce(flag, "sum")
    if comm.rank == 0:
        groups = [g for starts in ex._runner.starts for g in starts]
        with open(out, "w") as f:
            json.dump({"size": comm.size, "bit_identical": bool(flag[0] == comm.size), "losses": la,
                       "segments": len(ex.source.segments),
                       "groups": [[g.flat.size, g.start_after, g.wait_before] for g in groups]}, f)


if __name__ == "__main__":
    main(sys.argv[1])
