"""The direct stride-1 convolutions of `cuda_direct` on tensor cores: TF32 (precision "tf32") and
bfloat16 operands (precision "bf16").

Same blocking as the float32 direct kernels, the FMAs replaced by `mma.sync.m16n8k8` (operands
rounded to TF32 with cvt.rna, fp32 accumulation; fragment layout and helpers in `mma_tf32.j2`,
shared with the GEMM's tensor-core path):

- forward and grad-input (`conv2d_direct_tc.j2`): a block stages RB input rows (with their halo)
  of one image and the weights, CC input channels at a time, in shared memory, rounded to TF32
  once as they are staged. Per kernel tap (kh, kw) the convolution is a GEMM: m = the block's
  RB x WO output pixels (flattened, 16 a tile), n = output channels (8 a tile), k = input
  channels (8 a step), and A(pixel, channel) is the staged input at the pixel's offset plus the
  tap's: the sliding window is an address, so nothing is gathered twice from global memory.
  A warp owns FM pixel tiles x FN channel tiles.
- grad-weight (`conv2d_direct_tc_gw.j2`): dw[:, :, kh, kw] = dy (O x pixels) @ x shifted by the
  tap (pixels x C); a block walks a fixed range of (image, RB rows) units, staged with cp.async
  into two buffers (the next unit's copies in flight while this one is summed), and writes its
  partial sums; a second launch adds them in block order (deterministic, no atomics). A warp owns
  FM tiles of 16 output channels x FN tiles of 8 input channels x KHW kernel rows (all KW taps),
  so each dy fragment it reads serves FN x KHW x KW mmas.

With bfloat16 operands, stages of 16-channel steps (forward, grad-input) and the grad-weight's
pixels are staged as bfloat16 pairs and multiplied on `mma.sync.m16n8k16` (`mma_bf16.j2`); other
forward stages keep the TF32 mma, in which bfloat16 values are exact.

The cost model never picks the family (`direct_tc` in `cuda_choices`): tuning records and the
family prior (measured rankings) do, and the planners' rankings only order the plans the tuner
measures.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cuda_direct import _direct_geometry, direct_roles
from .cuda_kernels import (SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, _conv_geometry, _reduce_groups,
                           kernel_signature, with_epilogue)
from .device import current, static_shared_budget
from .shapes import ceil_div, round_up
from .templates_env import environment

_env = environment("cuda")

#: most fp32 accumulators a thread holds (4 a 16 x 8 tile): the float32 direct kernels' register budget
MAX_ACCUMULATORS = 64
#: plans the tuner measures per kernel: the planner's best TUNE_TOP, then the best of each warp tile
#: and of each size of block
TUNE_TOP = 6


@dataclass(frozen=True)
class TcPlan:
    """Tiling of the forward / grad-input kernel."""
    RB: int   # output rows a block
    CC: int   # input channels a shared-memory stage (a multiple of 8)
    FM: int   # 16-pixel tiles a warp
    FN: int   # 8-channel tiles a warp
    WM: int   # warps along the pixels
    WN: int   # warps along the output channels
    score: float = 0.0  # the planner's ranking (not part of a stamped plan)

    @property
    def threads(self) -> int:
        return 32 * self.WM * self.WN


@dataclass(frozen=True)
class TcGwPlan:
    """Tiling of the grad-weight kernel."""
    RB: int      # output rows a unit (one image)
    FM: int      # 16-output-channel tiles a warp
    FN: int      # 8-input-channel tiles a warp
    KHW: int     # kernel rows a warp (each with all KW taps)
    blocks: int  # blocks of the first launch (partials in scratch)
    score: float = 0.0

    def threads(self, C: int, O: int, KH: int) -> int:
        return 32 * (ceil_div(O, 16) // self.FM) * (ceil_div(C, 8) // self.FN) * (KH // self.KHW)


def stride_8_mod_16(n: int) -> int:
    """The least stride >= n that is 8 mod 16: a fragment read (lanes t = 0..3 one stride apart,
    g = 0..7 one float apart) then hits 32 distinct shared-memory banks."""
    return n + (8 - n % 16) % 16


def stride_4_mod_8(n: int) -> int:
    """The least stride >= n that is 4 mod 8: a fragment read (lanes g = 0..7 one stride apart,
    t = 0..3 one float apart) then hits 32 distinct shared-memory banks."""
    return n + (4 - n % 8) % 8


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def _occupancy(threads: int, registers: int, shared_bytes: int) -> float:
    """Warps a multiprocessor holds at once over 16 (a guess at what hides the mma and shared-memory
    latencies; at most 1), for blocks of `threads` taking an estimated `registers` a thread; 0
    when not one block fits."""
    dev = current()
    blocks = min(dev.max_threads_per_multiprocessor // threads, dev.max_blocks_per_multiprocessor,
                 dev.registers_per_multiprocessor // (round_up(registers, 8) * threads),
                 dev.shared_per_multiprocessor // (shared_bytes + 1024))
    return min(1.0, blocks * threads / 32 / 16)


# --------------------------------------------------------------------------- forward / grad-input

def tc_shared_floats(CC: int, RB: int, KH: int, KW: int, WO: int, CO: int, pairs: bool = False) -> int:
    """4-byte words of shared memory of the forward kernel: CC channel planes of RB + KH - 1 staged
    rows and the CC x KH x KW x CO weights (rows of output channels padded to 8 mod 16); with
    `pairs` (bfloat16 operands), two channels a word."""
    rows = CC // 2 if pairs else CC
    return rows * stride_8_mod_16((RB + KH - 1) * (WO + KW - 1)) + KH * KW * rows * stride_8_mod_16(round_up(CO, 8))


def tc_channels_per_step(CI: int, RB: int, KH: int, KW: int, WO: int, CO: int, pairs: bool = False) -> int | None:
    """Input channels a stage: the largest even split of CI, rounded up to a k step (8 channels;
    16 with `pairs`, bfloat16's mma) and at most 32, whose rows and weights fit the static shared
    memory of a block; None if not even one step fits."""
    budget = static_shared_budget(current())
    step = 16 if pairs else 8
    for parts in range(1, ceil_div(CI, step) + 1):
        CC = round_up(ceil_div(CI, parts), step)
        if CC <= 32 and 4 * tc_shared_floats(CC, RB, KH, KW, WO, CO, pairs) <= budget:
            return CC
    return None


def tc_forward_plans(N: int, CI: int, CO: int, HO: int, WO: int, KH: int, KW: int, pairs: bool = False) -> list[TcPlan]:
    """Every feasible tiling of a stride-1 convolution producing CO x HO x WO per image from CI
    channels, the planner's best first (a guess: unmeasured, see the module's doc). `pairs`: for
    bfloat16 operands, whose stages of whole 16-channel steps run on bfloat16 mma (k = 16)."""
    sms = current().multiprocessors
    NT = ceil_div(CO, 8)
    plans = []
    for RB in range(1, HO + 1):
        MT = ceil_div(RB * WO, 16)
        fitted = False
        for NB in tc_channel_tiles(CO):  # 8-channel tiles a block: every output channel, or a share
            tiles = ceil_div(NT, NB)
            CC = tc_channels_per_step(CI, RB, KH, KW, WO, 8 * NB, pairs)
            if CC is None:
                continue
            fitted = True
            for FN in _divisors(NB, 8):
                for FM in (1, 2, 3, 4):
                    WM, WN = ceil_div(MT, FM), NB // FN
                    if 4 * FM * FN > MAX_ACCUMULATORS or not 64 <= 32 * WM * WN <= 512:
                        continue
                    # work done over work issued: pixel tiles, rows past HO, channel tiles, k steps
                    useful = (RB * WO / (16 * FM * WM) * HO / (ceil_div(HO, RB) * RB) * CO / (8 * NB * tiles)
                              * CI / (CC * ceil_div(CI, CC)))
                    lds = (4 * FM + 2 * FN) / (FM * FN)  # fragment loads a mma
                    # warp instructions staging a stage's rows and weights (~12 a word) a mma (the
                    # rows staged again by every channel tile's block)
                    rows, ksteps = (CC // 2, CC // 16) if pairs else (CC, CC // 8)
                    staging = 12 / 32 * (rows * (RB + KH - 1) * (WO + KW - 1) + KH * KW * rows * 8 * NB) \
                        / (ksteps * KH * KW * WM * FM * WN * FN)
                    fill = min(1.0, N * ceil_div(HO, RB) * tiles / (2 * sms))
                    # registers: ptxas -v on conv2's plans (accumulators, fragments, offsets) ~ this
                    occupancy = _occupancy(32 * WM * WN, 4 * FM * FN + 8 * FM + 4 * FN + 16,
                                           4 * tc_shared_floats(CC, RB, KH, KW, WO, 8 * NB, pairs))
                    if occupancy == 0:
                        continue  # not one block fits a multiprocessor's registers: it would spill
                    score = useful * fill * occupancy / (1 + 0.5 * (lds + staging))
                    plans.append(TcPlan(RB, CC, FM, FN, WM, WN, score))
        if not fitted:
            break  # more rows fit even less
    return sorted(plans, key=lambda p: -p.score)


def tc_channel_tiles(CO: int) -> list[int]:
    """8-channel tiles of output channels a block may own: all of them (their weights staged
    together), or for more than 64 channels 4, 8 or 16 tiles (a grid axis over the shares, each
    block staging its share's weights: 256 channels' weights of a 16-channel stage are 76 KB)."""
    NT = ceil_div(CO, 8)
    return [NT] + ([d for d in (4, 8, 16) if d < NT] if NT > 8 else [])


def tc_plan_fits(plan: TcPlan, N: int, CI: int, CO: int, HO: int, WO: int, KH: int, KW: int,
                 pairs: bool = False) -> bool:
    """Whether a forward / grad-input plan (a tuning record's, which the planner of today may no
    longer list) tiles this convolution and its stage fits a block's static shared memory: bfloat16
    operands (`pairs`) stage a 16-channel multiple two channels a word, any other stage as floats."""
    pairs = pairs and plan.CC % 16 == 0
    return (plan.CC % 8 == 0 and 0 < plan.CC <= 32 and 1 <= plan.RB <= HO and plan.FM >= 1 and plan.FN >= 1
            and plan.WM * plan.FM * 16 >= plan.RB * WO and 1 <= plan.WN * plan.FN <= ceil_div(CO, 8)
            and 64 <= plan.threads <= 1024 and N <= 65535
            and 4 * tc_shared_floats(plan.CC, plan.RB, KH, KW, WO, 8 * plan.WN * plan.FN, pairs)
            <= static_shared_budget(current()))


def _spread(ranked: list, *shapes) -> list:
    """The best TUNE_TOP plans, then the best of each value of every `shape(plan)` among the rest
    (the ranking is a guess: the spread covers what it may misjudge)."""
    out = list(ranked[:TUNE_TOP])
    for shape in shapes:
        seen = {shape(p) for p in out}
        for p in ranked:
            if shape(p) not in seen:
                seen.add(shape(p))
                out.append(p)
    return list(dict.fromkeys(out))


def _rows_class(RB: int) -> int:
    return min(RB.bit_length(), 5)  # 1, 2-3, 4-7, 8-15, 16 and more rows a block


def tc_forward_candidates(N: int, CI: int, CO: int, HO: int, WO: int, KH: int, KW: int,
                          pairs: bool = False) -> list[TcPlan]:
    """The plans worth measuring, the planner's best first: a spread over warp tiles and rows a block."""
    return _spread(tc_forward_plans(N, CI, CO, HO, WO, KH, KW, pairs), lambda p: (p.FM, p.FN),
                   lambda p: _rows_class(p.RB))


