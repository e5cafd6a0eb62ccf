"""The CUDA target: its registry record, device storage, and the executor (NVRTC modules cached by
ember and loaded through CuPy, the whole step captured once into a CUDA graph and replayed per batch).

CuPy is imported only when a CUDA step is built, a device storage is made or kernels are planned
(for the GPU at hand: `compile_device`), so this module (and the `cuda` record: its passes, kernel
selection and code generation) works without a GPU, planning for the H200, which is how
`ember kernels --device cuda` writes sources for CI to compile with nvcc.

The executor owns one device arena laid out by the memory plan: the step's input buffers, every
intermediate and every kernel's scratch. A call copies each argument into its fixed input buffer
(from host memory, or device to device for a CuPy array), replays the graph on the step's stream,
and returns the outputs as device arrays (copies), so nothing is read back to the host unless the
caller asks. Parameters and optimizer state live in `DeviceStorage`; updates that were not written
in place are copied into it inside the graph.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ember.codegen import cuda as cuda_codegen
from ember.codegen import cpus, cuda_choices, cuda_conv_nhwc
from ember.codegen.cuda_kernels import counter_words, scalar_args, scratch_offset
from ember.codegen.device import CLOCK_UNDER_LOAD, REACHABLE_BANDWIDTH, Device, active, current, find, using
from ember.ir import Graph, KernelSpec, TensorType
from ember.passes import pipeline, targets

from . import cuda_modules, cuda_pdl, nvrtc_workers
from .cuda_streams import place
from .executor import Storage, check_inputs, planned_view

STREAMS = 4  # streams a step's independent kernels spread over inside its CUDA graph
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _cupy() -> Any:
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            raise RuntimeError("device 'cuda' needs CuPy: pip install 'ember[cuda13]' (or 'ember[cuda12]' for "
                               "CUDA 12)") from None
        raise _broken_cupy(exc) from None
    except Exception as exc:  # CuPy is there but its import fails: a missing CUDA library, a mismatch
        raise _broken_cupy(exc) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises its own CUDARuntimeError when no driver is present
        raise RuntimeError(f"device 'cuda' found no usable NVIDIA GPU ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())})") from None
    if count < 1:
        raise RuntimeError("device 'cuda' found no NVIDIA GPU")
    return cupy


def _broken_cupy(exc: Exception) -> RuntimeError:
    """Says "installed but broken", with CuPy's own reason: calling it missing would send the user
    to reinstall what is there, when what is wrong is usually its CUDA libraries."""
    reason = " ".join(str(exc).split())  # CuPy's messages can span lines; the CLI prints one
    return RuntimeError(f"device 'cuda': CuPy is installed but cannot be imported ({type(exc).__name__}: {reason}); "
                        f"expected a CuPy build that matches this machine's CUDA (cupy-cuda13x or cupy-cuda12x)")


def _c_order(array: Any) -> np.ndarray:
    """`array` as a C-contiguous NumPy array of the same shape: np.ascontiguousarray would turn a
    0-d array (a step counter, a scalar state) into shape (1,)."""
    return np.asarray(array, order="C")


def to_device(array: np.ndarray) -> Any:
    """A host array copied to the current GPU (a CuPy array)."""
    return _cupy().asarray(_c_order(array))


def check_available() -> None:
    """Raises a one-line RuntimeError when this process cannot run CUDA steps."""
    _cupy()


_SELECTED: list[int] = []  # the GPU index "cuda:N" chose for this process, once chosen


def select_device(index: int) -> None:
    """Makes GPU `index` current for this process ("cuda:N"). Storage, modules, streams and CUDA
    graphs are made on the current device, so one process uses one GPU (one rank a GPU, as under
    `ember launch`); asking for another later is refused rather than mixing devices."""
    cp = _cupy()
    count = cp.cuda.runtime.getDeviceCount()
    if not 0 <= index < count:
        raise ValueError(f"device 'cuda:{index}': this machine has {count} GPU{'s' if count != 1 else ''} "
                         f"(cuda:0{f'..cuda:{count - 1}' if count > 1 else ''})")
    if _SELECTED and _SELECTED[0] != index:
        raise ValueError(f"device 'cuda:{index}': this process already runs on cuda:{_SELECTED[0]}; one process "
                         f"uses one GPU (start one process per GPU, e.g. with ember launch)")
    cp.cuda.Device(index).use()
    _SELECTED[:] = [index]


class DeviceStorage(Storage):
    """Parameters and optimizer state as CuPy arrays on the current GPU; host copies only on request."""

    def __init__(self, arrays: Mapping[str, np.ndarray] | None = None) -> None:
        self._cp = _cupy()
        self._arrays: dict[str, Any] = {}
        for name, a in (arrays or {}).items():
            self.add(name, a)

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._arrays:
            raise KeyError(f"storage already holds {name!r}")
        self._arrays[name] = self._cp.asarray(_c_order(array))

    def device_array(self, name: str) -> Any:
        return self._arrays[name]

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        return self._arrays[name].get(out=out)

    def write(self, name: str, value: np.ndarray) -> None:
        target = self._arrays[name]
        if np.shape(value) != target.shape:
            raise ValueError(f"storage {name!r}: cannot write shape {np.shape(value)} into {target.shape}")
        if isinstance(value, self._cp.ndarray):
            self._cp.copyto(target, value.astype(target.dtype, copy=False))
        else:
            target.set(np.asarray(value, dtype=target.dtype, order="C"))

    def type_of(self, name: str) -> TensorType:
        a = self._arrays[name]
        return TensorType.of(np.empty(a.shape, a.dtype))


_STEP_STREAMS: dict[int, Any] = {}


def device_from_cupy(cp: Any, index: int | None = None) -> Device:
    """The descriptor of CUDA device `index` (default: the current one), read from its attributes.
    A GPU with a known descriptor (`codegen.device.KNOWN`: same name, same structure) is described
    by it, with the clock under load and the reachable bandwidth measured or estimated for that
    model; another one (a new model, or a MIG slice of a known one, with fewer multiprocessors)
    gets its clock and bandwidth estimated from the peaks its attributes give."""
    dev = cp.cuda.Device(index) if index is not None else cp.cuda.Device()
    a = dev.attributes
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    peak_bandwidth = a["MemoryClockRate"] * 1e3 * 2 * a["GlobalMemoryBusWidth"] / 8  # kHz, double data rate, bits
    # CuPy's Device.compute_capability ("90"), else the attributes' major and minor
    cc_text = getattr(dev, "compute_capability", None)
    cc = int(cc_text) if isinstance(cc_text, str) and cc_text.isdigit() else \
        10 * a.get("ComputeCapabilityMajor", 0) + a.get("ComputeCapabilityMinor", 0)
    read = Device(name=name.decode() if isinstance(name, bytes) else str(name),
                  multiprocessors=a["MultiProcessorCount"], shared_per_block=a["MaxSharedMemoryPerBlock"],
                  shared_per_block_optin=a["MaxSharedMemoryPerBlockOptin"],
                  shared_per_multiprocessor=a["MaxSharedMemoryPerMultiprocessor"],
                  registers_per_multiprocessor=a["MaxRegistersPerMultiprocessor"],
                  max_threads_per_multiprocessor=a["MaxThreadsPerMultiProcessor"],
                  max_blocks_per_multiprocessor=a["MaxBlocksPerMultiprocessor"],
                  clock_hz=a["ClockRate"] * 1e3 * CLOCK_UNDER_LOAD,
                  memory_bytes_per_s=peak_bandwidth * REACHABLE_BANDWIDTH, warp_size=a["WarpSize"],
                  compute_capability=cc)
    known = find(read.name)
    if known is not None and dataclasses.replace(read, clock_hz=known.clock_hz,
                                                 memory_bytes_per_s=known.memory_bytes_per_s) == known:
        return known
    return read


_AT_HAND: dict[int, Device] = {}  # GPU index -> its descriptor, read once


def compile_device() -> Device:
    """The descriptor the cuda target plans and renders kernels for: the one a `device.using`
    block chose (`ember kernels --gpu NAME`), else the GPU this process runs on, else (no usable
    GPU: sources written for CI) the default, the H200."""
    chosen = active()
    if chosen is not None:
        return chosen
    try:
        cp = _cupy()
    except RuntimeError:
        return current()
    index = cp.cuda.Device().id
    if index not in _AT_HAND:
        _AT_HAND[index] = device_from_cupy(cp, index)
    return _AT_HAND[index]


def _choose_kernel(sub: Graph, spec: KernelSpec, reuse: Any = ()) -> tuple[str, tuple, int, str] | None:
    with using(compile_device()):
        return cuda_choices.stamp(sub, spec, reuse=reuse)


def _shared_relayout(owner: Graph, owner_spec: KernelSpec, reader: Graph, reader_spec: KernelSpec
                     ) -> tuple[str, tuple, int] | None:
    with using(compile_device()):
        return cuda_conv_nhwc.shared_choice(cuda_choices.geometry(owner, owner_spec), owner_spec.choice,
                                            cuda_choices.geometry(reader, reader_spec), reader_spec.choice)


def _reusable(graph: Graph) -> tuple:
    with using(compile_device()):
        return cuda_choices.reusable(graph)


def expected_modules(traced: Graph) -> int:
    """About how many NVRTC modules a training step of this traced graph compiles: a
    contraction's forward, grad-input and grad-weight kernels, and a generated kernel for every
    ten other ops (MNIST CNN 12 against 12-15 built, ResNet-8 68 against 57, ViT 78 against ~50)."""
    contractions = sum(traced.op(n) in ("conv2d", "matmul") for n in traced.nodes())
    return 3 * contractions + (len(traced) - contractions) // 10


def nvrtc_options(cp: Any) -> tuple[str, ...]:
    """The options every CUDA module of this GPU is built with (steps, the tuner, the labs)."""
    return ("-std=c++17", f"-arch={nvrtc_arch(cp)}")


def _prepare_build(traced: Graph, sources: tuple[Any, ...] = ()) -> None:
    """Starts the NVRTC workers while the passes run, unless the step's kernels come from
    `sources` (a cached plan's, or the steps' whose plans it takes) whose builds ahead all ran to
    their end: their variants for any batch size are in the cache then, and workers starting beside
    a later batch size's passes only slowed them (0.27-0.32 s without, 0.39-0.46 with; H100 host,
    docs/benchmarks.md). Unmarked, they start: a model never stepped (nothing built ahead) gets
    them up early for its later batch size (0.85-0.89 s against 1.25-1.39 s without)."""
    if sources and all(s is not None for s in sources):
        cp = _cupy()
        options = nvrtc_options(cp)
        if all(cuda_modules.built_ahead(cp, s.code, options) for s in sources):
            return
    nvrtc_workers.prestart(expected_modules(traced))
    cuda_modules.warm(_cupy)


def render_step(graph: Graph) -> cuda_codegen.CudaStepSource:
    """The step's source, rendered for the same descriptor its kernels were chosen for."""
    with using(compile_device()):
        return cuda_codegen.render_step(graph)


