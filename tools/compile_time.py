"""Compile time of the recipe models, cold (an empty cache) and warm, and for a new batch size.

    python tools/compile_time.py --device cpu --models cnn resnet8
    python tools/compile_time.py --device cuda --models cnn resnet8 --json out.json

Each measurement runs in a fresh process (imports and the compiler's in-process caches do not
carry over), with `EMBER_CACHE_DIR` pointing at a new folder for "cold" and at the same folder
again for "warm"; "new batch" compiles the training step for another batch size in a process
whose cache holds the first one. Wall seconds of `compile()` alone (the data is random).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
import numpy as np
from ember.frontends import compile, nn, optim
from ember.frontends.training.recipes import MODELS, build_model
name, device, batch, second = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
flat = MODELS[name][1]
shape = (784,) if flat else (1, 28, 28)
x = np.zeros((batch, *shape), np.float32)
y = np.zeros(batch, np.int64)
model = build_model(name)
t = time.perf_counter()
step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device=device)
first = time.perf_counter() - t
again = None
if second:
    t = time.perf_counter()
    step.precompile((second, *shape))
    again = time.perf_counter() - t
stats = getattr(step, "compile_stats", None)
print(json.dumps({"compile_s": first, "new_batch_s": again, "stats": stats if isinstance(stats, dict) else None}))
"""


def _run(model: str, device: str, batch: int, cache: str, second: int = 0) -> dict:
    # CuPy's NVRTC cache too: ember points it under EMBER_CACHE_DIR only where it is not set
    env = dict(os.environ, EMBER_CACHE_DIR=cache, CUPY_CACHE_DIR=os.path.join(cache, "cupy"))
    out = subprocess.run([sys.executable, "-c", CHILD, model, device, str(batch), str(second)], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{model} on {device} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", default=["cnn", "mlp", "lenet5", "resnet8"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-batch", type=int, default=7, help="the batch size compiled after a warm start")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="ember-compile-time-") as cache:
            t = time.perf_counter()
            cold = _run(model, args.device, args.batch, cache)
            cold_wall = time.perf_counter() - t
            warm = _run(model, args.device, args.batch, cache, second=args.new_batch)
        row = {"model": model, "device": args.device, "batch": args.batch, "cold_s": round(cold["compile_s"], 3),
               "cold_process_s": round(cold_wall, 3), "warm_s": round(warm["compile_s"], 3),
               "new_batch": args.new_batch, "new_batch_s": round(warm["new_batch_s"], 3), "cold_stats": cold["stats"]}
        rows.append(row)
        print(f"{model:8s} {args.device:5s} cold {row['cold_s']:7.2f} s  warm {row['warm_s']:6.2f} s  "
              f"batch {args.new_batch} after warm {row['new_batch_s']:6.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
