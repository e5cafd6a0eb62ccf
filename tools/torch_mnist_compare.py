#!/usr/bin/env python3
"""One epoch of an MNIST recipe with `ember mnist` and with its PyTorch twin, from the same
initial weights, on the same batches; prints one JSON line with both test accuracies.

    python tools/torch_mnist_compare.py --model lenet5 --data ../shared/data/mnist

The recipe is `ember mnist`'s: PyTorch's default initialisation for --seed (ember reproduces it
bit for bit, so both start from identical weights), pixels/255, the training set in file order,
batch 64 with the last partial batch kept, plain SGD lr 0.05, cross-entropy; the 10k test images
evaluated once after the epoch in eval mode (BatchNorm's running statistics). PyTorch runs on
the CPU with --threads threads. The machine's load (`os.getloadavg`) is recorded before and
after each run: on a shared machine it explains the seconds, not the accuracies.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def run_ember(model: str, data: str, device: str, seed: int, threads: int) -> dict:
    from ember.frontends.cli import main
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        t0 = time.perf_counter()
        rc = main(["mnist", "--model", model, "--device", device, "--epochs", "1", "--data", data, "--seed", str(seed),
                   "--threads", str(threads), "--metrics-file", metrics, "--no-progress"])
        seconds = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"ember mnist failed with status {rc}")
        with open(metrics) as f:
            epoch = [r for r in map(json.loads, f) if r["type"] == "epoch"][-1]
    return {"test_acc": epoch["test_acc"], "test_loss": epoch["test_loss"], "train_loss": epoch["train_loss"],
            "seconds": round(seconds, 1)}


def run_torch(model: str, data: str, seed: int, threads: int, batch: int = 64, lr: float = 0.05) -> dict:
    import torch
    import torch.nn.functional as tF

    from ember.frontends.training import build_model
    from ember.frontends.training.torch_twins import torch_model
    from ember.runtime.data import load_mnist
    torch.set_num_threads(threads)
    flat = model == "mlp"
    x, y = load_mnist(data, "train", flat=flat)
    xt, yt = load_mnist(data, "test", flat=flat)
    tm = torch_model(model)
    tm.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in build_model(model, seed).state_dict().items()})
    opt = torch.optim.SGD(tm.parameters(), lr=lr)
    t0 = time.perf_counter()
    tm.train()
    losses = []
    for i in range(0, len(x), batch):
        opt.zero_grad(set_to_none=True)
        loss = tF.cross_entropy(tm(torch.from_numpy(x[i:i + batch])), torch.from_numpy(y[i:i + batch]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tm.eval()
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(xt), 1000):
            logits = tm(torch.from_numpy(xt[i:i + 1000]))
            target = torch.from_numpy(yt[i:i + 1000])
            total_loss += float(tF.cross_entropy(logits, target, reduction="sum"))
            correct += int((logits.argmax(1) == target).sum())
    return {"test_acc": correct / len(xt), "test_loss": total_loss / len(xt), "train_loss": float(np.mean(losses)),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lenet5")
    ap.add_argument("--data", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    out: dict = {"model": args.model, "device": args.device, "seed": args.seed, "threads": args.threads,
                 "nproc": os.cpu_count()}
    out["load_before_ember"] = _load()
    out["ember"] = run_ember(args.model, args.data, args.device, args.seed, args.threads)
    out["load_before_torch"] = _load()
    out["torch"] = run_torch(args.model, args.data, args.seed, args.threads)
    out["load_after"] = _load()
    import torch
    out["torch_version"] = torch.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
