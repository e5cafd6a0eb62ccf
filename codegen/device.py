"""The device descriptor: the hardware facts the CUDA kernel plans and choices depend on.

Tile sizes, split counts, blocks a launch aims for and shared-memory budgets all follow from a
few numbers of the GPU (multiprocessors, shared memory, registers, threads, clock, bandwidth).
They live here once, as data; the planners read them from the *active* descriptor, `current()`,
at the moment they plan, so one process can plan for any GPU:

    with device.using(device.named("a100")):
        graphs = plan(model, loss, opt, example, device="cuda")   # and render within the block

Outside any `using` block the active descriptor is `H200`, the device the shipped plans were
measured on and the one sources are written for without a GPU (`ember kernels`). The cuda target
plans for the GPU at hand (`ember.runtime.cuda.compile_device`, which reads it with
`device_from_cupy`) unless a block chose one. `current().name` is the device model a tuning
database is keyed by.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Device", "H200", "H100_SXM", "A100_SXM_80GB", "L4", "KNOWN", "named", "find", "current", "active",
           "using", "static_shared_budget", "resident_threads"]


@dataclass(frozen=True)
class Device:
    name: str  # as the driver reports it (cudaDeviceProp::name)
    multiprocessors: int
    #: shared memory a block may use: statically (and dynamically without opting in), and with
    #: cudaFuncAttributeMaxDynamicSharedMemorySize
    shared_per_block: int
    shared_per_block_optin: int
    shared_per_multiprocessor: int
    registers_per_multiprocessor: int
    max_threads_per_multiprocessor: int
    max_blocks_per_multiprocessor: int
    #: the GEMM cost model's time scales: the SM clock under load and the memory bandwidth a
    #: streaming kernel reaches (not the datasheet peaks)
    clock_hz: float
    memory_bytes_per_s: float
    warp_size: int = 32
    #: major * 10 + minor (90 for sm_90); 0 where unknown
    compute_capability: int = 0

    @property
    def wgmma(self) -> bool:
        """Whether the GPU runs warpgroup MMA (sm_90a: Hopper; the kernels are built for sm_90a there)."""
        return self.compute_capability == 90


# An H200's SM clock under load and its achievable HBM bandwidth as fractions of the datasheet
# peaks (1.755 of 1.98 GHz; about 4.0 of 4.8 TB/s): the estimate for a GPU nobody measured.
CLOCK_UNDER_LOAD = 1.755 / 1.98
REACHABLE_BANDWIDTH = 4.0 / 4.8
KIB = 1024

#: NVIDIA H200 SXM (compute capability 9.0): the shipped plans were measured on it
H200 = Device(name="NVIDIA H200", multiprocessors=132, shared_per_block=48 * KIB, shared_per_block_optin=227 * KIB,
              shared_per_multiprocessor=228 * KIB, registers_per_multiprocessor=65536,
              max_threads_per_multiprocessor=2048, max_blocks_per_multiprocessor=32, clock_hz=1.755e9,
              memory_bytes_per_s=4.0e12, compute_capability=90)
#: NVIDIA H100 SXM 80 GB (9.0): an H200's multiprocessors with HBM3 (3.35 TB/s peak)
H100_SXM = Device(name="NVIDIA H100 80GB HBM3", multiprocessors=132, shared_per_block=48 * KIB,
                  shared_per_block_optin=227 * KIB, shared_per_multiprocessor=228 * KIB,
                  registers_per_multiprocessor=65536, max_threads_per_multiprocessor=2048,
                  max_blocks_per_multiprocessor=32, clock_hz=1.98e9 * CLOCK_UNDER_LOAD,
                  memory_bytes_per_s=3.35e12 * REACHABLE_BANDWIDTH, compute_capability=90)
#: NVIDIA A100 SXM4 80 GB (8.0): 1.41 GHz boost, 2.04 TB/s peak
A100_SXM_80GB = Device(name="NVIDIA A100-SXM4-80GB", multiprocessors=108, shared_per_block=48 * KIB,
                       shared_per_block_optin=163 * KIB, shared_per_multiprocessor=164 * KIB,
                       registers_per_multiprocessor=65536, max_threads_per_multiprocessor=2048,
                       max_blocks_per_multiprocessor=32, clock_hz=1.41e9 * CLOCK_UNDER_LOAD,
                       memory_bytes_per_s=2.039e12 * REACHABLE_BANDWIDTH, compute_capability=80)
#: NVIDIA L4 (8.9): 2.04 GHz boost, 300 GB/s GDDR6 peak; 1536 threads and 24 blocks a multiprocessor
L4 = Device(name="NVIDIA L4", multiprocessors=58, shared_per_block=48 * KIB, shared_per_block_optin=99 * KIB,
            shared_per_multiprocessor=100 * KIB, registers_per_multiprocessor=65536,
            max_threads_per_multiprocessor=1536, max_blocks_per_multiprocessor=24, clock_hz=2.04e9 * CLOCK_UNDER_LOAD,
            memory_bytes_per_s=300e9 * REACHABLE_BANDWIDTH, compute_capability=89)

#: the descriptors `named` knows, by short name (`ember kernels --gpu NAME`)
KNOWN: dict[str, Device] = {"h200": H200, "h100": H100_SXM, "a100": A100_SXM_80GB, "l4": L4}


def find(name: str) -> Device | None:
    """The known descriptor called `name` (a short name or the driver's, any case), or None."""
    key = name.strip().lower()
    return KNOWN.get(key) or next((d for d in KNOWN.values() if d.name.lower() == key), None)


def named(name: str) -> Device:
    """The known descriptor called `name`; a one-line ValueError listing the known names otherwise."""
    found = find(name)
    if found is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(KNOWN)}")
    return found


_ACTIVE: contextvars.ContextVar[Device | None] = contextvars.ContextVar("ember_device", default=None)


def active() -> Device | None:
    """The descriptor a `using` block chose, or None outside one."""
    return _ACTIVE.get()


def current() -> Device:
    """The descriptor kernels are planned for now: the one `using` chose, else the H200."""
    return _ACTIVE.get() or H200


@contextlib.contextmanager
def using(device: Device) -> Iterator[Device]:
    """Within the block, kernels are planned and rendered for `device`."""
    if not isinstance(device, Device):
        raise TypeError(f"using() takes a Device, got {type(device).__name__}")
    token = _ACTIVE.set(device)
    try:
        yield device
    finally:
        _ACTIVE.reset(token)


# --------------------------------------------------------------------------- derived budgets

#: static shared memory left to the compiler's own use (its spills and temporaries) when a kernel
#: sizes its staging arrays
COMPILER_SHARED_RESERVE = 4 * KIB


def static_shared_budget(device: Device, reserve: int = COMPILER_SHARED_RESERVE) -> int:
    """Bytes of static shared memory a block's staged arrays may take: the per-block limit without
    opting in (static arrays cannot opt in), less `reserve` for what else the block declares."""
    return device.shared_per_block - reserve


def resident_threads(device: Device, registers_per_thread: int) -> int:
    """Threads a multiprocessor holds at once when each takes `registers_per_thread` registers:
    whole warps, at most its thread limit."""
    warps = device.registers_per_multiprocessor // registers_per_thread // device.warp_size
    return min(device.max_threads_per_multiprocessor, warps * device.warp_size)
