"""Benchmark of ember's generated CPU kernels for the MNIST CNN and MLP steps against PyTorch eager.

    python tools/kernel_bench.py [--runs 60] [--threads 2] [--bind close] [--max-seconds 180]
                                         [--kernels all|cnn|mlp]

Not a test (pytest does not collect it). Each kernel is timed with OpenMP on ``--threads``
threads (default 2: the target machine has 2 cores) next to PyTorch's equivalent with
``torch.set_num_threads`` the same. Timing is interleaved round robin (each round: every kernel 5 times with ember, then 5 times
with torch), so bursts of load from elsewhere hit both sides alike; the table shows the
median over all runs (>= 50 each, after warm-up; min in brackets), torch / ember and ember's
GFLOP/s.
``--bind close`` sets OMP_PROC_BIND=close (and OMP_PLACES=cores) before any OpenMP runtime starts.
The CNN is Conv2d(1,16,3) -> ReLU -> Conv2d(16,32,3) -> ReLU -> Flatten -> Linear(18432,10),
the MLP Linear(784,30) -> Sigmoid -> Linear(30,10); batch 64, fp32. The MLP's matmuls are tiny
(the three small ones are 38 KFLOP): ember's times include one ctypes call (its cost, measured
with an empty C function, is printed under the table), torch's its dispatcher and allocation.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=60, help="timed runs per kernel (>= 50)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bind", choices=["none", "close", "spread"], default="none",
                   help="OMP_PROC_BIND for the run (default: leave unset)")
    p.add_argument("--no-step", action="store_true", help="skip the whole-step PyTorch timing")
    p.add_argument("--max-seconds", type=float, default=180.0,
                   help="stop collecting rounds after this long, quiet or not")
    p.add_argument("--kernels", choices=["all", "cnn", "mlp"], default="all",
                   help="which model's kernels to time (default: both)")
    return p.parse_args()


ARGS = _parse()
# Must happen before libgomp (ours or torch's) initialises.
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
if ARGS.bind != "none":
    os.environ["OMP_PROC_BIND"] = ARGS.bind
    os.environ.setdefault("OMP_PLACES", "cores")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ember.codegen import cpp_kernels as ck  # noqa: E402
from ember.codegen.compiler import compile_cpp  # noqa: E402
from ember.codegen.cpu_vector import cxx_flags, resolve  # noqa: E402

torch.set_num_threads(ARGS.threads)
conv_bwd = torch.ops.aten.convolution_backward


def _aligned(n):
    raw = np.zeros(n + 16, dtype=np.float32)
    off = (-raw.ctypes.data % 64) // 4
    return raw[off:off + n]


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def main():
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    N = 64
    x1, w1, b1 = f32(N, 1, 28, 28), f32(16, 1, 3, 3), f32(16)
    h1 = np.maximum(f32(N, 16, 26, 26), 0)       # conv1 output = conv2 input
    w2, b2 = f32(32, 16, 3, 3), f32(32)
    dy2 = f32(N, 32, 24, 24)                      # grad at conv2 output
    dy1 = f32(N, 16, 26, 26)                      # grad at conv1 output
    flat, Wl, bl, dyl = f32(N, 18432), f32(10, 18432), f32(10), f32(N, 10)
    # MLP: x (N,784) -> h = sigmoid(x W1^T + b1) (N,30) -> logits = h W2^T + b2 (N,10)
    xm, W1, bm1, dh = f32(N, 784), f32(30, 784), f32(30), f32(N, 30)
    hm, W2, bm2, dlg = (1 / (1 + np.exp(-f32(N, 30)))).astype(np.float32), f32(10, 30), f32(10), f32(N, 10)

    # (label, kernel, ember args (inputs..., outputs...), torch callable, GFLOP)
    conv = dict(N=N, KH=3, KW=3)
    specs = [
        ("conv1 fwd +b+relu", ck.render_conv2d_forward("k_c1f", C=1, H=28, W=28, O=16, bias=True, relu=True, **conv),
         (x1, w1, b1, np.empty((N, 16, 26, 26), np.float32)), None, 2 * N * 16 * 26 * 26 * 9),
        ("conv2 fwd +b+relu", ck.render_conv2d_forward("k_c2f", C=16, H=26, W=26, O=32, bias=True, relu=True, **conv),
         (h1, w2, b2, np.empty((N, 32, 24, 24), np.float32)), None, 2 * N * 32 * 24 * 24 * 144),
        ("conv2 grad-input", ck.render_conv2d_grad_input("k_c2gi", C=16, H=26, W=26, O=32, **conv),
         (dy2, w2, np.empty((N, 16, 26, 26), np.float32)), None, 2 * N * 32 * 24 * 24 * 144),
        ("conv2 grad-weight+b", ck.render_conv2d_grad_weight("k_c2gw", C=16, H=26, W=26, O=32, bias=True, **conv),
         (h1, dy2, np.empty((32, 16, 3, 3), np.float32), np.empty(32, np.float32)), None, 2 * N * 32 * 24 * 24 * 144),
        ("conv1 grad-weight+b", ck.render_conv2d_grad_weight("k_c1gw", C=1, H=28, W=28, O=16, bias=True, **conv),
         (x1, dy1, np.empty((16, 1, 3, 3), np.float32), np.empty(16, np.float32)), None, 2 * N * 16 * 26 * 26 * 9),
        ("linear fwd x@W^T+b", ck.render_matmul("k_lf", M=N, N=10, K=18432, trans_a=False, trans_b=True, bias=True),
         (flat, Wl, bl, np.empty((N, 10), np.float32)), None, 2 * N * 10 * 18432),
        ("linear grad-in dy@W", ck.render_matmul("k_lgi", M=N, N=18432, K=10, trans_a=False, trans_b=False),
         (dyl, Wl, None, np.empty((N, 18432), np.float32)), None, 2 * N * 10 * 18432),
        ("linear grad-w dy^T@x", ck.render_matmul("k_lgw", M=10, N=18432, K=N, trans_a=True, trans_b=False),
         (dyl, flat, None, np.empty((10, 18432), np.float32)), None, 2 * N * 10 * 18432),
        ("mlp fc1 x@W1^T+b", ck.render_matmul("k_m1f", M=N, N=30, K=784, trans_a=False, trans_b=True, bias=True),
         (xm, W1, bm1, np.empty((N, 30), np.float32)), None, 2 * N * 30 * 784),
        ("mlp fc1 grad-w dh^T@x", ck.render_matmul("k_m1gw", M=30, N=784, K=N, trans_a=True, trans_b=False),
         (dh, xm, None, np.empty((30, 784), np.float32)), None, 2 * N * 30 * 784),
        ("mlp fc2 h@W2^T+b", ck.render_matmul("k_m2f", M=N, N=10, K=30, trans_a=False, trans_b=True, bias=True),
         (hm, W2, bm2, np.empty((N, 10), np.float32)), None, 2 * N * 10 * 30),
        ("mlp fc2 grad-in dl@W2", ck.render_matmul("k_m2gi", M=N, N=30, K=10, trans_a=False, trans_b=False),
         (dlg, W2, None, np.empty((N, 30), np.float32)), None, 2 * N * 10 * 30),
        ("mlp fc2 grad-w dl^T@h", ck.render_matmul("k_m2gw", M=10, N=30, K=N, trans_a=True, trans_b=False),
         (dlg, hm, None, np.empty((10, 30), np.float32)), None, 2 * N * 10 * 30),
    ]
    T = {k: torch.from_numpy(v) for k, v in dict(x1=x1, w1=w1, b1=b1, h1=h1, w2=w2, b2=b2, dy2=dy2,
                                                  dy1=dy1, flat=flat, Wl=Wl, bl=bl, dyl=dyl, xm=xm, W1=W1,
                                                  bm1=bm1, dh=dh, hm=hm, W2=W2, bm2=bm2, dlg=dlg).items()}
    torch_fns = [
        lambda: F.relu(F.conv2d(T["x1"], T["w1"], T["b1"])),
        lambda: F.relu(F.conv2d(T["h1"], T["w2"], T["b2"])),
        lambda: conv_bwd(T["dy2"], T["h1"], T["w2"], None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                         [True, False, False]),
        lambda: conv_bwd(T["dy2"], T["h1"], T["w2"], [32], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                         [False, True, True]),
        lambda: conv_bwd(T["dy1"], T["x1"], T["w1"], [16], [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                         [False, True, True]),
        lambda: torch.addmm(T["bl"], T["flat"], T["Wl"].t()),
        lambda: torch.mm(T["dyl"], T["Wl"]),
        lambda: torch.mm(T["dyl"].t(), T["flat"]),
        lambda: torch.addmm(T["bm1"], T["xm"], T["W1"].t()),
        lambda: torch.mm(T["dh"].t(), T["xm"]),
        lambda: torch.addmm(T["bm2"], T["hm"], T["W2"].t()),
        lambda: torch.mm(T["dlg"], T["W2"]),
        lambda: torch.mm(T["dlg"].t(), T["hm"]),
    ]
    groups = ["cnn"] * 8 + ["mlp"] * 5
    keep = [ARGS.kernels in ("all", g) for g in groups]
    specs = [s for s, k in zip(specs, keep) if k]
    torch_fns = [f for f, k in zip(torch_fns, keep) if k]
    groups = [g for g, k in zip(groups, keep) if k]

    src = []
    for _, k, args, _, _ in specs:
        n = len(args)
        params = ", ".join(f"void* a{i}" for i in range(n + 1))
        call = ", ".join([f"(float*)a{i}" for i in range(n + 1)] + [str(e) for e in k.extents])  # sizes: run time
        src += [k.code, f'extern "C" void bench_{k.name}({params}) {{ {k.name}({call}); }}\n']
    src.append('extern "C" void bench_noop(void*, void*, void*, void*, void*) {}\n')
    t0 = time.perf_counter()
    art = compile_cpp("\n".join(src), flags=cxx_flags(resolve()), name="kernel_bench")  # $EMBER_CPU_VECTOR's flags
    print(f"compiled {len(specs)} kernels in {time.perf_counter() - t0:.1f} s "
          f"({'cache hit' if art.cache_hit else 'g++'}); threads={ARGS.threads} "
          f"OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND', 'unset')}")
    lib = ctypes.CDLL(str(art.path))

    noop = lib.bench_noop
    noop.argtypes = [ctypes.c_void_p] * 5
    noop.restype = None
    calls = []
    for (label, k, args, _, fl), tfn in zip(specs, torch_fns):
        scratch = _aligned(max(k.scratch_bytes // 4, 1))
        fn = getattr(lib, f"bench_{k.name}")
        fn.argtypes = [ctypes.c_void_p] * (len(args) + 1)
        fn.restype = None
        ptrs = [_ptr(a) for a in args] + [_ptr(scratch)]
        calls.append((label, (lambda fn=fn, ptrs=ptrs: fn(*ptrs)), tfn, fl))

    step = None
    if not ARGS.no_step and "cnn" in groups:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3),
                                    torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(18432, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        xb, yb = T["x1"], torch.randint(0, 10, (N,))

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    # Round robin: every round runs each kernel 5 times with ember then 5 times with torch (and
    # the torch training step twice), so load from elsewhere hits all kernels and both sides
    # alike. This machine is shared: a round during which other processes used more than
    # 0.15 of a core (from /proc/stat) is "busy"; rounds go on until --runs quiet samples per
    # kernel are in, or --max-seconds pass. The table uses the quiet rounds when there are
    # enough of them, else all rounds (and says which).
    per_round = 5
    te = {c[0]: ([], []) for c in calls}    # label -> (quiet samples, busy samples)
    tt = {c[0]: ([], []) for c in calls}
    ts = ([], [])
    tn = ([], [])                           # the empty C function through ctypes
    noop_ptrs = [None] * 5
    clk = os.sysconf("SC_CLK_TCK")

    def busy_seconds():
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return (sum(v) - v[3] - v[4]) / clk          # all but idle and iowait

    def own_seconds():
        t = os.times()
        return t.user + t.system

    print(f"load average before: {os.getloadavg()[0]:.2f}")
    t_start = time.perf_counter()
    n_rounds = n_quiet = 0
    with torch.no_grad():
        for label, ef, tf, _ in calls:          # warm-up
            for _ in range(3):
                ef()
                tf()
    while True:
        b0, o0, w0 = busy_seconds(), own_seconds(), time.perf_counter()
        round_e = {c[0]: [] for c in calls}
        round_t = {c[0]: [] for c in calls}
        round_s = []
        round_n = []
        for _ in range(per_round):
            t1 = time.perf_counter()
            noop(*noop_ptrs)
            round_n.append(time.perf_counter() - t1)
        with torch.no_grad():
            for label, ef, tf, _ in calls:
                for f, acc in ((ef, round_e[label]), (tf, round_t[label])):
                    for _ in range(per_round):
                        t1 = time.perf_counter()
                        f()
                        acc.append(time.perf_counter() - t1)
        if step is not None:
            for _ in range(2):
                t1 = time.perf_counter()
                step()
                round_s.append(time.perf_counter() - t1)
        others = (busy_seconds() - b0) - (own_seconds() - o0)
        quiet = others < 0.15 * (time.perf_counter() - w0)
        k = 0 if quiet else 1
        for label in round_e:
            te[label][k].extend(round_e[label])
            tt[label][k].extend(round_t[label])
        ts[k].extend(round_s)
        tn[k].extend(round_n)
        n_rounds += 1
        n_quiet += quiet
        if n_quiet * per_round >= ARGS.runs or time.perf_counter() - t_start > ARGS.max_seconds:
            break

    use_quiet = n_quiet * per_round >= 50
    pick = (lambda qb: qb[0]) if use_quiet else (lambda qb: qb[0] + qb[1])
    rows = []
    for label, _, _, fl in calls:
        e, t = pick(te[label]), pick(tt[label])
        rows.append((label, statistics.median(e) * 1e6, statistics.median(t) * 1e6, fl,
                     min(e) * 1e6, min(t) * 1e6))
    nsamp = len(pick(te[calls[0][0]]))

    print()
    print(f"{n_rounds} rounds, {n_quiet} quiet; table: median of {nsamp} runs each from "
          f"{'the quiet rounds' if use_quiet else 'ALL rounds (too few quiet ones: expect noise)'}"
          f" (min in brackets)")
    print(f"{'kernel':<22} {'ember us':>17} {'torch us':>17} {'torch/ember':>11} {'ember GFLOP/s':>14}")
    for label, me, mt, fl, mne, mnt in rows:
        print(f"{label:<22} {me:>8.1f} ({mne:>6.1f}) {mt:>8.1f} ({mnt:>6.1f}) {mt / me:>10.2f}x "
              f"{fl / me / 1e3:>14.1f}")
    sums = {}
    for g in dict.fromkeys(groups):
        gr = [r for r, gg in zip(rows, groups) if gg == g]
        se, stt = sum(r[1] for r in gr), sum(r[2] for r in gr)
        sums[g] = se
        print(f"{'sum of the ' + g.upper() + ' rows':<22} {se:>8.1f} {'':8} {stt:>8.1f} {'':8} {stt / se:>10.2f}x "
              f"{sum(r[3] for r in gr) / se / 1e3:>14.1f}")
    print(f"ctypes call of an empty C function: {statistics.median(pick(tn)) * 1e6:.2f} us median "
          f"(included in every ember time above)")
    print(f"load average after: {os.getloadavg()[0]:.2f} (the machine has {os.cpu_count()} cores)")
    if step is not None:
        sm = statistics.median(pick(ts)) * 1e3
        print(f"PyTorch eager training step (same CNN, batch {N}): {sm:.2f} ms median; "
              f"ember's CNN kernels above sum to {sums['cnn'] / 1e3:.2f} ms = {sums['cnn'] / 1e3 / sm:.2f}x of it")


if __name__ == "__main__":
    sys.exit(main())
