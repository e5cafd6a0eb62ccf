"""NumPy float64 references and CuPy launch helpers of the CUDA kernel tests (cuda_gpu_check.py,
test_cuda_nonfinite_sources.py, test_cuda_launch_coverage.py), and the check of a kernel's
candidates through the tuner's measurer against the interpreter (the families' GPU tests)."""
from __future__ import annotations

import numpy as np

from ember.codegen.cuda_kernels import scalar_args, scratch_offset

sliding = np.lib.stride_tricks.sliding_window_view


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def conv_out(g):
    (sh, sw), (ph, pw) = _pair(g["stride"]), _pair(g["padding"])
    return (g["H"] + 2 * ph - g["KH"]) // sh + 1, (g["W"] + 2 * pw - g["KW"]) // sw + 1


def _pad(x, ph, pw):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def conv_fwd_ref(x, w, b, g, relu):
    (sh, sw), (ph, pw) = _pair(g["stride"]), _pair(g["padding"])
    HO, WO = conv_out(g)
    KH, KW = w.shape[2:]
    win = sliding(_pad(x.astype(np.float64), ph, pw), (KH, KW), axis=(2, 3))[:, :, ::sh, ::sw][:, :, :HO, :WO]
    y = np.einsum("nchwij,ocij->nohw", win, w.astype(np.float64), optimize=True)
    if b is not None:
        y = y + b.astype(np.float64)[None, :, None, None]
    return np.maximum(y, 0.0) if relu else y


def conv_grad_input_ref(dy, w, g, mask_src=None):
    (sh, sw), (ph, pw) = _pair(g["stride"]), _pair(g["padding"])
    N, C, H, W = g["N"], g["C"], g["H"], g["W"]
    KH, KW = w.shape[2:]
    HO, WO = dy.shape[2:]
    dxp = np.zeros((N, C, H + 2 * ph, W + 2 * pw))
    dy64, w64 = dy.astype(np.float64), w.astype(np.float64)
    for kh in range(KH):
        for kw in range(KW):
            contrib = np.einsum("nohw,oc->nchw", dy64, w64[:, :, kh, kw], optimize=True)
            dxp[:, :, kh:kh + sh * (HO - 1) + 1:sh, kw:kw + sw * (WO - 1) + 1:sw] += contrib
    dx = dxp[:, :, ph:ph + H, pw:pw + W]
    if mask_src is not None:
        dx = np.where(mask_src > 0, dx, 0.0)
    return dx


def conv_grad_weight_ref(x, dy, g):
    (sh, sw), (ph, pw) = _pair(g["stride"]), _pair(g["padding"])
    HO, WO = dy.shape[2:]
    win = sliding(_pad(x.astype(np.float64), ph, pw), (g["KH"], g["KW"]), axis=(2, 3))[:, :, ::sh, ::sw][:, :, :HO, :WO]
    dw = np.einsum("nohw,nchwij->ocij", dy.astype(np.float64), win, optimize=True)
    return dw, dy.astype(np.float64).sum(axis=(0, 2, 3))


def matmul_ref(a, b, m, bias=None):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if m.get("trans_a"):
        a64 = np.swapaxes(a64, -1, -2)
    if m.get("trans_b"):
        b64 = np.swapaxes(b64, -1, -2)
    y = a64 @ b64
    if bias is not None:
        y = y + bias.astype(np.float64)
    return np.maximum(y, 0.0) if m.get("relu") else y


def sce_ref(z, labels, C):
    z64 = z.astype(np.float64)
    mx = z64.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z64 - mx).sum(axis=1, keepdims=True)) + mx
    onehot = labels[:, None] == np.arange(C)[None, :]
    loss = -(onehot * (z64 - lse)).sum() / z.shape[0]
    sm = np.exp(z64 - lse)
    return loss, (sm - onehot) / z.shape[0]


