"""Where a CUDA training step's time goes (a diagnostic run on a GPU machine, not a test).

For each model and batch: the full `step.run` loop as `ember bench` times it; the host time of one
`step.run` (no synchronisation: launches are asynchronous, so this is what the host spends); the
CUDA graph alone replayed back to back (the device's time for one step); and the host parts of a
call (input copies, replay, output copy). PyTorch's captured step is timed the same two ways.

    python tools/cuda_step_overhead.py [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def events_per_step(cp, fn, steps: int = 200, rounds: int = 5) -> float:
    out = []
    for _ in range(rounds):
        cp.cuda.Device().synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(cp.cuda.get_current_stream())
        for i in range(steps):
            fn(i)
        cp.cuda.Device().synchronize()
        stop.record(cp.cuda.get_current_stream())
        stop.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / steps)
    return statistics.median(out)


def _host_per_call(cp, fn, steps: int = 200, rounds: int = 5) -> float:
    out = []
    for _ in range(rounds):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            fn(i)
        out.append((time.perf_counter() - t0) * 1e6 / steps)
        cp.cuda.Device().synchronize()
    return statistics.median(out)


def main() -> None:
    import cupy as cp

    from ember.frontends import compile as ember_compile
    from ember.frontends import nn, optim
    from ember.frontends.training.recipes import MODELS, build_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--cases", default="mlp:64,cnn:64,cnn:1024")
    args = ap.parse_args()
    results = []
    for case in args.cases.split(","):
        name, batch = case.split(":")
        batch = int(batch)
        shape = (batch, 784) if MODELS[name][1] else (batch, 1, 28, 28)
        rng = np.random.default_rng(0)
        xs_h = rng.random((8, *shape), dtype=np.float32)
        ys_h = rng.integers(0, 10, (8, batch)).astype(np.int64)
        step = ember_compile(build_model(name, 0), nn.CrossEntropyLoss(), optim.SGD(lr=0.05),
                             example_inputs=(xs_h[0], ys_h[0]), device="cuda")
        xs, ys = cp.asarray(xs_h), cp.asarray(ys_h)
        xl = [xs[i] for i in range(8)]
        yl = [ys[i] for i in range(8)]
        run = lambda i: step.run(xl[i % 8], yl[i % 8], check_labels=False)  # noqa: E731
        for i in range(30):
            run(i)
        executor = step._example_step()[1]
        row = {"model": name, "batch": batch, "launches": len(executor._launches)}
        row["step_us"] = events_per_step(cp, run)
        row["host_step_us"] = _host_per_call(cp, run)
        graph, stream = executor._graph, executor.stream
        row["graph_only_us"] = events_per_step(cp, lambda i: graph.launch(stream))
        row["host_graph_launch_us"] = _host_per_call(cp, lambda i: graph.launch(stream))
        inputs = {"x": xl[0], "y": yl[0]}
        row["host_load_us"] = _host_per_call(cp, lambda i: executor._load(inputs))
        out = executor._outputs["loss"]
        row["host_copy_out_us"] = _host_per_call(cp, lambda i: executor._copy_out(out))
        row["host_executor_call_us"] = _host_per_call(cp, lambda i: executor(inputs))
        # A/B of the ways to enqueue one device-to-device copy of the x batch (host time per call)
        buf, src = executor._inputs["x"], xl[0]
        rt, sp = cp.cuda.runtime, executor.stream.ptr
        row["host_copy_memptr_us"] = _host_per_call(
            cp, lambda i: buf.data.copy_from_device_async(src.data, src.nbytes, executor.stream))
        row["host_copy_raw_d2d_us"] = _host_per_call(cp, lambda i: rt.memcpyAsync(buf.data.ptr, src.data.ptr, src.nbytes,
                                                                                  3, sp))
        row["host_copy_raw_default_us"] = _host_per_call(
            cp, lambda i: rt.memcpyAsync(buf.data.ptr, src.data.ptr, src.nbytes, 4, sp))
        bp, spp, nb = buf.data.ptr, src.data.ptr, src.nbytes
        row["host_copy_raw_cached_ptrs_us"] = _host_per_call(cp, lambda i: rt.memcpyAsync(bp, spp, nb, 3, sp))
        row["host_empty_scalar_us"] = _host_per_call(cp, lambda i: cp.empty((), cp.float32))
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for i in range(2000):
            run(i)
        prof.disable()
        cp.cuda.Device().synchronize()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime")
        row["profile_top"] = [f"{fn[2]} ({fn[0].split('/')[-1]}:{fn[1]}): {st[2] / 2000 * 1e6:.2f} us/step"
                              for fn, st in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]]
        try:
            import torch

            from ember.frontends.cli.bench_cuda import _torch_systems
            init = build_model(name, 0).state_dict()
            txs, tys = torch.from_numpy(xs_h).cuda(), torch.from_numpy(ys_h).cuda()
            systems = dict(_torch_systems(name, init, 0.05, txs[0], tys[0]))
            replay = systems["torch-cudagraph"]
            tx = [txs[i] for i in range(8)]
            ty = [tys[i] for i in range(8)]
            trun = lambda i: replay(tx[i % 8], ty[i % 8])  # noqa: E731
            for i in range(30):
                trun(i)
            torch.cuda.synchronize()
            row["torch_step_us"] = events_per_step(cp, lambda i: (trun(i), torch.cuda.synchronize() if i < 0 else None))
            row["torch_host_step_us"] = _host_per_call(cp, trun)
            g = replay.__defaults__[0]
            row["torch_graph_only_us"] = events_per_step(cp, lambda i: g.replay())
        except Exception as exc:  # no torch with CUDA here: ember's figures alone
            row["torch_error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
