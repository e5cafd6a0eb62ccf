"""Direct (non-GEMM) CUDA kernels: stride-1 convolutions (forward, grad-input, grad-weight) and
matmuls with a short contraction.

The implicit-GEMM kernels of `cuda_kernels` gather every input element KH*KW times (once per
window position that reads it) and pay index arithmetic on each gather; with few channels (the
MNIST CNN's conv2 has 16 in, 32 out) that gather is most of their instructions, and they stall
near 20-40 % of fp32 peak. These kernels stage input rows and weights in shared memory once per
block and slide a register window along each row, so nearly every instruction in the inner loop
is an FMA (templates `conv2d_direct.j2`, `conv2d_direct_gw.j2`). Same contract as the GEMM
kernels (roles, scratch, epilogues, no float atomics, fixed summation orders); the summation
order differs from theirs, so results differ in the last bits, within the same tolerances.

A matmul with K <= 16 (`render_matmul_thin`) is a pass over memory: one thread writes 4
neighbouring outputs of a row with one float4 store, where the GEMM skeleton's scalar stores
reached a third of the memory bandwidth.

`direct_forward_plan` / `direct_grad_weight_plan` return None where a geometry does not suit
(stride > 1, too many channels for one block, windows wider than a row): codegen then uses the
implicit GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cuda_kernels import (SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, _conv_geometry, _reduce_groups,
                           kernel_signature, with_epilogue)
from .device import current, static_shared_budget
from .shapes import ceil_div, round_up
from .templates_env import environment

_env = environment("cuda")


@dataclass(frozen=True)
class DirectPlan:
    OT: int   # output channels per thread
    PT: int   # output columns per thread
    RB: int   # output rows per block
    CC: int   # input channels per shared-memory stage
    NCG: int  # column groups per row
    threads: int
    score: float = 0.0  # the planner's ranking (not part of a stamped plan)


def padded_channels(CO: int) -> int:
    """Row length of the staged weights: output channels padded by 4 floats (keeps the float4
    reads aligned; the coalesced staging stores then conflict 4-way instead of 32-way)."""
    return CO + 4 if CO % 4 == 0 else CO


def direct_channels_per_step(CI: int, RB: int, cols: int, KH: int, KW: int, CO: int) -> int | None:
    """Input channels a shared-memory stage: the largest even split of CI (at most 16) whose rows
    and weights fit the static shared memory of a block; None if not even one channel fits."""
    budget = static_shared_budget(current())
    for parts in range(1, CI + 1):
        CC = ceil_div(CI, parts)
        # (+ 3: room for a staged row's bank padding)
        if CC <= 16 and 4 * CC * ((RB + KH - 1) * (cols + KW - 1 + 3) + KH * KW * padded_channels(CO)) <= budget:
            return CC
    return None


def direct_plan_fits(plan: DirectPlan, CI: int, WO: int, CO: int, KH: int, KW: int) -> bool:
    """Whether a plan (of another batch size: the images only rank plans) tiles this geometry as
    `direct_forward_plan` would build it."""
    ncg = ceil_div(WO, plan.PT)
    return (CO % plan.OT == 0 and plan.NCG == ncg and plan.threads == (CO // plan.OT) * plan.RB * ncg
            and 64 <= plan.threads <= 512 and plan.CC == direct_channels_per_step(CI, plan.RB, ncg * plan.PT, KH, KW, CO))


def direct_forward_plan(N: int, CI: int, HI: int, WI: int, CO: int, HO: int, WO: int, KH: int, KW: int) -> DirectPlan | None:
    """Tiling of a stride-1 direct convolution producing CO x HO x WO per image, or None."""
    best = None
    sms = current().multiprocessors
    for OT in (8, 4, 2, 1):
        if CO % OT:
            continue
        for PT in range(2, 11):
            if OT * PT > 64 or OT * PT < 8:
                continue  # register budget; too little reuse of each staged value
            ncg = ceil_div(WO, PT)
            for RB in range(1, HO + 1):
                threads = (CO // OT) * RB * ncg
                if not 64 <= threads <= 512:
                    continue
                CC = direct_channels_per_step(CI, RB, ncg * PT, KH, KW, CO)
                if CC is None:
                    continue
                useful = WO / (ncg * PT) * HO / (ceil_div(HO, RB) * RB) * (threads / round_up(threads, 32))
                # shared-memory loads per FMA: the input window and the weight vectors
                lds = (PT + KW - 1 + KW * ceil_div(OT, 4)) / (KW * OT * PT)
                blocks = N * ceil_div(HO, RB)
                fill = min(1.0, blocks / (2 * sms))
                staging = (RB + KH - 1) / RB  # halo rows staged per output row
                # Measured on an H200 (tools/cuda_sweep.py direct, conv2 of the MNIST CNN):
                # 96-256 threads and 32 accumulators a thread run best (more registers or more
                # threads cut the blocks resident per multiprocessor; fewer starve it), and blocks
                # of many rows (24-26) ran 1.5x slower than 8-row ones.
                shape = (1.0 if 96 <= threads <= 256 else 0.6) * (1.0 if OT * PT <= 32 else 0.8) \
                    * (1.0 if RB <= 12 else 0.8)
                score = useful * fill * shape / (1 + 3 * lds) / (1 + 0.05 * staging)
                if best is None or score > best.score:
                    best = DirectPlan(OT, PT, RB, CC, ncg, threads, score)
    return best


def _direct_geometry(grad_input: bool, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, HO: int, WO: int,
                     ph: int, pw_: int) -> dict[str, int]:
    """The forward convolution a direct kernel computes: grad-input is one of dy, padded by K-1-P,
    with the flipped, transposed kernel."""
    if grad_input:
        return dict(CI=O, H_IN=HO, W_IN=WO, CO=C, HO_=H, WO_=W, PH=KH - 1 - ph, PW=KW - 1 - pw_)
    return dict(CI=C, H_IN=H, W_IN=W, CO=O, HO_=HO, WO_=WO, PH=ph, PW=pw_)


def direct_roles(grad_input: bool, N: int | None, C: int, H: int, W: int, O: int, KH: int, KW: int, HO: int, WO: int,
                 ph: int, pw_: int, *, bias: bool, relu: bool, relu_mask: bool
                 ) -> tuple[tuple[str, ...], tuple[str, ...], str, str]:
    """(roles, inputs, the role of the staged input, description) of a direct forward (x, w,
    [bias], out) or grad-input (dy, w, [mask_src], out) kernel, before a generated epilogue's roles.
    N None: the description names no batch (a kernel whose code serves every batch size)."""
    N = "N" if N is None else N
    if grad_input:
        roles = ("dy", "w") + (("mask_src",) if relu_mask else ()) + ("out",)
        return roles, ("dy", "w", "mask_src"), "dy", (
            f"conv2d grad-input dy({N},{O},{HO},{WO}) w({O},{C},{KH},{KW}) padding ({ph},{pw_})"
            f"{' *relu-mask' if relu_mask else ''}")
    roles = ("x", "w") + (("bias",) if bias else ()) + ("out",)
    return roles, ("x", "w", "bias"), "x", (f"conv2d forward x({N},{C},{H},{W}) w({O},{C},{KH},{KW}) padding ({ph},{pw_})"
                                            f"{' +bias' if bias else ''}{' +relu' if relu else ''}")


def direct_plan(*, grad_input: bool, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride=(1, 1),
                padding=(0, 0)) -> DirectPlan | None:
    """The plan `render_direct` uses for these arguments, or None where no direct kernel fits."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry("direct", N, C, H, W, O, KH, KW, stride, padding)
    if (sh, sw) != (1, 1) or ph >= KH or pw_ >= KW or N > 65535:
        return None
    geo = _direct_geometry(grad_input, N, C, H, W, O, KH, KW, HO, WO, ph, pw_)
    return direct_forward_plan(N, geo["CI"], geo["H_IN"], geo["W_IN"], geo["CO"], geo["HO_"], geo["WO_"], KH, KW)


