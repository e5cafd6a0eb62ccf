"""Times the skinny matmuls (codegen/cuda_skinny.py) against the GEMM (`cuda_kernels.render_matmul`)
for the MNIST CNN's linear forward (1024 x 10 from K = 18432: narrow) and grad-weight (10 x 18432
from K = 1024: short-M) at batch 64 and 1024: the planner's pick and plan variants (rows a lane,
warps, splits, unroll; k groups, splits), each checked against float64 (relative L2 error).

    python tests/codegen/cuda_skinny_try.py [--out FILE.json] [--batches 64 1024]

One line a kernel: batch, shape, label, graph-timed us, GB/s of compulsory traffic (each operand
read once, the output written once), relative error. The fastest variant of each shape decides
the planner defaults and `cuda_choices.SKINNY_MIN_BYTES` (which batch sizes use the skinny kernels).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cuda_direct_try import time_and_check  # noqa: E402
from ember.codegen import cuda_kernels as ck  # noqa: E402
from ember.codegen import cuda_skinny as cs  # noqa: E402


def _narrow_variants(B: int, m: dict) -> list[tuple[str, object]]:
    M, N, K = m["M"], m["N"], m["K"]
    plans = [("pick", cs.narrow_plan(M, N, K))]
    for s in (8, 16, 36, 72):
        plans.append((f"splits {s}", cs.narrow_plan(M, N, K, splits=s)))
    plans += [("rt2 rg8", cs.narrow_plan(M, N, K, rows_per_lane=2, warps=8)),
              ("rt2 rg8 u4", cs.narrow_plan(M, N, K, rows_per_lane=2, warps=8, unroll=4)),
              ("rt4 rg4", cs.narrow_plan(M, N, K, rows_per_lane=4, warps=4)),
              ("rt3 rg8", cs.narrow_plan(M, N, K, rows_per_lane=3, warps=8)),
              ("rt4 rg8 u1", cs.narrow_plan(M, N, K, unroll=1))]
    if B <= 64:
        plans += [("rt2 rg4", cs.narrow_plan(M, N, K, rows_per_lane=2, warps=4)),
                  ("rt1 rg8", cs.narrow_plan(M, N, K, rows_per_lane=1, warps=8))]
    out = []
    for i, (label, plan) in enumerate(plans):
        k = cs.render_matmul_narrow(f"nw{i}_{B}", plan=plan, **m)
        if k is not None:
            out.append((f"narrow {label}: rt{plan.RT} rg{plan.RG} u{plan.U} s{plan.S}x{plan.KC}", k))
    return out


def _short_variants(B: int, m: dict) -> list[tuple[str, object]]:
    M, N, K = m["M"], m["N"], m["K"]
    opts = [("pick", {}), ("kg4 s4", dict(groups=4, splits=4)), ("kg8", dict(groups=8)),
            ("kg2 s8", dict(groups=2, splits=8)), ("u4", dict(unroll=4)), ("ct64 kg4", dict(col_threads=64, groups=4))]
    if B > 64:
        opts += [("kg4 s16", dict(groups=4, splits=16)), ("kg2 s16", dict(groups=2, splits=16))]
    else:
        opts += [("kg4 s1", dict(groups=4, splits=1)), ("kg8 s1", dict(groups=8, splits=1)),
                 ("kg2 s1", dict(groups=2, splits=1))]
    out = []
    for i, (label, kw) in enumerate(opts):
        plan = cs.short_m_plan(M, N, K, **kw)
        if plan is None:
            continue
        k = cs.render_matmul_short_m(f"sm{i}_{B}", plan=plan, **m)
        if k is not None:
            out.append((f"short-M {label}: ct{plan.CT} kg{plan.KG} u{plan.U} s{plan.S}x{plan.KC}", k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    args = ap.parse_args()
    import cupy as cp
    rng = np.random.default_rng(1)
    out = []
    for B in args.batches:
        cases = [("linear_fwd", dict(M=B, N=10, K=18432, trans_a=False, trans_b=True, bias=True), _narrow_variants),
                 ("linear_gw", dict(M=10, N=18432, K=B, trans_a=True, trans_b=False), _short_variants)]
        for shape, m, variants in cases:
            kernels = [("gemm", ck.render_matmul(f"gemm_{shape}_{B}", **m))] + variants(B, m)
            nbytes = 4 * (m["M"] * m["K"] + m["K"] * m["N"] + m["M"] * m["N"])
            for label, k, t, rel in time_and_check(cp, rng, "matmul", m, {}, kernels):
                r = dict(batch=B, kernel=shape, variant=label, us=round(t, 2), gbps=round(nbytes / (t * 1e-6) / 1e9, 1),
                         rel_err=rel, launches=[[ln.function, list(ln.grid), list(ln.block)] for ln in k.launches])
                out.append(r)
                print(f"B={B:<5d} {shape:10s} {label:48s} {t:8.2f} us {r['gbps']:7.1f} GB/s  rel {rel:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
