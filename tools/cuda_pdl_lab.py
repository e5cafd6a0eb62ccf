"""What launching each kernel as its predecessor's programmatic dependent does to a step (a
diagnostic run on a GPU, not a test): the step's graph with every launch plain, with every
eligible launch dependent, and with only kernel k's launches dependent, for each k; device time
per step (best of rounds of replays), so a kernel's delta is what its dependent launch saves or costs.

    python tools/cuda_pdl_lab.py --cases vit:1024,cnn:64 [--out rows.json]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def graph_time(executor, mask, replays: int = 50, rounds: int = 3) -> float:
    """The step's device time with only the launches `mask` keeps made dependents."""
    from ember.frontends.cli.bench_cuda import captured_step_time
    saved = list(executor._dependent)
    executor._dependent = [d if keep else None for d, keep in zip(saved, mask)]
    try:
        return captured_step_time(executor, replays, rounds)
    finally:
        executor._dependent = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="cnn:64")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["EMBER_CUDA_PDL"] = "1"  # the executor makes the dependent launches this times
    from ember.frontends import compile as ember_compile
    from ember.frontends import nn, optim
    from ember.frontends.training.zoo import ZOO, zoo_model
    report = []
    for case in args.cases.split(","):
        name, batch = case.split(":")
        batch = int(batch)
        rng = np.random.default_rng(0)
        x = rng.random((batch, *ZOO[name].input_shape), dtype=np.float32)
        y = rng.integers(0, 10, batch).astype(np.int64)
        step = ember_compile(zoo_model(name, 0), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y),
                             device="cuda")
        for _ in range(3):
            step.run(x, y)
        executor = step._example_step()[1]
        graph = executor.graph
        spec_of = {graph.attrs(n)["graph"].name: graph.attrs(n)["kernel"] for n in graph.g if graph.op(n) == "fused"}
        names = [la.kernel for la in executor.source.launches]
        plain = graph_time(executor, [False] * len(names))
        every = graph_time(executor, [True] * len(names))
        rows = []
        for kernel in dict.fromkeys(names):
            mask = [n == kernel for n in names]
            if not any(d is not None for d, m in zip(executor._dependent, mask) if m):
                continue
            t = graph_time(executor, mask)
            spec = spec_of[kernel]
            launches = [(la.function, la.grid, la.block, la.shared_bytes) for la in executor.source.launches if la.kernel == kernel]
            rows.append({"kernel": kernel, "delta_us": round(t - plain, 2), "kind": spec.kind,
                         "choice": str(spec.choice)[:60], "launches": launches})
        rows.sort(key=lambda r: -r["delta_us"])
        print(f"{name}:{batch} plain {plain:.1f} us, every launch dependent {every:.1f} us, sum of single deltas "
              f"{sum(r['delta_us'] for r in rows):.1f} us", flush=True)
        for r in rows[:12] + [{"kernel": "..."}] + rows[-6:]:
            if r["kernel"] == "...":
                print("  ...")
                continue
            print(f"  {r['delta_us']:+8.2f} us {r['kernel']:24} {r['kind']:18} {r['choice']:40} "
                  f"{[(g, b, s) for _, g, b, s in r['launches']]}", flush=True)
        report.append({"case": case, "plain_us": plain, "every_us": every, "kernels": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
