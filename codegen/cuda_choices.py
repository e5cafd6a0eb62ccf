"""The CUDA choice table: which kernel family, with which plan, serves each kernel, as data.

A family is a set of kernel templates with one tiling scheme: the implicit GEMM (`cuda_kernels`),
the direct stride-1 convolutions and the short-contraction matmul (`cuda_direct`), the same
direct convolutions on TF32 tensor cores (`cuda_direct_tc`), the small-window convolutions
(`cuda_small_conv`), the skinny matmuls (`cuda_skinny`), 3x3 convolutions by Winograd's minimal
filtering around batched GEMMs (`cuda_winograd`), the grouped convolutions (`grouped_conv`: the
only family serving groups > 1), pooling and the generated kinds. Each entry
(a `choices.Family`) says which kernel kinds it serves, when it applies to a kernel's geometry (a
reason when it does not: precision included, so a family with a tensor-core path says so), when
the cost model prefers it, its plans (the cost model's best first; the tuner list of the GEMM
and of direct_tc is a wider spread of their planners' plans), its scratch from a plan, its
renderer and its version.

`TABLE` (a `choices.ChoiceTable`) answers for a kernel: its candidates, the decision (forced, else
the tuning database's measurement for this GPU model, else the cost model) and its stamp; the
module-level functions are its methods. Which family the cost model picks for a kernel nobody
tuned is learned from the tuning records of similar kernels (`family_prior`, placed by
`features`); the `preferred` rules are only the structural order where no record compares them.
Plans are made for the active device descriptor (`device.current()`; `with device.using(...)`
chooses another); the database is keyed by its name.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from ember.ir import Graph, KernelSpec

from . import cuda_direct, cuda_direct_tc, cuda_kernels, cuda_skinny, cuda_small_conv, cuda_winograd, family_prior
from . import cuda_conv_nhwc as conv_nhwc
from . import cuda_winograd_fused as winograd_fused
from . import grouped_conv
from . import pool_kernels
from .choices import Choice, ChoiceTable, Family, Plan
from .choices import runtime as without_sizes
from .device import current
from .cuda_kernels import CudaKernel, GemmPlan, Launch
from .shapes import pair, round_up

#: epilogues each contraction kind's templates take, in every family that serves the kind
EPILOGUES: dict[str, frozenset[str]] = {
    "conv2d": frozenset({"bias", "relu", "pointwise"}), "matmul": frozenset({"bias", "relu", "pointwise"}),
    "conv2d_grad_input": frozenset({"relu_mask", "pointwise"}), "conv2d_grad_weight": frozenset({"pointwise"})}
CONVS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")

# --------------------------------------------------------------------------- geometry

def geometry(sub: Graph, spec: KernelSpec) -> dict[str, Any]:
    """What the families decide on: the kind, epilogues, precision and the contraction's sizes
    (convolutions: N C H W O KH KW stride padding HO WO; matmuls: M N K batch trans_a trans_b rank2)."""
    g: dict[str, Any] = dict(kind=spec.kind, epilogues=spec.epilogues, tf32=bool(spec.param("tf32")))
    if spec.core is not None and spec.kind in CONVS + ("matmul",) + tuple(pool_kernels.POOL_KINDS):
        dtypes = {sub.type(n).dtype.name for n in [spec.core, *sub.operands(spec.core)]}
        if dtypes == {"bfloat16"}:  # only then: float32 kernels keep their tuning database keys
            g["dtype"] = "bfloat16"
        elif dtypes != {"float32"}:
            raise NotImplementedError(f"device='cuda' compiles {spec.kind} for float32 and bfloat16 only, got "
                                      f"{', '.join(sorted(dtypes))} (at {sub.loc(spec.core) or sub.name}); use float32 "
                                      f"or device='reference'")
    if spec.kind in CONVS:
        core = sub.attrs(spec.core)
        a_t, b_t = (sub.type(o) for o in sub.operands(spec.core))
        if spec.kind == "conv2d":
            (n, c, h, w), (o, _, kh, kw) = a_t.shape, b_t.shape
        elif spec.kind == "conv2d_grad_input":
            (n, c, h, w), (o, _, kh, kw) = core["input_shape"], b_t.shape
        else:
            (n, c, h, w), (o, _, kh, kw) = a_t.shape, core["weight_shape"]
        g.update(N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw, stride=core["stride"], padding=core["padding"])
        if core["groups"] != 1:  # only then: the tuning database's keys of ungrouped kernels stay as they were
            g["groups"] = core["groups"]
        *_, g["HO"], g["WO"] = cuda_kernels._conv_geometry("k", **_conv_args(g))
    elif spec.kind in pool_kernels.POOL_KINDS:  # its gradient has two modes to choose from: the sizes key them
        pg = pool_kernels.geometry(sub.type(sub.operands(spec.core)[0]).shape, sub.attrs(spec.core))
        g.update(pg.context())
    elif spec.kind == "matmul":
        a_t, b_t = (sub.type(o) for o in sub.operands(spec.core))
        *batch, m, kk = a_t.shape  # the core's operands are the logical (transposed) views
        g.update(M=m, N=sub.type(spec.core).shape[-1], K=kk, batch=math.prod(batch), trans_a=spec.param("trans_a"),
                 trans_b=spec.param("trans_b"), rank2=a_t.rank == 2 and b_t.rank == 2,
                 broadcast=a_t.shape[:-2] != b_t.shape[:-2], operands=f"{a_t} and {b_t}")
    return g


def _conv_args(g: dict[str, Any]) -> dict[str, Any]:
    return {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}


def _pairs(plan: Any) -> Plan:
    """A plan dataclass as stamped pairs (its ranking score left out)."""
    return tuple((f.name, getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name not in ("est_us", "score"))


# --------------------------------------------------------------------------- families

def _always(g: dict[str, Any]) -> str | None:
    return None


def _no_scratch(g: dict[str, Any], plan: Plan) -> int:
    return 0


# -- gemm: the implicit-GEMM skeleton (every contraction)

def _gemm_problem(g: dict[str, Any]) -> dict[str, Any]:
    """(M, N, K, batch, a_kfast, b_kfast) of the GEMM view of a contraction."""
    if g["kind"] == "matmul":
        return dict(M=g["M"], N=g["N"], K=g["K"], batch=g["batch"], a_kfast=not g["trans_a"], b_kfast=g["trans_b"])
    n, c, o, kh, kw, ho, wo = (g[k] for k in ("N", "C", "O", "KH", "KW", "HO", "WO"))
    if g["kind"] == "conv2d":
        return dict(M=n * ho * wo, N=o, K=c * kh * kw, batch=1, a_kfast=False, b_kfast=True)
    if g["kind"] == "conv2d_grad_input":
        m, n_, k, batch = cuda_kernels.grad_input_gemm(n, c, g["H"], g["W"], o, kh, kw, g["stride"], g["padding"])
        return dict(M=m, N=n_, K=k, batch=batch, a_kfast=False, b_kfast=True)
    return dict(M=o, N=c * kh * kw, K=n * ho * wo, batch=1, a_kfast=True, b_kfast=True)


def _gemm_rejects(g: dict[str, Any]) -> str | None:
    if g["kind"] == "matmul" and g["broadcast"]:
        raise NotImplementedError(f"matmul of {g['operands']} broadcasts batch dimensions, which the CUDA "
                                  f"templates do not support yet; broadcast_to the operands first")
    return None


def _gemm_plans(g: dict[str, Any], x3: bool = False) -> list[Plan]:
    p = _gemm_problem(g)
    best = cuda_kernels.plan_candidates(p["M"], p["N"], p["K"], p["batch"], a_kfast=p["a_kfast"], b_kfast=p["b_kfast"],
                                        tf32=g["tf32"], bf16="dtype" in g, x3=x3)[0]
    return [_pairs(best)]


#: the GEMM plans the tuner measures: the cost model's best TUNE_TOP, then the best of each split
#: count and of each block tile among its first TUNE_SPREAD (the cost model orders tiles well but
#: misjudges splits and gathers by up to 2x, so the spread covers what it ranks low)
TUNE_TOP, TUNE_SPREAD = 8, 300


def gemm_candidates(g: dict[str, Any], x3: bool = False) -> list[Plan]:
    """The GEMM plans worth measuring for this kernel, the cost model's pick first (`x3`: those
    of the 3xTF32 path, family gemm_x3)."""
    p = _gemm_problem(g)
    ranked = cuda_kernels.plan_candidates(p["M"], p["N"], p["K"], p["batch"], a_kfast=p["a_kfast"],
                                          b_kfast=p["b_kfast"], tf32=g["tf32"], bf16="dtype" in g, x3=x3)
    chosen = list(map(_pairs, ranked[:TUNE_TOP]))  # the first is `_gemm_plans`' pick: the same ranking
    if "dtype" in g:  # bfloat16: the tiles (and k-tiles of 32) that fit once a k pair is one word
        chosen += map(_pairs, cuda_kernels.plan_candidates(
            p["M"], p["N"], p["K"], p["batch"], a_kfast=p["a_kfast"], b_kfast=p["b_kfast"], bf16=True,
            pair_words=True)[:TUNE_TOP // 2])
    splits, tiles = set(), set()
    for q in ranked[:TUNE_SPREAD]:
        if q.splits not in splits:
            splits.add(q.splits)
            chosen.append(_pairs(q))
        if (q.BM, q.BN, q.TM, q.TN) not in tiles and len(tiles) < TUNE_TOP:
            tiles.add((q.BM, q.BN, q.TM, q.TN))
            chosen.append(_pairs(q))
    return list(dict.fromkeys(chosen))[:3 * TUNE_TOP]


def _gemm_accepts(g: dict[str, Any], plan: Plan, x3: bool = False) -> bool:
    """A stored GEMM plan fits when the cost model finds it feasible as it is (the same splits):
    a step's own kernels hold K and the split chunk in their code."""
    p, fields = _gemm_problem(g), dict(plan)
    try:
        gp = GemmPlan(**fields)
    except TypeError:
        return False
    mk = cuda_kernels.mma_k(g["tf32"] or x3, "dtype" in g)
    if mk and (gp.BK % mk or cuda_kernels.tf32_warp_grid(gp.BM, gp.BN, gp.threads) is None):
        return False
    q = cuda_kernels._gemm_cost(p["M"], p["N"], p["K"], p["batch"], gp.BM, gp.BN, gp.BK, gp.TM, gp.TN, gp.splits,
                                p["a_kfast"], p["b_kfast"], "dtype" in g, x3)
    return q is not None and _pairs(q) == plan


