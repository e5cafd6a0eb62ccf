"""Samples/s of the CNN step, one process or one rank of a data-parallel world (run under
`ember launch` / `mpiexec`), and the share of the step spent in communication (rank 0 prints).
    OMP_NUM_THREADS=2 python tests/runtime/dp_bench.py 64
    OMP_NUM_THREADS=1 mpiexec -n 2 python tests/runtime/dp_bench.py 32"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import cnn  # noqa: E402

from ember.frontends import compile as ember_compile  # noqa: E402
from ember.frontends import nn  # noqa: E402
from ember.passes.optimizer import SGD  # noqa: E402
from ember.runtime import comm as C  # noqa: E402

batch, steps = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 20
comm = C.from_env()
rng = np.random.default_rng(comm.rank)
x = rng.random((batch, 1, 28, 28), dtype=np.float32)
y = rng.integers(0, 10, batch)
step = ember_compile(cnn(), nn.CrossEntropyLoss(), SGD(lr=0.01), (x, y), device="cpu", communicator=comm)
for _ in range(3):
    step(x, y)
ex = next(iter(step._steps.values()))[1]
c0 = getattr(ex, "comm_seconds", 0.0)
comm.barrier()
t0 = time.perf_counter()
for _ in range(steps):
    step(x, y)
comm.barrier()
dt = time.perf_counter() - t0
if comm.rank == 0:
    share = (getattr(ex, "comm_seconds", 0.0) - c0) / dt
    print(f"ranks {comm.size} x batch {batch} x {os.environ.get('OMP_NUM_THREADS')} threads: "
          f"{steps * batch * comm.size / dt:.0f} samples/s, {dt / steps * 1e3:.2f} ms/step, comm {100 * share:.1f}% of the step")
