"""Compile times of later batch sizes on CUDA: in a fresh process on an empty cache the training
step at 64, then `precompile` at 7, 13, 50 and `inference` at 512 and 100; then a second process
on that cache: 64, 29 (a size it never saw) and inference at 33. Seconds and NVRTC modules built
for each (a diagnostic, not a test; needs a GPU).

    python tools/batch_sizes.py resnet8,cnn,zoo:vit
"""
import json, os, subprocess, sys, tempfile
CHILD = r'''
import os, sys, time, json
import numpy as np
from ember.frontends import compile, nn, optim
from ember.frontends.training.recipes import MODELS, build_model
from ember.frontends.training.zoo import ZOO, ember_zoo_model
name, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
if name.startswith("zoo:"):
    e = ZOO[name[4:]]; shape, model = e.input_shape, ember_zoo_model(e.name, seed=0)
else:
    shape, model = ((784,) if MODELS[name][1] else (1, 28, 28)), build_model(name)
cache = os.path.join(os.environ["EMBER_CACHE_DIR"], "nvrtc")
count = lambda: sum(f.endswith(".json") for _, _, fs in os.walk(cache) for f in fs) if os.path.isdir(cache) else 0
import cupy; cupy.empty(1)
rows = []
x = np.zeros((sizes[0], *shape), np.float32); y = np.zeros(sizes[0], np.int64)
n0 = count(); t = time.perf_counter()
step = compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y), device="cuda")
rows.append(("train", sizes[0], round(time.perf_counter() - t, 3), count() - n0))
for s in sizes[1:]:
    n0 = count(); t = time.perf_counter()
    if s < 0:
        step.inference(np.zeros((-s, *shape), np.float32)); kind = "inference"
    else:
        step.precompile((s, *shape)); kind = "train"
    rows.append((kind, abs(s), round(time.perf_counter() - t, 3), count() - n0))
print("JSON" + json.dumps(rows))
'''
for name in sys.argv[1].split(","):
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, EMBER_CACHE_DIR=cache)
        for sizes in ("64,7,13,50,-512,-100", "64,29,-33"):
            p = subprocess.run([sys.executable, "-c", CHILD, name, sizes], env=env, capture_output=True, text=True)
            if p.returncode:
                print(p.stderr[-2000:]); continue
            print(name, json.loads([l for l in p.stdout.splitlines() if l.startswith("JSON")][-1][4:]), flush=True)
