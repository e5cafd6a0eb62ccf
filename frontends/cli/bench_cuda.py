"""`ember bench --device cuda`: ember's compiled CUDA step against PyTorch on the same GPU, in one
process and one run: PyTorch eager and PyTorch with the whole step captured in one CUDA graph
(`torch_mnist.py --mode cudagraph` does the same), and with `--max-autotune`
`torch.compile(mode="max-autotune")` of the loss and of the optimizer's step (Inductor's tuned
kernels, replayed as CUDA graphs: minutes of tuning per model and batch size); float32 with TF32
off unless asked. Data lives on the device for every system (a batch is a slice, no host copy).

Each system runs blocks of steps in turn (interleaved rounds, so drift hits all alike); a block's
time is taken with CUDA events around `block` steps without reading the loss, and the figure is
the median over blocks of the time per step.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import numpy as np

from ember.frontends import compile as ember_compile
from ember.frontends import nn, optim

from ..training.zoo import ZOO, torch_zoo_model, zoo_model

FP32_PEAK_TFLOPS = 67.0  # H200 SXM datasheet fp32 (non-tensor) rate: the scale for "% of peak"
HBM_GB_PER_S = 4800.0    # H200 SXM datasheet HBM3e bandwidth: the scale for "% of HBM"


def _torch_model(name: str):
    return torch_zoo_model(name)  # the zoo's PyTorch definitions (the recipes' twins among them)


def _torch_systems(name: str, init: dict[str, np.ndarray], lr: float, x0, y0,
                   bf16: bool = False, max_autotune: bool = False,
                   log: Callable[[str], None] = print) -> list[tuple[str, Callable]]:
    import torch
    import torch.nn.functional as tF
    systems = []
    for mode in ("torch-eager", "torch-cudagraph") + (("torch-max-autotune",) if max_autotune else ()):
        model = _torch_model(name)
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
        model = model.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=lr)

        def eager(x, y, model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):  # ember's precision="bf16" alike
                loss = tF.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        if mode == "torch-eager":
            systems.append((mode, eager))
            continue
        if mode == "torch-max-autotune":
            try:
                systems.append((mode, _max_autotune_step(name, model, opt, x0, y0, bf16, log)))
            except Exception as e:  # noqa: BLE001 (Inductor's failures are many; the row is left out, said why)
                log(f"[{name}] torch.compile(mode='max-autotune') failed, left out: {type(e).__name__}: {e}")
            continue
        static_x, static_y = x0.clone(), y0.clone()
        saved = [p.detach().clone() for p in model.parameters()]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # warm-up (handles, autograd), undone below
                eager(static_x, static_y)
        torch.cuda.current_stream().wait_stream(s)
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved):
                p.copy_(v)
        opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                static_loss = tF.cross_entropy(model(static_x), static_y)
            static_loss.backward()
            opt.step()

        def replay(x, y, graph=graph, sx=static_x, sy=static_y, sl=static_loss):
            sx.copy_(x)
            sy.copy_(y)
            graph.replay()
            return sl

        systems.append((mode, replay))
    return systems


def _max_autotune_step(name: str, model: Any, opt: Any, x0: Any, y0: Any, bf16: bool,
                       log: Callable[[str], None]) -> Callable:
    """The step as `torch_mnist.py --mode compile` builds it, in max-autotune mode: the loss and
    `opt.step` compiled (static shapes), each compiled region replayed as a CUDA graph (Inductor's
    cudagraph trees, so every step marks its beginning). Compiled and tuned here, on the first
    batch, so the tuning stays out of the timed blocks; the weights are put back afterwards."""
    import time

    import torch
    import torch.nn.functional as tF

    def loss_fn(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            return tF.cross_entropy(model(x), y)

    fwd = torch.compile(loss_fn, mode="max-autotune", dynamic=False)
    opt_step = torch.compile(opt.step, mode="max-autotune", dynamic=False)

    def step(x, y):
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = fwd(x, y)
        loss.backward()
        opt_step()
        return loss

    saved = [p.detach().clone() for p in model.parameters()]
    t0 = time.perf_counter()
    for _ in range(3):  # compile and tune; then the cudagraph trees record and replay
        step(x0, y0)
    torch.cuda.synchronize()
    log(f"[{name}] torch.compile(mode='max-autotune'): {time.perf_counter() - t0:.1f} s to compile and tune")
    with torch.no_grad():
        for p, v in zip(model.parameters(), saved):
            p.copy_(v)
    return step


def run_cuda_bench(models: list[str], batches: list[int], *, steps: int = 200, rounds: int = 5, lr: float = 0.05,
                   tf32: bool = False, bf16: bool = False, seed: int = 0, profile: bool = False,
                   max_autotune: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    import cupy as cp

    from ember.runtime.cuda import wait_for_builds_ahead
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:
        torch, have_torch = None, False
    if have_torch:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    report: dict[str, Any] = {"device": "cuda", "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                              "tf32": tf32, "bf16": bf16, "rows": []}
    for name in models:
        for batch in batches:
            shape = (batch, *ZOO[name].input_shape)
            rng = np.random.default_rng(seed)
            nb = 8
            xs_host = rng.random((nb, *shape), dtype=np.float32)
            ys_host = rng.integers(0, 10, (nb, batch)).astype(np.int64)
            model = zoo_model(name, seed)
            init = model.state_dict()
            step = ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=lr), example_inputs=(xs_host[0], ys_host[0]),
                                 device="cuda", precision="bf16" if bf16 else "tf32" if tf32 else "float32")
            # A dataset on the device, already cut into batches (views made once, for every system
            # alike): slicing a device array costs microseconds of host time per call, which on a
            # ~20 us step would be measured instead of the step. Labels are drawn in 0..9: nothing to
            # check per step.
            xs, ys = cp.asarray(xs_host), cp.asarray(ys_host)
            xb, yb = [xs[i] for i in range(nb)], [ys[i] for i in range(nb)]
            systems: list[tuple[str, Callable]] = [("ember-cuda", lambda i: step.run(xb[i % nb], yb[i % nb], check_labels=False))]
            if have_torch:
                txs, tys = torch.from_numpy(xs_host).cuda(), torch.from_numpy(ys_host).cuda()
                txb, tyb = [txs[i] for i in range(nb)], [tys[i] for i in range(nb)]
                for mode, fn in _torch_systems(name, init, lr, txs[0], tys[0], bf16, max_autotune, log):
                    systems.append((mode, lambda i, fn=fn: fn(txb[i % nb], tyb[i % nb])))
            times: dict[str, list[float]] = {s: [] for s, _ in systems}
            per_block = max(1, steps // rounds)
            for fn_name, fn in systems:  # warm-up: compile, capture, caches
                for i in range(20):
                    fn(i)
            wait_for_builds_ahead()  # (their rendering holds the GIL: launches timed beside it wait)
            cp.cuda.Device().synchronize()
            for r in range(rounds):
                for sys_name, fn in systems:
                    start, stop = cp.cuda.Event(), cp.cuda.Event()
                    cp.cuda.Device().synchronize()
                    start.record(cp.cuda.get_current_stream())
                    for i in range(per_block):
                        fn(i)
                    if have_torch:
                        torch.cuda.synchronize()
                    cp.cuda.Device().synchronize()
                    stop.record(cp.cuda.get_current_stream())
                    stop.synchronize()
                    times[sys_name].append(cp.cuda.get_elapsed_time(start, stop) / per_block)
            ember_ms = statistics.median(times["ember-cuda"])
            for sys_name, ts in times.items():
                ms = statistics.median(ts)
                row = {"model": name, "batch": batch, "system": sys_name, "ms_per_step": ms,
                       "samples_per_s": batch / ms * 1e3, "ember_over_this": ember_ms / ms}
                report["rows"].append(row)
                log(f"{name:9} batch {batch:5} {sys_name:16} {ms * 1e3:9.1f} us/step {batch / ms * 1e3:12.0f} samples/s "
                    f"ember/this {ember_ms / ms:6.3f}")
            if profile:  # each kernel alone and the step without each: minutes for a zoo, so asked for
                report.setdefault("kernels", {})[f"{name}-{batch}"] = kernel_profile(step)
    return report


def kernel_profile(step: Any, repeats: int = 50, shares: bool = True) -> list[dict[str, Any]]:
    """Each launch of the training step timed alone with CUDA events (median of `repeats`), with its
    achieved share of fp32 peak where it is a contraction, and (`shares`) what it adds to the
    step's graph (`step_time_without_each_kernel`: the step replayed once per kernel, minutes at
    batch 1024)."""
    import cupy as cp
    executor = step._example_step()[1]
    graph = executor.graph
    flops, traffic = {}, {}
    for n in graph.g:
        if graph.op(n) == "fused":
            spec, sub = graph.attrs(n)["kernel"], graph.attrs(n)["graph"]
            # Compulsory memory traffic: every operand read once and the result written once (a
            # kernel that re-reads through L2 or spills to scratch moves more; this is the floor).
            traffic[sub.name] = sum(graph.type(o).numel * graph.type(o).dtype.itemsize
                                    for o in set(graph.operands(n))) + graph.type(n).numel * graph.type(n).dtype.itemsize
            if spec.kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight", "matmul"):
                a, b = (sub.type(o) for o in sub.operands(spec.core))
                out = sub.type(spec.core)
                if spec.kind == "matmul":
                    k = a.shape[-1]
                elif spec.kind == "conv2d":
                    k = int(np.prod(b.shape[1:]))
                elif spec.kind == "conv2d_grad_input":
                    k = b.shape[0] // sub.attrs(spec.core)["groups"] * b.shape[2] * b.shape[3]
                else:
                    k = a.shape[0] * b.shape[2] * b.shape[3]
                flops[sub.name] = 2 * out.numel * k
    rows = []
    for fn, grid, block, shared, args in executor._launches:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(repeats):
            start.record()
            fn(grid, block, args, shared_mem=shared)
            stop.record()
            stop.synchronize()
            ts.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
        rows.append({"launch": fn.name if hasattr(fn, "name") else str(fn), "us": statistics.median(ts)})
    names = [la.kernel for la in executor.source.launches]
    for row, kernel in zip(rows, names):
        row["kernel"] = kernel
    by_kernel: dict[str, float] = {}
    for row in rows:
        by_kernel[row["kernel"]] = by_kernel.get(row["kernel"], 0.0) + row["us"]
    in_graph = step_time_without_each_kernel(executor) if shares else None
    out = []
    for kernel, us in by_kernel.items():
        pct = 100 * flops[kernel] / (us * 1e-6) / (FP32_PEAK_TFLOPS * 1e12) if kernel in flops else None
        gbps = traffic[kernel] / (us * 1e-6) / 1e9
        row = {"kernel": kernel, "us": us, "pct_fp32_peak": pct, "bytes": traffic[kernel], "gb_per_s": gbps,
               "pct_hbm": 100 * gbps / HBM_GB_PER_S, "tflops": flops[kernel] / us / 1e6 if kernel in flops else None}
        if in_graph is not None:
            row["step_share_us"] = in_graph["full"] - in_graph[kernel]
        out.append(row)
    return out


def captured_step_time(executor: Any, replays: int = 100, rounds: int = 3) -> float:
    """Device time (us) of one step: the executor's launches as they stand, captured into a CUDA
    graph and replayed `replays` times a round (the best round)."""
    import cupy as cp
    with executor.stream:
        executor.stream.begin_capture()
        try:
            executor._launch_all()
        finally:
            graph = executor.stream.end_capture()
        graph.launch(executor.stream)
        best = float("inf")
        for _ in range(rounds):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(replays):
                graph.launch(executor.stream)
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) * 1e3 / replays)
    return best


def step_time_without_each_kernel(executor: Any, replays: int = 100, rounds: int = 3) -> dict[str, float]:
    """Device time (us) of the step's launches captured into one CUDA graph ("full"), and of the
    same graph with each kernel's launches left out (keyed by kernel). The difference is what the
    kernel adds to the step where it overlaps others on the step's streams: the time a faster
    kernel can save, which its time alone overstates for kernels off the critical path. The
    arena's values are garbage afterwards (kernels were skipped); only the timing is kept."""
    names = [la.kernel for la in executor.source.launches]
    saved, dependent = list(executor._launches), list(executor._dependent)

    def skip(grid: Any, block: Any, args: Any, shared_mem: int = 0) -> None:
        return None

    def timed() -> float:
        return captured_step_time(executor, replays, rounds)

    out = {"full": timed()}
    try:
        for kernel in dict.fromkeys(names):
            executor._launches = [(skip, *launch[1:]) if name == kernel else launch for launch, name in zip(saved, names)]
            executor._dependent = [None if name == kernel else d for d, name in zip(dependent, names)]
            out[kernel] = timed()
    finally:
        executor._launches, executor._dependent = saved, dependent
    return out