def _step_stream(cp: Any) -> Any:
    """The one stream every step on the current GPU runs on. Steps of one model (the training
    step, the one compiled for the last partial batch, the inference step) share its parameters,
    and one stream keeps them in call order without waiting on the host; and it is a blocking
    stream, so work on the legacy default stream (where CuPy's `get()` and a user's own CuPy
    calls run) waits for the steps: reading a loss later needs no explicit synchronisation."""
    device = cp.cuda.Device().id
    if device not in _STEP_STREAMS:
        _STEP_STREAMS[device] = cp.cuda.Stream(non_blocking=False)
    return _STEP_STREAMS[device]


def nvrtc_arch(cp: Any) -> str:
    """NVRTC's -arch: sm_90a on compute capability 9.0 (warpgroup MMA, which the `nhwc_wg` family
    issues, exists only there; the other kernels compile as for sm_90), else sm_XX."""
    cc = cp.cuda.Device().compute_capability  # CuPy gives "90" for compute capability 9.0
    return f"sm_{cc}a" if cc == "90" else f"sm_{cc}"


#: the name of the threads that build ahead (`wait_for_builds_ahead`)
PREFETCH_THREAD = "ember-cuda-prefetch"


def wait_for_builds_ahead(timeout: float | None = None) -> None:
    """Returns once every build ahead this process started has ended (or `timeout` seconds
    passed): a benchmark waits for them so that their rendering, which holds the GIL, does not
    delay the launches it times; a tool waits so that what they build is in the cache."""
    for thread in threading.enumerate():
        if thread.name == PREFETCH_THREAD and thread is not threading.current_thread():
            thread.join(timeout)


