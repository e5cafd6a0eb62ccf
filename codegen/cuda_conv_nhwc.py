"""The `nhwc_tc` family of the CUDA choice table: convolutions as an implicit GEMM over
channels-innermost operands on tensor cores (template `templates/cuda/conv_nhwc_tc.j2`): bfloat16
operands (precision "bf16") on mma.m16n8k16, float32 ones on mma.m16n8k8 as 3xTF32 (float32's
accuracy, as `gemm_x3`) or, under precision "tf32", one TF32 product.

ember's other convolution kernels read NCHW operands, where a GEMM row's k = (c, kh, kw) is
gathered an element at a time: the bfloat16 ones top out near 100 TFLOP/s on an H100
(docs/benchmarks.md, session 37). Here the kernel first copies its source to a zero-bordered NHWC
image and the weights to [o][kh][kw][c] in its scratch block, so a row's k = (kh, kw, c) runs as
16-byte chunks of channels: cp.async copies without bounds checks, STAGES deep, into
XOR-swizzled 64-byte tile rows read by ldmatrix (its standalone ancestor measured 200-310
TFLOP/s for the bfloat16 GEMMs; tools/cuda_conv_nhwc_lab.py times the family's kernels beside cuDNN). A plan is the block tile BM x BN, its warps WM x WN, the
pipeline depth and (grad-weight) the split count:

- forward (any stride, padding) and grad-input (stride 1: the forward convolution of dy bordered
  by K - 1 - padding with the weights flipped and transposed): m = output pixels, n = output
  channels; the value (bfloat16: rounded to bfloat16), then the template's and the generated
  epilogues at the NCHW index;
- grad-weight: m = output channels, n = (kh, kw, c), k = pixels (dy relaid to [pixel][o]), split
  SPLITS ways over the pixels; tiles [pixel][channel] read by ldmatrix.trans (bfloat16) or by
  scalar reads of rows padded by 8 floats (ldmatrix.trans would split a float's halves); the fp32
  partials summed in split order by a last launch (no atomics: the same bits every run), then
  (bfloat16) rounded, then the epilogue.

The relaid operands' channel counts must be whole 16-byte runs (8 bfloat16, 4 floats). The sums
run over k in order within a split, in fp32. Taken where the tuner measured it faster, never by
default; the relayouts are launches of their own for now (a producer's epilogue writing NHWC
would save them). Family `nhwc_wg` (plans with `WG=1`) runs the same kernels' GEMMs on Hopper's
warpgroup MMA (templates/cuda/conv_nhwc_wg.j2) and relays its operands as 64 x 64 tiles of
pixels and channels (`to_nhwc_tiles`, 4-byte writes), where nhwc_tc's relayout blocks a bordered
row each; the two relayouts are timed side by side by tools/cuda_conv_nhwc_lab.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from .cuda_kernels import (IMAGE_ROLES, SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, conv_roles,
                           kernel_signature, with_epilogue)
from .device import current
from .shapes import ceil_div, pair, round_up
from .templates_env import environment

__all__ = ["KINDS", "WG_KINDS", "NhwcPlan", "serves", "plans", "wg_serves", "wg_plans", "scratch_bytes", "render",
           "shares_image", "shared_choice", "unshared", "own_plan", "image_bytes"]

KINDS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
#: k a stage: 64-byte forward tile rows (32 bfloat16, 16 floats); as many pixels a grad-weight stage
BK = {"bf16": 32, "tf32": 16, "x3": 16}
#: bytes of a warpgroup-MMA tile row (64 bfloat16: k a stage; the 128-byte swizzle)
WG_ROW = 128
#: the kinds warpgroup MMA serves (a grad-weight's tiles [pixel][channel] as MN-major operands)
WG_KINDS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
#: pixels a warpgroup-MMA grad-weight's k-tile
WG_BK = 64
#: epilogues that read an operand at every output element (a staged plan's stores serve them)
PER_ELEMENT_EPILOGUES = frozenset({"pointwise", "relu_mask"})
#: scratch a kernel may take for its relaid operands and partials
MAX_SCRATCH = 4 << 30
#: bytes of shared memory a relayout block stages a source row's channels in
_RELAYOUT_STAGE = 16 * 1024
_env = environment("cuda")
#: what each precision runs on (the kernels' descriptions)
_ON = {"bf16": "bfloat16 tensor cores", "tf32": "TF32 tensor cores", "x3": "TF32 tensor cores as 3xTF32"}


@dataclass(frozen=True)
class NhwcPlan:
    BM: int      # block tile rows (forward: output pixels; grad-weight: output channels)
    BN: int      # block tile columns (forward: output channels; grad-weight: (kh, kw, c))
    WM: int      # warps along the rows
    WN: int      # warps along the columns
    STAGES: int  # k-tiles in flight (cp.async)
    SPLITS: int = 1  # grad-weight: ranges of pixels summed apart (their partials added in order)
    WG: int = 0  # 1: warpgroup MMA (family nhwc_wg): BM / 64 warpgroups, WM = BM / 16 warps of 16 rows, WN = 1
    ST: int = 0  # 1: a forward or grad-input with per-element epilogues stores through shared memory
    # (`staged_stores`; warpgroup-MMA plans always do)
    # Never tuned, set by the pass pairing kernels (passes/share_relayouts.py, `shared_choice`): a
    # grad-weight reads, instead of relaying its operand itself, the bordered image another kernel
    # relaid to the start of its scratch (launch roles IMAGE_ROLES)
    XI: int = 0   # 1: x's image, a forward's of the same x
    DYI: int = 0  # 1: dy's image, a grad-input's of the same dy (bordered by K - 1 - padding)

    @property
    def images(self) -> tuple[str, ...]:
        """The launch roles of the other kernels' images this plan reads (`SHARED_IMAGES`)."""
        return tuple(role for field, role in SHARED_IMAGES.values() if getattr(self, field))

    @property
    def threads(self) -> int:
        return 32 * self.WM * self.WN

    def shared_bytes(self, g: dict[str, Any]) -> int:
        """Dynamic shared memory of the GEMM launch: STAGES k-tiles of both operands (a float32
        grad-weight's rows padded by 8 floats)."""
        if self.WG:  # 128-byte rows, and the slack that aligns the tiles to 1024 bytes (the swizzle);
            # a forward's or grad-input's output tile may be staged there after the GEMM
            staged = 0 if g["kind"] == "conv2d_grad_weight" else self.staged_tile_bytes()
            return max(self.STAGES * (self.BM + self.BN) * WG_ROW, staged) + 1024
        if g["kind"] == "conv2d_grad_weight" and precision(g) != "bf16":
            return self.STAGES * BK["x3"] * (self.BM + self.BN + 16) * 4
        return max(self.STAGES * (self.BM + self.BN) * 64, self.staged_tile_bytes() if self.ST else 0)

    def staged_tile_bytes(self) -> int:
        """A block's output tile staged in shared memory: BN rows of BM + 4 floats."""
        return self.BN * (self.BM + 4) * 4

    def tiles(self, gw: bool) -> bool:
        """Whether the template's warp tiling and its copies' division among the threads hold."""
        if self.images and not gw:
            return False
        if self.WG:  # warpgroups of 64 rows; a 128-byte row is 8 chunks; m64nNk16 takes N <= 256;
            # a grad-weight's operands are atoms of 64 channels
            return (gw or self.SPLITS == 1) and self.BM % 64 == 0 and self.WM * 16 == self.BM and self.WN == 1 \
                and self.BN % (64 if gw else 16) == 0 and 16 <= self.BN <= 256 and self.STAGES >= 3 \
                and (8 * self.BM) % self.threads == 0 and (8 * self.BN) % self.threads == 0
        fm, fn = self.BM // (self.WM * 16), self.BN // (self.WN * 8)
        if fm < 1 or fn < 2 or fn % 2 or fm * 16 * self.WM != self.BM or fn * 8 * self.WN != self.BN:
            return False
        if gw:
            return self.BM % 64 == 0 and self.BN % 64 == 0 and (4 * self.BM) % self.threads == 0 \
                and (4 * self.BN) % self.threads == 0
        # a 64-byte tile row is 4 chunks: 4 BM of the A tile a stage, 4 BN of the B tile
        return self.SPLITS == 1 and (4 * self.BM) % self.threads == 0 and (4 * self.BN) % self.threads == 0


