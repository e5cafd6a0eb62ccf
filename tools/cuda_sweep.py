"""Sweeps of CUDA kernel variants on the MNIST models' shapes: every variant of a case is rendered,
compiled into one CuPy module with the others, checked against ember's float64 reference
interpreter (relative L2 error; the output poisoned with NaN first) and timed from CUDA-graph
replays (device us a call). The planners' defaults and the thresholds of the CUDA choice table
(codegen/cuda_choices.py) were measured with these.

    python tools/cuda_sweep.py COMMAND [--batches 64 1024] [--out FILE.json] [--match TEXT]
                                       [--once] [--dry-run]

The commands (`COMMANDS` below; `--help` lists them): gemm, gemm-plans, direct, direct-occupancy,
direct-staging, direct-tc, skinny, small.

--dry-run renders every variant and prints its plan, without CuPy or a GPU. --once launches each
variant once, uncaptured, with neither timing nor check, for a profiler, e.g.
`ncu --set full python tools/cuda_sweep.py direct --batches 1024 --match pick --once`.
--match keeps the variants whose label contains TEXT.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from cuda_lab import (CONV1, CONV2, Group, conv_out, describe, flops, measure, mnist_contractions, render_gemm,
                      require_cupy)
from ember.codegen import cuda_direct as cd
from ember.codegen import cuda_direct_tc as ct
from ember.codegen import cuda_kernels as ck
from ember.codegen import cuda_skinny as cs
from ember.codegen import cuda_small_conv as sc
from ember.codegen.shapes import ceil_div, round_up

# ---- gemm: the cost model's plans ----------------------------------------------------------------


def gemm_dims(kind: str, spec: dict, extra: dict) -> tuple[int, int, int, int, bool, bool, bool]:
    """(M, N, K, batch, a_kfast, b_kfast, rowsum) of a contraction case, as its renderer plans it."""
    if kind == "matmul":
        return spec["M"], spec["N"], spec["K"], spec.get("batch", 1), not spec["trans_a"], spec["trans_b"], False
    HO, WO = conv_out(spec)
    g = spec
    if kind == "conv_fwd":
        return g["N"] * HO * WO, g["O"], g["C"] * g["KH"] * g["KW"], 1, False, True, False
    if kind == "conv_gi":
        return g["N"] * g["H"] * g["W"], g["C"], g["O"] * g["KH"] * g["KW"], 1, False, True, False
    return g["O"], g["C"] * g["KH"] * g["KW"], g["N"] * HO * WO, 1, True, True, bool(extra.get("bias"))


def sweep_plans(kind: str, spec: dict, extra: dict, top: int) -> list[ck.GemmPlan]:
    """The model's best `top` plans, then the best of each split count and of each block tile among
    its first 300 (at most 3 * top in all)."""
    M, N, K, batch, akf, bkf, rowsum = gemm_dims(kind, spec, extra)
    cands = ck.plan_candidates(M, N, K, batch, a_kfast=akf, b_kfast=bkf, min_threads_for_rows=rowsum)
    chosen = list(cands[:top])
    seen_s, seen_t = set(), set()
    for p in cands[:300]:
        if p.splits not in seen_s:
            seen_s.add(p.splits)
            chosen.append(p)
        if (p.BM, p.BN, p.TM, p.TN) not in seen_t and len(seen_t) < top:
            seen_t.add((p.BM, p.BN, p.TM, p.TN))
            chosen.append(p)
    out = {}
    for p in chosen:
        out.setdefault((p.BM, p.BN, p.BK, p.TM, p.TN, p.splits), p)
    return list(out.values())[: 3 * top]


def _plan_label(p: ck.GemmPlan) -> str:
    return f"{p.BM}x{p.BN}x{p.BK} t{p.TM}x{p.TN} s{p.splits}"


def _tag(name: str) -> str:
    return name.replace("+", "_")


def gemm_groups(B: int, args) -> list[Group]:
    groups = []
    for name, (kind, spec, extra) in mnist_contractions(B).items():
        if args.kernels and name not in args.kernels:
            continue
        kernels = [("default", render_gemm(f"def_{_tag(name)}_{B}", kind, spec, extra))]
        for i, p in enumerate(sweep_plans(kind, spec, extra, args.top)):
            label = f"{_plan_label(p)} est {p.est_us:.1f}" + (" (model pick)" if i == 0 else "")
            kernels.append((label, render_gemm(f"sw{i}_{_tag(name)}_{B}", kind, spec, extra, plan=p)))
        groups.append(Group(kind, spec, extra, kernels, dict(batch=B, kernel=name), flops(kind, spec)))
    return groups


def gemm_summary(rows: list[dict]) -> None:
    """The three fastest plans of each contraction, next to the default and the model's pick."""
    for key in dict.fromkeys((r["batch"], r["kernel"]) for r in rows):
        res = sorted((r for r in rows if (r["batch"], r["kernel"]) == key), key=lambda r: r["us"])
        ref = {tag: next((r["us"] for r in res if tag in r["variant"]), float("nan"))
               for tag in ("default", "model pick")}
        for r in res[:3]:
            print(f"best B={key[0]:<5d} {key[1]:14s} {r['variant']:44s} {r['us']:8.2f} us "
                  f"(default {ref['default']:.2f}, model pick {ref['model pick']:.2f})")


