"""Times the CUDA kernels (codegen/cuda_kernels.py) for the MNIST CNN and MLP shapes.

Usage: python tests/codegen/cuda_kernel_bench.py [--out bench.json] [--runs 200] [--batches 64 1024]

For each kernel: median over --runs timed calls (CUDA events around each call, all of the
kernel's launches included, after 20 warm-up calls), achieved GFLOP/s and % of the assumed
H200 fp32 non-tensor peak. When torch with CUDA is importable, the equivalent torch op is timed
the same way with TF32 off (F.conv2d, torch.nn.grad.conv2d_weight / conv2d_input, matmul).
Prints a table and writes it as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_refs  # noqa: E402
from ember.codegen import cuda_kernels as ck  # noqa: E402

PEAK_TFLOPS = 67.0  # assumed H200 fp32 (non-tensor) peak


def _time(cp, fn, runs, warm=20):
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


def _time_graph_cp(cp, fn, runs, reps=20):
    """Device time of one fn() call: fn captured reps times into a CUDA graph (no host launch
    gaps), graph replays timed with events; median over runs replays, divided by reps."""
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


def _time_graph_torch(torch, fn, runs, reps=20):
    """As _time_graph_cp, through torch.cuda.CUDAGraph; None when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / reps)
        return statistics.median(ts)
    except Exception:  # noqa: BLE001 - e.g. an op that cannot be captured
        torch.cuda.synchronize()
        return None


def _cases(B):
    conv = dict(conv1=dict(N=B, C=1, H=28, W=28, O=16, KH=3, KW=3, stride=1, padding=0),
                conv2=dict(N=B, C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0))
    out = []
    for cn, g in conv.items():
        HO, WO = cuda_refs.conv_out(g)
        fl = 2 * B * g["O"] * HO * WO * g["C"] * g["KH"] * g["KW"]
        out.append((f"{cn}_fwd", ck.render_conv2d_forward(f"b_{cn}_fwd_{B}", bias=True, relu=True, **g),
                    ("conv_fwd", g, dict(bias=True, relu=True)), fl))
        out.append((f"{cn}_gw+db", ck.render_conv2d_grad_weight(f"b_{cn}_gw_{B}", bias=True, **g),
                    ("conv_gw", g, dict(bias=True)), fl))
        if cn == "conv2":
            out.append((f"{cn}_gi+mask", ck.render_conv2d_grad_input(f"b_{cn}_gi_{B}", relu_mask=True, **g),
                        ("conv_gi", g, dict(relu_mask=True)), fl))
    for mn, m in {
        "linear_fwd": dict(M=B, N=10, K=18432, trans_a=False, trans_b=True, bias=True),
        "linear_gi": dict(M=B, N=18432, K=10, trans_a=False, trans_b=False),
        "linear_gw": dict(M=10, N=18432, K=B, trans_a=True, trans_b=False),
        "mlp1_fwd": dict(M=B, N=30, K=784, trans_a=False, trans_b=True, bias=True, relu=True),
        "mlp1_gw": dict(M=30, N=784, K=B, trans_a=True, trans_b=False),
        "mlp2_fwd": dict(M=B, N=10, K=30, trans_a=False, trans_b=True, bias=True),
        "mlp2_gi": dict(M=B, N=30, K=10, trans_a=False, trans_b=False),
    }.items():
        out.append((mn, ck.render_matmul(f"b_{mn}_{B}", **m), ("matmul", m, {}), 2 * m["M"] * m["N"] * m["K"]))
    out.append(("softmax_xent", ck.render_softmax_cross_entropy(f"b_sce_{B}", N=B, C=10),
                ("sce", dict(N=B, C=10), {}), 0))
    out.append(("softmax_xent_grad", ck.render_softmax_cross_entropy_grad(f"b_sceg_{B}", N=B, C=10),
                ("sce_grad", dict(N=B, C=10), {}), 0))
    out.append(("sgd_cnn", ck.render_sgd_update(f"b_sgd_{B}", numel=CNN_PARAMS, lr=0.05),
                ("sgd", dict(numel=CNN_PARAMS, lr=0.05, momentum=0.0, weight_decay=0.0), {}), 0))
    return out