#: (BM, BN, WM, WN, STAGES) of the forward and grad-input, by the output channels' block width
_FORWARD = {
    128: ((128, 128, 2, 4, 3), (128, 128, 2, 4, 4), (64, 128, 2, 4, 4), (256, 128, 4, 2, 3)),
    64: ((128, 64, 4, 2, 4), (256, 64, 4, 2, 3), (64, 64, 2, 2, 4)),
    32: ((128, 32, 4, 1, 4), (256, 32, 4, 1, 4), (64, 32, 2, 1, 4)),
    16: ((64, 16, 2, 1, 4), (128, 16, 4, 1, 4)),
}
#: (BM, BN, WM, WN, STAGES) of the grad-weight, by the output channels' block height
_GRAD_WEIGHT = {
    128: ((128, 128, 2, 4, 3), (128, 128, 2, 4, 4), (64, 128, 2, 4, 4), (128, 64, 4, 2, 4)),
    64: ((64, 128, 2, 4, 4), (64, 64, 2, 2, 4)),
}


#: (BM, BN, STAGES) of the warpgroup-MMA forward and grad-input, by the output channels' block width;
#: the blocks of one warpgroup (BM 64) last: a small batch's few pixels fill the multiprocessors
#: with them (a 7 x 7 layer at batch 64, 3136 pixels, is 25 row tiles of 128: 50 blocks of 128 x 128
#: on an H100's 132 multiprocessors, 108 TFLOP/s where batch 1024's ran at 283)
_WARPGROUP = {
    256: ((128, 256, 3), (128, 256, 4), (128, 128, 4), (256, 128, 3), (64, 256, 4), (64, 128, 4), (64, 64, 4)),
    128: ((128, 128, 4), (128, 128, 3), (256, 128, 3), (64, 128, 4), (64, 64, 4)),
    64: ((128, 64, 4), (256, 64, 4), (128, 64, 6), (64, 64, 4)),
    32: ((128, 32, 4), (128, 32, 6), (64, 32, 4)),
}
#: (BM, BN, STAGES) of the warpgroup-MMA grad-weight (m = output channels, n = (kh, kw, c)), by the
#: output channels' block height: n of 192 is a 3x3 window of 64 channels in three tiles
_WARPGROUP_GW = {
    128: ((128, 256, 4), (128, 192, 4), (128, 128, 4)),
    64: ((64, 256, 4), (64, 192, 4), (64, 128, 4)),
}