# ---- gemm-plans: hand-picked conv2 plans ---------------------------------------------------------

#: (BM, BN, BK, TM, TN, splits); splits <= 0: 128 (batch 64) or 256 split groups, doubled for -1.
CONV2_PLANS = {
    "conv2_fwd": [(64, 32, 16, 2, 8, 1), (128, 32, 16, 4, 8, 1), (256, 32, 16, 8, 4, 1), (256, 32, 16, 4, 8, 1),
                  (128, 32, 16, 8, 4, 1)],
    "conv2_gi+mask": [(128, 16, 16, 2, 8, 1), (256, 16, 16, 2, 8, 1), (128, 16, 16, 2, 4, 1), (64, 16, 16, 2, 8, 1)],
    "conv2_gw+db": [(32, 32, 32, 4, 2, 0), (32, 64, 32, 2, 4, 0), (32, 48, 32, 2, 4, 0), (32, 144, 32, 4, 4, 0),
                    (32, 144, 32, 4, 4, -1), (32, 96, 32, 2, 4, 0), (32, 32, 32, 4, 2, -1)],
}


def gemm_plan(K: int, BM: int, BN: int, BK: int, TM: int, TN: int, splits: int) -> ck.GemmPlan:
    """A plan as given (no cost-model check: plans it would reject are what is measured here)."""
    kchunk = round_up(ceil_div(K, splits), BK)
    return ck.GemmPlan(BM, BN, BK, TM, TN, ceil_div(K, kchunk), kchunk)


def gemm_plans_groups(B: int, args) -> list[Group]:
    groups = []
    contractions = mnist_contractions(B)
    for name, plans in CONV2_PLANS.items():
        kind, spec, extra = contractions[name]
        M, N, K, batch, akf, bkf, rowsum = gemm_dims(kind, spec, extra)
        kernels = [("default", render_gemm(f"def_{_tag(name)}_{B}", kind, spec, extra))]
        for i, (BM, BN, BK, TM, TN, s) in enumerate(plans):
            splits = s if s > 0 else (128 if B == 64 else 256) * (2 if s < 0 else 1)
            p = gemm_plan(K, BM, BN, BK, TM, TN, splits)
            if p.threads % 32 or (rowsum and p.threads < BM):
                print(f"B={B} {name} {_plan_label(p)}: not a valid block (threads {p.threads})")
                continue
            kernels.append((_plan_label(p), render_gemm(f"try{i}_{_tag(name)}_{B}", kind, spec, extra, plan=p)))
        groups.append(Group(kind, spec, extra, kernels, dict(batch=B, kernel=name), flops(kind, spec)))
    return groups


# ---- direct: conv2's direct kernels --------------------------------------------------------------

FWD, GI = ("conv_fwd", dict(bias=True, relu=True)), ("conv_gi", dict(relu_mask=True))


def _direct_args(kind: str, spec: dict) -> dict:
    gi = kind == "conv_gi"
    return dict(grad_input=gi, **spec, **(dict(relu_mask=True) if gi else dict(bias=True, relu=True)))


