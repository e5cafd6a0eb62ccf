"""3x3 stride-1 convolutions by Winograd's minimal filtering F(2x2, 3x3) on the CPU: the `winograd`
family of the CPU choice table (`cpp_choices`); template `templates/cpp/conv_winograd.j2`.

A 2x2 block of outputs of a 3x3 correlation is A^T [(G g G^T) . (B^T d B)] A, d being the 4x4
input patch under it and g the 3x3 weights: 16 products where the direct form has 36, so the
multiply-adds of a layer fall by 2.25x (a 7x7 plane, whose 4x4 tiles cover 8x8, by 1.72x). For a
layer of C inputs and O outputs the 16 products of every tile, summed over the input channels, are
16 matrix products of (tiles x C) by (C x O): the register-tiled GEMM does nearly all the work,
and the transforms (adds and subtracts, the weights' halves) cost a few operations an element.

* forward: U[pos][c][o] = (G w[o][c] G^T)[pos] once a call (every thread a share of the channel
  pairs); tasks are blocks of RB tile rows (a tile row: TW = ceil(WO/2) tiles of one image, the
  blocks over the batch's N*TH rows in order), each transforming its input patches to
  V[pos][c][tile] (vectors of tiles), then for every block of OB output channels and VB vectors
  of tiles the 16 GEMMs (register tile OB x VB, as the direct kernels' flat tile) and the output
  transform with the bias and ReLU, its 2x2 blocks written back as rows;
* grad-input: at stride 1 the input gradient is the forward correlation of dy with the weights
  transposed and flipped (w'[c][o][r][s] = w[o][c][2-r][2-s]) and the padding 2 - p, so it is the
  same kernel (the ReLU-mask epilogue applied where rows are written back).

The input transform's adds are exact up to one rounding each, the weight transform's halves are
exact, and each GEMM sums C products where the direct kernel sums 9C: measured against float64
on random layers its error is no larger than the direct kernel's (docs/benchmarks.md). The
grad-weight is not served: its F(3x3, 2x2) form sums the tiles before the output transform,
whose cancellation doubled the error of the weight gradient in the same measurement.

Every output belongs to one block, and every sum has a fixed order: results do not depend on the
thread count. The images N are the kernel's argument (`KernelSource.extents`), not a constant.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .cpp_kernels import MAX_THREADS, TUNE_TILES, KernelSource, _plan_error, _render, _Scratch
from .cpu_vector import VectorISA
from .grouped_conv import ConvGeometry
from .shapes import ceil_div, round_up

__all__ = ["WinogradPlan", "KINDS", "serves", "plans", "scratch_bytes", "render"]

#: the kinds the family serves (the grad-weight: see the module's text)
KINDS = ("conv2d", "conv2d_grad_input")
_ALIGN = 16          # floats: 64-byte aligned regions
_MAX_VB = 6          # tile vectors a register tile may hold
_POSITIONS = 16      # the 4x4 transformed points of F(2x2, 3x3)
#: floats of a thread's transformed inputs (V) the cost model keeps a block within: the block is
#: read once per output-channel block, so it should stay in the core's L2
_V_BUDGET = 256 * 1024
#: tile rows a block may hold (the tuner's spread included)
_MAX_RB = 64


@dataclass(frozen=True)
class WinogradPlan:
    """How a `winograd` kernel runs: a register tile of OB output channels x VB vectors of tiles,
    over blocks of RB tile rows."""
    OB: int
    VB: int
    RB: int

    def pairs(self) -> tuple[tuple[str, int], ...]:
        return tuple(dataclasses.asdict(self).items())


@dataclass(frozen=True)
class _Correlation:
    """The stride-1 3x3 correlation a kernel computes: CI input channels of IH x IW, padded by
    (PT, PL) (negative: cropped), into CO channels of OH x OW; FLIP: the weights are the
    grad-input's (transposed and flipped)."""
    CI: int
    CO: int
    IH: int
    IW: int
    OH: int
    OW: int
    PT: int
    PL: int
    FLIP: bool

    @property
    def TH(self) -> int:
        return ceil_div(self.OH, 2)

    @property
    def TW(self) -> int:
        return ceil_div(self.OW, 2)