def problem(g: dict[str, Any]) -> dict[str, int]:
    """The template's sizes: the GEMM's source image (CI x HI x WI, bordered PH / PW) and output
    (CO x HO x WO) at stride SH / SW. A grad-input's source is dy and its output the layer's input."""
    sh, sw = pair(g["stride"], "stride")
    ph, pw = pair(g["padding"], "padding")
    common = dict(N=g["N"], KH=g["KH"], KW=g["KW"])
    if g["kind"] == "conv2d_grad_input":
        return dict(common, CI=g["O"], HI=g["HO"], WI=g["WO"], CO=g["C"], HO=g["H"], WO=g["W"],
                    PH=g["KH"] - 1 - ph, PW=g["KW"] - 1 - pw, SH=1, SW=1)
    return dict(common, CI=g["C"], HI=g["H"], WI=g["W"], CO=g["O"], HO=g["HO"], WO=g["WO"], PH=ph, PW=pw, SH=sh, SW=sw)


def precision(g: dict[str, Any]) -> str:
    """How the kernel multiplies: "bf16" (bfloat16 operands, mma.m16n8k16), "tf32" (float32
    operands rounded to TF32, precision "tf32") or "x3" (float32 as 3xTF32: float32's accuracy)."""
    return "bf16" if g.get("dtype") == "bfloat16" else "tf32" if g["tf32"] else "x3"


def element_bytes(g: dict[str, Any]) -> int:
    return 2 if precision(g) == "bf16" else 4


def _width_class(n: int, classes) -> int:
    """The block width of a GEMM dimension of n: the least class >= n, at most the widest."""
    return next((c for c in sorted(classes) if c >= n), max(classes))


