"""Device time of ember's training step per model and batch (a diagnostic, not a test), with the
kernel choices it ran: how many came from the tuning database, how many from the cost model.
Compare tuning databases by running it under different $EMBER_CACHE_DIR (the user database is
`$EMBER_CACHE_DIR/tuning`); `--no-db` ignores every database (the cost model alone).

    python tools/step_time.py --cases cnn:64,cnn:1024,mlp:64,airbench:64 [--tf32 | --bf16] [--torch] [--out rows.json]
    python tools/step_time.py --device cpu --cases resnet8:64,mobilenet:64 [--bf16] [--steps 20]
    python tools/step_time.py --cases resnet8:64 --runtime-sizes   # every GEMM as a reused plan renders it
    python tools/step_time.py --cases vit:1024 --prefer columns     # a family first wherever it applies

Any model of the zoo (`ember bench --zoo` lists them) can be a case. On the GPU the step is timed
with CUDA events (the median of 5 rounds of 200 steps); on the CPU by the wall clock, each step
alone (the median over --steps, after 3 warm-up steps), with the OpenMP team ember's kernels use.
Two builds are compared by running this once per build, alternately (a shared machine's load
moves between runs), with the same flags: beside `--torch` (PyTorch's graph timed in the same
process) ember's small steps measured 3-12% longer on an H200 (docs/benchmarks.md, session 21).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import Counter

import numpy as np


def main() -> None:
    from ember.codegen import tuning_db
    from ember.frontends import compile as ember_compile
    from ember.frontends import nn, optim
    from ember.frontends.training.zoo import ZOO, zoo_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="cnn:64,cnn:1024,mlp:64,mlp:1024", help="model:batch,...")
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--no-db", action="store_true", help="no tuning database: the cost model's choices")
    ap.add_argument("--torch", action="store_true", help="PyTorch's whole-step CUDA graph beside it")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--bf16", action="store_true", help="precision='bf16' (bfloat16 kernels; --torch: under autocast)")
    ap.add_argument("--steps", type=int, default=20, help="cpu: steps timed (each alone; the median is shown)")
    ap.add_argument("--runtime-sizes", action="store_true",
                    help="cuda: every GEMM kernel on run-time sizes (what a reused plan renders), not specialised")
    ap.add_argument("--prefer", default="", help="families ranked first wherever they apply (a,b): what a "
                    "tuning record choosing them would give, without tuning; the plan cache is off for the run")
    args = ap.parse_args()
    if args.prefer:
        _prefer(args.prefer.split(","), args.device)
    if args.runtime_sizes:
        from ember.codegen import cuda_choices
        cuda_choices.runtime_sizes = lambda spec: True
        os.environ["EMBER_PLAN_CACHE"] = "0"  # a cached plan holds the source rendered without it
    if args.device == "cpu":
        _cpu(args)
        return
    import cupy as cp  # after the arguments: --help works without a GPU

    from ember.runtime.cuda import wait_for_builds_ahead
    from cuda_step_overhead import events_per_step  # a sibling script: its folder is on the path
    rows = []
    for case in args.cases.split(","):
        name, batch = case.split(":")
        batch = int(batch)
        if name not in ZOO:
            raise SystemExit(f"step_time: unknown model {name!r} (known: {', '.join(ZOO)})")
        shape = (batch, *ZOO[name].input_shape)
        rng = np.random.default_rng(0)
        xs_h = rng.random((8, *shape), dtype=np.float32)
        ys_h = rng.integers(0, 10, (8, batch)).astype(np.int64)
        with tuning_db.using(None) if args.no_db else contextlib.nullcontext():
            model = zoo_model(name, 0)
            step = ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                                 example_inputs=(xs_h[0], ys_h[0]), device="cuda",
                                 precision="bf16" if args.bf16 else "tf32" if args.tf32 else "float32")
        xs, ys = cp.asarray(xs_h), cp.asarray(ys_h)
        run = lambda i: step.run(xs[i % 8], ys[i % 8], check_labels=False)  # noqa: E731
        for i in range(30):
            run(i)
        wait_for_builds_ahead()  # (their rendering holds the GIL: launches timed beside it wait)
        graph = step._example_step()[0]
        specs = [graph.attrs(n)["kernel"] for n in graph.meta["schedule"] if graph.op(n) == "fused"]
        why = Counter(s.why.split(":")[0] for s in specs if s.choice is not None)
        row = {"model": name, "batch": batch, "tf32": args.tf32, "bf16": args.bf16, "kernels": len(specs), "why": dict(why),
               "families": dict(Counter(s.choice[0] for s in specs if s.choice is not None)),
               "step_us": round(events_per_step(cp, run), 2)}
        if args.torch:
            import torch

            from ember.frontends.cli.bench_cuda import _torch_systems
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
            txs, tys = torch.from_numpy(xs_h).cuda(), torch.from_numpy(ys_h).cuda()
            replay = dict(_torch_systems(name, zoo_model(name, 0).state_dict(), 0.05, txs[0], tys[0],
                                         bf16=args.bf16))["torch-cudagraph"]
            for i in range(30):
                replay(txs[i % 8], tys[i % 8])
            torch.cuda.synchronize()
            row["torch_cudagraph_us"] = round(events_per_step(cp, lambda i: replay(txs[i % 8], tys[i % 8])), 2)
            row["ratio"] = round(row["step_us"] / row["torch_cudagraph_us"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


def _prefer(names: list[str], device: str) -> None:
    """Ranks these families before every other wherever they apply (the cost model's order after
    them), in this process, before any tuning record of such a kernel: unlike `force`, a kernel
    they cannot serve keeps its usual choice."""
    import dataclasses

    from ember.codegen import cpp_choices, cuda_choices
    table = (cuda_choices if device == "cuda" else cpp_choices).TABLE
    for name in names:
        if name not in table.families:
            raise SystemExit(f"step_time: no {device} family {name!r} (known: {', '.join(table.families)})")
        table.families[name] = dataclasses.replace(table.families[name], priority=-1, preferred=lambda g: True)
    os.environ["EMBER_PLAN_CACHE"] = "0"  # a cached plan would hold the usual choices
    decide = table._decide

    def prefer_over_records(sub, spec, g, db, reuse):
        # a tuning record measured before the family existed would otherwise keep its old choice
        if any(g["kind"] in table.families[n].kinds and table.applies(table.families[n], g) is None
               and table.families[n].plans(g) for n in names):
            db = None
        return decide(sub, spec, g, db, reuse)

    table._decide = prefer_over_records
    ranked = table._ranked

    def named_first(g, db=...):
        # the prior learns from every shipped record even where no database is read: it would
        # rank the families it has measured before these
        families, prior = ranked(g, db)
        return sorted(families, key=lambda f: f.name not in names), prior

    table._ranked = named_first


def _cpu(args: argparse.Namespace) -> None:
    from ember.codegen import cpp_choices, tuning_db
    from ember.frontends import compile as ember_compile
    from ember.frontends import nn, optim
    from ember.frontends.training.zoo import ZOO, zoo_model

    rows = []
    for case in args.cases.split(","):
        name, batch = case.split(":")
        batch = int(batch)
        if name not in ZOO:
            raise SystemExit(f"step_time: unknown model {name!r} (known: {', '.join(ZOO)})")
        rng = np.random.default_rng(0)
        xs = rng.random((4, batch, *ZOO[name].input_shape), dtype=np.float32)
        ys = rng.integers(0, 10, (4, batch)).astype(np.int64)
        with tuning_db.using(None) if args.no_db else contextlib.nullcontext():
            t0 = time.perf_counter()
            step = ember_compile(zoo_model(name, 0), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                                 example_inputs=(xs[0], ys[0]), device="cpu",
                                 precision="bf16" if args.bf16 else "float32")
            compile_s = time.perf_counter() - t0
        for i in range(3):
            step.run(xs[i % 4], ys[i % 4])
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            step.run(xs[i % 4], ys[i % 4])
            times.append(time.perf_counter() - t0)
        graph = step._example_step()[0]
        specs = [graph.attrs(n)["kernel"] for n in graph.meta["schedule"] if graph.op(n) == "fused"]
        row = {"model": name, "batch": batch, "device": "cpu", "bf16": args.bf16, "threads": cpp_choices.threads(),
               "kernels": len(specs), "families": dict(Counter(s.choice[0] for s in specs if s.choice is not None)),
               "compile_s": round(compile_s, 2), "step_ms": round(1e3 * statistics.median(times), 2),
               "p10_ms": round(1e3 * float(np.percentile(times, 10)), 2),
               "p90_ms": round(1e3 * float(np.percentile(times, 90)), 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
