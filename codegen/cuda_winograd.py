"""3x3 stride-1 convolutions by Winograd's minimal filtering on CUDA: the `winograd` (F(2x2, 3x3))
and `winograd4` (F(4x4, 3x3)) families of the CUDA choice table (`cuda_choices`); template
`templates/cuda/conv_winograd.j2` for the transforms (their sums written out from the matrices of
`winograd_matrices`), the GEMM skeleton's batched matmul (`cuda_kernels.render_matmul`) for the
products.

An m x m output block of a 3x3 correlation is A^T [(G g G^T) . (B^T d B)] A, d the (m+2) x (m+2)
input patch under it, so the (m+2)^2 transformed points of every tile, summed over the input
channels, are (m+2)^2 matrix products: F(2x2, 3x3) makes 16 products for 4 outputs (2.25x fewer
multiply-adds than the direct form; 1.72x on a 7x7 plane), F(4x4, 3x3) 36 for 16 (4x fewer; its
transformed operands, for the same plane, are 0.56x the size on 28x28 and 7x7 planes, 0.73x on
14x14), for more rounding: about 4.5x F(2x2)'s error and 8x the direct sums' in float32
(`winograd_matrices`), nearly all of it the GEMM's sums of transformed values that the output
transform then weighs by up to 64. On full-width airbench at batch 64 on an H100, per step from
the same weights, the update's error against float64 over PyTorch float32's was 2.6, 225 and 245
with every 3x3 convolution on F(4x4) against 2.1, 1.0 and 539 on F(2x2) (a max-pooling window
whose two largest values swap under rounding costs the most), so F(4x4) serves precision "tf32"
only, whose operands round to 10 bits. Unfused, in launches on regions of the kernel's scratch
block:

* forward and grad-input (the forward of dy with the weights transposed and flipped, padding
  2 - p): `_wt` U[pos][ci][co] = G g G^T; `_in` V[pos][ci][t] = B^T d B for every tile t of the
  batch; the matmul M[pos] = U[pos]^T V[pos] (batch (m+2)^2: CO x T from a reduction over CI, the
  GEMM planner's tiles and split count); `_out` the m x m blocks A^T m A with the epilogue (bias,
  ReLU, the ReLU mask, a generated pointwise epilogue);
* grad-weight (F(3x3, m x m)): `_in` as above over x; `_dy` W[pos][o][t] = A y A^T of dy's m x m
  blocks; the matmul S[pos] = W[pos] V[pos]^T (O x C, a reduction over the tiles: split over
  blocks where the planner says so, partials summed in split order); `_sums` dw = G^T s G with
  the epilogue.

A NaN or an infinity among the operands (seen by the transforms, which set a flag in the scratch
that a first launch clears) makes the last launch compute its outputs by the direct sums, as the
interpreter has them: the transforms would add an infinity to its opposite and spread NaN over a
tile. Its plan is the GEMM's plan for that batched product (the tuner measures the GEMM planner's
spread, as for the `gemm` family). Every output is one thread's, every sum has a fixed order: the
bits do not depend on the launch. The scratch holds the transformed operands of the whole batch
((m+2)^2 floats a tile and channel each): 51 MB each for a 256-channel 14x14 layer at batch 64
(F(2x2)).
"""
from __future__ import annotations

from typing import Any

from .cuda_kernels import (SCRATCH_ALIGN, CudaKernel, GemmPlan, Launch, PointwiseEpilogue, conv_roles, gemm_scratch_bytes,
                           kernel_signature, plan_candidates, render_matmul, scratch_role, with_epilogue)
from .shapes import ceil_div, pair, round_up
from .templates_env import environment
from .winograd_matrices import TRANSFORMS, combination

__all__ = ["KINDS", "convolution_rejects", "serves", "correlation", "problem", "plans", "scratch_bytes", "render"]

KINDS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
_THREADS = 256
#: the most scratch a kernel may take: its transformed operands grow with the batch (a 256-channel
#: 14x14 layer at batch 1024: 1.6 GB), past this the direct and GEMM families serve it
MAX_SCRATCH = 4 << 30

_env = environment("cuda")


def convolution_rejects(g: dict[str, Any]) -> str | None:
    """Why F(m x m, 3x3) cannot compute a convolution of geometry `g` (any Winograd family, fused
    or not): its window, stride, groups or operands' precision; None where it can."""
    if (g["KH"], g["KW"]) != (3, 3) or pair(g["stride"], "stride") != (1, 1) or g.get("groups", 1) != 1:
        return "it serves ungrouped 3x3 convolutions at stride 1"
    if g.get("dtype"):
        return "it computes in float32"
    return None


