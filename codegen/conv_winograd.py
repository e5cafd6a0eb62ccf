"""3x3 stride-1 convolutions by Winograd's minimal filtering on the CPU: the `winograd` family of
the CPU choice table (`cpp_choices`); templates `templates/cpp/conv_winograd.j2` (forward and
grad-input), `conv_winograd_gw.j2` (grad-weight), `winograd_input.j2` (the input transform both use).

A 2x2 block of outputs of a 3x3 correlation is A^T [(G g G^T) . (B^T d B)] A (F(2x2, 3x3)), d being
the 4x4 input patch under it and g the 3x3 weights: 16 products where the direct form has 36, so
the multiply-adds of a layer fall by 2.25x (a 7x7 plane, whose 4x4 tiles cover 8x8, by 1.72x). For
a layer of C inputs and O outputs the 16 products of every tile, summed over the input channels,
are 16 matrix products of (tiles x C) by (C x O): the register-tiled GEMMs do nearly all the work,
and the transforms (adds and subtracts, the weights' halves) cost a few operations an element.

* forward: U[pos][c][o] = (G w[o][c] G^T)[pos] once a call (every thread a share of the channel
  pairs, a vector of output channels at a time); tasks are blocks of RB tile rows (a tile row: TW =
  ceil(WO/2) tiles of one image, the blocks over the batch's N*TH rows in order), each transforming
  its input patches to V[pos][c][tile] (vectors of tiles), then for every block of OB output
  channels and VB vectors of tiles the 16 GEMMs (register tile OB x VB, as the direct kernels'
  flat tile) and the output transform with the bias and ReLU, its 2x2 blocks written back as rows;
* grad-input: at stride 1 the input gradient is the forward correlation of dy with the weights
  transposed and flipped (w'[c][o][r][s] = w[o][c][2-r][2-s]) and the padding 2 - p, so it is the
  same kernel (the ReLU-mask epilogue applied where rows are written back);
* grad-weight (F(3x3, 2x2)): dw[o][c] = G^T [sum over tiles of (A y A^T) . (B^T d B)] G, y the 2x2
  block of dy of a tile. For each block of tile rows the team transforms the input patches (as the
  forward) and dy's blocks, both as vectors of tiles; each point's input channels are then
  regrouped in place so a vector holds VL channels of one tile (a register transpose per VL x VL
  square), and the 16 GEMMs' (OB output channels x VB vectors of input channels) tiles sum the
  block's tiles, CKT in registers (float), the block's partial sums added to running sums in
  double; G^T m G at the end, in double. (Summing vectors of tiles instead, as before, needed a
  tree of shuffles per block for every output: 47 -> 38 ms on airbench's 256-channel 14x14 layer
  on a 2-core Xeon.)

Accuracy (tests/codegen/test_conv_winograd.py, against float64): a forward or grad-input output
sums C products of transformed values, CK channels a float chain (then the chains), where the
direct kernel sums 9C in one chain, so it is more accurate (0.61-0.77x the direct kernels' RMS
error on a 16 -> 40 channel 14x14 layer); the grad-weight's output transform cancels (G^T m G of
sums larger than the result): 1.73x the direct kernel's error there. On full-width airbench
(`tools/zoo_alignment.py`, docs/benchmarks.md) the step's update error against float64 over
PyTorch float32's was 2.08 with the direct kernels, 1.09 with these summing all C in one chain,
0.75 with chains of 32.

A NaN or an infinity among the operands would meet its opposite in the transforms and spread NaN
over a tile (and the tiles sharing its patch): the transforms notice it (0 * value summed) and such
a block (forward, grad-input), or the whole call (grad-weight), is computed by the direct sums,
with the interpreter's products (padding zeros times the weights in the forward's and the
grad-weight's windows; none past dy's edges in the grad-input's scatter).

Every output belongs to one block (forward, grad-input) or every sum has the blocks' order
(grad-weight): results do not depend on the thread count. The images N are the kernels' argument
(`KernelSource.extents`), not a constant.
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

#: the kinds the family serves
KINDS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
_ALIGN = 16          # floats: 64-byte aligned regions
_MAX_VB = 6          # tile vectors a register tile may hold
_POSITIONS = 16      # the 4x4 transformed points of F(2x2, 3x3)
#: floats of a thread's transformed inputs (V) the cost model keeps a block within: the block is
#: read once per output-channel block, so it should stay in the core's L2
_V_BUDGET = 256 * 1024
#: tile rows a block may hold (the tuner's spread included)
_MAX_RB = 64
#: input channels the forward's register tile sums before adding to its point's sums (float
#: chains of CK, then CI / CK): in a float32 simulation of a 256-channel layer the error against
#: float64 halves (4.5e-7 with one chain, 2.2e-7 with 32, 2.6e-7 with 64; 1.2e-7 with exact
#: sums), and full-width airbench's eval logits went from 1.5x PyTorch float32's error to 0.78x
#: (64: 0.88x), for a load, an add and a store a register every 32 channels (~3% of the kernel)
_CHUNK = 32
#: tiles the grad-weight's register tile sums before adding to the block's partial sums: on the
#: accuracy test's layer (147 tiles a block) its error over the direct kernel's was 1.94x with 32,
#: 1.73x with 16 (as the lane sums' before), 1.79x with 8; airbench's 256-channel 14x14 layer ran
#: 38.6-39.1 ms with either
_GW_CHUNK = 16


@dataclass(frozen=True)
class WinogradPlan:
    """How a `winograd` kernel runs: blocks of RB tile rows; a register tile of OB output channels x
    VB vectors of tiles (forward, grad-input), of OB output x VB input channels, each a vector of
    tiles (grad-weight)."""
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
        return "it serves convolutions"
    if (g.KH, g.KW) != (3, 3) or (g.SH, g.SW) != (1, 1) or g.G != 1:
        return "it serves ungrouped 3x3 convolutions at stride 1"
    return None


def _correlation(kind: str, g: ConvGeometry) -> _Correlation:
    if why := serves(kind, g):
        raise ValueError(f"winograd {kind}: {why}, got a {g.KH}x{g.KW} kernel at stride ({g.SH},{g.SW}), "
                         f"groups {g.G}")
    if kind == "conv2d_grad_input":
        return _Correlation(g.O, g.C, g.HO, g.WO, g.H, g.W, 2 - g.PH, 2 - g.PW, True)
    # the forward, and the grad-weight's input side (its tiles are dy's 2x2 blocks, the forward's)
    return _Correlation(g.C, g.O, g.H, g.W, g.HO, g.WO, g.PH, g.PW, False)


# --------------------------------------------------------------------------- plans

def _block(k: _Correlation, isa: VectorISA, plan: WinogradPlan) -> dict[str, int]:
    """A forward / grad-input block: its tiles TB, padded to whole register tiles (TBP: TG tiles a
    tile), and the output channels padded to whole tiles (COP)."""
    TB = plan.RB * k.TW
    TG = plan.VB * isa.lanes
    TBP = round_up(TB, TG)
    return dict(TB=TB, TG=TG, TBP=TBP, NTG=TBP // TG, COP=round_up(k.CO, plan.OB))


def _gw_block(g: ConvGeometry, isa: VectorISA, plan: WinogradPlan) -> dict[str, int]:
    """A grad-weight block: its tiles in whole vectors (TBP), the output and input channels padded
    to whole tiles (OP; CP: VB vectors a tile, also a row of sums)."""
    cp = round_up(g.C, plan.VB * isa.lanes)
    return dict(TBP=round_up(plan.RB * ceil_div(g.WO, 2), isa.lanes), OP=round_up(g.O, plan.OB), CP=cp)


def _transpose_stages(lanes: int) -> list[tuple[int, list[int], list[int]]]:
    """The shuffles of a lanes x lanes register transpose (conv_winograd_gw.j2): for each bit h of
    a lane index, rows i and i + h (i without h) swap the lanes with h of row i for those without
    h of row i + h; as __builtin_shuffle masks of (row i, row i + h) for the new rows."""
    out = []
    h = lanes // 2
    while h:
        lo = [lanes + l - h if l & h else l for l in range(lanes)]
        hi = [lanes + l if l & h else l + h for l in range(lanes)]
        out.append((h, lo, hi))
        h //= 2
    return out


def _registers(ob: int, vb: int) -> int:
    """Vector registers of a register tile (every kind): OB x VB accumulators, VB loads and a
    broadcast."""
    return ob * vb + vb + 1


def _check(name: str, kind: str, plan: WinogradPlan, isa: VectorISA) -> None:
    if not (1 <= plan.OB <= 16 and 1 <= plan.VB <= _MAX_VB and 1 <= plan.RB <= _MAX_RB):
        raise _plan_error(name, plan, f"it needs 1 <= OB <= 16, 1 <= VB <= {_MAX_VB} and 1 <= RB <= {_MAX_RB}")
    if (regs := _registers(plan.OB, plan.VB)) > isa.registers:
        raise _plan_error(name, plan, f"its tile needs {regs} vector registers, {isa.name} has {isa.registers}")


def _rows_options(k: _Correlation, N: int, floats_a_row: int, budget: int = _V_BUDGET) -> list[int]:
    """Block heights (tile rows) whose transformed values (`floats_a_row` a tile row) fit `budget`
    floats (at least one row), for the planned batch no more rows than it has."""
    most = max(1, min(_MAX_RB, N * k.TH, budget // max(floats_a_row, 1)))
    return list(range(1, most + 1))


def _step_cycles(ob: int, vb: int) -> float:
    """Modelled cycles of one step of an OB x VB GEMM tile (an input channel of the forward, a
    tile of the grad-weight): its FMAs at two a cycle, its VB vector loads (from L2 where the
    tile's slice passes L1) and OB broadcasts, and the loop's own instructions. Fitted to the
    tuner's measurements of airbench's 256x256 14x14 forward on a 2-core Zen 4 (tiles 6x4 .. 2x4
    within 15% of the measured ratios, in the same order but one pair)."""
    return 0.5 * ob * vb + 0.35 * vb + 0.2 * ob + 1.0


#: modelled cycles of a grad-weight block's two team barriers and its running sums' traffic
_GW_BLOCK_CYCLES = 20000.0


def _cost(kind: str, g: ConvGeometry, k: _Correlation, isa: VectorISA, plan: WinogradPlan) -> float:
    """Modelled cycles of a call. Forward and grad-input: the GEMMs' steps over every block (the
    padding of tiles to whole vectors and of channels to whole tiles included), plus streaming
    every point's weights once a block and tile group. Grad-weight: the GEMMs' steps over every
    tile (channels padded), the block's partial sums and channel transposes, plus a block's fixed
    cost."""
    blocks = ceil_div(g.N * k.TH, plan.RB)
    if kind == "conv2d_grad_weight":   # a step: a tile, VB loads, OB broadcasts, OB x VB FMAs
        b = _gw_block(g, isa, plan)
        tiles = (b["OP"] // plan.OB) * (b["CP"] // (plan.VB * isa.lanes))
        sums = plan.OB * plan.VB * (isa.lanes + 2)   # a block's partial sums added in double
        transpose = b["CP"] * b["TBP"] / isa.lanes   # a point's channels made the inner index
        return blocks * (_POSITIONS * (tiles * (plan.RB * k.TW * _step_cycles(plan.OB, plan.VB) + sums) + transpose)
                         + _GW_BLOCK_CYCLES)
    b = _block(k, isa, plan)
    gemm = blocks * _POSITIONS * (b["COP"] // plan.OB) * b["NTG"] * k.CI * _step_cycles(plan.OB, plan.VB)
    weights = blocks * _POSITIONS * k.CI * b["COP"] / isa.lanes * 0.25
    return gemm + weights


def plans(kind: str, g: ConvGeometry, isa: VectorISA, tune: bool = False) -> list[WinogradPlan]:
    """The cost model's plan for a kernel of `kind` (with `tune`, the spread the tuner measures:
    the best-modelled register tiles, and the best tile at other block heights, up to twice the
    cost model's L2 budget)."""
    k = _correlation(kind, g)
    gw = kind == "conv2d_grad_weight"
    # the grad-weight's tile is OB output channels x VB vectors of input channels
    tiles = [(ob, vb) for ob in range(1, 17) for vb in range(1, _MAX_VB + 1)
             if _registers(ob, vb) <= isa.registers and ob <= (g.O if gw else k.CO)
             and (not gw or vb <= ceil_div(g.C, isa.lanes))]
    # transformed values a tile row: V (and the grad-weight's transformed dy)
    a_row = _POSITIONS * k.TW * (k.CI + (g.O if gw else 0))

    def ranked(budget: int) -> list[WinogradPlan]:
        out = [(_cost(kind, g, k, isa, p), p) for ob, vb in tiles for rb in _rows_options(k, g.N, a_row, budget)
               for p in (WinogradPlan(OB=ob, VB=vb, RB=rb),)]
        out.sort(key=lambda t: (t[0], -t[1].RB, t[1].VB, t[1].OB))
        return [p for _, p in out]

    best = ranked(_V_BUDGET * (2 if gw else 1))
    if not tune:
        return best[:1]
    out = [next(p for p in best if (p.OB, p.VB) == t) for t in list(dict.fromkeys((p.OB, p.VB) for p in best))[:TUNE_TILES]]
    top = best[0]
    wider = [p for p in ranked(_V_BUDGET * (4 if gw else 2)) if (p.OB, p.VB) == (top.OB, top.VB) and p.RB > top.RB]
    narrower = [p for p in best if (p.OB, p.VB) == (top.OB, top.VB) and p.RB <= top.RB // 2]
    return list(dict.fromkeys(out + wider[:1] + narrower[:1]))


# --------------------------------------------------------------------------- rendering

def _input_side(k: _Correlation, plan: WinogradPlan, isa: VectorISA) -> dict[str, int]:
    """What the input transform (winograd_input.j2) needs besides the correlation: the even/odd
    rows' pitch XWP and count XR, the padded row's data columns [QLO, QHI), and the floats of a
    thread's row buffers (the padded row, a zero row, the even and odd rows, the vertical sums:
    8 of XWP + VL) with room for a masked output row (2 XWP)."""
    XWP = round_up(k.TW + 1, _ALIGN)    # a whole number of vectors of either variant
    XR = 2 * plan.RB + 2
    qlo = max(0, k.PL)
    return dict(XWP=XWP, XR=XR, QLO=qlo, QHI=max(qlo, min(2 * XWP, k.IW + k.PL)),
                WORK=3 * XWP + 2 * XR * XWP + 8 * (XWP + isa.lanes) + 2 * XWP)


def _ctx(name: str, kind: str, g: ConvGeometry, plan: WinogradPlan, isa: VectorISA) -> tuple[dict[str, Any], _Scratch]:
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    k = _correlation(kind, g)
    _check(name, kind, plan, isa)
    side = _input_side(k, plan, isa)
    common = dict(dataclasses.asdict(k), **side, kind=kind, name=name, OB=plan.OB, VB=plan.VB, RB=plan.RB, TH=k.TH,
                  TW=k.TW, C=g.C, O=g.O, H=g.H, W=g.W, HO=g.HO, WO=g.WO, PH=g.PH, PW=g.PW)
    sc = _Scratch()
    if kind == "conv2d_grad_weight":
        b = _gw_block(g, isa, plan)
        v_pos, w_pos, m_pos = b["CP"] * b["TBP"] + _ALIGN, b["OP"] * b["TBP"] + _ALIGN, b["OP"] * b["CP"] + _ALIGN
        work = round_up(side["WORK"], _ALIGN)
        per_thread = work + isa.lanes * b["TBP"]   # the row buffers, a block of channels being transposed
        sc.add("v", _POSITIONS * v_pos)
        sc.add("wt", _POSITIONS * w_pos)
        sc.add("mw", 2 * _POSITIONS * m_pos)   # doubles
        sc.add("thr", MAX_THREADS * per_thread)
        return dict(common, **b, V_POS=v_pos, W_POS=w_pos, M_POS=m_pos, PER_THREAD=per_thread, WORK_P=work,
                    CKT=_GW_CHUNK, STAGES=_transpose_stages(isa.lanes), off=sc.offsets), sc
    b = _block(k, isa, plan)
    v_pos = k.CI * b["TBP"] + _ALIGN    # a line more: the 16 points' rows are stored at once, no 4K aliasing
    v = round_up(_POSITIONS * v_pos, _ALIGN)
    per_thread = v + _POSITIONS * plan.OB * b["TG"] + plan.OB * 4 * b["TBP"] + side["WORK"]
    sc.add("u", round_up(_POSITIONS * k.CI * b["COP"], _ALIGN))
    sc.add("thr", MAX_THREADS * per_thread)
    return dict(common, **b, V_FLOATS=v, V_POS=v_pos, UCS=round_up(b["COP"], isa.lanes), PER_THREAD=per_thread,
                CK=_CHUNK, off=sc.offsets), sc


def scratch_bytes(kind: str, g: ConvGeometry, plan: WinogradPlan, isa: VectorISA) -> int:
    """Scratch bytes of the kernel under `plan` (ValueError where the plan does not fit)."""
    return _ctx("k", kind, g, plan, isa)[1].nbytes


def render(name: str, kind: str, g: ConvGeometry, plan: WinogradPlan, isa: VectorISA, *, bias: bool = False,
           relu: bool = False, relu_mask: bool = False) -> tuple[KernelSource, list[str | None]]:
    """The kernel and its arguments as roles (None: NULL), the signatures of `cpp_kernels`' templates:
    forward (x, w, bias, out, scratch), grad-input (dy, w, [mask], out, scratch), grad-weight (x,
    dy, out, NULL, scratch); the images N follow as a run-time size. Epilogues: the forward's bias
    and ReLU, the grad-input's ReLU mask."""
    if (bias or relu) and kind != "conv2d" or relu_mask and kind != "conv2d_grad_input":
        raise ValueError(f"the winograd {kind} kernel takes no {'relu_mask' if relu_mask else 'bias/relu'} epilogue")
    ctx, sc = _ctx(name, kind, g, plan, isa)
    if kind == "conv2d_grad_weight":
        code = _render("conv_winograd_gw.j2", isa, **ctx)
        return KernelSource(name, code, sc.nbytes, (g.N,)), ["x", "dy", "out", None, "scratch"]
    code = _render("conv_winograd.j2", isa, bias=bias, relu=relu, relu_mask=relu_mask, **ctx)
    order: list[str | None] = (["x", "w", "bias" if bias else None, "out", "scratch"] if kind == "conv2d" else
                               ["dy", "w", *(["mask"] if relu_mask else []), "out", "scratch"])
    return KernelSource(name, code, sc.nbytes, (g.N,)), order
