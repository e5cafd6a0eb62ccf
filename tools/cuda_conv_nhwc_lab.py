"""How fast the `nhwc_tc` and `nhwc_wg` families' convolutions run beside cuDNN's, layer by layer,
every plan (a diagnostic, not a test): each kernel as the family renders it (`ember.codegen.cuda_conv_nhwc`),
built through NVRTC, checked against PyTorch's float32 convolution of the same values and timed
beside cuDNN's (NCHW and channels_last) in the same precision. ember's tuned kernels of a whole
step are timed by `tools/kernel_times.py MODEL BATCH [--bf16]`.

    python tools/cuda_conv_nhwc_lab.py [--cases airbench,cnn] [--batch 1024] [--reps 50]
        [--kinds forward,grad_input,grad_weight] [--precision bf16|float32|tf32]

Prints one line per (layer, kind, plan), each time the median of individually event-timed calls
(`cuda_lab.time_eager`): the kernel's GEMM launch (with a grad-weight's ordered
sum of its split partials), us and TFLOP/s; its relayout launches (the source to bordered NHWC,
the weights, a grad-weight's dy); cuDNN's times; the error against float32 (bfloat16: ~3e-3 of
the largest value from the output's rounding; a bfloat16 grad-weight is rounded too).
Session 37 measured the family's ancestor here (docs/benchmarks.md). Needs CuPy and PyTorch with a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from cuda_lab import require_cupy, time_eager

#: layers (C, O, H, W, padding) of the zoo's 3x3 convolutions with whole 16-byte channel runs
LAYERS = {
    "airbench": [(64, 64, 28, 28, 1), (64, 256, 14, 14, 1), (256, 256, 14, 14, 1), (256, 256, 7, 7, 1)],
    "cnn": [(16, 32, 26, 26, 0)],
}
KINDS = {"forward": "conv2d", "grad_input": "conv2d_grad_input", "grad_weight": "conv2d_grad_weight"}


def geometry(kind: str, n: int, layer: tuple[int, int, int, int, int], precision: str) -> dict:
    """The CUDA choice table's geometry of the layer's kernel of `kind` in `precision`."""
    c, o, h, w, pad = layer
    return dict(kind=KINDS[kind], epilogues=frozenset(), tf32=precision == "tf32",
                dtype="bfloat16" if precision == "bf16" else None, N=n, C=c, H=h, W=w, O=o, KH=3, KW=3,
                stride=(1, 1), padding=(pad, pad), HO=h + 2 * pad - 2, WO=w + 2 * pad - 2)


def _operands(torch, kind: str, g: dict, precision: str) -> tuple[dict, object, object, object]:
    """(the kernel's operands by role as torch tensors in the kernel's dtype, the float32
    reference, cuDNN's call, cuDNN's channels_last call or None)."""
    n, c, o, h, w = (g[k] for k in ("N", "C", "O", "H", "W"))
    pad = g["padding"][0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype)
    wt = (torch.randn(o, c, 3, 3, device="cuda", generator=gen) / (9 * c) ** 0.5).to(dtype)
    dy = torch.randn(n, o, g["HO"], g["WO"], device="cuda", generator=gen).to(dtype)
    F, grad = torch.nn.functional, torch.nn.grad
    if kind == "forward":
        x_cl, w_cl = x.contiguous(memory_format=torch.channels_last), wt.contiguous(memory_format=torch.channels_last)
        return (dict(x=x, w=wt), F.conv2d(x.float(), wt.float(), padding=pad), lambda: F.conv2d(x, wt, padding=pad),
                lambda: F.conv2d(x_cl, w_cl, padding=pad))
    if kind == "grad_input":
        return (dict(dy=dy, w=wt), grad.conv2d_input(x.shape, wt.float(), dy.float(), padding=pad),
                lambda: grad.conv2d_input(x.shape, wt, dy, padding=pad), None)
    return (dict(x=x, dy=dy), grad.conv2d_weight(x.float(), wt.shape, dy.float(), padding=pad),
            lambda: grad.conv2d_weight(x, wt.shape, dy, padding=pad), None)


def _allow_shared(cp, function, nbytes: int) -> None:
    """Lets a RawModule's function take `nbytes` of dynamic shared memory (past 48 KiB: an opt-in)."""
    if hasattr(function, "max_dynamic_shared_size_bytes"):
        function.max_dynamic_shared_size_bytes = max(nbytes, 0)
    else:
        from ember.runtime.cuda_modules import allow_dynamic_shared
        allow_dynamic_shared(cp, function, nbytes)


