"""Times the small-window kernels (codegen/cuda_small_conv.py) against the implicit GEMM for the
MNIST CNN's conv1 at batch 64 and 1024: the forward (+bias +ReLU) and the grad-weight, over the
planner's pick and other plans (output channels a thread, rows a unit, lanes, blocks), each
checked against float64. One line each: label, us, GB/s of compulsory traffic, relative error.

    python tests/codegen/cuda_small_conv_try.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cuda_direct_try import time_and_check  # noqa: E402
from ember.codegen import cuda_kernels as ck  # noqa: E402
from ember.codegen import cuda_small_conv as sc  # noqa: E402

CONV1 = dict(C=1, H=28, W=28, O=16, KH=3, KW=3, stride=1, padding=0)
HO = WO = 26


def _forward_plans(B: int) -> list[sc.SmallPlan]:
    """The planner's pick, then (OT, RB, TL) variants: whole images or a few rows a block,
    2-16 channels a thread, one vector a lane or several."""
    best = sc.small_forward_plan(B, 1, 16, 3, 3, HO, WO, 1, 28, 0, 1)
    plans = [best]
    for OT, RB, TL in ((4, 26, 64), (4, 26, 128), (4, 13, 64), (4, 13, 96), (4, 7, 96), (4, 4, 64), (4, 2, 32),
                       (2, 13, 64), (2, 26, 64), (8, 13, 64), (8, 26, 128), (16, 13, 64), (4, 5, 64), (2, 4, 32)):
        p = sc.SmallPlan(OT, RB, TL, B * -(-HO // RB), 2)
        if all(dataclasses.astuple(p)[:3] != dataclasses.astuple(q)[:3] for q in plans):
            plans.append(p)
    return plans


def _grad_weight_plans(B: int) -> list[tuple[sc.SmallPlan, int | None]]:
    """The planner's pick, then (OT, RB, TL, blocks) variants with register caps (minimum blocks
    resident per SM in __launch_bounds__; None: the planner's)."""
    best = sc.small_grad_weight_plan(B, 1, 16, 3, 3, HO, WO, 1, 28, 0, 1)
    out = [(best, None)]
    # (OT = 8 holds 72 accumulators: it spills even at 128 registers)
    for OT, RB, TL in ((4, 9, 64), (4, 13, 64), (4, 9, 32), (4, 7, 32), (4, 5, 64), (4, 2, 32), (2, 13, 64),
                       (2, 26, 64), (4, 26, 128)):
        units = B * -(-HO // RB)
        for blocks in (264, 396, 528, 1056):
            if blocks <= units and (B == 1024 or blocks in (264, 528)):
                p = sc.SmallPlan(OT, RB, TL, blocks, 2)
                # more accumulators or loads than the planner allows: spills under its register cap
                heavy = -(-RB * 13 // TL) * OT * 2 > sc.GW_LOAD_REGS or OT * 9 > sc.GW_ACC_REGS
                if p != dataclasses.replace(best, score=0.0):
                    out.append((p, max(1, 512 // p.threads(16)) if heavy else None))  # <= 128 registers
    out.append((dataclasses.replace(best, score=0.0), max(1, 512 // best.threads(16))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp
    rng = np.random.default_rng(1)
    out = []
    for B in (64, 1024):
        spec = dict(N=B, **CONV1)
        x_bytes, y_bytes = 4 * B * 28 * 28, 4 * B * 16 * HO * WO
        fwd = [("gemm", ck.render_conv2d_forward(f"g_fwd_{B}", bias=True, relu=True, **spec))]
        for i, p in enumerate(_forward_plans(B)):
            fwd.append((f"small ot{p.OT} rb{p.RB} tl{p.TL} t{p.threads(16)} grid{B * -(-HO // p.RB)}"
                        + (" (pick)" if i == 0 else ""),
                        sc.render_small_forward(f"s{i}_fwd_{B}", bias=True, relu=True, plan=p, **spec)))
        gw = [("gemm", ck.render_conv2d_grad_weight(f"g_gw_{B}", bias=False, **spec))]
        for i, (p, mb) in enumerate(_grad_weight_plans(B)):
            gw.append((f"small ot{p.OT} rb{p.RB} tl{p.TL} t{p.threads(16)} blocks{p.blocks}"
                       + (f" minblocks{mb}" if mb else "") + (" (pick)" if i == 0 else ""),
                       sc.render_small_grad_weight(f"s{i}_gw_{B}", plan=p, min_blocks=mb, **spec)))
        for kind, extra, kernels, nbytes in (("conv_fwd", dict(bias=True, relu=True), fwd, x_bytes + y_bytes),
                                             ("conv_gw", dict(bias=False), gw, x_bytes + y_bytes)):
            for label, _, t, rel in time_and_check(cp, rng, kind, spec, extra, kernels):
                r = dict(batch=B, kernel=kind, variant=label, us=round(t, 2), gbps=round(nbytes / (t * 1e3), 1),
                         rel_err=rel)
                out.append(r)
                print(f"B={B:<5d} {kind:8s} {label:52s} {t:8.2f} us {r['gbps']:7.1f} GB/s  rel {rel:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