def render_direct(name: str, *, grad_input: bool, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                  stride=(1, 1), padding=(0, 0), bias: bool = False, relu: bool = False, relu_mask: bool = False,
                  epilogue: PointwiseEpilogue | None = None, plan: DirectPlan | None = None,
                  min_blocks: int = 0, coalesced_weights: bool = True, vector_stores: bool = True,
                  row_pad: int | None = None) -> CudaKernel | None:
    """The direct forward convolution (roles x, w, [bias], out) or grad-input (roles dy, w,
    [mask_src], out) of a conv2d with these arguments; None where no direct plan fits.
    `coalesced_weights` / `vector_stores` switch the weight staging order and the float4/float2
    output stores off, for measuring each (tools/cuda_sweep.py direct-staging); `row_pad`
    floats are added to each staged input row, by default up to a multiple of 4 (a thread's
    window then starts 16-byte aligned and loads as vectors: conv2 at batch 1024 on an H200,
    forward 149.7 -> 148.2 us, grad-input 237.6 -> 234.8; pads of 1 and 3 were 10-15 us slower)."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if (sh, sw) != (1, 1) or ph >= KH or pw_ >= KW:
        return None
    geo = _direct_geometry(grad_input, N, C, H, W, O, KH, KW, HO, WO, ph, pw_)
    # the images are the grid's y alone: the code is the same text at every batch size
    roles, inputs, src, description = direct_roles(grad_input, None, C, H, W, O, KH, KW, HO, WO, ph, pw_, bias=bias,
                                                   relu=relu, relu_mask=relu_mask)
    if plan is None:
        plan = direct_forward_plan(N, geo["CI"], geo["H_IN"], geo["W_IN"], geo["CO"], geo["HO_"], geo["WO_"], KH, KW)
    if plan is None or N > 65535:
        return None
    roles, inputs, unrestricted = with_epilogue(roles, inputs, epilogue)
    grid = (ceil_div(geo["HO_"], plan.RB), N, 1)
    if row_pad is None:
        row_pad = -(plan.NCG * plan.PT + KW - 1) % 4
    code = _env.get_template("conv2d_direct.j2").render(
        name=name, description=description, KH=KH, KW=KW, **geo, OT=plan.OT, PT=plan.PT, RB=plan.RB,
        CC=plan.CC, NCG=plan.NCG, threads=plan.threads, min_blocks=min_blocks, roles=roles, inputs=inputs,
        unrestricted=unrestricted, signature=kernel_signature(roles, inputs, unrestricted, False), grid=grid,
        flip=grad_input, src=src, bias=bias and not grad_input, relu=relu and not grad_input,
        relu_mask=relu_mask and grad_input, pw=epilogue,
        cop=padded_channels(geo["CO"]) if coalesced_weights else geo["CO"], coalesced_weights=coalesced_weights,
        vector_stores=vector_stores, row_pad=row_pad)
    return CudaKernel(name, code, (Launch(f"{name}_direct", grid, (plan.threads, 1, 1), 0, roles),), 0)


def gw_plane_pad(KH: int, KW: int, WO: int, RB: int) -> int:
    """Floats added to each input channel's staged plane so its stride is odd (see the template)."""
    return 1 - (RB + KH - 1) * (WO + KW - 1) % 2


