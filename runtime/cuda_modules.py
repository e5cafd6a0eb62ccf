"""CUDA modules: generated source -> NVRTC -> cubin, cached by ember, loaded through the driver.

Layout, beside the C++ cache (`codegen/compiler.py`, DESIGN.md "Caching"):

    <cache>/nvrtc/<key[:2]>/<key>.cubin   the module
    <cache>/nvrtc/<key[:2]>/<key>.json    metadata: sha256 of the cubin, options, NVRTC version
    <cache>/nvrtc/<key[:2]>/<key>.cu      the source it was built from
    <cache>/failed/<key>.cu               a source NVRTC rejected, kept for the error message
    <cache>/nvrtc/ahead/<key>             a step (keyed as a module of its whole source is) whose
                                          variants for other batch sizes were built ahead

Why not CuPy's own cache (`RawModule`): its key includes the output of NVRTC preprocessing an
empty source, done once per process and option set, and that one compile was ~0.2 s, nearly all
of a warm CUDA compile (docs/benchmarks.md). ember keys on what it can read without compiling:
the source, the options, the target architecture and NVRTC's version (a library call). A hit
reads the file, checks its sha256 and hands the image to the driver; a cubin the driver refuses
(a newer NVRTC's output under an older driver) is rebuilt, like a corrupt entry.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ember.codegen import compiler
from ember.passes import pipeline

from . import nvrtc_workers

FORMAT_VERSION = 1
KIND = "nvrtc"  # the artefact kind in the cache and in `compiler.cache_stats`

# What CuPy's RawModule added to every NVRTC compile before this cache replaced it: flushing
# float32 denormals to zero is part of the numerics ember's CUDA steps were verified with, and
# the default execution space lets helpers in the prelude omit `__device__`.
IMPLIED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")

_write_warned = threading.Event()


def nvrtc_version(cp: Any) -> tuple[int, int]:
    """NVRTC's (major, minor): part of the key, since another NVRTC may generate other code."""
    return _version_of(cp.cuda.nvrtc)


@functools.lru_cache(maxsize=None)
def _version_of(nvrtc: Any) -> tuple[int, int]:
    return tuple(nvrtc.getVersion())


def module_key(source: str, options: tuple[str, ...], version: tuple[int, int]) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, "source": source, "options": list(options),
                       "nvrtc": list(version)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _nvrtc_cubin(cp: Any, source: str, options: tuple[str, ...], name: str) -> tuple[bytes, str]:
    """(cubin, '') or (b'', NVRTC's log) for one source: `-arch=sm_XX` makes NVRTC emit SASS."""
    nvrtc = cp.cuda.nvrtc
    program = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError:
            return b"", nvrtc.getProgramLog(program)
        return nvrtc.getCUBIN(program), ""
    finally:
        nvrtc.destroyProgram(program)


WARM_ENV = "EMBER_NVRTC_WARM"
_warm_thread: threading.Thread | None = None
_warm_lock = threading.Lock()


def warm(cupy: Callable[[], Any]) -> threading.Thread | None:
    """Makes this process's first NVRTC call (an empty kernel) on a thread of its own, once a
    process, and returns the thread (None when not asked for, or already made). NVRTC's first
    call loads its builtins (~0.5 s on the H200's host), which the first in-process compile pays
    otherwise: in a warm process (plan and modules cached) that is a new batch size's, and right
    after the start (the trainer precompiles the last partial batch at once) the workers are still
    starting, so this process's threads compile then. NVRTC runs without the GIL, so this overlaps
    the passes. `cupy` gives CuPy, asked for only when the call is made. Opt-in
    (EMBER_NVRTC_WARM=1) until it is measured on a GPU."""
    global _warm_thread
    if os.environ.get(WARM_ENV, "0") != "1":
        return None
    with _warm_lock:
        if _warm_thread is not None:
            return None
        cp = cupy()

        def call() -> None:
            try:
                _nvrtc_cubin(cp, 'extern "C" __global__ void ember_warm() {}', IMPLIED_OPTIONS, "ember_warm.cu")
            except Exception:  # noqa: BLE001 (a head start only: the compile that needs NVRTC reports its errors)
                pass

        # not a daemon: the interpreter's exit waits for the call rather than unloading NVRTC under it
        _warm_thread = threading.Thread(target=call, name="ember-nvrtc-warm")
        _warm_thread.start()
        return _warm_thread


