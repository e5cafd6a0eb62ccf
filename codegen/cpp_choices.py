"""The CPU choice table: which kernel family, with which plan, serves each kernel, as data.

A family is one C++ template with its tiling scheme (`cpp_kernels`): the two matmul forms (`dot`:
x @ W^T vectorised along k; `axpy`: any matmul, vectorised along n), the three convolution
kernels (forward, grad-input, grad-weight), each with its modes (row, flat, generic; the
grad-input's scatter) and register tiles as plans, the phase-plane convolutions (`conv_phase`: any
stride and groups, register-tiled; the cost model's for strided and grouped convolutions), the
3x3 stride-1 convolutions by Winograd's F(2x2, 3x3) (`conv_winograd`: taken where measured), the
generic grouped convolutions (`grouped_conv`), pooling and the generated kinds (pointwise,
reductions: one plan each). Each entry (a `choices.Family`) says which kinds it serves, when it
applies (a reason when not), when the cost model prefers it, its plans (the cost model's best
first; the tuner's list is a spread of the cost model's ranking), its scratch from a plan, its
renderer and its version.

The plans are chosen for a vector variant (`cpu_vector`: lanes and registers), which is part of
the kernel's geometry (`isa`); the tuning database keys the device by that variant and the
thread count the step runs with (`device_name`: "x86-avx512/2t"), since which plan is fastest
depends on both.

`TABLE` (a `choices.ChoiceTable`) answers for a kernel: its candidates, the decision (forced, else
the tuning database's measurement for this CPU, else the cost model) and its stamp; the module's
functions are its methods. `render_kernel` renders the stamped choice for a vector variant.
"""
from __future__ import annotations

import ctypes
import math
import os
import platform
from typing import Any

from ember.ir import Graph, KernelSpec

from . import conv_phase, conv_winograd, cpp_bf16, cpp_kernels, cpu_vector, family_prior, grouped_conv, pool_kernels
from .choices import ChoiceTable, Family, Plan, runtime
from .conv_phase import PhasePlan
from .conv_winograd import WinogradPlan
from .cpp_kernels import AxpyPlan, ConvPlan, DotPlan, KernelSource
from .cpu_vector import VectorISA
from .shapes import pair

__all__ = ["TABLE", "FAMILIES", "EPILOGUES", "geometry", "device_name", "threads", "render_kernel", "candidates",
           "decide", "choose", "stamp", "force", "scratch_bytes", "reusable"]

CONVS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
#: epilogues each contraction kind's templates take (pointwise and reduction kernels: none)
EPILOGUES: dict[str, frozenset[str]] = {
    "conv2d": frozenset({"bias", "relu"}), "matmul": frozenset({"bias", "relu", "relu_mask"}),
    "conv2d_grad_input": frozenset({"relu_mask"}), "conv2d_grad_weight": frozenset()}
#: kinds rendered from a template (float32 register tiles): the rest are generated from their subgraph
TEMPLATED = CONVS + ("matmul",) + tuple(pool_kernels.POOL_KINDS)


# --------------------------------------------------------------------------- the device

def threads() -> int:
    """The OpenMP team the step's kernels run with: `omp_get_max_threads()` capped at
    `cpp_kernels.MAX_THREADS` (`team_size` in the vector prelude). That is libgomp's current
    setting where libgomp is loaded in this process already, else what it will read when the
    first step loads it: the first number of $OMP_NUM_THREADS, else the CPUs this process may
    run on."""
    n = 0
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        n = int(gomp.omp_get_max_threads())
    except (OSError, AttributeError):
        word = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        if word.isdigit():
            n = int(word)
    if n < 1:
        try:
            n = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            n = os.cpu_count() or 1
    return max(1, min(n, cpp_kernels.MAX_THREADS))


def device_name(isa: VectorISA | None = None) -> str:
    """The CPU as the tuning database keys it: architecture, vector variant and thread count
    ("x86-avx512/2t"): what decides which plan runs fastest."""
    machine = platform.machine().lower()
    arch = "x86" if machine in ("x86_64", "amd64", "i386", "i686") else machine or "cpu"
    return f"{arch}-{(isa or cpu_vector.resolve()).name}/{threads()}t"


