"""`ember mnist`: train an MNIST model (cnn, mlp, lenet5, resnet8) with a compiled step.

    ember mnist --model cnn --device cpu --epochs 1 --data ../shared/data/mnist

The recipe by default is the reference one (`../shared/reference/torch_mnist.py`): PyTorch's
default initialisation for seed 0 (reproduced bit for bit, see `pytorch_init`), pixels/255, the
training set in file order, batch 64 with the last partial batch kept, plain SGD lr 0.05, mean
cross-entropy, evaluation on the 10k test images after every epoch.

The command checks its arguments, reads (and if asked downloads) the data, builds the recipe
(`ember.frontends.training.recipes`) and hands the loop to `ember.frontends.training.Trainer`.
The epoch count is a target: `--epochs 3 --resume ckpt` trains until 3 epochs are done in all.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ember.runtime import target_names
from ember.runtime.comm import WorldError, world_from_env
from ember.runtime.consistency import ConsistencyError

from ember.frontends import nn
from ember.frontends.checkpoint import CheckpointError, load_checkpoint, load_weights
from ..training.metrics import MetricsWriter, format_loss, read_metrics
from ..training.recipes import INITS, MODELS, OPTIMIZERS, RECIPES, build_model, has_random_translation, make_optimizer
from ..training.trainer import Trainer, check_config
from . import mnist_setup as setup
from .cli_checks import (UsageError, check_device, check_hyperparameters, check_input_file, check_output_dir,
                         check_output_file, check_plot_file, describe_os_error, precision_flag)

__all__ = ["add_arguments", "recipe_defaults", "main"]

# Where a missing dataset folder is filled from (a module attribute so tests can point it elsewhere;
# None: the dataset's own mirrors).
MNIST_MIRRORS: tuple[str, ...] | None = None


def add_arguments(p: Any) -> None:
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="a named recipe's settings as the defaults (options given here win): "
                        + "; ".join(f"{name}: {r.description}" for name, r in RECIPES.items()).replace("%", "%%"))
    # default None until the recipe's settings are known (`recipe_defaults`), then cnn (`main`)
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="cnn (default), mlp, lenet5, resnet8 or speednet (the speedrun recipe's)")
    p.add_argument("--device", default="cpu", metavar="{" + ",".join(target_names()) + "}[:N]",
                   help="cpu (compiled C++, default), reference (NumPy interpreter) or cuda")
    p.add_argument("--tf32", action="store_true",
                   help="cuda: matmuls and convolutions on TF32 tensor cores (compile(..., precision='tf32'), "
                        "as PyTorch's allow_tf32); default: exact float32")
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision as torch.autocast(dtype=torch.bfloat16): matmuls and convolutions on bfloat16 "
                        "with float32 accumulation, float32 master weights (compile(..., precision='bf16'))")
    p.add_argument("--data", default=None, metavar="DIR",
                   help="folder with the dataset's four IDX files (default: the --dataset's folder, where missing "
                        "files are downloaded, md5-checked)")
    p.add_argument("--download", action="store_true",
                   help="download the dataset files missing from --data DIR (the default folder downloads anyway)")
    p.add_argument("--epochs", type=int, default=1, help="epochs to train in all (a resumed run continues the count)")
    p.add_argument("--batch-size", type=int, default=64, help="training batch (default 64; the last partial batch is kept)")
    p.add_argument("--eval-batch-size", type=int, default=1000, help="test-set batch of the inference graph (default 1000)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="torch.optim's SGD, Adam or AdamW")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default 0)")
    p.add_argument("--betas", default=None, metavar="B1,B2",
                   help="Adam's and AdamW's moment decays (default torch's 0.9,0.999)")
    p.add_argument("--translate", type=int, default=None, metavar="N",
                   help="random translation of the training images by up to N pixels each way, inside the compiled "
                        "step (models with an augmentation layer: speednet)")
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
    # a string, checked in _check_args: a typo is one line there, not argparse's usage dump
    p.add_argument("--bucket-bytes", default=None, metavar="N",
                   help="data parallel: all-reduce the gradients in buckets of at most N bytes (default 26214400, "
                        "25 MiB as PyTorch DDP); smaller buckets start communicating earlier in the backward pass")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    setup.add_training_arguments(p)
    p.add_argument("--verbose", action="store_true",
                   help="also print where the compile went (passes, rendering, compiler; objects cached or built)")


def recipe_defaults(args: Any) -> dict[str, Any] | None:
    """The --recipe's settings for --device, which the parser takes as its defaults. A recipe's
    random translation is its model's layer: with another --model that has none, it is left out
    (the recipe's other settings still apply)."""
    if not args.recipe:
        return None
    settings = dict(RECIPES[args.recipe].settings_for(args.device))
    if args.model not in (None, settings.get("model")) and "translate" in settings and \
            not has_random_translation(args.model):
        settings.pop("translate")
    return settings


def _betas(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        b1, b2 = (float(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--betas {text}: expected two decays B1,B2, e.g. 0.9,0.999") from None
    if not all(math.isfinite(b) and 0 <= b < 1 for b in (b1, b2)):
        raise UsageError(f"--betas {text}: expected decays in [0, 1), e.g. 0.9,0.999")
    return b1, b2


def _format_compile_stats(stats: dict[str, Any]) -> str:
    """One line: seconds per phase, then the cache's share (`ember mnist --verbose`)."""
    parts = [f"{label} {stats[key]:.2f} s" for key, label in (("passes_s", "passes"), ("render_s", "render"),
                                                               ("compiler_s", "compiler")) if key in stats]
    if "objects" in stats:
        parts.append(f"{stats['objects']} objects ({stats['objects_cached']} cached, {stats['objects_built']} built "
                     f"{stats['jobs']} at a time), link {'cached' if stats['link_cached'] else 'built'}")
    if "kernel_functions" in stats:
        parts.append(f"{stats['kernel_calls']} kernel calls of {stats['kernel_functions']} kernels")
    return "; ".join(parts)


def _error(msg: str) -> int:
    print(f"ember mnist: error: {msg}", file=sys.stderr)
    return 2


def _check_args(args: Any) -> None:
    """Everything that can be checked before reading data or compiling: numbers, then every
    path the run will write (so a typo fails now, not after an epoch or after all of them)."""
    if args.bucket_bytes is not None and not isinstance(args.bucket_bytes, int):
        try:
            args.bucket_bytes = int(args.bucket_bytes)
        except ValueError:
            raise UsageError(f"--bucket-bytes {args.bucket_bytes}: expected an integer >= 1 (bytes)") from None
    for name in ("epochs", "batch_size", "eval_batch_size", "limit_steps", "threads", "log_every", "bucket_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: expected an integer >= 1")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed {args.seed}: expected an integer in [0, 2**32)")
    check_hyperparameters(args.lr, args.momentum)
    _betas(args.betas)
    if args.betas is not None and args.optimizer == "sgd":
        raise UsageError(f"--betas {args.betas}: applies to --optimizer adam or adamw; SGD's is --momentum")
    setup.check_training_args(args)
    args.precision = precision_flag(args)
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
            from ..training.trackers import TENSORBOARD_MISSING
            raise UsageError(TENSORBOARD_MISSING) from None
    if args.resume and args.init_weights:  # (the weights were silently not loaded: session 36's probe)
        raise UsageError(f"--init-weights {args.init_weights} and --resume {args.resume}: a resumed run continues "
                         f"from the checkpoint's weights; give one of them")
    if args.resume:
        check_input_file("--resume", args.resume, "a checkpoint file written by --save")
    elif args.init_weights:
        check_input_file("--init-weights", args.init_weights, "a .safetensors or .npz weights file")


def _prepare_data(args: Any) -> Path:
    """The dataset's folder. The default one is filled by downloading; a folder given with --data
    only with --download, so a typo is reported instead of filled with a fresh download."""
    from ..training.datasets import DATASETS, dataset_dir, ensure_mnist, missing_mnist_files

    dataset = DATASETS[args.dataset]
    explicit = args.data is not None
    root = Path(args.data).expanduser() if explicit else dataset_dir(dataset.name)
    where = f"--data {root}" if explicit else f"the {dataset.name} folder {root}"
    if root.exists() and not root.is_dir():
        raise UsageError(f"{where}: is a file; expected a folder holding the four MNIST IDX files")
    missing = missing_mnist_files(root)
    if missing and explicit and not args.download:
        if not root.exists():
            raise UsageError(f"--data {root}: no such folder; expected the folder holding the four MNIST IDX files "
                             f"(add --download to download them there)")
        raise UsageError(f"--data {root}: {len(missing)} of the 4 MNIST files missing ({', '.join(missing)}); "
                         f"add --download to download them there")
    if missing:
        if root.exists() or root.parent.exists():
            check_output_dir("--data" if explicit else "MNIST folder", root)
        print(f"{dataset.name}: {len(missing)} of 4 files missing in {root}; downloading them (md5-checked)",
              file=sys.stderr)
        ensure_mnist(root, mirrors=MNIST_MIRRORS if MNIST_MIRRORS is not None else dataset.mirrors, md5s=dataset.md5s)
    return root


def _epoch_line(rec: dict[str, Any], epochs: int, n_test: int, limit_steps: int | None = None,
                world_size: int = 1) -> str:
    train = f"train loss {format_loss(rec['train_loss'])}" if rec["steps"] else "no step ran"
    if not rec["steps"] and rec.get("resumed_at_step_in_epoch"):
        train += f": the checkpoint is at step {rec['resumed_at_step_in_epoch'] + 1} of the epoch" + \
                 (f", past --limit-steps {limit_steps}" if limit_steps else "")
    elif rec.get("resumed_at_step_in_epoch"):
        # the steps before the resume ran in another process: their losses are not in this mean
        train += f" (steps {rec['resumed_at_step_in_epoch'] + 1}-{rec['resumed_at_step_in_epoch'] + rec['steps']} " \
                 f"of the epoch only, those run since the resume)"
    val = (f", val loss {format_loss(rec['val_loss'])}, val accuracy {100 * rec['val_acc']:.2f}%"
           if "val_loss" in rec else "")
    speed = (f"{rec['samples_per_s_all_ranks']:.0f} samples/s (all {world_size} ranks)" if world_size > 1
             else f"{rec['samples_per_s']:.0f} samples/s")
    return (f"epoch {rec['epoch']}/{epochs}: {train}{val}, test loss {format_loss(rec['test_loss'])}, test accuracy "
            f"{100 * rec['test_acc']:.2f}% ({round(rec['test_acc'] * n_test)}/{n_test}); {rec['epoch_seconds']:.1f} s, "
            f"{speed}")


def _target_line(trainer: Trainer, target: float, n_test: int) -> str:
    """Where and when the run reached --target-acc (or that it did not), and the time to it."""
    since = setup.seconds_since_start()
    wall = f", {since:.2f} s since the command started" if since is not None else ""
    r = trainer.reached
    if r is None:
        evals = [rec for rec in trainer.records if "test_acc" in rec and rec.get("type") in ("epoch", "eval")]
        best = max((rec["test_acc"] for rec in evals), default=None)
        return (f"target test accuracy {100 * target:.2f}% not reached" +
                (f" (best {100 * best:.2f}% of {len(evals)} evaluations)" if best is not None else "") +
                f"; {trainer.train_seconds:.3f} s of training, {trainer.eval_seconds:.3f} s of evaluation{wall}")
    return (f"reached test accuracy {100 * r['test_acc']:.2f}% ({round(r['test_acc'] * n_test)}/{n_test}) >= "
            f"{100 * target:.2f}% at epoch {r['epoch']}, step {r['step']}: {r['train_seconds']:.3f} s of training "
            f"(compile {trainer.compile_seconds:.2f} s and evaluation {r['eval_seconds']:.3f} s excluded){wall}")


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
    if args.model is None:
        args.model = "cnn"
    from ember.runtime.data import IDXError, load_mnist

    from ..training.datasets import DownloadError

    check_device(args.device)
    _check_args(args)
    try:
        comm = _data_parallel_world(args)
    except WorldError as e:  # every rank has it: rank 0 alone says it
        return _world_error(e)
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
    n_files = len(x_train)
    (x_train, y_train), val = setup.split_validation(x_train, y_train, args.val_split)

    config = {"model": args.model, "dataset": args.dataset, "optimizer": args.optimizer, "lr": args.lr,
              "momentum": args.momentum, "betas": args.betas, "weight_decay": args.weight_decay,
              "nesterov": args.nesterov, "recipe": args.recipe, "translate": args.translate,
              "label_smoothing": args.label_smoothing, "val_split": args.val_split, "tta": args.tta,
              "init": args.init_weights or f"{args.init} seed {args.seed}",
              "precision": args.precision}
    try:
        model = build_model(args.model, args.seed, args.init, translate=args.translate)
        if args.init_weights and not args.resume:
            try:
                weights = load_weights(args.init_weights)
            except CheckpointError as e:  # it names the file and the fault; add the flag
                raise UsageError(f"--init-weights {e}") from None
            bad = [k for k, v in weights.items() if np.issubdtype(np.asarray(v).dtype, np.floating)
                   and not np.isfinite(v).all()]
            if bad:  # (training on stopped at its first step blaming the learning rate)
                raise UsageError(f"--init-weights {args.init_weights}: {', '.join(bad[:3])}"
                                 f"{', ...' if len(bad) > 3 else ''} hold NaN or infinite values; expected finite "
                                 f"initial weights")
            try:
                model.load_state_dict(weights)
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{args.init_weights}: does not fit the {args.model} model: {e}") from None
        opt = make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay, args.nesterov,
                             _betas(args.betas))
    except (ValueError, OSError) as e:
        return _error(str(e))

    ckpt = None
    if args.resume:  # read and check it before compiling anything
        try:
            ckpt = load_checkpoint(args.resume)
            check_config(ckpt, config, ("model", "optimizer", "dataset"), args.resume)
        except (CheckpointError, OSError) as e:
            return _error(str(e))
        if ckpt.epoch >= args.epochs:
            print(f"nothing to do: {args.resume} has {ckpt.epoch} epoch(s) done and --epochs is {args.epochs} "
                  f"(the epoch count is the total; pass a larger --epochs to continue)")
            return 0

    run_dir = setup.run_folder(args.output_dir, args.resume) if args.output_dir else \
        setup.resumed_run_folder(args.resume)
    notes = setup.use_run_folder(args, run_dir) if run_dir is not None else []
    started = time.perf_counter()
    print(f"data: {args.dataset} from {root} ({len(x_train)} training"
          + (f" + {len(val[0])} validation (the last {args.val_split:g} of {n_files})" if val is not None else "")
          + f" / {len(x_test)} test images)", flush=True)
    # the schedule, attached by the trainer, gets a line of its own
    print(f"ember mnist: {f'recipe {args.recipe}: ' if args.recipe else ''}{args.model} on {args.device}, "
          f"{repr(opt).replace(', schedule=None', '')}, batch {args.batch_size}"
          + (f", {'shuffled' if args.shuffle else 'file order'}" if args.recipe else "")
          + (f", label smoothing {args.label_smoothing:g}" if args.label_smoothing else "")
          + (f", random translation up to {model.augment.max_shift} px" if getattr(model, "augment", None) else "")
          + (f", test-time augmentation {args.tta}" if args.tta else ""), flush=True)
    if run_dir is not None:
        setup.write_config(run_dir, args, {"run_dir": os.fspath(run_dir), "data": os.fspath(root)})
        print(f"run folder: {run_dir}", flush=True)
    for msg in notes:
        setup.note(msg)
    schedule = setup.lr_schedule(args)
    try:
        trainer = Trainer(model, opt, (x_train, y_train), (x_test, y_test), device=args.device,
                          batch_size=args.batch_size, shuffle=args.shuffle, seed=args.seed,
                          eval_batch_size=args.eval_batch_size, limit_steps=args.limit_steps, log_every=args.log_every,
                          progress=not args.no_progress, dump_dir=args.dump_kernels, config=config, communicator=comm,
                          bucket_bytes=args.bucket_bytes, precision=config["precision"], val=val,
                          loss_fn=nn.CrossEntropyLoss(label_smoothing=args.label_smoothing),
                          lr_schedule=schedule, epochs=args.epochs,
                          tta=setup.parse_shifts("--tta", args.tta) if args.tta else ())
    except ConsistencyError as e:  # raised on every rank at once: rank 0 alone says it
        return _ranks_disagree(comm, e)
    except ValueError as e:  # a warm-up longer than the run, known only with the steps per epoch
        return _error(str(e))
    if schedule is not None:
        print(schedule.describe(args.lr, args.epochs * trainer.steps_per_epoch()), flush=True)
    if trainer.world_size > 1:
        print(f"data parallel: {trainer.world_size} ranks x batch {args.batch_size} = global batch "
              f"{args.batch_size * trainer.world_size}; {len(trainer.loader.x)} "
              f"training images per rank, {trainer.dropped_tail} dropped (the tail that does not divide evenly); "
              f"gradients all-reduced in {len(trainer.step.train_graph.meta.get('buckets', []))} bucket(s) of at most "
              f"{trainer.step.bucket_bytes} bytes", flush=True)
    print(f"compiled the training step in {trainer.compile_seconds:.2f} s"
          + (f" (planned peak memory {trainer.step.peak_bytes / 2**20:.1f} MiB)" if trainer.step.peak_bytes else ""),
          flush=True)
    if args.verbose and trainer.step.compile_stats:
        for i, (shape, stats) in enumerate(trainer.step.all_compile_stats.items()):
            what = "" if i == 0 else f" (batch {shape.split('x')[0]}, the last partial batch)"
            print(f"compile{what}: " + _format_compile_stats(stats), flush=True)
    if ckpt is not None:
        try:
            trainer.load(ckpt)
        except (CheckpointError, OSError) as e:
            return _error(str(e))
        print(f"resumed from {args.resume}: {trainer.epoch} epoch(s), {trainer.global_step} steps done"
              + (f" ({trainer.step_in_epoch} into epoch {trainer.epoch + 1})" if trainer.step_in_epoch else ""),
              flush=True)
        if trainer.resume_note:
            print(f"note: {trainer.resume_note}", flush=True)
    writers: list[Any] = []
    if args.metrics_file:
        writers.append(MetricsWriter(args.metrics_file, mode="a" if args.resume else "w"))
        if writers[-1].repaired:
            print(f"ember mnist: warning: {writers[-1].repaired}", file=sys.stderr, flush=True)
    if args.tensorboard:
        from ..training.trackers import TensorBoardWriter
        writers.append(TensorBoardWriter(args.tensorboard))
    if writers:
        from ..training.trackers import Tee
        trainer.metrics = writers[0] if len(writers) == 1 else Tee(writers)
    trainer.run_record(epochs=args.epochs, resumed_from=args.resume, threads=args.threads)

    def on_epoch(rec: dict[str, Any]) -> None:
        trainer.print(_epoch_line(rec, args.epochs, len(x_test), args.limit_steps, trainer.world_size))
        sys.stdout.flush()

    def on_sigint(signum: int, frame: Any) -> None:
        if trainer.stop_requested:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        print("\ninterrupted: stopping after this step" + (f" and saving {args.save}" if args.save else "")
              + " (Ctrl-C again to abort at once)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
    try:
        trainer.fit(args.epochs, save=args.save, on_epoch=on_epoch, save_every=args.save_every,
                    target_acc=args.target_acc, eval_every=args.eval_every)
    except OSError as e:  # the checkpoint (or a dump of the inference step) could not be written
        if e.errno is None:
            raise
        return _write_failed(e, args, trainer)
    except ConsistencyError as e:  # another step plan (--epochs, --limit-steps) on some rank
        return _ranks_disagree(comm, e)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if trainer.metrics is not None:
            trainer.metrics.close()
    if trainer.diverged is not None:
        print(f"ember mnist: error: {_divergence_message(trainer.diverged, args)}", file=sys.stderr)
        return 1  # the run failed, not its arguments (those exit 2)
    if trainer.write_error is not None:
        return _write_failed(trainer.write_error, args, trainer)
    if trainer.stop_requested and trainer.epoch < args.epochs:
        print(f"stopped at step {trainer.global_step}" + (f"; resume with --resume {args.save}" if args.save else ""))
        return 130
    if args.target_acc is not None:
        print(_target_line(trainer, args.target_acc, len(x_test)), flush=True)
    if args.save:
        print(f"saved {args.save}")
    if args.plot:
        from ..training.plotting import plot_metrics, run_title
        records = read_metrics(args.metrics_file, warn=lambda m: print(f"ember mnist: warning: {m}", file=sys.stderr)) \
            if args.metrics_file else trainer.records
        try:
            plot_metrics(records, args.plot, title=run_title(records))
        except OSError as e:
            if e.errno is None:
                raise
            kept = "keeps its previous contents" if Path(args.plot).exists() else "was not written"
            print(f"ember mnist: error: --plot {args.plot}: {describe_os_error(e)}; the file {kept}", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def _write_failed(e: OSError, args: Any, trainer: Trainer) -> int:
    """One line for an output that failed mid-run (a full disk): which flag and file, why, and
    where the run stopped; the exit status of a failed run, 1."""
    def named(err: OSError) -> str:
        where = os.fspath(err.filename) if err.filename is not None else None
        for flag, path in (("--save", args.save), ("--metrics-file", args.metrics_file)):
            if path and where is not None and Path(where) == Path(path):
                return f"{flag} {path}"
        return where or "an output"

    if trainer.write_error is e:
        what = f"{named(e)}: a record could not be written: {describe_os_error(e)}"
    elif args.save and named(e) == f"--save {args.save}":
        kept = "keeps its previous contents" if Path(args.save).exists() else "was not written"
        what = f"--save {args.save}: the checkpoint could not be written: {describe_os_error(e)}; the file {kept}"
    else:
        what = f"{named(e)}: {describe_os_error(e)}"
    what += f"; stopped at step {trainer.global_step}"
    if trainer.write_error is not None and trainer.write_error is not e:
        what += f" (after {named(trainer.write_error)} failed: {describe_os_error(trainer.write_error)})"
    elif args.save and trainer.saved_at == trainer.global_step:
        what += f", saved {args.save} (resume with --resume {args.save})"
    print(f"ember mnist: error: {what}", file=sys.stderr)
    return 1


def _data_parallel_world(args: Any) -> Any:
    """This process's communicator under `ember launch` / `mpiexec` (None alone). Every rank
    trains; rank 0 alone prints and writes metrics, checkpoints and plots."""
    from ember.runtime import comm as C

    if C.world_from_env()[1] <= 1:
        return None
    if args.device != "cpu":
        raise UsageError(f"--device {args.device}: data parallel over MPI runs on --device cpu only")
    comm = C.from_env()
    if comm.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        args.metrics_file = args.tensorboard = args.save = args.plot = args.output_dir = None
        args.no_progress = True
    return comm


def _world_error(error: Exception) -> int:
    """This process cannot join its data-parallel world: one line, from rank 0 only where the
    environment names a rank (every rank of the launch has the same fault), and exit 2."""
    try:
        rank = world_from_env()[0]
    except WorldError:
        rank = 0
    if rank == 0:
        print(f"ember mnist: error: {error}", file=sys.stderr, flush=True)
    else:
        # no world to hold the others at a barrier: the first rank to exit gets the rest stopped
        # (by mpiexec, by the launcher), so give rank 0 a head start to say it
        time.sleep(2.0)
    return 2


def _ranks_disagree(comm: Any, error: Exception) -> int:
    """The ranks run different code or data: rank 0 prints the one line that says which and what;
    every rank exits 1. The barrier holds the others until the line is out, since the launcher
    stops every rank as soon as one exits."""
    if comm.rank == 0:
        print(f"ember mnist: error: {error}", file=sys.stderr, flush=True)
    comm.barrier()
    return 1


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()
