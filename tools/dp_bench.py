"""Samples/s of the CNN step, one process or one rank of a data-parallel world (run under
`ember launch` / `mpiexec`), and the share of the step spent in communication (rank 0 prints):
"comm" is the time in the communicator's path (copies into and out of the flat bucket buffers,
starting, progressing and waiting for the all-reduces: it includes waiting for the slower
rank), "allreduce" the time inside the MPI calls alone. The load average is printed with it.
    OMP_NUM_THREADS=2 python tools/dp_bench.py 64
    OMP_NUM_THREADS=1 mpiexec -n 2 python tools/dp_bench.py 32 [STEPS] [BUCKET_BYTES]
    EMBER_COMM_OVERLAP=0 ... (blocking all-reduces, for comparison)"""
from __future__ import annotations

import os
import sys
import time

import numpy as np


from ember.frontends import compile as ember_compile  # noqa: E402
from ember.frontends.training.recipes import build_model  # noqa: E402
from ember.frontends import nn  # noqa: E402
from ember.passes.optimizer import SGD  # noqa: E402
from ember.runtime import comm as C  # noqa: E402

batch, steps = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20
extra = {"bucket_bytes": int(sys.argv[3])} if len(sys.argv) > 3 else {}
comm = C.from_env()
rng = np.random.default_rng(comm.rank)
x = rng.random((batch, 1, 28, 28), dtype=np.float32)
y = rng.integers(0, 10, batch)
step = ember_compile(build_model("cnn"), nn.CrossEntropyLoss(), SGD(lr=0.01), (x, y), device="cpu", communicator=comm, **extra)
for _ in range(3):
    step(x, y)
ex = next(iter(step._steps.values()))[1]
c0, r0 = getattr(ex, "comm_seconds", 0.0), getattr(ex, "reduce_seconds", 0.0)
comm.barrier()
t0 = time.perf_counter()
ticks = [t0]
for _ in range(steps):
    step(x, y)
    ticks.append(time.perf_counter())
comm.barrier()
dt = time.perf_counter() - t0
per = np.diff(ticks) * 1e3  # rank 0's step times: the median and the best resist a loaded machine
if comm.rank == 0:
    share = (getattr(ex, "comm_seconds", 0.0) - c0) / dt
    reduce = (getattr(ex, "reduce_seconds", 0.0) - r0) / dt
    runner = getattr(ex, "_runner", None)
    mode = "" if runner is None else (" overlap" if runner.overlap else " blocking") + \
        f", {sum(map(len, runner.starts))} all-reduces/step"
    print(f"ranks {comm.size} x batch {batch} x {os.environ.get('OMP_NUM_THREADS')} threads{mode}: "
          f"{steps * batch * comm.size / dt:.0f} samples/s, {dt / steps * 1e3:.2f} ms/step "
          f"(median {np.median(per):.2f}, best {per.min():.2f}: {batch * comm.size / np.median(per) * 1e3:.0f} "
          f"samples/s at the median), "
          f"comm {100 * share:.1f}%, allreduce {100 * reduce:.1f}% of the step "
          f"({(getattr(ex, 'reduce_seconds', 0.0) - r0) / steps * 1e3:.3f} ms/step); "
          f"load {os.getloadavg()[0]:.2f}")
if comm.size > 1:  # the all-reduce of the step's gradients alone, the ranks lined up by a barrier first
    flat = np.zeros(sum(p.data.size for p in step.model.parameters()), np.float32)
    times = []
    for _ in range(30):
        comm.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(flat, "mean")
        times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        print(f"all-reduce of {flat.nbytes / 1e6:.2f} MB after a barrier: median {np.median(times) * 1e3:.3f} ms, "
              f"min {min(times) * 1e3:.3f} ms")