def format_cuda_report(report: dict[str, Any]) -> str:
    lines = [f"device=cuda ({report['gpu']}), {'bfloat16 mixed precision (autocast)' if report.get('bf16') else 'float32'}, "
             f"TF32 {'on' if report['tf32'] else 'off'}",
             f"{'model':9} {'batch':>5} {'system':16} {'us/step':>9} {'samples/s':>12} {'ember/this':>10}"]
    for r in report["rows"]:
        lines.append(f"{r['model']:9} {r['batch']:5} {r['system']:16} {r['ms_per_step'] * 1e3:9.1f} "
                     f"{r['samples_per_s']:12.0f} {r['ember_over_this']:10.3f}")
    for key, kernels in report.get("kernels", {}).items():
        total = sum(k["us"] for k in kernels)
        lines.append(f"\n{key}: {len(kernels)} kernels, {total:.1f} us if run back to back (each timed alone)")
        lines.append(f"  {'kernel':28} {'alone':>8}     {'in step':>7}  (in step: the step's graph time minus the "
                     f"same graph without the kernel)")
        for k in sorted(kernels, key=lambda k: -k["us"]):
            pct = f"{k['pct_fp32_peak']:5.1f}% fp32 peak" if k["pct_fp32_peak"] is not None else " " * 15
            hbm = f"{k['gb_per_s']:7.0f} GB/s {k['pct_hbm']:5.1f}% HBM" if "gb_per_s" in k else ""
            share = f"{k['step_share_us']:7.1f} us" if "step_share_us" in k else " " * 10
            lines.append(f"  {k['kernel']:28} {k['us']:8.1f} us  {share}  {pct}  {hbm}")
    return "\n".join(lines)
