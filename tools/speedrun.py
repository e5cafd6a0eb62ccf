#!/usr/bin/env python3
"""Time to accuracy of the speedrun recipe (`ember mnist --recipe speedrun`) over several seeds,
compiled once, and optionally of its PyTorch twin (tools/torch_speedrun.py) beside it.

    python tools/speedrun.py --device cuda --seeds 10 --torch
    python tools/speedrun.py --device cpu --threads 2 --seeds 2 --torch
    python tools/speedrun.py --device cuda --dataset fashion-mnist --seconds 1 --seeds 3

One process compiles the step once (`Trainer`), warms it up (the first call of each compiled
step, the evaluation's inference step), then runs every seed from that seed's initial weights
with fresh optimizer state, random stream and shuffled order (`Trainer.restart`), to the
target accuracy (evaluated after each epoch and every --eval-every steps) or the end of the
recipe's epochs. Per seed: time to target (training seconds: the steps only, the device
synchronised at each evaluation; compile, warm-up and evaluations excluded), the final test
accuracy, then their mean, min, max and spread (population standard deviation). With --torch,
the same for PyTorch (a separate process, the same seeds, initial weights and batch order) and
the ratio of the mean times. With --seconds S the epochs are chosen so that training takes
about S seconds (from one timed epoch) and no target stops it: the accuracy reached in S seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_speedrun import seed_list, summary  # noqa: E402  (the twin's: one definition for both)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    ap.add_argument("--seeds", default="3", metavar="N|A,B,...", help="N seeds 0..N-1, or a comma-separated list")
    ap.add_argument("--data", default=None, metavar="DIR", help="the dataset's IDX folder (default: ember's)")
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist"])
    ap.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--target-acc", type=float, default=0.99)
    ap.add_argument("--eval-every", type=int, default=None, metavar="N", help="also evaluate every N steps")
    ap.add_argument("--seconds", type=float, default=None, metavar="S",
                    help="train about S seconds (epochs from one timed epoch), no target: the accuracy then")
    ap.add_argument("--limit-steps", type=int, default=None, metavar="N", help="steps per epoch (smoke tests)")
    ap.add_argument("--threads", type=int, default=None, help="cpu: OpenMP threads (and PyTorch's)")
    ap.add_argument("--tf32", action="store_true", help="cuda: TF32 contractions, for both systems")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (autocast's rules), for both systems")
    ap.add_argument("--torch", action="store_true", help="also run the PyTorch twin (tools/torch_speedrun.py)")
    ap.add_argument("--json", action="store_true", help="only JSON lines")
    return ap.parse_args(argv)


class EmberRun:
    """The recipe's Trainer, compiled once for `epochs` and warmed up."""

    def __init__(self, args: argparse.Namespace, data: tuple[Any, Any, Any, Any], epochs: int | None) -> None:
        from ember.frontends import nn
        from ember.frontends.training import Trainer
        from ember.frontends.training.recipes import RECIPES, LRSchedule, build_model, make_optimizer

        self.build_model = build_model
        r = self.recipe = RECIPES["speedrun"].settings_for(args.device)
        self.epochs = epochs or int(r["epochs"])
        self.translate = r.get("translate")
        betas = tuple(float(b) for b in str(r["betas"]).split(",")) if r.get("betas") else None
        opt = make_optimizer(r["optimizer"], r["lr"], r.get("momentum", 0.0), r.get("weight_decay"),
                             r.get("nesterov", False), betas)
        xtr, ytr, xte, yte = data
        t0 = time.perf_counter()
        self.trainer = Trainer(
            self._model(0), opt, (xtr, ytr), (xte, yte), device=args.device, batch_size=int(r["batch_size"]),
            shuffle=bool(r.get("shuffle")), seed=0, eval_batch_size=int(r["eval_batch_size"]),
            limit_steps=args.limit_steps, log_every=0,
            precision="bf16" if args.bf16 else "tf32" if args.tf32 else "float32",
            loss_fn=nn.CrossEntropyLoss(label_smoothing=float(r.get("label_smoothing", 0.0))),
            lr_schedule=LRSchedule(r["lr_schedule"], int(r.get("warmup_steps", 0))), epochs=self.epochs,
            tta=tuple(tuple(int(v) for v in p.split(":")) for p in str(r.get("tta") or "").split(",") if p))
        self.compile_seconds = self.trainer.compile_seconds
        t1 = time.perf_counter()
        self._warm_up()
        self.warmup_seconds = time.perf_counter() - t1
        self.setup_seconds = time.perf_counter() - t0

    def _model(self, seed: int) -> Any:
        return self.build_model(self.recipe["model"], seed, translate=self.translate)

    def _warm_up(self) -> None:
        """The first two calls of every compiled step and of the evaluation's inference step,
        outside the timed runs (`restart` undoes their effect): on a GPU the first call loads the
        modules and the second captures the CUDA graph (runtime/cuda.py), which seed 0's timed
        run paid for when the warm-up made one call (0.38 s against 0.07 s for seeds 1-9). One
        batch is drawn from the loader too: on a device its first epoch shuffles the data by a
        CuPy gather, whose kernel CuPy compiles on first use (seed 0 paid 0.41 s for it on a fresh
        H200 machine, its kernel cache empty)."""
        t = self.trainer
        x, y = t.loader.x, t.loader.y
        bs, n = t.loader.batch_size, len(y)
        next(iter(t.loader))  # the loader's state is its epoch, which iterating leaves alone
        for _ in range(2):
            for size in sorted({min(bs, n), n % bs} - {0}):
                t.step.run(x[:size], y[:size], check_labels=False)
            t.evaluate()

    def run(self, seed: int, target: float | None, eval_every: int | None) -> dict[str, Any]:
        t = self.trainer
        t.restart(self._model(seed).state_dict(), seed)
        t.fit(self.epochs, target_acc=target, eval_every=eval_every)
        evals = [(r["step"], r["test_acc"]) for r in t.records if r["type"] in ("eval", "epoch")]
        reached = t.reached
        return {"system": "ember", "seed": seed, "device": t.device, "reached": reached is not None,
                "time_to_target_s": reached["train_seconds"] if reached else None,
                "steps_to_target": reached["step"] if reached else None, "final_acc": evals[-1][1],
                "train_seconds": t.train_seconds, "eval_seconds": t.eval_seconds, "steps": t.global_step,
                "epochs": t.epoch + (t.step_in_epoch > 0), "evals": evals}


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    from ember.frontends.training.datasets import DATASETS, dataset_dir
    from ember.runtime.data import load_mnist
    root = args.data or dataset_dir(DATASETS[args.dataset].name)
    return (*load_mnist(root, "train"), *load_mnist(root, "test"))


