"""Which steps' kernel choices a folder of tuning records would change, before they are shipped (a
diagnostic, not a test). The cost model's prior learns from every record of a device (and other
devices' records), so records measured on one model move the plans of others: sessions 33-34 found
airbench's records moving ResNet-8's and the ViT's kernels at a batch size nobody tuned. Each
moved step is one to time with and without the records (`tools/step_time.py` under two
`$EMBER_CACHE_DIR`s) before `tools/ship_tuning.py` copies them in.

    python tools/tuning_moves.py DIR [--device cuda] [--gpu h100,h200] [--models cnn,resnet8,airbench,mobilenet,vit] [--batch-sizes 64,1024] [--precision bf16]

DIR is a tuning database folder (`ember tune --db DIR`). Every training step is planned twice
(no compiler, no GPU): with the shipped records only, and with DIR's records as the user's
database beside them; the plan cache is off. Prints one line a step (kernels whose choice
differs, of how many), with --show each differing kernel's two choices, and per device the moved
steps as `tools/step_time.py --cases` takes them. Exit status 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Planned in a child process per database: the tuning database and the prior are read once per
# process, so one process cannot plan with two.
_CHILD = r'''
import contextlib, json, sys
import numpy as np
from ember.codegen.device import named, using
from ember.frontends import nn, plan
from ember.frontends.training.recipes import make_optimizer
from ember.frontends.training.zoo import ZOO, zoo_model
device, gpus, models, batches, precision = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","), sys.argv[4].split(","), sys.argv[5]
out = {}
for gpu in gpus:
    for name in models:
        for batch in map(int, batches):
            with using(named(gpu)) if device == "cuda" else contextlib.nullcontext():
                example = (np.zeros((batch, *ZOO[name].input_shape), np.float32), np.zeros(batch, np.int64))
                graphs = plan(zoo_model(name), nn.CrossEntropyLoss(), make_optimizer("sgd", 0.05), example, device=device,
                             precision=precision)
            graph = next(g for step, g in graphs.items() if step.startswith("train"))
            out[f"{gpu if device == 'cuda' else 'cpu'} {name}:{batch}"] = [
                graph.attrs(n)["kernel"].describe() for n in graph.meta["schedule"] if graph.op(n) == "fused"]
print(json.dumps(out))
'''


def choices(db: Path | None, device: str, gpus: str, models: str, batches: str,
            precision: str = "float32") -> dict[str, list[str]]:
    """step -> the `describe()` of every kernel in schedule order, planned with `db`'s records as
    the user's database (None: the shipped records only)."""
    with tempfile.TemporaryDirectory(prefix="ember-moves-") as cache:
        if db is not None:
            (Path(cache) / "tuning").mkdir()
            for f in db.glob("*.json"):
                shutil.copy(f, Path(cache) / "tuning" / f.name)
        env = dict(os.environ, EMBER_CACHE_DIR=cache, EMBER_PLAN_CACHE="0")
        r = subprocess.run([sys.executable, "-c", _CHILD, device, gpus, models, batches, precision], capture_output=True,
                           text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"planning failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def moves(before: dict[str, list[str]], after: dict[str, list[str]]) -> dict[str, list[tuple[str, str]]]:
    """step -> the (before, after) kernel descriptions that differ (a step whose kernels changed in
    number lists every kernel of the longer plan)."""
    out = {}
    for step, old in before.items():
        new = after[step]
        if len(old) != len(new):
            width = max(len(old), len(new))
            out[step] = [(old[i] if i < len(old) else "-", new[i] if i < len(new) else "-") for i in range(width)]
        else:
            out[step] = [(a, b) for a, b in zip(old, new) if a != b]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db", type=Path, help="a tuning database folder (ember tune --db DIR)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpu", default="h100,h200", help="cuda: the known GPUs to plan for (ember kernels --gpu)")
    ap.add_argument("--models", default="cnn,resnet8,airbench,mobilenet,vit")
    ap.add_argument("--batch-sizes", default="64,1024")
    ap.add_argument("--precision", default="float32", choices=("float32", "tf32", "bf16"),
                    help="plan the steps in this precision (records are kept per precision)")
    ap.add_argument("--show", action="store_true", help="each differing kernel's choice before and after")
    args = ap.parse_args()
    if not args.db.is_dir() or not list(args.db.glob("*.json")):
        raise SystemExit(f"{args.db}: not a tuning database folder (no <target>-<device>.json in it)")
    before = choices(None, args.device, args.gpu, args.models, args.batch_sizes, args.precision)
    after = choices(args.db, args.device, args.gpu, args.models, args.batch_sizes, args.precision)
    moved: dict[str, list[str]] = {}
    for step, changed in moves(before, after).items():
        print(f"{step:28s} {len(changed):4d} of {len(before[step]):4d} kernels change")
        if args.show:
            for old, new in changed:
                print(f"    {old}\n -> {new}")
        if changed:
            where, case = step.rsplit(" ", 1)  # a GPU named by its full name has spaces
            moved.setdefault(where, []).append(case)
    flag = {"float32": "", "tf32": " --tf32", "bf16": " --bf16"}[args.precision]
    for where, cases in moved.items():  # what to time on that device, with and without the records
        print(f"to time on {where}: python tools/step_time.py --cases {','.join(cases)}{flag}")


if __name__ == "__main__":
    main()
