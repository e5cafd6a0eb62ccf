#!/usr/bin/env python3
"""The speedrun recipe (`ember mnist --recipe speedrun`) in PyTorch: the side-by-side number.

    python tools/torch_speedrun.py --device cuda --seeds 10 --data ../shared/data/mnist
    python tools/torch_speedrun.py --device cpu --threads 2 --seeds 1

The recipe is read from ember (`recipes.RECIPES["speedrun"]`), so the two cannot drift: the twin
of speednet (`torch_twins`) starting from ember's initial weights for each seed (PyTorch's
default initialisation, which ember reproduces bit for bit), the same shuffled order (NumPy's
generator, as ember's loader; the last partial batch kept), Adam with the recipe's betas under
OneCycleLR (its rates tabulated from torch.optim.lr_scheduler), cross-entropy with label
smoothing, and each training image moved by up to the recipe's pixels (PyTorch's generator:
other shifts than ember's, the same distribution). On cuda the whole step — translation,
forward, loss, backward, Adam, and the learning rate looked up by a step counter on the device —
is one CUDA graph per batch shape, replayed per batch (the capture's warm-up steps are undone);
on cpu it runs eagerly. The test set lives on the device and is evaluated there after each epoch
(and every --eval-every steps), one read back each; the run stops at --target-acc.

Training seconds count the steps only, the device synchronised at each evaluation's start and
end (compile/capture excluded), as ember's trainer counts them. One JSON line per seed, then a
summary line ({"summary": ...}).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seeds", default="1", metavar="N|A,B,...", help="N seeds 0..N-1, or a comma-separated list")
    ap.add_argument("--data", default=None, metavar="DIR", help="the dataset's IDX folder (default: ember's)")
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist"])
    ap.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--target-acc", type=float, default=0.99)
    ap.add_argument("--eval-every", type=int, default=None, metavar="N", help="also evaluate every N steps")
    ap.add_argument("--limit-steps", type=int, default=None, metavar="N",
                    help="steps per epoch (smoke tests; the schedule spans epochs x N)")
    ap.add_argument("--threads", type=int, default=0, help="cpu: torch.set_num_threads (0: torch's default)")
    ap.add_argument("--tf32", action="store_true", help="cuda: TF32 matmuls and convolutions")
    ap.add_argument("--bf16", action="store_true", help="torch.autocast(dtype=torch.bfloat16) around the model")
    return ap.parse_args(argv)


def seed_list(text: str) -> list[int]:
    return [int(s) for s in text.split(",")] if "," in text else list(range(int(text)))


def translate(torch: Any, x: Any, s: int) -> Any:
    """Each image moved by (dy, dx), each uniform in [-s, s], zeros filling the border."""
    n, c, h, w = x.shape
    d = torch.randint(-s, s + 1, (2, n), device=x.device)
    rows = torch.arange(h, device=x.device)[None, :] - d[0][:, None]  # the source row of each output row
    cols = torch.arange(w, device=x.device)[None, :] - d[1][:, None]
    inside = (((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]).unsqueeze(1)
    picked = x[torch.arange(n, device=x.device)[:, None, None], :, rows.clamp(0, h - 1)[:, :, None],
               cols.clamp(0, w - 1)[:, None, :]]  # (n, h, w, c): advanced indices around a slice go first
    return picked.permute(0, 3, 1, 2) * inside


def onecycle_rates(torch: Any, lr: float, total: int) -> list[float]:
    """The rate of each of `total` steps under OneCycleLR(max_lr=lr, cycle_momentum=False)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, cycle_momentum=False)
    rates = []
    for _ in range(total):
        rates.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return rates


