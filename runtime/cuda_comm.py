"""NCCL communicators for CUDA steps (through `cupy.cuda.nccl`), so gradients are all-reduced on
the step's stream, inside its captured CUDA graph.

The ranks agree on NCCL's unique id through a process that stays alive until every rank has
joined: rank 0 makes it and sends it to the others, over MPI in an MPI world (`ember launch`
with mpiexec) or else over TCP at MASTER_ADDR:MASTER_PORT (`ember launch --no-mpi`, torchrun's
contract), and keeps running. A world of one needs neither MPI nor a second GPU.
Each process drives the GPU of its local rank (`LOCAL_RANK`, 0 by default). `mean` uses NCCL's average.
"""
from __future__ import annotations

import os
from typing import Any

from . import comm as _comm

_DTYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}


class NcclCommunicator:
    """One rank of an NCCL world; `all_reduce_device` is what a CUDA step's collective kernel calls."""

    device_collectives = True  # the CUDA executor may use it (a CPU communicator is not)

    def __init__(self, rank: int, size: int, unique_id: bytes | None = None, local_rank: int = 0) -> None:
        import cupy
        from cupy.cuda import nccl
        self._nccl = nccl
        self.rank, self.size = rank, size
        cupy.cuda.Device(local_rank).use()
        uid = unique_id if unique_id is not None else nccl.get_unique_id()
        self._comm = nccl.NcclCommunicator(size, uid, rank)

    def all_reduce_device(self, src: Any, dst: Any, op: str, stream: Any) -> None:
        """dst = op over ranks of src (CuPy arrays of one float dtype), on `stream`."""
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce: op must be 'sum' or 'mean', got {op!r}")
        dtype = getattr(self._nccl, _DTYPES[src.dtype.name])
        nccl_op = self._nccl.NCCL_SUM if op == "sum" else self._nccl.NCCL_AVG
        self._comm.allReduce(src.data.ptr, dst.data.ptr, src.size, dtype, nccl_op, stream.ptr)

    def all_reduce(self, buffer: Any, op: str = "sum") -> None:
        """A host NumPy buffer in place, through the device: the small control messages of a run
        (the start-of-run consistency checks, the stop flag), not the step's gradients."""
        import cupy
        stream = cupy.cuda.get_current_stream()
        dev = cupy.asarray(buffer)
        self.all_reduce_device(dev, dev, op, stream)
        stream.synchronize()
        buffer[...] = dev.get()

    def barrier(self) -> None:
        import numpy as np
        self.all_reduce(np.zeros(1), "sum")

    def broadcast_device(self, buffer: Any, root: int, stream: Any) -> None:
        dtype = getattr(self._nccl, _DTYPES[buffer.dtype.name])
        self._comm.bcast(buffer.data.ptr, buffer.size, dtype, root, stream.ptr)

    def broadcast_storage(self, storage: Any) -> None:
        """Rank 0's parameters and optimizer state into every rank's device storage, then a check
        that every rank holds the same bits (a SHA-256 of all of them, compared on the device)."""
        import cupy
        import numpy as np
        if self.size == 1:
            return
        stream = cupy.cuda.get_current_stream()
        names = sorted(storage)
        for name in names:
            self.broadcast_device(storage.device_array(name), 0, stream)
        digest = _comm.state_digest((k, storage.read(k)) for k in names)
        mine = cupy.asarray(np.frombuffer(digest, dtype=np.uint8).astype(np.float64))
        rank0 = mine.copy()
        self.broadcast_device(rank0, 0, stream)
        same = cupy.asarray([float(bool((mine == rank0).all()))])
        self.all_reduce_device(same, same, "sum", stream)
        if float(same[0]) != self.size:
            raise RuntimeError(f"parameters differ between ranks after the broadcast from rank 0 "
                               f"({int(self.size - float(same[0]))} of {self.size} ranks disagree)")

    def close(self) -> None:
        """Destroys the NCCL communicator (a process that does not can hang at exit)."""
        if getattr(self, "_comm", None) is not None:
            self._comm.destroy()
            self._comm = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _exchange_id(rank: int, size: int, make: Any, timeout: float = 120.0) -> bytes:
    """NCCL's unique id from rank 0 to every rank: over MPI when this is an MPI world, else over
    TCP at MASTER_ADDR:MASTER_PORT (the torchrun contract), rank 0 serving it until every other
    rank has it. Rank 0 is a process of the run, so it stays alive while the others join."""
    if "PMI_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:  # started by mpiexec
        try:
            mpi = _comm.MpiCommunicator()
            if (mpi.rank, mpi.size) == (rank, size):
                return mpi.comm.bcast(make() if rank == 0 else None, root=0)
        except RuntimeError:
            pass  # no mpi4py: the TCP rendezvous below
    import socket
    import time
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    if rank == 0:
        uid = make()
        with socket.create_server((addr, port), reuse_port=False) as server:
            server.settimeout(timeout)
            for _ in range(size - 1):
                conn, _ = server.accept()
                with conn:
                    conn.sendall(len(uid).to_bytes(4, "big") + bytes(uid))
        return uid
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5) as conn:
                data = b""
                while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                return data[4:4 + int.from_bytes(data[:4], "big")]
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: no NCCL id from rank 0 at {addr}:{port} within {timeout:.0f} s") from None
            time.sleep(0.2)


def from_env() -> NcclCommunicator:
    """The NCCL world this process belongs to: rank, size and GPU from RANK/WORLD_SIZE/LOCAL_RANK
    (or mpiexec's variables), the unique id from rank 0; a world of one needs no exchange."""
    rank, size, local = _comm.world_from_env()
    if size == 1:
        return NcclCommunicator(0, 1, local_rank=local)
    from cupy.cuda import nccl
    uid = _exchange_id(rank, size, nccl.get_unique_id)
    return NcclCommunicator(rank, size, uid, local_rank=local)