def gw_buffer_floats(C: int, O: int, KH: int, KW: int, WO: int, RB: int) -> int:
    """Floats of one staging buffer of the direct grad-weight kernel: RB rows of dy (channel-fastest,
    rows padded by 4) and RB + KH - 1 rows of x per channel (planes padded to an odd stride); a
    multiple of 4 so the second buffer stays 16-byte aligned."""
    return round_up(RB * WO * (O + 4) + C * ((RB + KH - 1) * (WO + KW - 1) + gw_plane_pad(KH, KW, WO, RB)), 4)


def direct_grad_weight_plan(N: int, C: int, O: int, KH: int, KW: int, HO: int, WO: int) -> tuple[int, int, int] | None:
    """(OT, RB, blocks) for the direct grad-weight kernel, or None where it does not suit."""
    dev = current()
    for OT in (4, 2, 1):
        if O % OT or OT * KH * KW > 64:
            continue
        threads = O // OT * C
        if not 64 <= threads <= 512:
            continue
        # Rows staged a unit: more rows amortise the barriers and share x's halo rows; two units'
        # buffers (double buffering) must fit the dynamic shared memory a launch may take without
        # opting in (48 KiB).
        for RB in (4, 3, 2, 1):
            if 2 * 4 * gw_buffer_floats(C, O, KH, KW, WO, RB) <= dev.shared_per_block:
                break
        else:
            return None
        units = N * ceil_div(HO, RB)
        # Enough blocks for ~4 per multiprocessor, but not so many that the partials (and the
        # reduce launch) outweigh the rows each block walks.
        blocks = max(1, min(units, 4 * dev.multiprocessors, units // 2 or 1))
        return OT, RB, blocks
    return None


def render_direct_grad_weight(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                              stride=(1, 1), padding=(0, 0), epilogue: PointwiseEpilogue | None = None,
                              blocks: int | None = None, rows: int | None = None,
                              min_blocks: int | None = None,
                              plan: tuple[int, int, int] | None = None,
                              bf16_roles: frozenset[str] = frozenset()) -> CudaKernel | None:
    """dw = conv2d_grad_weight(x, dy) for stride 1: roles x, dy, out (O,C,KH,KW); None where no
    direct plan fits. Two launches: per-block partials in scratch, then their fixed-order sum.
    `plan` is (OT, RB, blocks) as `direct_grad_weight_plan` gives it (the default). `bf16_roles`:
    the roles holding bfloat16 (precision "bf16": x and dy widened as they are staged, the sum
    rounded to bfloat16 before the epilogue)."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if (sh, sw) != (1, 1) or ph >= KH or pw_ >= KW:
        return None
    choice = plan or direct_grad_weight_plan(N, C, O, KH, KW, HO, WO)
    if choice is None:
        return None
    OT, RB, nblocks = choice
    dev = current()
    if blocks is not None:
        nblocks = blocks
    if rows is not None:
        RB = rows
    roles, inputs, unrestricted = with_epilogue(("x", "dy", "out"), ("x", "dy"), epilogue)
    outs = O * C * KH * KW
    rg = _reduce_groups(nblocks)
    threads = O // OT * C
    code = _env.get_template("conv2d_direct_gw.j2").render(
        name=name, description=f"conv2d grad-weight x({N},{C},{H},{W}) dy({N},{O},{HO},{WO}) padding ({ph},{pw_})",
        N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, PH=ph, PW=pw_, HO=HO, WO=WO, OT=OT, threads=threads,
        blocks=nblocks, RB=RB, dy_pad=4, smem_floats=gw_buffer_floats(C, O, KH, KW, WO, RB),
        plane_pad=gw_plane_pad(KH, KW, WO, RB),
        min_blocks=min_blocks or max(1, min(4, dev.max_threads_per_multiprocessor // threads)), roles=roles,
        inputs=inputs, unrestricted=unrestricted, bf16_roles=bf16_roles, bf16=bool({"x", "dy"} & bf16_roles),
        signature=kernel_signature(roles, inputs, unrestricted, True, bf16_roles), rg=rg, rgrid=ceil_div(outs, 32),
        unroll=WO if WO <= 32 else 4, pw=epilogue)
    args = roles + ("scratch",)
    scratch = round_up(4 * nblocks * outs, SCRATCH_ALIGN)
    smem = 2 * 4 * gw_buffer_floats(C, O, KH, KW, WO, RB)
    if smem > dev.shared_per_block:  # the dynamic shared memory a launch may take without opting in
        return None  # rows forced by the caller that do not fit two buffers
    return CudaKernel(name, code, (Launch(f"{name}_direct", (nblocks, 1, 1), (threads, 1, 1), smem, args),
                                   Launch(f"{name}_reduce", (ceil_div(outs, 32), 1, 1), (32 * rg, 1, 1), 0, args)),
                      scratch)


THIN_MAX_K = 16


def _thin_threads(N: int) -> tuple[int, int]:
    """(threads a block, column blocks) of the thin matmul: 4 columns a thread."""
    threads = 128 if N >= 512 else 32 * ceil_div(N // 4, 32)
    return threads, ceil_div(N // 4, threads)


def thin_rows(M: int, N: int) -> int:
    """Rows a block of the thin matmul (its plan): enough blocks to fill the GPU several times
    over; 4-16 rows measured alike on an H200 (1024 x 18432, K = 10: 28-29 us), 35 and 64 slower
    (42, 35 us)."""
    return max(4, min(16, ceil_div(M * _thin_threads(N)[1], 8 * current().multiprocessors)))


def render_matmul_thin(name: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool, batch: int = 1,
                       bias: bool = False, relu: bool = False, epilogue: PointwiseEpilogue | None = None,
                       rows: int | None = None, bf16_roles: frozenset[str] = frozenset(),
                       runtime_rows: bool = False) -> CudaKernel | None:
    """out = op(a) @ b [+ bias][relu][epilogue] for K <= 16, b row-major (K, N), N % 4 == 0, one
    batch: roles a, b, [bias], out; None where the shape does not suit. `bf16_roles`: the roles
    holding bfloat16 (precision "bf16"; with a or b among them the value is rounded to bfloat16
    before the epilogue, as the interpreter computes it). `runtime_rows`: M and K by-value
    arguments (a batch size sets the rows of a layer's input, or K of its weight gradient), one
    text for every batch size."""
    if K > THIN_MAX_K or N % 4 or trans_b or batch != 1 or M * N >= 2**31:
        return None
    threads, col_blocks = _thin_threads(N)
    RM = rows or thin_rows(M, N)
    roles = ("a", "b") + (("bias",) if bias else ()) + ("out",)
    roles, inputs, unrestricted = with_epilogue(roles, ("a", "b", "bias"), epilogue)
    grid = (col_blocks, ceil_div(M, RM), 1)
    code = _env.get_template("matmul_thin.j2").render(
        name=name, description=f"matmul ({'M' if runtime_rows else M}x{'K' if runtime_rows else K}{'^T' if trans_a else ''}) "
                               f"@ ({'K' if runtime_rows else K}x{N}){' +bias' if bias else ''}{' +relu' if relu else ''}",
        M="M" if runtime_rows else M, runtime=runtime_rows, N=N, K="K" if runtime_rows else K, kmax=THIN_MAX_K, RM=RM,
        threads=threads, grid=grid, trans_a=trans_a, bias=bias, relu=relu, pw=epilogue,
        roles=roles, inputs=inputs, unrestricted=unrestricted, bf16_roles=bf16_roles,
        bf16=bool({"a", "b"} & bf16_roles), signature=kernel_signature(roles, inputs, unrestricted, False, bf16_roles))
    scalars = (("int", M), ("int", K)) if runtime_rows else ()
    return CudaKernel(name, code, (Launch(f"{name}_thin", grid, (threads, 1, 1), 0, roles, scalars),), 0)


__all__ = ["DirectPlan", "direct_plan", "thin_rows", "direct_forward_plan", "direct_grad_weight_plan", "render_direct", "render_direct_grad_weight",
           "render_matmul_thin"]