class Run:
    """The recipe's training on one device, built once (model, optimizer, CUDA graphs) and run
    for any number of seeds."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.nn.functional as F

        from ember.frontends.training.datasets import DATASETS, dataset_dir
        from ember.frontends.training.recipes import RECIPES, build_model
        from ember.frontends.training.torch_twins import torch_model
        from ember.runtime.data import load_mnist

        self.torch, self.F, self.build_model = torch, F, build_model
        r = RECIPES["speedrun"].settings_for(args.device)
        self.recipe = r
        if r["optimizer"] != "adam" or r["lr_schedule"] != "onecycle" or not r["shuffle"]:
            raise SystemExit("torch_speedrun.py follows an Adam + onecycle + shuffled recipe; the recipe changed: "
                             "update this twin")
        self.dev = torch.device(args.device)
        if args.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = args.tf32
            torch.backends.cudnn.allow_tf32 = args.tf32
            torch.backends.cudnn.benchmark = True  # the capture's warm-up steps pick the convolutions
        elif args.threads:
            torch.set_num_threads(args.threads)
        root = args.data or dataset_dir(DATASETS[args.dataset].name)
        xtr, ytr = load_mnist(root, "train")
        xte, yte = load_mnist(root, "test")
        self.xtr, self.ytr = torch.from_numpy(xtr).to(self.dev), torch.from_numpy(ytr).to(self.dev)
        self.xte, self.yte = torch.from_numpy(xte).to(self.dev), torch.from_numpy(yte).to(self.dev)
        self.n, self.bs = len(xtr), int(r["batch_size"])
        self.epochs = args.epochs or int(r["epochs"])
        self.steps_per_epoch = min(-(-self.n // self.bs), args.limit_steps or self.n)
        self.shift, self.smoothing = int(r["translate"]), float(r["label_smoothing"])
        self.eval_bs, self.target, self.eval_every = int(r["eval_batch_size"]), args.target_acc, args.eval_every
        self.bf16 = args.bf16
        self.model = torch_model("speednet").to(self.dev)
        rates = onecycle_rates(torch, float(r["lr"]), self.epochs * self.steps_per_epoch)
        betas = tuple(float(b) for b in str(r["betas"]).split(","))
        self.graphed = args.device == "cuda"
        if self.graphed:
            self.rates = torch.tensor(rates + [rates[-1]], dtype=torch.float32, device=self.dev)
            self.lr = torch.tensor(rates[0], dtype=torch.float32, device=self.dev)
            self.counter = torch.zeros((1,), dtype=torch.int64, device=self.dev)
            self.opt = torch.optim.Adam(self.model.parameters(), lr=self.lr, betas=betas, capturable=True)
        else:
            self.rates = rates
            self.opt = torch.optim.Adam(self.model.parameters(), lr=rates[0], betas=betas)
        self.graphs: dict[int, tuple[Any, Any, Any]] = {}
        t0 = time.perf_counter()
        if self.graphed:
            self._reset(0)
            last = self.n % self.bs if self.steps_per_epoch * self.bs >= self.n else 0
            for size in sorted({self.bs, last} - {0}):
                self._capture(size)
            torch.cuda.synchronize()
        self.setup_seconds = time.perf_counter() - t0

    def _forward(self, x: Any) -> Any:
        # no autocast cache: a captured graph must not keep casts made outside it
        with self.torch.autocast(self.dev.type, dtype=self.torch.bfloat16, enabled=self.bf16, cache_enabled=False):
            return self.model(x).float()

    def _loss(self, x: Any, y: Any) -> Any:
        return self.F.cross_entropy(self._forward(translate(self.torch, x, self.shift)), y, label_smoothing=self.smoothing)

    def _graph_step(self, x: Any, y: Any) -> None:
        self.lr.copy_(self.rates.index_select(0, self.counter)[0])
        self._loss(x, y).backward()
        self.opt.step()
        self.counter.add_(1)

    def _capture(self, size: int) -> None:
        torch = self.torch
        x = self.xtr[:size].clone()
        y = self.ytr[:size].clone()
        saved = {k: v.clone() for k, v in self.model.state_dict().items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: autograd, cuDNN and the optimizer's state (undone below)
            for _ in range(3):
                self.opt.zero_grad(set_to_none=True)
                self._graph_step(x, y)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            self._graph_step(x, y)
        self.model.load_state_dict(saved)
        self.graphs[size] = (graph, x, y)

    def _reset(self, seed: int) -> None:
        """Seed `seed`'s initial weights (ember's, for that seed), fresh Adam state, step 0."""
        torch = self.torch
        weights = self.build_model("speednet", seed).state_dict()
        with torch.no_grad():
            self.model.load_state_dict({k: torch.from_numpy(np.asarray(v).copy()) for k, v in weights.items()})
            for state in self.opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        v.zero_()
            if self.graphed:
                self.counter.zero_()
        torch.manual_seed(seed)

    def _step(self, k: int, x: Any, y: Any) -> None:
        if self.graphed:
            graph, sx, sy = self.graphs[len(x)]
            sx.copy_(x)
            sy.copy_(y)
            graph.replay()
            return
        for group in self.opt.param_groups:
            group["lr"] = self.rates[k]
        self.opt.zero_grad(set_to_none=True)
        self._loss(x, y).backward()
        self.opt.step()

    def evaluate(self) -> float:
        torch = self.torch
        self.model.eval()
        with torch.no_grad():
            correct = torch.zeros((), dtype=torch.int64, device=self.dev)
            for s in range(0, len(self.xte), self.eval_bs):
                correct += (self._forward(self.xte[s:s + self.eval_bs]).argmax(1) == self.yte[s:s + self.eval_bs]).sum()
        self.model.train()
        return correct.item() / len(self.xte)

    def _sync(self) -> None:
        if self.graphed:
            self.torch.cuda.synchronize()

    def run(self, seed: int) -> dict[str, Any]:
        torch = self.torch
        self._reset(seed)
        train_s = eval_s = 0.0
        reached: dict[str, Any] | None = None
        evals: list[tuple[int, float]] = []
        k = 0

        def check() -> bool:
            nonlocal train_s, eval_s, reached
            self._sync()
            now = time.perf_counter()
            train_s += now - mark
            acc = self.evaluate()
            eval_s += time.perf_counter() - now
            evals.append((k, acc))
            if reached is None and acc >= self.target:
                reached = {"step": k, "train_seconds": train_s, "test_acc": acc}
            return reached is not None

        for epoch in range(self.epochs):
            order = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(self.n)).to(self.dev)
            self._sync()
            mark = time.perf_counter()
            xs, ys = self.xtr[order], self.ytr[order]
            for b in range(self.steps_per_epoch):
                self._step(k, xs[b * self.bs:(b + 1) * self.bs], ys[b * self.bs:(b + 1) * self.bs])
                k += 1
                if self.eval_every and k % self.eval_every == 0 and b + 1 < self.steps_per_epoch:
                    if check():
                        break
                    mark = time.perf_counter()
            if reached is not None or check():
                break
        return {"system": "pytorch", "seed": seed, "device": str(self.dev), "reached": reached is not None,
                "time_to_target_s": reached["train_seconds"] if reached else None,
                "steps_to_target": reached["step"] if reached else None, "final_acc": evals[-1][1],
                "train_seconds": train_s, "eval_seconds": eval_s, "steps": k, "evals": evals}


def summary(results: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Mean, min, max and spread (population std) of the final accuracy and of the time to target."""
    accs = [r["final_acc"] for r in results]
    times = [r["time_to_target_s"] for r in results if r["reached"]]
    out: dict[str, Any] = {"seeds": len(results), "target_acc": target, "reached": len(times),
                           "acc_mean": statistics.fmean(accs), "acc_min": min(accs), "acc_max": max(accs),
                           "acc_std": statistics.pstdev(accs),
                           "train_seconds_mean": statistics.fmean(r["train_seconds"] for r in results)}
    if times:
        out.update(time_mean_s=statistics.fmean(times), time_min_s=min(times), time_max_s=max(times),
                   time_std_s=statistics.pstdev(times))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    t0 = time.perf_counter()
    run = Run(args)
    print(json.dumps({"setup": {"system": "pytorch", "device": args.device, "setup_seconds": run.setup_seconds,
                                "recipe": run.recipe, "epochs": run.epochs, "threads": run.torch.get_num_threads(),
                                "torch": run.torch.__version__, "load": os.getloadavg()}}), flush=True)
    results = []
    for seed in seed_list(args.seeds):
        results.append(run.run(seed))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"summary": {"system": "pytorch", **summary(results, args.target_acc),
                                  "wall_seconds": time.perf_counter() - t0}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
