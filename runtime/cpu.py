"""CPU executor: loads the compiled step library with ctypes and calls it once per batch.

It owns the arena and the scratch block (64-byte aligned), binds parameters and optimizer state
to the shared `Storage` arrays (the generated code updates them in place), checks each call's
inputs against the compiled signature, and returns outputs as copies out of the arena.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ember.codegen.compiler import compile_cpp
from ember.codegen.cpp import render_step
from ember.ir import Graph, TensorType

from .executor import Storage, check_inputs


def _aligned(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


class CpuExecutor:
    """One compiled CPU step of a fused, memory-planned graph, bound to `storage`."""

    def __init__(self, graph: Graph, storage: Storage, dump_dir: str | os.PathLike | None = None, name: str = "step",
                 profile: bool | None = None) -> None:
        storage.check(graph)
        self.graph = graph
        self.storage = storage
        self.signature: dict[str, TensorType] = {k: graph.type(n) for k, n in graph.inputs.items()}
        t0 = time.perf_counter()
        self.profile = bool(os.environ.get("EMBER_PROFILE")) if profile is None else profile
        self.source = render_step(graph, profile=self.profile)
        self.artifact = compile_cpp(self.source.code, name=name, dump_dir=Path(dump_dir) if dump_dir else None)
        self.compile_seconds = time.perf_counter() - t0
        self.lib = ctypes.CDLL(str(self.artifact.path))
        if self.lib.ember_abi_version() != 1:
            raise RuntimeError(f"{self.artifact.path}: unexpected ABI version")
        self.lib.ember_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ember_step.restype = None
        self.arena = _aligned(max(self.source.arena_bytes, 64))
        self.scratch = _aligned(max(self.source.scratch_bytes, 64))
        self.peak_bytes = self.source.arena_bytes + self.source.scratch_bytes
        self._constants: dict[str, np.ndarray] = {}
        self._ext = (ctypes.c_void_p * max(1, len(self.source.slots)))()
        self._input_slots: list[tuple[int, str, tuple[int, ...], np.dtype]] = []
        for i, (kind, key) in enumerate(self.source.slots):
            if kind == "input":
                t = self.signature[key]
                self._input_slots.append((i, key, t.shape, t.dtype.numpy))
            elif kind == "constant":
                arr = np.ascontiguousarray(graph.attrs(int(key))["value"]).copy()
                self._constants[key] = arr
                self._ext[i] = arr.ctypes.data
            else:
                self._ext[i] = storage[key].ctypes.data
        self._outputs = {k: self._view(n) for k, n in graph.outputs.items()}
        self._copy_updates = [(k, self._view(n)) for k, n in graph.updates.items()
                              if graph.notes(n).get("storage") not in ("parameter", "state")
                              or graph.notes(n).get("name") != k]
        self._args = (ctypes.cast(self._ext, ctypes.c_void_p), self.arena.ctypes.data, self.scratch.ctypes.data)

    def kernel_times(self) -> list[tuple[str, str, float]]:
        """(kernel, what it implements, seconds summed over calls); needs profile=True (or EMBER_PROFILE=1)."""
        if not self.profile:
            raise RuntimeError("per-kernel timings need the step compiled with profile=True (or EMBER_PROFILE=1)")
        out = (ctypes.c_double * len(self.source.kernels))()
        self.lib.ember_profile(out)
        return [(f"k{k.index}_{k.kind}", (k.implements[0] if k.implements else "") + (f" (+{len(k.implements) - 1})" if len(k.implements) > 1 else ""),
                 out[k.index]) for k in self.source.kernels]

    def _view(self, n: int) -> np.ndarray:
        """The array where node n's value lives after a call (arena view or external array)."""
        g, notes = self.graph, self.graph.notes(n)
        t = g.type(n)
        storage = notes["storage"]
        if storage == "alias":
            return self._view(notes["alias_of"]).reshape(t.shape)
        if storage == "arena":
            off = notes["offset"]
            return self.arena[off:off + t.nbytes].view(t.dtype.numpy).reshape(t.shape)
        if storage == "constant":
            return self._constants[str(n)]
        if storage == "input":
            return _InputRef(notes["name"], t.shape)  # type: ignore[return-value]
        return self.storage[notes["name"]]

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = self._arrays(inputs)
        # `arrays` holds every buffer whose address goes to the compiled code: a contiguous copy
        # made for one input must outlive the call, or C++ reads freed memory.
        for slot, name, _, _ in self._input_slots:
            self._ext[slot] = arrays[name].ctypes.data
        self.lib.ember_step(*self._args)
        for name, view in self._copy_updates:
            np.copyto(self.storage[name], view.get(arrays) if isinstance(view, _InputRef) else view)
        return {k: (v.get(arrays) if isinstance(v, _InputRef) else v).copy() for k, v in self._outputs.items()}

    def _arrays(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The call's inputs as C-contiguous arrays of the compiled types, all held at once."""
        if len(inputs) == len(self._input_slots):
            for _, name, shape, dtype in self._input_slots:
                a = inputs.get(name)
                if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
                    break
            else:
                return inputs  # per-batch fast path: nothing to convert
        return check_inputs(self.signature, inputs)  # converts, or raises the clear error


class _InputRef:
    """An output that is one of the call's inputs, resolved per call."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape = name, shape

    def reshape(self, shape: tuple[int, ...]) -> "_InputRef":
        return _InputRef(self.name, shape)

    def get(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        return arrays[self.name].reshape(self.shape)
