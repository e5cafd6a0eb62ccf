"""How fast NVRTC compiles a model's CUDA units in one process and in several (a diagnostic, not a
test; on a GPU machine): every unit of the model's training step compiled with no cache, one by
one, on 2/4/8 threads, and on worker processes (spawned, importing only CuPy's NVRTC binding;
their start timed apart). This is what chose two threads and opt-in workers for
`runtime/cuda_modules.load_modules` (docs/benchmarks.md, session 12).

    python tools/nvrtc_throughput.py [resnet8|cnn|mlp|zoo:NAME] [batch]
    python tools/nvrtc_throughput.py resnet8 7 --groups     # the units one a module, or G a module

With --groups: NVRTC's cost of a module with the prelude alone (its fixed cost), then the units
compiled one after another as one module each and concatenated into G modules (G = 1, 2, 4, 8),
so whether building fewer, larger modules would pay.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import sys
import time

OPTS = ["-std=c++17", "-arch=sm_90", "-ftz=true", "--device-as-default-execution-space"]


def build(job: tuple[int, str, str]) -> float:
    from cupy_backends.cuda.libs import nvrtc
    i, source, tag = job
    program = nvrtc.createProgram(source + f"\n// {tag} {i} {time.time()}\n", f"u{i}.cu", (), ())  # never cached
    t = time.perf_counter()
    nvrtc.compileProgram(program, OPTS)
    nvrtc.getCUBIN(program)
    nvrtc.destroyProgram(program)
    return time.perf_counter() - t


def up(_: int) -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc.getVersion()


def units(model: str, batch: int) -> tuple[list[str], str]:
    import numpy as np
    from ember.frontends import nn, optim
    from ember.frontends.compile import plan
    from ember.frontends.training.recipes import MODELS, build_model
    from ember.frontends.training.zoo import ZOO, ember_zoo_model
    from ember.runtime.cuda import render_step
    if model.startswith("zoo:"):
        shape, m = ZOO[model[4:]].input_shape, ember_zoo_model(model[4:], seed=0)
    else:
        shape, m = ((784,) if MODELS[model][1] else (1, 28, 28)), build_model(model)
    example = (np.zeros((batch, *shape), np.float32), np.zeros(batch, np.int64))
    graph = next(iter(plan(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda").values()))
    source = render_step(graph)
    return [source.prelude + code for code, _ in source.units], source.prelude


def groups(sources: list[str], prelude: str) -> None:
    bodies = [s[len(prelude):] for s in sources]
    for job in [(i, s, "warm") for i, s in enumerate(sources)][:8]:
        build(job)
    fixed = sorted(build((i, prelude, "prelude")) for i in range(5))[2]
    print(f"prelude alone  median {fixed * 1e3:.1f} ms")
    t = time.perf_counter()
    per = [build((i, s, "one")) for i, s in enumerate(sources)]
    print(f"one a module   wall {time.perf_counter() - t:.3f} s, {len(sources)} modules, median {sorted(per)[len(per) // 2] * 1e3:.1f} ms")
    for g in (1, 2, 4, 8):
        chunks = [prelude + "".join(bodies[i::g]) for i in range(g)]
        t = time.perf_counter()
        per = [build((i, c, f"g{g}")) for i, c in enumerate(chunks)]
        print(f"{g} modules      wall {time.perf_counter() - t:.3f} s, largest {max(per) * 1e3:.1f} ms")


def main() -> None:
    import cupy as cp
    cp.cuda.runtime.free(0)  # a CUDA context, as a compiling step has
    OPTS[1] = f"-arch=sm_{cp.cuda.Device().compute_capability}"
    args = [a for a in sys.argv[1:] if a != "--groups"]
    sources, prelude = units(args[0] if args else "resnet8", int(args[1]) if len(args) > 1 else 64)
    if "--groups" in sys.argv:
        groups(sources, prelude)
        return
    jobs = lambda tag: [(i, s, tag) for i, s in enumerate(sources)]  # noqa: E731
    for job in jobs("warm")[:8]:
        build(job)  # NVRTC's first compiles in a process are slow: keep them out of the figures
    mid = len(sources) // 2
    t = time.perf_counter()
    per = [build(j) for j in jobs("serial")]
    print(f"serial      wall {time.perf_counter() - t:.3f} s, median {sorted(per)[mid] * 1e3:.1f} ms, {len(sources)} units")
    for n in (2, 4, 8):
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            t = time.perf_counter()
            per = list(pool.map(build, jobs(f"t{n}")))
        print(f"threads {n:2d} wall {time.perf_counter() - t:.3f} s, median {sorted(per)[mid] * 1e3:.1f} ms")
    for n in (4, 8):
        t0 = time.perf_counter()
        with concurrent.futures.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(up, range(n)))
            t1 = time.perf_counter()
            per = list(pool.map(build, jobs(f"p{n}"), chunksize=2))
            t2 = time.perf_counter()
        print(f"procs   {n:2d} start {t1 - t0:.3f} s, compiles wall {t2 - t1:.3f} s, median {sorted(per)[mid] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