def run_layer(cp, torch, n: int, layer: tuple, kind: str, precision: str, reps: int) -> Iterator[dict]:
    """One row per plan of the family for the layer's kernel of `kind`."""
    from ember.codegen import cuda, cuda_conv_nhwc as cn
    g = geometry(kind, n, layer, precision)
    if (why := cn.serves(g)) is not None:
        yield dict(error=f"nhwc_tc does not serve it: {why}")
        return
    operands, ref, cudnn_call, cudnn_cl_call = _operands(torch, kind, g, precision)
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    cudnn = time_eager(cp, cudnn_call, reps)
    cudnn_cl = time_eager(cp, cudnn_cl_call, reps) if cudnn_cl_call is not None else float("nan")
    bf16 = precision == "bf16"
    bufs = {r: cp.asarray(t.view(torch.int16)).view(cp.uint16) if bf16 else cp.asarray(t) for r, t in operands.items()}
    out_bf16 = bf16 and kind != "grad_weight"  # the step's bf16 grad-weight is float32 after its cast
    bufs["out"] = cp.empty(tuple(ref.shape), dtype=cp.uint16 if out_bf16 else cp.float32)
    roles = (frozenset(operands) | ({"out"} if out_bf16 else set())) if bf16 else frozenset()
    flops = 2.0 * n * layer[1] * g["HO"] * g["WO"] * layer[0] * 9
    from ember.runtime.cuda import nvrtc_options
    # the warpgroup-MMA plans (family nhwc_wg) where the GPU has them, after nhwc_tc's
    for plan in cn.plans(g) + (cn.wg_plans(g) if cn.wg_serves(g) is None else []):
        kernel = cn.render("lab", g, plan, bf16_roles=roles)
        module = cp.RawModule(code=cuda.prelude(bf16=bf16) + kernel.code, options=nvrtc_options(cp))
        scratch = cp.empty(max(kernel.scratch_bytes // 4, 1), dtype=cp.float32)
        calls = []
        for ln in kernel.launches:
            fn = module.get_function(ln.function)
            _allow_shared(cp, fn, ln.shared_bytes)
            calls.append((ln.function, fn, ln.grid, ln.block, ln.shared_bytes,
                          tuple(scratch if r == "scratch" else bufs[r] for r in ln.args)))

        def run(names: tuple[str, ...]):
            def call():
                for name, fn, grid, block, shared, args in calls:
                    if name.endswith(names):
                        fn(grid, block, args, shared_mem=shared)
            return call
        gemm, relayouts = run(("_gemm", "_reduce")), run(("_src", "_wt", "_dy"))
        relayouts(), gemm()
        got = bufs["out"]
        got = torch.as_tensor(got.view(cp.int16), device="cuda").view(torch.bfloat16).float() if out_bf16 else \
            torch.as_tensor(got, device="cuda")
        err = ((got.view(ref.shape) - ref).abs().max() / ref.abs().max()).item()
        t = time_eager(cp, gemm, reps)
        yield dict(layer=f"{layer[0]}->{layer[1]} {layer[2]}x{layer[3]} pad {layer[4]}", kind=kind, batch=n,
                   plan=" ".join(f"{k}={v}" for k, v in cn.stamped(plan)), gemm_us=t, tflops=flops / t / 1e6,
                   relayout_us=time_eager(cp, relayouts, reps), cudnn_us=cudnn, cudnn_cl_us=cudnn_cl, max_err=err)


def _guarded(rows: Iterator[dict]) -> Iterator[dict]:
    """The rows, then a row naming the error where one fails (the next layer still runs)."""
    try:
        yield from rows
    except Exception as e:  # noqa: BLE001 (a diagnostic: report and go on to the next layer)
        yield dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="airbench,cnn")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--kinds", default="forward,grad_input,grad_weight")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "float32", "tf32"))
    args = ap.parse_args()
    cp = require_cupy()
    import torch
    from ember.codegen.device import find, using
    device = find(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    with using(device) if device is not None else contextlib.nullcontext():
        for case in args.cases.split(","):
            for layer in LAYERS[case]:
                for kind in args.kinds.split(","):
                    for r in _guarded(run_layer(cp, torch, args.batch, layer, kind, args.precision, args.reps)):
                        if "error" in r:
                            print(f"{case:9s} {layer} {kind}: {r['error']}", flush=True)
                            continue
                        print(f"{case:9s} {r['layer']:20s} {r['kind']:11s} batch {r['batch']:5d} {r['plan']:42s} "
                              f"gemm {r['gemm_us']:9.1f} us {r['tflops']:6.1f} TF/s | relayouts {r['relayout_us']:7.1f} | "
                              f"cuDNN {r['cudnn_us']:8.1f} channels_last {r['cudnn_cl_us']:8.1f} | err {r['max_err']:.2e}",
                              flush=True)


if __name__ == "__main__":
    main()
