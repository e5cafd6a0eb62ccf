"""Communicators: how the ranks of a data-parallel world exchange buffers on the CPU.

`Communicator` is the interface (rank, size, `all_reduce(buffer, op)` in place, `broadcast(buffer,
root)` in place, `barrier()`); `SingleProcess` is the world of one (every call is the identity)
and `MpiCommunicator` goes through mpi4py (imported only here, only when an MPI world is asked
for). `from_env()` picks one: MPI when the process is one of several ranks, started by
`ember launch` (which runs `mpiexec` and sets RANK/WORLD_SIZE, the torchrun contract) or by
`mpiexec -n N` directly (hydra's PMI_RANK/PMI_SIZE); SingleProcess otherwise.

Sums are in the buffer's dtype; `mean` divides by the world size afterwards, on every rank, so
every rank holds bit-identical results (MPI_Allreduce gives every rank the same bits).

Non-blocking: `start_all_reduce(buffer, op)` starts the all-reduce (MPI_Iallreduce) and returns
a `Pending`, whose `wait()` completes it (and divides, for `mean`) and `test()` lets MPI progress
it. MPI (mpich without an asynchronous progress thread) moves a non-blocking collective only
inside MPI calls, so the runtime calls `test()` at every segment boundary it passes.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np

OPS = ("sum", "mean")


class Communicator(Protocol):
    rank: int
    size: int

    def all_reduce(self, buffer: np.ndarray, op: str = "sum") -> None: ...

    def broadcast(self, buffer: np.ndarray, root: int = 0) -> None: ...

    def barrier(self) -> None: ...


def _check(buffer: np.ndarray, op: str) -> None:
    if op not in OPS:
        raise ValueError(f"all_reduce: op must be one of {OPS}, got {op!r}")
    if not (isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.flags.writeable):
        raise ValueError("all_reduce: the buffer must be a writable C-contiguous NumPy array")


class Pending:
    """A started all-reduce: `wait()` once before reading the buffer."""

    def __init__(self, request: Any, buffer: np.ndarray, op: str, size: int) -> None:
        self.request, self.buffer, self.op, self.size = request, buffer, op, size

    def test(self) -> bool:
        """Lets MPI progress the reduction; True once it is complete (the buffer is not divided yet)."""
        return self.request is None or bool(self.request.Test())

    def wait(self) -> None:
        if self.request is not None:
            self.request.Wait()
            self.request = None
            if self.op == "mean":
                np.divide(self.buffer, np.asarray(self.size, dtype=self.buffer.dtype), out=self.buffer)


class SingleProcess:
    """The world of one process: every collective is the identity."""

    rank = 0
    size = 1

    def all_reduce(self, buffer: np.ndarray, op: str = "sum") -> None:
        _check(buffer, op)

    def start_all_reduce(self, buffer: np.ndarray, op: str = "sum") -> Pending:
        _check(buffer, op)
        return Pending(None, buffer, op, 1)

    def broadcast(self, buffer: np.ndarray, root: int = 0) -> None:
        if root != 0:
            raise ValueError(f"broadcast: root {root} is not a rank of a world of 1")

    def barrier(self) -> None:
        pass


class MpiCommunicator:
    """MPI_COMM_WORLD through mpi4py (the `mpi` extra: mpi4py with the mpich wheel)."""

    def __init__(self) -> None:
        try:
            from mpi4py import MPI
        except ImportError as e:  # one line, with the fix
            raise WorldError(f"data parallel on the CPU needs mpi4py ({e}); pip install 'ember[mpi]'") from None
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def all_reduce(self, buffer: np.ndarray, op: str = "sum") -> None:
        _check(buffer, op)
        self.comm.Allreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM)
        if op == "mean":
            np.divide(buffer, np.asarray(self.size, dtype=buffer.dtype), out=buffer)

    def start_all_reduce(self, buffer: np.ndarray, op: str = "sum") -> Pending:
        _check(buffer, op)
        return Pending(self.comm.Iallreduce(self._mpi.IN_PLACE, buffer, op=self._mpi.SUM), buffer, op, self.size)

    def broadcast(self, buffer: np.ndarray, root: int = 0) -> None:
        self.comm.Bcast(buffer, root=root)

    def barrier(self) -> None:
        self.comm.Barrier()


class WorldError(ValueError):
    """This process cannot join the data-parallel world its environment describes (a bad RANK or
    WORLD_SIZE, no mpi4py, a launcher and MPI that disagree): a one-line setup error."""


def _env_int(env: Mapping[str, str], name: str, default: int, expected: str) -> int:
    text = env.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise WorldError(f"{name}={text}: expected {expected}") from None


def world_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK)
    or, under a bare `mpiexec`, hydra's (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID); (0, 1, 0) otherwise.
    Raises WorldError for values that are not integers or a rank outside the world."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    elif "PMI_SIZE" in env:
        names = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
    else:
        return 0, 1, 0
    size = _env_int(env, names[1], 1, "the number of ranks, an integer >= 1")
    if size < 1:
        raise WorldError(f"{names[1]}={size}: expected the number of ranks, an integer >= 1")
    rank = _env_int(env, names[0], 0, f"this process's rank, an integer in 0..{size - 1}")
    if not 0 <= rank < size:
        raise WorldError(f"{names[0]}={rank} is outside a world of {names[1]}={size} ranks: expected 0..{size - 1}")
    return rank, size, _env_int(env, names[2], rank, "an integer >= 0")


def from_env() -> "Communicator":
    """The communicator of this process's world (see the module docstring); WorldError when this
    process cannot join the world its environment describes."""
    rank, size, _ = world_from_env()
    if size == 1:
        return SingleProcess()
    comm = MpiCommunicator()
    if (comm.rank, comm.size) != (rank, size):
        alone = " (started alone, not by a launcher: unset WORLD_SIZE to run one process)" if comm.size == 1 else ""
        raise WorldError(f"the environment says rank {rank} of {size} (RANK, WORLD_SIZE), MPI says rank {comm.rank} "
                         f"of {comm.size}{alone}; start the ranks with `ember launch --nproc-per-node {size}` "
                         f"or `mpiexec -n {size}`")
    return comm


def all_reduce_many(comm: "Communicator", buffers: list[np.ndarray], op: str) -> None:
    """All-reduces several buffers in one call over one flat buffer (a bucket), in place."""
    if comm.size == 1 or not buffers:
        return
    if len(buffers) == 1 and buffers[0].flags.c_contiguous:
        comm.all_reduce(buffers[0], op)
        return
    flat = np.concatenate([b.reshape(-1) for b in buffers])
    comm.all_reduce(flat, op)
    at = 0
    for b in buffers:
        b[...] = flat[at:at + b.size].reshape(b.shape)
        at += b.size


def state_digest(arrays: Iterable[tuple[str, np.ndarray]]) -> bytes:
    h = hashlib.sha256()
    for name, a in arrays:
        h.update(name.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.digest()


def broadcast_parameters(comm: "Communicator", arrays: Mapping[str, np.ndarray]) -> None:
    """Rank 0's values into every rank's arrays (in place, in name order), then checks that every
    rank holds the same bits (a SHA-256 of all of them, all-reduced as bytes)."""
    if comm.size == 1:
        return
    for name in sorted(arrays):
        a = arrays[name]
        buf = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        comm.broadcast(buf, 0)
        if buf is not a:
            a[...] = buf
    mine = np.frombuffer(state_digest((k, arrays[k]) for k in sorted(arrays)), dtype=np.uint8).astype(np.float64)
    rank0 = mine.copy()
    comm.broadcast(rank0, 0)
    same = np.array([float(np.array_equal(mine, rank0))])
    comm.all_reduce(same, "sum")
    if same[0] != comm.size:
        raise RuntimeError(f"parameters differ between ranks after the broadcast from rank 0 "
                           f"({int(comm.size - same[0])} of {comm.size} ranks disagree)")
