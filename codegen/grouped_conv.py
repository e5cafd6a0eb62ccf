"""Grouped convolutions (`groups` > 1, depthwise included) for the code-generating targets: the
forward, grad-input and grad-weight kernels in C++ and CUDA (templates
`templates/<target>/grouped_conv.j2`).

These are the generic, correct kernels every grouped convolution can run on; on the CPU the
tiled, vectorised ones are `conv_phase`'s (the cost model's first), on CUDA tiled families are
later work. Channel block g of
the input (C/G channels) meets output block g (O/G channels) only; the weight is
(O, C/G, KH, KW), as PyTorch's. Any stride and padding.

Determinism: every output element is computed by one thread in a fixed order, no atomics.
The C++ kernels own (image, output channel) planes (forward), (image, input channel) planes
(grad-input) or weights (grad-weight: per-image partial sums of HO*WO products, then their sum
over the images in order); the CUDA forward and grad-input run one thread an element, the
grad-weight one block a weight, its threads' strided partial sums added by a fixed tree.
Epilogues: the forward takes bias and ReLU, the grad-input the ReLU mask, and on CUDA any
kernel a generated pointwise epilogue.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ember.ir.ops import conv_out_dim

from .cpp_kernels import PARALLEL_MIN, KernelSource
from .cuda_kernels import SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, kernel_signature, with_epilogue
from .shapes import ceil_div, check_positive, round_up
from .templates_env import environment

CONV_KINDS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
CUDA_THREADS = 256
#: The CUDA grad-weight by taps (a block a filter and a share of the images, every thread all
#: KH x KW taps of its positions): for windows of at most this many taps (the accumulators live
#: in registers); larger ones keep a block a weight.
CUDA_TAPS_MAX = 25
#: ... its blocks: about this many a multiprocessor, at least this many positions a thread
CUDA_GW_BLOCKS_PER_SM, CUDA_GW_MIN_PER_THREAD = 4, 8


@dataclass(frozen=True)
class ConvGeometry:
    N: int
    C: int   # input channels, all groups
    H: int
    W: int
    O: int   # output channels, all groups
    KH: int
    KW: int
    SH: int
    SW: int
    PH: int
    PW: int
    HO: int
    WO: int
    G: int

    @property
    def macs(self) -> int:
        return self.N * self.O * self.HO * self.WO * (self.C // self.G) * self.KH * self.KW


def geometry(x_shape: tuple[int, ...], w_shape: tuple[int, ...], attrs: dict[str, Any]) -> ConvGeometry:
    """The convolution of an NCHW input of `x_shape` with an (O, C/G, KH, KW) weight under a
    convolution node's attributes (stride, padding, groups)."""
    (n, c, h, w), (o, cg, kh, kw) = x_shape, w_shape
    check_positive(N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw)
    (sh, sw), (ph, pw), g = attrs["stride"], attrs["padding"], int(attrs["groups"])
    if g < 1 or c != cg * g or o % g:
        raise ValueError(f"groups={g} does not split {c} input and {o} output channels with a weight of {cg} per group")
    ho, wo = conv_out_dim(h, kh, sh, ph), conv_out_dim(w, kw, sw, pw)
    if ho < 1 or wo < 1:
        raise ValueError(f"empty convolution output ({ho}x{wo}) for input {h}x{w}, kernel {kh}x{kw}")
    if max(n * c * h * w, n * o * ho * wo, o * cg * kh * kw) >= 2**31:
        raise ValueError("tensor too large for 32-bit indexing")  # the kernels index in int
    return ConvGeometry(n, c, h, w, o, kh, kw, sh, sw, ph, pw, ho, wo, g)


def _check(name: str, kind: str) -> None:
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    if kind not in CONV_KINDS:
        raise ValueError(f"unknown convolution kernel {kind!r}; expected one of {CONV_KINDS}")


def _description(kind: str, g: ConvGeometry, images: str | None = None) -> str:
    return (f"grouped {kind} x({images or g.N},{g.C},{g.H},{g.W}) w({g.O},{g.C // g.G},{g.KH},{g.KW}) groups {g.G} "
            f"stride ({g.SH},{g.SW}) padding ({g.PH},{g.PW}) -> {g.HO}x{g.WO}")


def render_cpp(name: str, kind: str, g: ConvGeometry, *, bias: bool = False, relu: bool = False,
               relu_mask: bool = False, bf16: bool = False) -> tuple[KernelSource, list[str | None]]:
    """The C++ kernel of `kind` and its argument order as roles (None: NULL; then the step passes
    scratch, unused): the signatures of the ungrouped templates in `cpp_kernels`. `bf16`: bfloat16
    operands and result (float32 sums of exact products; the result rounded as the interpreter's
    nodes are: the sum, then `+ bias`)."""
    _check(name, kind)
    if (bias or relu) and kind != "conv2d" or relu_mask and kind != "conv2d_grad_input":
        raise ValueError(f"the grouped {kind} kernel takes no {'relu_mask' if relu_mask else 'bias/relu'} epilogue")
    # N is no part of the code: the kernel takes it at run time, and decides then whether a team
    # of threads pays (as many tasks as 2 and PARALLEL_MIN multiply-adds)
    tasks = {"conv2d": "N * O", "conv2d_grad_input": "N * C", "conv2d_grad_weight": "O * CG"}[kind]
    per_image = g.macs // g.N
    ctx = {k: v for k, v in dataclasses.asdict(g).items() if k != "N"}
    code = environment("cpp").get_template("grouped_conv.j2").render(
        name=name, kind=kind, description=_description(kind, g, "N"), bias=bias, relu=relu, relu_mask=relu_mask,
        bf16=bf16, parallel_if=f"{tasks} >= 2 && static_cast<int64_t>(N) * {per_image} >= {PARALLEL_MIN}", **ctx)
    order: list[str | None] = {"conv2d": ["x", "w", "bias" if bias else None, "out"],
                               "conv2d_grad_input": ["dy", "w", *(["mask"] if relu_mask else []), "out"],
                               "conv2d_grad_weight": ["x", "dy", "out", None]}[kind]
    return KernelSource(name, code, 0, (g.N,)), order


