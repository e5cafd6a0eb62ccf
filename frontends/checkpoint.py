"""Checkpoints (model, optimizer state, progress) in safetensors, written atomically; and
initial weights from `.safetensors` or `.npz` files holding a PyTorch-style state dict.

A checkpoint is one safetensors file (through safetensors' NumPy API): tensors
``model/<name>`` (PyTorch names, e.g. ``model/0.weight``) and ``optimizer/<name>`` (the flat
optimizer state of `TrainStep.optimizer_state_dict()`), and string metadata:

    format          "ember.checkpoint"
    version         "1"
    epoch           epochs completed
    step            training steps completed in all (the global step)
    step_in_epoch   steps already done in epoch `epoch` (0 at an epoch boundary; a run stopped
                    mid-epoch resumes at the next batch of the same, reproducible, order)
    config          JSON: model, optimizer and the other settings the run used
    world_size      ranks of the data-parallel run that wrote it (1 alone; absent in older files)
    global_batch    samples per step over all ranks (absent in older files): with step_in_epoch,
                    where in the epoch a run of another world size or batch resumes

The file is written to a temporary file in the same folder, flushed to disk, and renamed over
the target with `os.replace` (atomic on POSIX), so a crash at any point leaves either the old
checkpoint or the new one, whole, and never a mix.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ember.passes.pipeline import write_atomic

__all__ = ["Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint", "load_weights", "atomic_write_bytes"]

FORMAT = "ember.checkpoint"
VERSION = "1"
_MODEL, _OPTIM = "model/", "optimizer/"


class CheckpointError(ValueError):
    """A file that is not a readable ember checkpoint (or weights file); the message names it."""


@dataclass
class Checkpoint:
    model: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)
    epoch: int = 0
    step: int = 0
    step_in_epoch: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # where it was read from
    world_size: int = 1
    global_batch: int | None = None  # None: not recorded (an older checkpoint)


def _write(f: Any, data: bytes) -> None:
    """Writes the serialized checkpoint into the open temporary file (a seam for crash tests)."""
    f.write(data)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` via a temporary file in the same folder, fsync and os.replace.

    On any failure (including KeyboardInterrupt) the temporary file is removed and `path` is
    left exactly as it was. An OSError names `path` (its filename), not the temporary file, which
    no longer exists by then.
    """
    write_atomic(path, data, durable=True, write=lambda f, d: _write(f, d))


def save_checkpoint(path: str | os.PathLike, model: Mapping[str, np.ndarray],
                    optimizer: Mapping[str, np.ndarray] | None = None, *, epoch: int = 0, step: int = 0,
                    step_in_epoch: int = 0, config: Mapping[str, Any] | None = None, world_size: int = 1,
                    global_batch: int | None = None) -> None:
    """Writes a checkpoint atomically (see the module docstring for the layout)."""
    from safetensors.numpy import save

    # np.ascontiguousarray would turn a 0-d state (Adam's step count) into shape (1,)
    contiguous = lambda v: np.array(v, order="C", copy=not np.asarray(v).flags.c_contiguous)  # noqa: E731
    tensors = {_MODEL + k: contiguous(v) for k, v in model.items()}
    tensors.update({_OPTIM + k: contiguous(v) for k, v in (optimizer or {}).items()})
    metadata = {"format": FORMAT, "version": VERSION, "epoch": str(int(epoch)), "step": str(int(step)),
                "step_in_epoch": str(int(step_in_epoch)), "config": json.dumps(dict(config or {}), sort_keys=True),
                "world_size": str(int(world_size))}
    if global_batch is not None:
        metadata["global_batch"] = str(int(global_batch))
    atomic_write_bytes(path, save(tensors, metadata=metadata))


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for bad files
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                              f"truncated or not a checkpoint?") from None
    return tensors, metadata


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Reads a checkpoint written by `save_checkpoint`; raises CheckpointError for anything else."""
    path = Path(path)
    tensors, meta = _read_safetensors(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: a safetensors file but not an ember checkpoint (metadata format="
                              f"{meta.get('format')!r}, expected {FORMAT!r}); to start from its weights "
                              f"use --init-weights instead of --resume")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: ember checkpoint version {meta.get('version')!r}; this ember reads {VERSION!r}")
    try:
        epoch, step, in_epoch = int(meta["epoch"]), int(meta["step"]), int(meta.get("step_in_epoch", "0"))
        config = json.loads(meta.get("config", "{}"))
        world_size = int(meta.get("world_size", "1"))
        global_batch = int(meta["global_batch"]) if "global_batch" in meta else None
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: bad checkpoint metadata ({type(e).__name__}: {e})") from None
    model = {k[len(_MODEL):]: v for k, v in tensors.items() if k.startswith(_MODEL)}
    optimizer = {k[len(_OPTIM):]: v for k, v in tensors.items() if k.startswith(_OPTIM)}
    return Checkpoint(model, optimizer, epoch, step, in_epoch, config, os.fspath(path), world_size, global_batch)


def load_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """A PyTorch-style state dict (name -> array) from `.safetensors` or `.npz`.

    An ember checkpoint is accepted too (its model part is used). This is what
    `torch_mnist.py --dump-init FILE.npz` writes, or `safetensors.torch.save_file(model.state_dict(), ...)`.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    if suffix == ".safetensors":
        tensors, meta = _read_safetensors(path)
        if meta.get("format") == FORMAT:
            return {k[len(_MODEL):]: v for k, v in tensors.items() if k.startswith(_MODEL)}
        return tensors
    raise CheckpointError(f"{path}: unsupported weights file {suffix or '(no suffix)'!r}; expected a .safetensors "
                          f"or .npz file holding a PyTorch-style state dict (from PyTorch: "
                          f"np.savez(path, **{{k: v.numpy() for k, v in model.state_dict().items()}}))")
