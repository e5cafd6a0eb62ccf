"""Each kernel of a zoo model's CUDA training step timed alone, biggest first, with its family, its
operands' shapes and its rate (a diagnostic, not a test): `ember bench --profile` without the step
replayed once per kernel, so it takes seconds at batch 1024 where that takes minutes.

    python tools/kernel_times.py airbench 1024 [--bf16] [--tf32] [--top 32] [--repeats 10]

Prints the step's device time (CUDA events over replays of its graph), the sum of the kernels
alone, that sum by family, and the `--top` kernels: microseconds, TFLOP/s in direct-convolution
(or matmul) multiply-adds for contractions (a Winograd kernel's real rate is lower by its saving),
GB/s of compulsory traffic for the rest.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("batch", type=int)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--top", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10, help="timed launches of each kernel (the median is kept)")
    args = ap.parse_args()
    import cupy as cp  # after the arguments: --help works without a GPU

    from cuda_step_overhead import events_per_step  # a sibling script: its folder is on the path
    from ember.frontends import compile as ember_compile
    from ember.frontends import nn, optim
    from ember.frontends.cli.bench_cuda import kernel_profile
    from ember.frontends.training.zoo import ZOO, zoo_model
    from ember.runtime.cuda import wait_for_builds_ahead

    if args.model not in ZOO:
        raise SystemExit(f"kernel_times: unknown model {args.model!r} (known: {', '.join(ZOO)})")
    rng = np.random.default_rng(0)
    x = rng.random((args.batch, *ZOO[args.model].input_shape), dtype=np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int64)
    precision = "bf16" if args.bf16 else "tf32" if args.tf32 else "float32"
    step = ember_compile(zoo_model(args.model, 0), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y),
                         device="cuda", precision=precision)
    xd, yd = cp.asarray(x), cp.asarray(y)
    for _ in range(10):
        step.run(xd, yd, check_labels=False)
    wait_for_builds_ahead()  # (their rendering holds the GIL)
    step_us = events_per_step(cp, lambda i: step.run(xd, yd, check_labels=False))
    graph = step._example_step()[1].graph
    about = {}
    for n in graph.g:
        if graph.op(n) == "fused":
            spec, sub = graph.attrs(n)["kernel"], graph.attrs(n)["graph"]
            shapes = " ".join("x".join(map(str, sub.type(o).shape)) for o in sub.operands(spec.core)) \
                if spec.core is not None else ""
            about[sub.name] = (spec.choice[0] if spec.choice else "-", spec.describe()[:60], shapes)
    rows = kernel_profile(step, repeats=args.repeats, shares=False)
    print(f"{args.model}:{args.batch} {precision}: step {step_us:.1f} us; kernels alone {sum(r['us'] for r in rows):.1f} us, "
          f"{len(rows)} kernels")
    by_family: dict[str, float] = defaultdict(float)
    for r in rows:
        by_family[about.get(r["kernel"], ("?",))[0]] += r["us"]
    print("by family (us): " + ", ".join(f"{f} {us:.0f}" for f, us in sorted(by_family.items(), key=lambda kv: -kv[1])))
    for r in sorted(rows, key=lambda r: -r["us"])[:args.top]:
        family, text, shapes = about.get(r["kernel"], ("?", "?", ""))
        rate = f"{r['tflops']:6.1f} TF/s" if r["tflops"] is not None else f"{r['gb_per_s']:6.0f} GB/s"
        print(f"{r['us']:9.1f} us {rate}  {family:14s} {text:60s} {shapes}")


if __name__ == "__main__":
    main()
