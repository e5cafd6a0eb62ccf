"""Compile time of the recipe and zoo models, cold (an empty cache) and warm, and for a new batch size.

    python tools/compile_time.py --device cpu --models cnn resnet8
    python tools/compile_time.py --device cpu --zoo --json out.json   # every zoo model (PyTorch needed)
    python tools/compile_time.py --device cuda --models cnn resnet8 --json out.json

Each measurement runs in a fresh process (imports and the compiler's in-process caches do not
carry over), with `EMBER_CACHE_DIR` pointing at a new folder for "cold" and at the same folder
again for "warm"; "new batch" compiles the training step for another batch size in the warm
process (whose cache holds the first one), as the last partial batch of an epoch does. Wall seconds
of `compile()` and `precompile()` alone (the data is random); a zoo model is imported from PyTorch
before the clock starts.

    python tools/compile_time.py --device cuda --zoo --trained 3   # the cold process trains 3 steps too
    python tools/compile_time.py --device cuda --models resnet8 --inference 7   # and inference at 7 after 64
    python tools/compile_time.py --device cuda --models resnet8 --right-after 32  # the trainer's last partial batch

By default the cold process only compiles, so on CUDA the warm process's new batch builds every
module on run-time sizes itself (what a `precompile` for another size costs where no step of the
model ever ran); with `--trained` the cold process runs steps after its compile, as a training run
does, and what the first steps build ahead is in the cache the new batch finds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
import numpy as np
from ember.frontends import compile, nn, optim
from ember.frontends.training.recipes import MODELS, build_model
from ember.frontends.training.zoo import ZOO, ember_zoo_model
name, device, batch, second, trained = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
inference_batch, right_after = int(sys.argv[6]), int(sys.argv[7])
if name.startswith("zoo:"):
    entry = ZOO[name[4:]]
    shape, model = entry.input_shape, ember_zoo_model(entry.name, seed=0)
else:
    shape, model = ((784,) if MODELS[name][1] else (1, 28, 28)), build_model(name)
x = np.zeros((batch, *shape), np.float32)
y = np.zeros(batch, np.int64)
device_init = None
if device.startswith("cuda"):  # the CUDA context, which any CUDA program pays once, timed apart
    t = time.perf_counter()
    import cupy
    cupy.zeros(1).sum().get()
    device_init = time.perf_counter() - t
profile_to = os.environ.get("EMBER_COMPILE_TIME_PROFILE")
if profile_to:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
t = time.perf_counter()
step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device=device)
first = time.perf_counter() - t
from ember.codegen import compiler


def modules_built_since(before):
    now = compiler.cache_stats("nvrtc")
    return sum(now[k] - before[k] for k in ("misses", "rebuilds"))


right_after_compile = None
if right_after:  # the trainer's path: the last partial batch's step compiled at once, before any step
    before = compiler.cache_stats("nvrtc")
    t = time.perf_counter()
    step.precompile((right_after, *shape))
    right_after_compile = {"s": time.perf_counter() - t, "modules_built": modules_built_since(before)}
for _ in range(trained):  # training steps after the compile, off the clock (what a training run leaves in the cache)
    step(x, y)
if trained and device.startswith("cuda"):  # a training run outlasts the build ahead its first steps start
    from ember.runtime.cuda import wait_for_builds_ahead
    wait_for_builds_ahead()
again = None
modules_built = None
if second:
    before = compiler.cache_stats("nvrtc")
    t = time.perf_counter()
    step.precompile((second, *shape))
    again = time.perf_counter() - t
    modules_built = modules_built_since(before)
inference = None
if inference_batch:
    # inference at the first batch size a few times (its graph captured: its build ahead starts),
    # then at another size, as an evaluation loop with a last partial batch does
    model.eval()
    for _ in range(3):
        step.inference(x)
    if device.startswith("cuda"):
        from ember.runtime.cuda import wait_for_builds_ahead
        wait_for_builds_ahead()
    before = compiler.cache_stats("nvrtc")
    t = time.perf_counter()
    step.inference(np.zeros((inference_batch, *shape), np.float32))
    inference = {"s": time.perf_counter() - t, "modules_built": modules_built_since(before)}
if profile_to:
    import io, pstats
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with open(profile_to, "w") as f:
        f.write(text.getvalue())
stats = getattr(step, "compile_stats", None)
later = [s for k, s in step.all_compile_stats.items() if second and k.startswith(f"{second}x")] \
    if hasattr(step, "all_compile_stats") else []
print(json.dumps({"compile_s": first, "device_init_s": device_init, "new_batch_s": again, "modules_built": modules_built,
                  "inference": inference, "right_after_compile": right_after_compile, "stats": stats if isinstance(stats, dict) else None,
                  "new_batch_stats": later[0] if later else None}))
"""


