"""`ember mnist`: train the MNIST CNN or MLP with a compiled step; and the reusable `Trainer`.

    ember mnist --model cnn --device cpu --epochs 1 --data ../shared/data/mnist

The recipe by default is the reference one (`../shared/reference/torch_mnist.py`): PyTorch's
default initialisation for seed 0 (reproduced bit for bit, see `pytorch_init`), pixels/255, the
training set in file order, batch 64 with the last partial batch kept, plain SGD lr 0.05, mean
cross-entropy, evaluation on the 10k test images after every epoch.

`Trainer` owns the loop: it compiles the step once (`ember.frontends.compile`), feeds it the
loader's batches (views of the arrays in memory; a shuffled batch is gathered per batch), keeps
the loss as Python floats, writes metrics records, evaluates with `step.inference` (the compiled
inference graph on the same parameters) and saves and restores checkpoints. The epoch count is
a target: `--epochs 3 --resume ckpt` trains until 3 epochs are done in all.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ember.runtime import target as get_target
from ember.runtime import target_names

from . import nn, optim
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, load_weights, save_checkpoint
from .cli_checks import (UsageError, check_hyperparameters, check_input_file, check_output_dir, check_output_file,
                         check_plot_file, format_loss)
from .compile import compile as ember_compile
from .metrics import MetricsWriter, correct_count, cross_entropy_sum, read_metrics

__all__ = ["MODELS", "build_model", "pytorch_init", "make_optimizer", "Trainer", "NonFiniteError", "add_arguments",
           "main"]


class NonFiniteError(ValueError):
    """The parameters (or optimizer state) hold NaN or inf: such a state is never saved."""


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 24 * 24, 10))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 30), nn.Sigmoid(), nn.Linear(30, 10))


# name -> (builder, whether it takes flat 784-pixel rows). The same models as torch_mnist.py.
MODELS: dict[str, tuple[Callable[[], nn.Module], bool]] = {"cnn": (_cnn, False), "mlp": (_mlp, True)}

# Where a missing MNIST folder is filled from (a module attribute so tests can point it elsewhere).
MNIST_MIRRORS: tuple[str, ...] | None = None


def pytorch_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Sets `model`'s Linear and Conv2d parameters, in place, to exactly the values PyTorch's
    default initialisation gives on the CPU after `torch.manual_seed(seed)` when the same layers
    are constructed in the same order (as a Sequential is); PyTorch itself is not needed.

    PyTorch's CPU generator is the standard MT19937 (the one NumPy's legacy RandomState runs),
    and `uniform_(a, b)` turns each 32-bit draw r into a + (r mod 2**24) * 2**-24 * (b - a),
    computed in double from the float32 bounds. Each layer draws its weight (kaiming_uniform
    with a=sqrt(5), bound sqrt(3) * sqrt(1/3) / sqrt(fan_in)) and then its bias (bound
    1 / sqrt(fan_in)). Bit-for-bit equality with torch is tested where PyTorch is installed.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32) for PyTorch's initialisation, got {seed}")
    rs = np.random.RandomState(seed)

    def uniform(p: Any, bound: float) -> None:
        raw = rs.randint(0, 2**32, size=p.data.size, dtype=np.uint32)  # full range: the raw MT19937 outputs
        x = (raw & np.uint32(0xFFFFFF)).astype(np.float64) * 2.0**-24
        lo, hi = float(np.float32(-bound)), float(np.float32(bound))
        p.data[...] = (x * (hi - lo) + lo).astype(np.float32).reshape(p.data.shape)

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fan_in = int(np.prod(m.weight.data.shape[1:]))
            uniform(m.weight, math.sqrt(3.0) * (math.sqrt(2.0 / (1 + 5)) / math.sqrt(fan_in)) if fan_in else 0.0)
            if m.bias is not None:
                uniform(m.bias, 1.0 / math.sqrt(fan_in) if fan_in else 0.0)
        elif m._parameters:
            raise NotImplementedError(f"pytorch_init: no PyTorch initialisation rule for {type(m).__name__} ({name!r})")
    return model


INITS = ("torch", "ember")


def build_model(name: str, seed: int = 0, init: str = "torch") -> nn.Module:
    """The named MNIST model. init "torch": PyTorch's default initialisation for `seed`, bit for
    bit (what the reference recipe, torch_mnist.py, starts from); "ember": ember's own
    generator (`nn.manual_seed(seed)`), the same distributions but other values."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected one of {INITS}")
    nn.manual_seed(seed)
    model = MODELS[name][0]()
    return pytorch_init(model, seed) if init == "torch" else model


