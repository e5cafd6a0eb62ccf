"""Start-of-run checks that every rank of a data-parallel world runs the same thing.

Parameters are broadcast from rank 0 and hashed (`comm.broadcast_parameters`); this module adds
the other ways ranks silently diverge: a rank started with other settings (another model,
`--lr`, batch size) or another step plan (epochs, steps per epoch: a rank that runs fewer steps
leaves the others waiting for it in an all-reduce, forever), a rank that compiled a different
step (another version of the code) and a rank that reads different data (another folder, a
damaged file). Settings are compared as labelled values (`agree_on_fields`), so the message
names the first that differs and its value on each rank; steps and data as digests. Each rank reduces what it has to a SHA-256 digest plus a few
numbers (sizes), the digests are gathered on every rank (an all-reduce of one slot per rank,
so it works through any communicator with `all_reduce`, and every rank reaches the same verdict
and stops together instead of leaving the others waiting in the first step), and a mismatch
raises `ConsistencyError` with one line naming the ranks that differ from rank 0 and what
differs.

What is hashed:
- the step: the generated source (C++ or CUDA) the executor compiled, without its `//` comment
  lines (they carry provenance, user file paths, which may differ between checkouts but do not
  change what runs); a graph printed as text where an executor has no source;
- the data: each array's dtype and shape and its bytes: all of them (SHA-256 runs at about
  1.5 GB/s with the SHA extensions: 0.13 s for MNIST's 188 MB of float32 training images, where
  reading them takes 0.7 s) up to `FULL_HASH_BYTES`; beyond that, the rows of an evenly
  strided sample of about that size, plus the first and last rows (a difference elsewhere then
  goes unseen; the sizes are always compared).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

#: arrays up to this many bytes in all are hashed whole; larger ones by a strided row sample
FULL_HASH_BYTES = 512 * 2**20

_DIGEST = 32  # bytes of a SHA-256 digest


class ConsistencyError(RuntimeError):
    """The ranks of a data-parallel world do not run the same step or read the same data."""


def source_digest(code: str) -> bytes:
    """SHA-256 of generated source with its `//` comment lines (provenance) left out."""
    h = hashlib.sha256()
    for line in code.splitlines():
        if not line.lstrip().startswith("//"):
            h.update(line.encode())
            h.update(b"\n")
    return h.digest()


def step_digest(executor: Any, graph: Any = None) -> bytes:
    """The digest of what a compiled step runs: its generated source, else its graph's text."""
    source = getattr(executor, "source", None)
    code = getattr(source, "code", None)
    if isinstance(code, str):
        return source_digest(code)
    from ember.ir import format_graph
    return hashlib.sha256(format_graph(graph).encode()).digest()


def _rows(a: np.ndarray) -> np.ndarray:
    return a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(-1, 1) if a.ndim == 1 else a.reshape(1, 1)