def _torch(args: argparse.Namespace, epochs: int, target: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The PyTorch twin in its own process: (its setup line, its per-seed results)."""
    cmd = [sys.executable, os.path.join(HERE, "torch_speedrun.py"), "--device", args.device.partition(":")[0],
           "--seeds", args.seeds, "--dataset", args.dataset, "--epochs", str(epochs), "--target-acc", str(target)]
    for flag, value in (("--data", args.data), ("--eval-every", args.eval_every), ("--threads", args.threads),
                        ("--limit-steps", args.limit_steps)):
        if value is not None:
            cmd += [flag, str(value)]
    cmd += [flag for flag, on in (("--tf32", args.tf32), ("--bf16", args.bf16)) if on]
    env = dict(os.environ)
    if args.device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = args.device.partition(":")[2]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"tools/torch_speedrun.py failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    setup = next(line["setup"] for line in lines if "setup" in line)
    return setup, [line for line in lines if "seed" in line]


def _print_table(name: str, results: list[dict[str, Any]], s: dict[str, Any]) -> None:
    print(f"{name}: seed, time to target (training s), steps, final test accuracy")
    for r in results:
        t = f"{r['time_to_target_s']:.4f}" if r["reached"] else "not reached"
        print(f"  {r['seed']:4d}  {t:>12}  {r['steps_to_target'] or r['steps']:5d}  {100 * r['final_acc']:.2f}%")
    line = (f"  accuracy mean {100 * s['acc_mean']:.3f}%, min {100 * s['acc_min']:.2f}%, max {100 * s['acc_max']:.2f}%, "
            f"std {100 * s['acc_std']:.3f}%")
    if "time_mean_s" in s:
        line += (f"; time to target mean {s['time_mean_s']:.4f} s, min {s['time_min_s']:.4f}, "
                 f"max {s['time_max_s']:.4f}, std {s['time_std_s']:.4f} ({s['reached']}/{s['seeds']} reached)")
    else:
        line += f"; training {s['train_seconds_mean']:.4f} s a seed"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    started = time.perf_counter()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read when the first compiled step loads
    data = _load(args)
    target = None if args.seconds else args.target_acc
    ember = EmberRun(args, data, args.epochs)
    if args.seconds:  # a timed epoch of seed 0, then the epochs that fit in the budget
        probe = EmberRun(args, data, 1) if ember.epochs != 1 else ember
        # the faster of two: the first paid 0.16 s more than an epoch (0.053 s) on an H200, so
        # 1 s bought 6 epochs (0.32 s of training) instead of 18
        epoch_s = min(probe.run(0, None, None)["train_seconds"] for _ in range(2))
        epochs = max(1, math.floor(args.seconds / epoch_s))
        ember = EmberRun(args, data, epochs) if epochs != ember.epochs else ember
    setup = {"system": "ember", "device": args.device, "dataset": args.dataset, "recipe": ember.recipe,
             "epochs": ember.epochs, "compile_seconds": ember.compile_seconds, "warmup_seconds": ember.warmup_seconds,
             "threads": os.environ.get("OMP_NUM_THREADS"), "load": os.getloadavg()}
    print(json.dumps({"setup": setup}), flush=True)
    results = []
    for seed in seed_list(args.seeds):
        results.append(ember.run(seed, target, args.eval_every))
        print(json.dumps(results[-1]), flush=True)
    s = summary(results, target)
    print(json.dumps({"summary": {"system": "ember", **s}}), flush=True)
    torch_s = None
    if args.torch:
        torch_setup, torch_results = _torch(args, ember.epochs, target if target is not None else 2.0)
        for r in torch_results:
            print(json.dumps(r), flush=True)
        torch_s = summary(torch_results, target)
        print(json.dumps({"summary": {"system": "pytorch", **torch_s, "setup_seconds": torch_setup["setup_seconds"]}}),
              flush=True)
    if not args.json:
        print(f"\nspeedrun on {args.device} ({args.dataset}, {ember.epochs} epoch(s) at most, target "
              f"{'none' if target is None else f'{100 * target:g}%'}; load {os.getloadavg()[0]:.2f}): ember compiled "
              f"in {ember.compile_seconds:.2f} s, warmed up in {ember.warmup_seconds:.2f} s")
        _print_table("ember", results, s)
        if torch_s is not None:
            _print_table("pytorch", torch_results, torch_s)
            if "time_mean_s" in s and "time_mean_s" in torch_s:
                print(f"PyTorch / ember, mean time to target: {torch_s['time_mean_s'] / s['time_mean_s']:.2f}x")
            else:
                print(f"PyTorch / ember, mean training seconds: "
                      f"{torch_s['train_seconds_mean'] / s['train_seconds_mean']:.2f}x")
        print(f"wall {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
