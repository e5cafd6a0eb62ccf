"""Times hand-picked GEMM plans for the MNIST conv kernels (plans outside the cost model's
sweep: larger thread tiles, wider N tiles), with a float64 check of each.

    python tests/codegen/cuda_plan_try.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cuda_kernel_bench as cb  # noqa: E402
from cuda_direct_try import time_and_check  # noqa: E402
from ember.codegen import cuda_kernels as ck  # noqa: E402

CONV2 = dict(C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0)
TRIES = {
    "conv2_fwd": (("conv_fwd", dict(bias=True, relu=True)),
                  [(64, 32, 16, 2, 8, 1), (128, 32, 16, 4, 8, 1), (256, 32, 16, 8, 4, 1), (256, 32, 16, 4, 8, 1),
                   (128, 32, 16, 8, 4, 1)]),
    "conv2_gi+mask": (("conv_gi", dict(relu_mask=True)),
                      [(128, 16, 16, 2, 8, 1), (256, 16, 16, 2, 8, 1), (128, 16, 16, 2, 4, 1), (64, 16, 16, 2, 8, 1)]),
    "conv2_gw+db": (("conv_gw", dict(bias=True)),
                    [(32, 32, 32, 4, 2, 0), (32, 64, 32, 2, 4, 0), (32, 48, 32, 2, 4, 0), (32, 144, 32, 4, 4, 0),
                     (32, 144, 32, 4, 4, -1), (32, 96, 32, 2, 4, 0), (32, 32, 32, 4, 2, -1)]),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp
    rng = np.random.default_rng(1)
    out = []
    for B in (64, 1024):
        for label, ((kind, extra), plans) in TRIES.items():
            spec = dict(N=B, **CONV2)
            M, N, K, batch, akf, bkf, rowsum = cb.gemm_dims(kind, spec, extra)
            kerns = []
            for i, (BM, BN, BK, TM, TN, s) in enumerate(plans):
                splits = s if s > 0 else (128 if B == 64 else 256) * (2 if s < 0 else 1)
                p = ck._gemm_cost(M, N, K, batch, BM, BN, BK, TM, TN, splits, akf, bkf)
                if p is None or (BM // TM) * (BN // TN) < (BM if rowsum else 1) or (BM // TM) * (BN // TN) % 32:
                    print(f"B={B} {label} {(BM, BN, BK, TM, TN, s)}: infeasible", flush=True)
                    continue
                kerns.append((p, cb._render_with(kind, spec, extra, f"try{i}_{label.replace('+', '_')}_{B}", p)))
            for p, _, t, rel in time_and_check(cp, rng, kind, spec, extra, kerns):
                r = dict(batch=B, kernel=label, plan=(p.BM, p.BN, p.BK, p.TM, p.TN, p.splits), us=round(t, 2), rel_err=rel)
                out.append(r)
                print(f"B={B:<5d} {label:14s} {r['plan']} {t:9.2f} us  rel {rel:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
