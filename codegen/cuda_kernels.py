"""Renderers for the CUDA kernels of contractions, the loss and the SGD update (fp32).

Each ``render_*`` function turns a static shape into CUDA C++ source (the templates live in
``templates/cuda/``) and returns a :class:`CudaKernel`: the source, the launches to make in order
and the device scratch they need.

Contract shared by every kernel here:

* layouts are the user's: activations NCHW, conv weights OIHW, Linear weights (out, in), all
  row-major and contiguous; outputs are fully overwritten (no zero-fill needed beforehand);
* arithmetic is plain fp32 with explicit FMA (``fmaf``): no TF32, no tensor cores, no fast-math
  intrinsics (the loss uses ``expf``/``logf``);
* no float atomics: every output element is written by exactly one thread, and split-K
  partials are summed by a second launch in a fixed order, so results are bit-identical run to
  run;
* any number of kernels can be concatenated into one translation unit: helpers live in
  ``namespace ember_cu_<NAME>``; the only global symbols are ``extern "C" __global__`` functions
  named ``<NAME>_<suffix>``;
* launch arguments are device pointers, one per role, in the order of ``Launch.args``; the
  runtime passes the base of one scratch block (at least ``scratch_bytes``, 256-byte aligned)
  for every ``"scratch"``, and that base plus OFF bytes for a role ``"scratch@OFF"`` (a region
  of the block: a kernel made of other kernels' launches hands them their operands there,
  `scratch_role`). A role ``"counters#W"`` is W unsigned words of the kernel's own that are zero
  before its first launch and that it leaves zero (`counter_role`: a split reduction's arrival
  counters); the runtime allocates them once per kernel, apart from the arena. The loss's
  ``labels`` role is an int64 pointer.

The contractions share one implicit-GEMM skeleton (``gemm.j2``): C[b,m,n] = sum_k A(b,m,k) *
B(b,k,n) where each kernel template defines how A and B elements are gathered (convolution
windows are gathered on the fly; no im2col buffer) and the epilogue (bias, ReLU, ReLU-backward
mask, layout of the store). A block computes a BM x BN tile with a register-prefetched
shared-memory pipeline over BK-deep k-tiles; each thread holds a TM x TN register tile read
from shared memory as float4/float2 vectors. When the output tiles alone cannot fill the GPU
and K is long, the k range is split over ``gridDim.z``: launch 1 writes per-split partials to
scratch, launch 2 sums them in split order and applies the epilogue. Tile sizes and the split
count are chosen per shape by a small cost model of the active device (`device.current()`).
"""
from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .device import current
from .shapes import ceil_div, check_positive, pair, round_up
from .templates_env import environment

__all__ = [
    "Launch", "CudaKernel", "GemmPlan", "PointwiseEpilogue", "plan_gemm", "plan_candidates", "scratch_role",
    "scratch_offset", "counter_role", "counter_words",
    "gemm_scratch_bytes", "grad_input_gemm",
    "render_conv2d_forward", "render_conv2d_grad_input", "render_conv2d_grad_weight",
    "render_matmul", "render_softmax_cross_entropy", "render_softmax_cross_entropy_grad", "render_sgd_update",
]


#: Alignment in bytes of every sub-buffer carved out of the scratch block.
SCRATCH_ALIGN = 256


@dataclass(frozen=True)
class Launch:
    function: str                 # an extern "C" __global__ function defined in the source
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int             # dynamic shared memory (0: static only)
    args: tuple[str, ...]         # role names in argument order ("scratch" for the scratch block)
    #: by-value arguments after the buffers, (C type, value): the sizes a kernel takes at run time
    #: (a generated kernel's leading extent), so its code serves every batch size
    scalars: tuple[tuple[str, int], ...] = ()


def scratch_role(offset: int) -> str:
    """The launch role of the scratch block's region at `offset` bytes (256-byte aligned)."""
    if offset < 0 or offset % SCRATCH_ALIGN:
        raise ValueError(f"scratch region at {offset} bytes: not a multiple of {SCRATCH_ALIGN}")
    return "scratch" if offset == 0 else f"scratch@{offset}"


#: the launch roles of a kernel's pointers to relaid operands other kernels' scratch holds (an
#: `nhwc_tc` / `nhwc_wg` grad-weight's x and dy images: its forward's, its grad-input's), each bound to that
#: kernel's scratch block by the graph note `reads_scratch_of` ({role: kernel}; passes/share_relayouts.py)
IMAGE_ROLES = ("x_image", "dy_image")


def scratch_offset(role: str) -> int | None:
    """The byte offset in the scratch block a launch role names (0 for "scratch"); None for a
    role that is not the scratch block's."""
    if role == "scratch":
        return 0
    if role.startswith("scratch@"):
        return int(role[len("scratch@"):])
    return None


def counter_role(words: int) -> str:
    """The launch role of `words` arrival counters of the kernel's own: zero when it first runs,
    left zero by every launch, never in the arena (which other kernels overwrite between steps)."""
    if words < 1:
        raise ValueError(f"counters: need at least one word, got {words}")
    return f"counters#{words}"


def counter_words(role: str) -> int | None:
    """How many counter words a launch role names; None for a role that is not counters."""
    return int(role[len("counters#"):]) if role.startswith("counters#") else None


#: C types of by-value launch arguments -> NumPy's (CuPy passes a NumPy scalar by value, as its type)
SCALAR_TYPES = {"int": np.int32, "int64_t": np.int64}

