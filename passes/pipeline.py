"""The standard pass lists, and the driver that runs them with hooks and dumps.

A target's record (`ember.passes.targets.Target`) names its pipeline: one of the functions here,
which builds the ordered (name, pass) list from the record's data (fusion capabilities, kernel
selection, alignment). `passes_for(target)` is that list for a registered target; `run_passes`
runs a list, verifies the graph after every pass, calls the optional before/after hooks, and (with
`dump_dir` or `$EMBER_DUMP_DIR`) writes the graph after every pass as `NN-<name>.txt` (printer
text) and `NN-<name>.dot`, the input as `00-input.*`. Dump files are written whole or not at all
(`write_text_atomic`), so a full disk leaves no truncated dump that reads as a different graph.
"""
from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any
from pathlib import Path

from ember.ir import Graph, format_graph, to_dot

from . import targets
from .autodiff import grad
from .data_parallel import DEFAULT_BUCKET_BYTES, data_parallel
from .fusion import fuse
from .memory import plan_memory
from .optimizer import OptimizerConfig, apply_optimizer
from .precision import autocast
from .schedule import schedule
from .select import select_kernels
from .share_relayouts import share_relayouts
from .simplify import simplify

Pass = Callable[[Graph], Graph]
Hook = Callable[[str, Graph], None]


def interpreted(target: "targets.Target") -> list[tuple[str, Pass]]:
    """For a target that runs the graph as it is (the NumPy interpreter): clean-up only."""
    return [("simplify", simplify)]


def kernels(target: "targets.Target") -> list[tuple[str, Pass]]:
    """For a target that compiles kernels: fuse as its capabilities allow, size each kernel's
    scratch, let kernels share relaid operands where the target can, order the kernels, then plan
    one arena at the target's alignment."""
    shared = [("share_relayouts", functools.partial(share_relayouts, target=target))] \
        if target.shared_relayout is not None else []
    return [("simplify", simplify),
            ("fusion", functools.partial(fuse, caps=target.fusion)),
            ("select", functools.partial(select_kernels, target=target)),
            *shared,
            ("schedule", functools.partial(schedule, early_collectives=target.early_collectives)),
            ("memory", functools.partial(plan_memory, alignment=target.alignment, reuse=target.reuse_memory))]


def passes_for(target: str) -> list[tuple[str, Pass]]:
    """A fresh copy of the ordered pass list of the registered target `target`."""
    return targets.get(target).passes()


def with_data_parallel(passes: Sequence[tuple[str, Pass]], world_size: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[tuple[str, Pass]]:
    """A target's train pass list with `data_parallel` right after `simplify` when world_size > 1
    (it needs autodiff's gradient tags, which fusion does not keep); unchanged for one process."""
    out = list(passes)
    if world_size <= 1:
        return out
    at = next((i + 1 for i, (name, _) in enumerate(out) if name == "simplify"), 0)
    out.insert(at, ("data_parallel", functools.partial(data_parallel, world_size=world_size, bucket_bytes=bucket_bytes)))
    return out


def precision_passes(precision: str) -> list[tuple[str, Pass]]:
    """What a precision adds before everything else (before autodiff, as torch.autocast runs on
    the forward): "bf16" rewrites the traced graph by `precision.RULES`; "float32" and "tf32"
    (an arithmetic mode of the contraction kernels alone) add nothing."""
    return [("autocast", autocast)] if precision == "bf16" else []


def trainable(graph: Graph) -> list[str]:
    """The parameters of `graph` a training step differentiates: all but `meta["frozen"]`."""
    frozen = set(graph.meta.get("frozen", ()))
    return [p for p in graph.parameters if p not in frozen]


def train_passes(optimizer_config: OptimizerConfig, *, loss: str = "out") -> list[tuple[str, Pass]]:
    """The two passes that turn a forward (loss) graph into a training step. Parameters named in
    the graph's `meta["frozen"]` (requires_grad False, or left out of the optimizer's params) get
    no gradient, so the optimizer leaves them as they are."""
    return [("autodiff", lambda g: grad(g, loss=loss, wrt=trainable(g))),
            ("optimizer", lambda g: apply_optimizer(g, optimizer_config))]


def write_atomic(path: str | os.PathLike, data: str | bytes, *, durable: bool = False,
                 write: Callable[[Any, Any], None] | None = None) -> None:
    """Writes `data` to a temporary file beside `path` and renames it over `path`, so a crash or
    a full disk leaves the old file whole and no partial one; on failure the temporary file is
    removed and the OSError names `path`. `durable` also flushes the file and the rename to disk
    (checkpoints); `write(file, data)` replaces the plain write (a seam for crash tests)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w", **({} if isinstance(data, bytes)
                                                                         else {"encoding": "utf-8"})) as f:
            (write or (lambda f_, d: f_.write(d)))(f, data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.errno is None:  # not from the system: nothing to restate
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        try:  # make the rename itself durable; not possible everywhere, and not needed for atomicity
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass


def write_text_atomic(path: Path, text: str) -> None:
    """`write_atomic` for a text file (dumps)."""
    write_atomic(path, text)


def _dump(dump_dir: Path, index: int, name: str, graph: Graph) -> None:
    stem = f"{index:02d}-{name}"
    write_text_atomic(dump_dir / f"{stem}.txt", format_graph(graph, show_notes=True) + "\n")
    write_text_atomic(dump_dir / f"{stem}.dot", to_dot(graph))


def run_passes(graph: Graph, passes: Sequence[tuple[str, Pass]], *, dump_dir: str | os.PathLike | None = None,
               before: Hook | None = None, after: Hook | None = None) -> Graph:
    """Applies `passes` in order; hooks are called as hook(name, graph). Each result is verified
    fully under `EMBER_VERIFY=1` (the tests); otherwise the structure of the last one only
    (`Graph.verify`)."""
    if dump_dir is None:
        dump_dir = os.environ.get("EMBER_DUMP_DIR") or None
    out = Path(dump_dir) if dump_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _dump(out, 0, "input", graph)
    for i, (name, fn) in enumerate(passes, start=1):
        if before is not None:
            before(name, graph)
        result = fn(graph)
        if not isinstance(result, Graph):
            raise TypeError(f"pass {name!r} returned {type(result).__name__}, expected a Graph")
        graph = result.verify()
        if after is not None:
            after(name, graph)
        if out is not None:
            _dump(out, i, name, graph)
    if os.environ.get("EMBER_VERIFY", "") in ("", "0"):
        graph.verify(full=False)
    return graph


def build_train_graph(forward: Graph, optimizer_config: OptimizerConfig, *, loss: str = "out",
                      dump_dir: str | os.PathLike | None = None, before: Hook | None = None,
                      after: Hook | None = None) -> Graph:
    """forward (a scalar loss output) -> forward + backward + optimizer update."""
    return run_passes(forward, train_passes(optimizer_config, loss=loss), dump_dir=dump_dir,
                      before=before, after=after)
