"""Times ember's CUDA kernels (codegen/cuda_kernels.py, each with the plan its renderer picks) for the
MNIST CNN and MLP shapes, next to PyTorch's equivalents.

    python tools/cuda_kernel_bench.py [--out bench.json] [--runs 200] [--batches 64 1024] [--dry-run]

For each kernel: device time a call from CUDA-graph replays (median), the median of --runs
individually launched calls ("eager", CUDA events around each, after 20 warm-up calls), achieved
GFLOP/s and % of the assumed H200 fp32 non-tensor peak. When torch with CUDA is importable, the
equivalent torch op is timed the same way with TF32 off (F.conv2d, torch.nn.grad.conv2d_weight /
conv2d_input, matmul). Then the CNN step's kernels back to back in one graph. Prints a table and
writes it as JSON to --out. --dry-run renders the kernels and prints their plans without a GPU.
Plan sweeps of the same kernels: tools/cuda_sweep.py gemm.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from cuda_lab import (PEAK_TFLOPS, compile_module, device_buffers, flops, launch, make_case, mnist_contractions,
                      plan_line, render_gemm, require_cupy, scratch_for, time_eager, time_graph)
from ember.codegen import cuda_kernels as ck

#: Parameters of the MNIST CNN (conv1 16x1x3x3+16, conv2 32x16x3x3+32, linear 10x18432+10).
CNN_PARAMS = 16 * 9 + 16 + 32 * 16 * 9 + 32 + 10 * 18432 + 10
#: The kernels of one MNIST-CNN training step (forward, loss, backward, update).
CNN_STEP = ("conv1_fwd", "conv2_fwd", "linear_fwd", "softmax_xent", "linear_gi", "linear_gw",
            "conv2_gi+mask", "conv2_gw+db", "conv1_gw+db", "sgd_cnn")
#: The contractions timed (the fused step's conv1_gw without its bias is a sweep case only).
CONTRACTIONS = ("conv1_fwd", "conv1_gw+db", "conv2_fwd", "conv2_gw+db", "conv2_gi+mask", "linear_fwd", "linear_gi",
                "linear_gw", "mlp1_fwd", "mlp1_gw", "mlp2_fwd", "mlp2_gi")


def cases(B: int) -> list[tuple[str, ck.CudaKernel, tuple[str, dict, dict]]]:
    """(label, kernel, (kind, spec, extra)) of every kernel timed at batch B."""
    contractions = mnist_contractions(B)
    out = []
    for label in CONTRACTIONS:
        kind, spec, extra = contractions[label]
        out.append((label, render_gemm(f"b_{label.replace('+', '_')}_{B}", kind, spec, extra), (kind, spec, extra)))
    sgd = dict(numel=CNN_PARAMS, lr=0.05, momentum=0.0, weight_decay=0.0)
    out += [("softmax_xent", ck.render_softmax_cross_entropy(f"b_sce_{B}", N=B, C=10), ("sce", dict(N=B, C=10), {})),
            ("softmax_xent_grad", ck.render_softmax_cross_entropy_grad(f"b_sceg_{B}", N=B, C=10),
             ("sce_grad", dict(N=B, C=10), {})),
            ("sgd_cnn", ck.render_sgd_update(f"b_sgd_{B}", numel=CNN_PARAMS, lr=0.05), ("sgd", sgd, {}))]
    return out


def _time_graph_torch(torch, fn, runs: int, reps: int = 20) -> float | None:
    """As cuda_lab.time_graph, through torch.cuda.CUDAGraph; None when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / reps)
        return statistics.median(ts)
    except Exception:  # noqa: BLE001 - e.g. an op that cannot be captured
        torch.cuda.synchronize()
        return None


def _torch_fn(torch, kind: str, spec: dict, ins: dict):
    """PyTorch's equivalent of a case, as a thunk over device tensors of `ins`; None if there is none."""
    F = torch.nn.functional
    t = {r: torch.as_tensor(a, device="cuda") for r, a in ins.items()}
    g = spec
    if kind == "conv_fwd":
        return lambda: F.relu(F.conv2d(t["x"], t["w"], t["bias"], stride=g["stride"], padding=g["padding"]))
    if kind == "conv_gw":
        wshape = (g["O"], g["C"], g["KH"], g["KW"])
        return lambda: (torch.nn.grad.conv2d_weight(t["x"], wshape, t["dy"], stride=g["stride"], padding=g["padding"]),
                        t["dy"].sum(dim=(0, 2, 3)))
    if kind == "conv_gi":
        xshape = (g["N"], g["C"], g["H"], g["W"])
        return lambda: torch.nn.grad.conv2d_input(xshape, t["w"], t["dy"], stride=g["stride"],
                                                  padding=g["padding"]) * (t["mask_src"] > 0)
    if kind == "matmul":
        a = t["a"].mT if spec["trans_a"] else t["a"]
        b = t["b"].mT if spec["trans_b"] else t["b"]
        if spec.get("bias"):
            if spec.get("relu"):
                return lambda: torch.relu(torch.addmm(t["bias"], a, b))
            return lambda: torch.addmm(t["bias"], a, b)
        return lambda: torch.matmul(a, b)
    if kind == "sgd":
        return lambda: t["p"].add_(t["g"], alpha=-spec["lr"])
    if kind == "sce":
        def f():
            z = t["logits"].detach().requires_grad_(True)
            F.cross_entropy(z, t["labels"]).backward()
        return f
    return None


