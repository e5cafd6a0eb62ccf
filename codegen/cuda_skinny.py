"""Memory-bound "skinny" matmuls: few output columns with a long contraction (`render_matmul_narrow`)
and few output rows with many columns (`render_matmul_short_m`).

The MNIST CNN's linear layer at batch 1024 has two such products: the forward, 1024 x 10 from
K = 18432, reads a 75 MB activation once; the weight gradient, 10 x 18432 from K = 1024, reads a
75 MB activation once. Both are passes over memory (a few FMAs a byte), but the implicit-GEMM
skeleton (`gemm.j2`) tiles them as if they were compute-bound: 10 columns fill a fraction of its
smallest tile, its k-tiles stage both operands through shared memory, and the split-K partials
of the long contraction cost a second pass; it reached ~30 % of the HBM bandwidth of an H200
(52 and 56 us against ~22 us for one read of the 75 MB). These kernels are built around the
one large operand instead: every thread streams it with 16-byte loads, several in flight, reads
each element exactly once, and keeps the whole small side of the product in registers.

Same contract as the GEMM kernels (`cuda_kernels`): outputs fully overwritten, plain fp32
`fmaf`, no float atomics, a fixed summation order (split partials in scratch, summed in split
order by a second launch that also applies bias, ReLU and the generated epilogue). The order
differs from the GEMM's, so results differ from it in the last bits, within the same tolerances.
Each renderer returns None where a shape does not suit (codegen then uses the GEMM).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .cuda_kernels import (SCRATCH_ALIGN, CudaKernel, Launch, PointwiseEpilogue, _check_name, _reduce_groups,
                           kernel_signature, with_epilogue)
from .device import Device, current, static_shared_budget
from .shapes import ceil_div, round_up
from .templates_env import environment

NARROW_MAX_N = 16
SHORT_MAX_M = 16
# Blocks a launch aims for a multiprocessor, measured on an H200 (tools/cuda_sweep.py skinny,
# the MNIST linear layer; docs/benchmarks.md, "History"): the narrow kernel (2 blocks of 256
# threads resident a multiprocessor) ran best at about one wave (1024 x 18432 x 10: 256 blocks
# 25.0 us, 480 28.6, 1152 35.1), the short-M kernel at about 4 blocks a multiprocessor (10 x 18432
# x 1024: 576 blocks 24.1 us, 1152 24.9, 2304 28.0); more blocks only add partials to sum.
NARROW_BLOCKS_PER_SM = 2
SHORT_BLOCKS_PER_SM = 4
SMEM_A_BYTES = 16 * 1024  # short-M: a's staged k chunk, at most (the group sums take the rest)

_env = environment("cuda")


def narrow_target_blocks(device: Device) -> int:
    return NARROW_BLOCKS_PER_SM * device.multiprocessors


def short_target_blocks(device: Device) -> int:
    return SHORT_BLOCKS_PER_SM * device.multiprocessors


@dataclass(frozen=True)
class NarrowPlan:
    RT: int  # rows a lane
    RG: int  # warps a block (row groups)
    V: int   # floats a k vector (4: float4 loads; K % V == 0)
    U: int   # k steps a lane has in flight
    S: int   # k splits (blocks along k)
    KC: int  # k chunk of a split

    @property
    def rows(self) -> int:
        return self.RT * self.RG


def narrow_plan(M: int, N: int, K: int, *, rows_per_lane: int | None = None, warps: int | None = None,
                splits: int | None = None, unroll: int = 2) -> NarrowPlan:
    """Tiling of out (M, N) = a (M, K) @ b (N, K)^T for N <= 16: RT x N sums and U x RT vectors
    of a a lane (~100 registers at N = 10), enough blocks to fill the GPU a few times, and at
    least two rounds of U steps a lane so the loads of a round overlap the FMAs of the last."""
    V = 4 if K % 4 == 0 else 2 if K % 2 == 0 else 1
    U = unroll
    RT = rows_per_lane or max(1, min(M, 48 // N, 8, 32 // (V * U)))
    RG = warps or max(1, min(8, ceil_div(M, RT)))
    row_blocks = ceil_div(M, RT * RG)
    step = 32 * V * U
    if splits is None:
        # at most one wave: 9 splits x 32 row blocks = 288 blocks for 264 slots ran as two rounds
        # (43 us in the step against 25 us for 256 blocks)
        splits = max(1, min(narrow_target_blocks(current()) // row_blocks, K // (2 * step)))
    KC = round_up(ceil_div(K, splits), step)
    return NarrowPlan(RT, RG, V, U, ceil_div(K, KC), KC)


def _reduce_launch(name: str, S: int, outs: int, args: tuple[str, ...]) -> tuple[Launch, dict]:
    """The split-sum launch (skinny_reduce.j2) and its template variables."""
    rg = _reduce_groups(S)
    lanes = max(1, 8 // rg)  # 256 threads a block, or 32 a group past 8 groups
    rgrid = ceil_div(outs, 32 * lanes)
    return Launch(f"{name}_reduce", (rgrid, 1, 1), (32 * lanes * rg, 1, 1), 0, args), dict(rg=rg, rg_lanes=lanes,
                                                                                             rgrid=rgrid)


def _split_kernel(name: str, kind: str, grid: tuple[int, int, int], threads: int, S: int, roles: tuple[str, ...],
                  inputs: tuple[str, ...], unrestricted: tuple[str, ...], bf16_roles: frozenset[str] = frozenset(),
                  runtime_rows: int | None = None, **template: object) -> CudaKernel:
    """A skinny kernel from template matmul_<kind>: its main launch NAME_<kind> and, with S > 1 k
    splits, the split-sum launch reading the S partials of each output from scratch. `bf16_roles`:
    the roles holding bfloat16 (with a or b among them the value is rounded to bfloat16 before the
    epilogue, as the interpreter computes it). `runtime_rows`: this step's M, which the kernels
    take as a by-value argument (the template's M is then its name)."""
    M, N = runtime_rows or template["M"], template["N"]
    split = S > 1
    args = roles + (("scratch",) if split else ())
    scalars = (("int", M),) if runtime_rows else ()
    launches = [Launch(f"{name}_{kind}", grid, (threads, 1, 1), 0, args, scalars)]
    ctx = dict(rg=1, rg_lanes=1, rgrid=1)
    if split:
        reduce, ctx = _reduce_launch(name, S, M * N, args)
        launches.append(dataclasses.replace(reduce, scalars=scalars))
    template_name = {"narrow": "matmul_narrow.j2", "shortm": "matmul_short_m.j2"}[kind]
    code = _env.get_template(template_name).render(
        name=name, S=S, grid=grid, roles=roles, inputs=inputs, unrestricted=unrestricted, bf16_roles=bf16_roles,
        runtime=runtime_rows is not None,
        bf16=bool({"a", "b"} & bf16_roles), signature=kernel_signature(roles, inputs, unrestricted, split, bf16_roles),
        **template, **ctx)
    scratch = round_up(4 * S * M * N, SCRATCH_ALIGN) if split else 0
    return CudaKernel(name, code, tuple(launches), scratch)


def _description(M: int | str, N: int, K: int, trans_a: bool, trans_b: bool, bias: bool, relu: bool) -> str:
    return (f"matmul ({M}x{K}{'^T' if trans_a else ''}) @ ({K}x{N}{'^T' if trans_b else ''})"
            f"{' +bias' if bias else ''}{' +relu' if relu else ''}")


def render_matmul_narrow(name: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool, batch: int = 1,
                         bias: bool = False, relu: bool = False, epilogue: PointwiseEpilogue | None = None,
                         plan: NarrowPlan | None = None, bf16_roles: frozenset[str] = frozenset(),
                         runtime_rows: bool = False) -> CudaKernel | None:
    """out = a @ b^T [+ bias][relu][epilogue] for N <= 16, a stored (M, K) and b (N, K), one batch:
    roles a, b, [bias], out; None where the shape does not suit (trans_a, b stored (K, N), a
    batch, more columns). `runtime_rows`: M a by-value argument of both launches, one text for
    every batch size (the plan's tiling and k splits whatever M is)."""
    _check_name(name)
    if trans_a or not trans_b or batch != 1 or N > NARROW_MAX_N or min(M, N, K) < 1 or M * max(N, K) >= 2**40:
        return None
    plan = plan or narrow_plan(M, N, K)
    row_blocks = ceil_div(M, plan.rows)
    if row_blocks > 65535 or plan.S >= 2**31 or K % plan.V:
        return None
    roles = ("a", "b") + (("bias",) if bias else ()) + ("out",)
    roles, inputs, unrestricted = with_epilogue(roles, ("a", "b", "bias"), epilogue)
    return _split_kernel(name, "narrow", (plan.S, row_blocks, 1), 32 * plan.RG, plan.S, roles, inputs, unrestricted,
                         bf16_roles, runtime_rows=M if runtime_rows else None,
                         M="M" if runtime_rows else M, N=N, K=K, RT=plan.RT, RG=plan.RG, V=plan.V, U=plan.U, KC=plan.KC,
                         bias=bias, relu=relu, pw=epilogue,
                         description=_description("M" if runtime_rows else M, N, K, trans_a, trans_b, bias, relu))


@dataclass(frozen=True)
class ShortMPlan:
    CT: int  # threads a k group (4 columns each)
    KG: int  # k groups a block
    U: int   # rows of b a thread has in flight
    S: int   # k splits (blocks along k)
    KC: int  # k chunk of a split


def short_m_plan(M: int, N: int, K: int, *, groups: int | None = None, splits: int | None = None,
                 unroll: int | None = None, col_threads: int = 32) -> ShortMPlan | None:
    """Tiling of out (M, N) = op(a) @ b (K, N) for M <= 16, N % 4 == 0: warps of 4-column
    threads, KG of them a block on one k chunk; splits over blocks until there are enough blocks
    to fill the GPU a few times, keeping at least 8 rows of b a thread (so U = 8 loads fly
    together) and a's staged chunk within SMEM_A_BYTES (and, with the group sums, the static
    shared memory of a block); None where the shared memory cannot fit."""
    MP = round_up(M, 4)
    KG = groups or 4
    col_blocks = ceil_div(N // 4, col_threads)
    dev = current()
    max_kc = min(SMEM_A_BYTES, static_shared_budget(dev) - 16 * (KG - 1) * M * col_threads) // (4 * MP)
    if max_kc < 1:
        return None
    if splits is None:
        # at least 16 rows of b a thread a split: at K = 64 one split (4.0 us) beat two (5.5 us)
        splits = max(1, min(ceil_div(short_target_blocks(dev), col_blocks), K // (16 * KG)))
    KC = min(ceil_div(K, max(1, splits)), max_kc)
    S = ceil_div(K, KC)
    U = unroll or next(u for u in (8, 4, 2, 1) if u <= max(1, ceil_div(KC, KG)))
    if S > 65535:
        return None
    return ShortMPlan(col_threads, KG, U, S, KC)


def render_matmul_short_m(name: str, *, M: int, N: int, K: int, trans_a: bool, trans_b: bool, batch: int = 1,
                          bias: bool = False, relu: bool = False, epilogue: PointwiseEpilogue | None = None,
                          plan: ShortMPlan | None = None, bf16_roles: frozenset[str] = frozenset()) -> CudaKernel | None:
    """out = op(a) @ b [+ bias][relu][epilogue] for M <= 16, b stored (K, N) with N % 4 == 0, one
    batch (a stored (M, K), or (K, M) with trans_a): roles a, b, [bias], out; None where the
    shape does not suit."""
    _check_name(name)
    if trans_b or batch != 1 or M > SHORT_MAX_M or N % 4 or min(M, N, K) < 1 or max(M, N) * K >= 2**40:
        return None
    plan = plan or short_m_plan(M, N, K)
    if plan is None:
        return None
    col_blocks = ceil_div(N // 4, plan.CT)
    if col_blocks >= 2**31 or plan.S > 65535:
        return None
    roles = ("a", "b") + (("bias",) if bias else ()) + ("out",)
    roles, inputs, unrestricted = with_epilogue(roles, ("a", "b", "bias"), epilogue)
    return _split_kernel(name, "shortm", (col_blocks, plan.S, 1), plan.CT * plan.KG, plan.S, roles, inputs, unrestricted,
                         bf16_roles,
                         M=M, N=N, K=K, CT=plan.CT, KG=plan.KG, U=plan.U, KC=plan.KC, trans_a=trans_a, bias=bias,
                         relu=relu, pw=epilogue, description=_description(M, N, K, trans_a, trans_b, bias, relu))


__all__ = ["NarrowPlan", "ShortMPlan", "narrow_plan", "short_m_plan", "render_matmul_narrow", "render_matmul_short_m",
           "NARROW_MAX_N", "SHORT_MAX_M", "narrow_target_blocks", "short_target_blocks"]