#: the statement every generated kernel body starts with (the prelude's macro: wait for the grid
#: before on the stream, then let the next one launch); the runtime launches a kernel as its
#: predecessor's programmatic dependent only because of it
GRID_DEPENDENCY = "EM_GRID_DEPENDENCY();"
_KERNEL_BODY = re.compile(r'(extern "C" __global__ [^;{]*\)\s*\{)')


def with_grid_dependency(code: str) -> str:
    """`code` with GRID_DEPENDENCY first in the body of each of its kernels (templates stay
    unaware of it: one rule for every family, present and future)."""
    return _KERNEL_BODY.sub(lambda m: m.group(1) + " " + GRID_DEPENDENCY, code)


def scalar_args(scalars: tuple[tuple[str, int], ...]) -> tuple[Any, ...]:
    """A launch's by-value arguments as the NumPy scalars a CuPy kernel call takes."""
    return tuple(SCALAR_TYPES[ctype](value) for ctype, value in scalars)


@dataclass(frozen=True)
class CudaKernel:
    name: str
    code: str                     # CUDA C++ source: the extern "C" __global__ functions NAME_*
    launches: tuple[Launch, ...]  # made in order on one stream
    scratch_bytes: int            # device scratch the launches need (0: none)


@dataclass(frozen=True)
class PointwiseEpilogue:
    """A generated epilogue: statements computing the stored value from `red` (the contraction's
    value after the template's own epilogues) at flat output index `i`, reading the kernel's
    operands in<k> for k in `inputs` (extra roles of the launch, after the template's)."""
    body: tuple[str, ...]
    result: str
    inputs: tuple[int, ...]
    index_type: str = "int"
    #: the same epilogue of an NCHW output at (img, channel o, pixel pix) (`red` the value there):
    #: (the statements of the channel alone, those of each element, the result), where a kernel
    #: storing a channel's pixels together computes the channel's (its per-channel operands'
    #: loads, a variance's square root) once for them; None where the output is not 4-d
    by_channel: tuple[tuple[str, ...], tuple[str, ...], str] | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(f"in{k}" for k in self.inputs)


_env = environment("cuda")


def _render(template: str, **ctx) -> str:
    return _env.get_template(template).render(**ctx)


# --------------------------------------------------------------------------- validation







def _check_name(name: str) -> None:
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"kernel name {name!r} is not a C identifier")




def _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding):
    """Validates a convolution's arguments; returns (sh, sw, ph, pw, HO, WO)."""
    _check_name(name)
    check_positive(N=N, C=C, H=H, W=W, O=O, KH=KH, KW=KW)
    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding")
    if sh < 1 or sw < 1 or ph < 0 or pw < 0:
        raise ValueError("stride must be >= 1 and padding >= 0")
    HO = (H + 2 * ph - KH) // sh + 1
    WO = (W + 2 * pw - KW) // sw + 1
    if HO < 1 or WO < 1:
        raise ValueError(f"empty convolution output ({HO}x{WO}) for input {H}x{W}, kernel {KH}x{KW}")
    # Indices are 32-bit in the kernels (products are formed in int).
    if max(N * C * H * W, N * O * HO * WO, O * C * KH * KW) >= 2**31:
        raise ValueError("tensor too large for 32-bit indexing")
    return sh, sw, ph, pw, HO, WO


def grad_input_gemm(N: int, C: int, H: int, W: int, O: int, KH: int, KW: int, stride=(1, 1),
                    padding=(0, 0)) -> tuple[int, int, int, int]:
    """(M, N, K, batch) of conv2d grad-input's implicit GEMM. Stride 1: M = N*H*W, K = O*KH*KW.
    Strided, one GEMM per phase, batched: the outputs of a phase (rh, rw), the rows with
    (h + PH) mod SH = rh and columns with (w + PW) mod SW = rw, read only the taps kh = rh + SH*a,
    kw = rw + SW*c, a stride-1 correlation on their sub-grid; so M = N * ceil(H/SH) * ceil(W/SW),
    K = O * ceil(KH/SH) * ceil(KW/SW), batch SH*SW (a phase's taps past KH or KW read zeros, its
    sub-grid rows past H are not stored). A 3x3 stride-2 layer's K is 4/9 of the plain view's,
    of which 2.25 taps of 4 are real on average, against 2.25 of 9."""
    sh, sw = pair(stride, "stride")
    if (sh, sw) == (1, 1):
        return N * H * W, C, O * KH * KW, 1
    return N * ceil_div(H, sh) * ceil_div(W, sw), C, O * ceil_div(KH, sh) * ceil_div(KW, sw), sh * sw


# --------------------------------------------------------------------------- GEMM planning