_TILES = frozenset(cuda_kernels._tile_candidates())


def _gemm_accepts_reused(g: dict[str, Any], plan: Plan, x3: bool = False) -> bool:
    """A GEMM plan of another batch size fits where its tile is one the templates build and is
    feasible (registers, shared memory, the tensor cores' warp grid) and its grid within CUDA's
    limits: a reused plan's kernel takes M, K and the split chunk at run time, so its split count
    serves any K (at a shorter one trailing splits add zeros)."""
    p, fields = _gemm_problem(g), dict(plan)
    try:
        gp = GemmPlan(**fields)
    except TypeError:
        return False
    if (gp.BM, gp.BN, gp.TM, gp.TN) not in _TILES or gp.BK < 1 or gp.splits < 1:
        return False
    mk = cuda_kernels.mma_k(g["tf32"] or x3, "dtype" in g)
    if mk and (gp.BK % mk or cuda_kernels.tf32_warp_grid(gp.BM, gp.BN, gp.threads) is None):
        return False
    if p["batch"] * gp.splits > 65535 or -(-p["N"] // gp.BN) > 65535:
        return False
    return cuda_kernels._gemm_cost(p["M"], p["N"], p["K"], p["batch"], gp.BM, gp.BN, gp.BK, gp.TM, gp.TN, gp.splits,
                                   p["a_kfast"], p["b_kfast"], "dtype" in g, x3) is not None


def _gemm_code(g: dict[str, Any]) -> dict[str, Any]:
    """What a GEMM kernel's code depends on: not a convolution's images, nor a matmul's batch,
    rows and reduced length (run-time sizes: `cuda_kernels.render_*(runtime_batch=True)`)."""
    dropped = ("M", "K", "batch", "operands") if g["kind"] == "matmul" else ("N",)
    return {k: v for k, v in g.items() if k not in dropped}


def _gemm_scratch(g: dict[str, Any], plan: Plan) -> int:
    p = _gemm_problem(g)
    return cuda_kernels.gemm_scratch_bytes(GemmPlan(**dict(plan)), p["M"], p["N"], p["batch"])


def bf16_roles(sub: Graph, spec: KernelSpec) -> frozenset[str]:
    """The roles of a contraction kernel whose buffers hold bfloat16 (as its templates name them)."""
    names = {"mask": "mask_src"} if spec.kind == "conv2d_grad_input" else {}
    roles = {names.get(role, role): sub.inputs[f"in{i}"] for role, i in spec.roles} | {"out": sub.outputs["out"]}
    return frozenset(r for r, n in roles.items() if sub.type(n).dtype.name == "bfloat16")


#: the plan of a generated kernel (pointwise, reduction, loss) that a step of another batch size
#: took from one of this model's steps: rendered on run-time sizes (`cuda.render_reduction`)
RUNTIME: Plan = (("sizes", "runtime"),)


def runtime_plan(spec: KernelSpec) -> bool:
    """Whether a generated kernel is rendered on run-time sizes (its stamped plan is `RUNTIME`)."""
    return spec.choice is not None and tuple(spec.choice[1]) == RUNTIME


def _generated_code(g: dict[str, Any]) -> dict[str, Any]:
    """What a generated kernel on run-time sizes is keyed by among reused plans: its kind (its
    code is the subgraph's; the facts of a reduction's layout at this size are left out)."""
    return {k: v for k, v in g.items() if k in ("kind", "epilogues", "tf32")}


def runtime_sizes(spec: KernelSpec) -> bool:
    """Whether a GEMM kernel takes its batch-dependent sizes at run time: where its plan was
    reused from a step of another batch size (select's `why`), so every later batch size (the
    last partial batch, inference at any size) is the same module. A step's own kernels hold
    their sizes: on the H200 the run-time variant ran ResNet-8's and the CNN's steps 8-16% slower
    (docs/benchmarks.md), which the step a model trains with would pay on every call."""
    return spec.why.startswith("reused")


def _gemm_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any,
                 x3: bool = False) -> CudaKernel:
    gp, eps = GemmPlan(**dict(plan)), spec.epilogues
    common = dict(epilogue=epilogue, tf32=g["tf32"], plan=gp, bf16_roles=bf16_roles(sub, spec),
                  runtime_batch=runtime_sizes(spec), x3=x3)
    if g["kind"] == "matmul":
        return cuda_kernels.render_matmul(name, M=g["M"], N=g["N"], K=g["K"], trans_a=g["trans_a"],
                                          trans_b=g["trans_b"], batch=g["batch"], bias="bias" in eps,
                                          relu="relu" in eps, **common)
    if g["kind"] == "conv2d":
        return cuda_kernels.render_conv2d_forward(name, **_conv_args(g), bias="bias" in eps, relu="relu" in eps, **common)
    if g["kind"] == "conv2d_grad_input":
        return cuda_kernels.render_conv2d_grad_input(name, **_conv_args(g), relu_mask="relu_mask" in eps, **common)
    return cuda_kernels.render_conv2d_grad_weight(name, **_conv_args(g), bias=False, **common)