def _problem(name: str, grad_input: bool, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride,
             padding) -> tuple[dict[str, int], int, int, int, int] | None:
    """(the forward convolution the kernel computes, ph, pw, HO, WO), or None where no direct
    kernel applies (stride > 1, padding not smaller than the kernel, too many images for the grid)."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if (sh, sw) != (1, 1) or ph >= KH or pw_ >= KW or N > 65535:
        return None
    return _direct_geometry(grad_input, N, C, H, W, O, KH, KW, HO, WO, ph, pw_), ph, pw_, HO, WO


def tc_direct_problem(*, grad_input: bool, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride=(1, 1),
                      padding=(0, 0)) -> dict[str, int] | None:
    """The forward convolution (CI, CO, HO_, WO_, ...) the forward / grad-input kernel computes,
    or None where none applies."""
    found = _problem("direct_tc", grad_input, N, C, H, W, O, KH, KW, stride, padding)
    return None if found is None else found[0]


def render_direct_tc(name: str, *, grad_input: bool, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                     stride=(1, 1), padding=(0, 0), bias: bool = False, relu: bool = False, relu_mask: bool = False,
                     epilogue: PointwiseEpilogue | None = None, plan: TcPlan | None = None,
                     bf16_roles: frozenset[str] = frozenset()) -> CudaKernel | None:
    """The direct forward convolution (roles x, w, [bias], out) or grad-input (roles dy, w,
    [mask_src], out) on TF32 tensor cores; None where no plan fits. `plan`: the planner's best.
    `bf16_roles`: the roles whose buffers hold bfloat16 (precision "bf16": the operands and output
    of the convolution), read as their exact values and stored rounded."""
    found = _problem(name, grad_input, N, C, H, W, O, KH, KW, stride, padding)
    if found is None:
        return None
    geo, ph, pw_, HO, WO = found
    roles, inputs, src, description = direct_roles(grad_input, N, C, H, W, O, KH, KW, HO, WO, ph, pw_, bias=bias,
                                                   relu=relu, relu_mask=relu_mask)
    if plan is None:
        plans = tc_forward_plans(N, geo["CI"], geo["CO"], geo["HO_"], geo["WO_"], KH, KW, {src, "w"} <= bf16_roles)
        if not plans:
            return None
        plan = plans[0]
    roles, inputs, unrestricted = with_epilogue(roles, inputs, epilogue)
    RS, WS = plan.RB + KH - 1, geo["WO_"] + KW - 1
    NB = plan.WN * plan.FN  # 8-channel tiles a block
    if not (plan.CC % 8 == 0 and plan.WM * plan.FM * 16 >= plan.RB * geo["WO_"]
            and 1 <= NB <= ceil_div(geo["CO"], 8)):
        raise ValueError(f"{name}: plan {plan} does not tile {geo['CO']} channels x {plan.RB} rows of {geo['WO_']}")
    tiles = ceil_div(geo["CO"], 8 * NB)  # blocks along the output channels (grid z)
    grid = (ceil_div(geo["HO_"], plan.RB), N, tiles)
    # bfloat16 operands a stage of whole 16-channel steps: multiplied as bfloat16 pairs (m16n8k16)
    pairs = {src, "w"} <= bf16_roles and plan.CC % 16 == 0
    code = _env.get_template("conv2d_direct_tc.j2").render(
        name=name, description=description, N=N, KH=KH, KW=KW, **geo, RB=plan.RB, CC=plan.CC, FM=plan.FM,
        FN=plan.FN, WM=plan.WM, WN=plan.WN, threads=plan.threads, plane=stride_8_mod_16(RS * WS),
        cop=stride_8_mod_16(round_up(geo["CO"], 8) if tiles == 1 else 8 * NB), tiles=tiles,
        roles=roles, inputs=inputs, unrestricted=unrestricted,
        signature=kernel_signature(roles, inputs, unrestricted, False, bf16_roles), grid=grid, flip=grad_input,
        src=src, bias=bias and not grad_input, relu=relu and not grad_input, relu_mask=relu_mask and grad_input,
        pw=epilogue, bf16_roles=bf16_roles, bf16=bool(bf16_roles), pairs=pairs, bits="" if pairs else "__float_as_uint")
    return CudaKernel(name, code, (Launch(f"{name}_direct_tc", grid, (plan.threads, 1, 1), 0, roles),), 0)


# --------------------------------------------------------------------------- grad-weight

def tc_gw_buffer_floats(C: int, O: int, KH: int, KW: int, WO: int, RB: int, pairs: bool = False) -> int:
    """Words (floats, or with `pairs` bfloat16 pairs) of one staging buffer of the grad-weight
    kernel: dy as ceil(O/16)*16 rows of the unit's pixels (rounded up to a k step; the row stride
    4 mod 8), then x as ceil(C/8)*8 planes of RB + KH - 1 rows (plane stride 4 mod 8); a multiple
    of 4 (the second buffer stays aligned). With `pairs` a dy row holds pixel pairs (rows padded
    to an even width) and an x plane two copies of the plane's pairs, the second a value later
    (`_gw_pairs_plane`)."""
    ps, plane = _gw_strides(RB, KH, KW, WO, pairs)
    return round_up(round_up(O, 16) * ps + round_up(C, 8) * plane, 4)


def _gw_pixels(RB: int, WO: int, pairs: bool) -> int:
    """A unit's pixels rounded up to whole k steps: of 8, or with bfloat16 pairs of 16, the rows
    padded to an even width (a pair never spans two rows)."""
    return round_up(RB * round_up(WO, 2), 16) if pairs else round_up(RB * WO, 8)


def _gw_strides(RB: int, KH: int, KW: int, WO: int, pairs: bool) -> tuple[int, int]:
    """Words from one dy row to the next and from one x plane to the next in a staging buffer."""
    if pairs:
        return stride_4_mod_8(_gw_pixels(RB, WO, True) // 2), stride_4_mod_8(2 * _gw_pairs_plane(RB, KH, KW, WO))
    return stride_4_mod_8(_gw_pixels(RB, WO, False)), stride_4_mod_8((RB + KH - 1) * (WO + KW - 1))


def _gw_pairs_plane(RB: int, KH: int, KW: int, WO: int) -> int:
    """Words of one copy of a staged x plane of bfloat16 pairs: every pair a tap reads, up to the
    value after the last (a padded pixel reads one past the plane)."""
    return (RB + KH - 1) * (WO + KW - 1) // 2 + 1


def tc_grad_weight_plans(N: int, C: int, O: int, KH: int, KW: int, HO: int, WO: int,
                         pairs: bool = False) -> list[TcGwPlan]:
    """Every feasible tiling of the grad-weight kernel, the planner's best first (unmeasured).
    `pairs`: x and dy of bfloat16 (the bfloat16 mma, k steps of 16 pixels)."""
    dev = current()
    MT, NT = ceil_div(O, 16), ceil_div(C, 8)
    plans = []
    for RB in (1, 2, 3, 4, 6, 8):
        smem = 2 * 4 * tc_gw_buffer_floats(C, O, KH, KW, WO, RB, pairs)
        if RB > HO or smem > dev.shared_per_block:
            continue  # two buffers must fit the dynamic shared memory a launch takes without opting in
        units = N * ceil_div(HO, RB)
        blocks = max(1, min(units, 4 * dev.multiprocessors, units // 2 or 1))
        pixels = _gw_pixels(RB, WO, pairs)
        for FM in _divisors(MT, 8):
            for FN in _divisors(NT, 8):
                for KHW in _divisors(KH, KH):
                    warps = MT // FM * (NT // FN) * (KH // KHW)
                    if 4 * FM * FN * KHW * KW > MAX_ACCUMULATORS or warps > 32:
                        continue
                    taps = FN * KHW * KW  # mmas a dy fragment serves
                    lds = (4 * FM + 2 * taps) / (FM * taps)
                    useful = (O / (16 * MT) * C / (8 * NT) * RB * WO / pixels
                              * HO / (ceil_div(HO, RB) * RB))
                    fill = min(1.0, blocks * warps / (8 * dev.multiprocessors))
                    # registers: ptxas -v on conv2's plans ~ this
                    occupancy = _occupancy(32 * warps, 4 * FM * FN * KHW * KW * 7 // 5 + 45, smem)
                    if occupancy == 0:
                        continue  # not one block fits a multiprocessor's registers: it would spill
                    score = useful * fill * occupancy / (1 + lds) / (1 + 0.1 * (RB + KH - 1) / RB)
                    plans.append(TcGwPlan(RB, FM, FN, KHW, blocks, score))
    return sorted(plans, key=lambda p: -p.score)


def tc_grad_weight_candidates(N: int, C: int, O: int, KH: int, KW: int, HO: int, WO: int,
                              pairs: bool = False) -> list[TcGwPlan]:
    """The grad-weight plans worth measuring, the planner's best first."""
    return _spread(tc_grad_weight_plans(N, C, O, KH, KW, HO, WO, pairs), lambda p: (p.FM, p.FN, p.KHW),
                   lambda p: p.RB)


