"""Renderers for the hot CPU kernels: convolution (forward, grad-input, grad-weight) and matmul.

Each ``render_*`` function turns a static shape into C++17 source for one ``static void NAME(...)``
function (the templates live in ``templates/cpp/``) and reports how much scratch memory the
function needs. The caller (the step's translation unit) owns the scratch buffer: one 64-byte
aligned block of at least ``scratch_bytes`` bytes, which the kernel may overwrite freely.

Contract shared by every kernel here:

* layouts are the user's: activations NCHW, conv weights OIHW, Linear weights (out, in), all
  row-major and contiguous; outputs are fully overwritten;
* all loop bounds are compile-time constants; OpenMP parallelises over a fixed static partition
  and every output element is owned by one task, so results are bit-identical run to run and do
  not depend on the number of threads (grad-weight sums fixed per-slot partials in a fixed order);
* no allocation in the call, no global state; a kernel may appear several times in one
  translation unit under different names (helpers live in ``namespace ember_k_<NAME>``, the
  shared vector prelude is include-guarded).

Vector code uses GCC vector extensions (``vf`` = VL x fp32, ``cpu_vector``): every renderer takes
an ``isa`` (default: ``cpu_vector.resolve()``, i.e. $EMBER_CPU_VECTOR or what -march=native
reaches) that sets the vector width (8 lanes for avx2, 16 for avx512) and the register file the
register tiles fill (16 or 32 registers). The 8-lane source compiles for any GCC target (a ymm
register with AVX2, two xmm registers or scalars elsewhere); the 16-lane one needs AVX-512F.
FMA is explicit (``vfma``: ``_mm256_fmadd_ps`` / ``_mm512_fmadd_ps``), so it does not depend on
``-ffp-contract``. A kernel's arithmetic order depends on the variant (lanes partition the
reductions differently), never on the thread count.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .cpu_vector import VectorISA, resolve
from .shapes import ceil_div, check_positive, pair, round_up
from .templates_env import environment

__all__ = [
    "KernelSource", "MAX_THREADS", "vec_prelude",
    "render_conv2d_forward", "render_conv2d_grad_input", "render_conv2d_grad_weight",
    "render_matmul", "ConvPlan", "DotPlan", "AxpyPlan", "conv_plans", "matmul_plans", "conv_scratch_bytes",
    "matmul_scratch_bytes",
]

#: Kernels clamp their OpenMP team to this many threads; per-thread scratch is sized for it.
MAX_THREADS = 16
#: work (elements, or multiply-adds) below which starting the OpenMP team costs more than it saves:
#: one fact of the CPU's team, read by every CPU renderer that decides whether a loop runs in parallel
PARALLEL_MIN = 32768
#: Alignment (in floats) of every sub-buffer carved out of the scratch block: 64 bytes.
_ALIGN = 16
#: Number of per-slot partial sums grad-weight reduces over (fixed: independent of threads).
_GW_SLOTS = 16

@dataclass(frozen=True)
class KernelSource:
    name: str            # the C function name
    code: str            # C++17 source defining ``static void name(...)`` (plus helpers)
    scratch_bytes: int   # size of the 64-byte aligned scratch block the kernel needs (may be 0)
    #: the sizes the code takes at run time rather than holding them (the images of a
    #: convolution, the rows of a matmul...), passed in this order after the scratch pointer as
    #: int64_t: so one compiled kernel serves every batch size (each call passes its own)
    extents: tuple[int, ...] = ()


@functools.cache
def vec_prelude(isa: VectorISA) -> str:
    """The shared vector helpers for ``isa`` (namespace ``ember_cpu<lanes>``). Include-guarded per
    width, so any number of kernels, of either width, can sit in one translation unit."""
    L = isa.lanes
    halves = [L >> k for k in range(1, L.bit_length())]           # L/2, ..., 2, 1
    hadd = [[4 * (j // 4) + (2 * (j % 4) + o if j % 4 < 2 else L + 2 * (j % 4 - 2) + o) for j in range(L)]
            for o in (0, 1)]                                       # vhadd's two shuffles
    return _env.get_template("vec_prelude.j2").render(
        VL=L, halves=halves, swap={h: [lane ^ h for lane in range(L)] for h in halves},
        hadd_lo=hadd[0], hadd_hi=hadd[1]).strip("\n")


_env = environment("cpp")


def _render(template: str, isa: VectorISA, **ctx) -> str:
    return _env.get_template(template).render(prelude=vec_prelude(isa), VL=isa.lanes, REGS=isa.registers,
                                              NS=f"ember_cpu{isa.lanes}", ISA=isa.name,
                                              MAX_THREADS=MAX_THREADS, **ctx)


def _check_name(name: str) -> None:
    if not name.isidentifier():
        raise ValueError(f"kernel name {name!r} is not a C identifier")




class _Scratch:
    """Carves named, 64-byte aligned float regions out of one scratch block."""

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self.total = 0

    def add(self, key: str, floats: int) -> None:
        self.offsets[key] = self.total
        self.total += round_up(max(int(floats), 0), _ALIGN)

    @property
    def nbytes(self) -> int:
        return 4 * self.total


# --------------------------------------------------------------------------- convolution

def _conv_out(H, W, KH, KW, sh, sw, ph, pw):
    HO = (H + 2 * ph - KH) // sh + 1
    WO = (W + 2 * pw - KW) // sw + 1
    if HO < 1 or WO < 1:
        raise ValueError(f"empty convolution output ({HO}x{WO}) for input {H}x{W}, kernel {KH}x{KW}")
    return HO, WO


def _flat_pitch(WO: int, WI: int, KW: int, PL: int) -> int:
    """Row pitch of the zero-padded copy used by the stride-1 "flat" convolutions.

    Output position q = oh*P + ow reads the copy at q + kh*P + kw, i.e. column s = ow + kw of
    row oh + kh, and s may run past P into the next row, where it must land on that row's
    left zero padding (s - P < PL). So rows may share their padding: P >= WO + KW - 1 - PL,
    and P >= PL + WI for the data, P >= WO for the outputs. For the MNIST grad-input (dy 24
    wide, padded by 2, dx 26 wide) that is 26 instead of 28, so no column is computed in vain.
    """
    if PL < 0:          # input cropped on the left (grad-input with padding > KW - 1)
        return WO + KW - 1
    return max(WO, PL + WI, WO + KW - 1 - PL)


# --------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class ConvPlan:
    """How a convolution kernel runs: what the CPU choice table (`cpp_choices`) stamps; a renderer
    given none takes the cost model's (`conv_plans(...)[0]`).

    ``mode``: the forward and the stride-1 grad-input ``row``, ``flat`` or ``generic`` (see
    `_direct_ctx`); the grad-input also ``scatter`` (any stride); the grad-weight ``row``,
    ``flat`` or ``generic``. ``VB`` x ``OB``: the register tile of the tiled modes (VB vectors of
    output pixels x OB output channels; the grad-weight's is OB channels x KW taps, VB unused),
    0 in the modes without one. ``IB``: the flat grad-weight's images per block, summed by each
    tile before its lanes are reduced (0: one image, as plans stamped before it existed)."""
    mode: str
    VB: int = 0
    OB: int = 0
    IB: int = 0


@dataclass(frozen=True)
class DotPlan:
    """A matmul in the dot form (see `render_matmul`): MR x NR register tile, k in chunks of KC
    (a multiple of the vector width), threads split the columns (``split_cols``) or the rows,
    ``parallel``: in an OpenMP region (else on the calling thread)."""
    MR: int
    NR: int
    KC: int
    split_cols: bool
    parallel: bool


@dataclass(frozen=True)
class AxpyPlan:
    """A matmul in the axpy form: MR rows x NV vectors register tile, column blocks of BT tiles,
    B packed into per-thread panels (``pack``, required when B is transposed) or read in place,
    ``parallel`` as for `DotPlan`."""
    MR: int
    NV: int
    BT: int
    pack: bool
    parallel: bool


MatmulPlan = DotPlan | AxpyPlan
#: the most rows a matmul's register tile may have (the templates split a shorter last row tile)
_MAX_MR = 16
#: the tuner measures the cost model's plan and, per mode or form, this many more register tiles
#: (the best-modelled ones): the model orders tiles well but misjudges close calls
TUNE_TILES = 6


def _plan_error(what: str, plan, why: str) -> ValueError:
    return ValueError(f"{what}: plan {plan} does not fit: {why}")


# --------------------------------------------------------------------------- convolution

def _conv_tap_cost(vb: int, ob: int) -> float:
    """Modelled cycles of one tap of a VB x OB conv tile: VB*OB FMAs and VB loads + OB
    broadcasts, 2 of each per cycle, whichever binds (a small per-load term breaks ties)."""
    return max(vb * ob, vb + ob) / 2 + 0.01 * (vb + ob)


def _conv_tile_costs(isa: VectorISA, mode: str, NV: int, CO: int, Q: int) -> list[tuple[float, int, int]]:
    """(modelled cycles, VB, OB) of every register tile that fits the register file, over the
    whole output: zero padding of the channels (CO up to NOB*OB) and of the pixels (Q up to whole
    tiles) included."""
    out = []
    for vb in range(1, 7):
        if mode == "row" and vb > NV:
            break
        for ob in range(1, 17):
            if vb * ob + vb + 1 > isa.registers:
                break
            obc = min(ob, CO)
            if mode == "row":
                nvb, vbr = divmod(NV, vb)
                per_block = nvb * _conv_tap_cost(vb, obc) + (_conv_tap_cost(vbr, obc) if vbr else 0.0)
            else:
                per_block = ceil_div(Q, vb * isa.lanes) * _conv_tap_cost(vb, obc)
            out.append((ceil_div(CO, obc) * per_block, vb, obc))
    return out


def _conv_tile(isa: VectorISA, mode: str, NV: int, CO: int, Q: int) -> tuple[int, int]:
    """(VB, OB) register tile of the direct convolution: VB vectors of pixels x OB channels,
    VB*OB accumulators + VB inputs + 1 broadcast <= the register file.

    16 registers (AVX2): the measured choice, (3,4) (16 registers, ~90% of FMA peak on one Zen 3
    core; (2,6) and (2,5) reached 80-85%, (1,8) ~70%), fewer vectors only where a row is
    narrower. 32 registers (AVX-512): the tile with the fewest modelled cycles (_conv_tile_costs);
    for the MNIST conv2 (CO = 32, Q = 622) that is (3,8): 28 registers, 11 loads per 24 FMAs, no
    channel padding."""
    if isa.registers <= 16:
        VB = min(3, NV) if mode == "row" else 3
        return VB, min({1: 8, 2: 6, 3: 4}[VB], CO)
    best: tuple[float, int, int] | None = None
    for cost, vb, ob in _conv_tile_costs(isa, mode, NV, CO, Q):
        if best is None or cost < best[0] - 1e-9:
            best = (cost, vb, ob)
    assert best is not None
    return best[1], best[2]


@dataclass(frozen=True)
class _Direct:
    """A convolution as conv2d_forward.j2 computes it: out[n,o,oh,ow] = sum_{c,kh,kw}
    in[n,c,oh*SH-PT+kh, ow*SW-PL+kw] * wt[o,c,kh,kw], where wt is w (OIHW) or, with ``flip``, w
    read as (C,O,KH,KW) and spatially flipped (the grad-input of a stride-1 convolution)."""
    N: int
    CI: int
    CO: int
    HI: int
    WI: int
    HO: int
    WO: int
    KH: int
    KW: int
    SH: int
    SW: int
    PT: int
    PL: int
    flip: bool
    allow_row: bool

    @property
    def pitch(self) -> int:
        return _flat_pitch(self.WO, self.WI, self.KW, self.PL)

    def modes(self, isa: VectorISA) -> list[str]:
        """The modes that can compute it, the cost model's first:
          row   - stride-1 in W, no padding, WO % VL == 0: reads the input rows in place;
          flat  - stride 1: the image is copied (zero-padded, row pitch P = WO+KW-1) into a
                  per-thread buffer and output pixels are tiled on the flattened (oh*P + ow) grid,
                  so 26-wide outputs waste WO/P (7%) instead of 19% with 32-wide rows;
          generic - any stride: plain loops over a clipped column range (they vectorise), not register-tiled.
        """
        modes = []
        if self.allow_row and self.SW == 1 and self.PT == 0 and self.PL == 0 and self.WO % isa.lanes == 0 \
                and (self.HO - 1) * self.SH + self.KH <= self.HI and self.WO + self.KW - 1 <= self.WI:
            modes.append("row")
        if self.SH == 1 and self.SW == 1:
            modes.append("flat")
        return modes + ["generic"]

    def tile_args(self, isa: VectorISA, mode: str) -> tuple[int, int, int]:
        """(NV, CO, Q) of `_conv_tile` for a tiled mode."""
        return self.WO // isa.lanes, self.CO, (self.HO - 1) * self.pitch + self.WO

    def plans(self, isa: VectorISA, tune: bool) -> list[ConvPlan]:
        plans = []
        for mode in self.modes(isa):
            if mode == "generic":
                plans.append(ConvPlan("generic"))
                continue
            plans.append(ConvPlan(mode, *_conv_tile(isa, mode, *self.tile_args(isa, mode))))
            if tune:
                ranked = sorted(_conv_tile_costs(isa, mode, *self.tile_args(isa, mode)), key=lambda c: c[0])
                tiles = list(dict.fromkeys((vb, ob) for _, vb, ob in ranked))[:TUNE_TILES]
                plans += [ConvPlan(mode, vb, ob) for vb, ob in tiles]
        plans = list(dict.fromkeys(plans))
        return plans if tune else plans[:1]


def _forward_direct(N, C, H, W, O, KH, KW, sh, sw, ph, pw, HO, WO) -> _Direct:
    return _Direct(N=N, CI=C, CO=O, HI=H, WI=W, HO=HO, WO=WO, KH=KH, KW=KW, SH=sh, SW=sw, PT=ph, PL=pw,
                   flip=False, allow_row=True)


def _grad_input_direct(N, C, H, W, O, KH, KW, ph, pw, HO, WO) -> _Direct:
    """The stride-1 grad-input: a forward convolution of dy padded by (KH-1-ph, KW-1-pw) with the
    transposed, flipped weights."""
    return _Direct(N=N, CI=O, CO=C, HI=HO, WI=WO, HO=H, WO=W, KH=KH, KW=KW, SH=1, SW=1, PT=KH - 1 - ph,
                   PL=KW - 1 - pw, flip=True, allow_row=False)


def _direct_ctx(name: str, d: _Direct, plan: ConvPlan, *, bias: bool, relu: bool,
                isa: VectorISA) -> tuple[dict, _Scratch]:
    """Context and scratch of conv2d_forward.j2 computing `d` with `plan` (one of `d.modes`)."""
    if plan.mode not in d.modes(isa):
        raise _plan_error(name, plan, f"mode {plan.mode!r} is not one of {d.modes(isa)} here")
    mode, VL = plan.mode, isa.lanes
    CI, CO, HI, WI, HO, WO, KH, KW = d.CI, d.CO, d.HI, d.WI, d.HO, d.WO, d.KH, d.KW
    PT = d.PT
    # N is no part of the code: the kernel takes it at run time (`KernelSource.extents`)
    ctx = dict(name=name, CI=CI, CO=CO, HI=HI, WI=WI, HO=HO, WO=WO, KH=KH, KW=KW,
               SH=d.SH, SW=d.SW, PT=PT, PL=d.PL, bias=bool(bias), relu=bool(relu), flip=d.flip,
               mode=mode, relu_mask=False)
    sc = _Scratch()
    if mode == "generic":
        ctx.update(VB=1, OB=1, NOB=CO)
        return ctx, sc
    # Register tile: VB vectors of VL output pixels x OB output channels. The loop body loads
    # VB input vectors, broadcasts OB weights and issues VB*OB FMAs (see _conv_tile).
    VB, OB = plan.VB, plan.OB
    if not (1 <= OB <= CO and 1 <= VB <= (WO // VL if mode == "row" else 16)):
        raise _plan_error(name, plan, f"its tile needs 1 <= OB <= {CO} and 1 <= VB"
                                      f"{f' <= {WO // VL} (vectors a row)' if mode == 'row' else ''}")
    P = d.pitch                               # padded row pitch (flat mode)
    NOB = ceil_div(CO, OB)
    ctx.update(VB=VB, OB=OB, NOB=NOB)
    sc.add("wk", NOB * OB * CI * KH * KW)     # weights repacked [ob][c][kh][kw][OB], zero-padded
    sc.add("bk", NOB * OB)                    # bias padded to NOB*OB
    if mode == "row":
        NVB, VBR = divmod(WO // VL, VB)       # full vector blocks per row, remainder vectors
        ctx.update(NVB=NVB, VBR=VBR)
    else:
        HP = HO + KH - 1                      # padded rows
        Q = (HO - 1) * P + WO                 # flat output positions that hold real pixels
        T = VB * VL
        NT = ceil_div(Q, T)
        QP = NT * T
        # every load in[c*CSP + q + kh*P + kw] with q < QP must be inside the channel's slot
        CSP = round_up(max(HP * P, QP + (KH - 1) * P + KW - 1), _ALIGN)
        ctx.update(P=P, HP=HP, Q=Q, T=T, NT=NT, QP=QP, CSP=CSP)
        # Tiles near the top and bottom read zero padding rows for some kh: each tile gets the
        # kh range that can reach data (zero-padding taps skipped; 7% of the FMAs for the
        # MNIST grad-input). One tile variant per distinct range, so only for small KH.
        r_lo, r_hi = max(PT, 0), min(PT + HI, HP)      # padded rows holding input data
        ranges = []
        for q in range(NT):
            r0 = min(q * T // P, HO - 1)
            r1 = min((q * T + T - 1) // P, HO - 1)
            lo, hi = max(0, r_lo - r1), min(KH, r_hi - r0)
            ranges.append((lo, max(lo, hi)))
        combos = sorted(set(ranges))
        if KH > 5 or combos == [(0, KH)]:
            combos, ranges = [(0, KH)], [(0, KH)] * NT
        ctx.update(KH_COMBOS=combos, KH_RANGE=[combos.index(r) for r in ranges])
        per_thread = round_up(CI * CSP, _ALIGN) + round_up(OB * QP, _ALIGN)
        ctx["PER_THREAD"] = per_thread
        sc.add("thr", MAX_THREADS * per_thread)
    return ctx, sc


def _conv_geometry(name: str, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                   stride, padding) -> tuple[int, int, int, int, int, int]:
    """Validates a convolution's arguments; returns (sh, sw, ph, pw, HO, WO)."""
    _check_name(name)
    check_positive(N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW)
    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding")
    if sh < 1 or sw < 1 or ph < 0 or pw < 0:
        raise ValueError("stride must be >= 1 and padding >= 0")
    HO, WO = _conv_out(H, W, KH, KW, sh, sw, ph, pw)
    return sh, sw, ph, pw, HO, WO


def _gw_modes(sh: int, sw: int, ph: int, pw: int, WO: int, VL: int) -> list[str]:
    """The grad-weight's modes, the cost model's first: row (x and dy read in place), flat
    (stride 1: zero-padded copies), generic (any stride, one task per (o, c), not tiled)."""
    modes = ["row"] if sw == 1 and ph == 0 and pw == 0 and WO % VL == 0 else []
    return modes + (["flat"] if sh == 1 and sw == 1 else []) + ["generic"]


def _gw_max_ob(O: int, KW: int, isa: VectorISA) -> int:
    # Register tile: OB output channels x KW taps of one (c, kh), vectorised along the pixels
    # being reduced. Per step: KW input vectors + 1 dy vector live, OB*KW accumulators:
    # OB*KW + KW + 1 <= registers (3x3: OB = 4 of 16 ymm, 8 of 32 zmm).
    return min(O, max(1, (isa.registers - KW - 1) // KW))


#: The flat grad-weight's image blocks: a tile sums at least this many vectors of pixels before
#: its lanes are reduced (a 16-wide lane reduction of OB*KW accumulators costs about as much as
#: one vector of FMAs for each), and what a channel block's pass re-reads (the block's x copies)
#: stays within a core's L2 (1-2 MiB on the x86 CPUs ember runs on).
_GW_MIN_VECTORS = 16
_GW_BLOCK_BYTES = 1024 * 1024
_GW_IMAGE_BLOCKS = (1, 2, 4, 8)
_GW_PARTIAL_BYTES = 4 * 1024 * 1024


def _gw_slots(NOB: int, slot_floats: int) -> int:
    """Image slots of the tiled grad-weight: _GW_SLOTS, fewer where the partials would pass over
    more than _GW_PARTIAL_BYTES (zeroing and adding SLOTS copies of a large dw cost more than
    its FMAs on a small plane: airbench's 256x256 7x7 grad-weight), but never so few that the
    largest team lacks two tasks a thread (slots x channel blocks)."""
    by_bytes = max(1, _GW_PARTIAL_BYTES // (4 * slot_floats))
    return min(_GW_SLOTS, max(by_bytes, ceil_div(2 * MAX_THREADS, NOB)))


def _gw_flat(C: int, W: int, O: int, KH: int, KW: int, pw: int, HO: int, WO: int, OB: int,
             isa: VectorISA) -> dict[str, int]:
    """The flat grad-weight's padded layout (per image): pitch, positions, channel strides."""
    VL = isa.lanes
    P = _flat_pitch(WO, W, KW, pw)
    HP = HO + KH - 1
    Q = (HO - 1) * P + WO
    QP = round_up(Q, VL)
    CSP = round_up(max(HP * P, QP + (KH - 1) * P + KW - 1), _ALIGN)
    OBG = ceil_div(O, OB) * OB                        # channels per group (a team of one: every block)
    QPA = round_up(QP, _ALIGN)
    return dict(P=P, HP=HP, Q=Q, QP=QP, QPA=QPA, CSP=CSP, OBG=OBG, XIMG=round_up(C * CSP, _ALIGN))


def _gw_blocks(f: dict[str, int], ob: int, isa: VectorISA) -> list[int]:
    """Image-block sizes that fit the L2 budget (at least 1), the cost model's first: the
    smallest that gives a tile _GW_MIN_VECTORS vectors."""
    # what one channel block's pass reads again and again: the block's x copies and its OB dy channels
    fits = [ib for ib in _GW_IMAGE_BLOCKS if ib == 1 or ib * (f["XIMG"] + ob * f["QPA"]) * 4 <= _GW_BLOCK_BYTES]
    nv = f["QP"] // isa.lanes
    best = next((ib for ib in fits if ib * nv >= _GW_MIN_VECTORS), fits[-1])
    return [best] + [ib for ib in fits if ib != best]


def _conv_plans(kind: str, name: str, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride, padding,
                isa: VectorISA, tune: bool) -> list[ConvPlan]:
    sh, sw, ph, pw, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if kind == "conv2d":
        return _forward_direct(N, C, H, W, O, KH, KW, sh, sw, ph, pw, HO, WO).plans(isa, tune)
    if kind == "conv2d_grad_input":
        direct = _grad_input_direct(N, C, H, W, O, KH, KW, ph, pw, HO, WO).plans(isa, tune) \
            if sh == 1 and sw == 1 else []
        return (direct + [ConvPlan("scatter")])[:None if tune else 1]
    if kind != "conv2d_grad_weight":
        raise ValueError(f"no convolution kernel kind {kind!r}")
    plans = []
    for mode in _gw_modes(sh, sw, ph, pw, WO, isa.lanes):
        if mode == "generic":
            plans.append(ConvPlan("generic"))
            continue
        top = _gw_max_ob(O, KW, isa)
        obs = [min(8, top)]
        if tune:
            obs += [top, ceil_div(O, ceil_div(O, top)), max(1, top // 2), max(1, top // 4)]
        if mode != "flat":
            plans += [ConvPlan(mode, 0, ob) for ob in obs]
            continue
        for i, ob in enumerate(obs):  # each tile at the model's block; the first tile at the others too
            blocks = _gw_blocks(_gw_flat(C, W, O, KH, KW, pw, HO, WO, ob, isa), ob, isa)
            plans += [ConvPlan(mode, 0, ob, 0 if ib == 1 else ib) for ib in (blocks if i == 0 else blocks[:1])]
    plans = list(dict.fromkeys(plans))
    return plans if tune else plans[:1]


def conv_plans(kind: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride=(1, 1),
               padding=(0, 0), isa: VectorISA | None = None, tune: bool = False) -> list[ConvPlan]:
    """The plans of a convolution kernel of `kind` ("conv2d", "conv2d_grad_input",
    "conv2d_grad_weight"): the cost model's alone, or with `tune` the spread the tuner measures
    (every mode that applies, each tiled mode's cost-model tile and its best-modelled others)."""
    return _conv_plans(kind, "conv", N, C, H, W, O, KH, KW, stride, padding, isa or resolve(), tune)


def _conv_ctx(kind: str, name: str, *, N, C, H, W, O, KH, KW, stride, padding, isa: VectorISA,
              plan: ConvPlan | None, bias: bool = False, relu: bool = False,
              relu_mask: bool = False) -> tuple[str, dict, _Scratch]:
    """(template, context, scratch) of a convolution kernel of `kind` under `plan` (None: the cost model's)."""
    sh, sw, ph, pw, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if plan is None:
        plan = _conv_plans(kind, name, N, C, H, W, O, KH, KW, stride, padding, isa, False)[0]
    if plan.IB and kind != "conv2d_grad_weight":
        raise _plan_error(name, plan, "image blocks (IB) are the flat grad-weight's")
    if kind == "conv2d":
        d = _forward_direct(N, C, H, W, O, KH, KW, sh, sw, ph, pw, HO, WO)
        ctx, sc = _direct_ctx(name, d, plan, bias=bias, relu=relu, isa=isa)
        return "conv2d_forward.j2", dict(ctx, entry="forward", off=sc.offsets), sc
    if kind == "conv2d_grad_input":
        if plan.mode == "scatter":
            ctx = dict(name=name, C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw,
                       HO=HO, WO=WO, transposed=False, relu_mask=bool(relu_mask))
            return "conv2d_grad_input.j2", ctx, _Scratch()
        if (sh, sw) != (1, 1):
            raise _plan_error(name, plan, "a grad-input at stride other than 1 scatters (mode 'scatter')")
        ctx, sc = _direct_ctx(name, _grad_input_direct(N, C, H, W, O, KH, KW, ph, pw, HO, WO), plan,
                              bias=False, relu=False, isa=isa)
        ctx.update(relu_mask=bool(relu_mask), off=sc.offsets, entry="grad_input", transposed=True)
        return "conv2d_grad_input.j2", ctx, sc
    modes = _gw_modes(sh, sw, ph, pw, WO, isa.lanes)
    if plan.mode not in modes:
        raise _plan_error(name, plan, f"mode {plan.mode!r} is not one of {modes} here")
    mode = plan.mode
    ctx = dict(name=name, C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw,
               HO=HO, WO=WO, bias=bool(bias), mode=mode)
    sc = _Scratch()
    if mode != "generic":
        OB = plan.OB
        if not 1 <= OB <= O:
            raise _plan_error(name, plan, f"its tile needs 1 <= OB <= {O}")
        NOB = ceil_div(O, OB)
        # The kernel splits the images into min(N, SLOTS) slots and each slot's channel blocks
        # into groups, at run time: the scratch holds SLOTS partials and the largest group's
        # channels (`_gw_flat`), whatever N is, so the code does not depend on N.
        CKK = C * KH * KW
        slots = _gw_slots(NOB, NOB * OB * CKK)
        ctx.update(OB=OB, NOB=NOB, SLOTS=slots, CKK=CKK)
        sc.add("dw", slots * NOB * OB * CKK)
        sc.add("db", slots * O)
        if mode == "flat":
            f = _gw_flat(C, W, O, KH, KW, pw, HO, WO, OB, isa)
            IB = max(1, plan.IB)
            if IB not in _GW_IMAGE_BLOCKS:
                raise _plan_error(name, plan, f"its image block IB must be one of {_GW_IMAGE_BLOCKS}")
            per_thread = IB * (f["XIMG"] + f["OBG"] * f["QPA"])
            ctx.update(f, IB=IB, PER_THREAD=per_thread)
            sc.add("thr", MAX_THREADS * per_thread)
        elif plan.IB:
            raise _plan_error(name, plan, "image blocks (IB) are the flat mode's")
    ctx["off"] = sc.offsets
    return "conv2d_grad_weight.j2", ctx, sc


def conv_scratch_bytes(kind: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride=(1, 1),
                       padding=(0, 0), plan: ConvPlan | None = None, isa: VectorISA | None = None) -> int:
    """Scratch bytes of the convolution kernel of `kind` under `plan`, without rendering it."""
    return _conv_ctx(kind, "conv", N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=stride, padding=padding,
                     isa=isa or resolve(), plan=plan)[2].nbytes


def render_conv2d_forward(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                          stride=(1, 1), padding=(0, 0), bias: bool, relu: bool,
                          isa: VectorISA | None = None, plan: ConvPlan | None = None) -> KernelSource:
    """y = relu?(conv2d(x, w) + b?) for x (N,C,H,W), w (O,C,KH,KW), b (O,), y (N,O,HO,WO).

    C signature: ``static void NAME(const float* x, const float* w, const float* b, float* y,
    float* scratch, int64_t n)`` (all ``__restrict__``; ``b`` is ignored, may be NULL, when
    bias=False; ``n``: the images, N, which the code does not hold: `KernelSource.extents`).
    ``isa``: the vector variant (default ``cpu_vector.resolve()``), as for every renderer here;
    ``plan``: mode and register tile (default: the cost model's, ``conv_plans(...)[0]``).
    """
    isa = isa or resolve()
    template, ctx, sc = _conv_ctx("conv2d", name, N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=stride,
                                  padding=padding, isa=isa, plan=plan, bias=bias, relu=relu)
    return KernelSource(name, _render(template, isa, **ctx), sc.nbytes, (N,))


def render_conv2d_grad_input(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int,
                             KW: int, stride=(1, 1), padding=(0, 0), relu_mask: bool = False,
                             isa: VectorISA | None = None, plan: ConvPlan | None = None) -> KernelSource:
    """dx (N,C,H,W) of y = conv2d(x, w) given dy (N,O,HO,WO) and w (O,C,KH,KW).

    C signature: ``static void NAME(const float* dy, const float* w, float* dx, float* scratch,
    int64_t n)`` (n: the images, N).
    Stride 1 is a forward convolution of dy (padded by KH-1-ph, KW-1-pw) with the transposed,
    flipped weights (see conv2d_forward.j2; modes flat and generic); any stride scatters per
    (n, c) plane (mode scatter: the cost model's for strides other than 1).
    With ``relu_mask`` (the ReLU backward as an epilogue: dx is zero where mask <= 0, mask being
    the forward activation of dx's shape) the signature is
    ``NAME(const float* dy, const float* w, const float* mask, float* dx, float* scratch, int64_t n)``.
    """
    isa = isa or resolve()
    template, ctx, sc = _conv_ctx("conv2d_grad_input", name, N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=stride,
                                  padding=padding, isa=isa, plan=plan, relu_mask=relu_mask)
    return KernelSource(name, _render(template, isa, **ctx), sc.nbytes, (N,))


def render_conv2d_grad_weight(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int,
                              KW: int, stride=(1, 1), padding=(0, 0), bias: bool,
                              isa: VectorISA | None = None, plan: ConvPlan | None = None) -> KernelSource:
    """dw (O,C,KH,KW) and, with bias, db (O,) = sum of dy over N,HO,WO; both fully overwritten.

    C signature: ``static void NAME(const float* x, const float* dy, float* dw, float* db,
    float* scratch, int64_t n)`` (``db`` ignored, may be NULL, when bias=False; n: the images, N).
    """
    isa = isa or resolve()
    template, ctx, sc = _conv_ctx("conv2d_grad_weight", name, N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, stride=stride,
                                  padding=padding, isa=isa, plan=plan, bias=bias)
    return KernelSource(name, _render(template, isa, **ctx), sc.nbytes, (N,))


# --------------------------------------------------------------------------- matmul

#: Below this many FLOPs (2*batch*M*N*K) a matmul runs on the calling thread alone. Measured on
#: the 2-core Zen 3 VM (one thread vs two, median): at 0.25 MFLOP one thread is as fast or
#: faster (64x30x64: 4.3 vs 4.3 us; 30x64x64: 3.2 vs 5.9), at 0.5 MFLOP it depends on the form
#: (30x128x64: 5.7 vs 7.9; 64x30x128: 7.0 vs 6.5), from 1 MFLOP two threads win (11.7 vs 9.6).
MATMUL_SERIAL_FLOPS = 512 * 1024
#: Target size of the block of B a matmul task keeps in L1 while all rows of A pass over it.
_MM_BLOCK_BYTES = 16 * 1024


def _mm_tile_cost(mt: int, nt: int) -> float:
    """Approximate cycles per k step (8 k in dot form, 1 k in axpy form) of an mt x nt register tile:
    FMAs at 2 per cycle, operand loads at 2 per cycle, whichever binds; a small per-load term
    breaks ties toward the tile that loads less."""
    return max(mt * nt / 2, (mt + nt) / 2) + 0.01 * (mt + nt)


def _mm_grid_cost(M: int, N: int, mr: int, nr: int) -> float:
    """Modelled cycles of an M x N grid in mr x nr tiles (remainder tiles included)."""
    fm, rm = divmod(M, mr)
    fn, rn = divmod(N, nr)
    cost = fm * fn * _mm_tile_cost(mr, nr)
    if rm:
        cost += fn * _mm_tile_cost(rm, nr)
    if rn:
        cost += fm * _mm_tile_cost(mr, rn)
    if rm and rn:
        cost += _mm_tile_cost(rm, rn)
    return cost


def _mm_pick_tile(M: int, N: int, cands) -> tuple[int, int]:
    """The (rows, cols) register tile of ``cands`` that covers an M x N grid (remainder tiles
    included) in the fewest modelled cycles; ties go to the earlier candidate."""
    best = None
    for mr, nr in cands:
        mr, nr = min(mr, M), min(nr, N)
        cost = _mm_grid_cost(M, N, mr, nr)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, mr, nr)
    return best[1], best[2]


def _mm_ranked_tiles(M: int, N: int, cands) -> list[tuple[int, int]]:
    """The distinct tiles of ``cands`` (clamped to the grid), fewest modelled cycles first."""
    tiles = dict.fromkeys((min(mr, M), min(nr, N)) for mr, nr in cands)
    return sorted(tiles, key=lambda t: _mm_grid_cost(M, N, *t))


#: Register-tile candidates of the two matmul forms (rows, columns; ties go to the earlier one),
#: per register file. 16 registers: the measured AVX2 lists (see render_matmul). 32 registers:
#: the same shapes widened to fill 32 zmm registers (dot: MR*NR + min(MR,NR) + 1 <= 32, MR <= 4
#: as for AVX2, so MR rows of a k chunk of A, 32 KiB at most, stay in L1; axpy: MR*NV + NV + 1
#: <= 32), then the 16-register ones for small problems.
_MM_DOT_TILES = {
    16: [(4, 3), (3, 4), (2, 5), (2, 6), (4, 2), (2, 4), (3, 3), (1, 7), (2, 3), (3, 2), (1, 1)],
    32: [(4, 6), (3, 8), (4, 5), (2, 12), (2, 10), (3, 6), (4, 4), (2, 8), (1, 15),
         (4, 3), (3, 4), (2, 5), (2, 6), (4, 2), (2, 4), (3, 3), (1, 7), (2, 3), (3, 2), (1, 1)],
}
_MM_AXPY_TILES = {
    16: [(4, 3), (6, 2), (5, 2), (2, 5), (2, 4), (3, 3), (14, 1), (1, 7)],
    32: [(6, 4), (8, 3), (4, 6), (12, 2), (5, 4), (7, 3), (14, 2), (3, 7), (2, 10), (14, 1), (1, 15),
         (4, 3), (6, 2), (5, 2), (2, 5), (2, 4), (3, 3), (1, 7)],
}


def _mm_set_conflicts(row_bytes: int, rows: int) -> bool:
    """True when ``rows`` rows of B, ``row_bytes`` apart, crowd into few L1 sets (a stride that
    is (nearly) a multiple of 4 KiB): read in place they would evict each other."""
    rows = min(rows, 64)
    sets = {(r * row_bytes // 64) % 64 for r in range(rows)}
    return len(sets) < max(1, rows // 2)


def _dot_serves(trans_a: bool, trans_b: bool, relu_mask: bool) -> str | None:
    """None where the dot form can compute the matmul, else why not."""
    if trans_a or not trans_b:
        return "it needs a (M, K) @ b (N, K)^T: rows of both contiguous in k"
    if relu_mask:
        return "its stores are scalar: no relu_mask epilogue"
    return None


def _dot_plan(M: int, N: int, K: int, batch: int, isa: VectorISA, tile: tuple[int, int] | None = None,
              KC: int | None = None) -> DotPlan:
    # MR*NR accumulators + the smaller side's vectors kept + 1 streamed <= the registers.
    # MR <= 4 keeps a tile's rows of A (MR x KC) in L1 while the tile sweeps the columns
    # (AVX2, 64x10x18432, best of 2-thread runs: 4x3 or 2x5 ~190 us, 6x2 ~205).
    VL = isa.lanes
    MR, NR = tile or _mm_pick_tile(M, N, _MM_DOT_TILES[isa.registers])
    if KC is None:
        # k chunks: B's chunk (N x KC) stays in L2 (<= 256 KiB) while the rows of A pass; one
        # chunk when K fits (64x30x784 in two chunks of 392 was 10% slower than in one).
        kc_max = min(2048, max(256, (64 * 1024 // N) // VL * VL))
        NKC = ceil_div(K, kc_max)
        KC = round_up(ceil_div(K, NKC), VL)
    parallel = 2 * batch * M * N * K >= MATMUL_SERIAL_FLOPS
    # Threads split the columns when A is small enough for every thread to read all of it
    # (from L2), else the rows. Splitting columns, no thread but one reads a given row of
    # B: in the MLP step (64x30x784) the serial SGD update of W1 that follows was 25 us
    # after a row split (both cores held all of W1) and 16 us after a column split.
    split_cols = parallel and ceil_div(N, NR) >= 2 and 4 * batch * M * K <= 512 * 1024
    return DotPlan(MR, NR, KC, split_cols, parallel)


def _axpy_plan(M: int, N: int, K: int, batch: int, trans_b: bool, isa: VectorISA,
               tile: tuple[int, int] | None = None) -> AxpyPlan:
    # MR*NV accumulators + NV B vectors + 1 broadcast <= the registers. AVX2 ties go to 4x3
    # (best of 2-thread runs, 64x18432x10: 4x3 175 us, 6x2 201; 30x784x64: 4x3, 6x2 and 5x2
    # within 4% of each other).
    VL = isa.lanes
    MR, NV = tile or _mm_pick_tile(M, ceil_div(N, VL), _MM_AXPY_TILES[isa.registers])
    NT8 = VL * NV
    # Pack B when its rows are not n-contiguous (trans_b), or rows of B a multiple of 4 KiB
    # apart would share L1 sets (N = 18432: 72 KiB; read in place they thrashed: 8 ms
    # instead of 0.3 for 64x10x18432).
    pack = trans_b or _mm_set_conflicts(4 * N, K)
    # Column blocks of BT tiles: the block of B (K x BT*NT8 floats, ~16 KiB) stays in L1
    # while every row tile of A passes over it.
    BT = max(1, min(ceil_div(N, NT8), _MM_BLOCK_BYTES // (4 * K * NT8)))
    return AxpyPlan(MR, NV, BT, pack, 2 * batch * M * N * K >= MATMUL_SERIAL_FLOPS)


def matmul_plans(form: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool, batch: int = 1,
                 relu_mask: bool = False, isa: VectorISA | None = None, tune: bool = False) -> list[MatmulPlan]:
    """The plans of a matmul in `form` ("dot" or "axpy"; [] where the form cannot compute it): the
    cost model's alone, or with `tune` the spread the tuner measures (its best-modelled register
    tiles, and the other k chunking, column split, packing, block width and threading)."""
    isa = isa or resolve()
    VL = isa.lanes
    if form == "dot":
        if _dot_serves(trans_a, trans_b, relu_mask) is not None:
            return []
        best = _dot_plan(M, N, K, batch, isa)
        if not tune:
            return [best]
        plans = [best] + [_dot_plan(M, N, K, batch, isa, tile=t)
                          for t in _mm_ranked_tiles(M, N, _MM_DOT_TILES[isa.registers])[:TUNE_TILES]]
        for kc in (round_up(K, VL), round_up(ceil_div(K, ceil_div(K, 256)), VL)):
            plans.append(_dot_plan(M, N, K, batch, isa, tile=(best.MR, best.NR), KC=kc))
        if best.parallel and ceil_div(N, best.NR) >= 2:
            plans.append(dataclasses.replace(best, split_cols=not best.split_cols))
        plans.append(dataclasses.replace(best, parallel=not best.parallel, split_cols=False))
    elif form == "axpy":
        best = _axpy_plan(M, N, K, batch, trans_b, isa)
        if not tune:
            return [best]
        nvec = ceil_div(N, VL)
        plans = [best] + [_axpy_plan(M, N, K, batch, trans_b, isa, tile=t)
                          for t in _mm_ranked_tiles(M, nvec, _MM_AXPY_TILES[isa.registers])[:TUNE_TILES]]
        if not trans_b:
            plans.append(dataclasses.replace(best, pack=not best.pack))
        plans += [dataclasses.replace(best, BT=bt) for bt in (1, ceil_div(N, VL * best.NV))]
        plans.append(dataclasses.replace(best, parallel=not best.parallel))
    else:
        raise ValueError(f"no matmul form {form!r} (expected 'dot' or 'axpy')")
    return list(dict.fromkeys(plans))


def _matmul_ctx(name: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool, batch: int, bias: bool,
                relu: bool, relu_mask: bool, isa: VectorISA, plan: MatmulPlan | None) -> tuple[dict, _Scratch]:
    _check_name(name)
    check_positive(M=M, N=N, K=K, batch=batch)
    VL = isa.lanes
    ta, tb = bool(trans_a), bool(trans_b)
    if plan is None:
        # the dot form for x @ W^T with a long k and few outputs, else axpy
        dot = _dot_serves(ta, tb, relu_mask) is None and K >= 64 and N <= 64
        plan = matmul_plans("dot" if dot else "axpy", M=M, N=N, K=K, trans_a=ta, trans_b=tb, batch=batch,
                            relu_mask=relu_mask, isa=isa)[0]
    # batch and M (and, in the axpy form, K) are no part of the code: the kernel takes them at run time
    ctx = dict(name=name, N=N, TA=ta, TB=tb,
               bias=bool(bias), relu=bool(relu), relu_mask=bool(relu_mask), parallel=bool(plan.parallel))
    sc = _Scratch()
    if isinstance(plan, DotPlan):
        if (why := _dot_serves(ta, tb, relu_mask)) is not None:
            raise _plan_error(name, plan, f"the dot form does not apply: {why}")
        # MR may exceed M (a plan of a larger batch): the last row tile is shorter (row_tail)
        if not (1 <= plan.MR <= _MAX_MR and 1 <= plan.NR <= N and plan.KC >= VL and plan.KC % VL == 0) \
                or (plan.split_cols and not plan.parallel):
            raise _plan_error(name, plan, f"it needs 1 <= MR <= {_MAX_MR}, 1 <= NR <= {N}, KC a multiple of {VL} "
                                          f"and split_cols only when parallel")
        ctx.update(mode="dot", K=K, MR=plan.MR, NR=plan.NR, KC=plan.KC, SPLIT_COLS=plan.split_cols)
    else:
        NTL = ceil_div(N, VL * plan.NV) if plan.NV >= 1 else 0
        if not (1 <= plan.MR <= _MAX_MR and 1 <= plan.NV <= ceil_div(N, VL) and 1 <= plan.BT <= NTL) \
                or (tb and not plan.pack):
            raise _plan_error(name, plan, f"it needs 1 <= MR <= {_MAX_MR}, 1 <= NV <= {ceil_div(N, VL)}, "
                                          f"1 <= BT <= the column tiles, and pack when B is transposed")
        ctx.update(mode="axpy", MR=plan.MR, NV=plan.NV, BT=plan.BT, PACK=plan.pack)
        if plan.pack:  # per thread: a K x BT*VL*NV panel (the kernel computes the same size)
            sc.add("panel", (MAX_THREADS if plan.parallel else 1) * round_up(K * plan.BT * VL * plan.NV, _ALIGN))
    ctx["off"] = sc.offsets
    return ctx, sc


def matmul_scratch_bytes(*, M: int, N: int, K: int, trans_a: bool, trans_b: bool, batch: int = 1,
                         relu_mask: bool = False, plan: MatmulPlan | None = None, isa: VectorISA | None = None) -> int:
    """Scratch bytes of the matmul kernel under `plan`, without rendering it."""
    return _matmul_ctx("mm", M=M, N=N, K=K, trans_a=trans_a, trans_b=trans_b, batch=batch, bias=False, relu=False,
                       relu_mask=relu_mask, isa=isa or resolve(), plan=plan)[1].nbytes


def render_matmul(name: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool,
                  batch: int = 1, bias: bool = False, relu: bool = False,
                  relu_mask: bool = False, isa: VectorISA | None = None,
                  plan: MatmulPlan | None = None) -> KernelSource:
    """C[b,m,n] = relu?(sum_k opA[b,m,k] * opB[b,k,n] + bias[n]?).

    A is stored (batch,M,K), or (batch,K,M) with trans_a; B (batch,K,N), or (batch,N,K) with
    trans_b; C (batch,M,N). C signature: ``static void NAME(const float* A, const float* B,
    const float* bias, float* C, float* scratch, int64_t batch, int64_t m)`` (``bias`` may be
    NULL when bias=False), ``..., int64_t batch, int64_t m, int64_t k)`` in the axpy form: the
    matrices, the rows M and (axpy) the reduced length K are not in the code
    (`KernelSource.extents`: one kernel for any of them).

    Two forms, both register-tiled with every C element owned by one task and summed in k order
    (``plan``: a `DotPlan` or an `AxpyPlan`; default: the cost model's, the dot form when
    trans_b, not trans_a, K >= 64 and N <= 64, else axpy):

    * ``dot`` (trans_b, not trans_a: x @ W^T, best with few outputs and a long k): rows of A and
      of B are contiguous in k, so C[m,n] is a dot product vectorised along k (tail loaded
      zero-padded), tile MR rows x NR columns, k split in chunks (B's chunk stays in L2);
      threads own equal ranges of column tiles when A is small (each reads all of A, but a row
      of B is read by one thread only), else of rows;
    * ``axpy`` (any matmul): vectorised along n, tile MR rows x VL*NV columns, B read in
      place when its rows are contiguous and spaced well for L1, else packed per block into a
      zero-padded per-thread panel (transposed when trans_b); threads own equal ranges of
      (column block, row tile, column tile) units.

    Either way a C element's arithmetic does not depend on the thread that computes it (tile
    widths along n and k chunks are fixed here), so results are bit-identical for any team
    size. With ``relu_mask`` (the ReLU backward as an epilogue) the signature takes a ``mask``
    (same shape as C) before C: ``NAME(A, B, bias, mask, C, scratch)``, and C is zero where
    mask <= 0; only the axpy form takes it (the dot form's stores are scalar). The cost model runs
    problems under ``MATMUL_SERIAL_FLOPS`` without an OpenMP region (the same work, in the same
    order, on the calling thread).
    """
    isa = isa or resolve()
    ctx, sc = _matmul_ctx(name, M=M, N=N, K=K, trans_a=trans_a, trans_b=trans_b, batch=batch, bias=bias, relu=relu,
                          relu_mask=relu_mask, isa=isa, plan=plan)
    return KernelSource(name, _render("matmul.j2", isa, **ctx), sc.nbytes,
                        (batch, M) if ctx["mode"] == "dot" else (batch, M, K))