def serves(g: dict[str, Any], m: int = 2) -> str | None:
    """None where the family serves a convolution of geometry `g` (the CUDA table's), else why not."""
    if g["kind"] not in KINDS:
        return "it serves convolutions"
    if (why := convolution_rejects(g)) is not None:
        return why
    if m > 2 and not g.get("tf32"):
        return (f"F({m}x{m}, 3x3) rounds several times more than the direct sums (a float32 step's update "
                "drifts from float64's far past PyTorch float32's): it serves precision 'tf32', which rounds more")
    if scratch_bytes(g, plans(g, m=m)[0], m) > MAX_SCRATCH:
        return f"its transformed operands would take more than {MAX_SCRATCH >> 30} GB of scratch"
    return None


def correlation(g: dict[str, Any], m: int) -> dict[str, int]:
    """The stride-1 3x3 correlation the kernel computes: CI input planes of IH x IW padded by
    (PT, PL) into CO planes of OH x OW (the grad-weight: the forward's input side, CO = O), in
    TH x TW tiles of m x m outputs an image."""
    ph, pw = pair(g["padding"], "padding")
    if g["kind"] == "conv2d_grad_input":
        k = dict(CI=g["O"], CO=g["C"], IH=g["HO"], IW=g["WO"], OH=g["H"], OW=g["W"], PT=2 - ph, PL=2 - pw)
    else:
        k = dict(CI=g["C"], CO=g["O"], IH=g["H"], IW=g["W"], OH=g["HO"], OW=g["WO"], PT=ph, PL=pw)
    k.update(TH=ceil_div(k["OH"], m), TW=ceil_div(k["OW"], m))
    k["T"] = g["N"] * k["TH"] * k["TW"]
    return k


def problem(g: dict[str, Any], m: int = 2) -> dict[str, Any]:
    """The batched matmul of the kernel (M, N, K, batch (m+2)^2, operand layouts): forward and
    grad-input M[pos] (CO x T) = U[pos]^T (U stored CI x CO) @ V[pos] (CI x T); grad-weight
    S[pos] (O x C) = W[pos] (O x T) @ V[pos]^T (V stored C x T)."""
    k, positions = correlation(g, m), TRANSFORMS[m].positions
    if g["kind"] == "conv2d_grad_weight":
        return dict(M=k["CO"], N=k["CI"], K=k["T"], batch=positions, trans_a=False, trans_b=True)
    return dict(M=k["CO"], N=k["T"], K=k["CI"], batch=positions, trans_a=True, trans_b=False)


def plans(g: dict[str, Any], top: int = 1, m: int = 2, x3: bool = False) -> list[GemmPlan]:
    """The GEMM planner's best `top` plans for the kernel's batched product (`x3`: on the GEMM's
    3xTF32 path, family winograd_x3)."""
    p = problem(g, m)
    return plan_candidates(p["M"], p["N"], p["K"], p["batch"], a_kfast=not p["trans_a"],
                           b_kfast=p["trans_b"], x3=x3)[:top]