def _direct_tiling(kind: str, spec: dict) -> tuple[int, int, int, int, int, int]:
    """(CI, HI, WI, CO, HO, WO) of the forward convolution a direct kernel computes (grad-input:
    the one of dy with the flipped kernel; stride 1, no padding)."""
    HO, WO = conv_out(spec)
    if kind == "conv_gi":
        return spec["O"], HO, WO, spec["C"], spec["H"], spec["W"]
    return spec["C"], spec["H"], spec["W"], spec["O"], HO, WO


def _direct_plan(kind: str, spec: dict, OT: int, PT: int, RB: int, CC: int | None = None) -> cd.DirectPlan | None:
    """The plan of thread tile OT x PT and RB rows a block, CC channels a stage (default: the
    planner's rule); None where it does not fit."""
    CI, _, _, CO, _, WO = _direct_tiling(kind, spec)
    if CO % OT:
        return None
    ncg = ceil_div(WO, PT)
    threads = CO // OT * RB * ncg
    CC = CC or cd.direct_channels_per_step(CI, RB, ncg * PT, spec["KH"], spec["KW"], CO)
    if CC is None or threads > 1024:
        return None
    return cd.DirectPlan(OT, PT, RB, CC, ncg, threads, 0.0)


def _direct_label(p: cd.DirectPlan) -> str:
    return f"{p.OT}x{p.PT} rb{p.RB} cc{p.CC} t{p.threads}"


#: (OT, PT, RB) tilings besides the planner's pick; at batch <= 64 also the small units (more
#: blocks for the multiprocessors).
DIRECT_TILES = ((8, 8, 4), (8, 8, 8), (8, 6, 4), (4, 8, 8), (4, 6, 12), (8, 4, 8), (4, 4, 16), (8, 7, 6),
                (8, 9, 4), (4, 7, 8), (2, 8, 16))
SMALL_UNIT_TILES = ((8, 4, 2), (8, 4, 3), (4, 4, 4), (8, 2, 2))


def direct_groups(B: int, args) -> list[Group]:
    spec = dict(N=B, **CONV2)
    groups = []
    for kind, extra in (FWD, GI):
        pick = cd.direct_forward_plan(spec["N"], *_direct_tiling(kind, spec), spec["KH"], spec["KW"])
        kernels = [("gemm", render_gemm(f"g_{kind}_{B}", kind, spec, extra)),
                   (f"direct pick {_direct_label(pick)}",
                    cd.render_direct(f"dp_{kind}_{B}", **_direct_args(kind, spec)))]
        seen = {dataclasses.astuple(pick)[:5]}
        for i, tile in enumerate(DIRECT_TILES + (SMALL_UNIT_TILES if B <= 64 else ())):
            p = _direct_plan(kind, spec, *tile)
            # (blocks of less than a warp only among the small units, which are about them)
            if p and (p.threads >= 32 or tile in SMALL_UNIT_TILES) and dataclasses.astuple(p)[:5] not in seen:
                seen.add(dataclasses.astuple(p)[:5])
                kernels.append((f"direct {_direct_label(p)}",
                                cd.render_direct(f"d{i}_{kind}_{B}", plan=p, **_direct_args(kind, spec))))
        groups.append(Group(kind, spec, extra, kernels, dict(batch=B, kernel=kind), flops(kind, spec)))
    extra = dict(bias=False)
    OT, RB, blocks = cd.direct_grad_weight_plan(B, spec["C"], spec["O"], spec["KH"], spec["KW"], *conv_out(spec))
    kernels = [("gemm", render_gemm(f"g_gw_{B}", "conv_gw", spec, extra)),
               (f"direct pick ot{OT} rows {RB} blocks {blocks}", cd.render_direct_grad_weight(f"dp_gw_{B}", **spec))]
    for blocks in ((96, 192, 384) if B <= 64 else (264, 528, 1056)):
        for rows in (1, 2, 4):
            kernels.append((f"direct blocks {blocks} rows {rows}",
                            cd.render_direct_grad_weight(f"d{blocks}r{rows}_gw_{B}", blocks=blocks, rows=rows, **spec)))
    groups.append(Group("conv_gw", spec, extra, kernels, dict(batch=B, kernel="conv_gw"), flops("conv_gw", spec)))
    kind, mm, _ = mnist_contractions(B)["linear_gi"]
    kernels = [("gemm", ck.render_matmul(f"g_mm_{B}", **mm))]
    kernels += [(f"thin rows {r}", cd.render_matmul_thin(f"t{r}_mm_{B}", rows=r, **mm)) for r in (4, 16, 35, 64)]
    groups.append(Group(kind, mm, {}, kernels, dict(batch=B, kernel="linear_gi"), flops(kind, mm)))
    return groups


