"""Device time of the fused F(2x2, 3x3) Winograd kernel (`winograd_fused`, every blocking) against
the unfused `winograd` family (its GEMM planner's pick), on the 3x3 stride-1 layers of
a model of the zoo, forward and grad-input (a diagnostic, not a test; `ember tune` decides).

    python tools/winograd_fused_bench.py [--batch 1024] [--layers 64x64x28,64x256x14,256x256x14,256x256x7] [--match 32x32]

A layer is CIxCOxHW (padding 1). Each kernel's launches are captured 20 times into a CUDA graph and
the replays timed with events (tools/cuda_lab.time_graph); each output is compared with the unfused
kernel's (max |difference| over max |value|), which shows a blocking that computes wrong numbers.
"""
from __future__ import annotations

import argparse

import numpy as np

from cuda_lab import require_cupy, time_graph
from ember.codegen import cuda_winograd, cuda_winograd_fused
from ember.codegen.cuda_kernels import scratch_offset


def _geometry(kind: str, n: int, ci: int, co: int, hw: int) -> dict:
    return dict(kind=kind, N=n, C=ci, H=hw, W=hw, O=co, KH=3, KW=3, stride=(1, 1), padding=(1, 1), HO=hw, WO=hw,
                tf32=False, epilogues=())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--layers", default="64x64x28,64x256x14,256x256x14,256x256x7")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--match", default="", help="time only the fused blockings whose label holds this (e.g. '32x32')")
    args = ap.parse_args()
    cp = require_cupy()
    rng = np.random.default_rng(0)
    for layer in args.layers.split(","):
        ci, co, hw = map(int, layer.split("x"))
        for kind in ("conv2d", "conv2d_grad_input"):
            g = _geometry(kind, args.batch, ci, co, hw)
            src_shape = (args.batch, ci, hw, hw) if kind == "conv2d" else (args.batch, co, hw, hw)
            out_shape = (args.batch, co, hw, hw) if kind == "conv2d" else (args.batch, ci, hw, hw)
            bufs = {("x" if kind == "conv2d" else "dy"): cp.asarray(rng.standard_normal(src_shape, dtype=np.float32)),
                    "w": cp.asarray(rng.standard_normal((co, ci, 3, 3), dtype=np.float32) / np.sqrt(9 * ci))}
            kernels = [("winograd", cuda_winograd.render("u", g, cuda_winograd.plans(g)[0]))]
            for i, plan in enumerate(cuda_winograd_fused.plans(g)):
                label = f"fused {plan.BT}x{plan.BCO} mb{plan.min_blocks}{' pipe' if plan.pipelined else ''}"
                if args.match in label:
                    kernels.append((label, cuda_winograd_fused.render(f"f{i}", g, plan)))
            module = cp.RawModule(code="\n".join(k.code for _, k in kernels), options=("-std=c++17",))
            reference = None
            for label, k in kernels:
                scratch = cp.empty(max(k.scratch_bytes // 4, 1), dtype=cp.float32)
                bufs["out"] = cp.full(out_shape, np.nan, dtype=cp.float32)

                def run(k=k, scratch=scratch) -> None:
                    for ln in k.launches:
                        fn = module.get_function(ln.function)
                        fn(ln.grid, ln.block, tuple(bufs[r] if scratch_offset(r) is None else scratch[scratch_offset(r) // 4:]
                                                    for r in ln.args), shared_mem=ln.shared_bytes)
                us = time_graph(cp, run, args.runs)
                out = cp.asnumpy(bufs["out"])
                if reference is None:
                    reference, diff = out, 0.0
                else:
                    diff = float(np.nanmax(np.abs(out - reference)) / np.max(np.abs(reference)))
                    diff = diff if not np.isnan(out).any() else float("nan")
                gflop = 2 * args.batch * ci * co * 9 * hw * hw / 1e9
                print(f"{layer:>12} {kind:18} {label:20} {us:10.1f} us {gflop / us * 1e3:8.1f} TFLOP/s (direct-equivalent)"
                      f"  diff {diff:.2e}", flush=True)


if __name__ == "__main__":
    main()