# --------------------------------------------------------------------------- geometry

def geometry(sub: Graph, spec: KernelSpec, isa: VectorISA | None = None) -> dict[str, Any]:
    """What the families decide on: the kind, epilogues, vector variant and the sizes (convolutions:
    N C H W O KH KW stride padding HO WO; matmuls: M N K batch trans_a trans_b; pooling: its window)."""
    g: dict[str, Any] = dict(kind=spec.kind, epilogues=tuple(spec.epilogues), isa=(isa or cpu_vector.resolve()).name)
    if spec.kind not in TEMPLATED:
        return g
    core = sub.attrs(spec.core)
    operand_types = [sub.type(o) for o in sub.operands(spec.core)]
    x_t, w_t = operand_types[0], operand_types[-1]
    # The templates are register-tiled for float32 vectors, the bf16 family for bfloat16 pairs; a
    # float64 instance would be a different kernel, not a type change, so it is refused here
    # rather than miscompiled. Only a bfloat16 geometry names its dtype (float32 keys unchanged).
    dtypes = sorted({sub.type(n).dtype.name for n in [spec.core, *sub.operands(spec.core)]})
    if dtypes == ["bfloat16"]:
        g.update(dtype="bfloat16", bf16_dot=cpu_vector.bf16_dot(isa or cpu_vector.resolve()))
    elif dtypes != ["float32"]:
        raise NotImplementedError(f"device='cpu' compiles {spec.kind} for float32 and bfloat16 only, got "
                                  f"{', '.join(dtypes)} (at {sub.loc(spec.core) or sub.name}); use float32 or "
                                  f"device='reference'")
    if spec.kind in pool_kernels.POOL_KINDS:
        p = pool_kernels.geometry(x_t.shape, core)
        g.update(N=p.N, C=p.C, H=p.H, W=p.W, KH=p.KH, KW=p.KW, stride=(p.SH, p.SW), padding=(p.PH, p.PW),
                 HO=p.HO, WO=p.WO)
    elif spec.kind == "matmul":
        if x_t.shape[:-2] != w_t.shape[:-2]:
            raise NotImplementedError(
                f"matmul of {x_t} and {w_t} broadcasts batch dimensions, which the CPU templates do not support "
                f"yet; broadcast_to the operands to a common batch shape first")
        *batch, m, k = x_t.shape  # the core's operands are the logical (transposed) views
        g.update(M=m, N=sub.type(spec.core).shape[-1], K=k, batch=math.prod(batch),
                 trans_a=bool(spec.param("trans_a")), trans_b=bool(spec.param("trans_b")))
    else:
        if spec.kind == "conv2d":
            (n, c, h, w), (o, _, kh, kw) = x_t.shape, w_t.shape
        elif spec.kind == "conv2d_grad_input":
            (n, c, h, w), (o, _, kh, kw) = core["input_shape"], w_t.shape
        else:
            (n, c, h, w), (o, _, kh, kw) = x_t.shape, core["weight_shape"]
        stride, padding = pair(core["stride"], "stride"), pair(core["padding"], "padding")
        g.update(N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw, stride=stride, padding=padding)
        if core["groups"] != 1:  # only then: the tuning database's keys of ungrouped kernels stay as they were
            g["groups"] = core["groups"]
        *_, g["HO"], g["WO"] = cpp_kernels._conv_geometry("k", **_conv_args(g))
    return g


def _conv_args(g: dict[str, Any]) -> dict[str, Any]:
    return {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}


def _mm_args(g: dict[str, Any]) -> dict[str, Any]:
    return dict(M=g["M"], N=g["N"], K=g["K"], trans_a=g["trans_a"], trans_b=g["trans_b"], batch=g["batch"],
                relu_mask="relu_mask" in g["epilogues"])


def _isa(g: dict[str, Any]) -> VectorISA:
    return cpu_vector.VARIANTS[g["isa"]]


def _pairs(plan: Any) -> Plan:
    """A plan dataclass as stamped pairs (a convolution's unused tile fields left out)."""
    return tuple((k, v) for k, v in plan.__dict__.items() if not (isinstance(plan, ConvPlan) and v == 0))


