"""`ember mnist`'s training options: optimizer details, learning-rate schedule, label smoothing,
the validation split, the dataset, evaluation (test-time augmentation, a target accuracy) and
the run folder (`--output-dir`).

Split out of `mnist.py`, which keeps the run itself; everything here runs before any data is
read or step compiled (the checks), or sets the run up (data, split, folder).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ember.frontends.checkpoint import atomic_write_bytes

from ..training.datasets import DATASETS
from ..training.recipes import LR_SCHEDULES, WARMUP_START_FACTOR, LRSchedule
from .cli_checks import UsageError, check_output_dir

__all__ = ["add_training_arguments", "check_training_args", "lr_schedule", "split_validation", "run_folder",
           "write_config", "parse_shifts", "seconds_since_start", "CHECKPOINT", "METRICS", "CURVES", "CONFIG"]

# the files of a run folder (--output-dir)
CHECKPOINT, METRICS, CURVES, CONFIG = "checkpoint.safetensors", "metrics.jsonl", "curves.png", "config.json"
_RUN = re.compile(r"run-(\d+)$")


def add_training_arguments(p: Any) -> None:
    p.add_argument("--dataset", choices=sorted(DATASETS), default="mnist",
                   help="which IDX dataset: its default folder is $EMBER_DATA or ~/.cache/ember/mnist (mnist), "
                        "the system package's folder or ~/.cache/ember/fashion-mnist (fashion-mnist); missing "
                        "files there are downloaded and md5-checked; --data DIR wins")
    p.add_argument("--weight-decay", type=float, default=None, metavar="WD",
                   help="weight decay as torch.optim's: an L2 term added to the gradient (sgd, adam) or decoupled "
                        "(adamw); default: torch's, 0 for sgd and adam, 0.01 for adamw")
    p.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum (needs --momentum > 0)")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                   help="the learning rate per step, computed inside the compiled step over the run's epochs x steps "
                        "per epoch (as torch.optim.lr_scheduler): cosine: CosineAnnealingLR to 0 at the end; "
                        "linear: LinearLR to 0 at the end; step: StepLR (--lr-step-size, --lr-gamma); onecycle: "
                        "OneCycleLR with max_lr --lr (momentum not cycled)")
    p.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                   help=f"a linear warm-up from {WARMUP_START_FACTOR:g} x --lr to --lr over the first N steps "
                        "(LinearLR), then the schedule over the remaining steps (SequentialLR, milestone N); "
                        "onecycle: N steps of rise (its pct_start)")
    p.add_argument("--lr-step-size", type=int, default=None, metavar="N",
                   help="--lr-schedule step: multiply the rate by --lr-gamma every N steps")
    p.add_argument("--lr-gamma", type=float, default=None, metavar="GAMMA",
                   help="--lr-schedule step: the factor every --lr-step-size steps (default 0.1)")
    p.add_argument("--label-smoothing", type=float, default=0.0, metavar="E",
                   help="training loss: cross-entropy with label smoothing E in [0, 1) (as F.cross_entropy); "
                        "test and validation losses stay plain cross-entropy")
    p.add_argument("--val-split", type=float, default=None, metavar="F",
                   help="hold out the last fraction F of the training set (in file order, before any shuffle or "
                        "sharding) and evaluate it after every epoch; every data-parallel rank holds all of it")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="a run folder DIR/run-001, run-002, ... (the next free number; --resume of a checkpoint "
                        "inside one continues there) holding metrics.jsonl, checkpoint.safetensors (each epoch), "
                        "curves.png (with matplotlib) and config.json; --save, --metrics-file and --plot still win")
    p.add_argument("--target-acc", type=float, default=None, metavar="A",
                   help="stop once the test accuracy reaches A (a fraction, e.g. 0.99), evaluating after every epoch "
                        "and every --eval-every steps; prints the time to it: training seconds (compile and "
                        "evaluations excluded) and wall seconds since the command started")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="also evaluate the test set every N steps (on the device, one read back each)")
    p.add_argument("--tta", default=None, metavar="DY:DX[,DY:DX...]",
                   help="test-time augmentation: evaluate the logits averaged over the images and their copies "
                        "moved by each DY:DX pixels (zeros fill the border), e.g. --tta=0:1,0:-1")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="also write the checkpoint every N steps (atomically; a mid-epoch one resumes at its step); "
                        "needs --save or --output-dir")


def lr_schedule(args: Any) -> LRSchedule | None:
    """The schedule the flags ask for (None: constant, no warm-up)."""
    if args.lr_schedule == "constant" and not args.warmup_steps:
        return None
    return LRSchedule(args.lr_schedule, args.warmup_steps, args.lr_step_size,
                      0.1 if args.lr_gamma is None else args.lr_gamma)


def check_training_args(args: Any) -> None:
    """The new options' numbers and paths, before anything is read or compiled."""
    if args.resume and Path(args.resume).expanduser().is_dir() and (Path(args.resume).expanduser() / CHECKPOINT).exists():
        args.resume = os.fspath(Path(args.resume).expanduser() / CHECKPOINT)  # a run folder: its checkpoint
    wd = args.weight_decay
    if wd is not None and (not math.isfinite(wd) or wd < 0):
        raise UsageError(f"--weight-decay {wd}: expected a finite weight decay >= 0")
    if args.nesterov and args.optimizer != "sgd":
        raise UsageError(f"--nesterov: applies to --optimizer sgd (with --momentum > 0), not {args.optimizer}")
    if args.nesterov and args.momentum <= 0:
        raise UsageError("--nesterov: Nesterov momentum requires a momentum and zero dampening; add --momentum M > 0")
    if args.momentum and args.optimizer != "sgd":
        raise UsageError(f"--momentum {args.momentum}: applies to --optimizer sgd; {args.optimizer}'s moment decay "
                         f"is its betas (0.9, 0.999)")
    if args.lr_schedule != "step":
        for flag, value in (("--lr-step-size", args.lr_step_size), ("--lr-gamma", args.lr_gamma)):
            if value is not None:
                raise UsageError(f"{flag} {value}: applies to --lr-schedule step (this run: {args.lr_schedule})")
    try:
        lr_schedule(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not (math.isfinite(args.label_smoothing) and 0 <= args.label_smoothing < 1):
        raise UsageError(f"--label-smoothing {args.label_smoothing}: expected a number in [0, 1)")
    if args.target_acc is not None and not (math.isfinite(args.target_acc) and 0 < args.target_acc <= 1):
        raise UsageError(f"--target-acc {args.target_acc}: expected a test accuracy in (0, 1], e.g. 0.99")
    if args.eval_every is not None and args.eval_every < 1:
        raise UsageError(f"--eval-every {args.eval_every}: expected an integer >= 1 (steps)")
    if args.tta is not None:
        parse_shifts("--tta", args.tta)
    if args.val_split is not None and not (math.isfinite(args.val_split) and 0 < args.val_split < 1):
        raise UsageError(f"--val-split {args.val_split}: expected a fraction of the training set in (0, 1), e.g. 0.1")
    if args.save_every is not None:
        if args.save_every < 1:
            raise UsageError(f"--save-every {args.save_every}: expected an integer >= 1 (steps)")
        if not args.save and not args.output_dir:
            raise UsageError(f"--save-every {args.save_every}: needs a checkpoint file: add --save FILE or "
                             f"--output-dir DIR")
    if args.output_dir is not None:
        check_output_dir("--output-dir", args.output_dir)


def parse_shifts(flag: str, text: str) -> tuple[tuple[int, int], ...]:
    """"DY:DX,DY:DX..." -> ((dy, dx), ...): pixel shifts, each a pair of integers."""
    shifts = []
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        dy, sep, dx = part.partition(":")
        try:
            shifts.append((int(dy), int(dx)))
        except ValueError:
            raise UsageError(f"{flag} {text}: {part!r} is not DY:DX; expected pixel shifts such as 0:1,0:-1") from None
        if not sep:
            raise UsageError(f"{flag} {text}: {part!r} is not DY:DX; expected pixel shifts such as 0:1,0:-1")
    if not shifts:
        raise UsageError(f"{flag} {text!r}: no shift given; expected pixel shifts such as 0:1,0:-1")
    return tuple(shifts)


def seconds_since_start() -> float | None:
    """Wall seconds since this process started (Python's start-up and imports included), from
    /proc (10 ms resolution); None where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


def split_validation(x: np.ndarray, y: np.ndarray, fraction: float | None
                     ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """(train, val): the last round(fraction x n) samples in file order held out. Deterministic
    and seed-independent, so a resumed run, every rank and a rerun hold out the same images."""
    if fraction is None:
        return (x, y), None
    n_val = round(fraction * len(x))
    if n_val < 1 or n_val >= len(x):
        raise UsageError(f"--val-split {fraction}: holds out {n_val} of {len(x)} training images; expected at "
                         f"least one in each part")
    cut = len(x) - n_val
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def run_folder(output_dir: str | os.PathLike, resume: str | None) -> Path:
    """The run folder under `output_dir`: the one holding the --resume checkpoint, if it is a
    run-NNN folder directly inside; else a new run-NNN, one past the highest number there."""
    root = Path(output_dir).expanduser()
    if resume:
        parent = Path(resume).expanduser().resolve().parent
        if _RUN.match(parent.name) and root.exists() and parent.parent == root.resolve():
            return parent
    root.mkdir(parents=True, exist_ok=True)
    while True:  # another run starting in the same folder at once takes the next number
        taken = [int(m.group(1)) for p in root.iterdir() if (m := _RUN.match(p.name)) and p.is_dir()]
        folder = root / f"run-{max(taken, default=0) + 1:03d}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def resumed_run_folder(resume: str | None) -> Path | None:
    """The run folder (`--output-dir`'s run-NNN, its config.json written) holding the --resume
    checkpoint, or None: a resumed run continues there even without --output-dir, rather than
    training on and writing nothing (no checkpoint, no metrics)."""
    if not resume:
        return None
    parent = Path(resume).expanduser().resolve().parent
    return parent if _RUN.match(parent.name) and (parent / "config.json").is_file() else None


def use_run_folder(args: Any, folder: Path) -> list[str]:
    """Points the outputs not given explicitly into `folder`; returns notes to print."""
    notes = []
    if not args.save:
        args.save = os.fspath(folder / CHECKPOINT)
    if not args.metrics_file:
        args.metrics_file = os.fspath(folder / METRICS)
    if not args.plot:
        try:
            import matplotlib  # noqa: F401
            args.plot = os.fspath(folder / CURVES)
        except ImportError:
            notes.append(f"{folder / CURVES} skipped: matplotlib is not installed (pip install 'ember[plot]')")
    return notes


def write_config(folder: Path, args: Any, extra: dict[str, Any]) -> Path:
    """config.json: every option of the command as given (after defaults), and `extra`."""
    config = {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (str, int, float, bool, type(None)))}
    config.update(extra)
    path = folder / CONFIG
    atomic_write_bytes(path, (json.dumps(config, indent=1) + "\n").encode("utf-8"))
    return path


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr, flush=True)