def _regions(g: dict[str, Any], plan: GemmPlan, m: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets of the scratch regions (A: U or W, B: V, M: the products, the non-finite flag,
    the GEMM's own scratch) and the total."""
    k, p, positions = correlation(g, m), problem(g, m), TRANSFORMS[m].positions
    a = positions * (k["CO"] * k["T"] if g["kind"] == "conv2d_grad_weight" else k["CI"] * k["CO"])
    b = positions * k["CI"] * k["T"]
    products = p["batch"] * p["M"] * p["N"]
    offs, at = [], 0
    for floats in (a, b, products, 1):
        offs.append(at)
        at += round_up(4 * floats, SCRATCH_ALIGN)
    gemm = gemm_scratch_bytes(plan, p["M"], p["N"], p["batch"])
    return offs[0], offs[1], offs[2], offs[3], at, at + gemm


def scratch_bytes(g: dict[str, Any], plan: GemmPlan, m: int = 2) -> int:
    return _regions(g, plan, m)[5]


def render(name: str, g: dict[str, Any], plan: GemmPlan, *, bias: bool = False, relu: bool = False,
           relu_mask: bool = False, epilogue: PointwiseEpilogue | None = None, m: int = 2,
           x3: bool = False) -> CudaKernel:
    """The kernel of F(m x m, 3x3): roles x, w, [bias], out (forward), dy, w, [mask_src], out
    (grad-input) or x, dy, out (grad-weight), then a generated epilogue's, and the scratch block.
    `x3`: its batched GEMM on TF32 tensor cores as 3xTF32 (the transforms stay float32 FMAs)."""
    kind = g["kind"]
    roles, inputs, src = conv_roles("winograd", kind, bias=bias, relu=relu, relu_mask=relu_mask)
    k, p, transform = correlation(g, m), problem(g, m), TRANSFORMS[m]
    off_a, off_b, off_m, off_flag, off_gemm, total = _regions(g, plan, m)
    roles, inputs, unrestricted = with_epilogue(roles, inputs, epilogue)
    ph, pw = pair(g["padding"], "padding")
    description = {"conv2d": f"conv2d forward x({g['N']},{g['C']},{g['H']},{g['W']}) w({g['O']},{g['C']},3,3) "
                             f"padding ({ph},{pw}){' +bias' if bias else ''}{' +relu' if relu else ''}",
                   "conv2d_grad_input": f"conv2d grad-input dy({g['N']},{g['O']},{g['HO']},{g['WO']}) "
                                        f"w({g['O']},{g['C']},3,3) padding ({ph},{pw}){' *relu-mask' if relu_mask else ''}",
                   "conv2d_grad_weight": f"conv2d grad-weight x({g['N']},{g['C']},{g['H']},{g['W']}) "
                                         f"dy({g['N']},{g['O']},{g['HO']},{g['WO']}) padding ({ph},{pw})"}[kind]
    code = _env.get_template("conv_winograd.j2").render(
        name=name, description=description + f", Winograd F({m}x{m}, 3x3): {p['batch']} GEMMs {p['M']}x{p['N']}x{p['K']}",
        kind=kind, t=transform, lin=combination, **k,
        off_a=off_a // 4, off_b=off_b // 4, off_m=off_m // 4, off_flag=off_flag // 4, roles=roles, inputs=inputs, unrestricted=unrestricted,
        signature=kernel_signature(roles, inputs, unrestricted, True), src=src, flip=kind == "conv2d_grad_input",
        bias=bias, relu=relu, relu_mask=relu_mask, pw=epilogue)
    mm = render_matmul(f"{name}_mm", M=p["M"], N=p["N"], K=p["K"], trans_a=p["trans_a"], trans_b=p["trans_b"],
                       batch=p["batch"], plan=plan, x3=x3)
    # the matmul's operands, product and split partials are regions of this kernel's scratch block
    regions = {"a": scratch_role(off_a), "b": scratch_role(off_b), "out": scratch_role(off_m),
               "scratch": scratch_role(off_gemm)}
    gemm = tuple(Launch(la.function, la.grid, la.block, la.shared_bytes, tuple(regions[r] for r in la.args),
                        la.scalars) for la in mm.launches)
    args = tuple(roles) + ("scratch",)

    def over(n: int) -> tuple[int, int, int]:
        return (ceil_div(n, _THREADS), 1, 1)
    clear = Launch(f"{name}_clear", (1, 1, 1), (32, 1, 1), 0, args)
    if kind == "conv2d_grad_weight":
        launches = (clear, Launch(f"{name}_in", over(k["CI"] * k["T"]), (_THREADS, 1, 1), 0, args),
                    Launch(f"{name}_dy", over(k["CO"] * k["T"]), (_THREADS, 1, 1), 0, args), *gemm,
                    Launch(f"{name}_sums", over(k["CO"] * k["CI"]), (_THREADS, 1, 1), 0, args))
    else:
        launches = (clear, Launch(f"{name}_wt", over(k["CI"] * k["CO"]), (_THREADS, 1, 1), 0, args),
                    Launch(f"{name}_in", over(k["CI"] * k["T"]), (_THREADS, 1, 1), 0, args), *gemm,
                    Launch(f"{name}_out", over(k["CO"] * k["T"]), (_THREADS, 1, 1), 0, args))
    if any(la.grid[0] > 2**31 - 1 for la in launches):
        raise ValueError(f"{name}: a transform's grid is too large")
    return CudaKernel(name, code + mm.code, launches, total)