def _fits(scratch):
    """`accepts` of a family: a stored plan fits where the template takes it for this geometry."""
    def accepts(g: dict[str, Any], plan: Plan) -> bool:
        try:
            scratch(g, plan)
        except (ValueError, TypeError):
            return False
        return True
    return accepts


# --------------------------------------------------------------------------- families

def _always(g: dict[str, Any]) -> str | None:
    return None


def _float32(rejects):
    """A float32 template's `rejects`: bfloat16 operands are the bf16 family's."""
    def check(g: dict[str, Any]) -> str | None:
        return "it computes in float32 (bfloat16 operands: the bf16 family)" if g.get("dtype") else rejects(g)
    return check


# -- bf16: every contraction kind on bfloat16 operands (cpp_bf16)

def _bf16_rejects(g: dict[str, Any]) -> str | None:
    return None if g.get("dtype") == "bfloat16" else "it serves bfloat16 operands only"


def _bf16_plans(tune: bool):
    def plans(g: dict[str, Any]) -> list[Plan]:
        return [_pairs(p) for p in cpp_bf16.plans(g, _isa(g), tune)]
    return plans


def _bf16_scratch(g: dict[str, Any], plan: Plan) -> int:
    return cpp_bf16.scratch_bytes(g, cpp_bf16.Bf16Plan(**dict(plan)), _isa(g))


_BF16_RUNTIME = {"matmul": runtime("batch", "M", "K"), **{kind: runtime("N") for kind in CONVS}}


def _bf16_code(g: dict[str, Any]) -> dict[str, Any]:
    """What a bf16 kernel's code depends on: not a convolution's images, nor a matmul's batch, rows
    and reduced length (run-time sizes; a matmul's N is its columns, which the code holds)."""
    return _BF16_RUNTIME[g["kind"]](g)


def _bf16_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                 epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    return cpp_bf16.render(name, g, cpp_bf16.Bf16Plan(**dict(plan)), _isa(g))


def _plain(g: dict[str, Any]) -> bool:
    return True


def _float32_only(g: dict[str, Any]) -> bool:
    return g.get("dtype") != "bfloat16"


def _no_scratch(g: dict[str, Any], plan: Plan) -> int:
    return 0


def _one_plan(g: dict[str, Any]) -> list[Plan]:
    return [()]


# -- matmul: the dot and axpy forms

def _matmul_plans(form: str, tune: bool):
    def plans(g: dict[str, Any]) -> list[Plan]:
        return [_pairs(p) for p in cpp_kernels.matmul_plans(form, **_mm_args(g), isa=_isa(g), tune=tune)]
    return plans


def _dot_rejects(g: dict[str, Any]) -> str | None:
    return cpp_kernels._dot_serves(g["trans_a"], g["trans_b"], "relu_mask" in g["epilogues"])


def _never(g: dict[str, Any]) -> bool:
    """A family taken only where measurements say so (the dot matmul over the general axpy form,
    Winograd over the direct convolutions)."""
    return False


def features(g: dict[str, Any]) -> tuple[float, ...]:
    """Where a kernel sits among measured ones (`family_prior`): the log2 of its sizes, and its
    operands' layouts (matmuls) or its window and stride (convolutions)."""
    if g["kind"] == "matmul":
        return family_prior.log2_sizes(g["M"], g["N"], g["K"], g["batch"]) + \
            (float(bool(g["trans_a"])), float(bool(g["trans_b"])))
    return family_prior.log2_sizes(g["N"] * g["HO"] * g["WO"], g["O"], g["C"], g["KH"] * g["KW"],
                                   math.prod(pair(g["stride"], "stride")))


def _matmul_scratch(form: type):
    def scratch(g: dict[str, Any], plan: Plan) -> int:
        return cpp_kernels.matmul_scratch_bytes(**_mm_args(g), plan=form(**dict(plan)), isa=_isa(g))
    return scratch


def _matmul_render(form: type):
    def render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
               epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
        eps = g["epilogues"]
        ks = cpp_kernels.render_matmul(name, **_mm_args(g), bias="bias" in eps, relu="relu" in eps,
                                       isa=_isa(g), plan=form(**dict(plan)))
        return ks, ["a", "b", "bias" if "bias" in eps else None, *(["mask"] if "relu_mask" in eps else []), "out",
                    "scratch"]
    return render


