"""`ember bench`: ember's MNIST training step against PyTorch, in one process, on the same data.

For each model: ember (compiled step, cold then warm compile timed), PyTorch eager and, when
asked, `torch.compile`, all starting from the same initial weights and fed the same batches
(the first batches of the training set in file order, or seeded random data without --data),
from PyTorch's default initialisation for the seed, as in the reference recipe.
Steps are timed in interleaved rounds (each system runs a block of steps in turn) so that drift
of a shared machine hits every system alike; the figure reported is the median step time, and
ratios are ember's median over the other system's.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from ember.codegen import tuning_db
from ember.frontends import compile as ember_compile
from ember.frontends import nn, optim
from ember.runtime import target_names

from ..training.recipes import MODELS
from ..training.zoo import ZOO, torch_zoo_model, zoo_model



#: A register-bound FMA loop (independent accumulators, no memory traffic) compiled with the flags
#: of every ember step: its rate on all threads is the machine's fp32 FMA peak, the yardstick for
#: kernel times (% of peak). 16-lane zmm FMAs where the compiler targets AVX-512, 8-lane ymm else.
FMA_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#if defined(__AVX512F__)
typedef __m512 vf;
#define VL 16
#define NACC 24
static inline vf fma_(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf set1_(float s) { return _mm512_set1_ps(s); }
static inline float first_(vf v) { return _mm512_cvtss_f32(v); }
#elif defined(__FMA__)
typedef __m256 vf;
#define VL 8
#define NACC 12
static inline vf fma_(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf set1_(float s) { return _mm256_set1_ps(s); }
static inline float first_(vf v) { return _mm256_cvtss_f32(v); }
#else
typedef float vf;
#define VL 1
#define NACC 12
static inline vf fma_(vf a, vf b, vf c) { return a * b + c; }
static inline vf set1_(float s) { return s; }
static inline float first_(vf v) { return v; }
#endif
extern "C" int ember_fma_lanes() { return VL * NACC; }
// Seconds for `iters` rounds of NACC independent vector FMAs on every thread (one region).
extern "C" double ember_fma_loop(long iters, float* sink) {
  double t0 = omp_get_wtime();
#pragma omp parallel
  {
    const vf m = set1_(0.999999f), a = set1_(1e-6f);
    // NACC named accumulators (an array would live on the stack): 12 ymm or 24 zmm registers.
#define EMBER_ACC(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) EMBER_ACC_HI(X)
#if NACC > 12
#define EMBER_ACC_HI(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#else
#define EMBER_ACC_HI(X)
#endif
#define DECL(i) vf a##i = set1_((float)i);
#define STEP(i) a##i = fma_(a##i, m, a);
#define SUM(i) s += first_(a##i);
    EMBER_ACC(DECL)
    for (long it = 0; it < iters; ++it) {
      EMBER_ACC(STEP)
    }
    float s = 0;
    EMBER_ACC(SUM)
    sink[omp_get_thread_num() % 64] = s;
  }
  return omp_get_wtime() - t0;
}
"""


