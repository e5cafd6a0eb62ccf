"""ember's CPU training step in several precisions, timed alternately (a diagnostic, not a test),
and optionally each contraction kernel on its own: for machines shared with other work, where
wall-clock times say more about the neighbours than about the step.

    python tools/cpu_step_time.py --cases cnn:64,cnn:1024,resnet8:64 [--precisions float32,bf16]
                                  [--threads 2] [--rounds 6] [--kernels]

Every precision's step is compiled first; then `--rounds` rounds time each one in turn (a few
steps each), so load from elsewhere falls on all of them alike. Each step is timed by the wall
clock and by the CPU time the process used (all threads), with OpenMP's waiting threads asleep
(OMP_WAIT_POLICY=passive, set before the OpenMP runtime starts), so the CPU time divided by the
thread count is what the step would take on idle cores (it counts thread wake-ups, not time
spent waiting for a core). Printed: the median and p10 of both, and the ratio of each precision's
median to the first's. `--kernels` adds every contraction kernel's CPU time per call (the tuner's
measurer on its stamped choice, `CpuMeasurer(cpu_time=True)`, the median of 7 rounds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="cnn:64,cnn:1024", help="model:batch,... (zoo models)")
    ap.add_argument("--precisions", default="float32,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--kernels", action="store_true", help="also each contraction kernel's CPU time")
    return ap.parse_args()


def _kernel_times(graph, threads: int) -> list[tuple[float, str, str]]:
    """(microseconds per call, kernel, choice) of each contraction kernel of a step: the CPU time
    it used over the threads, the median of 7 rounds."""
    from ember.codegen.tuning_db import choice_text
    from ember.ir.kernel import CONTRACTIONS
    from ember.runtime.tuner import kernels_of
    from ember.runtime.tuner_cpu import CpuMeasurer
    measurer = CpuMeasurer(threads=threads, rounds=7, target_s=0.02, cpu_time=True)
    out = []
    for sub, spec in kernels_of(graph):
        if spec.kind in CONTRACTIONS:
            trial, = measurer.measure(sub, spec, [spec.choice])
            out.append((trial.time_us or float("nan"), sub.name, choice_text(spec.choice)))
    return out


def main() -> None:
    args = _args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["OMP_WAIT_POLICY"] = "passive"
    import numpy as np

    from ember.frontends import compile as ember_compile
    from ember.frontends import nn, optim
    from ember.frontends.training.zoo import ZOO, zoo_model
    precisions = args.precisions.split(",")
    for case in args.cases.split(","):
        name, batch = case.split(":")
        batch = int(batch)
        rng = np.random.default_rng(0)
        xs = [rng.random((batch, *ZOO[name].input_shape), dtype=np.float32) for _ in range(4)]
        ys = [rng.integers(0, 10, batch).astype(np.int64) for _ in range(4)]
        steps = {p: ember_compile(zoo_model(name, 0), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                                  example_inputs=(xs[0], ys[0]), device="cpu", precision=p) for p in precisions}
        per_round = max(2, 1280 // batch)
        wall: dict[str, list[float]] = {p: [] for p in precisions}
        cpu: dict[str, list[float]] = {p: [] for p in precisions}
        for i in range(3):  # warm-up
            for s in steps.values():
                float(s.run(xs[i % 4], ys[i % 4]))
        for _ in range(args.rounds):
            for p, s in steps.items():
                for i in range(per_round):
                    c0, t0 = time.process_time(), time.perf_counter()
                    float(s.run(xs[i % 4], ys[i % 4]))
                    wall[p].append((time.perf_counter() - t0) * 1e3)
                    cpu[p].append((time.process_time() - c0) * 1e3 / args.threads)
        first = precisions[0]
        for p in precisions:
            q = lambda v: (statistics.median(v), float(np.percentile(v, 10)))  # noqa: E731
            (wm, w10), (cm, c10) = q(wall[p]), q(cpu[p])
            print(f"{name}:{batch} {p:8} wall median {wm:9.3f} ms (p10 {w10:9.3f})  cpu/{args.threads} median "
                  f"{cm:9.3f} ms (p10 {c10:9.3f})  ratio to {first}: wall {wm / statistics.median(wall[first]):.3f}, "
                  f"cpu {cm / statistics.median(cpu[first]):.3f}", flush=True)
        if args.kernels:
            for p, s in steps.items():
                rows = _kernel_times(s.train_graph, args.threads)
                print(f"  {p}: contraction kernels {sum(r[0] for r in rows) / 1e3:.3f} ms (CPU time / {args.threads})")
                for us, kernel, choice in sorted(rows, reverse=True):
                    print(f"    {us:9.1f} us  {kernel:26} {choice}")


if __name__ == "__main__":
    main()
