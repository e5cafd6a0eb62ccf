"""Where a compile's time goes, cold, warm and for a new batch size, part by part (a diagnostic,
not a test): the trace, the plan cache's key and load, every pass, the CUDA module builds
(`compile_units`), and on CUDA the context start and the imports timed apart, the modules loaded
again in the warm process (what a second load costs), the first two steps, and how many NVRTC
modules each compile added to ember's module cache (`<cache>/nvrtc`). Each model runs in fresh processes on an empty cache (cold), then on that
cache (warm, then batch 7 in the same process).

    python tools/compile_breakdown.py mlp,cnn,resnet8,zoo:vit [out.json]     # on a GPU machine
    DIAG_DEVICE=cpu python tools/compile_breakdown.py mlp,resnet8            # the CPU target
    DIAG_SETTLE_S=2 python tools/compile_breakdown.py resnet8   # the new batch 2 s after the warm steps
    DIAG_WARMUP=0 python tools/compile_breakdown.py resnet8     # no unreported warm-up compile first
    EMBER_NVRTC_WARM=1 python tools/compile_breakdown.py resnet8  # this process's first NVRTC call made early
"""
import collections, json, os, subprocess, sys, tempfile, time, timeit

CHILD = r'''
import collections, json, os, sys, time
t_import = time.perf_counter()
import numpy as np
from ember.frontends import compile, nn, optim
from ember.frontends.training.recipes import MODELS, build_model
from ember.frontends.training.zoo import ZOO, ember_zoo_model
import ember.frontends.compile as _c
C = sys.modules["ember.frontends.compile"]
import ember.runtime.cuda as rc
from ember.frontends import plan_cache
t_import = time.perf_counter() - t_import
name, batch, second = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times = collections.defaultdict(float)
def wrap(mod, attr, label):
    f = getattr(mod, attr)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: times[label] += time.perf_counter() - t
    setattr(mod, attr, w)
wrap(plan_cache, "load", "plan_load"); wrap(plan_cache, "step_key", "step_key"); wrap(plan_cache, "store", "plan_store")
wrap(rc, "compile_units", "compile_units"); wrap(C, "trace", "trace")
orig_rp = C.run_passes
def rp(graph, passes, **kw):
    timed = []
    for pname, fn in passes:
        def t(g, fn=fn, pname=pname):
            s = time.perf_counter(); r = fn(g); times["pass:" + pname] += time.perf_counter() - s; return r
        timed.append((pname, t))
    s = time.perf_counter(); r = orig_rp(graph, timed, **kw); times["run_passes"] += time.perf_counter() - s
    return r
C.run_passes = rp
DEV = os.environ.get("DIAG_DEVICE", "cuda")
init = 0.0
if DEV == "cuda":
    import cupy
    # the context alone: no CuPy kernel (its first one would run NVRTC, which ember's own steps avoid)
    t = time.perf_counter(); cupy.empty(1); cupy.cuda.runtime.deviceSynchronize(); init = time.perf_counter() - t
    from ember.runtime import cuda_modules
    t = time.perf_counter(); cuda_modules.nvrtc_version(cupy); nvrtc_load = time.perf_counter() - t
if name.startswith("zoo:"):
    e = ZOO[name[4:]]; shape, model = e.input_shape, ember_zoo_model(e.name, seed=0)
else:
    shape, model = ((784,) if MODELS[name][1] else (1, 28, 28)), build_model(name)
x = np.zeros((batch, *shape), np.float32); y = np.zeros(batch, np.int64)
cache = os.path.join(os.environ["EMBER_CACHE_DIR"], "nvrtc")
count = lambda: sum(f.endswith(".json") for _, _, fs in os.walk(cache) for f in fs) if os.path.isdir(cache) else 0
cupy_dir = os.environ["CUPY_CACHE_DIR"]
cupy_files = lambda: sum(len(fs) for _, _, fs in os.walk(cupy_dir)) if os.path.isdir(cupy_dir) else 0
n0 = count()
t = time.perf_counter()
step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device=DEV)
first = time.perf_counter() - t
out = {"import_s": t_import, "init_s": init, "compile_s": first, "parts": dict(times), "modules_added": count() - n0,
       "stats": step.compile_stats}
for i in range(2):  # the first call runs the launches, the second captures the graph
    t = time.perf_counter(); step(x, y)
    if DEV == "cuda": cupy.cuda.runtime.deviceSynchronize()
    out[f"step{i + 1}_s"] = time.perf_counter() - t
if DEV == "cuda": out["nvrtc_version_s"] = nvrtc_load
out["cupy_kernels_compiled"] = cupy_files()  # CuPy's own kernels (each one NVRTC run the first time)
if DEV == "cuda":  # what loading the step's modules costs, one after another, from the warm cache
    ex = step._example_step()[1]
    opts = ("-std=c++17", f"-arch={ex.arch}")
    t = time.perf_counter(); per = []
    for code, fns in ex.source.units:
        s0 = time.perf_counter(); m = cuda_modules.load_module(cupy, ex.source.prelude + code, opts)
        s1 = time.perf_counter(); m.get_function(fns[0]); per.append((s1 - s0, time.perf_counter() - s1))
    out["serial_load_s"] = time.perf_counter() - t
    out["serial_load_units"] = len(per)
    out["serial_get_function_ms_median"] = sorted(b for _, b in per)[len(per) // 2] * 1e3
    t = time.perf_counter(); rc.compile_units(cupy, ex.source.prelude, ex.source.units, opts); out["parallel_load_s"] = time.perf_counter() - t
if second:
    time.sleep(float(os.environ.get("DIAG_SETTLE_S", "0")))  # the training a later batch size comes after
    times.clear(); n0 = count()
    t = time.perf_counter(); step.precompile((second, *shape)); out["new_batch_s"] = time.perf_counter() - t
    out["new_parts"] = dict(times); out["new_modules_added"] = count() - n0
    out["new_stats"] = [s for k, s in step.all_compile_stats.items() if k.startswith(f"{second}x")][0]
print("JSON" + json.dumps(out))
'''

