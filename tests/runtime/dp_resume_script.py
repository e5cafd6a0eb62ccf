"""Resumes an `ember mnist` checkpoint (MLP, SGD momentum) on this world (alone, or under
`mpiexec -n M` / `ember launch`) through `Trainer.load`, and writes to argv[2] (rank 0):
whether every rank loaded exactly the checkpoint's parameters and optimizer state, whether
every rank still holds the same bits after 2 more steps, and the relative difference of those
2 steps from one process stepping the global batches (the same samples) from the checkpoint."""
from __future__ import annotations

import json
import sys

import numpy as np

from ember.frontends import compile as ember_compile
from ember.frontends import nn
from ember.frontends.training import Trainer, build_model, make_optimizer
from ember.frontends.checkpoint import load_checkpoint
from ember.runtime import comm as C
from ember.runtime.data import load_mnist

STEPS, BATCH = 2, 64


def main(ckpt_path: str, out: str, data: str) -> None:
    comm = C.from_env()
    rank, size = comm.rank, comm.size
    x, y = load_mnist(data, "train", flat=True)
    ck = load_checkpoint(ckpt_path)
    opt = lambda: make_optimizer("sgd", 0.05, 0.9)  # noqa: E731
    t = Trainer(build_model("mlp", 1 + rank, "ember"), opt(), (x, y), device="cpu", batch_size=BATCH,
                limit_steps=STEPS, communicator=comm if size > 1 else None)
    t.load(ck)
    same = all(np.array_equal(v, ck.model[k]) for k, v in t.step.state_dict().items())
    same &= all(np.array_equal(v, ck.optimizer[k]) for k, v in t.step.optimizer_state_dict().items())
    loaded = np.array([float(same)])
    comm.all_reduce(loaded, "sum")
    t.fit(ck.epoch + 1)
    after = {**t.step.state_dict(), **{"opt/" + k: v for k, v in t.step.optimizer_state_dict().items()}}
    digest = np.frombuffer(C.state_digest(sorted(after.items())), np.uint8).astype(np.float64)
    ref = digest.copy()
    comm.broadcast(ref, 0)
    equal = np.array([float(np.array_equal(digest, ref))])
    comm.all_reduce(equal, "sum")
    if rank != 0:
        return
    per = len(x) // size  # rank r's shard is x[r*per:(r+1)*per]; step i reads its rows i*B:(i+1)*B
    batches = [np.concatenate([np.arange(r * per + i * BATCH, r * per + (i + 1) * BATCH) for r in range(size)])
               for i in range(STEPS)]
    one = ember_compile(build_model("mlp", 0, "ember"), nn.CrossEntropyLoss(), opt(),
                        (x[batches[0]], y[batches[0]]), device="cpu")
    one.load_state_dict(ck.model)
    one.load_optimizer_state_dict(ck.optimizer)
    for b in batches:
        one(x[b], y[b])
    want = one.state_dict()
    rel = max(float(np.abs(after[k] - want[k]).max() / max(np.abs(want[k] - ck.model[k]).max(), 1e-30)) for k in want)
    with open(out, "w") as f:
        json.dump({"size": size, "loaded_equal": bool(loaded[0] == size), "ranks_equal": bool(equal[0] == size), "max_rel": rel,
                   "epoch": t.epoch, "step": t.global_step, "records": [r["type"] for r in t.records]}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