# -- gemm_x3: the GEMM skeleton's 3xTF32 path, float32 contractions on TF32 tensor cores

def _x3_precision(g: dict[str, Any]) -> str | None:
    """Why a 3xTF32 family (gemm_x3, winograd_x3) does not serve this geometry's precision, if so."""
    if g["tf32"] or g.get("dtype") == "bfloat16":
        return ("it computes float32 products on TF32 tensor cores (3xTF32): precision 'float32' only (under "
                "'tf32' one TF32 product is what is asked for; bfloat16 operands have their own mma)")
    return None


def _x3_rejects(g: dict[str, Any]) -> str | None:
    return _x3_precision(g) or _gemm_rejects(g)


# -- direct: stride-1 convolutions staging input rows once a block (cuda_direct)

def _direct_rejects(g: dict[str, Any]) -> str | None:
    if g.get("dtype") and g["kind"] != "conv2d_grad_weight":
        return "its forward and grad-input compute in float32 (bfloat16 operands: direct_tc, gemm)"
    return _direct_geometry_rejects(g)


def _direct_geometry_rejects(g: dict[str, Any]) -> str | None:
    """Why the direct kernels' blocking does not fit a convolution (any precision)."""
    ph, pw_ = pair(g["padding"], "padding")
    if pair(g["stride"], "stride") != (1, 1):
        return "stride is not 1"
    if ph >= g["KH"] or pw_ >= g["KW"]:
        return "padding is not smaller than the kernel"
    return None


def _direct_plans(g: dict[str, Any]) -> list[Plan]:
    if g["kind"] == "conv2d_grad_weight":
        gw = cuda_direct.direct_grad_weight_plan(g["N"], g["C"], g["O"], g["KH"], g["KW"], g["HO"], g["WO"])
        return [] if gw is None else [(("OT", gw[0]), ("RB", gw[1]), ("blocks", gw[2]))]
    plan = cuda_direct.direct_plan(grad_input=g["kind"] == "conv2d_grad_input", **_conv_args(g))
    return [] if plan is None else [_pairs(plan)]


def _direct_accepts_reused(g: dict[str, Any], plan: Plan) -> bool:
    """A forward or grad-input plan of another batch size fits where it tiles the geometry (the
    images are the grid's y alone); a grad-weight's must be the cost model's here (no step takes
    one from another batch size: its code holds the images, `_direct_code`)."""
    if g["kind"] == "conv2d_grad_weight" or _direct_rejects(g) is not None:
        return plan in _direct_plans(g)
    try:
        p = cuda_direct.DirectPlan(**dict(plan), score=0.0)
    except TypeError:
        return False
    ph, pw_ = pair(g["padding"], "padding")
    geo = cuda_direct._direct_geometry(g["kind"] == "conv2d_grad_input", g["N"], g["C"], g["H"], g["W"], g["O"],
                                       g["KH"], g["KW"], g["HO"], g["WO"], ph, pw_)
    return g["N"] <= 65535 and cuda_direct.direct_plan_fits(p, geo["CI"], geo["WO_"], geo["CO"], g["KH"], g["KW"])


def _direct_code(g: dict[str, Any]) -> dict[str, Any] | None:
    """What a direct kernel's code depends on: not the images of a forward or grad-input (the
    grid's y); a grad-weight's code holds them (None: a step of another batch size takes the
    first-ranked family that does not, `ChoiceTable.reused_choice`, whose variant is built ahead)."""
    return None if g["kind"] == "conv2d_grad_weight" else {k: v for k, v in g.items() if k != "N"}