# -- convolutions: one family a kind, its modes and register tiles as plans

def _conv_plans(tune: bool):
    def plans(g: dict[str, Any]) -> list[Plan]:
        return [_pairs(p) for p in cpp_kernels.conv_plans(g["kind"], **_conv_args(g), isa=_isa(g), tune=tune)]
    return plans


def _conv_scratch(g: dict[str, Any], plan: Plan) -> int:
    return cpp_kernels.conv_scratch_bytes(g["kind"], **_conv_args(g), plan=ConvPlan(**dict(plan)), isa=_isa(g))


def _conv_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                 epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    eps, cp, isa = g["epilogues"], ConvPlan(**dict(plan)), _isa(g)
    if g["kind"] == "conv2d":
        ks = cpp_kernels.render_conv2d_forward(name, **_conv_args(g), bias="bias" in eps, relu="relu" in eps,
                                               isa=isa, plan=cp)
        return ks, ["x", "w", "bias" if "bias" in eps else None, "out", "scratch"]
    if g["kind"] == "conv2d_grad_input":
        mask = "relu_mask" in eps
        ks = cpp_kernels.render_conv2d_grad_input(name, **_conv_args(g), relu_mask=mask, isa=isa, plan=cp)
        return ks, ["dy", "w", *(["mask"] if mask else []), "out", "scratch"]
    ks = cpp_kernels.render_conv2d_grad_weight(name, **_conv_args(g), bias=False, isa=isa, plan=cp)
    return ks, ["x", "dy", "out", None, "scratch"]


# -- grouped: convolutions with groups > 1, depthwise included (generic loops, grouped_conv)

def _grouped_rejects(g: dict[str, Any]) -> str | None:
    return None if g.get("groups", 1) != 1 else "it serves grouped convolutions only (groups > 1)"


