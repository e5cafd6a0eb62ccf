"""The reusable training loop: `Trainer` compiles the step once (`ember.frontends.compile`),
feeds it the loader's batches (views of the arrays in memory, or on the device for a target that
keeps data there; a shuffled batch is gathered per batch), reads the loss back as Python floats
(every step on the host; on a device only when it is logged or shown, so the GPU never waits), writes metrics records, evaluates with
`step.inference` (the compiled inference graph on the same parameters, its logits reduced where
they are: on a device one read back per evaluation; optionally averaged over shifted copies of
the images, test-time augmentation) and saves and restores checkpoints. The epoch count is a
target: `fit(3)` on a trainer resumed after one epoch trains two more. `fit(target_acc=...)`
also stops once the test accuracy reaches a target, evaluating every `eval_every` steps, and
times the run: `train_seconds` (steps only) and `eval_seconds` (evaluations), the device
synchronised at each boundary. `restart` starts another seed's run on the same compiled step.
"""
from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ember.frontends import compile as ember_compile
from ember.frontends import nn, optim

from ember.frontends.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from .metrics import MetricsWriter, format_loss, logit_sums

__all__ = ["Trainer", "NonFiniteError", "check_config"]


class NonFiniteError(ValueError):
    """The parameters (or optimizer state) hold NaN or inf: such a state is never saved."""