def serves(kind: str, g: ConvGeometry) -> str | None:
    """None where the family serves a convolution of `kind` and geometry `g`, else why not."""
    if kind not in KINDS:
        return "it serves the forward and grad-input convolutions"
    if (g.KH, g.KW) != (3, 3) or (g.SH, g.SW) != (1, 1) or g.G != 1:
        return "it serves ungrouped 3x3 convolutions at stride 1"
    return None


def _correlation(kind: str, g: ConvGeometry) -> _Correlation:
    if why := serves(kind, g):
        raise ValueError(f"winograd {kind}: {why}, got a {g.KH}x{g.KW} kernel at stride ({g.SH},{g.SW}), "
                         f"groups {g.G}")
    if kind == "conv2d":
        return _Correlation(g.C, g.O, g.H, g.W, g.HO, g.WO, g.PH, g.PW, False)
    return _Correlation(g.O, g.C, g.HO, g.WO, g.H, g.W, 2 - g.PH, 2 - g.PW, True)


# --------------------------------------------------------------------------- plans

def _block(k: _Correlation, isa: VectorISA, plan: WinogradPlan) -> dict[str, int]:
    TB = plan.RB * k.TW
    TG = plan.VB * isa.lanes
    TBP = round_up(TB, TG)
    return dict(TB=TB, TG=TG, TBP=TBP, NTG=TBP // TG, COP=round_up(k.CO, plan.OB))


def _check(name: str, k: _Correlation, plan: WinogradPlan, isa: VectorISA) -> None:
    if not (1 <= plan.OB <= 16 and 1 <= plan.VB <= _MAX_VB and 1 <= plan.RB <= _MAX_RB):
        raise _plan_error(name, plan, f"it needs 1 <= OB <= 16, 1 <= VB <= {_MAX_VB} and 1 <= RB <= {_MAX_RB}")
    if plan.OB * plan.VB + plan.VB + 1 > isa.registers:
        raise _plan_error(name, plan, f"its tile needs {plan.OB * plan.VB + plan.VB + 1} vector registers, "
                                      f"{isa.name} has {isa.registers}")


def _rows_options(k: _Correlation, N: int, budget: int = _V_BUDGET) -> list[int]:
    """Block heights (tile rows) whose transformed inputs fit `budget` floats (at least one row),
    for the planned batch no more rows than it has."""
    most = max(1, min(_MAX_RB, N * k.TH, budget // (_POSITIONS * k.CI * max(k.TW, 1))))
    return list(range(1, most + 1))


def _step_cycles(ob: int, vb: int) -> float:
    """Modelled cycles of one input channel's step of an OB x VB GEMM tile: its FMAs at two a
    cycle, its VB vector loads (a block's transformed inputs, from L2 when the tile's slice
    passes L1) and OB broadcasts, and the loop's own instructions. Fitted to the tuner's
    measurements of airbench's 256x256 14x14 forward on a 2-core Zen 4 (tiles 6x4 .. 2x4 within
    15% of the measured ratios, in the same order but one pair)."""
    return 0.5 * ob * vb + 0.35 * vb + 0.2 * ob + 1.0


def _cost(k: _Correlation, isa: VectorISA, N: int, plan: WinogradPlan) -> float:
    """Modelled cycles of a call: the GEMMs' steps over every block (the padding of tiles to whole
    vectors and of channels to whole tiles included), plus streaming every point's weights once a
    block and tile group."""
    b = _block(k, isa, plan)
    blocks = ceil_div(N * k.TH, plan.RB)
    gemm = blocks * _POSITIONS * (b["COP"] // plan.OB) * b["NTG"] * k.CI * _step_cycles(plan.OB, plan.VB)
    weights = blocks * _POSITIONS * k.CI * b["COP"] / isa.lanes * 0.25
    return gemm + weights


def plans(kind: str, g: ConvGeometry, isa: VectorISA, tune: bool = False) -> list[WinogradPlan]:
    """The cost model's plan for a kernel of `kind` (with `tune`, the spread the tuner measures:
    the best-modelled register tiles, and the best tile at other block heights, up to twice the
    cost model's L2 budget)."""
    k = _correlation(kind, g)
    tiles = [(ob, vb) for ob in range(1, 17) for vb in range(1, _MAX_VB + 1)
             if ob * vb + vb + 1 <= isa.registers and ob <= max(k.CO, 1)]

    def ranked(budget: int) -> list[WinogradPlan]:
        out = [(_cost(k, isa, g.N, p), p) for ob, vb in tiles for rb in _rows_options(k, g.N, budget)
               for p in (WinogradPlan(OB=ob, VB=vb, RB=rb),)]
        out.sort(key=lambda t: (t[0], -t[1].RB, t[1].VB, t[1].OB))
        return [p for _, p in out]

    best = ranked(_V_BUDGET)
    if not tune:
        return best[:1]
    out = [next(p for p in best if (p.OB, p.VB) == t) for t in list(dict.fromkeys((p.OB, p.VB) for p in best))[:TUNE_TILES]]
    top = best[0]
    wider = [p for p in ranked(2 * _V_BUDGET) if (p.OB, p.VB) == (top.OB, top.VB) and p.RB > top.RB]
    narrower = [p for p in best if (p.OB, p.VB) == (top.OB, top.VB) and p.RB <= top.RB // 2]
    return list(dict.fromkeys(out + wider[:1] + narrower[:1]))


# --------------------------------------------------------------------------- rendering

def _ctx(name: str, kind: str, g: ConvGeometry, plan: WinogradPlan, isa: VectorISA) -> tuple[dict[str, Any], _Scratch]:
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    k = _correlation(kind, g)
    _check(name, k, plan, isa)
    b = _block(k, isa, plan)
    XWP = round_up(k.TW + 1, _ALIGN)    # a whole number of vectors of either variant
    XR = 2 * plan.RB + 2
    # row buffers: the padded row (2 XWP), a zero row, the even and odd rows (XR each), the vertical
    # sums (8 of XWP + VL) and the grad-input's masked row (2 XWP)
    work = 3 * XWP + 2 * XR * XWP + 8 * (XWP + isa.lanes) + 2 * XWP
    v_pos = k.CI * b["TBP"] + _ALIGN
    v = _POSITIONS * v_pos
    per_thread = round_up(v, _ALIGN) + _POSITIONS * plan.OB * b["TG"] + plan.OB * 4 * b["TBP"] + work
    qlo = max(0, k.PL)
    sc = _Scratch()
    ucs = round_up(b["COP"], isa.lanes)
    u_pos = k.CI * ucs + _ALIGN
    sc.add("u", _POSITIONS * u_pos)
    sc.add("thr", MAX_THREADS * per_thread)
    ctx = dict(dataclasses.asdict(k), **b, kind=kind, name=name, OB=plan.OB, VB=plan.VB, RB=plan.RB, TH=k.TH,
               TW=k.TW, XWP=XWP, XR=XR, WORK=work, QLO=qlo, QHI=max(qlo, min(2 * XWP, k.IW + k.PL)), V_FLOATS=round_up(v, _ALIGN), V_POS=v_pos, UCS=ucs, U_POS=u_pos, PER_THREAD=per_thread, off=sc.offsets,
               N=g.N, C=g.C, O=g.O, H=g.H, W=g.W, HO=g.HO, WO=g.WO, PH=g.PH, PW=g.PW)
    return ctx, sc


def scratch_bytes(kind: str, g: ConvGeometry, plan: WinogradPlan, isa: VectorISA) -> int:
    """Scratch bytes of the kernel under `plan` (ValueError where the plan does not fit)."""
    return _ctx("k", kind, g, plan, isa)[1].nbytes


def render(name: str, kind: str, g: ConvGeometry, plan: WinogradPlan, isa: VectorISA, *, bias: bool = False,
           relu: bool = False, relu_mask: bool = False) -> tuple[KernelSource, list[str | None]]:
    """The kernel and its arguments as roles (None: NULL), the signatures of `cpp_kernels`' templates:
    forward (x, w, bias, out, scratch), grad-input (dy, w, [mask], out, scratch); the images N
    follow as a run-time size. Epilogues: the forward's bias and ReLU, the grad-input's ReLU mask."""
    if (bias or relu) and kind != "conv2d" or relu_mask and kind != "conv2d_grad_input":
        raise ValueError(f"the winograd {kind} kernel takes no {'relu_mask' if relu_mask else 'bias/relu'} epilogue")
    ctx, sc = _ctx(name, kind, g, plan, isa)
    code = _render("conv_winograd.j2", isa, bias=bias, relu=relu, relu_mask=relu_mask, **ctx)
    order: list[str | None] = (["x", "w", "bias" if bias else None, "out", "scratch"] if kind == "conv2d" else
                               ["dy", "w", *(["mask"] if relu_mask else []), "out", "scratch"])
    return KernelSource(name, code, sc.nbytes, (g.N,)), order
