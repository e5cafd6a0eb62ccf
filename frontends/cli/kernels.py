"""`ember kernels`: write every generated source of a model's training and inference steps.

    ember kernels --model cnn --device cuda --out DIR [--gpu a100]

Runs the device's passes and code generator only (no compiler, no GPU), so the CUDA sources can
be written and checked (`nvcc -cubin -arch=sm_90`) on a machine without a GPU, as CI does. CUDA
kernels are planned for the GPU at hand, an H200 without one, or the known GPU `--gpu` names. Writes
`DIR/<step>.<ext>` (the step's source), `DIR/<step>.txt` (the graph after every pass) for the
training step and the inference step, and prints one line per file.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from ember.codegen.device import KNOWN, named, using
from ember.ir import format_graph
from ember.runtime import target as get_target
from ember.runtime import target_names

from ember.frontends import nn, plan

from ember.frontends.checkpoint import atomic_write_bytes
from ..training.recipes import MODELS, make_optimizer
from ..training.zoo import ZOO, require_torch, zoo_model
from .cli_checks import check_output_dir, describe_os_error, precision_flag

EXTENSIONS = {"cpp": ".cpp", "cuda": ".cu"}


def write_kernels(model_name: str, device: str, out: Path, batch_size: int = 64,
                  precision: str = "float32", gpu: str | None = None) -> list[Path]:
    """Writes the sources of `model_name`'s steps for `device` under `out`, for the known GPU
    called `gpu` where one is named; returns the paths."""
    with using(named(gpu)) if gpu is not None else contextlib.nullcontext():
        return _write_kernels(model_name, device, out, batch_size, precision)


def _write_kernels(model_name: str, device: str, out: Path, batch_size: int, precision: str) -> list[Path]:
    import numpy as np
    target = get_target(device)
    if target.source is None:
        raise ValueError(f"device {device!r} generates no source code (it interprets the graph)")
    model = zoo_model(model_name)
    shape = (batch_size, *ZOO[model_name].input_shape)
    example = (np.zeros(shape, np.float32), np.zeros(batch_size, np.int64))
    graphs = plan(model, nn.CrossEntropyLoss(), make_optimizer("sgd", 0.05), example, device=device,
                  precision=precision)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for step, graph in graphs.items():
        source = out / f"{model_name}-{step}{EXTENSIONS.get(target.language or '', '.txt')}"
        # whole files or none: a truncated source on a full disk would fail nvcc far from the cause
        atomic_write_bytes(source, target.source(graph).encode())
        text = out / f"{model_name}-{step}.txt"
        atomic_write_bytes(text, (format_graph(graph, show_notes=True) + "\n").encode())
        written += [source, text]
    return written


def add_arguments(p: Any) -> None:
    p.add_argument("--model", choices=list(ZOO), default="cnn",
                   help="a recipe or zoo model (the zoo's own models need PyTorch: they are defined in it)")
    p.add_argument("--device", default="cpu", metavar="{" + ",".join(target_names()) + "}[:N]")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the sources (created)")
    p.add_argument("--tf32", action="store_true", help="cuda: the kernels of compile(..., precision='tf32')")
    p.add_argument("--bf16", action="store_true", help="the kernels of compile(..., precision='bf16') (bfloat16 "
                                                       "mixed precision)")
    p.add_argument("--gpu", metavar="NAME", help=f"cuda: plan the kernels for this GPU ({', '.join(KNOWN)}; "
                                                 f"default: the one at hand, else h200)")


def main(args: Any) -> int:
    if args.batch_size < 1:
        print(f"ember kernels: error: --batch-size must be at least 1, got {args.batch_size}", file=sys.stderr)
        return 2
    if args.gpu is not None:
        if args.device.split(":")[0] != "cuda":
            print(f"ember kernels: error: --gpu plans CUDA kernels; it needs --device cuda, not {args.device!r}",
                  file=sys.stderr)
            return 2
        try:
            named(args.gpu)
        except ValueError as exc:
            print(f"ember kernels: error: --gpu: {exc}", file=sys.stderr)
            return 2
    if args.model not in MODELS:  # the zoo's own models exist only as PyTorch definitions
        try:
            require_torch()
        except ModuleNotFoundError as exc:
            print(f"ember kernels: error: {args.model}: {exc}", file=sys.stderr)
            return 2
    args.precision = precision_flag(args)  # a UsageError: one line, exit status 2
    out = check_output_dir("--out", args.out)
    try:
        for path in write_kernels(args.model, args.device, out, args.batch_size,
                                  args.precision, args.gpu):
            print(path)
    except ValueError as exc:
        print(f"ember kernels: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # found only when written (a full disk): the machine failed, not the arguments
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"ember kernels: error: {where}{describe_os_error(exc)}", file=sys.stderr)
        return 1
    return 0