def _read_hit(cubin: Path, meta: Path) -> bytes | None:
    try:
        image = cubin.read_bytes()
        if json.loads(meta.read_text())["sha256"] == hashlib.sha256(image).hexdigest():
            return image
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _store(root: Path, shard: Path, key: str, source: str, image: bytes, options: tuple[str, ...],
           version: tuple[int, int], warn: bool = True) -> None:
    """Writes the entry (metadata last: it marks a complete one); a cache that cannot be written
    costs the next process a rebuild, never this one its module, so it warns once and goes on
    (`warn` False: silently, for modules built ahead that no one asked for yet)."""
    try:
        pipeline.write_atomic(shard / f"{key}.cu", source)
        pipeline.write_atomic(shard / f"{key}.cubin", image)
        pipeline.write_atomic(shard / f"{key}.json", json.dumps({
            "format": FORMAT_VERSION, "key": key, "sha256": hashlib.sha256(image).hexdigest(),
            "options": list(options), "nvrtc": list(version), "created": time.time()}, indent=1) + "\n")
    except OSError as exc:
        if warn and not _write_warned.is_set():
            _write_warned.set()
            warnings.warn(f"ember's compile cache {root} cannot be written ({exc.strerror or exc}): CUDA modules are "
                          "rebuilt in every process; set EMBER_CACHE_DIR to a writable folder", stacklevel=3)


def _ahead_marker(root: Path, step_code: str, options: tuple[str, ...], version: tuple[int, int]) -> Path:
    return root / KIND / "ahead" / module_key(step_code, tuple(options) + IMPLIED_OPTIONS, version)


def built_ahead(cp: Any, step_code: str, options: tuple[str, ...], cache: Path | None = None) -> bool:
    """Whether a `prefetch` for the step of this whole source (`CudaStepSource.code`) and options
    ran to its end into this cache, in this process or an earlier one: a later batch size of the
    step then finds its modules there."""
    root = Path(cache) if cache is not None else compiler.cache_dir()
    return _ahead_marker(root, step_code, options, nvrtc_version(cp)).exists()


def prefetch(cp: Any, sources: list[str], options: tuple[str, ...], *, names: list[str],
             cache: Path | None = None, step_code: str | None = None) -> int:
    """Builds into the cache the sources it does not hold, loading nothing: modules a later build
    is expected to ask for (`runtime/cuda.py`: a step's kernels as a step of another batch size
    renders them), made while this process does other work. The misses are compiled together
    as a build's are (`nvrtc_workers`: the worker processes where they run, else this process's
    two threads). A source NVRTC rejects is left out (the build that needs it raises). With
    `step_code` (the source of the step these are variants of), its end is marked for
    `built_ahead`. Returns how many were built."""
    root = Path(cache) if cache is not None else compiler.cache_dir()
    built = _prefetch(cp, sources, options, names, root)
    if step_code is not None:
        try:
            pipeline.write_atomic(_ahead_marker(root, step_code, options, nvrtc_version(cp)), "")
        except OSError:
            pass  # unmarked: a later process starts NVRTC workers it may not need, nothing else
    return built


def _prefetch(cp: Any, sources: list[str], options: tuple[str, ...], names: list[str], root: Path) -> int:
    options = tuple(options) + IMPLIED_OPTIONS
    version = nvrtc_version(cp)
    misses = []
    for source, name in zip(sources, names):
        key = module_key(source, options, version)
        shard = root / KIND / key[:2]
        if _read_hit(shard / f"{key}.cubin", shard / f"{key}.json") is None:
            misses.append((key, shard, source, name))
    jobs = [(source, options, f"{name}.cu") for _, _, source, name in misses]
    results = nvrtc_workers.compile_all(jobs, version, lambda job: _nvrtc_cubin(cp, *job)) if jobs else []
    built = 0
    for (key, shard, source, _), (image, _) in zip(misses, results):
        if image:
            _store(root, shard, key, source, image, options, version, warn=False)
            built += 1
    return built


