"""Memory-bound CUDA kernels for convolutions with a small window: the forward pass when
C*KH*KW <= 32 and the grad-weight when there are few weights (O*C*KH*KW <= 512).

Such convolutions (the MNIST CNN's conv1: 1 input channel, 3x3) do a handful of FMAs per output
or per dy element, so their time is the pass over the big tensor: the forward writes O*HO*WO
floats per image from C*H*W inputs (14x fewer for conv1), the grad-weight reads all of dy to
produce 144 weights. The implicit GEMM (`cuda_kernels`) spends that pass on gathers and index
arithmetic (conv1 at batch 1024 on an H200: forward 28 us against ~13 us of writes; grad-weight
52 us, 0.9 TB/s, for 44 MB of dy), and `cuda_direct` needs C*KH*KW >= 64 to pay for its
shared-memory stages. Here a thread owns OT output channels (their filters or partial sums
in registers) and walks vectors of V neighbouring output columns, lanes on consecutive vectors,
so every global access of the big tensor is a warp-contiguous float2/float4 (V = 4, 2 or 1,
whichever divides WO) and each staged input is read from shared memory once per (row, vector)
for OT x V x KW FMAs (templates `small_conv_fwd.j2`, `small_conv_gw.j2`).

Same contract as `cuda_kernels`: outputs fully overwritten, plain fp32 FMAs, no float atomics,
fixed summation orders (the grad-weight's per-block partials go to scratch and a second launch
sums them in block order, then applies the epilogue). Any stride and padding. The renderers
return None where a geometry does not suit; codegen then falls back to the other kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cuda_kernels import (SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, _conv_geometry, _reduce_groups,
                           kernel_signature, with_epilogue)
from .device import Device, current, resident_threads, static_shared_budget
from .shapes import ceil_div, round_up
from .templates_env import environment

MAX_WINDOW = 32         # C*KH*KW of the forward: the filters of OT channels live in registers
MAX_WEIGHTS = 512       # O*C*KH*KW of the grad-weight: per-block partials, the reduce launch
FWD_FILTER_REGS = 40    # OT*C*KH*KW registers for the forward's filters
GW_ACC_REGS = 40        # OT*C*KH*KW accumulators of the grad-weight
GW_LOAD_REGS = 16       # STEPS*OT*V dy values a grad-weight thread has in flight per unit
FWD_REGS = 64           # registers a forward thread takes, about (filters, outputs of a vector, indices)
GW_REGS = 85            # registers a grad-weight thread may take: its __launch_bounds__ asks for the blocks
                        # that many allow resident (accumulators and loads in flight fit in them)

_env = environment("cuda")


def _smem_budget(device: Device) -> int:
    """Static shared memory a block may stage rows in: 8 KiB are left for the block reduction."""
    return static_shared_budget(device, 8 * 1024)


def gw_threads_per_sm(device: Device) -> int:
    """Grad-weight threads resident a multiprocessor at GW_REGS registers each (768 on an H200)."""
    return resident_threads(device, GW_REGS)


@dataclass(frozen=True)
class SmallPlan:
    OT: int      # output channels per thread
    RB: int      # output rows per unit (a forward block owns one unit)
    TL: int      # lanes per channel group (a multiple of 32)
    blocks: int  # grid size
    V: int       # output columns per vector (divides WO)
    score: float = 0.0

    def threads(self, O: int) -> int:
        return O // self.OT * self.TL


def _vector(WO: int) -> int:
    return 4 if WO % 4 == 0 else 2 if WO % 2 == 0 else 1


def _staged_width(W: int, PW: int, WO: int, KW: int, SW: int, V: int) -> int:
    """Shared-memory row length: the padded input row, and at stride 1 every column the last
    vector loads touch (NV whole vectors from the last output vector's first column)."""
    nv = ceil_div((V - 1) * SW + KW, V)
    need = W + 2 * PW if SW != 1 else max(W + 2 * PW, WO - V + nv * V)
    return round_up(need, V)


def _channel_tile(O: int, CKK: int, regs: int) -> int:
    """Largest OT dividing O (at most 8) whose OT*C*KH*KW values fit `regs` registers."""
    return max(ot for ot in range(1, min(O, 8) + 1) if O % ot == 0 and (ot * CKK <= regs or ot == 1))


def _units(HO: int, WO: int, RB: int, TL: int, V: int) -> tuple[int, float]:
    """(steps a thread takes per unit, fraction of the lane steps that hold a live vector)."""
    groups = ceil_div(HO, RB)
    U = RB * (WO // V)
    steps = ceil_div(U, TL)
    return steps, (U / (steps * TL)) * (HO / (groups * RB))


def small_forward_plan(N: int, C: int, O: int, KH: int, KW: int, HO: int, WO: int, SH: int, W: int, PW: int,
                       SW: int) -> SmallPlan | None:
    """Tiling of the small-window forward (one block a unit of RB rows), or None where it does not suit."""
    CKK = C * KH * KW
    if CKK > MAX_WINDOW:
        return None
    V = _vector(WO)
    OT = _channel_tile(O, CKK, FWD_FILTER_REGS)
    WS = _staged_width(W, PW, WO, KW, SW, V)
    dev = current()
    budget, resident = _smem_budget(dev), resident_threads(dev, FWD_REGS)
    best = None
    for RB in range(1, HO + 1):
        if 4 * C * ((RB - 1) * SH + KH) * WS > budget:
            break
        for TL in (32, 64, 96, 128, 192, 256):
            threads = O // OT * TL
            if not 64 <= threads <= 512:
                continue
            steps, live = _units(HO, WO, RB, TL, V)
            if steps > 8 or (steps > 1 and TL > 128):
                continue
            blocks = N * ceil_div(HO, RB)
            if blocks >= 2**31:
                continue
            # Blocks resident per SM (about FWD_REGS registers a thread); fewer blocks than slots
            # leave multiprocessors idle, a last partial wave leaves some idle at the end.
            slots = dev.multiprocessors * max(1, resident // threads)
            waves = blocks / slots
            fill = min(1.0, waves) * (0.75 + 0.25 * waves / ceil_div(blocks, slots))
            halo = ((RB - 1) * SH + KH) / (RB * SH)  # staged rows per output row (x re-read from L2)
            # per block: filters, staging, one barrier: worth about one step of stores
            score = live * fill * steps / (steps + 1) / (1 + 0.05 * halo) * (1.0 if threads <= 256 else 0.9)
            if best is None or score > best.score:
                best = SmallPlan(OT, RB, TL, blocks, V, score)
    return best


def render_small_forward(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride=(1, 1),
                         padding=(0, 0), bias: bool = False, relu: bool = False,
                         epilogue: PointwiseEpilogue | None = None, plan: SmallPlan | None = None,
                         min_blocks: int = 0, bf16_roles: frozenset[str] = frozenset(),
                         runtime_images: bool = False) -> CudaKernel | None:
    """out = conv2d(x, w) [+ bias][relu][epilogue] for a small window (C*KH*KW <= 32): roles x,
    w, [bias], out; None where the geometry does not suit. `bf16_roles`: the roles holding
    bfloat16 (precision "bf16": widened as read, the value rounded to bfloat16 before the epilogue).
    `runtime_images`: the text holds no N (the images are the grid's), one for every batch size."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if plan is None:
        plan = small_forward_plan(N, C, O, KH, KW, HO, WO, sh, W, pw_, sw)
    if plan is None:
        return None
    WS = _staged_width(W, pw_, WO, KW, sw, plan.V)
    roles = ("x", "w") + (("bias",) if bias else ()) + ("out",)
    roles, inputs, unrestricted = with_epilogue(roles, ("x", "w", "bias"), epilogue)
    threads = plan.threads(O)
    grid = (N * ceil_div(HO, plan.RB), 1, 1)
    code = _env.get_template("small_conv_fwd.j2").render(
        name=name, description=f"conv2d forward x({'N' if runtime_images else N},{C},{H},{W}) w({O},{C},{KH},{KW}) "
                               f"stride ({sh},{sw}) padding ({ph},{pw_}){' +bias' if bias else ''}"
                               f"{' +relu' if relu else ''}",
        runtime=runtime_images, N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw_, HO=HO, WO=WO, OT=plan.OT, V=plan.V,
        RB=plan.RB, TL=plan.TL, WS=WS, threads=threads, grid=grid, min_blocks=min_blocks, roles=roles, inputs=inputs,
        unrestricted=unrestricted, signature=kernel_signature(roles, inputs, unrestricted, False, bf16_roles),
        bias=bias, relu=relu, pw=epilogue, bf16_roles=bf16_roles, bf16=bool({"x", "w"} & bf16_roles))
    return CudaKernel(name, code, (Launch(f"{name}_small", grid, (threads, 1, 1), 0, roles),), 0)


def small_grad_weight_plan(N: int, C: int, O: int, KH: int, KW: int, HO: int, WO: int, SH: int, W: int, PW: int,
                           SW: int) -> SmallPlan | None:
    """Tiling of the small grad-weight (units of RB rows, blocks walking fixed unit ranges), or None."""
    CKK = C * KH * KW
    if O * CKK > MAX_WEIGHTS:
        return None
    V = _vector(WO)
    OT = _channel_tile(O, CKK, GW_ACC_REGS)
    if OT * CKK > 2 * GW_ACC_REGS:
        return None
    WS = _staged_width(W, PW, WO, KW, SW, V)
    dev = current()
    budget, resident = _smem_budget(dev), gw_threads_per_sm(dev)
    best = None
    for RB in range(1, HO + 1):
        if 4 * (C * ((RB - 1) * SH + KH) * WS + 16 * OT * CKK) > budget:
            break
        for TL in (32, 64, 128):
            threads = O // OT * TL
            # Several blocks resident per SM, so one block's loads stream while another passes
            # a barrier or computes: about 85 registers a thread (accumulators + loads in flight)
            # allow 768 threads.
            if not 64 <= threads <= 512 or (threads > 256 and TL > 32):
                continue
            steps, live = _units(HO, WO, RB, TL, V)
            if steps * OT * V > GW_LOAD_REGS:
                continue
            units = N * ceil_div(HO, RB)
            slots = dev.multiprocessors * max(1, resident // threads)
            per_block = ceil_div(units, min(units, slots))
            blocks = ceil_div(units, per_block)  # one wave, equal shares of the units
            busy = units / (per_block * slots)   # of the resident slots over the kernel's time
            inflight = min(1.0, steps * OT * V / 16)
            halo = ((RB - 1) * SH + KH) / (RB * SH)
            # two barriers and a staging per unit, a reduction and a start per block
            score = live * busy * inflight * steps / (steps + 1) * per_block / (per_block + 1) / (1 + 0.05 * halo) \
                * (1.0 if 128 <= threads <= 256 else 0.8)
            if best is None or score > best.score:
                best = SmallPlan(OT, RB, TL, blocks, V, score)
    return best


def render_small_grad_weight(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                             stride=(1, 1), padding=(0, 0), epilogue: PointwiseEpilogue | None = None,
                             plan: SmallPlan | None = None, min_blocks: int | None = None,
                             bf16_roles: frozenset[str] = frozenset(), runtime_images: bool = False) -> CudaKernel | None:
    """dw = conv2d_grad_weight(x, dy) [epilogue] for few weights (O*C*KH*KW <= 512): roles x, dy,
    out (O,C,KH,KW); None where the geometry does not suit. Two launches: per-block partials in
    scratch, then their fixed-order sum and the epilogue (with bfloat16 operands among
    `bf16_roles`, the sum rounded to bfloat16 first). `runtime_images`: N a by-value argument of
    the first launch (the plan's blocks share the units whatever their number), one text for
    every batch size."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if plan is None:
        plan = small_grad_weight_plan(N, C, O, KH, KW, HO, WO, sh, W, pw_, sw)
    if plan is None:
        return None
    WS = _staged_width(W, pw_, WO, KW, sw, plan.V)
    roles, inputs, unrestricted = with_epilogue(("x", "dy", "out"), ("x", "dy"), epilogue)
    outs = O * C * KH * KW
    n = "N" if runtime_images else N
    rg = _reduce_groups(plan.blocks)
    threads = plan.threads(O)
    code = _env.get_template("small_conv_gw.j2").render(
        name=name, description=f"conv2d grad-weight x({n},{C},{H},{W}) dy({n},{O},{HO},{WO}) stride ({sh},{sw}) "
                               f"padding ({ph},{pw_})",
        runtime=runtime_images, N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw_, HO=HO, WO=WO, OT=plan.OT, V=plan.V,
        RB=plan.RB, TL=plan.TL, WS=WS, threads=threads, blocks=plan.blocks,
        min_blocks=min_blocks or max(1, gw_threads_per_sm(current()) // threads), roles=roles, inputs=inputs,
        unrestricted=unrestricted, signature=kernel_signature(roles, inputs, unrestricted, True, bf16_roles), rg=rg,
        rgrid=ceil_div(outs, 32), pw=epilogue, bf16_roles=bf16_roles, bf16=bool({"x", "dy"} & bf16_roles))
    args = roles + ("scratch",)
    scratch = round_up(4 * plan.blocks * outs, SCRATCH_ALIGN)
    scalars = (("int", N),) if runtime_images else ()
    return CudaKernel(name, code, (Launch(f"{name}_small", (plan.blocks, 1, 1), (threads, 1, 1), 0, args, scalars),
                                   Launch(f"{name}_reduce", (ceil_div(outs, 32), 1, 1), (32 * rg, 1, 1), 0, args)),
                      scratch)


__all__ = ["MAX_WEIGHTS", "MAX_WINDOW", "SmallPlan", "render_small_forward", "render_small_grad_weight",
           "small_forward_plan", "small_grad_weight_plan"]