@dataclass(frozen=True)
class GemmPlan:
    BM: int
    BN: int
    BK: int
    TM: int
    TN: int
    splits: int
    kchunk: int
    est_us: float = 0.0  # the cost model's estimate (for ranking only: not part of a stamped plan)

    @property
    def threads(self) -> int:
        return (self.BM // self.TM) * (self.BN // self.TN)


_LAUNCH_US = 1.5           # fixed cost of one more kernel in a stream / graph (approx.)


def _pick_bk(K: int) -> int:
    if K <= 32:
        return K              # one k-tile, no tail
    return 16 if K < 4096 else 32


def _gemm_cost(M, N, K, batch, BM, BN, BK, TM, TN, splits, a_kfast, b_kfast, bf16: bool = False, x3: bool = False):
    tile = _tile_model(BM, BN, BK, TM, TN, current(), 2 if bf16 else 1, x3)
    return None if tile is None else _split_cost(M, N, K, batch, tile, splits)


@dataclass(frozen=True)
class _TileModel:
    """What the cost model knows of a block tile before the problem's sizes: `_split_cost` adds
    those (the planner evaluates every split of a tile, so this part is computed once a tile)."""
    BM: int
    BN: int
    BK: int
    TM: int
    TN: int
    occ: int         # blocks a multiprocessor
    warps: int
    per_k_tile: float  # cycles a warp needs per k-tile, if alone (before the latency factor)
    latency: float
    dev: Any


@functools.lru_cache(maxsize=4096)  # a handful of k-tile depths x the tile candidates x devices
def _tile_model(BM: int, BN: int, BK: int, TM: int, TN: int, dev: Any, k_a_word: int = 1,
                x3: bool = False) -> _TileModel | None:
    """`k_a_word`: the k values a staged register and shared-memory word holds (bfloat16: 2, a
    pair), so a slot of the next tile's registers, and 4 bytes of shared memory, serve that many.
    `x3` (3xTF32): each operand fragment twice (big and small) and a fragment's partial sums."""
    threads = (BM // TM) * (BN // TN)
    kw = BK // k_a_word
    la = ceil_div(BM * kw, threads)
    lb = ceil_div(BN * kw, threads)
    # Accumulators, operand vectors, the prefetched next tile and its hoisted gather offsets.
    regs = TM * TN + TM + TN + 3 * (la + lb) + 24 + ((TM + TN + 4) if x3 else 0)
    if regs > 200 or la + lb > 20:
        return None  # would spill (measured with ptxas -v: la + lb = 36 spills at 64 threads)
    regs = round_up(regs, 8)
    smem = 4 * kw * (BM + BN)
    # (+ 1 KiB: the shared memory the runtime reserves a block)
    occ = min(dev.max_threads_per_multiprocessor // threads, dev.registers_per_multiprocessor // (threads * regs),
              dev.shared_per_multiprocessor // (smem + 1024), dev.max_blocks_per_multiprocessor)
    if occ < 1:
        return None
    # Issue slots per warp per k: TM*TN FMAs, the shared-memory vector loads, and the
    # gather of the next tile (about 8 instructions per element: index math, bounds, load, store).
    gm, gn = TM // min(TM, 4), TN // min(TN, 4)
    per_k = TM * TN + gm + gn + 8.0 * k_a_word * (la + lb) / BK  # (a pair's two values each loaded)
    # Shared-memory wavefronts per warp per k (the SM serves one per cycle): a warp spans
    # min(32, NTX) distinct m-vectors and ceil(32 / NTX) distinct n-vectors.
    ntx = BM // TM
    dm = min(32, ntx)
    dn = min(BN // TN, max(1, 32 // ntx))
    lds_k = gm * ceil_div(dm * min(TM, 4) * 4, 128) + gn * ceil_div(dn * min(TN, 4) * 4, 128)
    lds_k += 2.0 * (la + lb) / BK  # the stores of the next tile (some bank conflicts)
    warps = threads // 32 if threads >= 32 else 1
    # SM cycles one block's warps need, if alone: 4 schedulers issue 1 warp instruction each
    # per cycle; below 2 warps per scheduler latency is exposed.
    wps = occ * warps / 4
    latency = 1.0 if wps >= 2 else (0.5 + 0.25 * wps)
    return _TileModel(BM, BN, BK, TM, TN, occ, warps, BK * max(per_k / 4, lds_k) + 20, latency, dev)


def _split_cost(M: int, N: int, K: int, batch: int, tile: _TileModel, splits: int) -> GemmPlan:
    BM, BN, BK, dev, occ = tile.BM, tile.BN, tile.BK, tile.dev, tile.occ
    kchunk = round_up(ceil_div(K, splits), BK)
    splits = ceil_div(K, kchunk)
    m_tiles, n_tiles = ceil_div(M, BM), ceil_div(N, BN)
    blocks = m_tiles * n_tiles * batch * splits
    ktiles = kchunk // BK
    block_cycles = tile.warps * ktiles * tile.per_k_tile / tile.latency + 600
    waves = ceil_div(blocks, dev.multiprocessors * occ)
    sm_cycles = waves * occ * block_cycles
    # ... and a partial last wave only costs its share once there are many waves.
    if waves > 1:
        sm_cycles *= (blocks / (dev.multiprocessors * occ)) / waves * 0.5 + 0.5
    t = sm_cycles / dev.clock_hz
    compulsory = 4 * batch * (M * K + K * N + M * N)
    t = max(t, compulsory / dev.memory_bytes_per_s)
    # Operand re-reads (through L2) grow with the number of tiles on the other side.
    reread = 4 * batch * (M * K * n_tiles + K * N * m_tiles)
    t = max(t, reread / (3 * dev.memory_bytes_per_s))
    if splits > 1:
        t += (4 * (splits + 1) * batch * M * N) / dev.memory_bytes_per_s + _LAUNCH_US * 1e-6
    return GemmPlan(BM, BN, BK, tile.TM, tile.TN, splits, kchunk, t * 1e6)


def tf32_warp_grid(BM: int, BN: int, threads: int) -> tuple[int, int] | None:
    """(warps along m, warps along n) tiling a BM x BN block tile with mma.m16n8k8 pieces, the
    squarest per-warp piece first; None when the tile cannot be split so."""
    warps = threads // 32
    if threads % 32 or BM % 16 or BN % 8:
        return None
    best = None
    for wgm in range(1, warps + 1):
        if warps % wgm:
            continue
        wgn = warps // wgm
        if BM % (16 * wgm) or BN % (8 * wgn):
            continue
        shape = abs(BM // wgm - BN // wgn)
        if best is None or shape < best[0]:
            best = (shape, wgm, wgn)
    return None if best is None else best[1:]


@functools.lru_cache(maxsize=None)
def _tile_candidates() -> tuple[tuple[int, int, int, int], ...]:
    return tuple(_tiles())


def _tiles():
    for BM in (8, 16, 32, 64, 128):
        for BN in (4, 8, 16, 32, 48, 64, 96, 128):
            for TM in (1, 2, 4, 8):
                for TN in (1, 2, 4, 8):
                    if BM % TM or BN % TN:
                        continue
                    # Group layout needs TM (TN) < 4 or a multiple of 4.
                    if (TM > 4 and TM % 4) or (TN > 4 and TN % 4):
                        continue
                    threads = (BM // TM) * (BN // TN)
                    if threads not in (64, 128, 256):
                        continue
                    if TM * TN < 4 and threads > 64:
                        continue
                    yield BM, BN, TM, TN


def mma_k(tf32: bool, bf16: bool) -> int:
    """The k of one tensor-core instruction (mma.m16n8k8 for TF32, m16n8k16 for bfloat16); 0: none."""
    return 16 if bf16 else 8 if tf32 else 0


#: plan_candidates' answers by their arguments and the device: the same product is asked for
#: several times a compile (whether Winograd serves a convolution, then its plans; a step and
#: the steps of other batch sizes), and one answer costs ~4 ms of the cost model
_CANDIDATES: dict[tuple, tuple[GemmPlan, ...]] = {}


def plan_candidates(M: int, N: int, K: int, batch: int = 1, *, a_kfast: bool, b_kfast: bool,
                    min_threads_for_rows: bool = False, allow_split: bool = True, tf32: bool = False,
                    bf16: bool = False, pair_words: bool = False, x3: bool = False) -> list[GemmPlan]:
    """Every feasible plan for C (batch, M, N) = A (M, K) @ B (K, N), best estimate first (for
    tf32 and bf16: tiles the tensor-core warp grid can split, k-tiles a multiple of the
    instruction's k; ranked by the fp32 model, which over-weights the FMAs but orders the gathers
    and waves alike). `pair_words` (bf16): registers and shared memory counted as the kernel
    stages them, a k pair a word, with k-tiles of 32 beside the usual depth: the larger tiles
    this admits are for the tuner to measure (as the cost model's pick they measured slower on
    an H200: ResNet-8 at batch 256 +9%, airbench +6%, untuned). `x3`: the
    plans on the TF32 warp tiles with the 3xTF32 kernels' registers counted (family gemm_x3)."""
    key = (M, N, K, batch, a_kfast, b_kfast, min_threads_for_rows, allow_split, tf32, bf16, pair_words, x3, current())
    if key not in _CANDIDATES:
        if len(_CANDIDATES) > 4096:
            _CANDIDATES.clear()
        _CANDIDATES[key] = tuple(_plan_candidates(M, N, K, batch, a_kfast=a_kfast, b_kfast=b_kfast,
                                                  min_threads_for_rows=min_threads_for_rows,
                                                  allow_split=allow_split, tf32=tf32, bf16=bf16,
                                                  pair_words=pair_words, x3=x3))
    return list(_CANDIDATES[key])


def _plan_candidates(M: int, N: int, K: int, batch: int = 1, *, a_kfast: bool, b_kfast: bool,
                     min_threads_for_rows: bool = False, allow_split: bool = True, tf32: bool = False,
                     bf16: bool = False, pair_words: bool = False, x3: bool = False,
                     _min_tile: tuple[int, int] = (8, 4)) -> list[GemmPlan]:
    mk = mma_k(tf32 or x3, bf16)
    BK = round_up(_pick_bk(K), mk) if mk else _pick_bk(K)
    # bfloat16 stages k in pairs, so a k-tile of 32 holds the registers and shared memory of
    # float32's 16: offered beside the usual depth wherever K spans two of them
    words = bf16 and pair_words
    depths = (BK, 32) if words and BK < 32 and K >= 64 else (BK,)
    dev = current()
    plans = {}
    for (BM, BN, TM, TN), BK in itertools.product(_tile_candidates(), depths):
        if mk and tf32_warp_grid(BM, BN, (BM // TM) * (BN // TN)) is None:
            continue
        if BM > round_up(M, 8) * 2 and BM > _min_tile[0]:
            continue  # mostly empty tiles
        if BN > round_up(N, 4) * 2 and BN > _min_tile[1]:
            continue
        threads = (BM // TM) * (BN // TN)
        if min_threads_for_rows and threads < BM:
            continue
        split_opts = {1}
        if allow_split and K >= 4 * BK:
            s = 2
            while s <= K // (2 * BK) and s <= 1024:
                split_opts.add(s)
                s *= 2
            tiles = ceil_div(M, BM) * ceil_div(N, BN) * batch
            sms = dev.multiprocessors
            for target in (sms, 2 * sms, 4 * sms, 8 * sms):  # 1-8 waves of one block a multiprocessor
                s = ceil_div(target, tiles)
                if 1 < s <= K // (2 * BK):
                    split_opts.add(s)
        tile = _tile_model(BM, BN, BK, TM, TN, dev, 2 if words else 1, x3)
        if tile is None:
            continue
        for s in sorted(split_opts):
            plan = _split_cost(M, N, K, batch, tile, s)
            key = (plan.BM, plan.BN, plan.BK, plan.TM, plan.TN, plan.splits)
            if key not in plans or plan.est_us < plans[key].est_us:
                plans[key] = plan
    out = sorted(plans.values(), key=lambda p: p.est_us)
    if not out and mk and _min_tile != (32, 32):  # a tiny GEMM: the smallest tensor-core tiles, mostly empty
        return _plan_candidates(M, N, K, batch, a_kfast=a_kfast, b_kfast=b_kfast,
                                min_threads_for_rows=min_threads_for_rows, allow_split=allow_split, tf32=tf32,
                                bf16=bf16, pair_words=pair_words, x3=x3, _min_tile=(32, 32))
    assert out
    return out


def plan_gemm(M: int, N: int, K: int, batch: int = 1, *, a_kfast: bool, b_kfast: bool,
              min_threads_for_rows: bool = False, allow_split: bool = True, tf32: bool = False,
              bf16: bool = False) -> GemmPlan:
    """The cost model's best tile sizes and split-K factor for C (batch, M, N) = A (M, K) @ B (K, N).
    Measured plans come from the tuning database (`cuda_choices`), not from here."""
    return plan_candidates(M, N, K, batch, a_kfast=a_kfast, b_kfast=b_kfast,
                           min_threads_for_rows=min_threads_for_rows, allow_split=allow_split, tf32=tf32,
                           bf16=bf16)[0]


def gemm_scratch_bytes(plan: GemmPlan, M: int, N: int, batch: int = 1, rowsum: bool = False) -> int:
    """Scratch of a GEMM-skeleton kernel with this plan: the split-K partials (and row sums)."""
    if plan.splits == 1:
        return 0
    return 4 * (round_up(plan.splits * batch * M * N, SCRATCH_ALIGN // 4) + (plan.splits * batch * M if rowsum else 0))


def _reduce_groups(splits: int) -> int:
    """Split groups per output in the reduce launch: each thread sums at most ~8 partials."""
    rg = 1
    while rg < 32 and ceil_div(splits, rg) > 8:
        rg *= 2
    return rg


def conv_roles(family: str, kind: str, *, bias: bool = False, relu: bool = False, relu_mask: bool = False
               ) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(roles, inputs, the role of the GEMM's source) of a convolution kernel of `kind` before a
    generated epilogue's: x, w, [bias], out (forward); dy, w, [mask_src], out (grad-input); x, dy,
    out (grad-weight). A template epilogue the kind does not take is a ValueError naming `family`."""
    if (bias or relu) and kind != "conv2d" or relu_mask and kind != "conv2d_grad_input":
        raise ValueError(f"the {family} {kind} kernel takes no {'relu_mask' if relu_mask else 'bias/relu'} epilogue")
    if kind == "conv2d":
        return ("x", "w") + (("bias",) if bias else ()) + ("out",), ("x", "w", "bias"), "x"
    if kind == "conv2d_grad_input":
        return ("dy", "w") + (("mask_src",) if relu_mask else ()) + ("out",), ("dy", "w", "mask_src"), "dy"
    return ("x", "dy", "out"), ("x", "dy"), "x"


def with_epilogue(roles: tuple[str, ...], inputs: tuple[str, ...], epilogue: PointwiseEpilogue | None
                  ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(roles, inputs, unrestricted) of a kernel once its generated epilogue's operands follow the
    template's roles. They and the output are not __restrict__: an in-place update reads a
    parameter through one and writes it through the other."""
    if epilogue is None:
        return tuple(roles), tuple(inputs), ()
    return (tuple(roles) + tuple(r for r in epilogue.roles if r not in roles), tuple(inputs) + epilogue.roles,
            epilogue.roles + ("out",))


def kernel_signature(roles: tuple[str, ...], inputs: tuple[str, ...], unrestricted: tuple[str, ...],
                     scratch: bool, bf16_roles: frozenset[str] = frozenset()) -> str:
    """The parameter list of a kernel: one float pointer per role (bfloat16 bits, `unsigned
    short`, for `bf16_roles`), then the scratch block."""
    sig = ", ".join(("const " if r in inputs else "") + ("unsigned short* " if r in bf16_roles else "float* ")
                    + ("" if r in unrestricted else "__restrict__ ") + r for r in roles)
    return sig + (", float* __restrict__ scratch" if scratch else "")


#: the run-time sizes of the GEMM skeleton, as Params members and by-value arguments, in argument order
_RUNTIME_SIZES = (("M", "rM"), ("K", "rK"), ("BATCH", "rB"))


def _render_gemm(template: str, name: str, *, description: str, M: int, N: int, K: int,
                 batch: int, roles: tuple[str, ...], inputs: tuple[str, ...], a_kfast: bool,
                 b_kfast: bool, rowsum: bool = False, plan: GemmPlan | None = None,
                 c_nfast: bool = False, epilogue: PointwiseEpilogue | None = None, tf32: bool = False,
                 bf16_roles: frozenset[str] = frozenset(), runtime: frozenset[str] = frozenset(),
                 pair_roles: tuple[str, str] | None = None, x3: bool = False, **ctx) -> CudaKernel:
    """`runtime`: the sizes among M, K, BATCH the code takes as by-value arguments (the ones a
    batch size changes), so one text serves every batch size; with K, the split chunk too (the
    plan's split count is kept: at a shorter K trailing splits add zeros). `description` must
    then hold none of their values. `pair_roles`: the roles of the A and B operands, for a
    template whose loaders read a bfloat16 operand's (k, k + 1) pair at once (`load_a2`,
    `load_b2`: gemm.j2), used where that role is bfloat16. `x3`: float32 operands as three TF32
    products each (3xTF32, family gemm_x3) on the TF32 path's warp tiles."""
    if x3 and (tf32 or set(inputs[:2]) & bf16_roles):
        raise ValueError("3xTF32 is for float32 operands under precision 'float32' (not with tf32 or bfloat16)")
    tf32 = tf32 or x3
    # bfloat16 operands (their roles in `bf16_roles`, as any other bfloat16 buffer's): read as
    # floats, multiplied on the bfloat16 tensor cores (mma.m16n8k16), accumulated in fp32,
    # rounded before the epilogue
    bf16 = bool(set(inputs[:2]) & bf16_roles)
    if plan is None:
        plan = plan_candidates(M, N, K, batch, a_kfast=a_kfast, b_kfast=b_kfast,
                               min_threads_for_rows=rowsum, tf32=tf32, bf16=bf16, x3=x3)[0]
    mk = mma_k(tf32, bf16)
    warp_grid = tf32_warp_grid(plan.BM, plan.BN, plan.threads) if mk else None
    if mk and (warp_grid is None or plan.BK % mk):
        raise ValueError(f"plan {plan} cannot run on {'bfloat16' if bf16 else 'TF32'} tensor cores (tiles of 16 x 8 "
                         f"per warp, k-tiles of {mk})")
    # Shared-memory row padding (words): for the FMA path, 4 on a k-fast operand (stored
    # transposed: turns 32-way bank conflicts on the stores into 4-way, keeps 16-byte rows for
    # the vector reads); for the tensor-core paths, rows of 8 mod 32 words (TF32's floats, or
    # bfloat16 pairs: fragments read rows t apart): conflict-free fragment reads.
    a_pad = (8 - plan.BM % 32) % 32 if mk else (4 if a_kfast else 0)
    b_pad = (8 - plan.BN % 32) % 32 if mk else (4 if b_kfast else 0)
    if rowsum and plan.threads < plan.BM:
        raise ValueError("rowsum needs at least BM threads per block")
    roles, inputs, unrestricted = with_epilogue(roles, inputs, epilogue)
    splits = plan.splits
    kchunk = round_up(ceil_div(K, splits), plan.BK) if "K" in runtime else plan.kchunk
    values = {"M": M, "K": K, "BATCH": batch}
    members = [(size, member) for size, member in _RUNTIME_SIZES if size in runtime]
    if "K" in runtime:
        members.append(("KCHUNK", "rKC"))
        values["KCHUNK"] = kchunk
    spelled = {size: size for size in ("M", "K", "BATCH", "KCHUNK")} | {size: f"p.{m}" for size, m in members}
    scalars = tuple(("int", values[size]) for size, _ in members)
    part_off = 0
    part_floats = splits * batch * M * N if splits > 1 else 0
    rsum_off = round_up(part_floats, SCRATCH_ALIGN // 4)
    grid = (ceil_div(M, plan.BM), ceil_div(N, plan.BN), batch * splits)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"grid {grid} too large")
    outs = batch * M * N + (batch * M if rowsum else 0)
    rg = _reduce_groups(splits)
    rgrid = ceil_div(outs, 32)
    args = tuple(roles) + (("scratch",) if splits > 1 else ())
    sig = kernel_signature(roles, inputs, unrestricted, splits > 1, bf16_roles)
    code = _render(template, name=name, description=description, M=M, N=N, K=K, batch=batch,
                   BM=plan.BM, BN=plan.BN, BK=plan.BK, TM=plan.TM, TN=plan.TN,
                   threads=plan.threads, splits=splits, kchunk=kchunk,
                   rt=frozenset(runtime), sz=spelled, rt_members=[m for _, m in members],
                   rt_params="".join(f", const int {m}" for _, m in members),
                   rt_init="".join(f", {m}" for _, m in members), align=SCRATCH_ALIGN // 4,
                   part_off=part_off, rsum_off=rsum_off, roles=roles, inputs=inputs,
                   a_kfast=a_kfast, b_kfast=b_kfast, rowsum=rowsum, c_nfast=c_nfast, grid=grid, rgrid=rgrid,
                   signature=sig, rg=rg, pw=epilogue, unrestricted=unrestricted, tf32=tf32, bf16=bf16, x3=x3,
                   bf16_roles=bf16_roles,
                   wgm=warp_grid[0] if warp_grid else 0, wgn=warp_grid[1] if warp_grid else 0,
                   a_pad=a_pad, b_pad=b_pad,
                   pair_a=bf16 and pair_roles is not None and pair_roles[0] in bf16_roles,
                   pair_b=bf16 and pair_roles is not None and pair_roles[1] in bf16_roles, **ctx)
    launches = [Launch(f"{name}_gemm", grid, (plan.threads, 1, 1), 0, args, scalars)]
    if splits > 1:
        launches.append(Launch(f"{name}_reduce", (rgrid, 1, 1), (32 * rg, 1, 1), 0, args, scalars))
    return CudaKernel(name, code, tuple(launches), gemm_scratch_bytes(plan, M, N, batch, rowsum))


# --------------------------------------------------------------------------- convolution

def render_conv2d_forward(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int, KW: int,
                          stride=(1, 1), padding=(0, 0), bias: bool, relu: bool, plan: GemmPlan | None = None,
                          epilogue: PointwiseEpilogue | None = None, tf32: bool = False,
                          bf16_roles: frozenset[str] = frozenset(), runtime_batch: bool = False, x3: bool = False) -> CudaKernel:
    """out = relu?(conv2d(x, w) + bias?): roles x (N,C,H,W), w (O,C,KH,KW), [bias (O,)],
    out (N,O,HO,WO). Implicit GEMM with M = N*HO*WO, N = O, K = C*KH*KW. `runtime_batch`: the
    images N (so M) are a by-value argument, the code the same for every batch size."""
    sh, sw, ph, pw, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    roles = ("x", "w") + (("bias",) if bias else ()) + ("out",)
    return _render_gemm(
        "conv2d_forward.j2", name, runtime=frozenset({"M"} if runtime_batch else ()),
        description=f"conv2d forward x({'N' if runtime_batch else N},{C},{H},{W}) w({O},{C},{KH},{KW}) stride ({sh},{sw}) "
                    f"padding ({ph},{pw}){' +bias' if bias else ''}{' +relu' if relu else ''}",
        M=N * HO * WO, N=O, K=C * KH * KW, batch=1, roles=roles, inputs=("x", "w", "bias"),
        a_kfast=False, b_kfast=True, plan=plan,
        C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw, HO=HO, WO=WO,
        bias=bias, relu=relu, epilogue=epilogue, tf32=tf32, x3=x3, bf16_roles=bf16_roles)


def render_conv2d_grad_input(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int,
                             KW: int, stride=(1, 1), padding=(0, 0),
                             relu_mask: bool = False, plan: GemmPlan | None = None,
                             epilogue: PointwiseEpilogue | None = None, tf32: bool = False,
                             bf16_roles: frozenset[str] = frozenset(), runtime_batch: bool = False, x3: bool = False) -> CudaKernel:
    """dx = conv2d_grad_input(dy, w) [* (mask_src > 0)]: roles dy (N,O,HO,WO), w (O,C,KH,KW),
    [mask_src (N,C,H,W)], out (N,C,H,W). Implicit GEMM with M = N*H*W, N = C, K = O*KH*KW; strided,
    one such GEMM per phase (`grad_input_gemm`); `runtime_batch` as `render_conv2d_forward`'s."""
    sh, sw, ph, pw, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    roles = ("dy", "w") + (("mask_src",) if relu_mask else ()) + ("out",)
    M, n_, K, batch = grad_input_gemm(N, C, H, W, O, KH, KW, (sh, sw), (ph, pw))
    return _render_gemm(
        "conv2d_grad_input.j2", name, runtime=frozenset({"M"} if runtime_batch else ()),
        description=f"conv2d grad-input dy({'N' if runtime_batch else N},{O},{HO},{WO}) w({O},{C},{KH},{KW}) stride ({sh},{sw}) "
                    f"padding ({ph},{pw}){' *relu-mask' if relu_mask else ''}{', by phase' if batch > 1 else ''}",
        M=M, N=n_, K=K, batch=batch, roles=roles, inputs=("dy", "w", "mask_src"),
        a_kfast=False, b_kfast=True, plan=plan,
        C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw, HO=HO, WO=WO,
        HQ=ceil_div(H, sh), WQ=ceil_div(W, sw), TH=ceil_div(KH, sh), TW=ceil_div(KW, sw),
        relu_mask=relu_mask, epilogue=epilogue, tf32=tf32, x3=x3, bf16_roles=bf16_roles)


def render_conv2d_grad_weight(name: str, *, N: int, C: int, H: int, W: int, O: int, KH: int,
                              KW: int, stride=(1, 1), padding=(0, 0), bias: bool, plan: GemmPlan | None = None,
                              epilogue: PointwiseEpilogue | None = None, tf32: bool = False,
                              bf16_roles: frozenset[str] = frozenset(), runtime_batch: bool = False, x3: bool = False) -> CudaKernel:
    """dw = conv2d_grad_weight(x, dy) [, db = sum of dy over N, HO, WO]: roles x (N,C,H,W),
    dy (N,O,HO,WO), out (O,C,KH,KW), [db (O,)]. Implicit GEMM with M = O, N = C*KH*KW,
    K = N*HO*WO, deterministic split-K; db is the row sum of the A operand, fused.
    `runtime_batch`: K (and the split chunk) a by-value argument, one text for every batch size."""
    sh, sw, ph, pw, HO, WO = _conv_geometry(name, N, C, H, W, O, KH, KW, stride, padding)
    roles = ("x", "dy", "out") + (("db",) if bias else ())
    n = "N" if runtime_batch else N
    return _render_gemm(
        "conv2d_grad_weight.j2", name, runtime=frozenset({"K"} if runtime_batch else ()),
        description=f"conv2d grad-weight x({n},{C},{H},{W}) dy({n},{O},{HO},{WO}) stride ({sh},{sw}) "
                    f"padding ({ph},{pw}){' +db' if bias else ''}",
        M=O, N=C * KH * KW, K=N * HO * WO, batch=1, roles=roles, inputs=("x", "dy"),
        a_kfast=True, b_kfast=True, rowsum=bias, plan=plan, c_nfast=True, epilogue=epilogue, tf32=tf32, x3=x3,
        bf16_roles=bf16_roles, pair_roles=("dy", "x"),
        C=C, H=H, W=W, O=O, KH=KH, KW=KW, SH=sh, SW=sw, PH=ph, PW=pw, HO=HO, WO=WO)


# --------------------------------------------------------------------------- matmul

def render_matmul(name: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool,
                  batch: int = 1, bias: bool = False, relu: bool = False, plan: GemmPlan | None = None,
                  epilogue: PointwiseEpilogue | None = None, tf32: bool = False,
                  bf16_roles: frozenset[str] = frozenset(), runtime_batch: bool = False, x3: bool = False) -> CudaKernel:
    """out[b] = relu?(op(a[b]) @ op(b[b]) + bias?): roles a, b, [bias (N,)], out (batch,M,N).
    a is stored (batch,M,K), or (batch,K,M) with trans_a; b (batch,K,N), or (batch,N,K) with
    trans_b; all row-major contiguous. `runtime_batch`: batch, M and K (any of which a batch
    size may set: the rows of a layer's input, the reduced length of its weight gradient, the
    heads of an attention) are by-value arguments; the code holds N alone."""
    _check_name(name)
    check_positive(M=M, N=N, K=K, batch=batch)
    if max(batch * M * K, batch * K * N, batch * M * N) >= 2**40:
        raise ValueError("matmul too large")
    roles = ("a", "b") + (("bias",) if bias else ()) + ("out",)
    b_, m_, k_ = ("batch", "M", "K") if runtime_batch else (batch, M, K)
    return _render_gemm(
        "matmul.j2", name, runtime=frozenset({"M", "K", "BATCH"} if runtime_batch else ()),
        description=f"matmul batch {b_} ({m_}x{k_}{'^T' if trans_a else ''}) @ "
                    f"({k_}x{N}{'^T' if trans_b else ''}){' +bias' if bias else ''}{' +relu' if relu else ''}",
        M=M, N=N, K=K, batch=batch, roles=roles, inputs=("a", "b", "bias"),
        a_kfast=not trans_a, b_kfast=trans_b, plan=plan, c_nfast=True, trans_a=trans_a, trans_b=trans_b,
        bias=bias, relu=relu, epilogue=epilogue, tf32=tf32, x3=x3, bf16_roles=bf16_roles)


# --------------------------------------------------------------------------- loss, update

def _float_literal(v: float) -> str:
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"non-finite constant {v}")
    return repr(v) + "f" if ("." in repr(v) or "e" in repr(v)) else repr(v) + ".0f"


#: a loss kernel's 1/N on run-time rows, as the specialised kernels' literal is (rounded from
#: double to float)
_INV_ROWS = "(float)(1.0 / (double)n)"


def render_softmax_cross_entropy(name: str, *, N: int, C: int, runtime_rows: bool = False) -> CudaKernel:
    """loss = mean_i (logsumexp(z_i) - z_i[label_i]): roles logits (N,C) fp32, labels (N,) int64,
    loss (scalar). One block (up to 1024 threads, one row per thread per pass) so the mean has a
    fixed summation tree; an out-of-range label contributes a zero one-hot row (as ``one_hot``
    does). The gradient is `render_softmax_cross_entropy_grad`. `runtime_rows`: N a by-value
    argument (256 threads whatever it is), one text for every batch size."""
    _check_name(name)
    check_positive(N=N, C=C)
    threads = 32
    while threads < N and threads < 1024:
        threads *= 2
    if runtime_rows:
        threads = 256
    code = _render("softmax_cross_entropy.j2", name=name, N="n" if runtime_rows else N, C=C, threads=threads,
                   inv_n=_INV_ROWS if runtime_rows else _float_literal(1.0 / N), runtime_rows=runtime_rows)
    scalars = (("int", N),) if runtime_rows else ()
    return CudaKernel(name, code, (Launch(f"{name}_loss", (1, 1, 1), (threads, 1, 1), 0, ("logits", "labels", "loss"),
                                          scalars),), 0)


def render_softmax_cross_entropy_grad(name: str, *, N: int, C: int, grad_scale: float | None = None,
                                      runtime_rows: bool = False) -> CudaKernel:
    """dlogits = (softmax(z) - onehot) * grad_scale (default 1/N, the gradient of the mean): roles
    logits (N,C), labels (N,) int64, dlogits (N,C); one thread a row over as many blocks as the
    rows need (the rows are independent, unlike the loss's mean). `runtime_rows`: N a by-value
    argument (128 threads a block), one text for every batch size (the default scale only)."""
    _check_name(name)
    check_positive(N=N, C=C)
    if runtime_rows and grad_scale is not None:
        raise ValueError("a loss gradient on run-time rows scales by 1/N alone")
    if grad_scale is None:
        grad_scale = 1.0 / N
    threads = 128 if N >= 128 or runtime_rows else 32 * ceil_div(N, 32)
    blocks = ceil_div(N, threads)
    code = _render("softmax_cross_entropy_grad.j2", name=name, N="n" if runtime_rows else N, C=C, threads=threads,
                   blocks="(n + 127) / 128" if runtime_rows else blocks, runtime_rows=runtime_rows,
                   grad_scale=_INV_ROWS if runtime_rows else _float_literal(grad_scale))
    scalars = (("int", N),) if runtime_rows else ()
    return CudaKernel(name, code, (Launch(f"{name}_grad", (blocks, 1, 1), (threads, 1, 1), 0,
                                          ("logits", "labels", "dlogits"), scalars),), 0)


def render_sgd_update(name: str, *, numel: int, lr: float, momentum: float = 0.0,
                      weight_decay: float = 0.0) -> CudaKernel:
    """p -= lr * (g + weight_decay * p) (with momentum: v = momentum * v + g'; p -= lr * v), in
    place. Roles p, g[, v]; pointers must be 16-byte aligned (float4 body, scalar tail)."""
    _check_name(name)
    check_positive(numel=numel)
    numel4 = numel // 4 * 4
    items = numel4 // 4 + (numel - numel4)
    code = _render("sgd_update.j2", name=name, numel=numel, numel4=numel4, lr=lr,
                   momentum=momentum, weight_decay=weight_decay, lr_lit=_float_literal(lr),
                   mom_lit=_float_literal(momentum), wd_lit=_float_literal(weight_decay))
    roles = ("p", "g") + (("v",) if momentum else ())
    return CudaKernel(name, code, (Launch(f"{name}_sgd", (ceil_div(items, 256), 1, 1), (256, 1, 1), 0, roles),), 0)