def direct_occupancy_groups(B: int, args) -> list[Group]:
    """The planner's picks with register caps (minimum blocks per SM in __launch_bounds__) and
    other stage depths (CC), and other tilings at the full depth."""
    spec = dict(N=B, **CONV2)
    groups = []
    for kind, extra in (FWD, GI):
        base = cd.direct_forward_plan(spec["N"], *_direct_tiling(kind, spec), spec["KH"], spec["KW"])
        kernels = []
        for cc in dict.fromkeys((base.CC, 8, 4)):
            p = dataclasses.replace(base, CC=cc)
            for mb in (0, 2, 3, 4, 5):
                kernels.append((f"pick {_direct_label(p)} minblocks {mb}",
                                cd.render_direct(f"v{cc}_{mb}_{kind}", plan=p, min_blocks=mb,
                                                 **_direct_args(kind, spec))))
        for OT, PT, RB in ((8, 4, 4), (8, 4, 6), (8, 4, 12), (4, 4, 8), (8, 3, 8)):
            p = _direct_plan(kind, spec, OT, PT, RB, CC=16)
            for mb in (0, 3):
                if p is not None:
                    kernels.append((f"{_direct_label(p)} minblocks {mb}",
                                    cd.render_direct(f"w{OT}{PT}{RB}_{mb}_{kind}", plan=p, min_blocks=mb,
                                                     **_direct_args(kind, spec))))
        groups.append(Group(kind, spec, extra, kernels, dict(batch=B, kernel=kind), flops(kind, spec)))
    kernels = [(f"gw 528 blocks rows {rows} minblocks {mb}",
                cd.render_direct_grad_weight(f"gw{mb}_{rows}", blocks=528, rows=rows, min_blocks=mb, **spec))
               for mb in (2, 3, 4) for rows in (4, 6)]
    groups.append(Group("conv_gw", spec, dict(bias=False), kernels, dict(batch=B, kernel="conv_gw"),
                        flops("conv_gw", spec)))
    return groups


def direct_staging_groups(B: int, args) -> list[Group]:
    """Single-buffered direct forward / grad-input with and without coalesced weight staging and
    vector stores, staged rows padded by 1-3 floats, 16-channel thread tiles for the grad-input;
    the grad-weight over block counts and rows a unit."""
    spec = dict(N=B, **CONV2)
    groups = []
    for kind, extra in (FWD, GI):
        a = _direct_args(kind, spec)
        kernels = [(f"coalesced={cw} vector={vs}",
                    cd.render_direct(f"s{int(cw)}{int(vs)}_{kind}", coalesced_weights=cw, vector_stores=vs, **a))
                   for cw in (False, True) for vs in (False, True)]
        kernels += [(f"row pad {pad}", cd.render_direct(f"rp{pad}_{kind}", row_pad=pad, **a)) for pad in (1, 2, 3)]
        if kind == "conv_gi":
            for OT, PT, RB in ((16, 2, 9), (16, 4, 18), (16, 2, 5)):
                p = _direct_plan(kind, spec, OT, PT, RB)
                if p is not None:
                    kernels.append((_direct_label(p), cd.render_direct(f"o{OT}{PT}{RB}_{kind}", plan=p, **a)))
        groups.append(Group(kind, spec, extra, kernels, dict(batch=B, kernel=kind), flops(kind, spec)))
    kernels = [(f"gw blocks {b} rows {r}", cd.render_direct_grad_weight(f"g{b}_{r}", blocks=b, rows=r, **spec))
               for b in (264, 528, 792) for r in (2, 4)]
    groups.append(Group("conv_gw", spec, dict(bias=False), kernels, dict(batch=B, kernel="conv_gw"),
                        flops("conv_gw", spec)))
    return groups