def fma_peak_gflops(threads: int, seconds: float = 0.2, repeats: int = 5) -> float:
    """The machine's measured fp32 FMA peak in GFLOP/s on `threads` OpenMP threads: the best of
    `repeats` runs of FMA_PEAK_SOURCE (compiled like an ember step), 2 FLOP per FMA lane."""
    import ctypes

    from ember.codegen.compiler import compile_cpp
    lib = ctypes.CDLL(str(compile_cpp(FMA_PEAK_SOURCE, name="fma_peak").path))
    lib.ember_fma_loop.restype = ctypes.c_double
    lib.ember_fma_loop.argtypes = [ctypes.c_long, ctypes.c_void_p]
    sink = np.zeros(64, dtype=np.float32)
    lanes = lib.ember_fma_lanes()
    iters = 100_000
    t = lib.ember_fma_loop(iters, sink.ctypes.data)          # warm-up (threads start, clocks rise)
    iters = max(iters, int(iters * seconds / max(t, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        t = lib.ember_fma_loop(iters, sink.ctypes.data)
        best = max(best, 2.0 * lanes * iters * threads / t / 1e9)
    return best


def kernel_flops(graph: Any) -> dict[str, float]:
    """FLOPs of each contraction kernel (by its C name, k<id>_<kind>) of a planned graph: 2 per
    multiply-add; the generated pointwise/reduction kernels are memory-bound and left out."""
    import math
    out: dict[str, float] = {}
    for n in graph.g:
        if graph.op(n) != "fused":
            continue
        spec, sub = graph.attrs(n)["kernel"], graph.attrs(n)["graph"]
        if spec.kind not in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight", "matmul"):
            continue
        core = spec.core
        a_t, b_t = (sub.type(o) for o in sub.operands(core))
        if spec.kind == "matmul":
            k = a_t.shape[-1]
            flops = 2.0 * sub.type(core).numel * k
        elif spec.kind == "conv2d":
            o, c, kh, kw = b_t.shape
            flops = 2.0 * sub.type(core).numel * c * kh * kw
        elif spec.kind == "conv2d_grad_input":
            flops = 2.0 * a_t.numel * math.prod(b_t.shape[1:])  # dy elements x C*KH*KW
        else:  # grad_weight: dw numel * N*HO*WO
            flops = 2.0 * sub.type(core).numel * (b_t.numel // b_t.shape[1])
        out[f"k{n}_{spec.kind}"] = flops
    return out


def _input_shape(model: str) -> tuple[int, ...]:
    return ZOO[model].input_shape


@dataclass
class SystemResult:
    system: str
    step_ms: list[float] = field(default_factory=list)
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    peak_bytes: int | None = None
    note: str = ""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.step_ms, q)) if self.step_ms else float("nan")


def _batches(model: str, batch: int, count: int, data: str | None, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    shape = _input_shape(model)
    if data:
        from ember.runtime.data import load_mnist
        x, y = load_mnist(data, "train", flat=ZOO[model].flat)
        x, y = x[: batch * count], y[: batch * count]
    else:
        rng = np.random.default_rng(seed)
        x = rng.random((batch * count, *shape), dtype=np.float32)
        y = rng.integers(0, 10, batch * count)
    x = x.reshape(-1, *shape)
    return [(np.ascontiguousarray(x[i * batch:(i + 1) * batch]), np.ascontiguousarray(y[i * batch:(i + 1) * batch]))
            for i in range(len(x) // batch)]


def _ember(model_name: str, device: str, init: dict[str, np.ndarray], example: tuple[np.ndarray, np.ndarray],
           lr: float, profile: bool = False,
           precision: str = "float32") -> tuple[Callable[[np.ndarray, np.ndarray], Any], SystemResult]:
    res = SystemResult(f"ember-{device}")
    previous = os.environ.get("EMBER_CACHE_DIR")
    # the user's tuning database lives under their cache folder: chosen before the cache moves, or
    # a step tuned with `ember tune` would be timed with the cost model's kernels
    tuned = tuning_db.active()
    with tempfile.TemporaryDirectory(prefix="ember-bench-cache-") as cache, tuning_db.using(tuned):
        os.environ["EMBER_CACHE_DIR"] = cache  # an empty compile cache: the first compile is cold
        try:
            for attempt in ("cold", "warm"):
                model = zoo_model(model_name)
                model.load_state_dict(init)
                t0 = time.perf_counter()
                step = ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=lr), example_inputs=example, device=device,
                                     profile=profile, precision=precision)
                elapsed = time.perf_counter() - t0
                setattr(res, f"compile_{attempt}_s", elapsed)
        finally:
            if previous is None:
                os.environ.pop("EMBER_CACHE_DIR", None)
            else:
                os.environ["EMBER_CACHE_DIR"] = previous
    res.peak_bytes = step.peak_bytes
    return step, res


def _torch(model_name: str, init: dict[str, np.ndarray], lr: float, compiled: bool, threads: int,
           precision: str = "float32"):
    import torch
    import torch.nn.functional as tF
    torch.set_num_threads(threads)
    model = torch_zoo_model(model_name)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def loss_fn(x, y):
        # bf16: the forward under autocast, as ember's precision="bf16" (the same op lists)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return tF.cross_entropy(model(x), y)

    fwd, opt_step = loss_fn, opt.step
    res = SystemResult("torch-compile" if compiled else "torch-eager")
    if compiled:
        fwd = torch.compile(loss_fn, dynamic=False)
        opt_step = torch.compile(opt.step, dynamic=False)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = fwd(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        opt_step()
        return loss.detach()  # read with float() each step: a tensor that requires grad warns there

    return step, res


def run_bench(models: list[str], device: str = "cpu", steps: int = 200, warmup: int = 10, batch: int | None = 64,
              lr: float = 0.05, threads: int | None = None, data: str | None = None, torch_compile: bool = True,
              rounds: int = 4, seed: int = 0, profile: bool = False, precision: str = "float32",
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    if threads and threads > cores:
        # threads beyond the cores time-share them: the step times measure the oversubscription, and
        # a peak measured on them is below the machine's (kernels showed 185% of it)
        log(f"ember bench: warning: --threads {threads} exceeds the {cores} cores of this machine; the timings "
            f"include threads waiting for a core, and % of peak is taken against the peak of {cores} threads")
    threads = threads or cores
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # Threads must not spin between blocks: ember's team and PyTorch's share one libgomp in this
    # process (PyTorch's bundled libgomp.so.1 is loaded first and ember's steps bind to it), and
    # after each block its workers would otherwise busy-wait (GOMP's default ~300k spins) while
    # the other system runs. A short spin keeps the barriers inside a step cheap. Only effective
    # when set before libgomp loads (i.e. before `import torch`); the report records the values.
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    os.environ.setdefault("OMP_WAIT_POLICY", "active" if os.environ["GOMP_SPINCOUNT"] != "0" else "passive")
    report: dict[str, Any] = {"device": device, "precision": precision, "threads": threads,
                              "batch": batch or "per model", "steps": steps,
                              "models": {},
                              "omp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND")}}
    if device == "cpu":
        from ember.codegen.cpu_vector import resolve
        report["cpu_vector"] = resolve().name   # the kernels' vector variant ($EMBER_CPU_VECTOR or native)
        report["fma_peak_gflops"] = fma_peak_gflops(min(threads, cores))
        log(f"measured fp32 FMA peak on {min(threads, cores)} thread(s): {report['fma_peak_gflops']:.1f} GFLOP/s; "
            f"ember's CPU kernels: {report['cpu_vector']}")
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
        log("PyTorch is not importable: timing ember alone (pip install 'ember[torch]' to compare)")
    for name in models:
        model_batch = batch or ZOO[name].batch_size  # None: the zoo's batch size for the model
        batches = _batches(name, model_batch, 16, data, seed)
        init = zoo_model(name, seed).state_dict()  # PyTorch's initialisation (the reference recipe's weights)
        log(f"[{name}] compiling ember ...")
        systems: list[tuple[Callable, SystemResult]] = [_ember(name, device, init, batches[0], lr, profile, precision)]
        if have_torch:
            systems.append(_torch(name, init, lr, False, threads, precision))
            if torch_compile:
                try:
                    log(f"[{name}] torch.compile ...")
                    fn, res = _torch(name, init, lr, True, threads, precision)
                    t0 = time.perf_counter()
                    fn(*batches[0])
                    res.compile_cold_s = time.perf_counter() - t0
                    systems.append((fn, res))
                except Exception as e:  # inductor needs a working toolchain; report, don't die
                    log(f"[{name}] torch.compile failed: {type(e).__name__}: {e}")
        for fn, _ in systems:  # warm-up, untimed
            for i in range(warmup):
                fn(*batches[i % len(batches)])
        per_round = max(1, -(-steps // rounds))
        for r in range(rounds):
            for fn, res in systems:
                time.sleep(0.05)  # the previous system's threads have gone to sleep (short spin)
                for i in range(per_round):
                    x, y = batches[(r * per_round + i) % len(batches)]
                    t0 = time.perf_counter()
                    out = fn(x, y)
                    float(out)  # the loss is read every step, as a training loop would
                    res.step_ms.append((time.perf_counter() - t0) * 1e3)
        if profile:
            step = systems[0][0]
            calls = warmup + rounds * per_round
            flops = kernel_flops(step.train_graph)
            peak = report.get("fma_peak_gflops")
            rows_k = []
            for k, what, sec in step.kernel_times():
                ms = sec / calls * 1e3
                row = {"kernel": k, "implements": what, "ms_per_step": ms}
                if k in flops and ms > 0:
                    row["gflops"] = flops[k] / (ms * 1e6)
                    if peak:
                        row["pct_of_peak"] = 100.0 * row["gflops"] / peak
                rows_k.append(row)
            report.setdefault("kernels", {})[name] = rows_k
        ember_ms = systems[0][1].median_ms
        rows = []
        for _, res in systems:
            row = {k: v for k, v in asdict(res).items() if k != "step_ms"}
            row.update(batch=model_batch, median_ms=res.median_ms, p10_ms=res.quantile(0.1), p90_ms=res.quantile(0.9),
                       timed_steps=len(res.step_ms),
                       ember_over_this=ember_ms / res.median_ms if res.median_ms else None)
            rows.append(row)
        report["models"][name] = rows
    return report


def format_table(report: dict[str, Any]) -> str:
    peak = report.get("fma_peak_gflops")
    lines = [f"device={report['device']} precision={report.get('precision', 'float32')} threads={report['threads']} batch={report['batch']} steps/system={report['steps']}"
             + (f" fma_peak={peak:.1f} GFLOP/s" if peak else "")
             + (f" cpu_vector={report['cpu_vector']}" if report.get("cpu_vector") else "") + f" omp={report.get('omp')}",
             f"{'model':9} {'system':14} {'median ms':>10} {'p10':>8} {'p90':>8} {'ember/this':>10} {'compile cold':>12} {'warm':>7} {'peak MiB':>9}"]
    for model, rows in report["models"].items():
        for r in rows:
            cold = f"{r['compile_cold_s']:.2f}s" if r["compile_cold_s"] is not None else "-"
            warm = f"{r['compile_warm_s']:.2f}s" if r["compile_warm_s"] is not None else "-"
            peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] else "-"
            lines.append(f"{model:9} {r['system']:14} {r['median_ms']:10.3f} {r['p10_ms']:8.3f} {r['p90_ms']:8.3f} "
                         f"{r['ember_over_this']:10.3f} {cold:>12} {warm:>7} {peak:>9}")
    for model, kernels in report.get("kernels", {}).items():
        total = sum(k["ms_per_step"] for k in kernels)
        lines.append(f"\n{model}: ember kernels by time (profiled build; {total:.3f} ms per step in kernels)")
        for k in sorted(kernels, key=lambda k: -k["ms_per_step"]):
            eff = f"{k['gflops']:7.1f} GF/s {k['pct_of_peak']:5.1f}% peak" if "pct_of_peak" in k else " " * 24
            lines.append(f"  {k['kernel']:26} {k['ms_per_step']:8.3f} ms {100 * k['ms_per_step'] / total:5.1f}% {eff}  {k['implements']}")
    return "\n".join(lines)


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default="cnn,mlp", metavar="M[,M...]|all",
                   help=f"models to time, comma-separated: the recipes ({', '.join(MODELS)}; all: each of them) "
                        f"or zoo models ({', '.join(m for m in ZOO if m not in MODELS)}; defined in PyTorch)")
    p.add_argument("--zoo", action="store_true", help="time every model of the zoo (instead of --model)")
    p.add_argument("--device", default="cpu", metavar="{" + ",".join(target_names()) + "}[:N]")
    p.add_argument("--steps", type=int, default=200, help="timed steps per system (default 200)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per system first")
    p.add_argument("--batch-size", type=int, default=None,
                   help="default: each model's batch size in the zoo, 64 (cuda: 64 and 1024)")
    p.add_argument("--tf32", action="store_true", help="cuda: TF32 tensor cores for ember (precision='tf32') and PyTorch (allow_tf32) alike")
    p.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision for ember (precision='bf16') and PyTorch "
                                                       "(torch.autocast) alike")
    p.add_argument("--threads", type=int, default=None, help="threads for every system (default: all cores)")
    p.add_argument("--data", default=None, help="MNIST folder: time on its first batches (default: seeded random data)")
    p.add_argument("--no-torch-compile", action="store_true", help="cpu: skip torch.compile (its compile takes a while)")
    p.add_argument("--max-autotune", action="store_true",
                   help="cuda: also time torch.compile(mode='max-autotune') (minutes of tuning per model and batch size)")
    p.add_argument("--profile", action="store_true",
                   help="time every ember kernel and list them (cpu: a build with timers around each kernel; cuda: "
                        "each kernel alone and the step's graph without it)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: Any) -> int:
    from .cli_checks import check_device, precision_flag
    check_device(args.device)
    precision = precision_flag(args)  # the CPU timing has no TF32 mode: a run would ignore the flag
    from .cli_checks import UsageError, check_torch_for, selected_models
    models = selected_models(args.model, args.zoo)
    unknown = [m for m in models if m not in ZOO]
    if unknown or not models:
        raise UsageError(f"--model {args.model}: expected model names from {', '.join(ZOO)} "
                         f"(comma-separated) or all")
    check_torch_for(models)
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--batch-size", args.batch_size, 1), ("--threads", args.threads, 1)):
        if value is not None and value < least:  # (0 once meant "the default" for some of these, silently)
            raise UsageError(f"{flag} {value}: expected an integer >= {least}")
    if args.max_autotune and args.device.partition(":")[0] != "cuda":
        raise UsageError(f"--max-autotune: expected --device cuda (on {args.device} the bench times "
                         "torch.compile's default mode, unless --no-torch-compile)")
    if args.device.partition(":")[0] == "cuda":
        from .bench_cuda import format_cuda_report, run_cuda_bench
        batches = [args.batch_size] if args.batch_size else [64, 1024]
        report = run_cuda_bench(models, batches, steps=args.steps, tf32=args.tf32, bf16=precision == "bf16",
                                profile=args.profile, max_autotune=args.max_autotune,
                                log=lambda s: print(s, file=sys.stderr))
        print(json.dumps(report, indent=1) if args.json else format_cuda_report(report))
        return 0
    report = run_bench(models, device=args.device, steps=args.steps, warmup=args.warmup, batch=args.batch_size,
                       threads=args.threads, data=args.data, torch_compile=not args.no_torch_compile, profile=args.profile,
                       precision=precision)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
