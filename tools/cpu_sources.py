"""The generated C++ of the recipe models' CPU steps, saved or compared with a saved copy.

    python tools/cpu_sources.py --save before.json        # on one commit
    python tools/cpu_sources.py --compare before.json     # on another: which sources differ

For every model, batch size and vector variant (both, whatever this CPU has: sources only), the
training and inference steps are planned for device="cpu" with no tuning database (the cost
model decides every kernel) and rendered. Saved per step: every translation unit's source
(kernel units named by their content, so byte-identical kernels have the same names) and the
entry unit with the `choice=...` notes of its comments taken out (they name the choice that was
made, which a commit that records choices adds without changing any code). Exit status 1 when a
comparison finds a difference.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

MODELS = ("cnn", "mlp", "lenet5", "resnet8")
BATCHES = (64, 1024)
VARIANTS = ("avx2", "avx512")


def sources(models=MODELS, batches=BATCHES, variants=VARIANTS) -> dict[str, dict[str, str]]:
    from ember.codegen import cpp, cpu_vector
    from ember.frontends import nn, optim, plan
    from ember.frontends.training.recipes import MODELS as RECIPES, build_model

    try:
        from ember.codegen import tuning_db
        no_db = tuning_db.using(None)
    except ImportError:  # a commit before the tuning database
        import contextlib
        no_db = contextlib.nullcontext()
    out: dict[str, dict[str, str]] = {}
    before = os.environ.get(cpu_vector.ENV_VAR)
    try:
        with no_db:
            for variant in variants:
                os.environ[cpu_vector.ENV_VAR] = variant
                for name in models:
                    shape = (784,) if RECIPES[name][1] else (1, 28, 28)
                    for batch in batches:
                        example = (np.zeros((batch, *shape), np.float32), np.zeros(batch, np.int64))
                        graphs = plan(build_model(name), nn.CrossEntropyLoss(), optim.SGD(lr=0.05, momentum=0.9),
                                      example, device="cpu")
                        for step, graph in graphs.items():
                            src = cpp.render_step(graph)
                            units = {u.name: u.source for u in src.units}
                            units["entry"] = re.sub(r" choice=\S+", "", units["entry"])
                            out[f"{name}/{batch}/{variant}/{step}"] = units
    finally:
        if before is None:
            os.environ.pop(cpu_vector.ENV_VAR, None)
        else:
            os.environ[cpu_vector.ENV_VAR] = before
    return out


def compare(old: dict[str, dict[str, str]], new: dict[str, dict[str, str]]) -> list[str]:
    """One line per step whose units differ (names of the units only one side has)."""
    problems = []
    for step in sorted(set(old) | set(new)):
        a, b = old.get(step), new.get(step)
        if a is None or b is None:
            problems.append(f"{step}: only in the {'new' if a is None else 'saved'} sources")
            continue
        gone, added = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        changed = sorted(u for u in set(a) & set(b) if a[u] != b[u])
        if gone or added or changed:
            problems.append(f"{step}: units only saved {gone}, only new {added}, changed {changed}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write the sources to this JSON file")
    ap.add_argument("--compare", help="compare the sources with this JSON file")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = ap.parse_args()
    srcs = sources(args.models.split(","), [int(b) for b in args.batches.split(",")])
    kernels = {u for units in srcs.values() for u in units if u != "entry"}
    print(f"{len(srcs)} steps, {len(kernels)} distinct kernel units")
    if args.save:
        with open(args.save, "w") as f:
            json.dump(srcs, f, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            problems = compare(json.load(f), srcs)
        for line in problems:
            print(line)
        print("identical" if not problems else f"{len(problems)} steps differ")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
