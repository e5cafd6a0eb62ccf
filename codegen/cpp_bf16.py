"""bfloat16 contractions on the CPU: every kind (matmul, conv2d, its two gradients) on bfloat16
pairs with float32 accumulation, in five modes (the plan's `mode`, best first where they apply):

- `direct` (`Direct`, `templates/cpp/bf16_direct.j2`): convolutions of any stride and groups over
  a grid of their outputs, the input packed once per image in phase planes (a vector of output
  positions is one load); finished outputs staged and copied out a row at a time. Grad-input is
  the forward of dy; a strided one runs as its SH x SW output phases, each a stride-1 correlation
  of dy with its phase's taps (`grad_input_phases`); an ungrouped grad-weight reads the same grid
  with the roles turned (`bf16_direct_gw.j2`);
- `taps` (`bf16_taps_gw.j2`): a grouped grad-weight, one (o, c) pair a task, vectors along the
  positions;
- `dot` (`bf16_dot.j2`): x @ W^T, A's and B's rows read where they lie (pairs along k);
- `gemm` (`bf16_gemm.j2`): any ungrouped kind as batched GEMMs (below);
- `amx`: the GEMM mode on AMX tiles where the CPU has them (`dot` "amx"; `bf16_amx.j2`): A packed
  row by row, the register tile MR x NW of 16 or 32 each (up to four 16 x 16 float32 C tiles),
  k in steps of 16 pairs (K's pairs padded with zeros to whole steps), the C tiles stored to a
  buffer and finished by the same epilogue;
- `direct_amx`: the direct mode on AMX tiles (`bf16_tiles.j2`): its packed planes are B tiles as
  they lie (16 channel-pair planes a tile, 16 positions a row), each tap one tile load shifted
  along the plane, the weight packed as A tiles per tap; a group's pairs padded with zero planes
  to whole steps of 16. Its grad-weight has the output channels as rows (dy's rows on the grid,
  32 positions a tile row) and column tiles of 16 input channels at one tap (x in a pair layout:
  each position's word holds it and the next), every tile row a whole aligned 64-byte load.
  Where a group has one input channel, the vector direct mode pairs two taps of one phase plane
  instead of the channel and a zero.

In the GEMM mode each kind is read as G GEMMs C[g] (M x N) = A[g] (M x K) . B[g] (K x N) through element accessors
(a convolution's B is its im2col, gathered while packing, never stored whole):

| kind | G | M | N | K | A | B | C |
| --- | --- | --- | --- | --- | --- | --- | --- |
| conv2d | images | O | HO*WO | C*KH*KW | the weight | the input's windows | out[g] |
| conv2d_grad_input | images | C | H*W | O*KH*KW | the weight, per input channel | dy at the windows over each input pixel | out[g] |
| conv2d_grad_weight | images, summed | O | C*KH*KW | HO*WO | dy[g] | the input's windows | out |
| matmul | batch | M | N | K | a (or a^T) | b (or b^T) | out[g] |

Operands are packed as pairs along k: A row by row (`uint32` = two bfloat16), B in blocks of NB
columns as [k/2][n][2] (the layout `vdpbf16ps` reads: one 32-bit lane holds k and k+1 of one
column). The register tile is MR rows x NV vectors of columns; per pair of k, each row's pair is
broadcast and multiplied with the NV column vectors. The product-accumulate `dot2` is
`_mm512_dpbf16_ps` where the CPU has AVX512-BF16 (`cpu_vector.bf16_dot`: "avx512bf16"), else the
same arithmetic in float32 FMAs ("emulated": the pair's high halves' product, then the low's, as
the instruction does; it does not flush denormals, which the instruction does). A bfloat16
product is exact in float32, so both paths sum exact products in float32.

The epilogue mirrors the interpreter node by node: the accumulator rounded to bfloat16, then
`+ bias` rounded, then ReLU (or ReLU's backward mask), stored as bfloat16. Grad-weight sums its
images in min(N, 16) fixed chunks (partial sums in scratch, added in chunk order): the result does
not depend on the thread count.

The sizes that follow the batch are the kernels' arguments (`KernelSource.extents`), not constants
of their code, in every mode: a convolution's images, a matmul's batch, rows and reduced length;
so one compiled kernel serves every batch size, with the plan (tile, block, rows a task) of the
batch it was chosen for. The work split that depended on them (the GEMM mode's groups of row
tiles, the grad-weight's chunks) is computed at run time.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .cpp_kernels import MAX_THREADS, KernelSource, _check_name, _render, vec_prelude
from .cpu_vector import VectorISA

__all__ = ["Bf16Plan", "Gemm", "Direct", "gemm_of", "direct_of", "taps_of", "dot_serves", "plans", "scratch_bytes",
           "render"]

#: grad-weight's fixed number of partial sums (chunks of images)
CHUNKS = 16
#: below this many multiply-adds a kernel runs on one thread (a team costs more)
SERIAL_MACS = 1 << 18
#: the most bytes of finished outputs a direct-mode task stages before copying them out (within L2)
STAGE_BYTES = 64 * 1024
#: the most bytes of a GEMM-mode task's block of packed B (it stays in L2 while the row tiles run)
B_BLOCK_BYTES = 256 * 1024


@dataclass(frozen=True)
class Gemm:
    """A contraction as G GEMMs, with the C++ bodies of its element accessors."""
    kind: str
    G: int
    M: int
    N: int
    K: int
    a_role: str
    b_role: str
    a_shared: bool        # A is the same for every g (a convolution's weight): packed once
    reduce_groups: bool   # C = sum over g (grad-weight)
    a_body: str           # uint32_t element (m, k) of A[g] (0 for k >= K)
    b_body: str           # row k of B[g], columns [n0, n0 + NB), into dst (0 past N and for k >= K)
    out_index: str        # the flat index of C[g][m][n] in the output (and the mask)
    bias_index: str       # the bias element of (m, n)
    what: str             # one line for the kernel's header
    # where an operand lies in a plain layout, its rows as C++ pointers (else "": the accessors)
    a_row: str = ""       # row m of A[g], contiguous along k
    a_krow: str = ""      # row k of A[g] stored k by k (A^T row-major: contiguous along m)
    b_krow: str = ""      # row k of B[g], contiguous along n
    b_ncol: str = ""      # column n of B[g], contiguous along k


@dataclass(frozen=True)
class Bf16Plan:
    mr: int   # rows of the register tile
    nv: int   # column vectors of the register tile
    nb: int   # gemm: columns per block (a task packs one block of B); direct: output rows per task
              # (grad-weight: the output channels, padded to whole vectors)
    dot: str  # how pairs are multiplied: the geometry's `bf16_dot` (in the plan so dumps show it)
    mode: str = "gemm"  # "gemm" (ungrouped), "amx" (the GEMM mode on AMX tiles), "direct" (convolutions:
                        # `Direct`; grad-weight ungrouped), "direct_amx" (the direct mode on AMX tiles),
                        # "dot" (x @ W^T: vectors along k; mr x nv outputs a tile, nb unused) or
                        # "taps" (a grouped grad-weight: mr taps a pass, nv 1, nb unused)


@dataclass(frozen=True)
class Direct:
    """A convolution read directly: OC output channels over the flat positions q = oh * WP + ow
    of a grid of the outputs (HOUT x WP: each row a few positions wider, which are computed and
    dropped), so that a vector of VL consecutive positions is one load of the packed input (no
    im2col). The input is packed once per image as phase planes (a, b) < (SH, SW) over the grid
    (HP x WP): plane (a, b) holds input[i * SH + a - PT][j * SW + b - PL] at (i, j), zero outside
    the input, so the window offset (kh, kw) of position q is at q + (kh / SH) * WP + kw / SW in
    plane (kh % SH, kw % SW): stride 1 in every plane, whatever the convolution's. Phases that no
    tap reads (a >= KH: a 1x1 strided window) are not packed. The forward reads x (its pairs of
    channels); grad-input (stride 1) is the forward of dy, padded by the kernel's overhang
    (KH - 1 - PH, cropped where negative), with the weight flipped and its channel axes swapped;
    grad-weight reads x (one channel a plane) at the pairs of positions of dy."""
    kind: str
    G: int
    CI: int        # input channels (the reduction's, with KH * KW)
    OC: int        # output channels
    HIN: int
    WIN: int
    KH: int
    KW: int
    PT: int        # the input's padding: its first row (column) in the grid, negative where cropped
    PL: int
    HOUT: int
    WOUT: int
    a_role: str    # the weight
    b_role: str    # the input (x, or dy)
    w_index: str   # flat index in the weight of (output channel oc, input channel c, kh, kw)
    what: str
    SH: int = 1
    SW: int = 1
    GR: int = 1    # groups: output channel group gr reads input channel group gr only
    DH: int = 1    # the input's dilation (grad-input of a strided convolution: dy's rows SH apart)
    DW: int = 1

    @property
    def HP(self) -> int:
        return self.HOUT + (self.KH - 1) // self.SH

    @property
    def WP(self) -> int:
        return self.WOUT + (self.KW - 1) // self.SW

    @property
    def PHH(self) -> int:
        """Phase rows that some tap reads."""
        return min(self.SH, self.KH)

    @property
    def PHW(self) -> int:
        return min(self.SW, self.KW)


def direct_of(g: dict[str, Any]) -> Direct | None:
    """The direct reading of a convolution, else None. Grad-weight
    reads the same grid (x in phase planes, dy over its flat positions) with the roles turned:
    rows (c, kh, kw), columns o, summed over the positions (`templates/cpp/bf16_direct_gw.j2`;
    ungrouped: a grouped grad-weight is the taps mode's)."""
    if g["kind"] not in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight"):
        return None
    NI, C, H, W, O, KH, KW, SH, SW, PH, PW, HO, WO = _conv_sizes(g)
    GR = g.get("groups", 1)
    if g["kind"] == "conv2d_grad_weight":
        if GR != 1:
            return None
        return Direct("conv2d_grad_weight", NI, C, O, H, W, KH, KW, PH, PW, HO, WO, "dy", "x", "",
                      "dw[o,c,kh,kw] = sum_(n,q) dy[n,o,q] x[n,c] at the window of q", SH, SW)
    if g["kind"] == "conv2d":
        return Direct("conv2d", NI, C, O, H, W, KH, KW, PH, PW, HO, WO, "w", "x",
                      "((long)(oc * CIG + cl) * KH + kh) * KW + kw",
                      "out[n,o] = sum_(c,kh,kw) w[o,c,kh,kw] x[n,c] at the window", SH, SW, GR)
    # grad-input: the forward of dy with its rows (columns) placed SH (SW) apart; the direct mode
    # renders a strided one as its output phases (`grad_input_phases`), the GEMM mode reads it so
    return Direct("conv2d_grad_input", NI, O, C, HO, WO, KH, KW, KH - 1 - PH, KW - 1 - PW, H, W, "w", "dy",
                  "((long)(c * OCG + ocl) * KH + (KH - 1 - kh)) * KW + (KW - 1 - kw)",
                  "dx[n,c] = sum_(o,kh,kw) w[o,c,KH-1-kh,KW-1-kw] dy[n,o] padded and shifted" +
                  (f", dy's rows {SH} and columns {SW} apart" if (SH, SW) != (1, 1) else ""), 1, 1, GR, SH, SW)


def _phase_axis(alpha: int, s: int, k: int, pad: int, out: int) -> tuple[int, int, int, int]:
    """(first tap, taps, padding, outputs) along one axis of output phase `alpha` of a stride-s
    grad-input: the taps k0, k0 + s, ... reach dx positions u * s + alpha, from dy at u + t - padding."""
    k0 = (alpha + pad) % s
    taps = len(range(k0, k, s))
    return k0, taps, taps - 1 - (alpha + pad) // s, (out - alpha + s - 1) // s


def grad_input_phases(d: Direct) -> list[tuple[int, int, Direct | None]]:
    """The output phases (a, b) of a strided grad-input (`d`: dy placed DH x DW apart), each a
    stride-1 correlation of dy itself with the taps of its phase (None: a phase no tap reaches,
    zero): dx[u * DH + a][v * DW + b] = sum_(o,t,t') dy[o][u + t - PT'][v + t' - PL']
    w[o][c][kh0 + DH (T - 1 - t)][kw0 + DW (T' - 1 - t')], so no product reads the zeros that
    placing dy apart would put between its rows and columns."""
    ph, pw = d.KH - 1 - d.PT, d.KW - 1 - d.PL  # the forward's padding
    out = []
    for a in range(d.DH):
        kh0, th, pt, hout = _phase_axis(a, d.DH, d.KH, ph, d.HOUT)
        for b in range(d.DW):
            kw0, tw, pl, wout = _phase_axis(b, d.DW, d.KW, pw, d.WOUT)
            if th == 0 or tw == 0 or hout <= 0 or wout <= 0:
                out.append((a, b, None))
                continue
            w_index = (f"((long)(c * OCG + ocl) * {d.KH} + ({kh0} + {d.DH} * ({th - 1} - kh))) * {d.KW} + "
                       f"({kw0} + {d.DW} * ({tw - 1} - kw))")
            out.append((a, b, Direct(d.kind, d.G, d.CI, d.OC, d.HIN, d.WIN, th, tw, pt, pl, hout, wout, d.a_role,
                                     d.b_role, w_index, f"{d.what}: output phase ({a}, {b})", 1, 1, d.GR)))
    return out


def _phased(d: Direct | None) -> bool:
    """Whether the direct mode computes this kernel phase by phase (a strided grad-input)."""
    return d is not None and d.kind == "conv2d_grad_input" and (d.DH, d.DW) != (1, 1)


def _direct_rows(d: Direct, mp: int, nw: int) -> int:
    """Output rows per task: the whole image where the images alone give enough tasks and its
    finished outputs (every channel, staged before the copy into the output) stay within
    STAGE_BYTES; else halved until both hold (at least one row)."""
    rb = d.HOUT
    while rb > 1 and (d.G * math.ceil(d.HOUT / rb) < 4 * MAX_THREADS or 2 * mp * _stage_pitch(d, rb, nw) > STAGE_BYTES):
        rb = (rb + 1) // 2
    return rb


def taps_of(g: dict[str, Any]) -> Direct | None:
    """The taps reading of a grouped grad-weight (`templates/cpp/bf16_taps_gw.j2`), else None: one
    (output channel, input channel of its group) a task, its window's taps as vector accumulators
    along the flat positions of the grid (x in phase planes as in the direct mode, dy on the grid)."""
    if g["kind"] != "conv2d_grad_weight" or g.get("groups", 1) == 1:
        return None
    NI, C, H, W, O, KH, KW, SH, SW, PH, PW, HO, WO = _conv_sizes(g)
    return Direct("conv2d_grad_weight", NI, C, O, H, W, KH, KW, PH, PW, HO, WO, "dy", "x", "",
                  "dw[o,cl,kh,kw] = sum_(n,q) dy[n,o,q] x[n,c] at the window of q", SH, SW, g["groups"])


def _taps_per_pass(d: Direct, isa: VectorISA, dot: str) -> int:
    """Taps a pass accumulates: all of the window where the registers hold them (an accumulator a
    tap, besides dy's vector and the tap's load; emulated: their halves too)."""
    return max(1, min(d.KH * d.KW, isa.registers - (6 if dot == "emulated" else 2)))


def _taps_xplane(d: Direct, isa: VectorISA) -> int:
    """bfloat16 elements of one phase plane in the taps mode: what the last vector of the farthest
    tap reaches."""
    qv = math.ceil(d.HOUT * d.WP / (2 * isa.lanes))
    return _round_up((d.HP - d.HOUT) * d.WP + (d.KW - 1) // d.SW + qv * 2 * isa.lanes, 32)


def _direct_mp(d: Direct, mr: int) -> int:
    """Rows of the direct forward's tiles: each group's output channels in whole tiles."""
    return d.GR * _round_up(d.OC // d.GR, mr)


def _cig2(d: Direct) -> int:
    """Pairs of input channels of a group."""
    return (d.CI // d.GR + 1) // 2


def _tap_pairs(d: Direct) -> int:
    """Pairs of taps the vector direct mode multiplies where a group has one input channel (a
    first layer, a depthwise convolution): taps kw and kw + SW of one phase plane as a pair (x at
    consecutive positions of the plane), else 0 (pairs of channels)."""
    if d.CI // d.GR != 1:
        return 0
    return d.KH * sum(math.ceil((d.KW - b) / (2 * d.SW)) for b in range(d.PHW))


def _cig2x(d: Direct, amx: bool) -> int:
    """Pair planes a group packs: its pairs, in whole AMX steps of 16 for the direct_amx mode."""
    return _round_up(_cig2(d), 16) if amx else _cig2(d)


def _stage_pitch(d: Direct, rb: int, nw: int) -> int:
    """bfloat16 elements of one channel's row in the stage: a task's positions, whole vector groups."""
    return _round_up(rb * d.WP, nw)


def _conv_sizes(g: dict[str, Any]) -> tuple[int, ...]:
    (sh, sw), (ph, pw) = g["stride"], g["padding"]
    return g["N"], g["C"], g["H"], g["W"], g["O"], g["KH"], g["KW"], sh, sw, ph, pw, g["HO"], g["WO"]


def gemm_of(g: dict[str, Any]) -> Gemm:
    """The GEMM reading of a contraction's geometry (`cpp_choices.geometry`)."""
    kind = g["kind"]
    if kind == "matmul":
        M, N, K, G = g["M"], g["N"], g["K"], g["batch"]
        a = "(long)g * M * K + (long)k * M + m" if g["trans_a"] else "(long)g * M * K + (long)m * K + k"
        b = "(long)g * K * N + (long)n * K + k" if g["trans_b"] else "(long)g * K * N + (long)k * N + n"
        a_rows = {"a_krow": "pa + ((long)g * K + k) * M"} if g["trans_a"] else {"a_row": "pa + ((long)g * M + m) * K"}
        b_rows = {"b_ncol": "pb + ((long)g * N + n) * K"} if g["trans_b"] else {"b_krow": "pb + ((long)g * K + k) * N"}
        return Gemm(kind, G, M, N, K, "a", "b", False, False, f"return k < K ? pa[{a}] : 0u;",
                    _ROW.format(setup="", step="", value=f"pb[{b}]"),
                    "((long)g * M + m) * N + n", "n",
                    f"C[b] = {'A^T' if g['trans_a'] else 'A'}[b] @ {'B^T' if g['trans_b'] else 'B'}[b]",
                    **a_rows, **b_rows)
    NI, C, H, W, O, KH, KW, SH, SW, PH, PW, HO, WO = _conv_sizes(g)
    # the input's windows: row (c, kh, kw) over pixels (oh, ow), or row (oh, ow) over (c, kh, kw)
    pixel = "const int ih = oh * SH + kh - PH, iw = ow * SW + kw - PW;\n      if (ih >= 0 && ih < H && iw >= 0 && iw < W) v = {src};"
    if kind == "conv2d":
        return Gemm(kind, NI, O, HO * WO, C * KH * KW, "w", "x", True, False,
                    "return k < K ? pa[(long)m * K + k] : 0u;",
                    _ROW.format(setup="const int c = k / (KH * KW), kh = k % (KH * KW) / KW, kw = k % KW;\n"
                                      "  const uint16_t* __restrict__ plane = pb + ((long)g * C + c) * H * W;\n"
                                      "  int oh = n0 / WO, ow = n0 % WO;",
                                step="if (++ow == WO) { ow = 0; ++oh; }",
                                value=None, body=pixel.format(src="plane[ih * W + iw]")),
                    "((long)g * M + m) * N + n", "m", "out[n,o,p] = sum_(c,kh,kw) w[o,c,kh,kw] x[n,c,window(p)]",
                    a_row="pa + (long)m * K")
    if kind == "conv2d_grad_input":
        body = ("const int th = h + PH - kh, tw = w + PW - kw;\n"
                "      if (th >= 0 && tw >= 0 && th % SH == 0 && tw % SW == 0 && th / SH < HO && tw / SW < WO)\n"
                "        v = plane[(th / SH) * WO + tw / SW];")
        return Gemm(kind, NI, C, H * W, O * KH * KW, "w", "dy", True, False,
                    "if (k >= K) return 0u;\n"
                    "  const int o = k / (KH * KW), r = k % (KH * KW);\n"
                    "  return pa[((long)o * C + m) * KH * KW + r];",
                    _ROW.format(setup="const int o = k / (KH * KW), kh = k % (KH * KW) / KW, kw = k % KW;\n"
                                      "  const uint16_t* __restrict__ plane = pb + ((long)g * O + o) * HO * WO;\n"
                                      "  int h = n0 / W, w = n0 % W;",
                                step="if (++w == W) { w = 0; ++h; }", value=None, body=body),
                    "((long)g * M + m) * N + n", "m",
                    "dx[n,c,h,w] = sum_(o,kh,kw) w[o,c,kh,kw] dy[n,o,window over (h,w)]")
    if kind == "conv2d_grad_weight":
        return Gemm(kind, NI, O, C * KH * KW, HO * WO, "dy", "x", False, True,
                    "return k < K ? pa[((long)g * M + m) * K + k] : 0u;",
                    _ROW.format(setup="const int oh = k / WO, ow = k % WO;\n"
                                      "  int c = n0 / (KH * KW), kh = n0 % (KH * KW) / KW, kw = n0 % KW;",
                                step="if (++kw == KW) { kw = 0; if (++kh == KH) { kh = 0; ++c; } }", value=None,
                                body=pixel.format(src="pb[(((long)g * C + c) * H + ih) * W + iw]")),
                    "(long)m * N + n", "m", "dw[o,c,kh,kw] = sum_(n,p) dy[n,o,p] x[n,c,window(p)]",
                    a_row="pa + ((long)g * M + m) * K")
    raise ValueError(f"no bfloat16 GEMM reading of kind {kind!r}")


class _Row(str):
    """The body of `b_row`: `setup` once per row, then per column its value and `step` (the
    incremental coordinates of the next column: no division per element)."""

    def format(self, setup: str, step: str, value: str | None, body: str | None = None) -> str:  # type: ignore[override]
        inner = f"v = {value};" if value is not None else body
        return (f"if (k >= K) {{\n    for (int j = 0; j < NB; ++j) dst[j] = 0;\n    return;\n  }}\n"
                + (f"  {setup}\n" if setup else "")
                + "  for (int j = 0; j < NB; ++j) {\n    const int n = n0 + j;\n    uint16_t v = 0;\n"
                + f"    if (n < N) {{\n      {inner}\n    }}\n    dst[j] = v;\n"
                + (f"    {step}\n" if step else "") + "  }")


_ROW = _Row()


def _round_up(x: int, to: int) -> int:
    return -(-x // to) * to


def _max_rows(isa: VectorISA, nv: int, dot: str) -> int:
    """The most rows a tile of nv column vectors may have: accumulators plus what one k pair loads
    (emulated: each column vector and the row's pair split in their two halves) fill the registers."""
    per = 3 if dot == "emulated" else 1
    return max(1, min(16, (isa.registers - per * nv - per) // nv))


def _rows(M: int, most: int) -> list[int]:
    """Tile heights up to `most`, least padding of M first, then taller."""
    return sorted(range(1, most + 1), key=lambda r: (_round_up(M, r), -r))


def _block(gm: Gemm, nw: int) -> int:
    """Columns per block: the whole N (padded; grad-weight sums its images over it), halved while
    a block of B (K/2 pairs a column) is over B_BLOCK_BYTES (it stays in L2 while every row tile
    of the task runs over it)."""
    nb = _round_up(gm.N, nw)
    if gm.reduce_groups:
        return nb
    while nb > nw and (gm.K + 1) // 2 * nb * 4 > B_BLOCK_BYTES:
        nb = _round_up(nb // 2, nw)
    return nb


def dot_serves(g: dict[str, Any]) -> bool:
    """Whether the dot mode reads this kernel: a matmul whose A rows and B^T rows (x @ W^T) are
    contiguous along k, so its pairs along k are where they lie (no packing)."""
    return g["kind"] == "matmul" and not g["trans_a"] and g["trans_b"]


def _dot_tiles(g: dict[str, Any], isa: VectorISA) -> list[tuple[float, int, int]]:
    """(cost, rows, columns) of the dot mode's register tiles that fit, cheapest first: the outputs
    computed (padding included) times the products and loads of each (an accumulator a product,
    a vector load of A or B per row and column, at two loads a cycle), plus the horizontal sums."""
    M, N, K = g["M"], g["N"], g["K"]
    per = 3 if g["bf16_dot"] == "emulated" else 1  # what each pair product holds besides its accumulator
    steps = math.ceil(K / (2 * isa.lanes))
    out = []
    for nr in range(1, min(N, isa.lanes) + 1):
        for mr in range(1, min(M, 16) + 1):
            if mr * nr + per * nr + per > isa.registers:
                continue
            tiles = math.ceil(M / mr) * math.ceil(N / nr)
            out.append((tiles * (steps * (mr * nr + 0.5 * (mr + nr)) + mr * nr * math.log2(isa.lanes)), mr, nr))
    return sorted(out)


def _gemm_cost(gm: Gemm, plan: Bf16Plan, isa: VectorISA) -> float:
    """The GEMM mode's products (vector by vector, padding included), on the dot mode's scale (an
    AMX tile instruction: sixteen vector ones)."""
    vectors = gm.G * _round_up(gm.M, plan.mr) * _round_up(gm.N, plan.nv * isa.lanes) / isa.lanes * _pairs(gm.K, plan)
    return vectors / 16 if plan.mode == "amx" else vectors


def _direct_cost(d: Direct, plan: Bf16Plan, isa: VectorISA) -> float:
    """The direct modes' products (vector by vector, padding included; an AMX tile instruction:
    sixteen vector ones)."""
    amx = plan.mode == "direct_amx"
    nw = plan.nv * isa.lanes
    if d.kind == "conv2d_grad_weight":
        if amx:  # rows the output channels at each tap, columns the input channels in tiles of 16
            vectors = d.G * _gw_rows(d, plan) * _round_up(d.CI, 16) / isa.lanes * _gw_q2p(d)
        else:
            q2 = (d.HOUT * d.WP + 1) // 2
            vectors = d.G * _round_up(d.CI * d.KH * d.KW, plan.mr) * _round_up(d.OC, nw) / isa.lanes * q2
    else:
        pairs = (0 if amx else _tap_pairs(d)) or d.KH * d.KW * _cig2x(d, amx)
        vectors = d.G * _direct_mp(d, plan.mr) * _round_up(d.HOUT * d.WP, nw) / isa.lanes * pairs
    return vectors / 16 if amx else vectors


def _amx_direct_plans(d: Direct, isa: VectorISA, tune: bool) -> list[Bf16Plan]:
    """The direct_amx mode's plans: every AMX tile (tune), else the tallest the rows fill (a
    group's output channels; a grad-weight's rows are its output channels too, its columns the
    input channels) and 16 columns: on the one AMX CPU
    measured (an H100 machine's Xeon host, the CNN's convolutions at batch 64, 2 threads) the
    tiles 16 columns wide beat the 32-wide ones by 10-40% in each of the three kinds."""
    gw = d.kind == "conv2d_grad_weight"
    rows = d.OC // d.GR
    out = []
    for mr, nw in AMX_TILES:
        if tune or ((mr == 32) == (rows > 16) and nw == 16):
            nb = _round_up(d.CI, 16) if gw else _direct_rows(d, _direct_mp(d, mr), nw)
            out.append(Bf16Plan(mr, nw // isa.lanes, nb, "amx", "direct_amx"))
    return out


#: the direct_amx mode goes first where its tile products (padding included) are at most this
#: share of the vector direct mode's: the tiles' padding of channels (one input channel fills a
#: sixteenth of a step) and their loads and stores through memory make a tile instruction worth
#: fewer than its sixteen vector ones
AMX_DIRECT_SHARE = 0.25


def plans(g: dict[str, Any], isa: VectorISA, tune: bool = False) -> list[Bf16Plan]:
    """The cost model's plans, best first (tune: the tuner's wider list): the direct mode first
    where it applies (it gathers no windows: each input element is packed once, not KH * KW
    times), then the GEMM mode; for x @ W^T the dot mode (no packing, no padding of N to whole
    vectors) before the GEMM mode where it costs fewer products. Where the CPU has AMX, the direct
    mode on its tiles leads where its products are few enough (AMX_DIRECT_SHARE), else follows
    the vector modes."""
    gm, d = gemm_of(g), direct_of(g)
    out = []
    if (t := taps_of(g)) is not None:
        return [Bf16Plan(_taps_per_pass(t, isa, g["bf16_dot"]), 1, 0, g["bf16_dot"], "taps")]
    for mode in (["direct"] if d is not None else []) + (["gemm"] if g.get("groups", 1) == 1 else []):
        rows, cols = (d.OC // d.GR, d.HOUT * d.WP) if mode == "direct" else (gm.M, gm.N)
        if mode == "direct" and d.kind == "conv2d_grad_weight":
            rows, cols = d.CI * d.KH * d.KW, d.OC
        nvs = [2, 1] if cols > isa.lanes else [1]
        ranked = []
        for nv in nvs:
            most = _max_rows(isa, nv, g["bf16_dot"])
            for mr in _rows(rows, most)[: 3 if tune else 1]:
                nw = nv * isa.lanes
                nb = (_round_up(d.OC, nw) if d.kind == "conv2d_grad_weight" else
                      _direct_rows(d, _direct_mp(d, mr), nw)) if mode == "direct" else _block(gm, nw)
                ranked.append(Bf16Plan(mr, nv, nb, g["bf16_dot"], mode))
        if isa.registers < 32 and len(nvs) == 2:  # 16 registers: one column vector leaves room for rows
            ranked.sort(key=lambda p: p.nv)
        out += ranked
    if g["bf16_dot"] == "amx" and d is not None:
        tiles = _amx_direct_plans(d, isa, tune)
        ahead = _direct_cost(d, tiles[0], isa) <= AMX_DIRECT_SHARE * _direct_cost(d, out[0], isa)
        out = tiles + out if ahead else out + tiles
    if g["bf16_dot"] == "amx" and g.get("groups", 1) == 1:
        # the GEMM mode on the tiles measured 5-20x slower than the vector modes on the one AMX
        # CPU it ran on (an H100 machine's Xeon host, docs/precision.md: its im2col gathered while
        # packing): last, for the tuner to measure; the tallest and widest tile the sizes fill first
        amx = [Bf16Plan(mr, cols // isa.lanes, _block(gm, cols), "amx", "amx") for mr, cols in AMX_TILES
               if tune or ((mr == 32) == (gm.M > 16) and (cols == 32) == (gm.N > 16))]
        out = out + amx
    if dot_serves(g) and out:
        tiles = _dot_tiles(g, isa)
        dots = [Bf16Plan(mr, nr, 0, g["bf16_dot"], "dot") for _, mr, nr in tiles[: 3 if tune else 1]]
        out = dots + out if tiles[0][0] < _gemm_cost(gm, out[0], isa) else out + dots
    return out if tune else out[:1]


def _plane(d: Direct, nw: int) -> int:
    """Words of one packed phase plane of a channel pair: the grid, and past it what the last
    tile's vector loads reach (they start up to NW - 1 past the grid's last row, plus the window)."""
    return _round_up(d.HP * d.WP + nw + d.KW, 16)


def _planes(d: Direct) -> int:
    """Phase planes a channel (pair) packs."""
    return d.PHH * d.PHW


def _gw_q2p(d: Direct) -> int:
    """dy's pairs of grid positions in the direct_amx grad-weight: whole steps of 16."""
    return _round_up((d.HOUT * d.WP + 1) // 2, 16)


def _gw_pair_positions(d: Direct) -> int:
    """Positions of a phase plane in direct_amx's pair layout: what a B tile of the farthest tap
    reaches in the last step of 16 pairs (its position pair's first)."""
    shift = (d.KH - 1) // d.SH * d.WP + (d.KW - 1) // d.SW
    return _round_up(2 * _gw_q2p(d) + shift, 16)


def _gw_x_plane(d: Direct, amx: bool = False) -> int:
    """bfloat16 elements of one phase plane of a channel of x in the direct grad-weight: the grid
    and what the last position pair's window reaches past it (direct_amx: the pair layout's
    positions and the next, each position's word holding it and the next)."""
    reach = d.HP * d.WP + d.KW + 2
    if amx:
        reach = max(reach, _gw_pair_positions(d) + 16)
    return _round_up(reach, 32)


def _gw_x_words(d: Direct, plan: Bf16Plan) -> int:
    """4-byte words of one thread's x: its channels' phase planes, and for direct_amx the pair
    layout besides (every position's word of each channel, the channels padded to the tile's columns)."""
    amx = plan.mode == "direct_amx"
    words = _round_up(d.CI * _planes(d) * _gw_x_plane(d, amx) // 2, 16)
    if amx:
        words += _planes(d) * _gw_pair_positions(d) * _gw_cols(plan)
    return words


def _gw_dy_words(d: Direct, plan: Bf16Plan) -> int:
    """4-byte words of one thread's dy in the direct grad-weight: direct_amx's rows of the output
    channels on the grid (whole row tiles, whole steps of pairs), else its position pairs' words."""
    words = _round_up(d.OC, plan.mr) * _gw_q2p(d) if plan.mode == "direct_amx" else (d.HOUT * d.WP + 1) // 2 * plan.nb
    return _round_up(words, 16)


def _gw_cols(plan: Bf16Plan) -> int:
    """Columns of the direct grad-weight's sums, in whole tiles (the plan's nb): the output channels
    (direct_amx: the input channels)."""
    return plan.nb


def _stage_words(d: Direct, plan: Bf16Plan, isa: VectorISA) -> int:
    """4-byte words of one thread's stage (every channel's finished outputs of a task), 64-byte aligned."""
    return _round_up((_direct_mp(d, plan.mr) * _stage_pitch(d, plan.nb, plan.nv * isa.lanes) + 1) // 2, 16)


def _taps_layout(d: Direct, isa: VectorISA) -> dict[str, int]:
    """4-byte words of each thread's x planes and dy grid in the taps mode, 64-byte aligned."""
    qv = math.ceil(d.HOUT * d.WP / (2 * isa.lanes))
    return {"x_words": _round_up(_planes(d) * _taps_xplane(d, isa) // 2, 16) * MAX_THREADS,
            "dy_words": _round_up(qv * isa.lanes, 16) * MAX_THREADS}


def _layout(gm: Gemm, plan: Bf16Plan, isa: VectorISA, d: Direct | None = None) -> dict[str, int]:
    """Offsets (in 4-byte words, 64-byte aligned) of the scratch regions and its size."""
    if d is not None and d.kind == "conv2d_grad_weight":  # each thread's image and dy, the chunks' sums
        mp, op = _gw_rows(d, plan), _gw_cols(plan)
        sizes = {"x": _gw_x_words(d, plan) * MAX_THREADS,
                 "dy": _gw_dy_words(d, plan) * MAX_THREADS,
                 "part": min(d.G, CHUNKS) * mp * op}
    elif d is not None:  # the direct mode: the weight packed once, each thread's image and stage
        ci2, mp = _cig2x(d, plan.mode == "direct_amx"), _direct_mp(d, plan.mr)
        sizes = {"a": mp * d.KH * d.KW * ci2,
                 "x": d.GR * ci2 * _planes(d) * _plane(d, plan.nv * isa.lanes) * MAX_THREADS,
                 "stage": _stage_words(d, plan, isa) * MAX_THREADS}
    else:
        k2, mp = _pairs(gm.K, plan), _round_up(gm.M, plan.mr)
        chunks = min(gm.G, CHUNKS) if gm.reduce_groups else 0
        sizes = {"a": mp * k2 * (1 if gm.a_shared else gm.G) if not gm.reduce_groups else 0,
                 "a_thread": mp * k2 * MAX_THREADS if gm.reduce_groups else 0,
                 "b": k2 * plan.nb * MAX_THREADS,
                 "part": chunks * mp * plan.nb}
    out, at = {}, 0
    for key, words in sizes.items():
        out[key] = at
        at += _round_up(words, 16)
    out["total"] = at
    return out


def _gw_rows(d: Direct, plan: Bf16Plan) -> int:
    """Rows of the direct grad-weight's sums: (c, kh, kw) in whole row tiles; direct_amx: (tap, o),
    the output channels in whole row tiles at each tap."""
    return d.KH * d.KW * _round_up(d.OC, plan.mr) if plan.mode == "direct_amx" else _round_up(d.CI * d.KH * d.KW, plan.mr)


def _pairs(K: int, plan: Bf16Plan) -> int:
    """Pairs of k the GEMM modes pack: K's, in whole AMX k steps of 16 for the amx mode."""
    return _round_up((K + 1) // 2, 16) if plan.mode == "amx" else (K + 1) // 2


#: the AMX mode's register tiles (rows, columns): one to four 16 x 16 C tiles
AMX_TILES = ((32, 32), (16, 32), (32, 16), (16, 16))


def scratch_bytes(g: dict[str, Any], plan: Bf16Plan, isa: VectorISA) -> int:
    gm = gemm_of(g)
    _check_plan(gm, plan, isa, g["bf16_dot"], direct_of(g), g)
    if plan.mode == "dot":
        return 0
    if plan.mode == "taps":
        return 4 * sum(_taps_layout(taps_of(g), isa).values())
    d = direct_of(g) if plan.mode in ("direct", "direct_amx") else None
    if _phased(d):
        return 4 * _phased_scratch_words(gm, d, plan, isa)
    return 4 * _layout(gm, plan, isa, d)["total"]


def _check_plan(gm: Gemm, plan: Bf16Plan, isa: VectorISA, dot: str, d: Direct | None = None,
                g: dict[str, Any] | None = None) -> None:
    if plan.dot != dot:
        raise ValueError(f"plan for {plan.dot} products, the kernel's are {dot}")
    grouped = g is not None and g.get("groups", 1) != 1
    if plan.mode not in ("gemm", "amx", "direct", "direct_amx", "dot", "taps") or \
            (plan.mode in ("direct", "direct_amx") and d is None) or \
            (plan.mode == "dot" and not (g is not None and dot_serves(g))) or \
            (plan.mode in ("gemm", "amx") and grouped) or \
            (plan.mode == "taps" and not (g is not None and taps_of(g) is not None)):
        raise ValueError(f"mode {plan.mode!r} does not serve this kernel (direct, direct_amx: convolutions but a "
                         f"grouped grad-weight; dot: a @ b^T; taps: a grouped grad-weight; gemm, amx: ungrouped)")
    if plan.mode in ("amx", "direct_amx"):
        # the instructions where the CPU has them, else their arithmetic in C++ (tests)
        if dot not in ("amx", "emulated") or (dot == "amx" and isa.lanes != 16) or \
                (plan.mr, plan.nv * isa.lanes) not in AMX_TILES:
            raise ValueError(f"{plan.mode} plan {plan.mr} x {plan.nv} vectors ({dot}, {isa.name}): AMX tiles take 16 or "
                             f"32 rows and columns, with 'amx' products on avx512 (or 'emulated' ones)")
        if plan.mode == "direct_amx":
            _check_direct_rows(d, plan, isa)
            return
    if plan.mode == "taps":
        if (plan.mr, plan.nv, plan.nb) != (_taps_per_pass(taps_of(g), isa, dot), 1, 0):
            raise ValueError(f"taps plan {plan}: expected {_taps_per_pass(taps_of(g), isa, dot)} taps a pass")
        return
    if plan.mode == "dot":
        # not limited by M: the rows are a run-time size (past M the last row is computed again,
        # not stored), so a plan of one batch serves another
        per = 3 if dot == "emulated" else 1
        if not (1 <= plan.mr <= 16 and 1 <= plan.nv <= min(g["N"], isa.lanes)) or plan.nb != 0 or \
                plan.mr * plan.nv + per * plan.nv + per > isa.registers:
            raise ValueError(f"dot tile {plan.mr}x{plan.nv} (nb {plan.nb}) does not fit {isa.registers} registers "
                             f"({dot}) or the outputs")
        return
    if plan.mode == "direct":
        if plan.nv < 1 or plan.mr < 1 or plan.mr > _max_rows(isa, plan.nv, dot):
            raise ValueError(f"direct tile {plan.mr}x{plan.nv} vectors does not fit {isa.registers} registers ({dot})")
        _check_direct_rows(d, plan, isa)
        return
    if plan.mode == "gemm" and (plan.nv < 1 or plan.mr < 1 or plan.mr > _max_rows(isa, plan.nv, dot)):
        raise ValueError(f"tile {plan.mr}x{plan.nv} vectors does not fit {isa.registers} registers ({dot})")
    if plan.nb % (plan.nv * isa.lanes) or plan.nb < 1 or (gm.reduce_groups and plan.nb < gm.N):
        raise ValueError(f"column block {plan.nb} is not a multiple of the tile's {plan.nv * isa.lanes} columns")


def _check_direct_rows(d: Direct, plan: Bf16Plan, isa: VectorISA) -> None:
    # the sums' columns: the output channels in whole tiles; direct_amx: the input channels in
    # whole column tiles of 16 (a plan's 32 columns are two column tiles, of any taps)
    amx = plan.mode == "direct_amx"
    cols, tile = (d.CI, 16) if amx else (d.OC, plan.nv * isa.lanes)
    if d.kind == "conv2d_grad_weight" and plan.nb != _round_up(cols, tile):
        raise ValueError(f"direct grad-weight: nb {plan.nb} is not the {cols} {'input' if amx else 'output'} "
                         f"channels in whole tiles of {tile}")
    if d.kind != "conv2d_grad_weight" and not 1 <= plan.nb <= d.HOUT:
        raise ValueError(f"direct: {plan.nb} output rows a task, the output has {d.HOUT}")


def _phase_plan(plan: Bf16Plan, dp: Direct) -> Bf16Plan:
    return dataclasses.replace(plan, nb=min(plan.nb, dp.HOUT))


def _render_phased(name: str, gm: Gemm, d: Direct, plan: Bf16Plan, isa: VectorISA, dot: str,
                   relu_mask: bool) -> tuple[KernelSource, list[str | None]]:
    """A strided grad-input as its output phases (`grad_input_phases`), each the direct mode's
    stride-1 kernel in a namespace of its own storing its rows and columns into dx, run one after
    the other on the same scratch; phases no tap reaches are zeroed."""
    nw = plan.nv * isa.lanes
    parts, calls, zeros = [], [], []
    for a, b, dp in grad_input_phases(d):
        if dp is None:
            zeros.append((a, b))
            continue
        pplan = _phase_plan(plan, dp)
        lay = _layout(gm, pplan, isa, dp)
        code = _render("bf16_direct.j2", isa, d=dp, name=name, plan=pplan, dot=dot, CHUNKS=CHUNKS,
                       lay={**lay, "stage_words": _stage_words(dp, pplan, isa)},
                       OGP=_round_up(dp.OC // dp.GR, pplan.mr), PLANE=_plane(dp, nw), RB=pplan.nb,
                       SP=_stage_pitch(dp, pplan.nb, nw), bias=False, relu=False, relu_mask=relu_mask,
                       mask_in_copy=True, PARALLEL=_parallel("G * OC * HOUT * WOUT * CIG * KH * KW"),
                       amx=plan.mode == "direct_amx", tap_pairs=0 if plan.mode == "direct_amx" else _tap_pairs(dp),
                       phase={"a": a, "b": b, "sh": d.DH, "sw": d.DW, "h": d.HOUT, "w": d.WOUT})
        parts.append(code if not parts else code.replace(vec_prelude(isa), "", 1))
        calls.append(f"  ember_k_{name}::p{a}{b}::run(pa, pb, bias, mask, out, scratch, images);")
    zero = ""
    if zeros:
        cond = " || ".join(f"(a == {a} && b == {b})" for a, b in zeros)
        zero = f"""  // the phases no tap reaches
#pragma omp parallel for schedule(static) if(images * {d.OC * d.HOUT} >= 4096)
  for (long gr = 0; gr < images * {d.OC * d.HOUT}; ++gr) {{
    const int a = static_cast<int>(gr % {d.HOUT}) % {d.DH};
    uint16_t* __restrict__ row = out + gr * {d.WOUT};
    for (int j = 0; j < {d.WOUT}; ++j) {{
      const int b = j % {d.DW};
      if ({cond}) row[j] = 0;
    }}
  }}
"""
    wrapper = (f"static void {name}(const uint16_t* __restrict__ pa, const uint16_t* __restrict__ pb, "
               f"const uint16_t* __restrict__ bias, const uint16_t* __restrict__ mask, uint16_t* __restrict__ out, "
               f"float* __restrict__ scratch, const int64_t images) {{\n" + "\n".join(calls) + "\n" + zero + "}\n")
    roles = [d.a_role, d.b_role, None, "mask" if relu_mask else None, "out", "scratch"]
    return KernelSource(name, "\n".join(parts) + "\n" + wrapper, 4 * _phased_scratch_words(gm, d, plan, isa),
                        (d.G,)), roles


def _phased_scratch_words(gm: Gemm, d: Direct, plan: Bf16Plan, isa: VectorISA) -> int:
    return max(_layout(gm, _phase_plan(plan, dp), isa, dp)["total"] for _, _, dp in grad_input_phases(d) if dp)


def _parallel(macs: str) -> str:
    """The team's `if()`: whether a call's multiply-adds (`macs`, a C++ expression of its run-time
    sizes) are worth a team."""
    return f"(long){macs} >= {SERIAL_MACS}"


def render(name: str, g: dict[str, Any], plan: Bf16Plan, isa: VectorISA) -> tuple[KernelSource, list[str | None]]:
    """The kernel and its arguments in order as roles (None: a null pointer). The images of a
    convolution, and a matmul's batch, rows and reduced length, are its run-time sizes
    (`KernelSource.extents`), not constants of its code."""
    _check_name(name)
    gm, d = gemm_of(g), direct_of(g)
    dot = g["bf16_dot"]
    _check_plan(gm, plan, isa, dot, d, g)
    eps = g["epilogues"]
    common = dict(name=name, plan=plan, dot=dot, CHUNKS=CHUNKS)
    if plan.mode == "taps":
        t = taps_of(g)
        sizes = _taps_layout(t, isa)
        lay = {"x": 0, "dy": sizes["x_words"], "x_words": sizes["x_words"] // MAX_THREADS,
               "dy_words": sizes["dy_words"] // MAX_THREADS}
        code = _render("bf16_taps_gw.j2", isa, d=t, lay=lay, XPLANE=_taps_xplane(t, isa), **common,
                       bias=False, relu=False, relu_mask=False, mask_in_copy=False,
                       PARALLEL=_parallel("G * O * HO * WO * CG * KH * KW"))
        return KernelSource(name, code, 4 * sum(sizes.values()), (t.G,)), ["dy", "x", None, None, "out", "scratch"]
    if plan.mode == "dot":
        code = _render("bf16_dot.j2", isa, N=gm.N, **common,
                       bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps, mask_in_copy=False,
                       PARALLEL=_parallel("G * M * N * K"))
        return KernelSource(name, code, 0, (gm.G, gm.M, gm.K)), ["a", "b", "bias" if "bias" in eps else None,
                                                                  "mask" if "relu_mask" in eps else None, "out", "scratch"]
    amx = plan.mode == "direct_amx"
    if plan.mode in ("direct", "direct_amx") and d.kind == "conv2d_grad_weight":
        lay = _layout(gm, plan, isa, d)
        code = _render("bf16_direct_gw.j2", isa, d=d, lay={**lay, "x_words": _gw_x_words(d, plan), "dy_words": _gw_dy_words(d, plan)}, **common,
                       XPLANE=_gw_x_plane(d, amx), MP=_gw_rows(d, plan), amx=amx, XA=_gw_pair_positions(d),
                       OP=_gw_cols(plan), bias=False, relu=False,
                       relu_mask=False, mask_in_copy=False, PARALLEL=_parallel("G * O * HO * WO * C * KH * KW"))
        return KernelSource(name, code, 4 * lay["total"], (d.G,)), ["dy", "x", None, None, "out", "scratch"]
    if plan.mode in ("direct", "direct_amx") and _phased(d):
        return _render_phased(name, gm, d, plan, isa, dot, "relu_mask" in eps)
    if plan.mode in ("direct", "direct_amx"):
        lay = _layout(gm, plan, isa, d)
        code = _render("bf16_direct.j2", isa, d=d, **common,
                       lay={**lay, "stage_words": _stage_words(d, plan, isa)},
                       OGP=_round_up(d.OC // d.GR, plan.mr), PLANE=_plane(d, plan.nv * isa.lanes), RB=plan.nb,
                       SP=_stage_pitch(d, plan.nb, plan.nv * isa.lanes),
                       bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps, mask_in_copy=True,
                       PARALLEL=_parallel("G * OC * HOUT * WOUT * CIG * KH * KW"), amx=amx, phase=None,
                       tap_pairs=0 if amx else _tap_pairs(d))
        roles = [d.a_role, d.b_role, "bias" if "bias" in eps else None, "mask" if "relu_mask" in eps else None,
                 "out", "scratch"]
        return KernelSource(name, code, 4 * lay["total"], (d.G,)), roles
    lay = _layout(gm, plan, isa)
    # the images NI are no constant of a convolution's code: its G; a matmul's rows M and reduced
    # length K are run-time sizes too (`rt`), passed to its helpers as arguments (SZ, SA)
    conv = {k: v for k, v in zip(("C", "H", "W", "O", "KH", "KW", "SH", "SW", "PH", "PW", "HO", "WO"),
                                 _conv_sizes(g)[1:])} if gm.kind != "matmul" else {}
    rt = gm.kind == "matmul"
    # where each thread's B panel starts: past A, which grows with M, K and G where A is per GEMM
    b_at = "((long)MP * K2 * G + 15) / 16 * 16" if not (gm.a_shared or gm.reduce_groups) else str(lay["b"])
    code = _render("bf16_gemm.j2", isa, gm=gm, conv=conv, lay=lay, K2=_pairs(gm.K, plan), MP=_round_up(gm.M, plan.mr),
                   amx=plan.mode == "amx",
                   rt=rt, SZ=", const int M, const int K, const int K2" if rt else "", SA=", M, K, K2" if rt else "",
                   B_AT=b_at, MAXT=4 * MAX_THREADS, bias="bias" in eps, relu="relu" in eps,
                   relu_mask="relu_mask" in eps, mask_in_copy=False, PARALLEL=_parallel("G * M * N * K"), **common)
    roles = [gm.a_role, gm.b_role, "bias" if "bias" in eps else None, "mask" if "relu_mask" in eps else None,
             "out", "scratch"]
    return KernelSource(name, code, 4 * lay["total"], (gm.G, gm.M, gm.K) if rt else (gm.G,)), roles
