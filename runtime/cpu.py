"""The CPU target: its registry record and its executor (a compiled C++ step called with ctypes).

The executor owns the arena (64-byte aligned), which holds the step's input buffers, every
intermediate and every kernel's scratch, as the memory plan laid them out. A call checks its
arguments against the compiled signature, copies each into its fixed input buffer (any strides,
any memory order, read-only or not: the compiled code only ever reads the arena), runs
`ember_step` once, writes back updates that were not computed in place, and returns the outputs
as copies. Parameters and optimizer state are the host `Storage` arrays, updated in place.
"""
from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ember.codegen import cpp, cpp_choices, cpu_vector
from ember.codegen.compiler import UnitBuilds
from ember.ir import Graph, TensorType

# Threading between steps: GOMP's workers busy-wait ~300k spins (a fraction of a millisecond to
# milliseconds) after every parallel region by default, so between steps (while Python, the data
# loader or another library runs) they would burn the cores. A short spin (GOMP_SPINCOUNT=10000,
# a few microseconds) still covers the gaps between the kernels of one step; then they sleep.
# Read by libgomp once, when it loads: set here (unless the user set either variable) so it
# takes effect when the first step's library is loaded, and has no effect if an OpenMP runtime
# (e.g. PyTorch's) is already in the process. Partitions stay fixed whatever the wait policy.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
from ember.passes import pipeline, targets

from . import comm as _comm
from .cpu_segments import SegmentRunner, overlap_default, plan_groups
from .executor import HostStorage, Storage, check_inputs, planned_view