def _split_counts(g: dict[str, Any], q: dict[str, int], bm: int, bn: int, wg: bool = False) -> list[int]:
    """Split counts worth measuring for a grad-weight blocking, each split at least 8 k-tiles of
    pixels long: mma.sync's about two and four blocks a multiprocessor (powers of two: several
    blocks share one); warpgroup MMA's (`wg`: one block a multiprocessor, k-tiles of `WG_BK`
    pixels) the most that fill one and two whole waves, where a power of two would leave a last
    wave nearly empty (36 tiles by 4 splits: 144 blocks on 132 multiprocessors)."""
    tiles = ceil_div(q["CO"], bm) * ceil_div(q["KH"] * q["KW"] * q["CI"], bn)
    k_tiles = ceil_div(q["N"] * q["HO"] * q["WO"], WG_BK if wg else BK[precision(g)])
    most = max(1, min(k_tiles // 8, 256))
    out = []
    for waves in ((1, 2) if wg else (2, 4)):
        fill = waves * current().multiprocessors // tiles
        s = max(1, fill) if wg else 1 << max(0, fill.bit_length() - 1)
        out.append(min(s, most))
    return list(dict.fromkeys(out))


def plans(g: dict[str, Any]) -> list[NhwcPlan]:
    """Every plan the tuner measures, the first the one a stamp-less render takes."""
    q = problem(g)
    limit = current().shared_per_block_optin
    if g["kind"] == "conv2d_grad_weight":
        found = [NhwcPlan(*b, SPLITS=s) for b in _GRAD_WEIGHT[_width_class(q["CO"], _GRAD_WEIGHT)]
                 for s in _split_counts(g, q, b[0], b[1])]
    else:
        width = _width_class(q["CO"], _FORWARD)
        blockings = _FORWARD[width] + (_FORWARD[64] if width == 128 and q["CO"] >= 256 else ())
        found = [NhwcPlan(*b) for b in blockings]
        if PER_ELEMENT_EPILOGUES & set(g.get("epilogues", ())):  # each blocking with its stores staged too
            found += [replace(p, ST=1) for p in found]
    gw = g["kind"] == "conv2d_grad_weight"
    return [p for p in found if p.tiles(gw) and p.shared_bytes(g) <= limit]


def wg_plans(g: dict[str, Any]) -> list[NhwcPlan]:
    """Every warpgroup-MMA plan the tuner measures (family `nhwc_wg`), the first a stamp-less render's."""
    q = problem(g)
    if g["kind"] == "conv2d_grad_weight":
        found = [NhwcPlan(bm, bn, bm // 16, 1, stages, SPLITS=s, WG=1)
                 for bm, bn, stages in _WARPGROUP_GW[_width_class(q["CO"], _WARPGROUP_GW)]
                 for s in _split_counts(g, q, bm, bn, wg=True)]
    else:
        found = [NhwcPlan(bm, bn, bm // 16, 1, stages, WG=1)
                 for bm, bn, stages in _WARPGROUP[_width_class(q["CO"], _WARPGROUP)]]
    limit = current().shared_per_block_optin
    gw = g["kind"] == "conv2d_grad_weight"
    return [p for p in found if p.tiles(gw) and p.shared_bytes(g) <= limit]


def wg_serves(g: dict[str, Any]) -> str | None:
    """None where the warpgroup-MMA family `nhwc_wg` serves a convolution of geometry `g`, else why not."""
    if g["kind"] not in WG_KINDS:
        return "it serves convolutions"
    if precision(g) != "bf16":
        return "it serves bfloat16 operands"
    if not current().wgmma:
        return f"warpgroup MMA needs compute capability 9.0 (sm_90a); {current().name} has not"
    why = serves(g)
    if why is not None:
        return why
    return None if wg_plans(g) else "no warpgroup blocking fits"


def serves(g: dict[str, Any]) -> str | None:
    """None where the family serves a convolution of geometry `g` (the CUDA table's), else why not."""
    if g["kind"] not in KINDS:
        return "it serves convolutions"
    if g.get("groups", 1) != 1:
        return "it serves ungrouped convolutions"
    run = 16 // element_bytes(g)  # channels a 16-byte copy
    channels = {"conv2d": ("C",), "conv2d_grad_input": ("O",), "conv2d_grad_weight": ("C", "O")}[g["kind"]]
    if any(g[c] % run for c in channels):
        return (f"its operands are 16-byte runs of channels ({run} a run): "
                f"{' and '.join(f'{c} = {g[c]}' for c in channels)} not a multiple of {run}")
    ph, pw = pair(g["padding"], "padding")
    if g["kind"] == "conv2d_grad_input" and (pair(g["stride"], "stride") != (1, 1) or ph >= g["KH"] or pw >= g["KW"]):
        return "its grad-input serves stride 1 with padding smaller than the kernel (a forward convolution of dy)"
    q = problem(g)
    if g["N"] * q["HO"] * q["WO"] >= 2**31 or g["N"] * (q["HI"] + 2 * q["PH"]) >= 2**31:
        return "too many output pixels for its 32-bit pixel index"
    if not plans(g):
        return "no blocking fits"
    if scratch_bytes(g, plans(g)[0]) > MAX_SCRATCH:
        return f"its relaid operands would take more than {MAX_SCRATCH >> 30} GB of scratch"
    return None


def _regions(g: dict[str, Any], plan: NhwcPlan) -> dict[str, int]:
    """Byte offsets of the scratch regions (src: the bordered NHWC source; wt: the relaid weights;
    dyt: a grad-weight's dy as [pixel][o]; part: its split partials) and the total ("end")."""
    q, e = problem(g), element_bytes(g)
    src = 0 if plan.XI else image_bytes(g)
    kdim = q["KH"] * q["KW"] * q["CI"]
    at = round_up(src, SCRATCH_ALIGN)
    if g["kind"] != "conv2d_grad_weight":
        return dict(src=0, wt=at, dyt=0, part=0, end=at + round_up(e * q["CO"] * kdim, SCRATCH_ALIGN))
    dyt = 0 if plan.DYI else round_up(e * q["N"] * q["HO"] * q["WO"] * q["CO"], SCRATCH_ALIGN)
    return dict(src=0, wt=0, dyt=at, part=at + dyt, end=at + dyt + round_up(4 * plan.SPLITS * q["CO"] * kdim, SCRATCH_ALIGN))


def image_bytes(g: dict[str, Any]) -> int:
    """Bytes of the kernel's bordered NHWC source image (the scratch block's first region)."""
    q = problem(g)
    return element_bytes(g) * q["N"] * (q["HI"] + 2 * q["PH"]) * (q["WI"] + 2 * q["PW"]) * q["CI"]


def shares_image(owner: dict[str, Any], grad_weight: dict[str, Any]) -> str | None:
    """None where a grad-weight of geometry `grad_weight` may read the bordered image that a kernel
    of geometry `owner` relays to the start of its scratch block, else why not: a forward's of
    the same x (`XI` plans), or a stride-1 grad-input's of the same dy, bordered by K - 1 -
    padding (`DYI`: the grad-weight reads dy's rows past the border). One relayout of the operand a
    step, not two. The images are the same bytes when their sizes, borders and element agree
    (nhwc_tc's and nhwc_wg's relayouts write one layout)."""
    if grad_weight["kind"] != "conv2d_grad_weight" or owner["kind"] not in ("conv2d", "conv2d_grad_input"):
        return "a forward's or a grad-input's image serves a grad-weight"
    a, b = problem(owner), problem(grad_weight)
    if owner["kind"] == "conv2d":
        want = {k: b[k] for k in ("N", "CI", "HI", "WI", "PH", "PW")}
    else:
        if serves(owner) is not None:
            return f"the grad-input is not this family's: {serves(owner)}"
        want = dict(N=b["N"], CI=b["CO"], HI=b["HO"], WI=b["WO"], PH=b["KH"] - 1 - b["PH"], PW=b["KW"] - 1 - b["PW"])
    differ = [k for k, v in want.items() if a[k] != v]
    if differ:
        return f"their images differ in {', '.join(differ)}"
    if precision(owner) != precision(grad_weight):
        return "their operands' precisions differ"
    return None


#: the families whose kernels relay their source to the start of their scratch (`_regions`)
FAMILIES = ("nhwc_tc", "nhwc_wg")
#: by the kind of the kernel that relays an image: the plan field of a grad-weight reading it (never
#: a tuned plan's: `shared_choice` adds it to a chosen one) and the launch role that passes it
SHARED_IMAGES = {"conv2d": ("XI", "x_image"), "conv2d_grad_input": ("DYI", "dy_image")}
assert {role for _, role in SHARED_IMAGES.values()} <= set(IMAGE_ROLES), "codegen/cuda.py binds these roles"


def own_plan(plan: tuple) -> tuple:
    """A stamped plan without the shared-image fields: the family's own plan, as `select` stamped
    it and the tuner measured it (`Family.own_plan`)."""
    shared = {field for field, _ in SHARED_IMAGES.values()}
    return tuple((k, v) for k, v in plan if k not in shared)


def unshared(choice: tuple[str, tuple]) -> tuple[str, tuple]:
    return choice[0], own_plan(choice[1])


def shared_choice(owner: dict[str, Any], owner_choice: tuple[str, tuple] | None,
                  grad_weight: dict[str, Any], gw_choice: tuple[str, tuple] | None
                  ) -> tuple[str, tuple[str, tuple], int] | None:
    """(the launch role of the image, the grad-weight's choice reading it from the owner's scratch,
    its scratch bytes) where both kernels are of these families and `shares_image` allows; else
    None. The grad-weight's choice may already read the other operand's image."""
    if owner_choice is None or gw_choice is None or owner_choice[0] not in FAMILIES \
            or gw_choice[0] not in FAMILIES or shares_image(owner, grad_weight) is not None:
        return None
    field, role = SHARED_IMAGES[owner["kind"]]
    plan = replace(NhwcPlan(**dict(gw_choice[1])), **{field: 1})
    return role, (gw_choice[0], stamped(plan)), scratch_bytes(grad_weight, plan)


def staged_stores(plan: NhwcPlan, kind: str, relu_mask: bool, epilogue: PointwiseEpilogue | None) -> bool:
    """Whether a kernel stores its output through shared memory: a forward or grad-input whose
    epilogues read operands at every element (the ReLU mask, a generated epilogue), on warpgroup
    MMA always (its 128 accumulators a thread would otherwise each get an unrolled copy of the
    epilogue, reading its operands 8 pixels of 4 channels at a time: airbench's BatchNorm + GELU
    grad-inputs measured slower than nhwc_tc's that way), on mma.sync where the plan says (`ST`,
    measured beside the direct stores)."""
    return bool(plan.WG or plan.ST) and kind != "conv2d_grad_weight" and (relu_mask or epilogue is not None)


#: pixels of a channel a lane stores at once through shared memory (`staged_store_lines`)
STAGED_ROWS = 4
_DEFINES = re.compile(r"^\s*const\s+[\w ]+?\s+(\w+)\s*=")
_OPERAND_READ = re.compile(r"\bin\d+\[")
_WORD = re.compile(r"\b\w+\b")


def _staged_rows(bm: int) -> int:
    """Pixels a lane stores at once from a tile of `bm` rows: at most STAGED_ROWS, 32 times it
    dividing the tile (the loop's pixels never pass the tile's last row)."""
    rows = min(STAGED_ROWS, bm // 32)
    while bm % (32 * rows):
        rows -= 1
    return rows


def own_epilogue_lines(*, bf16: bool, bias: bool, relu: bool, mask: str) -> list[str]:
    """The template's own epilogues of `v`, the value at channel o: the bias, ReLU, and the ReLU
    mask read as `mask` (an expression; empty: no mask). One spelling for the staged and the
    direct stores."""
    lines = []
    if bias:
        lines.append("v = em_bf16_round(v + p.bias[o]);" if bf16 else "v += p.bias[o];")
    if relu:
        lines.append("v = v < 0.f ? 0.f : v;")
    if mask:
        lines.append(f"v = {mask} > 0.f ? v : 0.f;")
    return lines


def staged_store_lines(rows: int, *, bf16: bool, bias: bool, relu: bool, relu_mask: bool,
                       epilogue: PointwiseEpilogue | None, index_type: str) -> list[str]:
    """The body of a staged store loop over a channel's tile row (`o`, row `c` of `tile`) for the
    `rows` pixels m0 + r0 + lane + 32 u (u < rows) of a lane: first every pixel's index and its
    per-element operand reads (the epilogue's, the ReLU mask's), then the values, then the stores.
    Pixel by pixel, each read waited for the last store (the output may be an operand, so no
    compiler moves a read above a store): airbench's BatchNorm + GELU grad-inputs spent longer in
    these loops than in their GEMMs. A read is moved ahead only where it depends on indices and
    other moved reads; an element is still read before it is written."""
    per_element = list(epilogue.by_channel[1]) if epilogue is not None and epilogue.by_channel else []
    defined = {m.group(1) for line in per_element if (m := _DEFINES.match(line))}
    local = defined | {"red", "v", "m", "img", "pix", "oi", "live", "mask"}
    early, late, late_names = [], [], {"red", "v"}
    for line in per_element:
        names = set(_WORD.findall(line))
        m = _DEFINES.match(line)
        if _OPERAND_READ.search(line) and not names & late_names:
            early.append(line)
        else:
            late.append(line)
            if m:
                late_names.add(m.group(1))

    def ours(line: str, u: int) -> str:
        return _WORD.sub(lambda w: f"{w.group(0)}_{u}" if w.group(0) in local else w.group(0), line)

    first, values, stores = [], [], []
    for u in range(rows):
        at = f"r0 + lane + {32 * u}"
        first += [ours(f"const int m = m0 + {at};", u), ours("const bool live = m < MDIM;", u),
                  ours(f"const {index_type} img = (live ? m : m0) / HWO, pix = (live ? m : m0) % HWO;", u),
                  ours("const long long oi = ((long long)img * CO + o) * HWO + pix;", u)]
        if relu_mask:
            first.append(ours("const float mask = p.mask_src[oi];", u))
        first += [ours(line, u) for line in early]
        v = f"tile[c * TILE_LD + {at}]"
        body = [f"float v = {f'em_bf16_round({v})' if bf16 else v};",
                *own_epilogue_lines(bf16=bf16, bias=bias, relu=relu, mask="mask" if relu_mask else "")]
        if epilogue is not None and epilogue.by_channel:
            body += ["const float red = v;", *late, f"v = {epilogue.by_channel[2]};"]
        elif epilogue is not None:
            body.append("v = pw_epilogue(p, oi, v);")
        values += [ours(line, u) for line in body]
        stores.append(ours("if (live) p.out[oi] = v;", u))
    return first + values + stores


def scratch_bytes(g: dict[str, Any], plan: NhwcPlan) -> int:
    return _regions(g, plan)["end"]


def render(name: str, g: dict[str, Any], plan: NhwcPlan, *, bias: bool = False, relu: bool = False,
           relu_mask: bool = False, epilogue: PointwiseEpilogue | None = None,
           bf16_roles: frozenset[str] = frozenset()) -> CudaKernel:
    """The kernel: roles x, w, [bias], out (forward), dy, w, [mask_src], out (grad-input) or x,
    dy, out (grad-weight), then a generated epilogue's, and the scratch block. `bf16_roles`: the
    roles holding bfloat16 (the convolution's operands, where the geometry's dtype is bfloat16;
    else none of them)."""
    kind, why_not = g["kind"], serves(g)
    if why_not is not None:
        raise ValueError(f"nhwc_tc does not serve this convolution: {why_not}")
    gw = kind == "conv2d_grad_weight"
    roles, inputs, src = conv_roles("nhwc_tc", kind, bias=bias, relu=relu, relu_mask=relu_mask)
    images = plan.images
    if images and not gw:
        raise ValueError(f"{name}: a plan reading another kernel's image (XI, DYI) is a grad-weight's")
    if not plan.tiles(gw) or plan.shared_bytes(g) > current().shared_per_block_optin:
        raise ValueError(f"{name}: {plan} does not tile the nhwc_tc {kind} kernel")
    if plan.WG and wg_serves(g) is not None:
        raise ValueError(f"nhwc_wg does not serve this convolution: {wg_serves(g)}")
    q, regions = problem(g), _regions(g, plan)
    staged, rows = staged_stores(plan, kind, relu_mask, epilogue), _staged_rows(plan.BM)
    prec, e = precision(g), element_bytes(g)
    operands = {"x", "dy"} if gw else {src, "w"}
    if (operands & bf16_roles) != (operands if prec == "bf16" else set()):
        raise ValueError(f"{name}: the nhwc_tc kernel of {prec} takes {'bfloat16' if prec == 'bf16' else 'float32'} "
                         f"operands; the bfloat16 roles are {sorted(operands & bf16_roles)}")
    roles, inputs, unrestricted = with_epilogue(roles, inputs, epilogue)
    ph, pw = pair(g["padding"], "padding")
    sh, sw = pair(g["stride"], "stride")
    what = {"conv2d": "forward", "conv2d_grad_input": "grad-input", "conv2d_grad_weight": "grad-weight"}[kind]
    description = (f"conv2d {what} x({g['N']},{g['C']},{g['H']},{g['W']}) w({g['O']},{g['C']},{g['KH']},{g['KW']}) "
                   f"stride ({sh},{sw}) padding ({ph},{pw}){' +bias' if bias else ''}{' +relu' if relu else ''}"
                   f"{' *relu-mask' if relu_mask else ''}, channels-innermost GEMM on {_ON[prec]}, "
                   + (f"warpgroup MMA, blocks {plan.BM}x{plan.BN}, {plan.BM // 64} warpgroups, " if plan.WG else
                      f"blocks {plan.BM}x{plan.BN}, warps {plan.WM}x{plan.WN}, ")
                   + f"{plan.STAGES} stages"
                   f"{f', {plan.SPLITS} splits' if gw else ''}"
                   f"{', the output staged in shared memory by channel' if staged else ''}"
                   f"{', x read from the image a forward relaid' if plan.XI else ''}"
                   f"{', dy read from the image a grad-input relaid' if plan.DYI else ''}")
    widest = max(q["WI"], q["WO"] if gw else 0)
    rch = min(round_up(max(q["CI"], q["CO"] if gw else 0), 8), max(8, _RELAYOUT_STAGE // (e * widest) - 2) // 8 * 8)
    code = _env.get_template("conv_nhwc_tc.j2").render(
        name=name, description=description, **q, BM=plan.BM, BN=plan.BN, WM=plan.WM, WN=plan.WN,
        STAGES=plan.STAGES, SPLITS=plan.SPLITS, threads=plan.threads, RCH=rch, off_src=regions["src"] // e, off_wt=regions["wt"] // e,
        off_dyt=regions["dyt"] // e, off_part=regions["part"] // 4, gw=gw, flip=kind == "conv2d_grad_input",
        src=src, roles=roles, inputs=inputs, unrestricted=unrestricted, bf16_roles=bf16_roles,
        signature=kernel_signature(roles, inputs, unrestricted, True, bf16_roles)
        + "".join(f", const float* __restrict__ {r}" for r in images), images=images, bias=bias, relu=relu,
        relu_mask=relu_mask, pw=epilogue, bf16=prec == "bf16", x3=prec == "x3", wg=bool(plan.WG),
        staged=staged, staged_bytes=plan.shared_bytes(g) - (1024 if plan.WG else 0),
        index_type=epilogue.index_type if epilogue is not None else "int",
        own_lines=own_epilogue_lines(bf16=prec == "bf16", bias=bias, relu=relu,
                                     mask="p.mask_src[oi]" if relu_mask else ""),
        staged_rows=rows,
        staged_lines=staged_store_lines(rows, bf16=prec == "bf16", bias=bias, relu=relu,
                                        relu_mask=relu_mask, epilogue=epilogue,
                                        index_type=epilogue.index_type if epilogue is not None else "int")
        if staged else [])
    args = tuple(roles) + ("scratch",) + images
    hp = q["HI"] + 2 * q["PH"]
    kdim = q["KH"] * q["KW"] * q["CI"]
    pixels = q["N"] * q["HO"] * q["WO"]
    relay_src = Launch(f"{name}_src", _relayout_grid(q["N"], q["CI"], q["HI"], q["WI"], q["PH"], q["PW"], plan),
                       (256, 1, 1), 0, args)
    block = (plan.threads, 1, 1)
    if gw:
        grid = (ceil_div(q["CO"], plan.BM), ceil_div(kdim, plan.BN), plan.SPLITS)
        relay_dy = Launch(f"{name}_dy", _relayout_grid(q["N"], q["CO"], q["HO"], q["WO"], 0, 0, plan), (256, 1, 1), 0, args)
        launches = (*(() if plan.DYI else (relay_dy,)),
                    *(() if plan.XI else (relay_src,)),
                    Launch(f"{name}_gemm", grid, block, plan.shared_bytes(g), args),
                    Launch(f"{name}_reduce", (ceil_div(q["CO"] * kdim, 256), 1, 1), (256, 1, 1), 0, args))
    else:
        grid = (ceil_div(pixels, plan.BM), ceil_div(q["CO"], plan.BN), 1)
        launches = (relay_src, Launch(f"{name}_wt", (ceil_div(q["CO"] * kdim, 256), 1, 1), (256, 1, 1), 0, args),
                    Launch(f"{name}_gemm", grid, block, plan.shared_bytes(g), args))
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"{name}: the nhwc_tc grid {grid} is too large")
    return CudaKernel(name, code, launches, regions["end"])


#: a tiled relayout block's pixels and channels (`to_nhwc_tiles`)
RELAYOUT_TILE = 64


def _relayout_grid(n: int, c: int, h: int, w: int, ph: int, pw: int, plan: NhwcPlan) -> tuple[int, int, int]:
    """The grid of a relayout of (n, c, h, w) to a bordered NHWC image: a block a bordered row
    (`to_nhwc`), or for warpgroup-MMA plans a block a 64 x 64 tile of pixels and channels, and a
    block more an image and channel tile zeroing the border (`to_nhwc_tiles`)."""
    if not plan.WG:
        return (n * (h + 2 * ph), 1, 1)
    tiles = ceil_div(h * w, RELAYOUT_TILE) + (1 if ph or pw else 0)
    return (n * tiles, ceil_div(c, RELAYOUT_TILE), 1)


def stamped(plan: NhwcPlan) -> tuple[tuple[str, int], ...]:
    """A plan as the choice table stamps it (a forward's without its split count)."""
    pairs = (("BM", plan.BM), ("BN", plan.BN), ("WM", plan.WM), ("WN", plan.WN), ("STAGES", plan.STAGES))
    return pairs + ((("SPLITS", plan.SPLITS),) if plan.SPLITS != 1 else ()) \
        + tuple((flag, 1) for flag in ("WG", "ST", "XI", "DYI") if getattr(plan, flag))


def family_render(name: str, sub: Any, spec: Any, g: dict[str, Any], plan: tuple, epilogue: Any,
                  bf16_roles: frozenset[str]) -> CudaKernel:
    """The choice table's renderer (its plan stamped pairs, its epilogues the spec's)."""
    eps = spec.epilogues
    return render(name, g, NhwcPlan(**dict(plan)), bias="bias" in eps, relu="relu" in eps,
                  relu_mask="relu_mask" in eps, epilogue=epilogue, bf16_roles=bf16_roles)