def direct_tc_groups(B: int, args) -> list[Group]:
    """conv2 on TF32 tensor cores: every direct_tc plan the tuner measures against the float32
    direct kernel and the GEMM's tensor-core pick (the TF32 kernels' rel error is TF32's, ~1e-4)."""
    spec = dict(N=B, **CONV2)
    HO, WO = conv_out(spec)
    groups = []
    for kind, extra in (FWD, GI):
        CI, _, _, CO, HOk, WOk = _direct_tiling(kind, spec)
        kernels = [("direct float32", cd.render_direct(f"dp_{kind}_{B}", **_direct_args(kind, spec))),
                   ("gemm tf32", render_gemm(f"gt_{kind}_{B}", kind, spec, dict(extra, tf32=True)))]
        for i, p in enumerate(ct.tc_forward_candidates(B, CI, CO, HOk, WOk, spec["KH"], spec["KW"])):
            kernels.append((f"direct_tc rb{p.RB} cc{p.CC} w{p.WM}x{p.WN} f{p.FM}x{p.FN} t{p.threads}",
                            ct.render_direct_tc(f"tc{i}_{kind}_{B}", plan=p, **_direct_args(kind, spec))))
        groups.append(Group(kind, spec, extra, kernels, dict(batch=B, kernel=kind), flops(kind, spec)))
    extra = dict(bias=False)
    kernels = [("direct float32", cd.render_direct_grad_weight(f"dp_gw_{B}", **spec)),
               ("gemm tf32", render_gemm(f"gt_gw_{B}", "conv_gw", spec, dict(extra, tf32=True)))]
    for i, p in enumerate(ct.tc_grad_weight_candidates(B, spec["C"], spec["O"], spec["KH"], spec["KW"], HO, WO)):
        kernels.append((f"direct_tc rb{p.RB} f{p.FM}x{p.FN} khw{p.KHW} blocks {p.blocks} "
                        f"t{p.threads(spec['C'], spec['O'], spec['KH'])}",
                        ct.render_direct_tc_grad_weight(f"tc{i}_gw_{B}", plan=p, **spec)))
    groups.append(Group("conv_gw", spec, extra, kernels, dict(batch=B, kernel="conv_gw"), flops("conv_gw", spec)))
    return groups


# ---- skinny: the linear layer's memory-bound matmuls --------------------------------------------

def _traffic(m: dict) -> int:
    return 4 * (m["M"] * m["K"] + m["K"] * m["N"] + m["M"] * m["N"])


def skinny_groups(B: int, args) -> list[Group]:
    contractions = mnist_contractions(B)
    _, fwd, _ = contractions["linear_fwd"]
    M, N, K = fwd["M"], fwd["N"], fwd["K"]
    plans = [("pick", cs.narrow_plan(M, N, K))]
    plans += [(f"splits {s}", cs.narrow_plan(M, N, K, splits=s)) for s in (8, 16, 36, 72)]
    plans += [("rt2 rg8", cs.narrow_plan(M, N, K, rows_per_lane=2, warps=8)),
              ("rt2 rg8 u4", cs.narrow_plan(M, N, K, rows_per_lane=2, warps=8, unroll=4)),
              ("rt4 rg4", cs.narrow_plan(M, N, K, rows_per_lane=4, warps=4)),
              ("rt3 rg8", cs.narrow_plan(M, N, K, rows_per_lane=3, warps=8)),
              ("rt4 rg8 u1", cs.narrow_plan(M, N, K, unroll=1))]
    if B <= 64:
        plans += [("rt2 rg4", cs.narrow_plan(M, N, K, rows_per_lane=2, warps=4)),
                  ("rt1 rg8", cs.narrow_plan(M, N, K, rows_per_lane=1, warps=8))]
    narrow = [("gemm", ck.render_matmul(f"gemm_fwd_{B}", **fwd))]
    narrow += [(f"narrow {label}: rt{p.RT} rg{p.RG} u{p.U} s{p.S}x{p.KC}",
                cs.render_matmul_narrow(f"nw{i}_{B}", plan=p, **fwd)) for i, (label, p) in enumerate(plans) if p]

    _, gw, _ = contractions["linear_gw"]
    M, N, K = gw["M"], gw["N"], gw["K"]
    opts = [("pick", {}), ("kg4 s4", dict(groups=4, splits=4)), ("kg8", dict(groups=8)),
            ("kg2 s8", dict(groups=2, splits=8)), ("u4", dict(unroll=4)), ("ct64 kg4", dict(col_threads=64, groups=4))]
    if B > 64:
        opts += [("kg4 s16", dict(groups=4, splits=16)), ("kg2 s16", dict(groups=2, splits=16))]
    else:
        opts += [("kg4 s1", dict(groups=4, splits=1)), ("kg8 s1", dict(groups=8, splits=1)),
                 ("kg2 s1", dict(groups=2, splits=1))]
    short = [("gemm", ck.render_matmul(f"gemm_gw_{B}", **gw))]
    for i, (label, kw) in enumerate(opts):
        p = cs.short_m_plan(M, N, K, **kw)
        if p is not None:
            short.append((f"short-M {label}: ct{p.CT} kg{p.KG} u{p.U} s{p.S}x{p.KC}",
                          cs.render_matmul_short_m(f"sm{i}_{B}", plan=p, **gw)))
    return [Group("matmul", fwd, {}, narrow, dict(batch=B, kernel="linear_fwd"), nbytes=_traffic(fwd)),
            Group("matmul", gw, {}, short, dict(batch=B, kernel="linear_gw"), nbytes=_traffic(gw))]