def _aligned(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _allocate_arena(graph: Graph, nbytes: int) -> np.ndarray:
    """The step's arena, or a one-line MemoryError that says what asked for so much (the step and
    its batch) instead of NumPy's allocation traceback: the batch is what the user can change."""
    try:
        return _aligned(max(nbytes, 64))
    except MemoryError as e:
        kind = "training" if graph.updates else "inference"
        batches = sorted({t.shape[0] for t in (graph.type(n) for n in graph.inputs.values()) if t.shape})
        batch = f" for batch {batches[0]}" if len(batches) == 1 else ""
        reason = " ".join(str(e).split()) or "out of memory"
        raise MemoryError(f"the {kind} step{batch} plans {_gib(nbytes)} of memory (its arena), which could not be "
                          f"allocated ({reason}); expected a smaller batch or more memory") from None


class CpuExecutor:
    """One compiled CPU step of a fused, memory-planned graph, bound to `storage`."""

    def __init__(self, graph: Graph, storage: Storage, dump_dir: str | os.PathLike | None = None, name: str = "step",
                 profile: bool | None = None, communicator: "_comm.Communicator | None" = None,
                 overlap: bool | None = None, source: cpp.StepSource | None = None) -> None:
        storage.check(graph)
        self.graph = graph
        self.storage = storage
        self.signature: dict[str, TensorType] = {k: graph.type(n) for k, n in graph.inputs.items()}
        t0 = time.perf_counter()
        self.profile = bool(os.environ.get("EMBER_PROFILE")) if profile is None else profile
        # the step's units compile in parallel, each through the cache (codegen/cpp_units.py); a
        # contraction's unit starts compiling as soon as it is generated
        builds = UnitBuilds(name=name, dump_dir=Path(dump_dir) if dump_dir else None)
        try:
            isa = source.isa if source is not None else cpu_vector.resolve()
            self._check_isa(isa)
            # given: from the plan cache (frontends/plan_cache.py), rendered with the same profile setting
            t_render = time.perf_counter()
            self.source = source if source is not None else cpp.render_step(graph, profile=self.profile, isa=isa,
                                                                            on_unit=builds.start)
            render_s = time.perf_counter() - t_render
            self.artifact = builds.finish(self.source.units, link_flags=self.source.link_flags,
                                          headers=self.source.headers)
        finally:
            builds.close()
        self.isa = self.source.isa
        self.compile_seconds = time.perf_counter() - t0
        # where the time went (the frontend adds its passes' seconds and writes compile_stats.json in a dump)
        self.compile_stats: dict[str, float | int | bool] = {
            "render_s": round(render_s, 4), "compiler_s": round(self.compile_seconds - render_s, 4),
            "kernel_calls": len(self.source.kernels), "kernel_functions": len(self.source.functions),
            **self.artifact.stats()}
        self.lib = ctypes.CDLL(str(self.artifact.path))
        if self.lib.ember_abi_version() != cpp.ABI_VERSION:
            raise RuntimeError(f"{self.artifact.path}: ABI version {self.lib.ember_abi_version()}, "
                               f"expected {cpp.ABI_VERSION} (a stale cache entry? remove it)")
        # A step with collectives is compiled as segments (codegen/cpp.py): the executor calls
        # segment 0, starts the all-reduces scheduled after it through the communicator (one flat
        # buffer per bucket), segment 1, ..., waiting for a bucket before the first segment that
        # reads it (runtime/cpu_segments.py). Simpler than calling back from C++ into Python,
        # and the communicator stays a Python object.
        self.comm = None
        if self.source.collectives:
            self.comm = communicator if communicator is not None else _comm.from_env()
            self.lib.ember_segment.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
            self.lib.ember_segment.restype = None
        else:
            self.lib.ember_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            self.lib.ember_step.restype = None
        self.arena = _allocate_arena(graph, self.source.arena_bytes)
        self.peak_bytes = self.source.arena_bytes
        self._constants: dict[str, np.ndarray] = {}
        self._ext = (ctypes.c_void_p * max(1, len(self.source.slots)))()
        for i, (kind, key) in enumerate(self.source.slots):
            if kind == "constant":
                arr = np.ascontiguousarray(graph.attrs(int(key))["value"]).copy()
                self._constants[key] = arr
                self._ext[i] = arr.ctypes.data
            else:
                self._ext[i] = storage[key].ctypes.data
        self._inputs = {k: self._view(n) for k, n in graph.inputs.items()}
        self._outputs = {k: self._view(n) for k, n in graph.outputs.items()}
        self._copy_updates = [(k, self._view(n)) for k, n in graph.updates.items()
                              if graph.notes(n).get("storage") not in ("parameter", "state")
                              or graph.notes(n).get("name") != k]
        # this step's arena offsets and kernel sizes: the library's entry reads them here, so a
        # step of another batch size of the same graph runs the same library (codegen/cpp.py)
        self._dims = np.array(self.source.dims or [0], dtype=np.int64)
        self._args = (ctypes.cast(self._ext, ctypes.c_void_p), self.arena.ctypes.data, self._dims.ctypes.data)
        self._runner = None
        if self.source.collectives:
            segments = [[self.source.kernels[i] for i in seg] for seg in self.source.segments]
            groups = plan_groups(graph, segments, self.source.collectives, self._view)
            self._runner = SegmentRunner(groups, len(segments), self.comm,
                                         overlap_default() if overlap is None else overlap)
            self._segment = lambda s: self.lib.ember_segment(*self._args, s)

    @staticmethod
    def _check_isa(isa: cpu_vector.VectorISA) -> None:
        if not cpu_vector.host_supports(isa):
            # a forced variant this CPU cannot run would die of SIGILL inside the first step
            raise RuntimeError(f"the CPU step was generated for {isa.name} (${cpu_vector.ENV_VAR}="
                               f"{os.environ.get(cpu_vector.ENV_VAR, '')!r}), which this CPU does not have "
                               f"(no {isa.cpu_flag!r} in /proc/cpuinfo); unset {cpu_vector.ENV_VAR} or set it to "
                               f"{cpu_vector.native_isa().name}")

    def kernel_times(self) -> list[tuple[str, str, float]]:
        """(kernel, what it implements, seconds summed over calls); needs profile=True (or EMBER_PROFILE=1)."""
        if not self.profile:
            raise RuntimeError("per-kernel timings need the step compiled with profile=True (or EMBER_PROFILE=1)")
        out = (ctypes.c_double * len(self.source.kernels))()
        self.lib.ember_profile(out)
        return [(k.name, (k.implements[0] if k.implements else "") + (f" (+{len(k.implements) - 1})" if len(k.implements) > 1 else ""),
                 out[k.index]) for k in self.source.kernels]

    def _view(self, n: int) -> np.ndarray:
        """The array where node n's value lives after a call (arena view or external array)."""
        return planned_view(self.graph, n, self.arena, lambda m: self._constants[str(m)], self.storage.__getitem__)

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if len(inputs) != len(self._inputs):
            check_inputs(self.signature, inputs)  # raises the clear error
        for name, buffer in self._inputs.items():
            value = inputs.get(name)
            if type(value) is not np.ndarray or value.shape != buffer.shape or value.dtype != buffer.dtype:
                value = check_inputs(self.signature, inputs)[name]  # the slow path raises the clear error
            np.copyto(buffer, value)  # any layout in, the planned buffer out
        if self.comm is None:
            self.lib.ember_step(*self._args)
        else:
            self._run_segments()
        for name, view in self._copy_updates:
            np.copyto(self.storage[name], view)
        return {k: v.copy() for k, v in self._outputs.items()}

    def _run_segments(self) -> None:
        self._runner.run(self._segment)

    @property
    def comm_seconds(self) -> float:
        """Seconds in the communicator's path (copies, all-reduces, waits) over all calls."""
        return self._runner.comm_seconds if self._runner is not None else 0.0

    @property
    def reduce_seconds(self) -> float:
        """Seconds inside the all-reduce calls alone (MPI_Allreduce, or Iallreduce/Test/Wait)."""
        return self._runner.reduce_seconds if self._runner is not None else 0.0


def _tune(graph: Graph, **options: Any) -> Any:
    """`Target.tune`: the candidates of every kernel measured on this CPU, at the step's thread
    count (`runtime/tuner.py`, `runtime/tuner_cpu.py`)."""
    from .tuner import tune_graph
    from .tuner_cpu import CpuMeasurer
    return tune_graph(graph, table=cpp_choices.TABLE, measurer=CpuMeasurer, **options)


TARGET = targets.register(targets.Target(
    name="cpu",
    description="generated C++ compiled with g++ and OpenMP, the whole step in one call",
    pipeline=pipeline.kernels,
    # What the C++ templates accept (codegen/cpp.py render_contraction checks the same table):
    # bias/relu on the forward contractions, relu_mask (ReLU's backward) on matmul and grad-input.
    fusion=targets.FusionCaps(epilogues={"conv2d": frozenset({"bias", "relu"}),
                                         "matmul": frozenset({"bias", "relu", "relu_mask"}),
                                         "conv2d_grad_input": frozenset({"relu_mask"})},
                              multi_output=True),
    alignment=64,
    # each gradient bucket's all-reduce right after its last gradient, started non-blocking and
    # waited before the first update that reads it (runtime/cpu_segments.py)
    early_collectives=True,
    choose_kernel=cpp_choices.stamp,  # the choice table: family, plan and scratch of each kernel
    reusable=cpp_choices.reusable,  # kernels take the batch at run time: a new batch size reuses plans
    tune=_tune,
    device_model=cpp_choices.device_name,
    language="cpp",
    source=lambda graph: cpp.render_step(graph).code,
    executor=CpuExecutor,
    storage=HostStorage,
    precisions=frozenset({"float32", "bf16"}),  # bfloat16: codegen/cpp_bf16.py and the generated kernels
))
