"""Argument and path checks of the `ember` commands, run before any data is read or step compiled.

A mistake in an output path used to surface only when the file was written: after the first
epoch (--save) or after all of them (--plot), so a long run was lost to a typo. Every check here
raises `UsageError` with one line naming the flag, the path, the fault and what was expected;
`ember.frontends.cli` prints it as ``ember <command>: error: ...`` and exits with 2.

Permission bits do not tell whether a file can be made (root passes os.access everywhere, /proc
and read-only or full file systems refuse anyway), so an output folder is also tried: a real
temporary file, one byte long, is created in it and removed.
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import tempfile
from pathlib import Path

from ..training.metrics import format_loss  # re-exported: the commands print losses with it
from ..training.recipes import MODELS
from ..training.zoo import ZOO, require_torch

__all__ = ["UsageError", "check_output_file", "check_output_dir", "check_plot_file", "check_input_file",
           "check_hyperparameters", "check_device", "check_tf32", "precision_flag", "describe_os_error", "format_loss",
           "selected_models", "check_torch_for"]


class UsageError(Exception):
    """An ordinary user mistake: the CLI prints the message on one line, with no traceback."""


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def describe_os_error(e: OSError) -> str:
    """"No space left on device (errno 28, ENOSPC)": the words, and what to search for."""
    why = e.strerror or str(e)
    if e.errno is None:
        return why
    return f"{why} (errno {e.errno}, {errno.errorcode.get(e.errno, '?')})"


def _try_writing(flag: str, path: Path, folder: Path, expected: str) -> None:
    """Creates, writes one byte to and removes a temporary file in `folder`."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ember-write-test-")
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create a file in {folder}: {describe_os_error(e)}; "
                         f"expected {expected}") from None
    try:
        os.write(fd, b"\0")
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {folder}: {describe_os_error(e)}; "
                         f"expected {expected}") from None
    finally:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (what a later mkdir(parents=True) starts from)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def _check_parent(flag: str, path: Path) -> None:
    """The folder `path` goes in exists and is writable, or can be created (mkdir -p)."""
    base = _nearest_existing(path.parent if path.parent != Path("") else Path("."))
    if not base.is_dir():
        raise UsageError(f"{flag} {path}: {base} is a file, not a directory; expected a path in a writable folder")
    if not _writable(base):
        raise UsageError(f"{flag} {path}: cannot write in {base} (permission denied); expected a path in a writable folder")
    _try_writing(flag, path, base, "a path in a writable folder")


def check_output_file(flag: str, path: str | os.PathLike) -> Path:
    """A file the run will write (created, or replaced whole): not a directory, in a writable folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{flag} {p}: is a directory; expected a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{flag} {p}: the file is not writable (permission denied)")
    _check_parent(flag, p)
    return p


def check_output_dir(flag: str, path: str | os.PathLike) -> Path:
    """A folder the run will write into (created if missing): not a file, writable."""
    if os.fspath(path) == "":
        # Path("") is ".": the files would land in the current folder, mixed with whatever is there
        raise UsageError(f"{flag} '': an empty path; expected a directory name (use {flag} . for the current one)")
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {p}: is a file; expected a directory (existing or to be created)")
        if not _writable(p):
            raise UsageError(f"{flag} {p}: cannot write in this directory (permission denied)")
        _try_writing(flag, p, p, "a writable directory")
        return p
    _check_parent(flag, p)
    return p


def check_plot_file(flag: str, path: str | os.PathLike) -> Path:
    """An image matplotlib can write: its extension names a format it knows (none means PNG)."""
    p = check_output_file(flag, path)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install 'ember[plot]'") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = p.suffix[1:].lower()
    if ext and ext not in formats:
        raise UsageError(f"{flag} {p}: unknown image format {p.suffix!r}; expected one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return p


def check_input_file(flag: str, path: str | os.PathLike, what: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{flag} {p}: is a directory; expected {what}")
    if not p.exists():
        raise UsageError(f"{flag} {p}: no such file; expected {what}")
    return p


def check_hyperparameters(lr: float, momentum: float) -> None:
    """Refuses what would train on NaN at once (and what torch.optim refuses)."""
    if not math.isfinite(lr) or lr < 0:
        raise UsageError(f"--lr {lr}: expected a finite learning rate >= 0")
    if not math.isfinite(momentum) or momentum < 0:
        raise UsageError(f"--momentum {momentum}: expected a finite momentum >= 0")


def check_device(device: str) -> None:
    """The device is a registered backend that can run here (CuPy importable, a GPU present): the
    one-line reason otherwise, the same for every command."""
    from ember.runtime import target, target_names

    name, colon, index = device.partition(":")
    if name not in target_names():
        raise UsageError(f"--device {device}: no such backend; available: {', '.join(target_names())} "
                         f"(a GPU by index: cuda:N)")
    if colon and not (index.isdigit() and target(name).select_device is not None):
        raise UsageError(f"--device {device}: expected {name!r}" + (f" or {name}:N with a device index N >= 0"
                                                                     if target(name).select_device else ""))
    available = target(device).available
    if available is not None:
        try:
            available()
        except RuntimeError as exc:
            raise UsageError(f"--device {device}: {exc}") from None


def check_tf32(tf32: bool, device: str) -> None:
    if tf32 and device.partition(":")[0] != "cuda":
        raise UsageError(f"--tf32: TF32 is a CUDA tensor-core mode; --device {device} computes in float32")


def precision_flag(args: "argparse.Namespace") -> str:
    """The precision `--tf32` / `--bf16` ask for ("float32" without either), checked against the
    command's --device: one flag at most, and one the device computes in."""
    tf32, bf16 = bool(getattr(args, "tf32", False)), bool(getattr(args, "bf16", False))
    if tf32 and bf16:
        raise UsageError("--tf32 and --bf16: choose one precision")
    check_tf32(tf32, args.device)
    from ember.runtime import target, target_names
    if not bf16:
        return "tf32" if tf32 else "float32"
    name = args.device.partition(":")[0]
    if name in target_names() and "bf16" not in target(name).precisions:
        having = [t for t in target_names() if "bf16" in target(t).precisions]
        raise UsageError(f"--bf16: --device {args.device} has no bfloat16 kernels (devices with them: "
                         f"{', '.join(having)})")
    return "bf16"


def selected_models(model: str, zoo: bool) -> list[str]:
    """The models a `--model` list names (comma-separated; "all": the recipes), or with `--zoo`
    every zoo model; unknown names are the caller's to refuse."""
    if zoo:
        return list(ZOO)
    return list(MODELS) if model == "all" else [m.strip() for m in model.split(",") if m.strip()]


def check_torch_for(models: list[str]) -> None:
    """The zoo's own models exist only as PyTorch definitions: one line when PyTorch is missing."""
    if any(m not in MODELS for m in models):
        try:
            require_torch()
        except ModuleNotFoundError as e:
            raise UsageError(f"{', '.join(m for m in models if m not in MODELS)}: {e}") from None