#: Parameters of the MNIST CNN (conv1 16x1x3x3+16, conv2 32x16x3x3+32, linear 10x18432+10).
CNN_PARAMS = 16 * 9 + 16 + 32 * 16 * 9 + 32 + 10 * 18432 + 10
#: The kernels of one MNIST-CNN training step (forward, loss, backward, update).
CNN_STEP = ("conv1_fwd", "conv2_fwd", "linear_fwd", "softmax_xent", "linear_gi", "linear_gw",
            "conv2_gi+mask", "conv2_gw+db", "conv1_gw+db", "sgd_cnn")


def gemm_dims(kind, spec, extra):
    """(M, N, K, batch, a_kfast, b_kfast, rowsum) of a contraction case, as the renderers use."""
    if kind == "matmul":
        return (spec["M"], spec["N"], spec["K"], spec.get("batch", 1), not spec["trans_a"],
                spec["trans_b"], False)
    if kind not in ("conv_fwd", "conv_gi", "conv_gw"):
        return None
    HO, WO = cuda_refs.conv_out(spec)
    g = spec
    if kind == "conv_fwd":
        return g["N"] * HO * WO, g["O"], g["C"] * g["KH"] * g["KW"], 1, False, True, False
    if kind == "conv_gi":
        return g["N"] * g["H"] * g["W"], g["C"], g["O"] * g["KH"] * g["KW"], 1, False, True, False
    if kind == "conv_gw":
        return g["O"], g["C"] * g["KH"] * g["KW"], g["N"] * HO * WO, 1, True, True, bool(extra.get("bias"))
    return None


def sweep_plans(kind, spec, extra, n_top):
    """A spread of candidate plans: the model's top n_top, plus the best of each split count
    and of each block tile among the top 300."""
    M, N, K, batch, akf, bkf, rowsum = gemm_dims(kind, spec, extra)
    cands = ck.plan_candidates(M, N, K, batch, a_kfast=akf, b_kfast=bkf, min_threads_for_rows=rowsum)
    chosen = list(cands[:n_top])
    seen_s, seen_t = set(), set()
    for p in cands[:300]:
        if p.splits not in seen_s:
            seen_s.add(p.splits)
            chosen.append(p)
        if (p.BM, p.BN, p.TM, p.TN) not in seen_t and len(seen_t) < n_top:
            seen_t.add((p.BM, p.BN, p.TM, p.TN))
            chosen.append(p)
    out, keys = [], set()
    for p in chosen:
        key = (p.BM, p.BN, p.BK, p.TM, p.TN, p.splits)
        if key not in keys:
            keys.add(key)
            out.append(p)
    return out[: 3 * n_top]


def _render_with(kind, spec, extra, name, plan):
    if kind == "conv_fwd":
        return ck.render_conv2d_forward(name, plan=plan, **spec, **extra)
    if kind == "conv_gi":
        return ck.render_conv2d_grad_input(name, plan=plan, **spec, **extra)
    if kind == "conv_gw":
        return ck.render_conv2d_grad_weight(name, plan=plan, **spec, **extra)
    return ck.render_matmul(name, plan=plan, **spec)


