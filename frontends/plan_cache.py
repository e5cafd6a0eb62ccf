"""The plan cache: a traced step's graph after every pass, and its generated source, kept on disk,
so compiling the same model again (a rerun of a script, another process) skips the passes and
the code generator; the compiler's own cache then finds every object (`codegen/compiler.py`).
This is what makes a warm `compile()` a trace, a hash and a load.

The key is everything the result depends on: the traced graph as text (its ops, types, attributes
and provenance, which kernel headers quote) and the bytes of its constants, the passes and their
configuration (optimizer, precision, target), the device the kernels are chosen for, the tuning
database that chooses them, the families a `force` block holds kernels to, and the code of ember
itself (every module and template), so a changed pass or template never serves an old plan.
What cannot be keyed reliably is not cached: a data-parallel step (its communicator), a step
compiled with dumps (the passes must run to write them), or a pass whose configuration prints an
object address. `EMBER_PLAN_CACHE=0` turns the cache off (the test suite does, so that tests
which patch a pass see it run).

Entries are pickles under `$EMBER_CACHE_DIR/plans/`, written atomically; an unreadable entry is a
miss, and an entry that cannot be written costs time only.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.codegen import cpp_choices, cuda_choices, tuning_db
from ember.codegen.compiler import cache_dir
from ember.ir import Graph, format_graph
from ember.passes.pipeline import write_atomic

__all__ = ["enabled", "step_key", "load", "store"]

#: bump when what an entry holds changes shape
FORMAT = 1
#: graph meta entries that hold live objects (the model's Parameters and Buffers): never pickled,
#: restored from the trace that looked the entry up
LIVE_META = ("parameters", "buffers")


def enabled() -> bool:
    return os.environ.get("EMBER_PLAN_CACHE", "1") not in ("0", "")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of ember's own code: every module, template and shipped file of its packages."""
    import ember.codegen
    import ember.frontends
    import ember.ir
    import ember.passes
    import ember.runtime
    h = hashlib.sha256()
    for package in (ember.ir, ember.passes, ember.codegen, ember.runtime, ember.frontends):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".j2", ".json") and "__pycache__" not in path.parts:
                h.update(f"{package.__name__}/{path.relative_to(root).as_posix()}".encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _canon(v: Any) -> str:
    """A text of a pass's configuration that is the same in every process: sets sorted, functions
    by name, a target by its name (keyed on its own), dataclasses field by field."""
    if isinstance(v, functools.partial):
        return f"{_canon(v.func)}({', '.join(map(_canon, v.args))}; {_canon(v.keywords)})"
    if hasattr(v, "pipeline") and hasattr(v, "executor") and hasattr(v, "name"):  # a Target record
        return f"target:{v.name}"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return f"{type(v).__qualname__}({', '.join(f'{f.name}={_canon(getattr(v, f.name))}' for f in dataclasses.fields(v))})"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(map(_canon, v))) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(sorted(f"{_canon(k)}: {_canon(x)}" for k, x in v.items())) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(_canon, v)) + "]"
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '?')}.{v.__qualname__}"
    return repr(v)


def step_key(forward: Graph, passes: Sequence[tuple[str, Any]], *, target: Any, device: str, profile: bool,
             extra: str = "") -> str | None:
    """The cache key of `forward` through `passes` for `target`, or None when it cannot be keyed."""
    h = hashlib.sha256()
    for part in (f"ember-plan-{FORMAT}", code_fingerprint(), target.name, device, f"profile={profile}", extra,
                 format_graph(forward, show_notes=True)):
        h.update(part.encode())
        h.update(b"\0")
    recipe = "\n".join(f"{name}:{_canon(fn)}" for name, fn in passes)
    if " at 0x" in recipe:  # a configuration object without a stable repr: no reliable key
        return None
    h.update(recipe.encode())
    for n in forward.topo_order():
        if forward.op(n) == "constant":
            value = np.ascontiguousarray(forward.attrs(n)["value"])
            h.update(f"{value.dtype}{value.shape}".encode())
            h.update(value.tobytes())
    db = tuning_db.active()
    h.update(b"no-db" if db is None else db.fingerprint(target.name, device).encode())
    for table in (cpp_choices.TABLE, cuda_choices.TABLE):  # a step compiled inside `force` chose by it
        h.update(repr(sorted(table.forced().items())).encode())
    return h.hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / "plans" / key[:2] / f"{key}.pkl"


def load(key: str, forward: Graph) -> tuple[Graph, Any] | None:
    """(planned graph, generated source) of an entry, its live meta taken from `forward`; None on a miss."""
    try:
        with open(_path(key), "rb") as f:
            fmt, graph, source = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError, ImportError):
        return None
    if fmt != FORMAT:
        return None
    for name in LIVE_META:
        if name in forward.meta:
            graph.meta[name] = forward.meta[name]
    return graph, source


def store(key: str, graph: Graph, source: Any) -> None:
    """Keeps (graph, source) under `key`; a failure to write (a full disk, a read-only cache) is ignored."""
    meta = graph.meta
    graph.meta = {k: v for k, v in meta.items() if k not in LIVE_META}
    try:
        data = pickle.dumps((FORMAT, graph, source), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return
    finally:
        graph.meta = meta
    try:
        write_atomic(_path(key), data)
    except OSError:
        pass
