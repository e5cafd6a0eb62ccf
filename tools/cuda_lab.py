"""What the CUDA kernel tools share (tools/cuda_kernel_bench.py, tools/cuda_sweep.py): random inputs
and float64 references of a kernel case, one CuPy module for many kernels, launching and timing.

Not a script. A case is (kind, spec, extra) as the kernel renderers take it: kind is conv_fwd,
conv_gi, conv_gw, matmul, sce (the loss), sce_grad (its gradient) or sgd; spec the geometry
(N, C, H, W, O, KH, KW, stride, padding; or M, N, K, trans_a, trans_b, batch, bias, relu; or N, C;
or numel, lr, momentum, weight_decay) and extra the epilogue flags of a convolution (bias, relu,
relu_mask). The reference is the case written as an ember graph and evaluated by ember's
reference interpreter in float64 (`ember.ir.run(..., precision="float64")`), the semantics every
backend is tested against. Only the launch and timing functions need CuPy and a GPU.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.codegen import cuda_kernels as ck
from ember.codegen.cuda_kernels import CudaKernel, GemmPlan, scalar_args, scratch_offset
from ember.ir import Graph, TensorType, conv_out_dim, int64, run

#: Assumed fp32 (non-tensor-core) peak of an H200, for "% of peak" columns.
PEAK_TFLOPS = 67.0


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def conv_out(g: dict) -> tuple[int, int]:
    """(HO, WO) of a convolution geometry."""
    (sh, sw), (ph, pw) = _pair(g["stride"]), _pair(g["padding"])
    return conv_out_dim(g["H"], g["KH"], sh, ph), conv_out_dim(g["W"], g["KW"], sw, pw)


#: The MNIST CNN's convolutions (batch N left out): Conv2d(1, 16, 3) and Conv2d(16, 32, 3).
CONV1 = dict(C=1, H=28, W=28, O=16, KH=3, KW=3, stride=1, padding=0)
CONV2 = dict(C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0)


def mnist_contractions(B: int) -> dict[str, tuple[str, dict, dict]]:
    """name -> (kind, spec, extra) of the contractions of the MNIST CNN and MLP training steps at
    batch B, with the epilogues fusion gives them (the MLP's hidden layer is 30 wide)."""
    conv1, conv2 = dict(N=B, **CONV1), dict(N=B, **CONV2)
    return {
        "conv1_fwd": ("conv_fwd", conv1, dict(bias=True, relu=True)),
        "conv1_gw+db": ("conv_gw", conv1, dict(bias=True)),
        # a fused step's conv1 grad-weight: its bias gradient is a reduction of its own
        "conv1_gw": ("conv_gw", conv1, dict(bias=False)),
        "conv2_fwd": ("conv_fwd", conv2, dict(bias=True, relu=True)),
        "conv2_gi+mask": ("conv_gi", conv2, dict(relu_mask=True)),
        "conv2_gw+db": ("conv_gw", conv2, dict(bias=True)),
        "linear_fwd": ("matmul", dict(M=B, N=10, K=18432, trans_a=False, trans_b=True, bias=True), {}),
        "linear_gi": ("matmul", dict(M=B, N=18432, K=10, trans_a=False, trans_b=False), {}),
        "linear_gw": ("matmul", dict(M=10, N=18432, K=B, trans_a=True, trans_b=False), {}),
        "mlp1_fwd": ("matmul", dict(M=B, N=30, K=784, trans_a=False, trans_b=True, bias=True, relu=True), {}),
        "mlp1_gw": ("matmul", dict(M=30, N=784, K=B, trans_a=True, trans_b=False), {}),
        "mlp2_fwd": ("matmul", dict(M=B, N=10, K=30, trans_a=False, trans_b=True, bias=True), {}),
        "mlp2_gi": ("matmul", dict(M=B, N=30, K=10, trans_a=False, trans_b=False), {}),
    }


def flops(kind: str, spec: dict) -> int:
    """Multiply-adds x 2 of a contraction case (0 for the loss and the update)."""
    if kind == "matmul":
        return 2 * spec.get("batch", 1) * spec["M"] * spec["N"] * spec["K"]
    if kind in ("conv_fwd", "conv_gi", "conv_gw"):
        HO, WO = conv_out(spec)
        return 2 * spec["N"] * spec["O"] * HO * WO * spec["C"] * spec["KH"] * spec["KW"]
    return 0


def render_gemm(name: str, kind: str, spec: dict, extra: dict, plan: GemmPlan | None = None) -> CudaKernel:
    """A contraction case as a GEMM-skeleton kernel (`codegen/cuda_kernels.py`), with `plan` or
    the renderer's own."""
    if kind == "conv_fwd":
        return ck.render_conv2d_forward(name, plan=plan, **spec, **extra)
    if kind == "conv_gi":
        return ck.render_conv2d_grad_input(name, plan=plan, **spec, **extra)
    if kind == "conv_gw":
        return ck.render_conv2d_grad_weight(name, plan=plan, **spec, **extra)
    return ck.render_matmul(name, plan=plan, **spec)


class _Case:
    """A graph under construction whose inputs are drawn as they are declared."""

    def __init__(self, kind: str, rng: np.random.Generator) -> None:
        self.graph = Graph(kind)
        self.rng = rng
        self.inputs: dict[str, np.ndarray] = {}

    def input(self, name: str, shape: tuple[int, ...], scale: float = 0.0) -> int:
        """A float32 input, uniform in [-1, 1] (normal with std `scale` when given)."""
        draw = self.rng.normal(0, scale, shape) if scale else self.rng.uniform(-1, 1, shape)
        self.inputs[name] = draw.astype(np.float32)
        return self.graph.add_input(name, TensorType(shape))

    def labels(self, name: str, n: int, classes: int) -> int:
        self.inputs[name] = self.rng.integers(0, classes, (n,)).astype(np.int64)
        return self.graph.add_input(name, TensorType((n,), int64))

    def const(self, value: float) -> int:
        return self.graph.add_constant(value, "float32")

    def __call__(self, op: str, *operands: int, **attrs: Any) -> int:
        return self.graph.add(op, operands, **attrs)


def _conv(c: _Case, kind: str, g: dict, extra: dict) -> None:
    N, C, H, W, O, KH, KW = (g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW"))
    HO, WO = conv_out(g)
    geo = dict(stride=_pair(g["stride"]), padding=_pair(g["padding"]))
    if kind == "conv_fwd":
        y = c("conv2d", c.input("x", (N, C, H, W)), c.input("w", (O, C, KH, KW)), **geo)
        if extra.get("bias"):
            y = c("add", y, c("reshape", c.input("bias", (O,)), shape=(O, 1, 1)))
        c.graph.set_output("out", c("relu", y) if extra.get("relu") else y)
    elif kind == "conv_gi":
        dx = c("conv2d_grad_input", c.input("dy", (N, O, HO, WO)), c.input("w", (O, C, KH, KW)),
               input_shape=(N, C, H, W), **geo)
        if extra.get("relu_mask"):
            zero = c.const(0.0)
            dx = c("where", c("gt", c.input("mask_src", (N, C, H, W)), zero), dx, zero)
        c.graph.set_output("out", dx)
    else:
        dy = c.input("dy", (N, O, HO, WO))
        x = c.input("x", (N, C, H, W))
        c.graph.set_output("out", c("conv2d_grad_weight", x, dy, weight_shape=(O, C, KH, KW), **geo))
        if extra.get("bias"):
            c.graph.set_output("db", c("sum", dy, axes=(0, 2, 3)))


def _matmul(c: _Case, m: dict) -> None:
    M, N, K, B = m["M"], m["N"], m["K"], m.get("batch", 1)
    lead = (B,) if B > 1 else ()
    swap = tuple(range(len(lead))) + (len(lead) + 1, len(lead))
    a = c.input("a", lead + ((K, M) if m["trans_a"] else (M, K)))
    b = c.input("b", lead + ((N, K) if m["trans_b"] else (K, N)))
    y = c("matmul", c("transpose", a, perm=swap) if m["trans_a"] else a,
          c("transpose", b, perm=swap) if m["trans_b"] else b)
    if m.get("bias"):
        y = c("add", y, c.input("bias", (N,)))
    if m.get("relu"):
        y = c("relu", y)
    c.graph.set_output("out", c("reshape", y, shape=(B, M, N)))


def _softmax_xent(c: _Case, kind: str, N: int, C: int) -> None:
    z = c.input("logits", (N, C), scale=3.0)
    onehot = c("one_hot", c.labels("labels", N, C), num_classes=C)
    mx = c("max", z, axes=(1,), keepdims=True)
    lse = c("add", c("log", c("sum", c("exp", c("sub", z, mx)), axes=(1,), keepdims=True)), mx)
    logp = c("sub", z, lse)
    if kind == "sce":
        loss = c("div", c("neg", c("sum", c("mul", onehot, logp), axes=(0, 1))), c.const(N))
        c.graph.set_output("loss", c("reshape", loss, shape=(1,)))
    else:
        c.graph.set_output("dlogits", c("div", c("sub", c("exp", logp), onehot), c.const(N)))


def _sgd(c: _Case, s: dict) -> None:
    n = s["numel"]
    p, g = c.input("p", (n,)), c.input("g", (n,))
    if s["weight_decay"]:
        g = c("add", g, c("mul", c.const(s["weight_decay"]), p))
    if s["momentum"]:
        g = c("add", c("mul", c.const(s["momentum"]), c.input("v", (n,))), g)
        c.graph.set_output("v", g)
    c.graph.set_output("p", c("sub", p, c("mul", c.const(s["lr"]), g)))


def make_case(kind: str, spec: dict, extra: dict, rng: np.random.Generator
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Random inputs (role -> float32 / int64 array) and float64 references (output role ->
    array) of one kernel case."""
    c = _Case(kind, rng)
    if kind in ("conv_fwd", "conv_gi", "conv_gw"):
        _conv(c, kind, spec, extra)
    elif kind == "matmul":
        _matmul(c, spec)
    elif kind in ("sce", "sce_grad"):
        _softmax_xent(c, kind, spec["N"], spec["C"])
    elif kind == "sgd":
        _sgd(c, spec)
    else:
        raise ValueError(f"unknown kernel case kind {kind!r}; expected conv_fwd, conv_gi, conv_gw, matmul, "
                         "sce, sce_grad or sgd")
    return c.inputs, run(c.graph, c.inputs, precision="float64").outputs


def plan_line(k: CudaKernel) -> str:
    """The plan a renderer writes on its source's second line ("" if it writes none)."""
    return k.code.split("\n")[1].lstrip("/ ") if k.code.startswith("// ====") else ""


# ---- CuPy: compiling, launching, timing ----------------------------------------------------------

def require_cupy():
    """CuPy, or exit with one line when it or a GPU is missing."""
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any failure means: no usable GPU here
        raise SystemExit(f"needs CuPy and an NVIDIA GPU ({type(e).__name__}: {e}); --dry-run renders without one")
    return cp


def compile_module(cp, kernels: list[CudaKernel]):
    """One NVRTC module (CuPy targets the current device's architecture) for all `kernels`."""
    return cp.RawModule(code="\n".join(k.code for k in kernels), options=("-std=c++17",))


def launch(module, kernel: CudaKernel, bufs: dict, scratch) -> None:
    """`kernel`'s launches in order, with device buffers `bufs` (role -> array)."""
    for ln in kernel.launches:
        args = tuple(bufs[r] if scratch_offset(r) is None else scratch[scratch_offset(r) // 4:]
                     for r in ln.args) + scalar_args(ln.scalars)
        module.get_function(ln.function)(ln.grid, ln.block, args, shared_mem=ln.shared_bytes)


def scratch_for(cp, kernel: CudaKernel):
    return cp.empty(max(kernel.scratch_bytes // 4, 1), dtype=cp.float32)


def device_buffers(cp, ins: dict, refs: dict) -> dict:
    """Inputs copied to the device and an empty buffer for every output role that is no input."""
    bufs = {r: cp.asarray(a) for r, a in ins.items()}
    for role, ref in refs.items():
        bufs.setdefault(role, cp.empty(ref.shape, dtype=cp.float32))
    return bufs


def time_eager(cp, fn: Callable[[], Any], runs: int, warm: int = 20) -> float:
    """Median us of `runs` individually launched fn() calls, CUDA events around each."""
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    starts = [cp.cuda.Event() for _ in range(runs)]
    ends = [cp.cuda.Event() for _ in range(runs)]
    for i in range(runs):
        starts[i].record()
        fn()
        ends[i].record()
    ends[-1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in zip(starts, ends))


def time_graph(cp, fn: Callable[[], Any], runs: int, reps: int = 20) -> float:
    """Device us of one fn() call: fn captured reps times into a CUDA graph (no host launch gaps),
    replays timed with events; the median over `runs` replays, divided by reps."""
    st = cp.cuda.Stream(non_blocking=True)
    with st:
        fn()
    st.synchronize()
    st.begin_capture()
    with st:
        for _ in range(reps):
            fn()
    g = st.end_capture()
    for _ in range(3):
        g.launch(st)
    st.synchronize()
    ts = []
    for _ in range(runs):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(st)
        g.launch(st)
        b.record(st)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / reps)
    return statistics.median(ts)


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """Relative L2 error of `got` against `ref`; a NaN counts as a huge error."""
    diff = np.nan_to_num(got.astype(np.float64) - ref, nan=1e30)
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30))


# ---- comparing kernels on one case ---------------------------------------------------------------

@dataclass
class Group:
    """Kernels that compute the same case, compared side by side. `fields` go into each result row;
    `flops` / `nbytes` (compulsory traffic: each operand read once, the output written once), when
    given, add % of fp32 peak / GB/s."""
    kind: str
    spec: dict
    extra: dict
    kernels: list[tuple[str, CudaKernel | None]]
    fields: dict = field(default_factory=dict)
    flops: int = 0
    nbytes: int = 0

    def rendered(self) -> list[tuple[str, CudaKernel]]:
        """The variants a renderer could build (it returns None for a plan that does not fit)."""
        return [(label, k) for label, k in self.kernels if k is not None]


def describe(groups: list[Group], match: str | None = None, log: Callable[[str], Any] = print) -> None:
    """Each group's variants and their plans, without a GPU (`--dry-run`)."""
    for g in groups:
        head = " ".join(f"{k}={v}" for k, v in g.fields.items())
        for label, k in g.rendered():
            if match is None or match in label:
                log(f"{head} {label:52s} {k.name}: {plan_line(k)}")


def measure(cp, rng: np.random.Generator, groups: list[Group], match: str | None = None, once: bool = False,
            log: Callable[[str], Any] = print) -> list[dict]:
    """Times every variant of every group (graph-timed us) and checks it against the float64
    reference (relative L2 error; the output is poisoned with NaN first). With `once`, launches
    each variant once, uncaptured, and neither times nor checks it (for a profiler). `match` keeps
    the variants whose label contains it."""
    rows = []
    for g in groups:
        kernels = [(label, k) for label, k in g.rendered() if match is None or match in label]
        if not kernels:
            continue
        ins, refs = make_case(g.kind, g.spec, g.extra, rng)
        bufs = device_buffers(cp, ins, refs)
        module = compile_module(cp, [k for _, k in kernels])
        ref = refs["out"]
        head = " ".join(f"{k}={v}" for k, v in g.fields.items())
        for label, k in kernels:
            scratch = scratch_for(cp, k)
            if once:
                launch(module, k, bufs, scratch)
                cp.cuda.runtime.deviceSynchronize()
                log(f"{head} {label}: launched once")
                continue
            bufs["out"][...] = np.nan
            launch(module, k, bufs, scratch)
            rel = rel_error(cp.asnumpy(bufs["out"]).reshape(ref.shape), ref)
            us = time_graph(cp, lambda: launch(module, k, bufs, scratch), 10, reps=10)
            row = dict(g.fields, variant=label, us=round(us, 2), rel_err=rel,
                       launches=[[ln.function, list(ln.grid), list(ln.block)] for ln in k.launches])
            rate = ""
            if g.flops:
                row["pct_fp32_peak"] = round(100 * g.flops / (us * 1e-6) / (PEAK_TFLOPS * 1e12), 1)
                rate += f" {row['pct_fp32_peak']:5.1f}% peak"
            if g.nbytes:
                row["gbps"] = round(g.nbytes / (us * 1e3), 1)
                rate += f" {row['gbps']:7.1f} GB/s"
            rows.append(row)
            log(f"{head} {label:52s} {us:9.2f} us{rate}  rel {rel:.1e}")
    return rows
