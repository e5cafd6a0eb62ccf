"""The device descriptor: the hardware facts the CUDA kernel plans and choices depend on.

Tile sizes, split counts, blocks a launch aims for and shared-memory budgets all follow from a
few numbers of the GPU (multiprocessors, shared memory, registers, threads). They live here once,
as data, instead of being copied into each kernel module. `H200` is the device the shipped plans
were measured on and the one sources are written for without a GPU (`ember kernels`); the runtime
can describe the device at hand (`ember.runtime.cuda.device_from_cupy`).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "H200"]


@dataclass(frozen=True)
class Device:
    name: str
    multiprocessors: int
    #: shared memory a block may use: statically (and dynamically without opting in), and with
    #: cudaFuncAttributeMaxDynamicSharedMemorySize
    shared_per_block: int
    shared_per_block_optin: int
    shared_per_multiprocessor: int
    registers_per_multiprocessor: int
    max_threads_per_multiprocessor: int
    warp_size: int = 32


#: NVIDIA H200 SXM (compute capability 9.0)
H200 = Device(name="NVIDIA H200", multiprocessors=132, shared_per_block=48 * 1024,
              shared_per_block_optin=227 * 1024, shared_per_multiprocessor=228 * 1024,
              registers_per_multiprocessor=65536, max_threads_per_multiprocessor=2048, warp_size=32)
