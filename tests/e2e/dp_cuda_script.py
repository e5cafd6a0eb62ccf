"""One rank of a data-parallel CUDA run (NCCL), started by test_cuda_data_parallel.py or by hand:

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 python dp_cuda_script.py OUT.json

Each rank trains the MNIST CNN on its half of every batch of 64 (random MNIST-shaped data).
Rank 0 also keeps a single-GPU step on the whole batch: per step, loaded with the data-parallel
weights before each step, it must make the same update (relative to the update's size); then
both run free for 200 steps and their losses are compared; then samples/s of each, batch 64 per
rank. Rank 0 writes the figures to OUT.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from ember.frontends import compile, nn, optim
from ember.frontends.training import build_model
from ember.runtime import cuda_comm


def main(out: str) -> None:
    comm = cuda_comm.from_env()
    rank, size = comm.rank, comm.size
    rng = np.random.default_rng(0)
    steps, batch = 200, 64
    xs = rng.random((steps, batch, 1, 28, 28), dtype=np.float32)
    ys = rng.integers(0, 10, (steps, batch)).astype(np.int64)
    per = batch // size
    shard = slice(rank * per, (rank + 1) * per)
    dp = compile(build_model("cnn"), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                 example_inputs=(xs[0][shard], ys[0][shard]), device="cuda", communicator=comm)
    ref = compile(build_model("cnn"), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                  example_inputs=(xs[0], ys[0]), device="cuda") if rank == 0 else None
    report: dict = {"world_size": size}
    # per step, from the same weights
    rel = []
    for i in range(20):
        before = dp.state_dict()
        if ref is not None:
            ref.load_state_dict(before)
            ref(xs[i], ys[i])
        dp(xs[i][shard], ys[i][shard])
        if ref is not None:
            after, want = dp.state_dict(), ref.state_dict()
            rel.append(max(float(np.abs((after[k] - before[k]) - (want[k] - before[k])).max()
                                 / max(np.abs(want[k] - before[k]).max(), 1e-30)) for k in before))
    # free running from the same weights
    if ref is not None:
        ref.load_state_dict(dp.state_dict())
    diffs = []
    for i in range(steps):
        loss = dp(xs[i][shard], ys[i][shard])
        if ref is not None:
            diffs.append(abs(loss - ref(xs[i], ys[i])))
    # throughput, batch 64 per rank
    fast = compile(build_model("cnn"), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                   example_inputs=(xs[0], ys[0]), device="cuda", communicator=comm)
    import cupy
    dx, dy = cupy.asarray(xs[:8]), cupy.asarray(ys[:8])
    for i in range(20):
        fast.run(dx[i % 8], dy[i % 8], check_labels=False)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        fast.run(dx[i % 8], dy[i % 8], check_labels=False)
    cupy.cuda.Device().synchronize()
    report["samples_per_s"] = size * batch * steps / (time.perf_counter() - t0)
    if rank == 0:
        report.update(per_step_update_rel_diff_max=max(rel), per_step_update_rel_diff_median=float(np.median(rel)),
                      free_running_loss_diff_max=max(diffs), steps=steps)
        with open(out, "w") as f:
            json.dump(report, f)
    comm.close()


if __name__ == "__main__":
    main(sys.argv[1])
