"""`ember align`: ember and PyTorch trained side by side from the same weights on the same batches.

    ember align --model cnn --steps 200 --device cpu --data ../shared/data/mnist

Both start from PyTorch's seeded initialisation (or --init-weights) and see the training set in
file order, batch 64, plain SGD. Printed side by side:

* the logits of batch 0 and its loss, before any update (ember: `step.inference`, the compiled
  inference graph);
* the gradient norm of every parameter at step 0 (ember: the gradient graph built by
  `ember.passes.autodiff.grad` from the traced loss, compiled for the same device and run on
  the initial weights; it is the backward half of the training step, without the update);
* every parameter's norm after one step of each;
* over N steps: the largest loss difference of the two free-running float32 trainings, the
  largest difference of the loss on the *same* weights (before each ember step a PyTorch
  follower is loaded with ember's weights), and, as the scale that float32 rounding alone
  reaches, each float32 run's distance to the exact (float64) PyTorch run.

Free-running float32 runs drift apart by the chaotic amplification of rounding differences
(PyTorch's own float32 backends disagree with each other by the same order), so the figure that
judges ember is how close it stays to the float64 trajectory compared with PyTorch float32.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ember.frontends import compile as ember_compile
from ember.frontends import nn, optim, trace
from ember.runtime import target_names

from ..training.torch_twins import torch_model

__all__ = ["ember_gradients", "run_alignment", "Alignment", "format_alignment", "add_arguments", "main"]

TORCH_MISSING = ("ember align needs PyTorch as the reference it compares with, and PyTorch is not "
                 "installed here: pip install 'ember[torch]'")


def ember_gradients(model: nn.Module, x: np.ndarray, y: np.ndarray, device: str = "cpu") -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {parameter name: gradient}) of cross-entropy at the model's current parameters.

    The traced loss graph is differentiated by `ember.passes.autodiff.grad` and run on
    `device`: "reference" evaluates it with `ember.ir.run` (the NumPy interpreter), "cpu"
    compiles it with the device's passes (fusion, memory plan) and runs it on copies of the
    parameters, so the gradients come from the same kind of kernels as the training step.
    """
    from ember.passes.autodiff import grad
    from ember.passes.pipeline import run_passes
    from ember.runtime import target as get_target

    loss_fn = nn.CrossEntropyLoss()
    forward = trace(lambda x, y: loss_fn(model(x), y), x, y, name="loss", modules={"": model})
    graph = grad(forward)
    params = {name: forward.meta["parameters"][name].data.copy() for name in graph.parameters}
    target = get_target(device)
    storage = target.storage()
    for name, value in params.items():
        storage.add(name, value)
    out = target.executor(run_passes(graph, target.passes()), storage, name="grad")({"x": x, "y": y})
    return float(out["loss"]), {k[len("grad:"):]: np.array(v) for k, v in out.items() if k.startswith("grad:")}


@dataclass
class Alignment:
    model: str
    device: str
    steps: int
    batch_size: int
    lr: float
    torch_version: str
    threads: int
    logits0: tuple[np.ndarray, np.ndarray]                     # (ember, torch), batch 0, initial weights
    loss0: tuple[float, float]
    grad_norms: list[tuple[str, float, float]]                 # (name, ember, torch), step 0
    param_norms_1: list[tuple[str, float, float]]              # after one step of each
    ember: np.ndarray                                           # free-running losses
    torch32: np.ndarray
    torch64: np.ndarray | None = None
    same_weights: np.ndarray | None = None                      # |ember loss - torch loss on ember's weights|
    next_loss: np.ndarray | None = None                         # |ember loss - torch's after its own step from ember's previous weights|
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def grad_rel(self) -> dict[str, float]:
        return {n: abs(e - t) / max(abs(t), 1e-30) for n, e, t in self.grad_norms}

    def summary(self) -> dict[str, Any]:
        """The headline figures as plain numbers (max and argmax of each loss difference)."""
        def peak(a: np.ndarray | None, first: int = 0) -> tuple[float, int] | None:
            return None if a is None or not len(a) else (float(np.max(a)), first + int(np.argmax(a)))
        out: dict[str, Any] = {
            "logits0_max_abs_diff": float(np.abs(self.logits0[0] - self.logits0[1]).max()),
            "loss0_abs_diff": abs(self.loss0[0] - self.loss0[1]),
            "grad_norm_max_rel_diff": max(self.grad_rel.values()),
            "param_norm_1_max_rel_diff": max(abs(e - t) / max(abs(t), 1e-30) for _, e, t in self.param_norms_1),
            "free_ember32_vs_torch32": peak(np.abs(self.ember - self.torch32)),
            "same_weights": peak(self.same_weights),
            "next_loss": peak(self.next_loss, first=1),  # next_loss[0] is step 1's
        }
        if self.torch64 is not None:
            out["free_ember32_vs_torch64"] = peak(np.abs(self.ember - self.torch64))
            out["free_torch32_vs_torch64"] = peak(np.abs(self.torch32 - self.torch64))
        return out


