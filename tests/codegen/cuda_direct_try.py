"""Times the direct convolutions (codegen/cuda_direct.py) against the implicit GEMM for the MNIST
CNN's conv2 at batch 64 and 1024, over the planner's pick and its runners-up (different thread
tiles, rows per block, channels per stage), with a float64 check of each.

    python tests/codegen/cuda_direct_try.py [--out FILE]
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
import cuda_kernel_bench as cb  # noqa: E402
import cuda_refs  # noqa: E402
from ember.codegen import cuda_direct as cd  # noqa: E402
from ember.codegen import cuda_kernels as ck  # noqa: E402

CONV2 = dict(C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0)


def _alternatives(N, CI, HI, WI, CO, HO, WO, KH, KW, count=6):
    """The planner's pick and other plans: different (OT, PT, RB) with the planner's CC rule."""
    best = cd.direct_forward_plan(N, CI, HI, WI, CO, HO, WO, KH, KW)
    plans = [best]
    for OT, PT, RB in ((8, 8, 4), (8, 8, 8), (8, 6, 4), (4, 8, 8), (4, 6, 12), (8, 4, 8), (4, 4, 16), (8, 7, 6),
                       (8, 9, 4), (4, 7, 8), (2, 8, 16)):
        if CO % OT:
            continue
        ncg = -(-WO // PT)
        threads = CO // OT * RB * ncg
        if not 32 <= threads <= 1024:
            continue
        CC = cd.direct_channels_per_step(CI, RB, ncg * PT, KH, KW, CO)
        if CC is None:
            continue
        p = cd.DirectPlan(OT, PT, RB, CC, ncg, threads, 0.0)
        if all(dataclasses.astuple(p)[:5] != dataclasses.astuple(q)[:5] for q in plans):
            plans.append(p)
    return plans[:count + 1]


def time_and_check(cp, rng, kind: str, spec: dict, extra: dict, kernels: list) -> list[tuple[str, object, float, float]]:
    """(label, kernel, graph-timed us, relative L2 error against float64) for each (label, kernel)
    of one case, compiled into one module; the output is poisoned with NaN before each check."""
    ins, refs, _ = cuda_refs.make_case(kind, spec, extra, rng)
    bufs = {r: cp.asarray(a) for r, a in ins.items()}
    for role, ref in refs.items():
        bufs.setdefault(role, cp.empty(ref.shape, dtype=cp.float32))
    mod = cuda_refs.compile_module(cp, [k.code for _, k in kernels])
    ref = refs["out"]
    results = []
    for label, k in kernels:
        scr = cp.empty(max(k.scratch_bytes // 4, 1), dtype=cp.float32)
        bufs["out"][...] = np.nan
        cuda_refs.run_launches(cp, mod, k, bufs, scr)
        got = cp.asnumpy(bufs["out"]).reshape(ref.shape).astype(np.float64)
        rel = float(np.linalg.norm(np.nan_to_num(got - ref, nan=1e30)) / np.linalg.norm(ref))
        t = cb._time_graph_cp(cp, lambda: cuda_refs.run_launches(cp, mod, k, bufs, scr), 10, reps=10)
        results.append((label, k, t, rel))
    return results


def sweep_gemms(cp, rng, n_top: int = 8) -> list[dict]:
    """The GEMM plans of the CNN step's memory-bound contractions, measured (the cost model's top
    plans and a spread): linear forward / grad-weight and conv1 grad-weight without the bias."""
    out = []
    for B in (64, 1024):
        cases = [("linear_fwd", "matmul", dict(M=B, N=10, K=18432, trans_a=False, trans_b=True, bias=True), {}),
                 ("linear_gw", "matmul", dict(M=10, N=18432, K=B, trans_a=True, trans_b=False), {}),
                 ("conv1_gw", "conv_gw", dict(N=B, C=1, H=28, W=28, O=16, KH=3, KW=3, stride=1, padding=0),
                  dict(bias=False))]
        for label, kind, spec, extra in cases:
            plans = cb.sweep_plans(kind, spec, extra, n_top)
            kerns = [(p, cb._render_with(kind, spec, extra, f"sw{i}_{label}_{B}", p)) for i, p in enumerate(plans)]
            res = [dict(batch=B, kernel=label, key=list(cb.gemm_dims(kind, spec, extra)),
                        plan=[p.BM, p.BN, p.BK, p.TM, p.TN, p.splits], us=round(t, 2), rel_err=rel)
                   for p, _, t, rel in time_and_check(cp, rng, kind, spec, extra, kerns)]
            res.sort(key=lambda r: r["us"])
            for r in res[:3]:
                print(f"sweep B={B:<5d} {label:10s} {r['plan']} {r['us']:8.2f} us rel {r['rel_err']:.1e} "
                      f"(model pick {res and [x for x in res if x['plan'] == [plans[0].BM, plans[0].BN, plans[0].BK, plans[0].TM, plans[0].TN, plans[0].splits]][0]['us']} us)",
                      flush=True)
            out += res
    return out


def occupancy_variants(cp, rng) -> list[dict]:
    """conv2 at batch 1024: the direct kernels' planner picks against register caps
    (__launch_bounds__ minimum blocks per SM) and other stage depths (CC), each checked against
    float64 and timed."""
    B = 1024
    spec = dict(N=B, **CONV2)
    out = []
    variants = []
    for grad_input, kind, extra in ((False, "conv_fwd", dict(bias=True, relu=True)), (True, "conv_gi", dict(relu_mask=True))):
        geo = (B, 32, 24, 24, 16, 26, 26, 3, 3) if grad_input else (B, 16, 26, 26, 32, 24, 24, 3, 3)
        base = cd.direct_forward_plan(*geo)
        ks = []
        for cc in (base.CC, 8, 4):
            p = dataclasses.replace(base, CC=cc)
            for mb in (0, 2, 3, 4, 5):
                label = f"{p.OT}x{p.PT} rb{p.RB} cc{cc} t{p.threads} minblocks {mb}"
                ks.append((label, cd.render_direct(f"v{cc}_{mb}_{kind}", grad_input=grad_input, plan=p, min_blocks=mb,
                                                   **spec, **({"relu_mask": True} if grad_input else {"bias": True, "relu": True}))))
        for OT, PT, RB in ((8, 4, 4), (8, 4, 6), (8, 4, 12), (4, 4, 8), (8, 3, 8)):
            ncg = -(-(26 if grad_input else 24) // PT)
            threads = (16 if grad_input else 32) // OT * RB * ncg
            p = cd.DirectPlan(OT, PT, RB, 16, ncg, threads, 0.0)
            for mb in (0, 3):
                label = f"{OT}x{PT} rb{RB} cc16 t{threads} minblocks {mb}"
                ks.append((label, cd.render_direct(f"w{OT}{PT}{RB}_{mb}_{kind}", grad_input=grad_input, plan=p,
                                                   min_blocks=mb, **spec,
                                                   **({"relu_mask": True} if grad_input else {"bias": True, "relu": True}))))
        variants.append((kind, extra, ks))
    ks = []
    for mb in (2, 3, 4):
        for rows in (4, 6):
            ks.append((f"gw 528 blocks rows {rows} minblocks {mb}",
                       cd.render_direct_grad_weight(f"gw{mb}_{rows}", blocks=528, rows=rows, min_blocks=mb, **spec)))
    variants.append(("conv_gw", dict(bias=False), ks))
    for kind, extra, kernels in variants:
        kernels = [(label, k) for label, k in kernels if k is not None]
        for label, _, t, rel in time_and_check(cp, rng, kind, spec, extra, kernels):
            out.append(dict(batch=B, kernel=kind, variant=label, us=round(t, 2), rel_err=rel))
            print(f"occ {kind:9s} {label:40s} {t:9.2f} us  rel {rel:.1e}", flush=True)
    return out


def staging_variants(cp, rng) -> list[dict]:
    """conv2 at batch 1024: the direct forward / grad-input kernels single-buffered with and without
    coalesced weight staging and vector stores, staged rows padded by 1-3 floats, and 16-channel
    thread tiles for the grad-input; the grad-weight kernel over block counts and rows a unit."""
    B = 1024
    spec = dict(N=B, **CONV2)
    out = []
    for grad_input, kind, extra in ((False, "conv_fwd", dict(bias=True, relu=True)), (True, "conv_gi", dict(relu_mask=True))):
        args = dict(grad_input=grad_input, **spec, **({"relu_mask": True} if grad_input else {"bias": True, "relu": True}))
        ks = [(f"single coalesced={cw} vector={vs}", cd.render_direct(f"s{int(cw)}{int(vs)}_{kind}", coalesced_weights=cw,
                                                                       vector_stores=vs, **args))
              for cw in (False, True) for vs in (False, True)]
        ks += [(f"row pad {pad}", cd.render_direct(f"rp{pad}_{kind}", row_pad=pad, **args)) for pad in (1, 2, 3)]
        if grad_input:
            for OT, PT, RB in ((16, 2, 9), (16, 4, 18), (16, 2, 5)):
                ncg = -(-26 // PT)
                p = cd.DirectPlan(OT, PT, RB, cd.direct_channels_per_step(32, RB, ncg * PT, 3, 3, 16), ncg, RB * ncg, 0.0)
                ks.append((f"single {OT}x{PT} rb{RB} cc{p.CC} t{p.threads}", cd.render_direct(f"o{OT}{PT}{RB}_{kind}", plan=p, **args)))
        for label, _, t, rel in time_and_check(cp, rng, kind, spec, extra, [(lb, k) for lb, k in ks if k is not None]):
            out.append(dict(batch=B, kernel=kind, variant=label, us=round(t, 2), rel_err=rel))
            print(f"stage {kind:9s} {label:40s} {t:9.2f} us  rel {rel:.1e}", flush=True)
    ks = [(f"gw cp.async blocks {b} rows {r}", cd.render_direct_grad_weight(f"g{b}_{r}", blocks=b, rows=r, **spec))
          for b in (264, 528, 792) for r in (2, 4)]
    for label, _, t, rel in time_and_check(cp, rng, "conv_gw", spec, dict(bias=False), [(lb, k) for lb, k in ks if k is not None]):
        out.append(dict(batch=B, kernel="conv_gw", variant=label, us=round(t, 2), rel_err=rel))
        print(f"stage conv_gw   {label:40s} {t:9.2f} us  rel {rel:.1e}", flush=True)
    return out


def batch64_variants(cp, rng) -> list[dict]:
    """conv2 at batch 64, where cuda_choices.DIRECT_MIN_POSITIONS keeps the implicit GEMM: the GEMM against the
    direct kernels' planner picks and smaller units (more blocks for an H200's multiprocessors)."""
    B = 64
    spec = dict(N=B, **CONV2)
    out = []
    for grad_input, kind, extra in ((False, "conv_fwd", dict(bias=True, relu=True)), (True, "conv_gi", dict(relu_mask=True))):
        args = dict(grad_input=grad_input, **spec, **({"relu_mask": True} if grad_input else {"bias": True, "relu": True}))
        gemm = (ck.render_conv2d_grad_input(f"g64_{kind}", relu_mask=True, **spec) if grad_input
                else ck.render_conv2d_forward(f"g64_{kind}", bias=True, relu=True, **spec))
        ks = [("gemm", gemm), ("direct pick", cd.render_direct(f"d64_{kind}", **args))]
        cols, ci, co = (26, 32, 16) if grad_input else (24, 16, 32)
        for OT, PT, RB in ((8, 4, 2), (8, 4, 3), (4, 4, 4), (8, 2, 2)):
            ncg = -(-cols // PT)
            cc = cd.direct_channels_per_step(ci, RB, ncg * PT, 3, 3, co)
            p = cd.DirectPlan(OT, PT, RB, cc, ncg, co // OT * RB * ncg, 0.0)
            ks.append((f"direct {OT}x{PT} rb{RB} t{p.threads}", cd.render_direct(f"v64_{OT}{PT}{RB}_{kind}", plan=p, **args)))
        for label, _, t, rel in time_and_check(cp, rng, kind, spec, extra, [(lb, k) for lb, k in ks if k is not None]):
            out.append(dict(batch=B, kernel=kind, variant=label, us=round(t, 2), rel_err=rel))
            print(f"b64 {kind:9s} {label:32s} {t:8.2f} us  rel {rel:.1e}", flush=True)
    ks = [("gemm", ck.render_conv2d_grad_weight("g64_gw", bias=False, **spec))]
    ks += [(f"direct blocks {b} rows {r}", cd.render_direct_grad_weight(f"d64_{b}_{r}", blocks=b, rows=r, **spec))
           for b in (96, 192, 384) for r in (1, 2, 4)]
    for label, _, t, rel in time_and_check(cp, rng, "conv_gw", spec, dict(bias=False), [(lb, k) for lb, k in ks if k is not None]):
        out.append(dict(batch=B, kernel="conv_gw", variant=label, us=round(t, 2), rel_err=rel))
        print(f"b64 conv_gw   {label:32s} {t:8.2f} us  rel {rel:.1e}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep-only", action="store_true", help="only the GEMM plan sweep")
    ap.add_argument("--occupancy", action="store_true", help="only the direct kernels' register-cap variants")
    ap.add_argument("--staging", action="store_true", help="only the staging / store variants at batch 1024")
    ap.add_argument("--b64", action="store_true", help="only the GEMM against direct variants at batch 64")
    ap.add_argument("--once", action="store_true",
                    help="run conv2's planner picks at batch 1024 once each, uncaptured (for ncu)")
    args = ap.parse_args()
    import cupy as cp
    rng = np.random.default_rng(1)
    out = []
    if args.staging or args.b64:
        out = staging_variants(cp, rng) if args.staging else batch64_variants(cp, rng)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return
    if args.once:
        spec = dict(N=1024, **CONV2)
        for kind, extra, k in (
                ("conv_fwd", dict(bias=True, relu=True), cd.render_direct("p_fwd", grad_input=False, bias=True, relu=True, **spec)),
                ("conv_gi", dict(relu_mask=True), cd.render_direct("p_gi", grad_input=True, relu_mask=True, **spec)),
                ("conv_gw", dict(bias=False), cd.render_direct_grad_weight("p_gw", **spec))):
            ins, refs, _ = cuda_refs.make_case(kind, spec, extra, rng)
            bufs = {r: cp.asarray(a) for r, a in ins.items()} | {"out": cp.empty(refs["out"].shape, dtype=cp.float32)}
            mod = cuda_refs.compile_module(cp, [k.code])
            cuda_refs.run_launches(cp, mod, k, bufs, cp.empty(max(k.scratch_bytes // 4, 1), dtype=cp.float32))
            cp.cuda.runtime.deviceSynchronize()
        return
    if args.occupancy:
        out = occupancy_variants(cp, rng)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return
    if args.sweep_only:
        out = sweep_gemms(cp, rng)
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        return
    for B in (64, 1024):
        spec = dict(N=B, **CONV2)
        HO = WO = 24
        cases = []
        for kind, extra in (("conv_fwd", dict(bias=True, relu=True)), ("conv_gi", dict(relu_mask=True)),
                            ("conv_gw", dict(bias=False))):
            kernels = []
            if kind == "conv_fwd":
                kernels.append(("gemm", ck.render_conv2d_forward(f"g_fwd_{B}", bias=True, relu=True, **spec)))
                for i, p in enumerate(_alternatives(B, 16, 26, 26, 32, HO, WO, 3, 3)):
                    kernels.append((f"direct {p.OT}x{p.PT} rb{p.RB} cc{p.CC} t{p.threads}",
                                    cd.render_direct(f"d{i}_fwd_{B}", grad_input=False, bias=True, relu=True, plan=p, **spec)))
            elif kind == "conv_gi":
                kernels.append(("gemm", ck.render_conv2d_grad_input(f"g_gi_{B}", relu_mask=True, **spec)))
                for i, p in enumerate(_alternatives(B, 32, 24, 24, 16, 26, 26, 3, 3)):
                    kernels.append((f"direct {p.OT}x{p.PT} rb{p.RB} cc{p.CC} t{p.threads}",
                                    cd.render_direct(f"d{i}_gi_{B}", grad_input=True, relu_mask=True, plan=p, **spec)))
            else:
                kernels.append(("gemm", ck.render_conv2d_grad_weight(f"g_gw_{B}", bias=False, **spec)))
                for blocks in (264, 528, 1056):
                    for rows in (1, 2, 4):
                        kernels.append((f"direct blocks {blocks} rows {rows}",
                                        cd.render_direct_grad_weight(f"d{blocks}r{rows}_gw_{B}", blocks=blocks,
                                                                     rows=rows, **spec)))
            cases.append((kind, extra, [(label, k) for label, k in kernels if k is not None]))
        mm = dict(M=B, N=18432, K=10, trans_a=False, trans_b=False)
        cases.append(("matmul", {}, [("gemm", ck.render_matmul(f"g_mm_{B}", **mm))] +
                      [(f"thin rows {r}", cd.render_matmul_thin(f"t{r}_mm_{B}", rows=r, **mm)) for r in (4, 16, 35, 64)]))
        for kind, extra, kernels in cases:
            for label, k, t, rel in time_and_check(cp, rng, kind, mm if kind == "matmul" else spec, extra, kernels):
                flops = 2 * B * 18432 * 10 if kind == "matmul" else 2 * B * 32 * 16 * 9 * HO * WO
                r = dict(batch=B, kernel=kind, variant=label, us=round(t, 2), rel_err=rel,
                         pct_fp32_peak=round(100 * flops / (t * 1e-6) / 67e12, 1))
                out.append(r)
                print(f"B={B:<5d} {kind:9s} {label:34s} {t:9.2f} us {r['pct_fp32_peak']:5.1f}% peak  rel {rel:.1e}",
                      flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