def _direct_scratch(g: dict[str, Any], plan: Plan) -> int:
    if g["kind"] != "conv2d_grad_weight":
        return 0
    return round_up(4 * dict(plan)["blocks"] * g["O"] * g["C"] * g["KH"] * g["KW"], cuda_kernels.SCRATCH_ALIGN)


def _direct_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    p, eps = dict(plan), spec.epilogues
    if g["kind"] == "conv2d_grad_weight":
        return cuda_direct.render_direct_grad_weight(name, **_conv_args(g), epilogue=epilogue,
                                                     plan=(p["OT"], p["RB"], p["blocks"]),
                                                     bf16_roles=bf16_roles(sub, spec))
    return cuda_direct.render_direct(name, grad_input=g["kind"] == "conv2d_grad_input", **_conv_args(g),
                                     bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps,
                                     epilogue=epilogue, plan=cuda_direct.DirectPlan(**p))


# -- direct_tc: the direct convolutions on TF32 tensor cores (cuda_direct_tc)

def _direct_tc_rejects(g: dict[str, Any]) -> str | None:
    # bfloat16 operands: pairs on the bfloat16 mma (forward, grad-input) or widened floats, exact
    # in TF32 (grad-weight, and stages of 8 or 24 channels)
    if g.get("dtype") != "bfloat16" and not g["tf32"]:
        return "it runs on TF32 tensor cores: precision 'tf32' or bfloat16 operands only"
    return _direct_geometry_rejects(g)


def _direct_tc_candidates(g: dict[str, Any]) -> list[Plan]:
    """Every plan the tuner measures, the planner's best first."""
    if g["kind"] == "conv2d_grad_weight":
        sizes = (g[k] for k in ("N", "C", "O", "KH", "KW", "HO", "WO"))
        return list(map(_pairs, cuda_direct_tc.tc_grad_weight_candidates(*sizes, g.get("dtype") == "bfloat16")))
    geo = cuda_direct_tc.tc_direct_problem(grad_input=g["kind"] == "conv2d_grad_input", **_conv_args(g))
    if geo is None:
        return []
    return list(map(_pairs, cuda_direct_tc.tc_forward_candidates(g["N"], geo["CI"], geo["CO"], geo["HO_"], geo["WO_"],
                                                                 g["KH"], g["KW"], g.get("dtype") == "bfloat16")))


def _direct_tc_accepts(g: dict[str, Any], plan: Plan) -> bool | None:
    """A forward or grad-input plan fits where it tiles the geometry (a record measured before the
    planner changed stays valid); a grad-weight's must be among today's candidates."""
    if g["kind"] == "conv2d_grad_weight":
        return None
    geo = cuda_direct_tc.tc_direct_problem(grad_input=g["kind"] == "conv2d_grad_input", **_conv_args(g))
    try:
        p = cuda_direct_tc.TcPlan(**dict(plan))
    except TypeError:
        return False
    return geo is not None and cuda_direct_tc.tc_plan_fits(p, g["N"], geo["CI"], geo["CO"], geo["HO_"], geo["WO_"],
                                                           g["KH"], g["KW"], g.get("dtype") == "bfloat16")


def _direct_tc_version(g: dict[str, Any]) -> int:
    # 2: the bfloat16 grad-weight multiplies pixel pairs on the bfloat16 mma (session 23; it
    # had widened them on the TF32 mma), whose records' times are another kernel's
    return 2 if g["kind"] == "conv2d_grad_weight" and g.get("dtype") == "bfloat16" else 1


def _direct_tc_plans(g: dict[str, Any]) -> list[Plan]:
    return _direct_tc_candidates(g)[:1]


def _unmeasured(g: dict[str, Any]) -> bool:
    return False  # no measurement says when it wins: the tuner decides, the cost model never picks it


def _direct_tc_scratch(g: dict[str, Any], plan: Plan) -> int:
    if g["kind"] != "conv2d_grad_weight":
        return 0
    return cuda_direct_tc.tc_grad_weight_scratch(dict(plan)["blocks"], g["O"], g["C"], g["KH"], g["KW"])


def _direct_tc_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                      epilogue: Any) -> CudaKernel:
    p, eps = dict(plan), spec.epilogues
    if g["kind"] == "conv2d_grad_weight":
        return cuda_direct_tc.render_direct_tc_grad_weight(name, **_conv_args(g), epilogue=epilogue,
                                                           plan=cuda_direct_tc.TcGwPlan(**p),
                                                           bf16_roles=bf16_roles(sub, spec))
    return cuda_direct_tc.render_direct_tc(name, grad_input=g["kind"] == "conv2d_grad_input", **_conv_args(g),
                                           bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps,
                                           epilogue=epilogue, plan=cuda_direct_tc.TcPlan(**p),
                                           bf16_roles=bf16_roles(sub, spec))


# -- nhwc_tc: convolutions as a GEMM over channels-innermost operands on tensor cores (cuda_conv_nhwc)

def _nhwc_plan(plan: Plan) -> conv_nhwc.NhwcPlan | None:
    try:
        return conv_nhwc.NhwcPlan(**dict(plan))
    except TypeError:
        return None


def _nhwc_accepts(g: dict[str, Any], plan: Plan, wg: bool = False) -> bool:
    """A plan (a record's, perhaps of another batch size) fits where it is of the family's GEMM core
    (`wg`: warpgroup MMA), tiles the kernel of its kind and its stages fit a block's shared memory:
    any split count serves a grad-weight."""
    p = _nhwc_plan(plan)  # (never a plan reading another kernel's image: only share_relayouts sets those)
    return p is not None and bool(p.WG) == wg and not p.images and p.tiles(g["kind"] == "conv2d_grad_weight") \
        and p.shared_bytes(g) <= current().shared_per_block_optin


def _nhwc_scratch(g: dict[str, Any], plan: Plan) -> int:
    return conv_nhwc.scratch_bytes(g, conv_nhwc.NhwcPlan(**dict(plan)))


def _nhwc_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    return conv_nhwc.family_render(name, sub, spec, g, plan, epilogue, bf16_roles(sub, spec))


# -- small_window: memory-bound convolutions with a small window / few weights (cuda_small_conv)