def _grouped_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                    epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    eps = g["epilogues"]
    geo = grouped_conv.geometry((g["N"], g["C"], g["H"], g["W"]), (g["O"], g["C"] // g["groups"], g["KH"], g["KW"]),
                                g)
    ks, order = grouped_conv.render_cpp(name, g["kind"], geo, bias="bias" in eps, relu="relu" in eps,
                                        relu_mask="relu_mask" in eps, bf16=g.get("dtype") == "bfloat16")
    return ks, [*order, "scratch"]


# -- phase: convolutions of any stride and groups over phase planes, register-tiled (conv_phase)

def _phase_geometry(g: dict[str, Any]) -> grouped_conv.ConvGeometry:
    return grouped_conv.ConvGeometry(g["N"], g["C"], g["H"], g["W"], g["O"], g["KH"], g["KW"], *g["stride"],
                                     *g["padding"], g["HO"], g["WO"], g.get("groups", 1))


def _phase_plans(tune: bool):
    def plans(g: dict[str, Any]) -> list[Plan]:
        return [p.pairs() for p in conv_phase.plans(g["kind"], _phase_geometry(g), _isa(g), tune)]
    return plans


def _phase_preferred(g: dict[str, Any]) -> bool:
    # strided or grouped: these, where the conv families run generic loops; stride 1, ungrouped:
    # the conv families' row and flat modes (their measured tiles, rows sharing their padding),
    # but for a 1x1 grad-weight, whose tile there (OB dy channels x 1 tap) loads a vector for
    # every FMA, where these tile OB x CB channels (ember tune, MobileNet's four 1x1 layers on 2
    # threads: 5-60% faster)
    if tuple(g["stride"]) != (1, 1) or g.get("groups", 1) != 1:
        return True
    return g["kind"] == "conv2d_grad_weight" and g["KW"] == 1


def _phase_scratch(g: dict[str, Any], plan: Plan) -> int:
    return conv_phase.scratch_bytes(g["kind"], _phase_geometry(g), PhasePlan(**dict(plan)), _isa(g))


def _phase_code(g: dict[str, Any]) -> dict[str, Any]:
    """What a phase kernel's code depends on: its channels a group, not the images or the groups
    (run-time sizes)."""
    groups = g.get("groups", 1)
    return {**{k: v for k, v in g.items() if k not in ("N", "C", "O", "groups")},
            "CG": g["C"] // groups, "OG": g["O"] // groups}


def _phase_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                  epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    eps = g["epilogues"]
    return conv_phase.render(name, g["kind"], _phase_geometry(g), PhasePlan(**dict(plan)), _isa(g),
                             bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps)


# -- winograd: 3x3 stride-1 forward and grad-input convolutions by F(2x2, 3x3) (conv_winograd)

def _winograd_rejects(g: dict[str, Any]) -> str | None:
    return conv_winograd.serves(g["kind"], _phase_geometry(g))


def _winograd_plans(tune: bool):
    def plans(g: dict[str, Any]) -> list[Plan]:
        return [p.pairs() for p in conv_winograd.plans(g["kind"], _phase_geometry(g), _isa(g), tune)]
    return plans


def _winograd_scratch(g: dict[str, Any], plan: Plan) -> int:
    return conv_winograd.scratch_bytes(g["kind"], _phase_geometry(g), WinogradPlan(**dict(plan)), _isa(g))


def _winograd_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                     epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    eps = g["epilogues"]
    return conv_winograd.render(name, g["kind"], _phase_geometry(g), WinogradPlan(**dict(plan)), _isa(g),
                                bias="bias" in eps, relu="relu" in eps, relu_mask="relu_mask" in eps)


# -- pooling and the generated kinds: one family each, one plan

def _pool_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                 epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    x_t = sub.type(sub.operands(spec.core)[0])
    ks, order = pool_kernels.render_cpp(name, spec.kind, pool_kernels.geometry(x_t.shape, sub.attrs(spec.core)),
                                        bf16=g.get("dtype") == "bfloat16")
    return ks, [*order, "scratch"]


def _pool_scratch(g: dict[str, Any], plan: Plan) -> int:
    p = pool_kernels.PoolGeometry(*(g[k] for k in ("N", "C", "H", "W", "KH", "KW")), *g["stride"], *g["padding"],
                                  g["HO"], g["WO"])
    return pool_kernels.cpp_scratch_bytes(g["kind"], p, bf16=g.get("dtype") == "bfloat16")


def _generated_render(name: str, sub: Graph, spec: KernelSpec, g: dict[str, Any], plan: Plan,
                      epilogue: Any = None) -> tuple[KernelSource, list[str | None]]:
    """A pointwise or reduction kernel (its inputs in0.., then its outputs out, out1..; no
    scratch). Imported when called: `cpp` (the step renderer) imports this table."""
    from . import cpp
    code = cpp.render_pointwise(name, sub) if spec.kind == "pointwise" else cpp.render_reduction(name, sub, spec.core)
    return KernelSource(name, code, 0, cpp.generated_extents(sub, spec.kind, spec.core)), [*sub.inputs, *sub.outputs]


def _bf16_version(g: dict[str, Any]) -> int:
    """The bf16 family's version at g: 3 for a grad-weight on AMX tiles (its direct_amx plans' rows
    became the output channels and nb the input channels), 2 elsewhere (those records stay valid)."""
    return 3 if g["kind"] == "conv2d_grad_weight" and g.get("bf16_dot") == "amx" else 2


def _winograd_version(g: dict[str, Any]) -> int:
    """The winograd family's version at g: 3 for a grad-weight (its plans' VB became vectors of
    input channels: the GEMM sums tiles into lanes of channels), 2 elsewhere (those records stay
    valid)."""
    return 3 if g["kind"] == "conv2d_grad_weight" else 2


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("matmul_dot", ("matmul",), 0, _matmul_plans("dot", False), _float32(_dot_rejects), _never,
           _matmul_scratch(DotPlan), _matmul_render(DotPlan), tuning_plans=_matmul_plans("dot", True),
           accepts=_fits(_matmul_scratch(DotPlan)), code_geometry=runtime("batch", "M")),
    Family("matmul_axpy", ("matmul",), 1, _matmul_plans("axpy", False), _float32(_always), _plain,
           _matmul_scratch(AxpyPlan), _matmul_render(AxpyPlan), tuning_plans=_matmul_plans("axpy", True),
           accepts=_fits(_matmul_scratch(AxpyPlan)), code_geometry=runtime("batch", "M", "K")),
    *(Family(name, (kind,), 0, _conv_plans(False), _float32(_always), _plain, _conv_scratch, _conv_render,
             tuning_plans=_conv_plans(True), accepts=_fits(_conv_scratch), code_geometry=runtime("N"), modal=True)
      for name, kind in (("conv_forward", "conv2d"), ("conv_grad_input", "conv2d_grad_input"),
                         ("conv_grad_weight", "conv2d_grad_weight"))),
    Family("phase", CONVS, -1, _phase_plans(False), _float32(_always), _phase_preferred, _phase_scratch,
           _phase_render, tuning_plans=_phase_plans(True), accepts=_fits(_phase_scratch), grouped=True,
           code_geometry=_phase_code),
    # fewer multiplications than the direct kernels, more transforms: taken where measured (the
    # tuning database, or the prior its records give kernels of similar sizes), never by default
    # version 2: the forward's GEMMs sum 32 channels at a time (more accurate, ~3% slower); 3 for
    # the grad-weight (_winograd_version)
    Family("winograd", conv_winograd.KINDS, 1, _winograd_plans(False), _float32(_winograd_rejects), _never,
           _winograd_scratch, _winograd_render, tuning_plans=_winograd_plans(True), accepts=_fits(_winograd_scratch),
           code_geometry=runtime("N"), version=2, version_of=_winograd_version),
    # float32 or bfloat16 operands; for bfloat16 after the bf16 family (its direct and taps modes
    # are tiled), so the generic loops serve what they do not (a strided grouped grad-input)
    Family("grouped", CONVS, 0, _one_plan, _grouped_rejects, _float32_only, _no_scratch, _grouped_render,
           grouped=True, code_geometry=runtime("N")),
    Family("bf16", CONVS + ("matmul",), 0, _bf16_plans(False), _bf16_rejects, _plain, _bf16_scratch, _bf16_render,
           tuning_plans=_bf16_plans(True), accepts=_fits(_bf16_scratch), version=2, grouped=True,
           code_geometry=_bf16_code, version_of=_bf16_version),
    Family("pool", tuple(pool_kernels.POOL_KINDS), 0, _one_plan, _always, _plain, _pool_scratch, _pool_render),
    Family("pointwise", ("pointwise",), 0, _one_plan, _always, _plain, _no_scratch, _generated_render),
    Family("reduction", ("reduction",), 0, _one_plan, _always, _plain, _no_scratch, _generated_render),
)}