def data_digest(arrays: Sequence[Any], full_limit: int = FULL_HASH_BYTES) -> tuple[bytes, bool]:
    """(SHA-256 of the arrays' dtypes, shapes and contents, whether every byte was hashed).
    Device arrays (CuPy) are brought to the host first."""
    host = [np.asarray(a.get() if hasattr(a, "__cuda_array_interface__") else a) for a in arrays]
    total = sum(a.nbytes for a in host)
    full = total <= full_limit
    h = hashlib.sha256()
    for a in host:
        h.update(f"{a.dtype.str}{a.shape};".encode())
        if a.size == 0:
            continue
        if full:
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
            continue
        rows = _rows(a)
        stride = max(1, -(-total // full_limit))  # every stride-th row: about full_limit bytes in all
        for part in (rows[::stride], rows[-1:]):
            h.update(memoryview(np.ascontiguousarray(part)).cast("B"))
    return h.digest(), full


def agree(comm: Any, what: str, digest: bytes, facts: Sequence[int] = (), describe: Any = None) -> None:
    """Checks that every rank of `comm` holds the same `digest` (and the same `facts`, small
    integers such as sizes); raises ConsistencyError on every rank otherwise, naming the ranks
    that differ from rank 0 and what differs (`what`, and `describe(facts, digest)` per rank).

    A collective: every rank must call it, with the same number of facts."""
    if comm is None or comm.size <= 1:
        return
    if len(digest) != _DIGEST:
        raise ValueError(f"agree: expected a {_DIGEST}-byte digest, got {len(digest)} bytes")
    width = _DIGEST + len(facts)
    mine = np.concatenate([np.frombuffer(digest, np.uint8).astype(np.float64), np.asarray(facts, np.float64)])
    if any(abs(f) >= 2**53 for f in facts):
        raise ValueError("agree: facts must be integers below 2**53 (exact in float64)")
    table = np.zeros(comm.size * width)  # one slot per rank; the sum of zeros and one value is exact
    table[comm.rank * width:(comm.rank + 1) * width] = mine
    comm.all_reduce(table, "sum")
    table = table.reshape(comm.size, width)
    differ = [r for r in range(1, comm.size) if not np.array_equal(table[r], table[0])]
    if not differ:
        return

    def said(r: int) -> str:
        d = bytes(table[r, :_DIGEST].astype(np.uint8))
        f = [int(v) for v in table[r, _DIGEST:]]
        return describe(f, d) if describe is not None else f"sha256 {d.hex()[:12]}"

    ranks = f"rank {differ[0]} differs" if len(differ) == 1 else f"ranks {', '.join(map(str, differ))} differ"
    raise ConsistencyError(f"{ranks} from rank 0 in {what}: {said(differ[0])} on rank {differ[0]}, "
                           f"{said(0)} on rank 0; every rank must run the same code on the same data")


def agree_on_step(comm: Any, executor: Any, graph: Any = None) -> None:
    """Every rank compiled the same step (see the module docstring)."""
    agree(comm, "the compiled training step (its generated source)", step_digest(executor, graph),
          describe=lambda f, d: f"sha256 {d.hex()[:12]}")


def agree_on_data(comm: Any, name: str, arrays: Sequence[Any]) -> None:
    """Every rank reads the same `arrays` (e.g. a dataset's inputs and labels), named `name`."""
    digest, full = data_digest(arrays)
    facts = [len(arrays[0]) if len(arrays) else 0, sum(int(np.prod(a.shape)) for a in arrays)]
    how = "" if full else " (of a strided sample)"
    agree(comm, name, digest, facts, describe=lambda f, d: f"{f[0]} samples, sha256{how} {d.hex()[:12]}")


#: bytes of a setting's text shown per rank in a mismatch (the comparison uses its whole digest)
VALUE_BYTES = 64


def _shown(value: object) -> bytes:
    text = value if isinstance(value, str) else repr(value)
    return text.encode()[:VALUE_BYTES].ljust(VALUE_BYTES, b"\0")


def agree_on_fields(comm: Any, fields: Sequence[tuple[str, object]],
                    must: str = "every rank must be started with the same settings") -> None:
    """Every rank holds the same value for every labelled field (model name, batch size, epochs,
    ...); raises ConsistencyError on every rank otherwise, naming the first field that differs and
    its value on the first rank that differs and on rank 0:
    "rank 1 differs from rank 0: model is mlp on rank 1, cnn on rank 0; <must>".

    A collective: every rank must call it; the labels are agreed first, so ranks that pass
    different fields get a ConsistencyError too, not a hang."""
    if comm is None or comm.size <= 1:
        return
    labels = "\0".join(label for label, _ in fields).encode()
    agree(comm, "the settings checked at the start", hashlib.sha256(labels).digest(), [len(fields)],
          describe=lambda f, d: f"{f[0]} settings (names sha256 {d.hex()[:12]})")
    width = _DIGEST + VALUE_BYTES
    mine = np.zeros(len(fields) * width)
    for i, (_, value) in enumerate(fields):
        text = value if isinstance(value, str) else repr(value)
        row = hashlib.sha256(text.encode()).digest() + _shown(value)
        mine[i * width:(i + 1) * width] = np.frombuffer(row, np.uint8)
    table = np.zeros(comm.size * mine.size)
    table[comm.rank * mine.size:(comm.rank + 1) * mine.size] = mine
    comm.all_reduce(table, "sum")
    table = table.reshape(comm.size, len(fields), width)
    for i, (label, _) in enumerate(fields):
        differ = [r for r in range(1, comm.size) if not np.array_equal(table[r, i], table[0, i])]
        if differ:
            def said(r: int) -> str:
                return bytes(table[r, i, _DIGEST:].astype(np.uint8)).rstrip(b"\0").decode(errors="replace")
            ranks = f"rank {differ[0]} differs" if len(differ) == 1 else \
                f"ranks {', '.join(map(str, differ))} differ"
            beyond = f" (they differ past the {VALUE_BYTES} bytes shown)" if said(differ[0]) == said(0) else ""
            raise ConsistencyError(f"{ranks} from rank 0: {label} is {said(differ[0])} on rank {differ[0]}, "
                                   f"{said(0)} on rank 0{beyond}; {must}")