def _prefetch_reused(cp: Any, graph: Graph, source: cuda_codegen.CudaStepSource,
                     options: tuple[str, ...]) -> threading.Thread | None:
    """Starts building, on a thread of its own, the modules a step of this model at another batch
    size will ask for that this one did not build (its GEMMs and generated kernels on run-time
    sizes, `cuda_codegen.reused_variants`), so the last partial batch or an inference at another
    size finds them: rendered here, compiled as one build on the NVRTC workers (other processes)
    where they run, else on this process's threads, which run NVRTC without the GIL. Every step
    builds ahead: an inference step beside training (which took the training step's plans) its
    own kernels' variants, so inference at another size finds them; a later batch size, whose
    kernels already take run-time sizes, little or nothing. `EMBER_PREFETCH=0` turns it off. A
    failure here costs nothing: the later build compiles what it misses (and raises what NVRTC
    rejects)."""
    if os.environ.get("EMBER_PREFETCH", "1") == "0":
        return None
    device = compile_device()

    def build() -> None:
        cpus.widen_this_thread()  # not the core an OpenMP runtime may have bound the step's thread to
        try:
            with using(device):
                units = cuda_codegen.reused_variants(graph)
            if not _exiting.is_set():
                cuda_modules.prefetch(cp, [source.prelude + code for code, _ in units], options,
                                      names=[functions[0] for _, functions in units], step_code=source.code)
        except Exception:  # noqa: BLE001 (ahead-of-time work: the build that needs a module makes it)
            pass

    # Not a daemon: the interpreter's exit waits for the build in NVRTC (or stops it before it
    # starts, `_exiting`), rather than unloading libraries under it.
    thread = threading.Thread(target=build, name=PREFETCH_THREAD)
    thread.start()
    return thread