# --------------------------------------------------------------------------- the table

def _geometry(sub: Graph, spec: KernelSpec) -> dict[str, Any]:
    return geometry(sub, spec)


TABLE = ChoiceTable("cpu", FAMILIES, _geometry, device_name, EPILOGUES, features=features)
reusable = TABLE.reusable

force = TABLE.force
candidates = TABLE.candidates
decide = TABLE.decide
choose = TABLE.choose
scratch_bytes = TABLE.scratch_bytes
stamp = TABLE.stamp


def render_kernel(name: str, sub: Graph, spec: KernelSpec,
                  isa: VectorISA | None = None) -> tuple[KernelSource, list[str | None]]:
    """The kernel of the (family, plan) stamped on `spec` (by `select`; the cost model's for a spec
    that was not through it), for the vector variant `isa` (default: `cpu_vector.resolve()`), and its
    arguments in order as roles ("out", "scratch", input roles; None: NULL)."""
    isa = isa or cpu_vector.resolve()
    family, plan = spec.choice or TABLE.decide(sub, spec, db=None).choice
    g = geometry(sub, spec, isa)
    f = FAMILIES[family]
    if TABLE.applies(f, g) is not None or not f.fits(g, plan):
        raise ValueError(f"{name}: the choice {family}{plan} does not fit this kernel for {isa.name} (was "
                         f"${cpu_vector.ENV_VAR} changed between planning and rendering?)")
    return f.render(name, sub, spec, g, plan, None)