def make_optimizer(name: str, lr: float, momentum: float = 0.0) -> optim.Optimizer:
    if name == "sgd":
        return optim.SGD(lr=lr, momentum=momentum)
    if name == "adam":
        if momentum:
            raise ValueError("--momentum applies to SGD; Adam's moment decay is its betas (0.9, 0.999)")
        return optim.Adam(lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; expected 'sgd' or 'adam'")


class Trainer:
    """Trains `model` with a compiled step on in-memory arrays; evaluates, logs and checkpoints.

    train, test: (x, y) arrays (float32 inputs, int64 labels); test may be None.
    limit_steps: stop each epoch after this many steps (CI and smoke runs). loss_fn: the training
    loss (default cross-entropy; evaluation reports cross-entropy and accuracy of the logits).
    metrics: a MetricsWriter (or None) that receives every record; records are also kept in
    `self.records`. config: settings stored in checkpoints and in the run record.
    """

    def __init__(self, model: nn.Module, optimizer: Any, train: tuple[np.ndarray, np.ndarray],
                 test: tuple[np.ndarray, np.ndarray] | None = None, *, device: str = "cpu", batch_size: int = 64,
                 shuffle: bool = False, seed: int = 0, eval_batch_size: int = 1000, limit_steps: int | None = None,
                 log_every: int = 50, metrics: MetricsWriter | None = None, progress: bool = False,
                 dump_dir: str | os.PathLike | None = None, config: dict[str, Any] | None = None,
                 print_fn: Callable[[str], None] | None = None, loss_fn: Callable[[Any, Any], Any] | None = None) -> None:
        from ember.runtime.data import DataLoader

        x, y = train
        if len(x) == 0:
            raise ValueError("the training set is empty")
        self.model = model
        self.device = device
        self.loader = DataLoader(x, y, batch_size, shuffle=shuffle, seed=seed)
        self.test = test
        self.eval_batch_size = eval_batch_size
        self.limit_steps = limit_steps
        self.log_every = log_every
        self.metrics = metrics
        self.progress = progress
        self.config = dict(config or {})
        self.print = print_fn or print
        self.records: list[dict[str, Any]] = []
        self.epoch = 0           # epochs completed
        self.global_step = 0     # steps completed, all epochs
        self.step_in_epoch = 0   # steps done in epoch `self.epoch` (nonzero only after a mid-epoch stop)
        self.stop_requested = False  # set (e.g. by a signal handler) to stop after the current step
        self.diverged: dict[str, Any] | None = None  # the "diverged" record once the loss is not finite
        self.target_epochs: int | None = None  # fit()'s goal, for the progress bar
        self._t0 = time.perf_counter()
        t0 = time.perf_counter()
        first = min(batch_size, len(x))
        self.step = ember_compile(model, loss_fn or nn.CrossEntropyLoss(), optimizer, example_inputs=(x[:first], y[:first]),
                                  device=device, dump_dir=dump_dir)
        # The last partial batch has its own shape: compile its step now, not mid-epoch.
        last = len(x) % batch_size if len(x) > batch_size else 0
        reaches_end = not self.limit_steps or self.limit_steps >= len(self.loader)
        if last and reaches_end and not getattr(self.loader, "drop_last", False):
            self.step.precompile((last, *x.shape[1:]))
        self.compile_seconds = time.perf_counter() - t0

    # ---- records -----------------------------------------------------------------------------
    def record(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        if self.metrics is not None:
            self.metrics.write(rec)

    def run_record(self, **extra: Any) -> dict[str, Any]:
        rec = {"type": "run", **self.config, "device": self.device, "batch_size": self.loader.batch_size,
               "shuffle": self.loader.shuffle, "seed": self.loader.seed, "limit_steps": self.limit_steps,
               "compile_seconds": round(self.compile_seconds, 4), "peak_bytes": self.step.peak_bytes,
               "start_epoch": self.epoch, "start_step": self.global_step, **extra}
        self.record(rec)
        return rec

    # ---- training ----------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        n = len(self.loader)
        return min(n, self.limit_steps) if self.limit_steps else n

    def train_epoch(self) -> dict[str, Any]:
        """Trains epoch `self.epoch` (from `step_in_epoch` on), evaluates, returns its record.

        If `stop_requested` becomes true mid-epoch, returns early with {"type": "stopped", ...}
        and leaves epoch/step counters where they are (a checkpoint then resumes mid-epoch).
        """
        from tqdm import tqdm

        loader, step, log_every, show = self.loader, self.step, self.log_every, self.progress
        loader.set_epoch(self.epoch)
        total, skip = self.steps_per_epoch(), self.step_in_epoch
        epoch_no = self.epoch + 1
        desc = f"epoch {epoch_no}" + (f"/{self.target_epochs}" if self.target_epochs else "")
        bar = tqdm(total=total, initial=skip, desc=desc, unit="step", disable=not self.progress,
                   file=sys.stderr, dynamic_ncols=True, leave=True)
        loss_sum = batch_loss_sum = 0.0  # per-sample sum and per-batch sum, over this run's part of the epoch
        samples = steps = 0
        interval_loss, interval_samples, interval_steps = 0.0, 0, 0
        t_start = t_interval = t_bar = time.perf_counter()
        stopped = False
        for i, (xb, yb) in enumerate(loader):
            if i >= total:
                break
            if i < skip:  # resuming mid-epoch: the order is reproducible, skip what was done
                continue
            loss = step(xb, yb)
            if not math.isfinite(loss):
                # every later step would train on NaN too: stop here, and never save this state
                self.global_step += 1
                self.step_in_epoch = i + 1
                bar.close()
                self.diverged = {"type": "diverged", "epoch": epoch_no, "step": self.global_step,
                                 "step_in_epoch": self.step_in_epoch, "loss": loss}
                self.record(self.diverged)
                return self.diverged
            n = len(yb)
            loss_sum += loss * n
            batch_loss_sum += loss
            samples += n
            steps += 1
            interval_loss += loss
            interval_samples += n
            interval_steps += 1
            self.global_step += 1
            self.step_in_epoch = i + 1
            if log_every and self.global_step % log_every == 0:
                now = time.perf_counter()
                self.record({"type": "step", "epoch": epoch_no, "step": self.global_step, "loss": loss,
                             "loss_avg": interval_loss / interval_steps,
                             "samples_per_s": interval_samples / max(now - t_interval, 1e-12),
                             "time": now - self._t0})
                interval_loss, interval_samples, interval_steps, t_interval = 0.0, 0, 0, now
            if show:
                bar.update(1)
                now = time.perf_counter()
                if now - t_bar > 0.5:
                    bar.set_postfix_str(f"loss {format_loss(batch_loss_sum / steps)}, "
                                        f"{samples / (now - t_start):.0f} samples/s", refresh=False)
                    t_bar = now
            if self.stop_requested:
                stopped = self.step_in_epoch < total
                break
        epoch_seconds = time.perf_counter() - t_start
        if show and steps:
            bar.set_postfix_str(f"loss {format_loss(batch_loss_sum / steps)}, {samples / epoch_seconds:.0f} samples/s")
        bar.close()
        if stopped:
            return {"type": "stopped", "epoch": epoch_no, "step": self.global_step, "step_in_epoch": self.step_in_epoch}
        rec: dict[str, Any] = {"type": "epoch", "epoch": epoch_no, "step": self.global_step, "steps": steps,
                               "samples": samples, "train_loss": loss_sum / max(samples, 1),
                               "train_loss_batch_mean": batch_loss_sum / max(steps, 1)}
        if skip:
            rec["resumed_at_step_in_epoch"] = skip
        t_eval = time.perf_counter()
        if self.test is not None:
            rec["test_loss"], rec["test_acc"] = self.evaluate()
        rec.update(samples_per_s=samples / max(epoch_seconds, 1e-12), epoch_seconds=epoch_seconds,
                   eval_seconds=time.perf_counter() - t_eval, time=time.perf_counter() - self._t0)
        self.epoch += 1
        self.step_in_epoch = 0
        self.record(rec)
        return rec

    def evaluate(self, data: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[float, float]:
        """(mean cross-entropy, accuracy) of the current parameters on `data` (default: the test
        set), through the compiled inference graph in batches of `eval_batch_size`."""
        x, y = data if data is not None else self.test  # type: ignore[misc]
        bs = self.eval_batch_size
        loss = 0.0
        correct = 0
        for s in range(0, len(x), bs):
            logits = self.step.inference(x[s:s + bs])
            loss += cross_entropy_sum(logits, y[s:s + bs])
            correct += correct_count(logits, y[s:s + bs])
        return loss / len(x), correct / len(x)

    def fit(self, epochs: int, save: str | os.PathLike | None = None,
            on_epoch: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Trains until `epochs` epochs are done in all (a resumed trainer continues its count);
        saves a checkpoint to `save` after every epoch and when stopped early."""
        done = []
        self.target_epochs = epochs
        while self.epoch < epochs:
            rec = self.train_epoch() if not self.stop_requested else {"type": "stopped"}
            if rec["type"] == "diverged":
                break
            if rec["type"] != "stopped":
                done.append(rec)
                if on_epoch is not None:
                    on_epoch(rec)
            if not self.finite():  # a finite loss, but the update it computed overflowed
                self.diverged = {"type": "diverged", "epoch": self.epoch + (self.step_in_epoch > 0),
                                 "step": self.global_step, "step_in_epoch": self.step_in_epoch, "loss": None,
                                 "reason": "parameters"}
                self.record(self.diverged)
                break
            if save is not None:
                self.save(save)
            if rec["type"] == "stopped":
                break
        return done

    def finite(self) -> bool:
        """Whether every parameter and optimizer state value is finite."""
        return all(np.isfinite(v).all() for v in (*self.step.state_dict().values(),
                                                   *self.step.optimizer_state_dict().values()))

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Writes a checkpoint atomically; raises NonFiniteError (writing nothing) if the state
        holds NaN or inf, so a diverged run never overwrites a good checkpoint."""
        if not self.finite():
            raise NonFiniteError(f"{path}: not written: the parameters or optimizer state are not finite")
        save_checkpoint(path, self.step.state_dict(), self.step.optimizer_state_dict(), epoch=self.epoch,
                        step=self.global_step, step_in_epoch=self.step_in_epoch, config=self.config)

    def load(self, source: "str | os.PathLike | Checkpoint", check: tuple[str, ...] = ("model", "optimizer")) -> None:
        """Restores parameters, optimizer state and progress from a checkpoint (a path or a loaded
        `Checkpoint`). The settings in `check` must match (a mismatch raises CheckpointError)."""
        ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
        where = ckpt.path if isinstance(source, Checkpoint) else source
        check_config(ckpt, self.config, check, where)
        try:
            self.step.load_state_dict(ckpt.model)
            self.step.load_optimizer_state_dict(ckpt.optimizer)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{where}: does not fit this model and optimizer: {e}") from None
        self.epoch, self.global_step, self.step_in_epoch = ckpt.epoch, ckpt.step, ckpt.step_in_epoch
        self.resumed_config = ckpt.config


def check_config(ckpt: Checkpoint, config: dict[str, Any], keys: tuple[str, ...], where: Any) -> None:
    for key in keys:
        have, want = ckpt.config.get(key), config.get(key)
        if have is not None and want is not None and have != want:
            raise CheckpointError(f"{where}: checkpoint was written with {key}={have!r}, this run has {key}={want!r}")


# ---- the command ---------------------------------------------------------------------------------

def add_arguments(p: Any) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="cnn", help="cnn (default) or mlp")
    p.add_argument("--device", choices=target_names(), default="cpu",
                   help="cpu (compiled C++, default), reference (NumPy interpreter) or cuda")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="folder with the MNIST IDX files (default: $EMBER_DATA, else ~/.cache/ember/mnist, "
                        "where missing files are downloaded, md5-checked)")
    p.add_argument("--download", action="store_true",
                   help="download the MNIST files missing from --data DIR (the default folder downloads anyway)")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train in all (a resumed run continues the count)")
    p.add_argument("--batch-size", type=int, default=64, help="training batch (default 64; the last partial batch is kept)")
    p.add_argument("--eval-batch-size", type=int, default=1000, help="test-set batch of the inference graph (default 1000)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the shuffled order")
    p.add_argument("--init", choices=INITS, default="torch",
                   help="initial weights: torch (default): PyTorch's default initialisation for --seed, bit for bit, "
                        "as the reference recipe (PyTorch not needed); ember: ember's own generator")
    p.add_argument("--shuffle", action="store_true", help="a new seeded order each epoch (default: file order)")
    p.add_argument("--init-weights", default=None, metavar="FILE",
                   help="initial weights: .safetensors or .npz with a PyTorch-style state dict "
                        "(e.g. torch_mnist.py --dump-init FILE.npz)")
    p.add_argument("--save", default=None, metavar="FILE",
                   help="checkpoint (safetensors) written atomically after every epoch, and on Ctrl-C; "
                        "never with non-finite parameters")
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="continue from a checkpoint written by --save (model, optimizer state, epoch and step; "
                        "--init/--init-weights are then ignored)")
    p.add_argument("--metrics-file", default=None, metavar="FILE",
                   help="JSON-lines metrics (step and epoch records); a resumed run appends")
    p.add_argument("--log-every", type=int, default=50, metavar="N", help="a step record every N steps (default 50)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="loss and accuracy curves at the end (matplotlib)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="TensorBoard event files in DIR: step loss, epoch train/test loss and accuracy "
                        "(needs tensorboardX: pip install 'ember[tensorboard]')")
    p.add_argument("--dump-kernels", default=None, metavar="DIR",
                   help="write the graphs after every pass and the generated sources to DIR")
    p.add_argument("--limit-steps", type=int, default=None, metavar="N", help="stop each epoch after N steps")
    p.add_argument("--threads", type=int, default=None, help="OpenMP threads of the cpu device (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _error(msg: str) -> int:
    print(f"ember mnist: error: {msg}", file=sys.stderr)
    return 2


def _check_args(args: Any) -> None:
    """Everything that can be checked before reading data or compiling: numbers, then every
    path the run will write (so a typo fails now, not after an epoch or after all of them)."""
    for name in ("epochs", "batch_size", "eval_batch_size", "limit_steps", "threads", "log_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: expected an integer >= 1")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed {args.seed}: expected an integer in [0, 2**32)")
    check_hyperparameters(args.lr, args.momentum)
    if args.save:
        check_output_file("--save", args.save)
    if args.metrics_file:
        check_output_file("--metrics-file", args.metrics_file)
    if args.plot:
        check_plot_file("--plot", args.plot)
    if args.dump_kernels:
        check_output_dir("--dump-kernels", args.dump_kernels)
    elif os.environ.get("EMBER_DUMP_DIR"):
        check_output_dir("EMBER_DUMP_DIR", os.environ["EMBER_DUMP_DIR"])
    if args.tensorboard:
        check_output_dir("--tensorboard", args.tensorboard)
        try:
            import tensorboardX  # noqa: F401  (fail now, not after the compile)
        except ImportError:
            from .trackers import TENSORBOARD_MISSING
            raise UsageError(TENSORBOARD_MISSING) from None
    if args.resume:
        check_input_file("--resume", args.resume, "a checkpoint file written by --save")
    elif args.init_weights:
        check_input_file("--init-weights", args.init_weights, "a .safetensors or .npz weights file")


def _prepare_data(args: Any) -> Path:
    """The MNIST folder. The default one is filled by downloading; a folder given with --data
    only with --download, so a typo is reported instead of filled with a fresh download."""
    from ember.runtime.data import MNIST_FILES, default_data_dir, ensure_mnist, find_mnist_file

    explicit = args.data is not None
    root = Path(args.data).expanduser() if explicit else default_data_dir()
    where = f"--data {root}" if explicit else f"the MNIST folder {root}"
    if root.exists() and not root.is_dir():
        raise UsageError(f"{where}: is a file; expected a folder holding the four MNIST IDX files")
    stems = [s for pair in MNIST_FILES.values() for s in pair]
    missing = [s for s in stems if find_mnist_file(root, s) is None]
    if missing and explicit and not args.download:
        if not root.exists():
            raise UsageError(f"--data {root}: no such folder; expected the folder holding the four MNIST IDX files "
                             f"(add --download to download them there)")
        raise UsageError(f"--data {root}: {len(missing)} of the 4 MNIST files missing ({', '.join(missing)}); "
                         f"add --download to download them there")
    if missing:
        if root.exists() or root.parent.exists():
            check_output_dir("--data" if explicit else "MNIST folder", root)
        print(f"MNIST: {len(missing)} of 4 files missing in {root}; downloading them (md5-checked)", file=sys.stderr)
        kwargs = {"mirrors": MNIST_MIRRORS} if MNIST_MIRRORS is not None else {}
        ensure_mnist(root, **kwargs)
    return root


def _epoch_line(rec: dict[str, Any], epochs: int, n_test: int) -> str:
    train = f"train loss {format_loss(rec['train_loss'])}"
    if rec.get("resumed_at_step_in_epoch"):
        # the steps before the resume ran in another process: their losses are not in this mean
        train += f" (steps {rec['resumed_at_step_in_epoch'] + 1}-{rec['resumed_at_step_in_epoch'] + rec['steps']} " \
                 f"of the epoch only, those run since the resume)"
    return (f"epoch {rec['epoch']}/{epochs}: {train}, test loss {format_loss(rec['test_loss'])}, test accuracy "
            f"{100 * rec['test_acc']:.2f}% ({round(rec['test_acc'] * n_test)}/{n_test}); {rec['epoch_seconds']:.1f} s, "
            f"{rec['samples_per_s']:.0f} samples/s")


def _divergence_message(d: dict[str, Any], args: Any) -> str:
    if d.get("loss") is not None:
        what = f"the training loss became {d['loss']} at epoch {d['epoch']}, step {d['step']}"
    else:
        what = f"the parameters became non-finite (NaN or inf) by epoch {d['epoch']}, step {d['step']}"
    msg = f"{what}; stopped. Try a lower --lr (this run: {args.lr})"
    if args.save:
        kept = "keeps its previous contents" if Path(args.save).exists() else "was not written"
        msg += f"; --save {args.save} {kept} (non-finite parameters are never saved)"
    return msg


def main(args: Any) -> int:
    from ember.runtime.data import DownloadError, IDXError, load_mnist

    if args.device not in target_names():
        return _error(f"--device {args.device}: no such backend; available: {', '.join(target_names())}")
    device_check = get_target(args.device).available
    if device_check is not None:
        try:
            device_check()
        except RuntimeError as exc:
            return _error(f"--device {args.device}: {exc}")
    _check_args(args)
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read when the first compiled step loads

    try:
        root = _prepare_data(args)
        flat = MODELS[args.model][1]
        x_train, y_train = load_mnist(root, "train", flat=flat)
        x_test, y_test = load_mnist(root, "test", flat=flat)
    except DownloadError as e:
        return _error(str(e))
    except (IDXError, FileNotFoundError, OSError) as e:
        return _error(f"{e}\n(pass --data DIR, the folder holding the four MNIST IDX files)")
    for split, x in (("training", x_train), ("test", x_test)):
        if len(x) == 0:
            return _error(f"--data {root}: the {split} set holds no images; expected the MNIST IDX files")

    config = {"model": args.model, "optimizer": args.optimizer, "lr": args.lr, "momentum": args.momentum,
              "init": args.init_weights or f"{args.init} seed {args.seed}"}
    try:
        model = build_model(args.model, args.seed, args.init)
        if args.init_weights and not args.resume:
            try:
                weights = load_weights(args.init_weights)
            except CheckpointError as e:  # it names the file and the fault; add the flag
                raise UsageError(f"--init-weights {e}") from None
            try:
                model.load_state_dict(weights)
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{args.init_weights}: does not fit the {args.model} model: {e}") from None
        opt = make_optimizer(args.optimizer, args.lr, args.momentum)
    except (ValueError, OSError) as e:
        return _error(str(e))

    ckpt = None
    if args.resume:  # read and check it before compiling anything
        try:
            ckpt = load_checkpoint(args.resume)
            check_config(ckpt, config, ("model", "optimizer"), args.resume)
        except (CheckpointError, OSError) as e:
            return _error(str(e))
        if ckpt.epoch >= args.epochs:
            print(f"nothing to do: {args.resume} has {ckpt.epoch} epoch(s) done and --epochs is {args.epochs} "
                  f"(the epoch count is the total; pass a larger --epochs to continue)")
            return 0

    started = time.perf_counter()
    print(f"ember mnist: {args.model} on {args.device}, {args.optimizer} lr {args.lr}"
          + (f" momentum {args.momentum}" if args.momentum else "")
          + f", batch {args.batch_size}, {len(x_train)} training / {len(x_test)} test images from {root}", flush=True)
    trainer = Trainer(model, opt, (x_train, y_train), (x_test, y_test), device=args.device,
                      batch_size=args.batch_size, shuffle=args.shuffle, seed=args.seed,
                      eval_batch_size=args.eval_batch_size, limit_steps=args.limit_steps, log_every=args.log_every,
                      progress=not args.no_progress, dump_dir=args.dump_kernels, config=config)
    print(f"compiled the training step in {trainer.compile_seconds:.2f} s"
          + (f" (planned peak memory {trainer.step.peak_bytes / 2**20:.1f} MiB)" if trainer.step.peak_bytes else ""),
          flush=True)
    if ckpt is not None:
        try:
            trainer.load(ckpt)
        except (CheckpointError, OSError) as e:
            return _error(str(e))
        print(f"resumed from {args.resume}: {trainer.epoch} epoch(s), {trainer.global_step} steps done"
              + (f" ({trainer.step_in_epoch} into epoch {trainer.epoch + 1})" if trainer.step_in_epoch else ""),
              flush=True)
    writers: list[Any] = []
    if args.metrics_file:
        writers.append(MetricsWriter(args.metrics_file, mode="a" if args.resume else "w"))
    if args.tensorboard:
        from .trackers import TensorBoardWriter
        writers.append(TensorBoardWriter(args.tensorboard))
    if writers:
        from .trackers import Tee
        trainer.metrics = writers[0] if len(writers) == 1 else Tee(writers)
    trainer.run_record(epochs=args.epochs, resumed_from=args.resume, threads=args.threads)

    def on_epoch(rec: dict[str, Any]) -> None:
        trainer.print(_epoch_line(rec, args.epochs, len(x_test)))
        sys.stdout.flush()

    def on_sigint(signum: int, frame: Any) -> None:
        if trainer.stop_requested:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        print("\ninterrupted: stopping after this step" + (f" and saving {args.save}" if args.save else "")
              + " (Ctrl-C again to abort at once)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
    try:
        trainer.fit(args.epochs, save=args.save, on_epoch=on_epoch)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if trainer.metrics is not None:
            trainer.metrics.close()
    if trainer.diverged is not None:
        print(f"ember mnist: error: {_divergence_message(trainer.diverged, args)}", file=sys.stderr)
        return 1  # the run failed, not its arguments (those exit 2)
    if trainer.stop_requested and trainer.epoch < args.epochs:
        print(f"stopped at step {trainer.global_step}" + (f"; resume with --resume {args.save}" if args.save else ""))
        return 130
    if args.save:
        print(f"saved {args.save}")
    if args.plot:
        from .plot import plot_metrics, run_title
        records = read_metrics(args.metrics_file) if args.metrics_file else trainer.records
        plot_metrics(records, args.plot, title=run_title(records))
        print(f"wrote {args.plot}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
