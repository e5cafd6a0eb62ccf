"""`ember tune`: measure every candidate kernel of models' steps on this machine and keep the fastest.

    ember tune --model cnn,mlp --device cuda --batch-size 64,1024 [--tf32] [--budget-s 300]

For each model and batch size, the training and inference steps are planned as `compile` plans
them, then every kernel with more than one candidate (family and plan) is built, checked against
the cost model's choice on random inputs and timed on the device (`ember.runtime.tuner`). The
winners go into the tuning database (`--db`, default `$EMBER_CACHE_DIR/tuning`), which every later
compile on this device model reads. Kernels the database already holds are not measured again
(`--retune` measures them anyway), so an interrupted run resumes where it stopped, and models that
share a kernel share its measurement. A Python model is tuned through the API:
`compile(..., tune=True)`.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from ember.codegen import tuning_db
from ember.frontends import nn, plan
from ember.runtime import target as get_target
from ember.runtime import target_names

from ..training.recipes import MODELS, make_optimizer
from ..training.zoo import ZOO, zoo_model
from .cli_checks import UsageError, check_device, check_torch_for, precision_flag, selected_models


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{what} {text!r}: expected integers separated by commas, e.g. 64,1024") from None
    if not values or min(values) < 1:
        raise UsageError(f"{what} {text!r}: expected integers >= 1")
    return values


def add_arguments(p: Any) -> None:
    p.add_argument("--model", default="cnn,mlp", metavar="M[,M...]|all",
                   help=f"models to tune: the recipes ({', '.join(MODELS)}; all: each of them) or zoo models "
                        f"({', '.join(m for m in ZOO if m not in MODELS)}; defined in PyTorch) (default cnn,mlp)")
    p.add_argument("--zoo", action="store_true", help="tune every model of the zoo (instead of --model)")
    p.add_argument("--device", default="cuda", metavar="{" + ",".join(target_names()) + "}[:N]")
    p.add_argument("--batch-size", default="64,1024", metavar="B[,B...]", help="batch sizes (default 64,1024)")
    p.add_argument("--tf32", action="store_true", help="cuda: tune the kernels of precision='tf32'")
    p.add_argument("--bf16", action="store_true", help="tune the kernels of precision='bf16' (bfloat16 mixed precision)")
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget for the whole run, in seconds")
    p.add_argument("--retune", action="store_true", help="measure kernels the database already holds again")
    p.add_argument("--families", default=None, metavar="F[,F...]",
                   help="measure only these kernel families' candidates, beside the cost model's first and what "
                        "each step runs now (a new family compared quickly; a later run without it measures "
                        "the others)")
    p.add_argument("--db", default=None, metavar="DIR",
                   help="tuning database folder to write (default: $EMBER_CACHE_DIR/tuning)")
    p.add_argument("--quiet", action="store_true", help="no line per kernel, no progress bar")


def main(args: Any) -> int:
    precision = precision_flag(args)
    models = selected_models(args.model, args.zoo)
    if unknown := [m for m in models if m not in ZOO]:
        raise UsageError(f"--model {', '.join(unknown)}: expected names from {', '.join(ZOO)} (or all)")
    check_torch_for(models)
    batches = _ints(args.batch_size, "--batch-size")
    if not args.budget_s > 0:
        raise UsageError(f"--budget-s {args.budget_s}: expected a number of seconds > 0")
    name, _, index = args.device.partition(":")
    target = get_target(name)
    if target.tune is None:
        raise UsageError(f"--device {args.device}: it has no kernel choices to measure")
    check_device(args.device)  # CuPy and a GPU present: the one line every command gives
    if index:
        target.select_device(int(index))
    families = None
    if args.families is not None:
        families = {f.strip() for f in args.families.split(",") if f.strip()}
        known = _families_of(name)
        if not families or families - set(known):
            raise UsageError(f"--families {args.families!r}: expected names from {', '.join(known)}")
    db = tuning_db.TuningDB(args.db, (tuning_db.SHIPPED_DIR,)) if args.db else tuning_db.default_db()
    t0 = time.perf_counter()
    totals = {"measured": 0, "reused": 0, "budget": 0}
    with tuning_db.using(db):
        for model_name in models:
            for batch in batches:
                example = (np.zeros((batch, *ZOO[model_name].input_shape), np.float32), np.zeros(batch, np.int64))
                graphs = plan(zoo_model(model_name), nn.CrossEntropyLoss(), make_optimizer("sgd", 0.05), example,
                              device=name, precision=precision)
                for step, graph in graphs.items():
                    left = args.budget_s - (time.perf_counter() - t0)
                    report = target.tune(graph, db=db, budget_s=max(left, 0.0), retune=args.retune, families=families,
                                         progress=None if args.quiet else _progress(f"{model_name} {step}"))
                    for k in report.kernels:
                        totals[k.status] = totals.get(k.status, 0) + 1
                    print(f"{model_name} {step}: {report.summary()}", flush=True)
    where = db.user_dir
    skipped = f", {totals['skipped']} served by no family of --families" if totals.get("skipped") else ""
    print(f"ember tune: {totals['measured']} kernels measured, {totals['reused']} reused, "
          f"{totals['budget']} left for lack of budget{skipped}, in {time.perf_counter() - t0:.1f} s; database {where}")
    return 0


def _families_of(target_name: str) -> list[str]:
    """The kernel families of a target's choice table (what --families may name)."""
    from ember.codegen import cpp_choices, cuda_choices
    return list({"cuda": cuda_choices.TABLE, "cpu": cpp_choices.TABLE}[target_name].families)


def _progress(desc: str) -> Any:
    """A callback printing each kernel's line above a tqdm bar over the step's tunable kernels."""
    from tqdm import tqdm

    state: dict[str, Any] = {}

    def update(report: Any, done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = tqdm(total=total, desc=desc, unit="kernel", file=sys.stderr, leave=False)
        bar.write(report.line())
        bar.update(1)
        if done == total:
            bar.close()
    return update
