"""The `winograd_fused` family of the CUDA choice table: the forward and grad-input of 3x3 stride-1
convolutions by F(2x2, 3x3) in one launch that makes the input transforms, the 16 products and the
output transform with the epilogue (template `templates/cuda/conv_winograd_fused.j2`, included by
`conv_winograd.j2` beside the unfused kernel's weight transform).

The unfused `winograd` family (`cuda_winograd`) writes the transformed input V and the products M
of the whole batch to memory and reads them back: 4x the input's size each at F(2x2), which bound
airbench's 28x28 64-channel layers on an H100 (docs/benchmarks.md, session 31). Here a block takes
BT tiles and BCO output channels and keeps both in shared memory and registers: its plan is the
(BT, BCO) blocking, KC = 256 / BT input channels a chunk. The sums run over the input channels in
order (no split), so the rounding is the unfused F(2x2)'s without split-K (`winograd_matrices`:
about 1.7x the direct sums' in float32). A NaN or an infinity in a tile's input patch gives that
tile the direct sums (in the weights: every tile), as the interpreter has them. The grad-weight,
a reduction over the tiles, stays with the unfused families.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cuda_kernels import (SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, conv_roles, kernel_signature,
                           with_epilogue)
from .cuda_winograd import convolution_rejects, correlation
from .shapes import ceil_div, pair, round_up
from .templates_env import environment
from .winograd_matrices import TRANSFORMS, combination

__all__ = ["KINDS", "FusedPlan", "serves", "plans", "scratch_bytes", "render"]

KINDS = ("conv2d", "conv2d_grad_input")
_THREADS = 256
#: dynamic shared memory a block takes without opting in, less the static tile flags beside it
_SHARED_LIMIT = 48 * 1024 - 1024
_env = environment("cuda")


@dataclass(frozen=True)
class FusedPlan:
    BT: int   # tiles a block (its threads transform BT patches of KC = 256 / BT channels a chunk)
    BCO: int  # output channels a block
    #: blocks a multiprocessor holds (__launch_bounds__): 2 caps a thread at 128 registers, where
    #: ptxas spills 50-500 bytes a thread (sm_90), 1 lets it take up to 255 without spilling
    min_blocks: int = 1
    #: 1: the transformed patches in two buffers, a chunk staged while the one before is summed
    #: (one barrier a chunk), U read from the scratch (L1) in the sums, not staged; 0: one buffer
    #: for both, staged between two barriers
    pipelined: int = 0

    @property
    def KC(self) -> int:
        return _THREADS // self.BT

    def _floats(self) -> tuple[int, int]:
        """(the staged chunks, half the points' sums Ms at the end), in floats."""
        stage = 16 * self.KC * (2 * self.BT if self.pipelined else self.BT + self.BCO)
        return stage, 8 * self.BCO * (self.BT + 1)

    def flags_at(self) -> int:
        """Where the tile flags lie in the dynamic shared memory (floats; pipelined only)."""
        return max(self._floats())

    def shared_bytes(self) -> int:
        """The block's dynamic shared memory: the staged chunks or, at the end, half the points'
        sums, whichever is larger (pipelined: then the tile flags)."""
        return 4 * (self.flags_at() + (self.BT if self.pipelined else 0))


#: the blockings the template takes: RM = BCO / 4 and RT = BT / 4 sums a thread of each point
PLANS = tuple(FusedPlan(bt, bco, mb, pipe) for pipe in (0, 1) for mb in (1, 2)
              for bt, bco in ((32, 32), (32, 16), (16, 16), (64, 16)))


def serves(g: dict[str, Any]) -> str | None:
    """None where the family serves a convolution of geometry `g` (the CUDA table's), else why not."""
    if g["kind"] not in KINDS:
        return "it serves the forward and grad-input of convolutions (the grad-weight sums over tiles: winograd)"
    return convolution_rejects(g)


def plans(g: dict[str, Any]) -> list[FusedPlan]:
    """Every blocking that fits, the default first: 32 x 32 pipelined at 2 blocks a
    multiprocessor (the fastest of the 16 on every 64-channel layer measured, docs/benchmarks.md,
    session 34), or 16 channels a block where the output has at most 16 (a wider one would sum
    zeros)."""
    fit = [q for q in PLANS if q.shared_bytes() <= _SHARED_LIMIT]
    k = correlation(g, 2)
    first = FusedPlan(32, 16, 2, 1) if k["CO"] <= 16 else FusedPlan(32, 32, 2, 1)
    return [first] + [q for q in fit if q != first]


def _u_extents(g: dict[str, Any], plan: FusedPlan) -> tuple[int, int]:
    """U's extents (input, output channels): padded to whole chunks and blocks where the
    pipelined kernel reads it without checks."""
    k = correlation(g, 2)
    if plan.pipelined:
        return round_up(k["CI"], plan.KC), round_up(k["CO"], plan.BCO)
    return k["CI"], k["CO"]


def _regions(g: dict[str, Any], plan: FusedPlan) -> tuple[int, int, int]:
    """Byte offsets of the transformed weights U[pos][ci][co] and the non-finite flag, and the total."""
    uci, uco = _u_extents(g, plan)
    flag = round_up(4 * 16 * uci * uco, SCRATCH_ALIGN)
    return 0, flag, flag + SCRATCH_ALIGN


def scratch_bytes(g: dict[str, Any], plan: FusedPlan) -> int:
    return _regions(g, plan)[2]


def render(name: str, g: dict[str, Any], plan: FusedPlan, *, bias: bool = False, relu: bool = False,
           relu_mask: bool = False, epilogue: PointwiseEpilogue | None = None) -> CudaKernel:
    """The kernel: roles x, w, [bias], out (forward) or dy, w, [mask_src], out (grad-input), then a
    generated epilogue's, and the scratch block; launches _clear, _wt (the unfused kernel's) and
    _fused."""
    kind, why_not = g["kind"], serves(g)
    if why_not is not None:
        raise ValueError(f"winograd_fused does not serve this convolution: {why_not}")
    roles, inputs, src = conv_roles("fused winograd", kind, bias=bias, relu=relu, relu_mask=relu_mask)
    if plan not in PLANS or plan.shared_bytes() > _SHARED_LIMIT:
        raise ValueError(f"{name}: {plan} is not a blocking of the fused template ({PLANS})")
    k, transform = correlation(g, 2), TRANSFORMS[2]
    off_a, off_flag, total = _regions(g, plan)
    uci, uco = _u_extents(g, plan)
    roles, inputs, unrestricted = with_epilogue(roles, inputs, epilogue)
    ph, pw = pair(g["padding"], "padding")
    description = (f"conv2d forward x({g['N']},{g['C']},{g['H']},{g['W']}) w({g['O']},{g['C']},3,3) padding ({ph},{pw})"
                   f"{' +bias' if bias else ''}{' +relu' if relu else ''}" if kind == "conv2d" else
                   f"conv2d grad-input dy({g['N']},{g['O']},{g['HO']},{g['WO']}) w({g['O']},{g['C']},3,3) padding "
                   f"({ph},{pw}){' *relu-mask' if relu_mask else ''}")
    code = _env.get_template("conv_winograd.j2").render(
        name=name, description=description + f", Winograd F(2x2, 3x3) fused, blocks of {plan.BT} tiles x {plan.BCO} channels",
        kind=kind, t=transform, lin=combination, **k, off_a=off_a // 4, off_b=0, off_m=0, off_flag=off_flag // 4,
        roles=roles, inputs=inputs, unrestricted=unrestricted, signature=kernel_signature(roles, inputs, unrestricted, True),
        src=src, flip=kind == "conv2d_grad_input", bias=bias, relu=relu, relu_mask=relu_mask, pw=epilogue,
        fused=True, BT=plan.BT, BCO=plan.BCO, KC=plan.KC, min_blocks=plan.min_blocks, pipelined=plan.pipelined,
        upad=bool(plan.pipelined), UCI=uci, UCO=uco, flags_at=plan.flags_at())
    args = tuple(roles) + ("scratch",)
    grid = (ceil_div(k["T"], plan.BT), ceil_div(k["CO"], plan.BCO), 1)
    if grid[0] > 2**31 - 1 or grid[1] > 65535:
        raise ValueError(f"{name}: the fused Winograd grid {grid} is too large")
    launches = (Launch(f"{name}_clear", (1, 1, 1), (32, 1, 1), 0, args),
                Launch(f"{name}_wt", (ceil_div(uci * uco, _THREADS), 1, 1), (_THREADS, 1, 1), 0, args),
                Launch(f"{name}_fused", grid, (_THREADS, 1, 1), plan.shared_bytes(), args))
    return CudaKernel(name, code, launches, total)


def stamped(plan: FusedPlan) -> tuple[tuple[str, int], ...]:
    """A plan as the choice table stamps it."""
    return (("BT", plan.BT), ("BCO", plan.BCO), ("min_blocks", plan.min_blocks)) + \
        ((("pipelined", 1),) if plan.pipelined else ())  # session 33's records name the unpipelined plans so


def family_render(name: str, sub: Any, spec: Any, g: dict[str, Any], plan: tuple, epilogue: Any) -> CudaKernel:
    """The choice table's renderer (its plan stamped pairs, its epilogues the spec's)."""
    eps = spec.epilogues
    return render(name, g, FusedPlan(**dict(plan)), bias="bias" in eps, relu="relu" in eps,
                  relu_mask="relu_mask" in eps, epilogue=epilogue)