def _torch_fn(torch, kind, spec, extra, ins):
    F = torch.nn.functional
    t = {r: torch.as_tensor(a, device="cuda") for r, a in ins.items()}
    if kind == "conv_fwd":
        g = spec
        return lambda: F.relu(F.conv2d(t["x"], t["w"], t["bias"], stride=g["stride"], padding=g["padding"]))
    if kind == "conv_gw":
        g = spec
        wshape = (g["O"], g["C"], g["KH"], g["KW"])
        return lambda: (torch.nn.grad.conv2d_weight(t["x"], wshape, t["dy"], stride=g["stride"], padding=g["padding"]),
                        t["dy"].sum(dim=(0, 2, 3)))
    if kind == "conv_gi":
        g = spec
        xshape = (g["N"], g["C"], g["H"], g["W"])
        return lambda: torch.nn.grad.conv2d_input(xshape, t["w"], t["dy"], stride=g["stride"],
                                                  padding=g["padding"]) * (t["mask_src"] > 0)
    if kind == "matmul":
        a = t["a"].mT if spec["trans_a"] else t["a"]
        b = t["b"].mT if spec["trans_b"] else t["b"]
        if spec.get("bias"):
            f = (lambda: torch.relu(torch.addmm(t["bias"], a, b))) if spec.get("relu") else (lambda: torch.addmm(t["bias"], a, b))
            return f
        return lambda: torch.matmul(a, b)
    if kind == "sgd":
        lr = spec["lr"]
        return lambda: t["p"].add_(t["g"], alpha=-lr)
    if kind == "sce":
        z, lab = t["logits"].requires_grad_(False), t["labels"]
        def f():
            zz = z.detach().requires_grad_(True)
            F.cross_entropy(zz, lab).backward()
        return f
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--sweep", type=int, default=0,
                    help="also time this many of the cost model's top plans (and a spread) per contraction")
    args = ap.parse_args(argv)
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        sys.exit(f"cuda_kernel_bench: needs CuPy and an NVIDIA GPU ({e})")
    try:
        import torch
        if not torch.cuda.is_available():
            torch = None
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    except Exception:
        torch = None
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"]
    dev = dev.decode() if isinstance(dev, bytes) else dev
    print(f"device: {dev}; assumed fp32 peak {PEAK_TFLOPS} TFLOP/s; device time per call from CUDA-graph replays"
          f" (median); 'eager' = median of {args.runs} individually launched calls"
          f"; torch: {'yes (TF32 off)' if torch else 'not available'}")
    rows, steps, sweeps = [], [], []
    rng = np.random.default_rng(0)
    for B in args.batches:
        cases = _cases(B)
        mod = cuda_refs.compile_module(cp, [k.code for _, k, _, _ in cases])
        prepared = {}
        for label, k, (kind, spec, extra), flops in cases:
            ins, refs, _ = cuda_refs.make_case(kind, spec, extra, rng)
            bufs = {r: cp.asarray(a) for r, a in ins.items()}
            for role, ref in refs.items():
                bufs.setdefault(role, cp.empty(ref.shape, dtype=cp.float32))
            scratch = cp.empty(max(k.scratch_bytes // 4, 1), dtype=cp.float32)
            prepared[label] = (k, bufs, scratch, ins, refs)
            fn = lambda: cuda_refs.run_launches(cp, mod, k, bufs, scratch)  # noqa: E731
            us_eager = _time(cp, fn, args.runs)
            us = _time_graph_cp(cp, fn, 30)
            row = dict(batch=B, kernel=label, name=k.name, us=round(us, 2), us_eager=round(us_eager, 2),
                       launches=[dict(function=l.function, grid=l.grid, block=l.block) for l in k.launches],
                       plan=k.code.split("\n")[1].lstrip("/ "), scratch_bytes=k.scratch_bytes)
            if flops:
                row["gflops"] = round(flops / us / 1e3, 1)
                row["pct_peak"] = round(100 * flops / us / 1e6 / PEAK_TFLOPS, 1)
            tf = None
            if torch is not None:
                try:
                    tf = _torch_fn(torch, kind, spec, extra, ins)
                    row["torch_us_eager"] = round(_time(cp, tf, args.runs), 2)
                    tg = _time_graph_torch(torch, tf, 30)
                    row["torch_us"] = round(tg, 2) if tg is not None else row["torch_us_eager"]
                    row["torch_timing"] = "graph" if tg is not None else "eager"
                except Exception as e:  # keep going: the comparison is optional
                    row["torch_error"] = repr(e)[:300]
                    tf = None
            prepared[label] += (tf,)
            rows.append(row)
            print(f"B={B:<5d} {label:14s} {us:9.2f} us  {row.get('gflops', 0):9.1f} GFLOP/s "
                  f"{row.get('pct_peak', 0):5.1f}% peak   torch {row.get('torch_us', float('nan')):9.2f} us"
                  f"   [{row['plan']}]", flush=True)
        # The whole CNN step's kernels back to back (one timed region, launches queued).
        step = [prepared[l] for l in CNN_STEP]

        def run_step():
            for k, bufs, scratch, *_ in step:
                cuda_refs.run_launches(cp, mod, k, bufs, scratch)
        us = _time_graph_cp(cp, run_step, 30, reps=5)
        st = dict(batch=B, us=round(us, 2), us_eager=round(_time(cp, run_step, args.runs), 2), kernels=list(CNN_STEP),
                  sum_of_medians=round(sum(r["us"] for r in rows if r["batch"] == B and r["kernel"] in CNN_STEP), 2))
        tfs = [t[-1] for t in step]
        if torch is not None and all(tfs):
            def torch_step():
                for f in tfs:
                    f()
            tg = _time_graph_torch(torch, torch_step, 30, reps=5)
            st["torch_us"] = round(tg if tg is not None else _time(cp, torch_step, args.runs), 2)
            st["torch_timing"] = "graph" if tg is not None else "eager"
        steps.append(st)
        print(f"B={B}: CNN step kernels in one graph {us:.1f} us (sum of per-kernel {st['sum_of_medians']:.1f}; eager {st['us_eager']:.1f}); "
              f"torch equivalents back to back {st.get('torch_us', float('nan')):.1f} us", flush=True)
        if args.sweep:
            for label, k, (kind, spec, extra), flops in cases:
                if gemm_dims(kind, spec, extra) is None or (label not in CNN_STEP and not label.startswith("mlp")):
                    continue
                _, bufs, _, ins, refs, _ = prepared[label]
                plans = sweep_plans(kind, spec, extra, args.sweep)
                kerns = [_render_with(kind, spec, extra, f"sw{i}_{label.replace('+', '_')}_{B}", p)
                         for i, p in enumerate(plans)]
                smod = cuda_refs.compile_module(cp, [kk.code for kk in kerns])
                ref = refs["out"]
                res = []
                for p, kk in zip(plans, kerns):
                    scr = cp.empty(max(kk.scratch_bytes // 4, 1), dtype=cp.float32)
                    bufs["out"][...] = np.nan
                    cuda_refs.run_launches(cp, smod, kk, bufs, scr)
                    got = cp.asnumpy(bufs["out"]).reshape(ref.shape).astype(np.float64)
                    rel = float(np.linalg.norm(np.nan_to_num(got - ref, nan=1e30)) / np.linalg.norm(ref))
                    t = _time_graph_cp(cp, lambda: cuda_refs.run_launches(cp, smod, kk, bufs, scr), 10, reps=10)
                    res.append(dict(BM=p.BM, BN=p.BN, BK=p.BK, TM=p.TM, TN=p.TN, splits=p.splits,
                                    est_us=round(p.est_us, 2), us=round(t, 2), rel_err=rel))
                res.sort(key=lambda r: r["us"])
                sweeps.append(dict(batch=B, kernel=label, dims=gemm_dims(kind, spec, extra), results=res))
                b0 = res[0]
                print(f"  sweep B={B} {label:14s} model pick {[r for r in res if r['est_us'] == min(x['est_us'] for x in res)][0]['us']:8.2f} us; "
                      f"best {b0['us']:8.2f} us = {b0['BM']}x{b0['BN']}x{b0['BK']} t{b0['TM']}x{b0['TN']} s{b0['splits']} "
                      f"(est {b0['est_us']}); worst rel err {max(r['rel_err'] for r in res):.1e}", flush=True)
    print("\nsummary (us per call; % of fp32 peak; torch TF32 off)")
    print(f"{'kernel':16s}" + "".join(f"{'B=' + str(B):>30s}" for B in args.batches))
    labels = list(dict.fromkeys(r["kernel"] for r in rows))
    for lab in labels:
        line = f"{lab:16s}"
        for B in args.batches:
            r = next((r for r in rows if r["batch"] == B and r["kernel"] == lab), None)
            line += f"{r['us']:10.2f} {r.get('pct_peak', 0):5.1f}% torch {r.get('torch_us', float('nan')):8.2f}" if r else " " * 30
        print(line)
    for st in steps:
        print(f"B={st['batch']}: CNN step kernels {st['us']:.1f} us back to back (torch {st.get('torch_us', float('nan')):.1f} us)")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=dev, peak_tflops=PEAK_TFLOPS, runs=args.runs, rows=rows,
                                                  steps=steps, sweeps=sweeps), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