def make_case(kind, spec, extra, rng):
    """Random inputs (role -> float32/int64 array), output roles -> shapes, and references."""
    if kind in ("conv_fwd", "conv_gi", "conv_gw"):
        g = dict(spec)
        HO, WO = conv_out(g)
        N, C, H, W, O, KH, KW = (g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW"))
        x = rng.uniform(-1, 1, (N, C, H, W)).astype(np.float32)
        w = rng.uniform(-1, 1, (O, C, KH, KW)).astype(np.float32)
        dy = rng.uniform(-1, 1, (N, O, HO, WO)).astype(np.float32)
        if kind == "conv_fwd":
            b = rng.uniform(-1, 1, (O,)).astype(np.float32) if extra["bias"] else None
            ins = dict(x=x, w=w) | (dict(bias=b) if b is not None else {})
            return ins, dict(out=conv_fwd_ref(x, w, b, g, extra["relu"])), dict(out=C * KH * KW)
        if kind == "conv_gi":
            ms = rng.uniform(-1, 1, (N, C, H, W)).astype(np.float32) if extra["relu_mask"] else None
            ins = dict(dy=dy, w=w) | (dict(mask_src=ms) if ms is not None else {})
            return ins, dict(out=conv_grad_input_ref(dy, w, g, ms)), dict(out=O * KH * KW)
        dw, db = conv_grad_weight_ref(x, dy, g)
        refs = dict(out=dw) | (dict(db=db) if extra["bias"] else {})
        return dict(x=x, dy=dy), refs, dict(out=N * HO * WO, db=N * HO * WO)
    if kind == "matmul":
        m = spec
        M, N, K, B = m["M"], m["N"], m["K"], m.get("batch", 1)
        ashape = (K, M) if m["trans_a"] else (M, K)
        bshape = (N, K) if m["trans_b"] else (K, N)
        lead = (B,) if B > 1 else ()
        a = rng.uniform(-1, 1, lead + ashape).astype(np.float32)
        b = rng.uniform(-1, 1, lead + bshape).astype(np.float32)
        bias = rng.uniform(-1, 1, (N,)).astype(np.float32) if m.get("bias") else None
        ins = dict(a=a, b=b) | (dict(bias=bias) if bias is not None else {})
        return ins, dict(out=matmul_ref(a, b, m, bias).reshape(B, M, N)), dict(out=K)
    if kind == "sce":
        N, C = spec["N"], spec["C"]
        z = rng.normal(0, 3, (N, C)).astype(np.float32)
        labels = rng.integers(0, C, (N,)).astype(np.int64)
        loss, _ = sce_ref(z, labels, C)
        return dict(logits=z, labels=labels), dict(loss=np.array([loss])), dict(loss=C)
    if kind == "sce_grad":  # the gradient kernel alone: dlogits
        N, C = spec["N"], spec["C"]
        z = rng.normal(0, 3, (N, C)).astype(np.float32)
        labels = rng.integers(0, C, (N,)).astype(np.int64)
        return dict(logits=z, labels=labels), dict(dlogits=sce_ref(z, labels, C)[1]), dict(dlogits=C)
    if kind == "sgd":
        n = spec["numel"]
        p = rng.uniform(-1, 1, (n,)).astype(np.float32)
        g = rng.uniform(-1, 1, (n,)).astype(np.float32)
        ins = dict(p=p, g=g)
        p64, g64 = p.astype(np.float64), g.astype(np.float64) + spec["weight_decay"] * p
        if spec["momentum"]:
            v = rng.uniform(-1, 1, (n,)).astype(np.float32)
            ins["v"] = v
            v64 = spec["momentum"] * v.astype(np.float64) + g64
            return ins, dict(p=p64 - spec["lr"] * v64, v=v64), dict(p=1, v=1)
        return ins, dict(p=p64 - spec["lr"] * g64), dict(p=1)
    raise ValueError(kind)


def run_launches(cp, module, kernel, bufs, scratch):
    """Launch ``kernel``'s launches in order with device buffers ``bufs`` (role -> cupy array)."""
    for ln in kernel.launches:
        fn = module.get_function(ln.function)
        args = tuple(bufs[r] if scratch_offset(r) is None else scratch[scratch_offset(r) // 4:]
                     for r in ln.args) + scalar_args(ln.scalars)
        fn(ln.grid, ln.block, args, shared_mem=ln.shared_bytes)


def compile_module(cp, sources):
    """One RawModule (NVRTC) for all ``sources``; CuPy targets the current device's arch."""
    return cp.RawModule(code="\n".join(sources), options=("-std=c++17",))


def measured_against_interpreter(measurer, sub, spec, choices, tolerance: float) -> int:
    """Every choice of the kernel through the tuner's measurer (`runtime.tuner_cuda.CudaMeasurer`),
    each output against the interpreter's float64 run on the measurer's inputs within `tolerance`
    of the reference's largest magnitude; returns how many were measured."""
    from ember.ir import interpreter
    trials = measurer.measure(sub, spec, choices, seed=0)
    # the measurer's inputs: standard normal, drawn in the subgraph's input order
    rng = np.random.default_rng(0)
    inputs = {name: rng.standard_normal(sub.type(n).shape).astype(np.float32) for name, n in sub.inputs.items()}
    ref = interpreter.run(sub, inputs, precision="float64").outputs["out"]
    for trial in trials:
        assert trial.error is None, (sub.name, spec.describe(), trial.choice, trial.error)
        err = np.max(np.abs(trial.output - ref)) / max(np.max(np.abs(ref)), 1e-30)
        assert err <= tolerance, (sub.name, spec.describe(), trial.choice, err)
    return len(trials)
