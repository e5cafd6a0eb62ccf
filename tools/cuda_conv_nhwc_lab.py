"""How fast a bfloat16 3x3 convolution runs as a channels-innermost tensor-core GEMM (a laboratory,
not part of ember): tools/cuda_conv_nhwc_lab.cu built through NVRTC per geometry and blocking,
checked against PyTorch's float32 convolution of the same bfloat16 values, and timed beside
cuDNN's bfloat16 convolution (NCHW and channels_last). ember's own kernels for the same layers are
timed by `tools/kernel_times.py MODEL BATCH --bf16`.

    python tools/cuda_conv_nhwc_lab.py [--cases airbench,cnn] [--batch 1024] [--reps 50]

Prints one line per (layer, blocking): the convolution alone (us, TFLOP/s), the two relayouts
(x to padded NHWC, the weights to [o][kh][kw][c]), cuDNN's times, and the error against float32;
then the same for the input gradient (the forward kernel on dy, bordered, with the weights flipped
and transposed; stride 1) and the weight gradient (its GEMM and the ordered sum of its split
partials; the relayouts of x and dy).
Needs CuPy and PyTorch with a GPU.
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).with_name("cuda_conv_nhwc_lab.cu")

#: layers (C, O, H, W, padding) of the zoo's bf16 steps with C % 8 == 0
LAYERS = {
    "airbench": [(64, 64, 28, 28, 1), (64, 256, 14, 14, 1), (256, 256, 14, 14, 1), (256, 256, 7, 7, 1)],
    "cnn": [(16, 32, 26, 26, 0)],
}

#: (BM, BN, WM, WN, STAGES, SPLITS) of the weight gradient tried per output width
GW_BLOCKINGS = {
    "wide": [(128, 128, 2, 4, 3, 8), (128, 128, 2, 4, 4, 16), (64, 128, 2, 4, 4, 16), (128, 64, 4, 2, 4, 16)],
    64: [(64, 128, 2, 4, 4, 32), (64, 64, 2, 2, 4, 32), (64, 128, 2, 4, 4, 64)],
    32: [(64, 64, 2, 2, 4, 64), (64, 128, 2, 4, 4, 64)],
}

#: (BM, BN, WM, WN, STAGES) tried per output width
BLOCKINGS = {
    "wide": [(128, 128, 2, 4, 3), (128, 128, 2, 4, 4), (64, 128, 2, 4, 4), (128, 64, 4, 2, 4), (256, 128, 4, 2, 3)],
    64: [(128, 64, 4, 2, 4), (256, 64, 4, 2, 3), (64, 64, 2, 2, 4)],
    32: [(128, 32, 4, 1, 4), (256, 32, 4, 1, 4), (64, 32, 2, 1, 4)],
    16: [(64, 16, 2, 1, 4), (128, 32, 4, 1, 4)],  # the CNN's grad-input (16 input channels)
}


def _timed(fn, reps: int, cp) -> float:
    """Median microseconds of `reps` launches of fn, each between CUDA events (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return statistics.median(times)


def _forward_kernel_rows(cp, torch, src, weights, ref, build: dict, weights_function: str, flops: float,
                         label: str, tag: str, cudnn: float, cudnn_cl: float, reps: int) -> Iterator[dict]:
    """conv_nhwc on `src` (N_, C_, H_, W_ bfloat16, relaid with a border of P_) and `weights`
    (relaid by `weights_function`), built with the sizes in `build`, at each blocking of its output
    width: the result against `ref` (float32), the kernels timed."""
    n, c, h, w, o, pad = (build[k] for k in ("N_", "C_", "H_", "W_", "O_", "P_"))
    kh = kw = 3
    hp, wp = h + 2 * pad, w + 2 * pad
    ho, wo = hp - kh + 1, wp - kw + 1
    src_bits = cp.asarray(src.view(torch.int16)).view(cp.uint16)
    w_bits = cp.asarray(weights.view(torch.int16)).view(cp.uint16)
    padded = cp.empty(n * hp * wp * c, dtype=cp.uint16)
    wk = cp.empty(o * c * kh * kw, dtype=cp.uint16)
    out = cp.empty(n * o * ho * wo, dtype=cp.uint16)
    for bm, bn, wm, wn, stages in BLOCKINGS.get(o, BLOCKINGS["wide"]):
        module = _module(cp, dict(build, KH_=kh, KW_=kw, S_=1, BM=bm, BN=bn, WM=wm, WN=wn, STAGES=stages))
        relayout, relay_weights, conv = (module.get_function(f) for f in ("to_padded_nhwc", weights_function, "conv_nhwc"))
        smem = stages * (bm + bn) * 32 * 2
        _allow_shared(cp, conv, smem)
        grid = ((n * ho * wo + bm - 1) // bm, (o + bn - 1) // bn)

        def run_relayout():
            relayout((n * hp,), (256,), (src_bits, padded))

        def run_weights():
            relay_weights(((o * c * kh * kw + 255) // 256,), (256,), (w_bits, wk))

        def run_conv():
            conv(grid, (wm * wn * 32,), (padded, wk, out), shared_mem=smem)

        run_relayout(), run_weights(), run_conv()
        got = torch.as_tensor(out.view(cp.int16), device="cuda").view(torch.bfloat16).float().view(n, o, ho, wo)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        t = _timed(run_conv, reps, cp)
        yield dict(layer=label, batch=n, blocking=f"{tag}{bm}x{bn} warps {wm}x{wn} stages {stages}", conv_us=t,
                   tflops=flops / t / 1e6, relayout_us=_timed(run_relayout, reps, cp),
                   weights_us=_timed(run_weights, reps, cp), cudnn_us=cudnn, cudnn_cl_us=cudnn_cl, max_err=err)


def run_layer(cp, torch, n: int, layer: tuple[int, int, int, int, int], reps: int) -> Iterator[dict]:
    c, o, h, w, pad = layer
    kh = kw = 3
    ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(torch.bfloat16)
    wt = (torch.randn(o, c, kh, kw, device="cuda", generator=gen) / (c * kh * kw) ** 0.5).to(torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    ref = torch.nn.functional.conv2d(x.float(), wt.float(), padding=pad)
    cudnn = _timed(lambda: torch.nn.functional.conv2d(x, wt, padding=pad), reps, cp)
    x_cl, w_cl = x.contiguous(memory_format=torch.channels_last), wt.contiguous(memory_format=torch.channels_last)
    cudnn_cl = _timed(lambda: torch.nn.functional.conv2d(x_cl, w_cl, padding=pad), reps, cp)
    yield from _forward_kernel_rows(cp, torch, x, wt, ref, dict(N_=n, C_=c, H_=h, W_=w, O_=o, P_=pad), "weights_okkc",
                                    2.0 * n * o * ho * wo * c * kh * kw, f"{c}->{o} {h}x{w} pad {pad}", "", cudnn,
                                    cudnn_cl, reps)


def run_grad_input(cp, torch, n: int, layer: tuple[int, int, int, int, int], reps: int) -> Iterator[dict]:
    """The stride-1 input gradient: the forward kernel on dy (relaid to NHWC with a border of
    KH - 1 - padding) and the weights flipped and transposed (`weights_flipped`); against torch's
    float32 input gradient of the same bfloat16 values and cuDNN's bfloat16 one."""
    c, o, h, w, pad = layer
    kh = kw = 3
    ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    gen = torch.Generator(device="cuda").manual_seed(2)
    wt = (torch.randn(o, c, kh, kw, device="cuda", generator=gen) / (c * kh * kw) ** 0.5).to(torch.bfloat16)
    dy = torch.randn(n, o, ho, wo, device="cuda", generator=gen).to(torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    ref = torch.nn.grad.conv2d_input((n, c, h, w), wt.float(), dy.float(), padding=pad)
    cudnn = _timed(lambda: torch.nn.grad.conv2d_input((n, c, h, w), wt, dy, padding=pad), reps, cp)
    # the build's input is dy (C_ = the layer's O), its output dx (O_ = the layer's C)
    build = dict(N_=n, C_=o, H_=ho, W_=wo, O_=c, P_=kh - 1 - pad)
    yield from _forward_kernel_rows(cp, torch, dy, wt, ref, build, "weights_flipped", 2.0 * n * o * ho * wo * c * kh * kw,
                                    f"{c}->{o} {h}x{w} pad {pad}", "gi ", cudnn, float("nan"), reps)


def _allow_shared(cp, function, nbytes: int) -> None:
    """Lets `function` take `nbytes` of dynamic shared memory (over 48 KB needs the opt-in)."""
    if hasattr(function, "max_dynamic_shared_size_bytes"):  # a RawKernel (RawModule.get_function's)
        function.max_dynamic_shared_size_bytes = nbytes
        return
    attr = getattr(cp.cuda.driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
    cp.cuda.driver.funcSetAttribute(function.ptr, attr, nbytes)


def _module(cp, defs: dict):
    return cp.RawModule(code=SOURCE.read_text(), options=("-std=c++17", "--gpu-architecture=sm_90",
                                                          *(f"-D{k}={v}" for k, v in defs.items())))


def run_grad_weight(cp, torch, n: int, layer: tuple[int, int, int, int, int], reps: int) -> Iterator[dict]:
    """The weight gradient of the layer: dy and x relaid (dy to [pixel][o], x to padded NHWC),
    the split GEMM, the ordered sum of its partials; against torch's float32 weight gradient of
    the same bfloat16 values and cuDNN's bfloat16 one."""
    c, o, h, w, pad = layer
    kh = kw = 3
    ho, wo = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    flops = 2.0 * n * o * ho * wo * c * kh * kw
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(n, o, ho, wo, device="cuda", generator=gen).to(torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    ref = torch.nn.grad.conv2d_weight(x.float(), (o, c, kh, kw), dy.float(), padding=pad)
    cudnn = _timed(lambda: torch.nn.grad.conv2d_weight(x, (o, c, kh, kw), dy, padding=pad), reps, cp)
    xs = cp.asarray(x.view(torch.int16)).view(cp.uint16)
    dys = cp.asarray(dy.view(torch.int16)).view(cp.uint16)
    hp, wp = h + 2 * pad, w + 2 * pad
    xp = cp.empty(n * hp * wp * c, dtype=cp.uint16)
    dyt = cp.empty(n * ho * wo * o, dtype=cp.uint16)
    dw = cp.empty(o * c * kh * kw, dtype=cp.float32)
    for bm, bn, wm, wn, stages, splits in GW_BLOCKINGS.get(o, GW_BLOCKINGS["wide"]):
        blocking = dict(BM=bm, BN=bn, WM=wm, WN=wn, STAGES=stages, SPLITS=splits)
        module = _module(cp, dict(N_=n, C_=c, H_=h, W_=w, O_=o, KH_=kh, KW_=kw, P_=pad, S_=1, **blocking))
        # dy's relayout is x's with dy's sizes: C_ = O, the output plane, no border
        dy_module = _module(cp, dict(N_=n, C_=o, H_=ho, W_=wo, O_=o, KH_=kh, KW_=kw, P_=0, S_=1, **blocking))
        relayout_x, gemm, reduce = (module.get_function(f) for f in ("to_padded_nhwc", "conv_nhwc_grad_weight",
                                                                      "grad_weight_reduce"))
        relayout_dy = dy_module.get_function("to_padded_nhwc")
        partial = cp.empty(splits * o * c * kh * kw, dtype=cp.float32)
        smem = stages * (bm + bn) * 32 * 2
        _allow_shared(cp, gemm, smem)
        grid = ((o + bm - 1) // bm, (c * kh * kw + bn - 1) // bn, splits)

        def run_relayouts():
            relayout_x((n * hp,), (256,), (xs, xp))
            relayout_dy((n * ho,), (256,), (dys, dyt))

        def run_gemm():
            gemm(grid, (wm * wn * 32,), (dyt, xp, partial), shared_mem=smem)
            reduce(((o * c * kh * kw + 255) // 256,), (256,), (partial, dw))

        run_relayouts(), run_gemm()
        got = torch.as_tensor(dw, device="cuda").view(o, c, kh, kw)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        t = _timed(run_gemm, reps, cp)
        yield dict(layer=f"{c}->{o} {h}x{w} pad {pad}", batch=n,
                   blocking=f"gw {bm}x{bn} warps {wm}x{wn} stages {stages} splits {splits}", conv_us=t,
                   tflops=flops / t / 1e6, relayout_us=_timed(run_relayouts, reps, cp), weights_us=0.0,
                   cudnn_us=cudnn, cudnn_cl_us=float("nan"), max_err=err)


def _guarded(rows: Iterator[dict]) -> Iterator[dict]:
    """The rows, then a row naming the error where one fails (the next layer still runs)."""
    try:
        yield from rows
    except Exception as e:  # noqa: BLE001 (a lab: report and go on to the next layer)
        yield dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="airbench,cnn")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--kinds", default="forward,grad_input,grad_weight")
    args = ap.parse_args()
    import cupy as cp
    import torch
    for case in args.cases.split(","):
        for layer in LAYERS[case]:
            runs = [f for kind, f in (("forward", run_layer), ("grad_input", run_grad_input),
                                      ("grad_weight", run_grad_weight))
                    if kind in args.kinds.split(",")]
            for r in (r for f in runs for r in _guarded(f(cp, torch, args.batch, layer, args.reps))):
                if "error" in r:
                    print(f"{case:9s} {layer}: {r['error']}", flush=True)
                    continue
                print(f"{case:9s} {r['layer']:22s} batch {r['batch']:5d} {r['blocking']:28s} conv {r['conv_us']:9.1f} us "
                      f"{r['tflops']:6.1f} TF/s | relayout {r['relayout_us']:7.1f} weights {r['weights_us']:6.1f} | "
                      f"cuDNN {r['cudnn_us']:8.1f} channels_last {r['cudnn_cl_us']:8.1f} | err {r['max_err']:.2e}",
                      flush=True)


if __name__ == "__main__":
    main()
