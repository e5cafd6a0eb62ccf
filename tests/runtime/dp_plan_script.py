"""A data-parallel Trainer whose step plan comes from argv (epochs, limit steps), so that `ember
launch` can give the ranks different ones: the start-of-run check must stop every rank (exit 1,
rank 0 printing the one line), where the rank with fewer steps used to leave the others waiting
in an all-reduce forever."""
from __future__ import annotations

import sys

import numpy as np

from ember.frontends import nn, optim
from ember.frontends.training import Trainer
from ember.runtime import comm as C
from ember.runtime.consistency import ConsistencyError


def main(epochs: int, limit: int) -> int:
    comm = C.from_env()
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 4), dtype=np.float32), rng.integers(0, 3, 64)
    t = Trainer(nn.Linear(4, 3), optim.SGD(lr=0.1), (x, y), device="cpu", batch_size=8, limit_steps=limit,
                communicator=comm)
    try:
        t.fit(epochs)
    except ConsistencyError as e:
        if comm.rank == 0:
            print(f"dp_plan_script: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
