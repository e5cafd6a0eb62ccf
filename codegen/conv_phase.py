"""Convolutions over phase planes: any stride and any groups (depthwise included), register-tiled
and vectorised on the CPU. The `phase` family of the CPU choice table (`cpp_choices`); template
`templates/cpp/conv_phase.j2`.

A convolution at stride (SH, SW) is a stride-1 one over SH*SW phase planes of its input: plane
(a, b) holds x[i*SH + a - PH][j*SW + b - PW] (zero outside the image), and tap (kh, kw) reads
plane (kh % SH, kw % SW) shifted by (kh // SH, kw // SW). Each plane is laid out at row pitch
P = WO + ceil(KW/SW) - 1 with R = HO + ceil(KH/SH) - 1 rows, so an output pixel is a flat
position q = oh*P + ow and every tap a compile-time offset from it: the flat register tiles of
the stride-1 kernels (`conv2d_forward.j2`) then serve any stride. Phases that hold no tap are
not copied: a 1x1 convolution at stride 2 becomes a GEMM over the subsampled input.

* forward: tiles of VB vectors of flat positions x OB output channels of one group, summed over
  the taps of the group's input channels; staged and copied out (stored straight into y where
  P == WO);
* grad-input: each phase (a, b) of dx (rows i with (i + PH) % SH == a, columns likewise) is a
  stride-1 correlation of dy with the taps kh = a + SH*t, kw = b + SW*t':
  dx[u*SH + a - PH][v*SW + b - PW] = sum_{o,t,t'} dy[o][u - t][v - t'] w[o][c][a + SH t][b + SW t'],
  computed on one flat grid over a zero-padded copy of dy that all phases share, then
  interleaved back into dx (with the ReLU-mask epilogue); a phase without taps is zero;
* grad-weight: dw[o][c][kh][kw] = sum over images and flat positions of dyp[o][q] *
  plane[c][q + offset(kh, kw)], dyp being dy at pitch P (zero elsewhere): a tile of OB dy
  channels x (CB input channels x TC taps) independent vector accumulators runs over IB images
  stacked in the planes, then adds its lane sums into per-slot partials; min(N, 16) slots of
  images are summed in slot order at the end.

Tasks own output channel blocks of whole images (forward, grad-input) or fixed image slots
(grad-weight), every sum has a fixed order: results do not depend on the thread count. Channel
blocks never cross a group, and a group's tiles read its C/G input channels only.

The images N and the groups G are the kernels' arguments (`KernelSource.extents`), not constants
of their code: one compiled kernel serves every batch size, and any number of groups of the same
channels a group (a batch folded into the groups: `random_translate`'s per-image taps). A plan
stacking more images than a slot gets (a plan of a larger batch) runs short passes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .cpp_kernels import _GW_SLOTS, MAX_THREADS, TUNE_TILES, KernelSource, _conv_tile_costs, _plan_error, _render, \
    _Scratch
from .cpu_vector import VectorISA
from .grouped_conv import CONV_KINDS, ConvGeometry
from .shapes import ceil_div, round_up

__all__ = ["PhasePlan", "plans", "scratch_bytes", "render"]

_ALIGN = 16          # floats: 64-byte aligned regions and channel slots
_MAX_VB = 6          # output vectors a forward / grad-input tile may hold
#: positions a grad-weight pass stacks images up to: each tile adds its lane sums once a pass,
#: so a pass of a few hundred positions keeps that under ~5% of its FMAs, while the stacked
#: planes (C/G channels) stay in L2
_GW_STACK = 1024
#: floats of stacked planes (a thread's, all of a group's channels) the cost model stacks images up to
_GW_PLANES = 128 * 1024


@dataclass(frozen=True)
class PhasePlan:
    """How a `phase` kernel runs. Forward and grad-input: a register tile of VB vectors of output
    positions x OB output channels (grad-input: dx channels). Grad-weight: OB dy channels x
    CB input channels x TC taps of accumulators (CB > 1 only with every tap of a channel), over
    IB images stacked per pass. Unused fields are 0 and left out of the stamped pairs."""
    VB: int = 0
    OB: int = 0
    CB: int = 0
    TC: int = 0
    IB: int = 0

    def pairs(self) -> tuple[tuple[str, int], ...]:
        return tuple((k, v) for k, v in dataclasses.asdict(self).items() if v)


# --------------------------------------------------------------------------- geometry

def _phase_taps(K: int, S: int, a: int) -> list[int]:
    """Kernel offsets (kh) that phase a reads: a, a + S, ..."""
    return list(range(a, K, S))


def _valid(size: int, pad: int, s: int, a: int, limit: int) -> tuple[int, int]:
    """[lo, hi) of phase indices i (< limit) whose source i*s + a - pad lies in 0..size-1."""
    lo = max(0, ceil_div(pad - a, s))
    hi = min(limit, (size - 1 + pad - a) // s + 1)
    return lo, max(lo, hi)


@dataclass(frozen=True)
class _Planes:
    """The x-side phase planes (forward, grad-weight) of `g`: used phases (those holding a tap),
    rows R and pitch P, and each tap's offset once the plane slot PS is known."""
    g: ConvGeometry

    @property
    def khq(self) -> int:
        return ceil_div(self.g.KH, self.g.SH)

    @property
    def kwq(self) -> int:
        return ceil_div(self.g.KW, self.g.SW)

    @property
    def used(self) -> list[tuple[int, int]]:
        return [(a, b) for a in range(min(self.g.SH, self.g.KH)) for b in range(min(self.g.SW, self.g.KW))]

    @property
    def R(self) -> int:
        return self.g.HO + self.khq - 1

    @property
    def P(self) -> int:
        return self.g.WO + self.kwq - 1

    def tap_offsets(self, PS: int) -> list[int]:
        """Offset of every tap (kh, kw in row-major order) from its output's flat position."""
        g, idx = self.g, {p: i for i, p in enumerate(self.used)}
        return [idx[(kh % g.SH, kw % g.SW)] * PS + (kh // g.SH) * self.P + kw // g.SW
                for kh in range(g.KH) for kw in range(g.KW)]

    def copy_ctx(self) -> dict[str, Any]:
        """What the plane copy needs: per used phase its plane index, valid rows and columns."""
        g = self.g
        rows = {a: _valid(g.H, g.PH, g.SH, a, self.R) for a in range(min(g.SH, g.KH))}
        cols = {b: _valid(g.W, g.PW, g.SW, b, self.P) for b in range(min(g.SW, g.KW))}
        bs = sorted(cols)
        # columns [JA, JB) hold data in every used column phase: one deinterleaving pass; the
        # others (HEAD, TAIL of each phase) one phase at a time
        ja = max(cols[b][0] for b in bs)
        jb = max(ja, min(cols[b][1] for b in bs))
        head = {b: (lo, min(hi, ja)) for b, (lo, hi) in cols.items()}
        tail = {b: (max(lo, jb), hi) for b, (lo, hi) in cols.items()}
        return dict(ROWS=rows, COL_PHASES=bs, JA=ja, JB=jb, HEAD=head, TAIL=tail,
                    PIDX={p: i for i, p in enumerate(self.used)})


def _common(g: ConvGeometry, isa: VectorISA) -> dict[str, Any]:
    # no N, C, O or G: the kernels take the images and the groups at run time (`extents`), so one
    # kernel serves every batch size, and a batch folded into the groups (random_translate's
    # per-image taps); the regions of the scratch that grow with G come last
    return dict(H=g.H, W=g.W, KH=g.KH, KW=g.KW, SH=g.SH, SW=g.SW, PH=g.PH, PW=g.PW,
                HO=g.HO, WO=g.WO, CG=g.C // g.G, OG=g.O // g.G)


def _check_tile(name: str, plan: PhasePlan, cout: int, isa: VectorISA) -> None:
    if plan.CB or plan.TC or plan.IB:
        raise _plan_error(name, plan, "a forward or grad-input plan has VB and OB only")
    if not (1 <= plan.OB <= cout and 1 <= plan.VB <= _MAX_VB):
        raise _plan_error(name, plan, f"its tile needs 1 <= OB <= {cout} (channels a group) and 1 <= VB <= {_MAX_VB}")
    if plan.VB * plan.OB + plan.VB + 1 > isa.registers:
        raise _plan_error(name, plan, f"its tile needs {plan.VB * plan.OB + plan.VB + 1} vector registers, "
                                      f"{isa.name} has {isa.registers}")


# --------------------------------------------------------------------------- forward

def _forward_ctx(name: str, g: ConvGeometry, plan: PhasePlan, isa: VectorISA) -> tuple[dict, _Scratch]:
    pl, VL = _Planes(g), isa.lanes
    CG, OG = g.C // g.G, g.O // g.G
    _check_tile(name, plan, OG, isa)
    VB, OB = plan.VB, plan.OB
    P, R = pl.P, pl.R
    Q = (g.HO - 1) * P + g.WO
    T = VB * VL
    NT = ceil_div(Q, T)
    QP = NT * T
    PS = round_up(max(R * P, QP + (pl.khq - 1) * P + pl.kwq - 1), _ALIGN)
    NPH = len(pl.used)
    NOBG = ceil_div(OG, OB)
    NU = g.G * NOBG
    ctx = dict(_common(g, isa), kind="conv2d", VB=VB, OB=OB, P=P, R=R, Q=Q, T=T, NT=NT, QP=QP, PS=PS, NPH=NPH,
               CS=NPH * PS, NOBG=NOBG, NDIRECT=(g.HO * g.WO) // T if P == g.WO else 0,
               TAP_OFF=pl.tap_offsets(PS), **pl.copy_ctx())
    sc = _Scratch()
    per_thread = round_up(CG * NPH * PS, _ALIGN) + OB * QP
    ctx["PER_THREAD"] = per_thread
    sc.add("thr", MAX_THREADS * per_thread)
    sc.add("wk", NU * OB * CG * g.KH * g.KW)
    sc.add("bk", NU * OB)   # the kernel finds it past wk (G at run time)
    return ctx, sc


# --------------------------------------------------------------------------- grad-input

def _gi_grid(g: ConvGeometry) -> dict[str, int]:
    """The grad-input's flat grid: dx phases (a, b) that hold taps, rows u in [U0, U0 + RU) and
    columns v in [V0, V0 + CV) covering all of them, pitch P; the dy copy dyp[r][s] =
    dy[r - RT][s - RL] (DR rows) that every phase reads."""
    khq, kwq = ceil_div(g.KH, g.SH), ceil_div(g.KW, g.SW)
    urange = [_valid(g.H, g.PH, g.SH, a, 1 << 30) for a in range(min(g.SH, g.KH))]
    vrange = [_valid(g.W, g.PW, g.SW, b, 1 << 30) for b in range(min(g.SW, g.KW))]
    U0, V0 = min(lo for lo, _ in urange), min(lo for lo, _ in vrange)
    U1, V1 = max(U0 + 1, *(hi for _, hi in urange)), max(V0 + 1, *(hi for _, hi in vrange))
    RU, CV = U1 - U0, V1 - V0
    P = CV + kwq - 1
    return dict(khq=khq, kwq=kwq, U0=U0, V0=V0, RU=RU, CV=CV, P=P, DR=RU + khq - 1, RT=khq - 1 - U0,
                RL=kwq - 1 - V0, Q=(RU - 1) * P + CV)


def _grad_input_ctx(name: str, g: ConvGeometry, plan: PhasePlan, isa: VectorISA) -> tuple[dict, _Scratch]:
    VL = isa.lanes
    CG, OG = g.C // g.G, g.O // g.G
    _check_tile(name, plan, CG, isa)
    VB, OB = plan.VB, plan.OB
    grid = _gi_grid(g)
    khq, kwq, P, DR, U0, V0, RU, CV, RT, RL = (grid[k] for k in ("khq", "kwq", "P", "DR", "U0", "V0", "RU", "CV",
                                                                 "RT", "RL"))
    Q = (RU - 1) * P + CV
    T = VB * VL
    NT = ceil_div(Q, T)
    QP = NT * T
    DS = round_up(max(DR * P, QP + (khq - 1) * P + kwq - 1), _ALIGN)
    phases = [(a, b) for a in range(min(g.SH, g.KH)) for b in range(min(g.SW, g.KW))]   # those holding taps
    taps = [[(kh, kw) for kh in _phase_taps(g.KH, g.SH, a) for kw in _phase_taps(g.KW, g.SW, b)] for a, b in phases]
    offs = [[(khq - 1 - kh // g.SH) * P + (kwq - 1 - kw // g.SW) for kh, kw in t] for t in taps]
    woff = [OG * OB * sum(len(t) for t in taps[:i]) for i in range(len(taps))]
    pidx = {p: i for i, p in enumerate(phases)}
    # dx columns j = v*SW + b - PW: for v in [VA, VZ) every phase b lands inside the row
    vall = {b: _valid(g.W, g.PW, g.SW, b, 1 << 30) for b in range(g.SW)}
    VA = max(lo for lo, _ in vall.values())
    VZ = max(VA, min(hi for _, hi in vall.values()))
    JH = min(g.W, max(0, VA * g.SW - g.PW))            # dx columns before the interleaved run
    JT = max(JH, min(g.W, VZ * g.SW - g.PW))           # and after it
    ZLEN = round_up(max(hi for _, hi in vall.values()) + 1, _ALIGN)   # the zero row of tapless phases
    NCB = ceil_div(CG, OB)
    NU = g.G * NCB
    ctx = dict(_common(g, isa), kind="conv2d_grad_input", VB=VB, OB=OB, P=P, U0=U0, V0=V0, RU=RU, CV=CV, DR=DR,
               RT=RT, RL=RL, Q=Q, T=T, NT=NT, QP=QP, DS=DS, NPH=len(phases), PHASES=phases, PTAPS=taps, POFF=offs,
               PKK=[[kh * g.KW + kw for kh, kw in t] for t in taps], PWOFF=woff, VA=VA, VZ=VZ, JH=JH, JT=JT, ZLEN=ZLEN, NCB=NCB,
               PT_OF=[[pidx.get((a, b), -1) for b in range(g.SW)] for a in range(g.SH)])
    sc = _Scratch()
    per_thread = round_up(OG * DS, _ALIGN) + len(phases) * OB * QP + ZLEN
    ctx["PER_THREAD"] = per_thread
    sc.add("thr", MAX_THREADS * per_thread)
    sc.add("wk", NU * OB * OG * g.KH * g.KW)
    return ctx, sc


# --------------------------------------------------------------------------- grad-weight

def _gw_limits(g: ConvGeometry) -> tuple[int, int]:
    """(slots, most images a slot holds)."""
    S = min(g.N, _GW_SLOTS)
    return S, ceil_div(g.N, S)


def _grad_weight_ctx(name: str, g: ConvGeometry, plan: PhasePlan, isa: VectorISA) -> tuple[dict, _Scratch]:
    pl, VL = _Planes(g), isa.lanes
    CG, OG = g.C // g.G, g.O // g.G
    TPC = g.KH * g.KW
    OB, CB, TC, IB = plan.OB, plan.CB, plan.TC, plan.IB
    if plan.VB:
        raise _plan_error(name, plan, "a grad-weight plan has no VB")
    # IB may exceed the images a slot holds (a plan of a larger batch: the kernel's passes are then
    # short), not the stack the cost model allows any batch
    ib_max = max(1, _GW_STACK // (pl.R * pl.P))
    if not (1 <= OB <= OG and 1 <= IB <= ib_max and 1 <= TC <= TPC and 1 <= CB <= CG and (CB == 1 or TC == TPC)):
        raise _plan_error(name, plan, f"it needs 1 <= OB <= {OG}, 1 <= IB <= {ib_max}, 1 <= TC <= {TPC}, "
                                      f"1 <= CB <= {CG} and CB > 1 only with TC = {TPC}")
    X = CB * TC
    if OB * X + X + 1 > isa.registers:
        raise _plan_error(name, plan, f"its tile needs {OB * X + X + 1} vector registers, {isa.name} has "
                                      f"{isa.registers}")
    P, R = pl.P, pl.R
    LQ = IB * R * P
    NV = ceil_div(LQ, VL)
    PS = round_up(NV * VL + (pl.khq - 1) * P + pl.kwq - 1, _ALIGN)
    DS = round_up(NV * VL, _ALIGN)
    NPH = len(pl.used)
    NOBG = ceil_div(OG, OB)
    if TC == TPC:    # chunks of CB channels, every tap
        chunks = [(c0, min(CB, CG - c0), 0, TPC) for c0 in range(0, CG, CB)]
    else:            # one channel, chunks of TC taps
        chunks = [(-1, 1, k0, min(TC, TPC - k0)) for k0 in range(0, TPC, TC)]
    ctx = dict(_common(g, isa), kind="conv2d_grad_weight", OB=OB, CB=CB, TC=TC, IB=IB, SLOTS=_GW_SLOTS, P=P, R=R,
               LQ=LQ, NV=NV,
               PS=PS, DS=DS, NPH=NPH, CS=NPH * PS, NOBG=NOBG, TPC=TPC, CHUNKS=chunks,
               TAP_OFF=pl.tap_offsets(PS), **pl.copy_ctx())
    sc = _Scratch()
    per_thread = round_up(CG * NPH * PS, _ALIGN) + OG * DS
    ctx["PER_THREAD"] = per_thread
    sc.add("thr", MAX_THREADS * per_thread)
    sc.add("dw", _GW_SLOTS * g.O * CG * TPC)  # min(N, SLOTS) slots at run time: room for SLOTS
    return ctx, sc


_CTX = {"conv2d": _forward_ctx, "conv2d_grad_input": _grad_input_ctx, "conv2d_grad_weight": _grad_weight_ctx}


# --------------------------------------------------------------------------- the cost model

def _grid(g: ConvGeometry, kind: str) -> tuple[int, int]:
    """(flat output positions Q, output channels a group) of a forward or grad-input kernel."""
    if kind == "conv2d":
        pl = _Planes(g)
        return (g.HO - 1) * pl.P + g.WO, g.O // g.G
    return _gi_grid(g)["Q"], g.C // g.G


def _gw_step(ob: int, x: int) -> float:
    """Modelled cycles of one vector step of an ob x x grad-weight tile: ob*x FMAs at 2 a cycle, or
    its x + ob loads at 1 a cycle, whichever binds (streaming loads measured about half as fast as
    FMAs: (OB 2, 9 taps) ran 1.7x faster than (OB 25, 1 tap), whose loads match its FMAs), plus a
    small per-load term for ties."""
    return max(ob * x / 2, x + ob) + 0.01 * (x + ob)


def _gw_cost(g: ConvGeometry, isa: VectorISA, ob: int, cb: int, tc: int, ib: int) -> float:
    """Modelled cycles per image of a grad-weight plan: every tile's vector steps over a pass of
    ib stacked images and its lane sums (about a cycle an accumulator) once a pass."""
    pl = _Planes(g)
    CG, OG, TPC = g.C // g.G, g.O // g.G, g.KH * g.KW
    nv = ceil_div(ib * pl.R * pl.P, isa.lanes)
    obs = [min(ob, OG - o) for o in range(0, OG, ob)]
    xs = [min(cb, CG - c) * TPC for c in range(0, CG, cb)] if tc == TPC else \
        [min(tc, TPC - k) for k in range(0, TPC, tc)] * CG
    per_pass = sum(nv * _gw_step(o, x) + o * x for o in obs for x in xs)
    return g.G * per_pass / ib


def _gw_plans(g: ConvGeometry, isa: VectorISA, tune: bool) -> list[PhasePlan]:
    S, IMAX = _gw_limits(g)
    pl = _Planes(g)
    CG, OG, TPC = g.C // g.G, g.O // g.G, g.KH * g.KW
    plane = pl.R * pl.P
    ib_best = max(1, min(IMAX, _GW_STACK // plane, _GW_PLANES // (CG * len(pl.used) * plane)))
    tiles = []
    for tc in range(1, TPC + 1):
        for cb in (range(1, CG + 1) if tc == TPC else (1,)):
            x = cb * tc
            if x + 2 > isa.registers:
                break
            for ob in range(1, OG + 1):
                if ob * x + x + 1 > isa.registers:
                    break
                tiles.append((_gw_cost(g, isa, ob, cb, tc, ib_best), ob, cb, tc))
    tiles.sort()
    best = [PhasePlan(OB=ob, CB=cb, TC=tc, IB=ib_best) for _, ob, cb, tc in tiles]
    if not tune:
        return best[:1]
    out = best[:TUNE_TILES] + [dataclasses.replace(best[0], IB=ib) for ib in (1, IMAX)]
    return list(dict.fromkeys(out))


def plans(kind: str, g: ConvGeometry, isa: VectorISA, tune: bool = False) -> list[PhasePlan]:
    """The plans of a `phase` kernel of `kind`: the cost model's alone, or with `tune` the spread the
    tuner measures (the best-modelled register tiles; grad-weight: and other image stacks)."""
    if kind not in CONV_KINDS:
        raise ValueError(f"no convolution kernel kind {kind!r}")
    if kind == "conv2d_grad_weight":
        return _gw_plans(g, isa, tune)
    Q, cout = _grid(g, kind)
    ranked = sorted((c, vb, ob) for c, vb, ob in _conv_tile_costs(isa, "flat", 0, cout, Q) if vb <= _MAX_VB)
    tiles = list(dict.fromkeys(PhasePlan(VB=vb, OB=ob) for _, vb, ob in ranked))
    return tiles[:TUNE_TILES + 1 if tune else 1]


# --------------------------------------------------------------------------- rendering

def _ctx(name: str, kind: str, g: ConvGeometry, plan: PhasePlan, isa: VectorISA) -> tuple[dict, _Scratch]:
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    if kind not in _CTX:
        raise ValueError(f"no convolution kernel kind {kind!r}")
    ctx, sc = _CTX[kind](name, g, plan, isa)
    ctx.update(name=name, off=sc.offsets)
    return ctx, sc


def scratch_bytes(kind: str, g: ConvGeometry, plan: PhasePlan, isa: VectorISA) -> int:
    """Scratch bytes of the kernel under `plan` (ValueError where the plan does not fit)."""
    return _ctx("k", kind, g, plan, isa)[1].nbytes


def render(name: str, kind: str, g: ConvGeometry, plan: PhasePlan, isa: VectorISA, *, bias: bool = False,
           relu: bool = False, relu_mask: bool = False) -> tuple[KernelSource, list[str | None]]:
    """The kernel and its arguments as roles (None: NULL), the signatures of `cpp_kernels`' templates:
    forward (x, w, bias, out, scratch), grad-input (dy, w, [mask], out, scratch), grad-weight
    (x, dy, out, NULL, scratch). Epilogues: the forward's bias and ReLU, the grad-input's ReLU mask."""
    if (bias or relu) and kind != "conv2d" or relu_mask and kind != "conv2d_grad_input":
        raise ValueError(f"the phase {kind} kernel takes no {'relu_mask' if relu_mask else 'bias/relu'} epilogue")
    ctx, sc = _ctx(name, kind, g, plan, isa)
    code = _render("conv_phase.j2", isa, bias=bias, relu=relu, relu_mask=relu_mask, **ctx)
    order: list[str | None] = {"conv2d": ["x", "w", "bias" if bias else None, "out", "scratch"],
                               "conv2d_grad_input": ["dy", "w", *(["mask"] if relu_mask else []), "out", "scratch"],
                               "conv2d_grad_weight": ["x", "dy", "out", None, "scratch"]}[kind]
    return KernelSource(name, code, sc.nbytes, (g.N, g.G)), order

