"""Programmatic dependent launch (Hopper): a kernel launched as the dependent of the grid before it
on its stream may start while that grid finishes, and waits for it inside (`griddepcontrol.wait`,
the statement `codegen.cuda_kernels.GRID_DEPENDENCY` puts first in every generated kernel). In a
captured CUDA graph the edge between the two becomes a programmatic one, so a step of many small
kernels does not pay a full launch gap at every kernel boundary.

CuPy launches only with `cuLaunchKernel`; the launch attribute needs `cuLaunchKernelEx`, called
here through ctypes on the driver library.

Opt-in (`EMBER_CUDA_PDL=1`), because it measured both ways on an H200 (docs/cuda.md): 4-9% off
the step of the models with many small kernels at batch 64 (ViT, ResNet-8, MobileNet, speednet),
8-10% more on the MNIST CNN and LeNet-5 at 64 and 17% more on ViT at 1024, with the trigger at
the kernel's start or at its exit alike and on one stream as on four.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("allowed", ctypes.c_int)]


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
           np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
_driver: Any = None


def enabled(arch: str) -> bool:
    """Whether steps launch their kernels as programmatic dependents: where EMBER_CUDA_PDL=1 asks
    for it, on sm_90 and later (the kernels are the same either way)."""
    if os.environ.get("EMBER_CUDA_PDL", "0") != "1":
        return False
    major = int("".join(ch for ch in arch.split("_")[-1] if ch.isdigit())[:-1] or 0)
    return major >= 9 and _load_driver() is not None


def _load_driver() -> Any:
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchKernelEx.restype = ctypes.c_int
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
            _driver = lib
        except (OSError, AttributeError):  # no driver library, or one older than CUDA 12
            _driver = False
    return _driver or None


class DependentLaunch:
    """One kernel launch, ready to be issued as the programmatic dependent of the stream's previous
    grid: the argument block is built once (the step's buffers do not move)."""

    def __init__(self, function: Any, grid: tuple, block: tuple, shared_bytes: int, args: tuple) -> None:
        self._function = ctypes.c_void_p(function.ptr)
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        self._attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attribute.value.allowed = 1
        self._config = _LaunchConfig(*grid, *block, shared_bytes, None, ctypes.pointer(self._attribute), 1)
        self._holders = [_holder(a) for a in args]
        self._params = (ctypes.c_void_p * max(len(args), 1))(
            *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in self._holders])

    def __call__(self, stream_ptr: int) -> None:
        self._config.stream = stream_ptr
        status = _driver.cuLaunchKernelEx(ctypes.byref(self._config), self._function, self._params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status} (a programmatic dependent "
                               f"launch, asked for by EMBER_CUDA_PDL=1)")


def _holder(value: Any) -> Any:
    if hasattr(value, "data") and hasattr(value.data, "ptr"):  # a CuPy array: its device pointer
        return ctypes.c_void_p(value.data.ptr)
    if isinstance(value, np.generic):
        return _CTYPES[value.dtype](value.item())
    raise TypeError(f"a kernel argument must be a device array or a NumPy scalar, got {type(value).__name__}")