def _run(model: str, device: str, batch: int, cache: str, second: int = 0, profile_to: str = "",
         trained: int = 0, inference_batch: int = 0, right_after: int = 0) -> dict:
    # CuPy's own cache too, for any CuPy kernel the run uses (ember's modules are under <cache>/nvrtc)
    env = dict(os.environ, EMBER_CACHE_DIR=cache, CUPY_CACHE_DIR=os.path.join(cache, "cupy"))
    if profile_to:
        env["EMBER_COMPILE_TIME_PROFILE"] = profile_to
    out = subprocess.run([sys.executable, "-c", CHILD, model, device, str(batch), str(second), str(trained), str(inference_batch),
                          str(right_after)], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{model} on {device} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", default=["cnn", "mlp", "lenet5", "resnet8"],
                   help="recipe models, or zoo models as zoo:NAME")
    p.add_argument("--zoo", action="store_true", help="every zoo model (at its benchmark batch size), not --models")
    p.add_argument("--batch", type=int, default=64, help="the first batch size of the recipe models")
    p.add_argument("--new-batch", type=int, default=7, help="the batch size compiled after a warm start")
    p.add_argument("--trained", type=int, default=0, metavar="STEPS",
                   help="the cold process also runs this many training steps after its compile, off the clock, as a "
                        "training run would before a later process starts (on CUDA the second one starts building "
                        "what another batch size will ask for; the process waits for that build at exit)")
    p.add_argument("--inference", type=int, default=0, metavar="BATCH",
                   help="also, in the warm process after the new batch: the model in eval mode, inference at the "
                        "first batch size three times (waiting for its build ahead on CUDA), then at this batch "
                        "size, timed (the modules it built counted)")
    p.add_argument("--right-after", type=int, default=0, metavar="BATCH",
                   help="also, in the cold process right after its compile (before any step): the training step at "
                        "this batch size, timed, as the trainer compiles the last partial batch's (the modules it "
                        "built counted); the warm process's new batch then finds them if it is the same size")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--cprofile", default=None, metavar="DIR",
                   help="write a cProfile summary of each cold and warm (+ new batch) run to DIR/MODEL_{cold,warm}.txt")
    args = p.parse_args()
    if args.zoo:
        from ember.frontends.training.zoo import ZOO
        models = [(f"zoo:{m.name}", m.batch_size) for m in ZOO.values()]
    else:
        from ember.frontends.training.recipes import MODELS
        from ember.frontends.training.zoo import ZOO
        for m in args.models:  # before any child process: a wrong name is one line, not a child's traceback
            if m not in MODELS and not (m.startswith("zoo:") and m[4:] in ZOO):
                hint = f" (a zoo model: zoo:{m})" if m in ZOO else ""
                raise SystemExit(f"compile_time: unknown model {m!r}{hint}; recipes: {', '.join(MODELS)}; "
                                 f"zoo models as zoo:NAME ({', '.join(ZOO)})")
        models = [(m, args.batch) for m in args.models]
    rows = []
    for model, batch in models:
        with tempfile.TemporaryDirectory(prefix="ember-compile-time-") as cache:
            t = time.perf_counter()
            profile = (lambda run: os.path.join(args.cprofile, f"{model.replace(':', '_')}_{run}.txt")) \
                if args.cprofile else (lambda run: "")
            cold = _run(model, args.device, batch, cache, profile_to=profile("cold"), trained=args.trained,
                        right_after=args.right_after)
            cold_wall = time.perf_counter() - t
            warm = _run(model, args.device, batch, cache, second=args.new_batch, profile_to=profile("warm"),
                        inference_batch=args.inference)
        row = {"model": model, "device": args.device, "batch": batch, "trained": args.trained,
               "cold_s": round(cold["compile_s"], 3),
               "cold_process_s": round(cold_wall, 3), "warm_s": round(warm["compile_s"], 3),
               "new_batch": args.new_batch, "new_batch_s": round(warm["new_batch_s"], 3), "cold_stats": cold["stats"], "warm_stats": warm["stats"],
               "new_batch_stats": warm["new_batch_stats"], "new_batch_modules_built": warm["modules_built"],
               "inference": warm["inference"], "right_after_compile": cold["right_after_compile"],
               "device_init_s": warm["device_init_s"]}
        rows.append(row)
        nb = warm["new_batch_stats"] or {}
        built = f" ({nb['objects_built']} objects built)" if "objects_built" in nb else \
            f" ({warm['modules_built']} modules built)" if args.device.startswith("cuda") else ""
        print(f"{model:12s} {args.device:5s} batch {batch:4d}: cold {row['cold_s']:7.2f} s  warm {row['warm_s']:6.2f} s  "
              f"batch {args.new_batch} after warm{' (cold trained)' if args.trained else ''} {row['new_batch_s']:6.2f} s{built}"
              + (f"  (device init {row['device_init_s']:.2f} s apart)" if row["device_init_s"] is not None else "")
              + (f"  inference at {args.inference} {warm['inference']['s']:.2f} s"
                 + (f" ({warm['inference']['modules_built']} modules built)" if args.device.startswith("cuda") else "")
                 if warm["inference"] else "")
              + (f"  batch {args.right_after} right after the cold compile {cold['right_after_compile']['s']:.2f} s"
                 + (f" ({cold['right_after_compile']['modules_built']} modules built)" if args.device.startswith("cuda") else "")
                 if cold["right_after_compile"] else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