# ---- small: conv1's small-window kernels ---------------------------------------------------------

def _small_forward_plans(B: int, HO: int) -> list[sc.SmallPlan]:
    """The planner's pick, then (OT, RB, TL) variants: whole images or a few rows a block, 2-16
    channels a thread, one vector a lane or several."""
    g = CONV1
    plans = [sc.small_forward_plan(B, g["C"], g["O"], g["KH"], g["KW"], HO, HO, 1, g["W"], 0, 1)]
    for OT, RB, TL in ((4, 26, 64), (4, 26, 128), (4, 13, 64), (4, 13, 96), (4, 7, 96), (4, 4, 64), (4, 2, 32),
                       (2, 13, 64), (2, 26, 64), (8, 13, 64), (8, 26, 128), (16, 13, 64), (4, 5, 64), (2, 4, 32)):
        p = sc.SmallPlan(OT, RB, TL, B * ceil_div(HO, RB), 2)
        if all(dataclasses.astuple(p)[:3] != dataclasses.astuple(q)[:3] for q in plans):
            plans.append(p)
    return plans


def _small_grad_weight_plans(B: int, HO: int) -> list[tuple[sc.SmallPlan, int | None]]:
    """The planner's pick, then (OT, RB, TL, blocks) variants with register caps (minimum blocks
    resident per SM in __launch_bounds__; None: the planner's)."""
    g = CONV1
    best = sc.small_grad_weight_plan(B, g["C"], g["O"], g["KH"], g["KW"], HO, HO, 1, g["W"], 0, 1)
    out = [(best, None)]
    # (OT = 8 holds 72 accumulators: it spills even at 128 registers)
    for OT, RB, TL in ((4, 9, 64), (4, 13, 64), (4, 9, 32), (4, 7, 32), (4, 5, 64), (4, 2, 32), (2, 13, 64),
                       (2, 26, 64), (4, 26, 128)):
        units = B * ceil_div(HO, RB)
        for blocks in (264, 396, 528, 1056):
            if blocks <= units and (B == 1024 or blocks in (264, 528)):
                p = sc.SmallPlan(OT, RB, TL, blocks, 2)
                # more accumulators or loads than the planner allows: spills under its register cap
                heavy = ceil_div(RB * 13, TL) * OT * 2 > sc.GW_LOAD_REGS or OT * 9 > sc.GW_ACC_REGS
                if p != dataclasses.replace(best, score=0.0):
                    out.append((p, max(1, 512 // p.threads(16)) if heavy else None))  # <= 128 registers
    out.append((dataclasses.replace(best, score=0.0), max(1, 512 // best.threads(16))))
    return out


def small_groups(B: int, args) -> list[Group]:
    spec = dict(N=B, **CONV1)
    HO, WO = conv_out(spec)
    nbytes = 4 * B * (spec["C"] * spec["H"] * spec["W"] + spec["O"] * HO * WO)
    fwd = [("gemm", render_gemm(f"g_fwd_{B}", "conv_fwd", spec, dict(bias=True, relu=True)))]
    for i, p in enumerate(_small_forward_plans(B, HO)):
        fwd.append((f"small ot{p.OT} rb{p.RB} tl{p.TL} t{p.threads(spec['O'])} grid{B * ceil_div(HO, p.RB)}"
                    + (" (pick)" if i == 0 else ""),
                    sc.render_small_forward(f"s{i}_fwd_{B}", bias=True, relu=True, plan=p, **spec)))
    gw = [("gemm", render_gemm(f"g_gw_{B}", "conv_gw", spec, dict(bias=False)))]
    for i, (p, mb) in enumerate(_small_grad_weight_plans(B, HO)):
        gw.append((f"small ot{p.OT} rb{p.RB} tl{p.TL} t{p.threads(spec['O'])} blocks{p.blocks}"
                   + (f" minblocks{mb}" if mb else "") + (" (pick)" if i == 0 else ""),
                   sc.render_small_grad_weight(f"s{i}_gw_{B}", plan=p, min_blocks=mb, **spec)))
    return [Group("conv_fwd", spec, dict(bias=True, relu=True), fwd, dict(batch=B, kernel="conv1_fwd"), nbytes=nbytes),
            Group("conv_gw", spec, dict(bias=False), gw, dict(batch=B, kernel="conv1_gw"), nbytes=nbytes)]


# ---- the command line ----------------------------------------------------------------------------

#: command -> (its groups at one batch size, default batch sizes, help)
COMMANDS = {
    "gemm": (gemm_groups, [64, 1024],
             "the GEMM cost model's top plans and a spread of tiles and split counts for each contraction of "
             "the MNIST CNN and MLP (--kernels, --top), next to the renderer's default plan"),
    "gemm-plans": (gemm_plans_groups, [64, 1024],
                   "hand-picked GEMM plans for conv2 outside the model's sweep (larger thread tiles, wider N tiles)"),
    "direct": (direct_groups, [64, 1024],
               "conv2: the direct kernels (planner pick and other tilings; at batch <= 64 also small units) "
               "against the implicit GEMM; the thin matmul against the GEMM for the linear grad-input"),
    "direct-occupancy": (direct_occupancy_groups, [1024],
                         "conv2: the direct kernels under register caps (__launch_bounds__ minimum blocks) and "
                         "other stage depths"),
    "direct-staging": (direct_staging_groups, [1024],
                       "conv2: the direct kernels' weight staging, vector stores and row padding; the "
                       "grad-weight over block counts and rows a unit"),
    "direct-tc": (direct_tc_groups, [64, 1024],
                  "conv2 on TF32 tensor cores: the direct_tc plans against the float32 direct kernels and the "
                  "GEMM's TF32 pick"),
    "skinny": (skinny_groups, [64, 1024],
               "the CNN's linear forward (narrow) and grad-weight (short-M): the skinny matmuls' plans against "
               "the GEMM, with GB/s of compulsory traffic"),
    "small": (small_groups, [64, 1024],
              "conv1: the small-window kernels' plans against the implicit GEMM, with GB/s"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (_, batches, text) in COMMANDS.items():
        p = sub.add_parser(name, help=f"{text} (default batches: {' '.join(map(str, batches))})", description=text)
        p.add_argument("--batches", type=int, nargs="+", default=batches)
        p.add_argument("--out", default=None, help="write the result rows as JSON here")
        p.add_argument("--match", default=None, help="only the variants whose label contains this")
        p.add_argument("--once", action="store_true", help="launch each variant once, uncaptured (for ncu)")
        p.add_argument("--dry-run", action="store_true", help="render the variants and list them; no GPU needed")
        if name == "gemm":
            p.add_argument("--top", type=int, default=4, help="the cost model's best plans timed (and a spread)")
            p.add_argument("--kernels", nargs="+", default=None, choices=sorted(mnist_contractions(64)),
                           metavar="NAME", help="contractions to sweep (default: all of "
                                                f"{', '.join(mnist_contractions(64))})")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    build = COMMANDS[args.command][0]
    groups = [g for B in args.batches for g in build(B, args)]
    if args.dry_run:
        describe(groups, args.match)
        return
    rows = measure(require_cupy(), np.random.default_rng(1), groups, args.match, args.once)
    if args.command == "gemm" and not args.once:
        gemm_summary(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