def _small_args(g: dict[str, Any]) -> tuple:
    sh, sw = pair(g["stride"], "stride")
    _, pw_ = pair(g["padding"], "padding")
    return g["N"], g["C"], g["O"], g["KH"], g["KW"], g["HO"], g["WO"], sh, g["W"], pw_, sw


def _small_rejects(g: dict[str, Any]) -> str | None:
    ckk = g["C"] * g["KH"] * g["KW"]
    if g["kind"] == "conv2d" and ckk > cuda_small_conv.MAX_WINDOW:
        return f"its window C*KH*KW = {ckk} exceeds {cuda_small_conv.MAX_WINDOW}"
    if g["kind"] == "conv2d_grad_weight" and g["O"] * ckk > cuda_small_conv.MAX_WEIGHTS:
        return f"its {g['O'] * ckk} weights exceed {cuda_small_conv.MAX_WEIGHTS}"
    return None


def _small_plans(g: dict[str, Any]) -> list[Plan]:
    planner = cuda_small_conv.small_forward_plan if g["kind"] == "conv2d" else cuda_small_conv.small_grad_weight_plan
    plan = planner(*_small_args(g))
    return [] if plan is None else [_pairs(plan)]


def _small_preferred(g: dict[str, Any]) -> bool:
    return g["KH"] * g["KW"] != 1  # a 1x1 convolution: the GEMM gathers nothing


def _small_scratch(g: dict[str, Any], plan: Plan) -> int:
    if g["kind"] == "conv2d":
        return 0
    return round_up(4 * dict(plan)["blocks"] * g["O"] * g["C"] * g["KH"] * g["KW"], cuda_kernels.SCRATCH_ALIGN)


def _small_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    sp = cuda_small_conv.SmallPlan(**dict(plan))
    rt = runtime_sizes(spec)
    if g["kind"] == "conv2d":
        return cuda_small_conv.render_small_forward(name, **_conv_args(g), bias="bias" in spec.epilogues,
                                                    relu="relu" in spec.epilogues, epilogue=epilogue, plan=sp,
                                                    bf16_roles=bf16_roles(sub, spec), runtime_images=rt)
    return cuda_small_conv.render_small_grad_weight(name, **_conv_args(g), epilogue=epilogue, plan=sp,
                                                    bf16_roles=bf16_roles(sub, spec), runtime_images=rt)


def _small_accepts_reused(g: dict[str, Any], plan: Plan) -> bool:
    """A small-window plan of another batch size fits: its tiling holds no image count (the
    forward's images are its grid's, the grad-weight's blocks share whatever units there are)."""
    try:
        sp = cuda_small_conv.SmallPlan(**dict(plan))
    except TypeError:
        return False
    return min(sp.OT, sp.RB, sp.TL, sp.blocks, sp.V) >= 1 and g["O"] % sp.OT == 0 and g["WO"] % sp.V == 0


# -- thin, skinny_narrow, skinny_short: matmuls that are passes over memory

def _thin_rejects(g: dict[str, Any]) -> str | None:
    if not g["rank2"]:
        return "it takes one batch of 2-d operands"
    if g["K"] > cuda_direct.THIN_MAX_K or g["N"] % 4 or g["trans_b"] or g["M"] * g["N"] >= 2**31:
        return f"it needs K <= {cuda_direct.THIN_MAX_K}, N a multiple of 4 and b stored (K, N)"
    return None


def _matmul_args(g: dict[str, Any], spec: KernelSpec, epilogue: Any) -> dict[str, Any]:
    return dict(M=g["M"], N=g["N"], K=g["K"], bias="bias" in spec.epilogues, relu="relu" in spec.epilogues,
                epilogue=epilogue)


def _thin_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    return cuda_direct.render_matmul_thin(name, trans_a=g["trans_a"], trans_b=g["trans_b"], rows=dict(plan)["RM"],
                                          bf16_roles=bf16_roles(sub, spec), runtime_rows=runtime_sizes(spec),
                                          **_matmul_args(g, spec, epilogue))


#: rows a block of the thin matmul the tuner measures beside the cost model's
THIN_TUNING_ROWS = (2, 4, 8, 16, 32)