def _torch_model(name: str):
    return torch_model(name)  # the recipes' PyTorch twins (frontends/training/torch_twins.py)


def _batches(x: np.ndarray, y: np.ndarray, batch: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first `steps` batches of the file order (the last may be partial, as in an epoch)."""
    out = []
    for i in range(steps):
        xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
        if not len(xb):
            raise ValueError(f"{steps} steps of batch {batch} need {steps * batch} samples; the data has {len(x)}")
        out.append((np.ascontiguousarray(xb), np.ascontiguousarray(yb)))
    return out


def _torch_free_run(model_name: str, init: Mapping[str, np.ndarray], batches, lr: float, dtype) -> tuple[np.ndarray, Any]:
    """PyTorch trained alone on `batches` in `dtype`; the losses, and its parameters after step 0."""
    import torch
    import torch.nn.functional as tF
    model = _torch_model(model_name)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in init.items()})
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, after_first = [], None
    for i, (xb, yb) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = tF.cross_entropy(model(torch.from_numpy(xb).to(dtype)), torch.from_numpy(yb))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i == 0:
            after_first = {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}
    return np.array(losses), after_first


def run_alignment(model_name: str, x: np.ndarray, y: np.ndarray, *, steps: int = 200, batch_size: int = 64,
                  lr: float = 0.05, device: str = "cpu", threads: int | None = 2, seed: int = 0,
                  init: Mapping[str, np.ndarray] | None = None, float64: bool = True, synchronized: bool = True,
                  log: Callable[[str], None] = lambda s: None) -> Alignment:
    """Trains ember (on `device`) and PyTorch (CPU) side by side; see the module docstring.

    x, y: the training set in file order (flat rows for the MLP). init: initial weights
    (default: PyTorch's initialisation under torch.manual_seed(seed)). Raises ImportError with
    TORCH_MISSING when PyTorch is not installed.
    """
    try:
        import torch
        import torch.nn.functional as tF
    except ImportError:
        raise ImportError(TORCH_MISSING) from None
    if threads:
        torch.set_num_threads(threads)
    seconds: dict[str, float] = {}
    batches = _batches(x, y, batch_size, steps)
    if init is None:
        torch.manual_seed(seed)
        init = {k: v.detach().numpy().copy() for k, v in _torch_model(model_name).state_dict().items()}
    init = {k: np.asarray(v, dtype=np.float32) for k, v in init.items()}
    x0, y0 = batches[0]

    # ---- ember: batch 0 at the initial weights, then the free run ----
    from ..training.recipes import build_model
    t0 = time.perf_counter()
    model = build_model(model_name)
    model.load_state_dict(init)
    log(f"ember: gradient graph for batch 0 on {device} ...")
    loss0_e, grads_e = ember_gradients(model, x0, y0, device)
    log(f"ember: compiling the training step on {device} ...")
    step = ember_compile(model, nn.CrossEntropyLoss(), optim.SGD(lr=lr), example_inputs=(x0, y0), device=device)
    logits0_e = np.array(step.inference(x0))
    seconds["ember_setup"] = time.perf_counter() - t0

    param_names = [k for k, _ in model.named_parameters()]
    ember_losses: list[float] = []
    snapshots: list[dict[str, np.ndarray]] = []  # ember's weights before each step, for the follower
    params_1_e: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    log(f"ember: {steps} steps ...")
    for i, (xb, yb) in enumerate(batches):
        if synchronized:
            current = model.state_dict()  # the trained values on every device
            snapshots.append({k: current[k] for k in param_names})
        ember_losses.append(step(xb, yb))
        if i == 0:
            params_1_e = {k: v.astype(np.float64) for k, v in step.state_dict().items()}
    seconds["ember"] = time.perf_counter() - t0

    # ---- PyTorch following ember: each step taken from ember's weights before that step ----
    # (run after ember's loop, not interleaved with it: two OpenMP runtimes taking turns on the
    # same cores slow each other down several times)
    same, ahead = [], []
    if synchronized:
        t0 = time.perf_counter()
        log(f"PyTorch following ember's weights: {steps} steps ...")
        follower = _torch_model(model_name)
        follower_opt = torch.optim.SGD(follower.parameters(), lr=lr)
        fparams = dict(follower.named_parameters())
        for i, (xb, yb) in enumerate(batches):
            xt, yt = torch.from_numpy(xb), torch.from_numpy(yb)
            if i > 0:  # the follower's loss after its own step from ember's previous weights
                with torch.no_grad():
                    ahead.append(abs(ember_losses[i] - tF.cross_entropy(follower(xt), yt).item()))
            with torch.no_grad():
                for name, value in snapshots[i].items():
                    fparams[name].copy_(torch.from_numpy(value))
            follower_opt.zero_grad(set_to_none=True)
            tl = tF.cross_entropy(follower(xt), yt)
            tl.backward()
            follower_opt.step()
            same.append(abs(ember_losses[i] - tl.item()))
        snapshots.clear()
        seconds["torch_follower"] = time.perf_counter() - t0

    # ---- PyTorch: batch 0 at the initial weights, then the free runs ----
    t0 = time.perf_counter()
    tmodel = _torch_model(model_name)
    tmodel.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
    out = tmodel(torch.from_numpy(x0))
    tloss0 = tF.cross_entropy(out, torch.from_numpy(y0))
    tloss0.backward()
    logits0_t = out.detach().numpy().copy()
    grads_t = {k: p.grad.detach().double().numpy() for k, p in tmodel.named_parameters()}
    log(f"PyTorch float32: {steps} steps ...")
    torch32, params_1_t = _torch_free_run(model_name, init, batches, lr, torch.float32)
    seconds["torch32"] = time.perf_counter() - t0
    torch64 = None
    if float64:
        t0 = time.perf_counter()
        log(f"PyTorch float64: {steps} steps ...")
        torch64, _ = _torch_free_run(model_name, init, batches, lr, torch.float64)
        seconds["torch64"] = time.perf_counter() - t0

    names = list(init)
    norm = lambda a: float(np.linalg.norm(np.asarray(a, dtype=np.float64).ravel()))  # noqa: E731
    return Alignment(
        model=model_name, device=device, steps=steps, batch_size=batch_size, lr=lr, torch_version=torch.__version__,
        threads=torch.get_num_threads(), logits0=(logits0_e, logits0_t), loss0=(loss0_e, tloss0.item()),
        grad_norms=[(n, norm(grads_e[n]), norm(grads_t[n])) for n in names],
        param_norms_1=[(n, norm(params_1_e[n]), norm(params_1_t[n])) for n in names],
        ember=np.array(ember_losses), torch32=torch32, torch64=torch64,
        same_weights=np.array(same) if synchronized else None,
        next_loss=np.array(ahead) if synchronized else None, seconds=seconds)


def format_alignment(a: Alignment, rows: int = 2) -> str:
    le, lt = a.logits0
    s = a.summary()
    fmt = lambda v: np.array2string(v, precision=5, suppress_small=False, max_line_width=200, floatmode="fixed")  # noqa: E731
    lines = [f"MNIST {a.model}: {a.steps} SGD steps (batch {a.batch_size}, lr {a.lr}, training set in file order), "
             f"same initial weights; ember device={a.device} vs PyTorch {a.torch_version} CPU ({a.threads} threads)", "",
             f"logits of batch 0 (first {rows} of {len(le)} samples; largest |diff| over all {le.size}: "
             f"{s['logits0_max_abs_diff']:.2e})"]
    for r in range(min(rows, len(le))):
        lines.append(f"  sample {r}  ember   {fmt(le[r])}")
        lines.append(f"            pytorch {fmt(lt[r])}")
    lines += ["", f"loss of batch 0:  ember {a.loss0[0]:.8f}   pytorch {a.loss0[1]:.8f}   |diff| {s['loss0_abs_diff']:.2e}",
              "", "gradient norms at step 0:", f"  {'parameter':<12} {'ember':>16} {'pytorch':>16} {'rel. diff':>10}"]
    rel = a.grad_rel
    for n, e, t in a.grad_norms:
        lines.append(f"  {n:<12} {e:16.9g} {t:16.9g} {rel[n]:10.2e}")
    lines += ["", "parameter norms after one step:", f"  {'parameter':<12} {'ember':>16} {'pytorch':>16} {'rel. diff':>10}"]
    for n, e, t in a.param_norms_1:
        lines.append(f"  {n:<12} {e:16.9g} {t:16.9g} {abs(e - t) / max(abs(t), 1e-30):10.2e}")

    def peak(key: str) -> str:
        v = s.get(key)
        return "-" if v is None else f"{v[0]:.3e} (step {v[1]})"
    lines += ["", f"loss over {a.steps} steps (ember first {a.ember[0]:.5f}, last {a.ember[-1]:.5f}; "
                  f"pytorch last {a.torch32[-1]:.5f}): largest |diff|"]
    lines.append(f"  free running, ember f32 vs pytorch f32:       {peak('free_ember32_vs_torch32')}")
    if a.same_weights is not None:
        lines.append(f"  same weights each step (pytorch loaded with ember's): {peak('same_weights')}")
        lines.append(f"  one step each from ember's weights (next loss): {peak('next_loss')}")
    if a.torch64 is not None:
        lines.append(f"  free running, ember f32 vs pytorch f64:       {peak('free_ember32_vs_torch64')}")
        lines.append(f"  free running, pytorch f32 vs pytorch f64:     {peak('free_torch32_vs_torch64')}"
                     "   (float32 rounding alone)")
    return "\n".join(lines)


def add_arguments(p: Any) -> None:
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--steps", type=int, default=200, help="training steps to compare (default 200; 938 = one epoch)")
    p.add_argument("--device", default="cpu", metavar="{" + ",".join(target_names()) + "}[:N]", help="ember's device")
    p.add_argument("--data", default=None, metavar="DIR", help="MNIST folder (default: $EMBER_DATA, else ~/.cache/ember/mnist)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=2, help="PyTorch threads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for PyTorch's initialisation")
    p.add_argument("--init-weights", default=None, metavar="FILE", help=".safetensors/.npz state dict to start both from")
    p.add_argument("--no-float64", action="store_true", help="skip the float64 PyTorch run")
    p.add_argument("--no-sync", action="store_true", help="skip the synchronized (same weights) PyTorch follower")
    p.add_argument("--rows", type=int, default=2, help="samples of batch 0 whose logits are printed")
    p.add_argument("--json", action="store_true", help="print the summary figures as JSON too")


def main(args: Any) -> int:
    from .cli_checks import check_device
    check_device(args.device)  # before the data is read: the same line as `ember mnist`
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"ember align: {TORCH_MISSING}", file=sys.stderr)
        return 2
    from ember.runtime.data import IDXError, default_data_dir, load_mnist
    from pathlib import Path

    from ember.frontends.checkpoint import CheckpointError, load_weights
    from ..training.datasets import DownloadError, ensure_mnist
    root = Path(args.data).expanduser() if args.data else default_data_dir()
    try:
        ensure_mnist(root)
        x, y = load_mnist(root, "train", flat=args.model == "mlp")
        init = load_weights(args.init_weights) if args.init_weights else None
        a = run_alignment(args.model, x, y, steps=args.steps, batch_size=args.batch_size, lr=args.lr, device=args.device,
                          threads=args.threads, seed=args.seed, init=init, float64=not args.no_float64,
                          synchronized=not args.no_sync, log=lambda s: print(s, file=sys.stderr, flush=True))
    except (DownloadError, IDXError, CheckpointError, OSError, ValueError, KeyError) as e:
        print(f"ember align: error: {e}", file=sys.stderr)
        return 2
    print(format_alignment(a, rows=args.rows))
    if args.json:
        import json
        print(json.dumps({**{k: v for k, v in asdict(a).items() if k in ("model", "device", "steps", "batch_size", "lr",
                                                                            "torch_version", "threads", "seconds")},
                          **a.summary()}))
    return 0