#: set when the interpreter starts to exit (before it joins threads): builds ahead stop
_exiting = threading.Event()
if hasattr(threading, "_register_atexit"):  # CPython's hook for this (concurrent.futures uses it)
    threading._register_atexit(_exiting.set)


class CudaExecutor:
    """One compiled CUDA step of a fused, memory-planned graph, bound to a `DeviceStorage`."""

    def __init__(self, graph: Graph, storage: Storage, dump_dir: str | os.PathLike | None = None, name: str = "step",
                 profile: bool | None = None, communicator: Any = None, source: Any = None) -> None:
        cp = self._cp = _cupy()
        storage.check(graph)
        if not isinstance(storage, DeviceStorage):
            raise TypeError(f"the cuda executor needs a DeviceStorage, got {type(storage).__name__}")
        self.graph, self.storage = graph, storage
        self.signature: dict[str, TensorType] = {k: graph.type(n) for k, n in graph.inputs.items()}
        t0 = time.perf_counter()
        self.source = source if source is not None else render_step(graph)  # given: from the plan cache
        rendered = time.perf_counter()
        self.arch = nvrtc_arch(cp)
        options = nvrtc_options(cp)
        if dump_dir is not None:
            out = Path(dump_dir)
            out.mkdir(parents=True, exist_ok=True)
            pipeline.write_text_atomic(out / f"{name}.cu", self.source.code)
            pipeline.write_text_atomic(out / f"{name}.nvrtc_options", " ".join(options) + "\n")
        collectives = [la for la in self.source.launches if la.function.startswith(cuda_codegen.COLLECTIVE_PREFIX)]
        if collectives and not getattr(communicator, "device_collectives", False):
            raise ValueError(f"the CUDA step all-reduces ({len(collectives)} collectives) and needs a device "
                             f"communicator (ember.runtime.cuda_comm: NCCL), got {type(communicator).__name__}")
        self.communicator = communicator
        self.module = cuda_modules.load_module(cp, _RING_SOURCE, options, name="ring")
        self.functions = compile_units(cp, self.source.prelude, self.source.units, options)
        self.functions.update({la.function: self._collective(la.function[len(cuda_codegen.COLLECTIVE_PREFIX):])
                               for la in collectives})
        self.compile_seconds = time.perf_counter() - t0
        # the build ahead starts once the step's graph is captured (`_replay`): its rendering
        # holds the GIL, which cost a cold compile 0.05-0.25 s on an H100 host when it ran beside
        # the rest of it, and the first 50 steps 30-55 ms once where it starts now
        self.prefetch: threading.Thread | None = None
        self._build_ahead = (cp, graph, self.source, options)
        # where the time went (the frontend adds its passes' seconds; `ember mnist --verbose`)
        self.compile_stats: dict[str, float | int] = {
            "render_s": round(rendered - t0, 4), "compiler_s": round(time.perf_counter() - rendered, 4),
            "kernel_functions": len(self.source.units), "kernel_calls": len(self.source.kernels)}
        self.arena = cp.zeros(max(self.source.arena_bytes, 256), dtype=cp.uint8)
        self.peak_bytes = self.source.arena_bytes
        self._constants = {n: cp.asarray(_c_order(graph.attrs(n)["value"]))
                           for n in graph.g if graph.notes(n).get("storage") == "constant"}
        self._inputs = {k: self._view(n) for k, n in graph.inputs.items()}
        self._outputs = {k: self._view(n) for k, n in graph.outputs.items()}
        self._copy_updates = [(storage.device_array(k), self._view(n)) for k, n in graph.updates.items()
                              if graph.notes(n).get("storage") not in ("parameter", "state")
                              or graph.notes(n).get("name") != k]
        self._counters: dict[int, Any] = {}  # kernel node -> its counters (zero now; each launch leaves them zero)
        for la in self.source.launches:
            cuda_modules.allow_dynamic_shared(cp, self.functions[la.function], la.shared_bytes)
        self._launches = [(self.functions[la.function], la.grid, la.block, la.shared_bytes,
                           tuple(self._arg(a) for a in la.args) + scalar_args(la.scalars))
                          for la in self.source.launches]
        # with EMBER_CUDA_PDL=1, a generated kernel right after another on its stream is launched
        # as its programmatic dependent (`cuda_pdl`); collectives are NCCL's and stay plain launches
        pdl = cuda_pdl.enabled(self.arch)
        self._dependent = [cuda_pdl.DependentLaunch(*launch) if pdl and not la.function.startswith(cuda_codegen.COLLECTIVE_PREFIX)
                           else None for launch, la in zip(self._launches, self.source.launches)]
        # Kernels with no memory hazard between them overlap on other streams inside the graph.
        kernel_nodes = [n for n in graph.meta["schedule"] if graph.op(n) == "fused"]
        self._placements = place(graph, kernel_nodes, STREAMS)
        by_kernel = {graph.attrs(n)["graph"].name: i for i, n in enumerate(kernel_nodes)}
        self._kernel_of_launch = [by_kernel[la.kernel] for la in self.source.launches]
        self._streams = [cp.cuda.Stream(non_blocking=True) for _ in range(STREAMS - 1)]
        self.stream = _step_stream(cp)
        self._graph = None
        self.profile = bool(profile)
        # Scalar float32 outputs (the loss) are returned from a ring (see _RING_SOURCE).
        self._rings = {k: _LossRing(cp, self.module, v) for k, v in self._outputs.items()
                       if v.shape == () and v.dtype == cp.float32}

    def _collective(self, op: str) -> Any:
        """A launch-shaped callable that all-reduces its first argument into its second, on the
        current stream (captured into the step's graph with the kernels around it)."""
        def launch(grid: Any, block: Any, args: tuple[Any, Any], shared_mem: int = 0) -> None:
            src, dst = args
            self.communicator.all_reduce_device(src, dst, op, self._cp.cuda.get_current_stream())
        return launch

    def _view(self, n: int) -> Any:
        return planned_view(self.graph, n, self.arena, self._constants.__getitem__, self.storage.device_array)

    def _arg(self, ref: tuple[str, int]) -> Any:
        kind, n = ref
        region = scratch_offset(kind)
        if region is not None:  # the kernel's scratch block, or its region at `region` bytes
            off = self.graph.notes(n)["scratch_offset"]
            return self.arena[off + region:off + self.graph.attrs(n)["kernel"].scratch_bytes]
        words = counter_words(kind)
        if words is not None:  # apart from the arena: other kernels write there between this one's launches
            if n not in self._counters:
                self._counters[n] = self._cp.zeros(words, dtype=self._cp.uint32)
            return self._counters[n]
        return self._view(n)

    def _launch_all(self, concurrent: bool = True, rings: bool = False) -> None:
        """Every launch of the step, then the copied-back updates, issued on the current stream;
        with `concurrent`, kernels go to the streams `place` chose, ordered by events, and
        everything joins the current stream again before the updates. With `rings`, the scalar
        outputs are then put into their rings: only for the step `__call__` runs (eagerly or
        captured), so each ring's device slot counter advances exactly once per call."""
        if not concurrent:
            for fn, grid, block, shared, args in self._launches:
                fn(grid, block, args, shared_mem=shared)
        else:
            cp = self._cp
            origin = cp.cuda.get_current_stream()
            streams = [origin] + self._streams
            start = origin.record()
            for s in self._streams:  # fork: every stream starts after what came before the step
                s.wait_event(start)
            done: dict[int, Any] = {}
            previous = None
            # per stream: whether the last thing issued on it in this step is a generated kernel
            # (the one a dependent launch waits for) with no event wait since
            after_kernel = [False] * len(streams)
            for (fn, grid, block, shared, args), k, dependent in zip(self._launches, self._kernel_of_launch,
                                                                      self._dependent):
                placement = self._placements[k]
                stream = streams[placement.stream]
                if k != previous:
                    for j in placement.waits:
                        stream.wait_event(done[j])
                        after_kernel[placement.stream] = False
                if dependent is not None and after_kernel[placement.stream]:
                    dependent(stream.ptr)
                else:
                    with stream:
                        fn(grid, block, args, shared_mem=shared)
                after_kernel[placement.stream] = dependent is not None
                done[k] = stream.record()
                previous = k
            for s in self._streams:  # join
                origin.wait_event(s.record())
        if self._copy_updates:  # memcpys, not CuPy's copy kernel (whose first use compiles it with NVRTC)
            stream = self._cp.cuda.get_current_stream().ptr
            for dst, src in self._copy_updates:
                self._cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, _DEVICE_TO_DEVICE, stream)
        if rings:
            for name, ring in self._rings.items():
                ring.put(self._outputs[name])

    def _replay(self) -> None:
        """The first call runs the launches eagerly (loading the module), the second captures them
        into a CUDA graph; every later call replays that graph."""
        if self._graph is not None:  # the per-step path: the stream is explicit, no context switch
            self._graph.launch(self.stream)
            return
        with self.stream:
            if getattr(self, "_warm", False):
                self.stream.begin_capture()
                try:
                    self._launch_all(rings=True)
                finally:
                    self._graph = self.stream.end_capture()
                self._graph.launch(self.stream)
                self.prefetch = _prefetch_reused(*self._build_ahead)
            else:
                self._launch_all(rings=True)
                self._warm = True

    def run_eager(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """One step with plain launches (no graph): for tests that compare replay with launches."""
        self._load(inputs)
        with self.stream:
            self._launch_all(concurrent=False)
            return {k: v.copy() for k, v in self._outputs.items()}

    def _load(self, inputs: Mapping[str, Any]) -> None:
        # This runs every step and its host time is the step's floor on a small model (an MLP
        # step is ~20 us of GPU time), so device inputs take one raw cudaMemcpyAsync each:
        # CuPy's MemoryPointer.copy_from_device_async costs several microseconds more per call.
        cp = self._cp
        if len(inputs) != len(self._inputs):
            check_inputs(self.signature, inputs)
        memcpy, stream_ptr = cp.cuda.runtime.memcpyAsync, self.stream.ptr
        for name, buffer in self._inputs.items():
            value = inputs.get(name)
            if isinstance(value, cp.ndarray):
                if value.shape != buffer.shape or value.dtype != buffer.dtype:
                    raise TypeError(f"input {name!r}: expected {self.signature[name]}, got a device array "
                                    f"{value.dtype}{list(value.shape)}")
                if value.flags.c_contiguous:  # a plain device-to-device copy: no kernel to launch
                    memcpy(buffer.data.ptr, value.data.ptr, value.nbytes, _DEVICE_TO_DEVICE, stream_ptr)
                else:
                    with self.stream:
                        cp.copyto(buffer, value)
                continue
            if type(value) is not np.ndarray or value.shape != buffer.shape or value.dtype != buffer.dtype:
                value = check_inputs(self.signature, inputs)[name]
            buffer.set(_c_order(value), stream=self.stream)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        self._load(inputs)
        for ring in self._rings.values():
            ring.advance(self.stream)
        self._replay()
        return {k: ring.latest() if (ring := self._rings.get(k)) else self._copy_out(v) for k, v in self._outputs.items()}

    def _copy_out(self, view: Any) -> Any:
        """A copy of an output buffer (the next step overwrites it), made by one async memcpy on the
        step's stream rather than a copy kernel: this runs every step, so its host cost counts."""
        out = self._cp.empty(view.shape, view.dtype)
        self._cp.cuda.runtime.memcpyAsync(out.data.ptr, view.data.ptr, view.nbytes, _DEVICE_TO_DEVICE, self.stream.ptr)
        return out


# A step's scalar output (the loss) is read back by few callers and only when they log, but
# copying it into a fresh array costs ~7 us of host time a step (an allocation and a memcpy call),
# a third of an MLP step at batch 64. Instead the step's graph ends with ember_ring_put, which
# stores the scalar in the next slot of a device chunk and advances a device counter; the host
# keeps its own count of calls and returns a view of that slot. Slots are never reused: a full
# chunk is replaced by a fresh one (ember_ring_reset, stream-ordered before the next step), and
# the old chunk lives as long as any returned view of it.
def compile_units(cp: Any, prelude: str, units: list[tuple[str, tuple[str, ...]]],
                  options: tuple[str, ...]) -> dict[str, Any]:
    """function name -> kernel, one NVRTC module per distinct kernel. Each module is cached on
    disk by its own source (`cuda_modules`), so a step that shares kernels with one compiled
    before (another batch size, the inference step, a model changed in one layer) compiles only
    the kernels that are new, on two threads (`nvrtc_workers`: NVRTC runs one compile at a time
    per process; worker processes where EMBER_NVRTC_WORKERS asks for them)."""
    modules = cuda_modules.load_modules(cp, [prelude + code for code, _ in units], options,
                                        names=[functions[0] for _, functions in units])
    return {f: module.get_function(f) for module, (_, functions) in zip(modules, units) for f in functions}


_RING_SOURCE = r"""
// ---- the scalar output ring (runtime/cuda.py: _LossRing)
extern "C" __global__ void ember_ring_put(const float* value, float* const* chunk, unsigned* count) {
  (*chunk)[*count] = *value;
  *count += 1u;
}
extern "C" __global__ void ember_ring_reset(float** chunk, unsigned* count, float* fresh) {
  *chunk = fresh;
  *count = 0u;
}
"""
RING_SLOTS = 4096


class _LossRing:
    """Host side of one scalar output's ring: the device chunk pointer and slot counter, the
    current chunk, and the number of slots the host has handed out of it."""

    def __init__(self, cp: Any, module: Any, value: Any) -> None:
        self._cp = cp
        self._put_fn = module.get_function("ember_ring_put")
        self._reset_fn = module.get_function("ember_ring_reset")
        self._state = cp.zeros(2, dtype=cp.uint64)  # [chunk pointer, slot counter (low 32 bits)]
        self._chunk = None
        self._used = RING_SLOTS  # forces a fresh chunk before the first step

    def advance(self, stream: Any) -> None:
        """Called before each step is enqueued: a full (or no) chunk is replaced first."""
        if self._used == RING_SLOTS:
            self._chunk = self._cp.empty(RING_SLOTS, dtype=self._cp.float32)
            with stream:
                self._reset_fn((1,), (1,), (self._state[0:1], self._state[1:2], self._chunk))
            self._used = 0
        self._used += 1

    def put(self, value: Any) -> None:
        """The device side of one step (launched inside the step's graph)."""
        self._put_fn((1,), (1,), (value, self._state[0:1], self._state[1:2]))

    def latest(self) -> Any:
        """The 0-d view of the slot the step just enqueued writes."""
        return self._chunk[self._used - 1]


def _tune(graph: Graph, **options: Any) -> Any:
    """`Target.tune`: the candidates of every kernel measured on this GPU (`runtime/tuner.py`)."""
    from .tuner import tune_graph
    from .tuner_cuda import CudaMeasurer
    with using(compile_device()):  # the device the graph's kernels were chosen for, and keyed by
        return tune_graph(graph, table=cuda_choices.TABLE, measurer=CudaMeasurer, **options)


TARGET = targets.register(targets.Target(
    name="cuda",
    description="generated CUDA compiled with NVRTC (CuPy), the whole step replayed as one CUDA graph",
    pipeline=pipeline.kernels,
    # What the CUDA templates take: bias/relu on the forward contractions, ReLU's backward on
    # conv grad-input, a generated pointwise epilogue on every contraction (on a GPU each kernel
    # is a launch and a pass over memory: a sigmoid backward, ReLU's backward behind a reshape or
    # an SGD update rides in the kernel that produces its input), and the loss as its own kernels.
    fusion=targets.FusionCaps(kinds=targets.FusionCaps().kinds | {"softmax_xent", "softmax_xent_grad"},
                              epilogues={"conv2d": frozenset({"bias", "relu", "pointwise"}),
                                         "matmul": frozenset({"bias", "relu", "pointwise"}),
                                         "conv2d_grad_input": frozenset({"relu_mask", "pointwise"}),
                                         "conv2d_grad_weight": frozenset({"pointwise"})},
                              loss_kernels=True, multi_output=True, store_narrow=True,
                              epilogue_dtypes=frozenset({"float32", "bfloat16"})),
    alignment=256,
    reuse_memory=False,  # an H200 has memory to spare; concurrency needs buffers that do not alias
    choose_kernel=_choose_kernel,  # the choice table: family, plan and scratch of each kernel
    # the GEMM family takes the batch-dependent sizes at run time: a new batch size reuses its plans
    reusable=_reusable,
    shared_relayout=_shared_relayout,  # a grad-weight reads the images of x and dy its forward and grad-input relaid
    tune=_tune,
    device_model=lambda: compile_device().name,
    language="cuda",
    source=lambda graph: render_step(graph).code,
    executor=CudaExecutor,
    storage=DeviceStorage,
    available=check_available,
    prepare_build=_prepare_build,  # NVRTC workers start while the passes run
    select_device=select_device,
    to_device=to_device,
    precisions=frozenset({"float32", "tf32", "bf16"}),  # bf16: the GEMM family's mma.sync bfloat16 path
))