def _thin_row_blocks_fit(g: dict[str, Any], rows: int) -> bool:
    return -(-g["M"] // rows) <= 65535  # the row blocks are the grid's y


def _thin_plans(g: dict[str, Any]) -> list[Plan]:
    rows = cuda_direct.thin_rows(g["M"], g["N"])
    return [(("RM", rows),)] if _thin_row_blocks_fit(g, rows) else []


def _thin_candidates(g: dict[str, Any]) -> list[Plan]:
    """The cost model's rows a block, then the others the tuner measures: fewer rows make more
    blocks (a row's loads in flight per thread), more make fewer and longer ones."""
    return list(dict.fromkeys(_thin_plans(g) + [(("RM", rows),) for rows in THIN_TUNING_ROWS
                                                 if _thin_row_blocks_fit(g, rows)]))


def _thin_accepts_reused(g: dict[str, Any], plan: Plan) -> bool:
    """A thin plan of another batch size fits: its kernel takes the rows and K at run time (the
    family serves the geometry: K <= 16), and any rows a block serve any M the grid holds."""
    fields = dict(plan)
    return (set(fields) == {"RM"} and isinstance(fields["RM"], int) and fields["RM"] >= 1
            and _thin_row_blocks_fit(g, fields["RM"]))


def _narrow_rejects(g: dict[str, Any]) -> str | None:
    if not g["rank2"]:
        return "it takes one batch of 2-d operands"
    if g["trans_a"] or not g["trans_b"] or g["N"] > cuda_skinny.NARROW_MAX_N \
            or g["M"] * max(g["N"], g["K"]) >= 2**40:
        return f"it needs a (M, K) @ b (N, K)^T with N <= {cuda_skinny.NARROW_MAX_N}"
    return None


def _narrow_plans(g: dict[str, Any]) -> list[Plan]:
    return _narrow_candidates(g)[:1]


def _narrow_candidates(g: dict[str, Any]) -> list[Plan]:
    """The planner's tiling first, then the other shapes of a lane's work the tuner measures: rows a
    lane and k steps in flight trade registers for bytes in flight, which decide a pass over memory
    (bfloat16 rows bring half the bytes of float32 ones per load)."""
    M, N, K = g["M"], g["N"], g["K"]
    shapes = [{}, dict(rows_per_lane=2, warps=8), dict(rows_per_lane=2, warps=8, unroll=4),
              dict(rows_per_lane=4, warps=4, unroll=4), dict(rows_per_lane=1, warps=8, unroll=8)]
    out = []
    for shape in shapes:
        plan = cuda_skinny.narrow_plan(M, N, K, **shape)
        if math.ceil(M / plan.rows) <= 65535 and plan.S < 2**31 and K % plan.V == 0 and _pairs(plan) not in out:
            out.append(_pairs(plan))
    return out


def _short_rejects(g: dict[str, Any]) -> str | None:
    if not g["rank2"]:
        return "it takes one batch of 2-d operands"
    if g["trans_b"] or g["M"] > cuda_skinny.SHORT_MAX_M or g["N"] % 4 or max(g["M"], g["N"]) * g["K"] >= 2**40:
        return f"it needs M <= {cuda_skinny.SHORT_MAX_M}, N a multiple of 4 and b stored (K, N)"
    return None


def _short_plans(g: dict[str, Any]) -> list[Plan]:
    plan = cuda_skinny.short_m_plan(g["M"], g["N"], g["K"])
    if plan is None or math.ceil(g["N"] // 4 / plan.CT) >= 2**31 or plan.S > 65535:
        return []
    return [_pairs(plan)]


def _split_scratch(g: dict[str, Any], plan: Plan) -> int:
    s = dict(plan)["S"]
    return round_up(4 * s * g["M"] * g["N"], cuda_kernels.SCRATCH_ALIGN) if s > 1 else 0


def _narrow_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    return cuda_skinny.render_matmul_narrow(name, trans_a=bool(g["trans_a"]), trans_b=bool(g["trans_b"]),
                                            plan=cuda_skinny.NarrowPlan(**dict(plan)), bf16_roles=bf16_roles(sub, spec),
                                            runtime_rows=runtime_sizes(spec), **_matmul_args(g, spec, epilogue))


def _narrow_accepts_reused(g: dict[str, Any], plan: Plan) -> bool:
    """A narrow plan of another batch size fits: its kernel takes the rows at run time, and its
    tiling of k (the same K) and rows serves any M."""
    try:
        p = cuda_skinny.NarrowPlan(**dict(plan))
    except TypeError:
        return False
    return min(p.RT, p.RG, p.V, p.U, p.S, p.KC) >= 1 and g["K"] % p.V == 0 and p.S * p.KC >= g["K"] \
        and -(-g["M"] // p.rows) <= 65535


def _short_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    return cuda_skinny.render_matmul_short_m(name, trans_a=bool(g["trans_a"]), trans_b=bool(g["trans_b"]),
                                             plan=cuda_skinny.ShortMPlan(**dict(plan)), bf16_roles=bf16_roles(sub, spec),
                                             **_matmul_args(g, spec, epilogue))


# -- winograd, winograd4: 3x3 stride-1 convolutions by Winograd's minimal filtering F(m x m, 3x3),
# m = 2 or 4, around batched GEMMs (cuda_winograd)

def _winograd_family(name: str, m: int, priority: int, x3: bool = False) -> Family:
    """`x3`: the batched GEMM as 3xTF32 (float32 products on TF32 tensor cores, gemm_x3's path),
    for precision "float32" only."""
    def gemm(g: dict[str, Any]) -> dict[str, Any]:
        """The kernel's batched product as a matmul geometry (what the GEMM family's planner and
        checks read)."""
        return dict(kind="matmul", epilogues=(), tf32=False, **cuda_winograd.problem(g, m))

    def render(kernel_name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
        eps = spec.epilogues
        return cuda_winograd.render(kernel_name, g, GemmPlan(**dict(plan)), bias="bias" in eps, relu="relu" in eps,
                                    relu_mask="relu_mask" in eps, epilogue=epilogue, m=m, x3=x3)

    def rejects(g: dict[str, Any]) -> str | None:
        return (_x3_precision(g) if x3 else None) or cuda_winograd.serves(g, m)

    tuning = (lambda g: gemm_candidates(gemm(g), x3=True)[:TUNE_TOP * 2]) if x3 else (lambda g: gemm_candidates(gemm(g)))
    # fewer multiply-adds, transforms through memory: taken where measured, never by default
    return Family(name, CONVS, priority, lambda g: [_pairs(cuda_winograd.plans(g, m=m, x3=x3)[0])], rejects, _never,
                  lambda g, plan: cuda_winograd.scratch_bytes(g, GemmPlan(**dict(plan)), m), render,
                  tuning_plans=tuning, accepts=lambda g, plan: _gemm_accepts(gemm(g), plan, x3=x3))


# -- grouped: convolutions with groups > 1, depthwise included (generic kernels, grouped_conv)

def _grouped_rejects(g: dict[str, Any]) -> str | None:
    return None if g.get("groups", 1) != 1 else "it serves grouped convolutions only (groups > 1)"


def _grouped_geometry(g: dict[str, Any]) -> grouped_conv.ConvGeometry:
    return grouped_conv.geometry((g["N"], g["C"], g["H"], g["W"]), (g["O"], g["C"] // g["groups"], g["KH"], g["KW"]),
                                 g)  # a grouped family's geometry always holds groups


def _grouped_plans(g: dict[str, Any]) -> list[Plan]:
    """The grad-weight's: by taps in this many shares of the images (0: a block a weight)."""
    if g["kind"] != "conv2d_grad_weight":
        return [()]
    return [(("splits", grouped_conv.cuda_grad_weight_splits(_grouped_geometry(g), current().multiprocessors)),)]


def _grouped_scratch(g: dict[str, Any], plan: Plan) -> int:
    return grouped_conv.cuda_scratch_bytes(g["kind"], _grouped_geometry(g), dict(plan).get("splits", 0))


def _grouped_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    eps = spec.epilogues
    return grouped_conv.render_cuda(name, g["kind"], _grouped_geometry(g), bias="bias" in eps, relu="relu" in eps,
                                    relu_mask="relu_mask" in eps, epilogue=epilogue, splits=dict(plan).get("splits", 0),
                                    bf16_roles=bf16_roles(sub, spec), runtime_images=runtime_sizes(spec))


def _grouped_accepts_reused(g: dict[str, Any], plan: Plan) -> bool:
    """A grouped plan of another batch size fits: its kernel takes the images at run time and its
    grad-weight's split count serves any (a share of none adds zeros)."""
    fields = dict(plan)
    if g["kind"] != "conv2d_grad_weight":
        return not fields
    return set(fields) == {"splits"} and isinstance(fields["splits"], int) and fields["splits"] >= 0


# -- pool and the generated kinds: one family each

def _pool_plans(g: dict[str, Any]) -> list[Plan]:
    """The forward: one plan. The gradient: a thread an input element gathering the windows that
    hold it (any pooling), and where windows do not overlap, first, a thread a window writing its
    whole tile (each input read once, no window searched twice)."""
    if g["kind"] != "max_pool2d_grad":
        return [()]
    gather: Plan = (("mode", "gather"),)
    if pool_kernels.PoolGeometry(**{k: g[k] for k in pool_kernels.GEOMETRY_FIELDS}).windows_disjoint:
        return [(("mode", "tile"),), gather]
    return [gather]


def _pool_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    x_t = sub.type(sub.operands(spec.core)[0])
    return pool_kernels.render_cuda(name, spec.kind, pool_kernels.geometry(x_t.shape, sub.attrs(spec.core)),
                                    bf16=g.get("dtype") == "bfloat16", tile=dict(plan).get("mode") == "tile",
                                    runtime_images=runtime_sizes(spec))


def _generated(module_function: str) -> Callable[..., CudaKernel]:
    """The renderer of a generated kind, as a CudaKernel whose roles are in0.. out (scratch).
    Imported when called: `cuda` (the step renderer) imports this table."""
    def render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
        from . import cuda
        args = tuple(sub.inputs) + tuple(sub.outputs)
        runtime = plan == RUNTIME
        if module_function == "pointwise":
            code, grid, block, scalars = cuda.render_pointwise(name, sub, runtime=runtime)
            return CudaKernel(name, code, (Launch(name, grid, block, 0, args, scalars),), 0)
        if module_function == "reduction":
            return _reduction_kernel(name, sub, cuda.render_reduction(name, sub, spec.core, runtime=runtime))
        return cuda.render_loss(name, sub, spec, runtime=runtime)[0]
    return render


def _reduction_scratch(g: dict[str, Any], plan: Plan) -> int:
    return g["runtime"]["scratch"] if plan == RUNTIME else g["reduction_scratch"]


def _columns_rejects(g: dict[str, Any]) -> str | None:
    return None if "rows" in g else "it serves column sums (float sums over the leading axes into contiguous outputs)"


def _columns_plans(g: dict[str, Any]) -> list[Plan]:
    from . import cuda
    return [(("splits", cuda.column_splits(g["rows"], g["outputs"])),)]


def _columns_tuning(g: dict[str, Any]) -> list[Plan]:
    """The cost model's split count, a quarter, half and twice it, and one block along the rows:
    each as `column_split_plan` makes it (no two alike)."""
    from . import cuda
    best = cuda.column_splits(g["rows"], g["outputs"])
    counts = [best, max(1, best // 4), max(1, best // 2), 2 * best, 1]
    made = dict.fromkeys(cuda.column_split_plan(g["rows"], c)[0] for c in counts)
    return [(("splits", c),) for c in made]


def _columns_accepts(g: dict[str, Any], plan: Plan) -> bool:
    splits = dict(plan).get("splits")
    return isinstance(splits, int) and 1 <= splits <= g["rows"]


def _columns_scratch(g: dict[str, Any], plan: Plan) -> int:
    from . import cuda
    return cuda.column_scratch(g["rows"], g["outputs"], g["sums"], dict(plan)["splits"])


def _columns_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan, epilogue: Any) -> CudaKernel:
    from . import cuda
    return _reduction_kernel(name, sub, cuda.render_columns(name, sub, spec.core, dict(plan)["splits"]))


def _reduction_kernel(name: str, sub: Graph, red: Any) -> CudaKernel:
    """A rendered reduction (`cuda.ReductionKernel`) as a CudaKernel: its roles in0.. out.., then
    each launch's own (scratch, counters)."""
    args = tuple(sub.inputs) + tuple(sub.outputs)
    return CudaKernel(name, red.code, tuple(Launch(f, grid, block, 0, args + extra, red.scalars)
                                            for f, grid, block, extra in red.launches), red.scratch_bytes)


def _one_plan(g: dict[str, Any]) -> list[Plan]:
    return [()]


def _plain(g: dict[str, Any]) -> bool:
    return True


def _never(g: dict[str, Any]) -> bool:
    """A specialised family is picked over the general one only where measurements say so."""
    return False


def features(g: dict[str, Any]) -> tuple[float, ...]:
    """Where a kernel sits among measured ones (`family_prior`): the log2 of its GEMM view's sizes,
    of its window and stride (convolutions) or its operands' layouts (matmuls), and its precision."""
    if g["kind"] == "reduction":  # a column sum (the one kind of reduction with two families)
        return family_prior.log2_sizes(g["rows"], g["outputs"], g["sums"])
    p = _gemm_problem(g)
    sizes = family_prior.log2_sizes(p["M"], p["N"], p["K"], p["batch"])
    if g["kind"] in CONVS:
        shape = family_prior.log2_sizes(g["KH"] * g["KW"], math.prod(pair(g["stride"], "stride")))
    else:
        shape = (float(bool(g["trans_a"])), float(bool(g["trans_b"])))
    return sizes + shape + (float(g["tf32"]),)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("small_window", ("conv2d", "conv2d_grad_weight"), 0, _small_plans, _small_rejects,
           _small_preferred, _small_scratch, _small_render, code_geometry=without_sizes("N"),
           accepts_reused=_small_accepts_reused),
    Family("direct", CONVS, 1, _direct_plans, _direct_rejects, _never, _direct_scratch, _direct_render,
           accepts_reused=_direct_accepts_reused, code_geometry=_direct_code),
    # TF32 is a property of a family: the ones with a tensor-core path say so by the geometries
    # they take (direct_tc: precision "tf32", and bfloat16 operands, as pairs on the bfloat16 mma
    # or exact in TF32; gemm: its plans follow the geometry's tf32);
    # the others compute in float32 whatever the precision, which TF32 permits (bfloat16
    # operands widened as they are read)
    Family("direct_tc", CONVS, 6, _direct_tc_plans, _direct_tc_rejects, _unmeasured, _direct_tc_scratch,
           _direct_tc_render, tuning_plans=_direct_tc_candidates, accepts=_direct_tc_accepts,
           version_of=_direct_tc_version),
    Family("thin", ("matmul",), 2, _thin_plans, _thin_rejects, _plain, _no_scratch, _thin_render,
           tuning_plans=_thin_candidates, code_geometry=without_sizes("M", "K", "operands"),
           accepts_reused=_thin_accepts_reused),
    Family("skinny_narrow", ("matmul",), 3, _narrow_plans, _narrow_rejects, _never, _split_scratch,
           _narrow_render, tuning_plans=_narrow_candidates, code_geometry=without_sizes("M", "operands"),
           accepts_reused=_narrow_accepts_reused),
    Family("skinny_short", ("matmul",), 4, _short_plans, _short_rejects, _never, _split_scratch,
           _short_render),
    # under precision "tf32" its plans use mma.sync; bfloat16 operands (precision "bf16") run on
    # its mma.sync bfloat16 path
    Family("gemm", CONVS + ("matmul",), 5, _gemm_plans, _gemm_rejects, _plain, _gemm_scratch, _gemm_render,
           tuning_plans=gemm_candidates, accepts=_gemm_accepts, code_geometry=_gemm_code,
           accepts_reused=_gemm_accepts_reused),
    # float32 on TF32 tensor cores, three products an operand pair (accuracy: docs/precision.md);
    # taken where measured, never by default
    Family("gemm_x3", CONVS + ("matmul",), 9, functools.partial(_gemm_plans, x3=True), _x3_rejects, _never, _gemm_scratch,
           functools.partial(_gemm_render, x3=True), tuning_plans=lambda g: gemm_candidates(g, x3=True)[:TUNE_TOP * 2],
           accepts=functools.partial(_gemm_accepts, x3=True), code_geometry=_gemm_code,
           accepts_reused=functools.partial(_gemm_accepts_reused, x3=True)),
    _winograd_family("winograd", 2, 7),
    # F(4x4, 3x3): 1.78x fewer products than F(2x2), smaller transformed operands, more rounding
    _winograd_family("winograd4", 4, 8),
    # F(2x2, 3x3) with its GEMM as 3xTF32 (float32)
    _winograd_family("winograd_x3", 2, 10, x3=True),
    # F(2x2, 3x3) forward and grad-input in one launch: no transformed operands through memory;
    # taken where measured, never by default
    Family("winograd_fused", ("conv2d", "conv2d_grad_input"), 11,
           lambda g: [winograd_fused.stamped(winograd_fused.plans(g)[0])], winograd_fused.serves, _never,
           lambda g, plan: winograd_fused.scratch_bytes(g, winograd_fused.FusedPlan(**dict(plan))), winograd_fused.family_render,
           tuning_plans=lambda g: [winograd_fused.stamped(q) for q in winograd_fused.plans(g)]),
    # convolutions as a GEMM over channels-innermost operands relaid in the scratch block, on
    # bfloat16 tensor cores or TF32 ones (3xTF32 for float32); taken where measured, never by default
    Family("nhwc_tc", CONVS, 12, lambda g: [conv_nhwc.stamped(conv_nhwc.plans(g)[0])], conv_nhwc.serves, _never,
           _nhwc_scratch, _nhwc_render,
           tuning_plans=lambda g: [conv_nhwc.stamped(q) for q in conv_nhwc.plans(g)], accepts=_nhwc_accepts, own_plan=conv_nhwc.own_plan),
    # the same kernels on warpgroup MMA (sm_90a, bfloat16 operands): m64 x BN slices a warpgroup,
    # 128-byte swizzled k-tiles read by descriptors (a grad-weight's MN-major); taken where measured,
    # never by default
    Family("nhwc_wg", conv_nhwc.WG_KINDS, 13, lambda g: [conv_nhwc.stamped(conv_nhwc.wg_plans(g)[0])],
           conv_nhwc.wg_serves, _never, _nhwc_scratch,
           _nhwc_render, tuning_plans=lambda g: [conv_nhwc.stamped(q) for q in conv_nhwc.wg_plans(g)],
           accepts=functools.partial(_nhwc_accepts, wg=True), own_plan=conv_nhwc.own_plan),
    Family("grouped", CONVS, 0, _grouped_plans, _grouped_rejects, _plain, _grouped_scratch, _grouped_render,
           grouped=True, code_geometry=without_sizes("N"), accepts_reused=_grouped_accepts_reused),
    # a step that took its plan from a step of another batch size renders it on run-time images
    Family("pool", tuple(pool_kernels.POOL_KINDS), 0, _pool_plans, _always, _plain, _no_scratch, _pool_render,
           version=2, code_geometry=without_sizes("N")),
    # the generated kinds: a step whose plans came from a step of another batch size renders them
    # on run-time sizes (RUNTIME), one text for every later batch size
    Family("pointwise", ("pointwise",), 0, _one_plan, _always, _plain, _no_scratch, _generated("pointwise"),
           code_geometry=_generated_code, reused_plan=RUNTIME),
    Family("reduction", ("reduction",), 0, _one_plan, _always, _plain, _reduction_scratch, _generated("reduction"),
           code_geometry=_generated_code, reused_plan=RUNTIME),
    # column sums row by row: taken where measured, never by default
    Family("columns", ("reduction",), 1, _columns_plans, _columns_rejects, _never, _columns_scratch, _columns_render,
           tuning_plans=_columns_tuning, accepts=_columns_accepts),
    Family("loss", ("softmax_xent", "softmax_xent_grad"), 0, _one_plan, _always, _plain, _no_scratch,
           _generated("loss"), code_geometry=_generated_code, reused_plan=RUNTIME),
)}


# --------------------------------------------------------------------------- the table

def _geometry(sub: Graph, spec: KernelSpec) -> dict[str, Any]:
    g = geometry(sub, spec)
    if spec.kind == "reduction":  # the general family's split count comes out of the lowering, not a plan (yet)
        from . import cuda
        g.update(cuda.reduction_facts(sub, spec.core))
    return g


def _device_name() -> str:
    return current().name


TABLE = ChoiceTable("cuda", FAMILIES, _geometry, _device_name, EPILOGUES, features=features)

force = TABLE.force
candidates = TABLE.candidates
decide = TABLE.decide
choose = TABLE.choose
scratch_bytes = TABLE.scratch_bytes
stamp = TABLE.stamp
render = TABLE.render
reusable = TABLE.reusable