def _torch():
    """torch with CUDA and TF32 off, or None."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - the comparison is optional
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def _bench_batch(cp, torch, B: int, runs: int, rng: np.random.Generator) -> tuple[list[dict], dict]:
    """The rows of every kernel at batch B, and the CNN step's kernels back to back."""
    batch = cases(B)
    module = compile_module(cp, [k for _, k, _ in batch])
    rows, prepared = [], {}
    for label, k, (kind, spec, extra) in batch:
        ins, refs = make_case(kind, spec, extra, rng)
        bufs, scratch = device_buffers(cp, ins, refs), scratch_for(cp, k)

        def fn(k=k, bufs=bufs, scratch=scratch):
            launch(module, k, bufs, scratch)
        us = time_graph(cp, fn, 30)
        row = dict(batch=B, kernel=label, name=k.name, us=round(us, 2), us_eager=round(time_eager(cp, fn, runs), 2),
                   launches=[dict(function=ln.function, grid=ln.grid, block=ln.block) for ln in k.launches],
                   plan=plan_line(k), scratch_bytes=k.scratch_bytes)
        fl = flops(kind, spec)
        if fl:
            row["gflops"] = round(fl / us / 1e3, 1)
            row["pct_peak"] = round(100 * fl / us / 1e6 / PEAK_TFLOPS, 1)
        tf = None
        if torch is not None:
            try:
                tf = _torch_fn(torch, kind, spec, ins)
                if tf is not None:
                    row["torch_us_eager"] = round(time_eager(cp, tf, runs), 2)
                    tg = _time_graph_torch(torch, tf, 30)
                    row["torch_us"] = round(tg, 2) if tg is not None else row["torch_us_eager"]
                    row["torch_timing"] = "graph" if tg is not None else "eager"
            except Exception as e:  # noqa: BLE001 - keep going: the comparison is optional
                row["torch_error"] = repr(e)[:300]
                tf = None
        prepared[label] = (fn, tf)
        rows.append(row)
        print(f"B={B:<5d} {label:17s} {us:9.2f} us  {row.get('gflops', 0):9.1f} GFLOP/s "
              f"{row.get('pct_peak', 0):5.1f}% peak   torch {row.get('torch_us', float('nan')):9.2f} us"
              f"   [{row['plan']}]", flush=True)
    fns = [prepared[label][0] for label in CNN_STEP]
    tfs = [prepared[label][1] for label in CNN_STEP]

    def run_step():
        for f in fns:
            f()
    us = time_graph(cp, run_step, 30, reps=5)
    step = dict(batch=B, us=round(us, 2), us_eager=round(time_eager(cp, run_step, runs), 2), kernels=list(CNN_STEP),
                sum_of_medians=round(sum(r["us"] for r in rows if r["kernel"] in CNN_STEP), 2))
    if torch is not None and all(tfs):
        def torch_step():
            for f in tfs:
                f()
        tg = _time_graph_torch(torch, torch_step, 30, reps=5)
        step["torch_us"] = round(tg if tg is not None else time_eager(cp, torch_step, runs), 2)
        step["torch_timing"] = "graph" if tg is not None else "eager"
    print(f"B={B}: CNN step kernels in one graph {us:.1f} us (sum of per-kernel {step['sum_of_medians']:.1f}; "
          f"eager {step['us_eager']:.1f}); torch equivalents back to back {step.get('torch_us', float('nan')):.1f} us",
          flush=True)
    return rows, step


def _summary(rows: list[dict], steps: list[dict], batches: list[int]) -> None:
    print("\nsummary (us per call; % of fp32 peak; torch TF32 off)")
    print(f"{'kernel':18s}" + "".join(f"{'B=' + str(B):>30s}" for B in batches))
    for label in dict.fromkeys(r["kernel"] for r in rows):
        line = f"{label:18s}"
        for B in batches:
            r = next((r for r in rows if r["batch"] == B and r["kernel"] == label), None)
            line += (f"{r['us']:10.2f} {r.get('pct_peak', 0):5.1f}% torch {r.get('torch_us', float('nan')):8.2f}"
                     if r else " " * 30)
        print(line)
    for st in steps:
        print(f"B={st['batch']}: CNN step kernels {st['us']:.1f} us back to back "
              f"(torch {st.get('torch_us', float('nan')):.1f} us)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows and the step timings as JSON here")
    ap.add_argument("--runs", type=int, default=200, help="individually launched calls timed per kernel")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--dry-run", action="store_true", help="render the kernels and print their plans; no GPU needed")
    args = ap.parse_args(argv)
    if args.dry_run:
        for B in args.batches:
            for label, k, _ in cases(B):
                print(f"B={B:<5d} {label:17s} {k.name}: {plan_line(k)}")
        return
    cp = require_cupy()
    torch = _torch()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"]
    dev = dev.decode() if isinstance(dev, bytes) else dev
    print(f"device: {dev}; assumed fp32 peak {PEAK_TFLOPS} TFLOP/s; device time per call from CUDA-graph replays"
          f" (median); 'eager' = median of {args.runs} individually launched calls"
          f"; torch: {'yes (TF32 off)' if torch else 'not available'}")
    rows, steps = [], []
    rng = np.random.default_rng(0)
    for B in args.batches:
        batch_rows, step = _bench_batch(cp, torch, B, args.runs, rng)
        rows += batch_rows
        steps.append(step)
    _summary(rows, steps, args.batches)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, peak_tflops=PEAK_TFLOPS, runs=args.runs, rows=rows,
                                                  steps=steps), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