#: dynamic shared memory a launch may take without its function's opt-in (every GPU since Volta)
DEFAULT_DYNAMIC_SHARED = 48 * 1024


def allow_dynamic_shared(cp: Any, function: Any, nbytes: int) -> None:
    """Lets `function` (a loaded module's) launch with `nbytes` of dynamic shared memory: past 48
    KiB the driver refuses a launch unless the function opted in to that much."""
    if nbytes > DEFAULT_DYNAMIC_SHARED:
        attribute = getattr(cp.cuda.driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
        cp.cuda.driver.funcSetAttribute(function.ptr, attribute, nbytes)


def load_module(cp: Any, source: str, options: tuple[str, ...], *, name: str = "kernels",
                cache: Path | None = None) -> Any:
    """A loaded `cupy.cuda.function.Module` for `source`, built by NVRTC only on a cache miss.
    `options` are the caller's (`-std`, `-arch=sm_XX`); `IMPLIED_OPTIONS` are added. Raises
    `compiler.CompileError` (NVRTC's log, the source kept) when NVRTC rejects the source."""
    return load_modules(cp, [source], options, names=[name], cache=cache, workers=False)[0]


def load_modules(cp: Any, sources: list[str], options: tuple[str, ...], *, names: list[str],
                 cache: Path | None = None, workers: bool = True) -> list[Any]:
    """`load_module` of each source; the misses compiled together, with `workers` through
    `nvrtc_workers` (two threads, and worker processes where asked for), else one by one here.
    Every miss is built before the first rejected source raises."""
    options = tuple(options) + IMPLIED_OPTIONS
    version = nvrtc_version(cp)
    root = Path(cache) if cache is not None else compiler.cache_dir()
    keys = [module_key(source, options, version) for source in sources]
    modules: list[Any] = [None] * len(sources)
    misses = []
    for i, key in enumerate(keys):
        shard = root / KIND / key[:2]
        image = _read_hit(shard / f"{key}.cubin", shard / f"{key}.json")
        if image is not None:
            module = cp.cuda.function.Module()
            try:
                module.load(image)
            except cp.cuda.driver.CUDADriverError:  # e.g. built by a newer NVRTC than this driver runs
                compiler.count_cache(KIND, "rebuilds")
            else:
                compiler.count_cache(KIND, "hits")
                modules[i] = module
                continue
        else:
            compiler.count_cache(KIND, "rebuilds" if (shard / f"{key}.json").exists() else "misses")
        misses.append(i)
    jobs = [(sources[i], options, f"{names[i]}.cu") for i in misses]
    local = lambda job: _nvrtc_cubin(cp, *job)  # noqa: E731
    results = nvrtc_workers.compile_all(jobs, version, local) if workers else [local(job) for job in jobs]
    failed = None
    for i, (image, log) in zip(misses, results):
        key, shard = keys[i], root / KIND / keys[i][:2]
        if not image:
            failed = failed or (i, log)
            continue
        _store(root, shard, key, sources[i], image, options, version)
        modules[i] = cp.cuda.function.Module()
        modules[i].load(image)
    if failed is not None:
        i, log = failed
        kept = root / "failed" / f"{keys[i]}.cu"
        try:
            pipeline.write_atomic(kept, sources[i])
        except OSError:
            kept = Path("(not kept: the cache cannot be written)")
        raise compiler.CompileError(
            f"NVRTC compilation failed for {names[i]!r}, key {keys[i][:16]}\nsource kept at: {kept}\n"
            f"options: {' '.join(options)}\n--- NVRTC log ---\n{compiler.trim_log(log)}",
            source_path=kept, command=("nvrtc", *options), stderr=log)
    return modules