def run(name, batch, cache, second=0):
    env = dict(os.environ, EMBER_CACHE_DIR=cache, CUPY_CACHE_DIR=os.path.join(cache, "cupy"))
    p = subprocess.run([sys.executable, "-c", CHILD, name, str(batch), str(second)], env=env, capture_output=True, text=True)
    if p.returncode: print(p.stderr[-3000:]); return None
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("JSON")][-1][4:])

def main():
    import networkx as nx
    from networkx.utils import backends
    print("networkx", nx.__version__, "backends:", sorted(getattr(backends, "backends", {})), nx.config)
    print("MultiDiGraph() us", timeit.timeit(lambda: nx.MultiDiGraph(), number=2000) / 2000 * 1e6)
    g = nx.DiGraph([(0, 1), (1, 2)])
    print("lexsort call us", timeit.timeit(lambda: list(nx.lexicographical_topological_sort(g)), number=2000) / 2000 * 1e6,
          "orig", timeit.timeit(lambda: list(nx.lexicographical_topological_sort.orig_func(g)), number=2000) / 2000 * 1e6)
    rows = {}
    if os.environ.get("DIAG_WARMUP", "1") != "0":
        # the first compile-heavy process on a fresh machine is slow throughout (its cold NVRTC
        # work 1.3-1.7 s where later ones take 0.15-0.5 on the H200's host, docs/benchmarks.md
        # session 21): one unreported cold compile first
        with tempfile.TemporaryDirectory() as cache:
            run(sys.argv[1].split(",")[0], 64, cache)
    for name in sys.argv[1].split(","):
        with tempfile.TemporaryDirectory() as cache:
            cold = run(name, 64, cache)
            warm = run(name, 64, cache, second=7)
        rows[name] = {"cold": cold, "warm": warm}
        r = lambda d: {k: round(v, 3) for k, v in d.items()} if d else d
        print(f"== {name}: cold {cold and round(cold['compile_s'], 3)} steps {cold and round(cold['step1_s'], 3)} parts {r(cold and cold['parts'])}")
        if warm:
            print(f"   loads: serial {warm.get('serial_load_s', 0):.3f} s for {warm.get('serial_load_units')} units "
                  f"(get_function median {warm.get('serial_get_function_ms_median', 0):.2f} ms), parallel {warm.get('parallel_load_s', 0):.3f} s")
            print(f"   warm {round(warm['compile_s'], 3)} import {round(warm['import_s'], 2)} init {round(warm['init_s'], 2)} parts {r(warm['parts'])} modules+ {warm['modules_added']} nvrtc_version {warm.get('nvrtc_version_s', 0):.3f} steps {warm['step1_s']:.3f} {warm['step2_s']:.3f} cupy files {warm['cupy_kernels_compiled']}")
            print(f"   new batch {round(warm['new_batch_s'], 3)} parts {r(warm['new_parts'])} modules+ {warm['new_modules_added']} stats {warm['new_stats']}")
    if len(sys.argv) > 2:
        json.dump(rows, open(sys.argv[2], "w"), indent=1)

main()
