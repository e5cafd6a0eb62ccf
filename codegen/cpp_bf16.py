"""bfloat16 contractions on the CPU: every kind (matmul, conv2d, its two gradients) as batched GEMMs
of bfloat16 pairs with float32 accumulation (`templates/cpp/bf16_gemm.j2`).

Each kind is read as G GEMMs C[g] (M x N) = A[g] (M x K) . B[g] (K x N) through element accessors
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
of their code: a convolution's images, a matmul's batch, rows and reduced length; so one compiled
kernel serves every batch size, with the plan (tile, column block) of the batch it was chosen for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .cpp_kernels import MAX_THREADS, KernelSource, _check_name, _render
from .cpu_vector import VectorISA

__all__ = ["Bf16Plan", "Gemm", "gemm_of", "plans", "scratch_bytes", "render"]

#: grad-weight's fixed number of partial sums (chunks of images)
CHUNKS = 16
#: below this many multiply-adds a kernel runs on one thread (a team costs more)
SERIAL_MACS = 1 << 18


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


@dataclass(frozen=True)
class Bf16Plan:
    mr: int   # rows of the register tile
    nv: int   # column vectors of the register tile
    nb: int   # columns per block (a task packs one block of B)
    dot: str  # how pairs are multiplied: the geometry's `bf16_dot` (in the plan so dumps show it)
    mode: str = "gemm"  # "gemm" (any contraction) or "direct" (stride-1 convolutions: `Direct`)


@dataclass(frozen=True)
class Direct:
    """A stride-1 convolution read directly: OC output channels over the flat positions
    q = oh * WP + ow of a zero-padded input (HP x WP, the input placed at (PT, PL)), so that the
    input element of window offset (kh, kw) is at q + kh * WP + kw and a vector of VL consecutive
    positions is one load (no im2col; positions with ow >= WOUT are computed and dropped).
    The input is packed once per image as pairs of channels (the reduction's pairs). The
    forward reads x; grad-input is the forward of dy, padded by the kernel's overhang
    (KH - 1 - PH), with the weight flipped and its channel axes swapped."""
    kind: str
    G: int
    CI: int        # input channels (the reduction's, with KH * KW)
    OC: int        # output channels
    HIN: int
    WIN: int
    KH: int
    KW: int
    PT: int        # the input's first row (column) in the padded grid
    PL: int
    HOUT: int
    WOUT: int
    a_role: str    # the weight
    b_role: str    # the input (x, or dy)
    w_index: str   # flat index in the weight of (output channel oc, input channel c, kh, kw)
    what: str

    @property
    def HP(self) -> int:
        return self.HOUT + self.KH - 1

    @property
    def WP(self) -> int:
        return self.WOUT + self.KW - 1


def direct_of(g: dict[str, Any]) -> Direct | None:
    """The direct reading of a stride-1 convolution, else None. Grad-weight reads the same grid
    (x padded, dy over its flat positions) with the roles turned: rows (c, kh, kw), columns o,
    summed over the positions (`templates/cpp/bf16_direct_gw.j2`)."""
    if g["kind"] not in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight") or tuple(g["stride"]) != (1, 1):
        return None
    NI, C, H, W, O, KH, KW, _, _, PH, PW, HO, WO = _conv_sizes(g)
    if g["kind"] == "conv2d_grad_weight":
        return Direct("conv2d_grad_weight", NI, C, O, H, W, KH, KW, PH, PW, HO, WO, "dy", "x", "",
                      "dw[o,c,kh,kw] = sum_(n,q) dy[n,o,q] x[n,c] shifted")
    if g["kind"] == "conv2d":
        return Direct("conv2d", NI, C, O, H, W, KH, KW, PH, PW, HO, WO, "w", "x",
                      "((long)(oc * CI + c) * KH + kh) * KW + kw", "out[n,o] = sum_(c,kh,kw) w[o,c,kh,kw] x[n,c] shifted")
    if PH > KH - 1 or PW > KW - 1:
        return None  # more padding than the kernel overhangs: the padded dy would start inside dy
    return Direct("conv2d_grad_input", NI, O, C, HO, WO, KH, KW, KH - 1 - PH, KW - 1 - PW, H, W, "w", "dy",
                  "((long)(c * OC + oc) * KH + (KH - 1 - kh)) * KW + (KW - 1 - kw)",
                  "dx[n,c] = sum_(o,kh,kw) w[o,c,KH-1-kh,KW-1-kw] dy[n,o] padded and shifted")


def _direct_block(d: Direct, nw: int) -> int:
    """Columns (flat positions) per task: a whole image where the images alone give enough tasks."""
    cols = d.HOUT * d.WP
    nb = _round_up(cols, nw)
    while nb > nw and d.G * math.ceil(cols / nb) < 4 * MAX_THREADS:
        nb = _round_up(nb // 2, nw)
    return nb


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
        return Gemm(kind, G, M, N, K, "a", "b", False, False, f"return k < K ? pa[{a}] : 0u;",
                    _ROW.format(setup="", step="", value=f"pb[{b}]"),
                    "((long)g * M + m) * N + n", "n",
                    f"C[b] = {'A^T' if g['trans_a'] else 'A'}[b] @ {'B^T' if g['trans_b'] else 'B'}[b]")
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
                    "((long)g * M + m) * N + n", "m", "out[n,o,p] = sum_(c,kh,kw) w[o,c,kh,kw] x[n,c,window(p)]")
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
                    "(long)m * N + n", "m", "dw[o,c,kh,kw] = sum_(n,p) dy[n,o,p] x[n,c,window(p)]")
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
    """Columns per block: the whole N (padded) where the groups alone give enough tasks, else
    halved until there are (a block of B stays within a few hundred kB)."""
    if gm.reduce_groups:
        return _round_up(gm.N, nw)
    nb = _round_up(gm.N, nw)
    while nb > nw and (gm.G * math.ceil(gm.N / nb) < 4 * MAX_THREADS or (gm.K + 1) // 2 * nb * 4 > 512 * 1024):
        nb = _round_up(nb // 2, nw)
    return nb


def plans(g: dict[str, Any], isa: VectorISA, tune: bool = False) -> list[Bf16Plan]:
    """The cost model's plans, best first (tune: the tuner's wider list): the direct mode first
    where it applies (it gathers no windows: each input element is packed once, not KH * KW
    times), then the GEMM mode."""
    gm, d = gemm_of(g), direct_of(g)
    out = []
    for mode in (["direct"] if d is not None else []) + ["gemm"]:
        rows, cols = (d.OC, d.HOUT * d.WP) if mode == "direct" else (gm.M, gm.N)
        if mode == "direct" and d.kind == "conv2d_grad_weight":
            rows, cols = d.CI * d.KH * d.KW, d.OC
        nvs = [2, 1] if cols > isa.lanes else [1]
        ranked = []
        for nv in nvs:
            most = _max_rows(isa, nv, g["bf16_dot"])
            for mr in _rows(rows, most)[: 3 if tune else 1]:
                nw = nv * isa.lanes
                nb = (_round_up(d.OC, nw) if d.kind == "conv2d_grad_weight" else _direct_block(d, nw)) \
                    if mode == "direct" else _block(gm, nw)
                ranked.append(Bf16Plan(mr, nv, nb, g["bf16_dot"], mode))
        if isa.registers < 32 and len(nvs) == 2:  # 16 registers: one column vector leaves room for rows
            ranked.sort(key=lambda p: p.nv)
        out += ranked
    return out if tune else out[:1]


def _plane(d: Direct, nw: int) -> int:
    """Words of one packed channel pair: the padded grid, and past it what the last tile's
    vector loads reach (they start up to NW - 1 past the grid's last row, plus the window)."""
    return _round_up(d.HP * d.WP + nw + d.KW, 16)


def _gw_x_plane(d: Direct) -> int:
    """bfloat16 elements of one padded channel of x in the direct grad-weight: the grid and what
    the last position pair's window reaches past it."""
    return _round_up(d.HP * d.WP + d.KW + 2, 32)


def _gw_x_words(d: Direct) -> int:
    return _round_up(d.CI * _gw_x_plane(d) // 2, 16)


def _layout(gm: Gemm, plan: Bf16Plan, isa: VectorISA, d: Direct | None = None) -> dict[str, int]:
    """Offsets (in 4-byte words, 64-byte aligned) of the scratch regions and its size."""
    if d is not None and d.kind == "conv2d_grad_weight":  # each thread's image and dy, the chunks' sums
        mp, op = _round_up(d.CI * d.KH * d.KW, plan.mr), _round_up(d.OC, plan.nv * isa.lanes)
        sizes = {"x": _gw_x_words(d) * MAX_THREADS, "dy": (d.HOUT * d.WP + 1) // 2 * op * MAX_THREADS,
                 "part": min(d.G, CHUNKS) * mp * op}
    elif d is not None:  # the direct mode: the weight packed once, each thread's image
        ci2, mp = (d.CI + 1) // 2, _round_up(d.OC, plan.mr)
        sizes = {"a": mp * d.KH * d.KW * ci2, "x": ci2 * _plane(d, plan.nv * isa.lanes) * MAX_THREADS}
    else:
        k2, mp = (gm.K + 1) // 2, _round_up(gm.M, plan.mr)
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


def scratch_bytes(g: dict[str, Any], plan: Bf16Plan, isa: VectorISA) -> int:
    gm = gemm_of(g)
    _check_plan(gm, plan, isa, g["bf16_dot"], direct_of(g))
    return 4 * _layout(gm, plan, isa, direct_of(g) if plan.mode == "direct" else None)["total"]


def _check_plan(gm: Gemm, plan: Bf16Plan, isa: VectorISA, dot: str, d: Direct | None = None) -> None:
    if plan.dot != dot:
        raise ValueError(f"plan for {plan.dot} products, the kernel's are {dot}")
    if plan.mode not in ("gemm", "direct") or (plan.mode == "direct" and d is None):
        raise ValueError(f"mode {plan.mode!r} does not serve this kernel (direct: stride-1 convolutions)")
    if plan.mode == "direct":
        if plan.nv < 1 or plan.mr < 1 or plan.mr > _max_rows(isa, plan.nv, dot) or plan.nb % (plan.nv * isa.lanes):
            raise ValueError(f"direct tile {plan.mr}x{plan.nv} vectors, blocks of {plan.nb}: does not fit")
        return
    if plan.nv < 1 or plan.mr < 1 or plan.mr > _max_rows(isa, plan.nv, dot):
        raise ValueError(f"tile {plan.mr}x{plan.nv} vectors does not fit {isa.registers} registers ({dot})")
    if plan.nb % (plan.nv * isa.lanes) or plan.nb < 1 or (gm.reduce_groups and plan.nb < gm.N):
        raise ValueError(f"column block {plan.nb} is not a multiple of the tile's {plan.nv * isa.lanes} columns")


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
    _check_plan(gm, plan, isa, dot, d)
    eps = g["epilogues"]
    common = dict(name=name, plan=plan, dot=dot, CHUNKS=CHUNKS)
    if plan.mode == "direct" and d.kind == "conv2d_grad_weight":
        lay = _layout(gm, plan, isa, d)
        code = _render("bf16_direct_gw.j2", isa, d=d, lay={**lay, "x_words": _gw_x_words(d)}, **common,
                       XPLANE=_gw_x_plane(d), MP=_round_up(d.CI * d.KH * d.KW, plan.mr),
                       OP=_round_up(d.OC, plan.nv * isa.lanes), bias=False, relu=False, relu_mask=False,
                       PARALLEL=_parallel("G * O * HO * WO * C * KH * KW"))
        return KernelSource(name, code, 4 * lay["total"], (d.G,)), ["dy", "x", None, None, "out", "scratch"]
    if plan.mode == "direct":
        lay = _layout(gm, plan, isa, d)
        code = _render("bf16_direct.j2", isa, d=d, lay=lay, CI2=(d.CI + 1) // 2, **common,
                       MP=_round_up(d.OC, plan.mr), PLANE=_plane(d, plan.nv * isa.lanes),
                       bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps,
                       PARALLEL=_parallel("G * OC * HOUT * WOUT * CI * KH * KW"))
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
    code = _render("bf16_gemm.j2", isa, gm=gm, conv=conv, lay=lay, K2=(gm.K + 1) // 2, MP=_round_up(gm.M, plan.mr),
                   rt=rt, SZ=", const int M, const int K, const int K2" if rt else "", SA=", M, K, K2" if rt else "",
                   B_AT=b_at, bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps,
                   PARALLEL=_parallel("G * M * N * K"), **common)
    roles = [gm.a_role, gm.b_role, "bias" if "bias" in eps else None, "mask" if "relu_mask" in eps else None,
             "out", "scratch"]
    return KernelSource(name, code, 4 * lay["total"], (gm.G, gm.M, gm.K) if rt else (gm.G,)), roles
