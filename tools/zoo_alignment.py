"""A zoo model's training step against PyTorch, per step from the same weights, at any width (a
diagnostic, not a test: tests/frontends/training/test_zoo.py runs the same comparison at small
widths).

    python tools/zoo_alignment.py airbench [--width 1.0] [--steps 3] [--batch 8] [--device cpu]
                                           [--force conv2d=winograd,...] [--no-tuning] [--params]

Before every step PyTorch float32 and float64 are loaded with ember's current weights and take
the same SGD step; ember's update error against the float64 update is divided by PyTorch
float32's (a ratio near 1: ember rounds as PyTorch does). `--force kind=family,...` compiles with
those kernel families (the CPU or CUDA choice table's `force`), `--no-tuning` with the cost
model alone, `--params` adds each parameter's errors after the first step.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

import numpy as np


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch's threads")
    ap.add_argument("--force", default="", help="kind=family,... (e.g. conv2d=winograd)")
    ap.add_argument("--no-tuning", action="store_true", help="the cost model alone (no tuning database)")
    ap.add_argument("--params", action="store_true", help="each parameter's update errors after the first step")
    return ap.parse_args()


def _error(new, exact, old, keys) -> float:
    num = sum(float(np.sum((np.asarray(new[k], np.float64) - exact[k]) ** 2)) for k in keys)
    den = sum(float(np.sum((exact[k] - np.asarray(old[k], np.float64)) ** 2)) for k in keys)
    return (num / den) ** 0.5 if den else 0.0


def main() -> None:
    args = _args()
    os.environ.setdefault("EMBER_CACHE_DIR", tempfile.mkdtemp(prefix="ember_align_"))  # no cached plan
    import torch

    from ember.codegen import cpp_choices, cuda_choices, tuning_db
    from ember.frontends import compile, nn, optim
    from ember.frontends.training.torch_twins import torch_sgd_step
    from ember.frontends.training.zoo import ZOO, ember_zoo_model, torch_zoo_model
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shape = ZOO[args.model].input_shape
    batches = [(rng.random((args.batch, *shape), dtype=np.float32), rng.integers(0, 10, args.batch))
               for _ in range(args.steps)]
    model = ember_zoo_model(args.model, torch_module=torch_zoo_model(args.model, args.width, seed=0))
    table = cuda_choices if args.device.startswith("cuda") else cpp_choices
    forced = dict(pair.split("=", 1) for pair in args.force.split(",") if pair)
    with (table.force(**forced) if forced else contextlib.nullcontext()), \
            (tuning_db.using(None) if args.no_tuning else contextlib.nullcontext()):
        step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=args.lr), example_inputs=batches[0],
                       device=args.device)
    t32, t64 = (torch_zoo_model(args.model, args.width) for _ in range(2))
    ratios = []
    for i, (x, y) in enumerate(batches):
        before = {k: np.array(v) for k, v in step.state_dict().items()}
        loss32, after32 = torch_sgd_step(t32, before, x, y, torch.float32, args.lr)
        _, after64 = torch_sgd_step(t64, before, x, y, torch.float64, args.lr)
        loss = step(x, y)
        after = {k: np.array(v) for k, v in step.state_dict().items()}
        e, t = _error(after, after64, before, after64), _error(after32, after64, before, after64)
        ratios.append(e / t)
        print(f"step {i}: loss {loss:.6f} (torch f32 {loss32:.6f}); update error vs float64: ember {e:.3g}, "
              f"torch f32 {t:.3g}, ratio {e / t:.3f}")
        if args.params and i == 0:
            for k in after64:
                e1, t1 = _error(after, after64, before, [k]), _error(after32, after64, before, [k])
                print(f"  {k:28s} {str(before[k].shape):20s} ember {e1:9.3g} torch {t1:9.3g} ratio "
                      f"{e1 / t1 if t1 else float('nan'):6.2f}")
    print(f"{args.model} width {args.width} {args.device}: median ratio {np.median(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