def render_direct_tc_grad_weight(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                                 stride=(1, 1), padding=(0, 0), epilogue: PointwiseEpilogue | None = None,
                                 plan: TcGwPlan | None = None,
                                 bf16_roles: frozenset[str] = frozenset()) -> CudaKernel | None:
    """dw = conv2d_grad_weight(x, dy) for stride 1 on tensor cores: roles x, dy, out
    (O, C, KH, KW); two launches (per-block partials in scratch, their fixed-order sum); None
    where no plan fits. `plan`: the planner's best. `bf16_roles`: the roles holding bfloat16
    (precision "bf16"): x and dy both bfloat16 are staged as pixel pairs and multiplied on the
    bfloat16 mma (`pairs`); one of them alone is widened as it is staged, exact in TF32; the sum
    is rounded to bfloat16 before the epilogue."""
    sh, sw, ph, pw_, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    if (sh, sw) != (1, 1) or ph >= KH or pw_ >= KW:
        return None
    pairs = {"x", "dy"} <= bf16_roles
    if plan is None:
        plans = tc_grad_weight_plans(N, C, O, KH, KW, HO, WO, pairs)
        if not plans:
            return None
        plan = plans[0]
    MT, NT = ceil_div(O, 16), ceil_div(C, 8)
    if MT % plan.FM or NT % plan.FN or KH % plan.KHW:
        raise ValueError(f"{name}: plan {plan} does not tile {O} x {C} x {KH} rows of weights")
    buf = tc_gw_buffer_floats(C, O, KH, KW, WO, plan.RB, pairs)
    smem = 2 * 4 * buf
    if smem > current().shared_per_block:
        return None  # rows that do not fit two buffers
    roles, inputs, unrestricted = with_epilogue(("x", "dy", "out"), ("x", "dy"), epilogue)
    outs = O * C * KH * KW
    rg = _reduce_groups(plan.blocks)
    threads = plan.threads(C, O, KH)
    ps, plane = _gw_strides(plan.RB, KH, KW, WO, pairs)
    code = _env.get_template("conv2d_direct_tc_gw.j2").render(
        name=name, description=f"conv2d grad-weight x({N},{C},{H},{W}) dy({N},{O},{HO},{WO}) padding ({ph},{pw_})",
        N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW, PH=ph, PW=pw_, HO=HO, WO=WO, RB=plan.RB, FM=plan.FM, FN=plan.FN,
        KHW=plan.KHW, blocks=plan.blocks, threads=threads, ps=ps, plane=plane, buf=buf,
        roles=roles, inputs=inputs, unrestricted=unrestricted,
        signature=kernel_signature(roles, inputs, unrestricted, True, bf16_roles), rg=rg, rgrid=ceil_div(outs, 32),
        pw=epilogue, bf16_roles=bf16_roles, bf16=bool({"x", "dy"} & bf16_roles), pairs=pairs)
    args = roles + ("scratch",)
    return CudaKernel(name, code, (Launch(f"{name}_direct_tc", (plan.blocks, 1, 1), (threads, 1, 1), smem, args),
                                   Launch(f"{name}_reduce", (ceil_div(outs, 32), 1, 1), (32 * rg, 1, 1), 0, args)),
                      tc_grad_weight_scratch(plan.blocks, O, C, KH, KW))


def tc_grad_weight_scratch(blocks: int, O: int, C: int, KH: int, KW: int) -> int:
    """Scratch bytes of the grad-weight kernel: one partial of every weight per block."""
    return round_up(4 * blocks * O * C * KH * KW, SCRATCH_ALIGN)