def cuda_grad_weight_splits(g: ConvGeometry, multiprocessors: int) -> int:
    """How many shares of the images the CUDA grad-weight by taps cuts each filter's sums into (0:
    the window is too large for taps, a block a weight). A depthwise layer has as few filters as
    channels (32 blocks for 32 of them), so the images are split until there are about
    CUDA_GW_BLOCKS_PER_SM blocks a multiprocessor, each with CUDA_GW_MIN_PER_THREAD positions a
    thread or more; the shares' partials are added in order by a second launch."""
    if g.KH * g.KW > CUDA_TAPS_MAX:
        return 0
    filters = g.O * (g.C // g.G)
    splits = min(g.N, ceil_div(CUDA_GW_BLOCKS_PER_SM * multiprocessors, filters),
                 g.N * g.HO * g.WO // (CUDA_GW_MIN_PER_THREAD * CUDA_THREADS))
    splits = max(1, splits)
    return ceil_div(g.N, ceil_div(g.N, splits))  # whole, equal shares of images


def cuda_scratch_bytes(kind: str, g: ConvGeometry, splits: int) -> int:
    """Scratch of a CUDA grouped kernel: the grad-weight's partials where it splits the images."""
    if kind != "conv2d_grad_weight" or splits <= 1:
        return 0
    return round_up(4 * splits * g.O * (g.C // g.G) * g.KH * g.KW, SCRATCH_ALIGN)


def render_cuda(name: str, kind: str, g: ConvGeometry, *, bias: bool = False, relu: bool = False,
                relu_mask: bool = False, epilogue: PointwiseEpilogue | None = None, splits: int = 0,
                bf16_roles: frozenset[str] = frozenset(), runtime_images: bool = False) -> CudaKernel:
    """The CUDA kernel of `kind`: one thread an output element (forward, grad-input); the
    grad-weight with `splits` (`cuda_grad_weight_splits`) by taps, a block a filter and a share of
    the images (then, above 1, a launch adding the shares in order), with 0 a block a weight. Roles
    as the GEMM templates': x, w, [bias], out / dy, w, [mask_src], out / x, dy, out. `bf16_roles`:
    the roles whose buffers hold bfloat16 (precision "bf16"): read as floats, the products summed
    in float32 and the convolution's value rounded to bfloat16 (the bias add rounded again), as the
    interpreter has them. `runtime_images`: the images N a by-value argument of every launch (a
    grad-weight's share of them computed from it, its split count the plan's), one text for every
    batch size."""
    _check(name, kind)
    roles = {"conv2d": ("x", "w") + (("bias",) if bias else ()) + ("out",),
             "conv2d_grad_input": ("dy", "w") + (("mask_src",) if relu_mask else ()) + ("out",),
             "conv2d_grad_weight": ("x", "dy", "out")}[kind]
    operands = roles[:2]  # the contraction's two operands: bfloat16 ones make it a bfloat16 convolution
    roles, inputs, unrestricted = with_epilogue(roles, ("x", "w", "bias", "dy", "mask_src"), epilogue)
    taps = kind == "conv2d_grad_weight" and splits > 0
    scratch = cuda_scratch_bytes(kind, g, splits)
    filters = g.O * (g.C // g.G)
    if taps:
        grid = (filters, splits, 1)
    elif kind == "conv2d_grad_weight":
        grid = (filters * g.KH * g.KW, 1, 1)
    else:
        grid = (ceil_div(g.N * (g.O * g.HO * g.WO if kind == "conv2d" else g.C * g.H * g.W), CUDA_THREADS), 1, 1)
    ptr = {r: "em_bf16_in" if r in bf16_roles else "float* __restrict__" for r in ("x", "w", "dy")}
    code = environment("cuda").get_template("grouped_conv.j2").render(
        name=name, kind=kind, description=_description(kind, g, "N" if runtime_images else None), bias=bias,
        relu=relu, relu_mask=relu_mask, runtime=runtime_images,
        threads=CUDA_THREADS, roles=roles, inputs=inputs, unrestricted=unrestricted, pw=epilogue,
        taps=taps, splits=splits, chunk=ceil_div(g.N, splits) if taps else 0, bf16_roles=bf16_roles,
        bf16=bool(set(operands) & bf16_roles), ptr=ptr,
        signature=kernel_signature(roles, inputs, unrestricted, scratch > 0, bf16_roles), **dataclasses.asdict(g))
    args = roles + (("scratch",) if scratch else ())
    scalars = (("int", g.N),) if runtime_images else ()
    launches = [Launch(f"{name}_grouped", grid, (CUDA_THREADS, 1, 1), 0, args, scalars)]
    if scratch:
        launches.append(Launch(f"{name}_combine", (ceil_div(filters * g.KH * g.KW, CUDA_THREADS), 1, 1),
                               (CUDA_THREADS, 1, 1), 0, args, scalars))
    return CudaKernel(name, code, tuple(launches), scratch)


__all__ = ["CONV_KINDS", "ConvGeometry", "cuda_grad_weight_splits", "cuda_scratch_bytes", "geometry", "render_cpp",
           "render_cuda"]