class Trainer:
    """Trains `model` with a compiled step on in-memory arrays; evaluates, logs and checkpoints.

    train, test: (x, y) arrays (float32 inputs, int64 labels); test may be None.
    limit_steps: stop each epoch after this many steps (CI and smoke runs). loss_fn: the training
    loss (default cross-entropy; evaluation reports cross-entropy and accuracy of the logits).
    metrics: a MetricsWriter (or None) that receives every record; records are also kept in
    `self.records`. A record that cannot be written (a full disk) stops the run as Ctrl-C does:
    the step in flight completes, fit() saves, and `write_error` holds the OSError.
    config: settings stored in checkpoints and in the run record.
    val: a held-out (x, y) evaluated after every epoch as the test set is (`val_loss`, `val_acc`
    in the epoch record). lr_schedule: a `recipes.LRSchedule` attached to `optimizer` for
    `epochs` x steps_per_epoch() steps (a schedule already attached with `optim.lr_scheduler`
    works as it is); step records then log each step's `lr`. A resumed trainer must be built with
    the same schedule (checkpoints record it, and `load` refuses another).
    tta: test-time augmentation, (dy, dx) pixel shifts: evaluation averages the logits of the
    images and of each shifted copy (zeros fill the border; the copies are made once, where
    the data is kept). seed: the initial shuffled order and the stream of the step's random
    draws (`TrainStep.seed_random`: dropout masks, random translations).
    """

    def __init__(self, model: nn.Module, optimizer: Any, train: tuple[np.ndarray, np.ndarray],
                 test: tuple[np.ndarray, np.ndarray] | None = None, *, device: str = "cpu", batch_size: int = 64,
                 shuffle: bool = False, seed: int = 0, eval_batch_size: int = 1000, limit_steps: int | None = None,
                 log_every: int = 50, metrics: MetricsWriter | None = None, progress: bool = False,
                 dump_dir: str | os.PathLike | None = None, config: dict[str, Any] | None = None,
                 print_fn: Callable[[str], None] | None = None, loss_fn: Callable[[Any, Any], Any] | None = None,
                 communicator: Any = None, bucket_bytes: int | None = None, precision: str = "float32",
                 val: tuple[np.ndarray, np.ndarray] | None = None, lr_schedule: Any = None,
                 epochs: int | None = None, tta: Sequence[tuple[int, int]] = ()) -> None:
        from ember.runtime.data import DataLoader

        from ember.runtime import target as get_target

        x, y = train
        if len(x) == 0:
            raise ValueError("the training set is empty")
        # data parallel: rank r trains on the r-th of `size` equal contiguous shards (the tail
        # that does not divide evenly is dropped), so every rank runs the same number of steps;
        # batch_size is per rank, the global batch is batch_size * size
        self.rank, self.world_size = (communicator.rank, communicator.size) if communicator is not None else (0, 1)
        self.dropped_tail = 0
        if self.world_size > 1:
            # every rank must be started with the same settings, then read the same data (before
            # sharding it); settings first, so a rank with another model is named as such, not
            # as one reading other data (the MLP reads flat images); a rank with another folder
            # or a damaged file stops the run here, instead of training on something else
            from ember.runtime.consistency import agree_on_data, agree_on_fields
            shapes = [f"{name}{tuple(p.data.shape)}" for name, p in model.named_parameters()]
            agree_on_fields(communicator, [*((str(k), v) for k, v in (config or {}).items()),
                                           ("the model's parameters", f"{len(shapes)} tensors: {' '.join(shapes)}"),
                                           ("device", device), ("batch size", batch_size), ("shuffle", shuffle),
                                           ("seed", seed), ("eval batch size", eval_batch_size)])
            agree_on_data(communicator, "the training data", (x, y))
            if test is not None:
                agree_on_data(communicator, "the test data", test)
            if val is not None:  # held out before sharding: every rank evaluates the same set
                agree_on_data(communicator, "the validation data", val)
            per = len(x) // self.world_size
            if per == 0:
                raise ValueError(f"{len(x)} training samples cannot be sharded over {self.world_size} ranks")
            self.dropped_tail = len(x) - per * self.world_size
            x, y = x[self.rank * per:(self.rank + 1) * per], y[self.rank * per:(self.rank + 1) * per]
        self.model = model
        self.device = device
        # A target that keeps data on its device gets the datasets uploaded once (a batch is then
        # a slice there). Their labels were checked when they were loaded, so the steps skip that
        # check, which on a device would wait for it; and the loss is read back only when needed.
        to_device = get_target(device).to_device
        self.on_device = to_device is not None
        example = (x[:min(batch_size, len(x))], y[:min(batch_size, len(x))])
        self.tta = tuple((int(dy), int(dx)) for dy, dx in tta)
        # the evaluation sets as evaluate() reads them: every view of the images (the images, then
        # each shifted copy), and the labels, where the data is kept
        self._eval_views = {name: _views(data, self.tta, to_device) for name, data in (("test", test), ("val", val))
                            if data is not None}
        if self.on_device:
            x, y = to_device(x), to_device(y)
        self.loader = DataLoader(x, y, batch_size, shuffle=shuffle, seed=seed, to_device=to_device)
        self.test = test
        self.val = val
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
        self.resume_note: str | None = None  # set by load() when the progress had to be mapped
        self.diverged: dict[str, Any] | None = None  # the "diverged" record once the loss is not finite
        self.write_error: OSError | None = None  # the first failed metrics write; none is tried after it
        self.saved_at: int | None = None  # global step of the last checkpoint this trainer wrote
        self.target_epochs: int | None = None  # fit()'s goal, for the progress bar
        self.target_acc: float | None = None  # fit(): stop once the test accuracy reaches it
        self.eval_every: int | None = None  # fit(): also evaluate the test set every N steps
        self.reached: dict[str, Any] | None = None  # the "target" record once target_acc is reached
        self.train_seconds = 0.0  # time in training steps (device synchronised), this process
        self.eval_seconds = 0.0  # time in evaluations, this process
        self._train_mark = 0.0  # when the current stretch of steps started
        self.save_every: int | None = None  # fit(): also checkpoint every N steps, to fit's `save`
        self._save_path: str | os.PathLike | None = None
        # the schedule's length is fixed here, in the compiled step: epochs x steps per epoch
        self.scheduler = None
        if lr_schedule is not None:
            if epochs is None:
                raise ValueError("lr_schedule needs epochs: the schedule spans epochs x steps per epoch")
            self.scheduler = lr_schedule.attach(optimizer, epochs * self.steps_per_epoch())
        self.optimizer_config = optim.as_config(optimizer)
        self.config["lr_schedule"] = str(self.optimizer_config.schedule or "constant")
        self._t0 = time.perf_counter()
        t0 = time.perf_counter()
        extra = {"bucket_bytes": bucket_bytes} if bucket_bytes is not None else {}  # else compile()'s default
        self.step = ember_compile(model, loss_fn or nn.CrossEntropyLoss(), optimizer, example_inputs=example,
                                  device=device, dump_dir=dump_dir, communicator=communicator, precision=precision,
                                  **extra)
        # The last partial batch has its own shape: compile its step now, not mid-epoch.
        last = len(x) % batch_size if len(x) > batch_size else 0
        reaches_end = not self.limit_steps or self.limit_steps >= len(self.loader)
        if last and reaches_end and not getattr(self.loader, "drop_last", False):
            self.step.precompile((last, *x.shape[1:]))
        self.compile_seconds = time.perf_counter() - t0
        self.step.seed_random(seed)

    def lr_at(self, t: int) -> float:
        """The learning rate of optimizer step t (0-based, counted over the whole run), as the
        compiled step computes it from its step counter."""
        cfg = self.optimizer_config
        return cfg.schedule.value(int(t), cfg.lr) if cfg.schedule is not None else cfg.lr

    # ---- records -----------------------------------------------------------------------------
    def record(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        if self.metrics is not None and self.write_error is None:
            try:
                self.metrics.write(rec)
            except OSError as e:
                # a full disk must not kill the run mid-step and lose what it trained: stop as
                # Ctrl-C does (agreed by every rank, checkpoint saved) and let the caller report it
                self.write_error = e
                self.stop_requested = True

    def _agree_to_stop(self) -> bool:
        """stop_requested, agreed by every rank (a 1-value all-reduce per step in data parallel):
        a Ctrl-C reaches the ranks at different steps, and a rank that stopped alone would leave
        the others waiting in their next all-reduce."""
        if self.world_size == 1:
            return self.stop_requested
        flag = np.array([1.0 if self.stop_requested else 0.0])
        self.step.comm.all_reduce(flag, "sum")
        self.stop_requested = bool(flag[0])
        return self.stop_requested

    def run_record(self, **extra: Any) -> dict[str, Any]:
        rec = {"type": "run", **self.config, "device": self.device, "batch_size": self.loader.batch_size,
               "shuffle": self.loader.shuffle, "seed": self.loader.seed, "limit_steps": self.limit_steps,
               "compile_seconds": round(self.compile_seconds, 4), "peak_bytes": self.step.peak_bytes,
               "start_epoch": self.epoch, "start_step": self.global_step, **extra}
        if self.world_size > 1:
            rec.update(world_size=self.world_size, global_batch_size=self.loader.batch_size * self.world_size,
                       dropped_tail=self.dropped_tail, bucket_bytes=self.step.bucket_bytes,
                       buckets=len(self.step.train_graph.meta.get("buckets", [])))
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
        t_start = t_interval = t_bar = self._train_mark = time.perf_counter()
        paused = 0.0  # seconds of this epoch spent evaluating mid-epoch (eval_every)
        stopped = False
        pending: list[tuple[Any, int]] = []  # (loss as the device holds it, batch size), not yet read back
        loss = math.nan

        def settle() -> dict[str, Any] | None:
            """Reads back the pending losses, in order, into the sums; the diverged record if one is not finite."""
            nonlocal loss, loss_sum, batch_loss_sum, samples, steps, interval_loss, interval_samples, interval_steps
            values = _read_back([v for v, _ in pending])
            for k, (value, (_, n)) in enumerate(zip(values, pending)):
                if not math.isfinite(value):
                    # every later step trains on NaN too: stop here, and never save this state
                    done = len(pending) - k - 1  # steps run after the first non-finite one (on a device)
                    self.diverged = {"type": "diverged", "epoch": epoch_no, "step": self.global_step - done,
                                     "step_in_epoch": self.step_in_epoch - done, "loss": value}
                    return self.diverged
                loss = value
                loss_sum += value * n
                batch_loss_sum += value
                samples += n
                steps += 1
                interval_loss += value
                interval_samples += n
                interval_steps += 1
            pending.clear()
            return None

        for i, (xb, yb) in enumerate(loader):
            if i >= total:
                break
            if i < skip:  # resuming mid-epoch: the order is reproducible, skip what was done
                continue
            pending.append((step.run(xb, yb, check_labels=not self.on_device), len(yb)))
            self.global_step += 1
            self.step_in_epoch = i + 1
            logging = bool(log_every) and self.global_step % log_every == 0
            now_bar = time.perf_counter() if show else 0.0
            # On the host every loss is read at once; on a device only when something shows it
            if not self.on_device or logging or (show and now_bar - t_bar > 0.5) or self.stop_requested:
                if settle() is not None:
                    bar.close()
                    self.record(self.diverged)
                    return self.diverged
            if logging:
                now = time.perf_counter()
                self.record({"type": "step", "epoch": epoch_no, "step": self.global_step, "loss": loss,
                             "loss_avg": interval_loss / interval_steps, "lr": self.lr_at(self.global_step - 1),
                             "samples_per_s": interval_samples / max(now - t_interval, 1e-12),
                             "time": now - self._t0})
                interval_loss, interval_samples, interval_steps, t_interval = 0.0, 0, 0, now
            if show:
                bar.update(1)
                now = time.perf_counter()
                if now - t_bar > 0.5 and steps:
                    bar.set_postfix_str(f"loss {format_loss(batch_loss_sum / steps)}, "
                                        f"{samples / (now - t_start):.0f} samples/s", refresh=False)
                    t_bar = now
            if (self.save_every and self._save_path is not None and self.global_step % self.save_every == 0
                    and self.step_in_epoch < total):  # the epoch's own checkpoint follows its last step
                if settle() is not None:
                    bar.close()
                    self.record(self.diverged)
                    return self.diverged
                if not self.finite():  # never save a state that overflowed; fit() reports it
                    stopped = True
                    break
                self.save(self._save_path)
            if self.eval_every and self.global_step % self.eval_every == 0 and self.step_in_epoch < total:
                if settle() is not None:  # also waits for the device: the steps' time ends here
                    bar.close()
                    self.record(self.diverged)
                    return self.diverged
                t_pause = time.perf_counter()
                self._checkpoint_eval(epoch_no)
                paused += time.perf_counter() - t_pause
                if self.reached is not None:
                    stopped = True
                    break
            if self._agree_to_stop():
                stopped = self.step_in_epoch < total
                break
        if settle() is not None:
            bar.close()
            self.record(self.diverged)
            return self.diverged
        epoch_seconds = time.perf_counter() - t_start - paused
        self.train_seconds += time.perf_counter() - self._train_mark
        if show and steps:
            bar.set_postfix_str(f"loss {format_loss(batch_loss_sum / steps)}, {samples / epoch_seconds:.0f} samples/s")
        bar.close()
        if stopped:
            return {"type": "stopped", "epoch": epoch_no, "step": self.global_step, "step_in_epoch": self.step_in_epoch}
        # no step ran (resumed at or past limit_steps): no training loss, rather than a loss of 0
        rec: dict[str, Any] = {"type": "epoch", "epoch": epoch_no, "step": self.global_step, "steps": steps,
                               "samples": samples, "train_loss": loss_sum / samples if samples else None,
                               "train_loss_batch_mean": batch_loss_sum / steps if steps else None}
        if skip:
            rec["resumed_at_step_in_epoch"] = skip
        t_eval = time.perf_counter()
        if self.test is not None:
            rec["test_loss"], rec["test_acc"] = self.evaluate()
        if self.val is not None:
            rec["val_loss"], rec["val_acc"] = self.evaluate("val")
        eval_seconds = time.perf_counter() - t_eval
        self.eval_seconds += eval_seconds
        rec.update(samples_per_s=samples / max(epoch_seconds, 1e-12), epoch_seconds=epoch_seconds,
                   eval_seconds=eval_seconds, train_seconds=self.train_seconds, time=time.perf_counter() - self._t0)
        if self.world_size > 1:  # every rank trains as many samples in the same steps
            rec["samples_per_s_all_ranks"] = rec["samples_per_s"] * self.world_size
        self.epoch += 1
        self.step_in_epoch = 0
        self.record(rec)
        if "test_acc" in rec:
            self._note_target(rec)
        return rec

    def _checkpoint_eval(self, epoch_no: int) -> None:
        """A test-set evaluation between steps (`eval_every`): an "eval" record, and the target
        checked. The caller has synchronised the device; the next stretch of steps starts after."""
        self.train_seconds += time.perf_counter() - self._train_mark
        t0 = time.perf_counter()
        loss, acc = self.evaluate()
        seconds = time.perf_counter() - t0
        self.eval_seconds += seconds
        rec = {"type": "eval", "epoch": epoch_no, "step": self.global_step, "test_loss": loss, "test_acc": acc,
               "eval_seconds": seconds, "train_seconds": self.train_seconds, "time": time.perf_counter() - self._t0}
        self.record(rec)
        self._note_target(rec)
        self._train_mark = time.perf_counter()

    def _note_target(self, rec: dict[str, Any]) -> None:
        """The "target" record, the first time an evaluation reaches `target_acc`: where (epoch,
        step), the accuracy, and the time to it: training seconds (compile and evaluations
        excluded), evaluation seconds so far, and seconds since the trainer was made (`time`)."""
        if self.target_acc is None or self.reached is not None or rec["test_acc"] < self.target_acc:
            return
        self.reached = {"type": "target", "target_acc": self.target_acc, "epoch": rec["epoch"], "step": rec["step"],
                        "test_acc": rec["test_acc"], "train_seconds": self.train_seconds,
                        "eval_seconds": self.eval_seconds, "time": time.perf_counter() - self._t0}
        self.record(self.reached)

    def evaluate(self, data: "str | tuple[np.ndarray, np.ndarray]" = "test") -> tuple[float, float]:
        """(mean cross-entropy, accuracy) of the current parameters on `data` ("test", "val" or
        an (x, y) pair), through the compiled inference graph in batches of `eval_batch_size`.
        With `tta`, of the logits averaged over the images and their shifted copies. The sums
        stay where the logits are until the end: on a device the evaluation reads back once."""
        views, y = self._eval_views[data] if isinstance(data, str) else _views(data, self.tta, None)
        bs = self.eval_batch_size
        loss: Any = 0.0
        correct: Any = 0
        model = self.step.model
        was_training = model.training
        model.eval()  # BatchNorm normalises by its running statistics (and leaves them), as in PyTorch
        try:
            for s in range(0, len(y), bs):
                logits = self.step.inference(views[0][s:s + bs], host=False)
                for v in views[1:]:
                    logits = logits + self.step.inference(v[s:s + bs], host=False)
                batch_loss, batch_correct = logit_sums(logits / len(views) if len(views) > 1 else logits, y[s:s + bs])
                loss, correct = loss + batch_loss, correct + batch_correct
        finally:
            model.train(was_training)
        return float(loss) / len(y), int(correct) / len(y)

    def fit(self, epochs: int, save: str | os.PathLike | None = None,
            on_epoch: Callable[[dict[str, Any]], None] | None = None,
            save_every: int | None = None, target_acc: float | None = None,
            eval_every: int | None = None) -> list[dict[str, Any]]:
        """Trains until `epochs` epochs are done in all (a resumed trainer continues its count);
        saves a checkpoint to `save` after every epoch and when stopped early (unless stopped
        before any step ran: the file on disk then already holds this state, or a better one),
        and with `save_every` also every that many steps (mid-epoch checkpoints resume there).
        With `target_acc`, stops at the first evaluation whose test accuracy reaches it (after
        each epoch, and every `eval_every` steps), recorded in `self.reached`."""
        if target_acc is not None and self.test is None:
            raise ValueError("target_acc needs a test set to evaluate")
        if eval_every is not None and (eval_every < 1 or self.test is None):
            raise ValueError(f"eval_every {eval_every}: expected an integer >= 1 and a test set to evaluate")
        done = []
        self.target_epochs = epochs
        self.target_acc, self.eval_every = target_acc, eval_every
        self.save_every, self._save_path = save_every, save
        start_step = self.global_step
        if self.world_size > 1:
            # a rank that runs fewer steps leaves the others waiting in their next all-reduce
            from ember.runtime.consistency import agree_on_fields
            agree_on_fields(self.step.comm, [("epochs", epochs), ("limit steps", self.limit_steps or "none"),
                                             ("steps per epoch", self.steps_per_epoch()),
                                             ("resume point (epochs done, steps into the next)",
                                              f"{self.epoch}, {self.step_in_epoch}")],
                            must="every rank must run the same steps")
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
            if save is not None and (rec["type"] != "stopped" or self.global_step > start_step):
                self.save(save)
            if rec["type"] == "stopped" or self.stop_requested or self.reached is not None:
                break
        return done

    def restart(self, weights: Mapping[str, Any], seed: int) -> None:
        """Starts another run on the compiled step, as a new Trainer of `seed` would but without
        compiling again: `weights` (the model's state dict, e.g. another seed's initial
        parameters and buffers) loaded, fresh optimizer state (the schedule starts again), the
        random stream and the shuffled order of `seed`, and the counters, timers and records
        at zero."""
        self.step.load_state_dict(weights)
        self.step.reset_optimizer()
        self.step.seed_random(seed)
        self.loader.seed = int(seed)
        self.epoch = self.global_step = self.step_in_epoch = 0
        self.train_seconds = self.eval_seconds = 0.0
        self.records, self.reached, self.diverged = [], None, None
        self.stop_requested = False
        self._t0 = time.perf_counter()

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
        self.step.save(path, epoch=self.epoch, step=self.global_step, step_in_epoch=self.step_in_epoch,
                       config=self.config, world_size=self.world_size,
                       global_batch=self.loader.batch_size * self.world_size)
        self.saved_at = self.global_step

    def load(self, source: "str | os.PathLike | Checkpoint",
             check: tuple[str, ...] = ("model", "optimizer", "lr_schedule")) -> None:
        """Restores parameters, optimizer state and progress from a checkpoint (a path or a loaded
        `Checkpoint`). The settings in `check` must match (a mismatch raises CheckpointError)."""
        ckpt = source if isinstance(source, Checkpoint) else load_checkpoint(source)
        where = ckpt.path if isinstance(source, Checkpoint) else source
        check_config(ckpt, self.config, check, where)
        ckpt.path = os.fspath(where)
        self.step.load(ckpt)
        # data parallel: every rank read the file; rank 0's copy is broadcast and all are checked
        # equal, so a rank that read another (stale, node-local) file cannot train on it
        self.step.sync_ranks()
        self.epoch, self.global_step, self.step_in_epoch = ckpt.epoch, ckpt.step, ckpt.step_in_epoch
        self.resumed_config = ckpt.config
        self.resume_note = None
        global_batch = self.loader.batch_size * self.world_size
        if ckpt.step_in_epoch and ckpt.global_batch is not None and ckpt.global_batch != global_batch:
            # Stopped mid-epoch at another global batch (another world size or --batch-size): a
            # step count means other samples now, so resume at the same sample count, rounded
            # down (a few samples seen twice rather than skipped). Each rank reads its own
            # contiguous shard, so the rest of the epoch is not exactly the samples the old
            # world would have read: only whole epochs resume exactly across world sizes.
            done = ckpt.step_in_epoch * ckpt.global_batch
            self.step_in_epoch = done // global_batch
            self.resume_note = (f"the checkpoint stopped {done} samples into epoch {ckpt.epoch + 1} at a global batch "
                                f"of {ckpt.global_batch} ({ckpt.world_size} rank(s)); this run ({self.world_size} "
                                f"rank(s), global batch {global_batch}) resumes at step {self.step_in_epoch} of that "
                                f"epoch; the rest of the epoch is not exactly the samples the other run would have read")


def check_config(ckpt: Checkpoint, config: dict[str, Any], keys: tuple[str, ...], where: Any) -> None:
    for key in keys:
        have, want = ckpt.config.get(key), config.get(key)
        if have is not None and want is not None and have != want:
            hint = ("; a schedule spans epochs x steps per epoch, so resume with the checkpoint's epochs, "
                    "steps per epoch and schedule settings" if key == "lr_schedule" else "")
            raise CheckpointError(f"{where}: checkpoint was written with {key}={have!r}, this run has {key}={want!r}"
                                  + hint)


def _read_back(losses: list[Any]) -> list[float]:
    """The losses as floats. On a device, stacked there first: one copy back (the first loss's
    wait included) instead of one per loss, which an epoch of hundreds of fast steps notices."""
    if len(losses) > 1 and hasattr(losses[0], "__cuda_array_interface__"):
        stacked = np.stack(losses)  # CuPy's stack, through NumPy's dispatch
        return [float(v) for v in (stacked.get() if hasattr(stacked, "get") else stacked)]
    return [float(v) for v in losses]


def moved(x: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """NCHW images moved down by dy and right by dx pixels, zeros where nothing lands (what
    `nn.RandomTranslate` does to an image that drew (dy, dx))."""
    out = np.zeros_like(x)
    h, w = x.shape[-2:]
    out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
        x[..., max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def _views(data: tuple[Any, Any], tta: tuple[tuple[int, int], ...], to_device: Any) -> tuple[list[Any], Any]:
    """([the images, each shifted copy], labels) of an evaluation set, on the device where
    `to_device` is given (a device set stays there; its shifted copies are made there once)."""
    x, y = data
    if tta and x.ndim != 4:
        raise ValueError(f"test-time augmentation shifts NCHW images; the evaluation images are {x.shape}")
    on_device = hasattr(x, "__cuda_array_interface__")
    host = x.get() if on_device and tta else x
    views = [x] + [moved(host, dy, dx) for dy, dx in tta]
    if to_device is not None:
        views = [v if hasattr(v, "__cuda_array_interface__") else to_device(v) for v in views]
        y = y if hasattr(y, "__cuda_array_interface__") else to_device(np.asarray(y))
    return views, y
