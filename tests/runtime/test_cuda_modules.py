"""The CUDA module cache (`runtime/cuda_modules.py`): NVRTC runs only on a miss, a hit loads the
stored cubin, and a corrupt entry, a cubin the driver refuses, a rejected source and an
unwritable cache each end the way the module promises. CuPy is faked without a GPU (what the
cache reads of it: `cuda.nvrtc`, `cuda.function.Module`, `cuda.driver.CUDADriverError`); the
`cuda` test builds and loads real modules."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ember.codegen import compiler
from ember.ir import Graph
from ember.runtime import cuda_modules

SOURCE = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n'
OPTIONS = ("-std=c++17", "-arch=sm_90a")  # what the runtime builds with for compute capability 9.0


class FakeNVRTC:
    class NVRTCError(Exception):
        pass

    def __init__(self, version=(13, 0)):
        self.version, self.compiles, self.options = version, 0, []

    def getVersion(self):
        return self.version

    def createProgram(self, source, name, headers, include_names):
        return {"source": source, "name": name}

    def compileProgram(self, program, options):
        self.compiles += 1
        self.options.append(tuple(options))
        if "syntax error" in program["source"]:
            program["log"] = f"{program['name']}(1): error: expected a declaration"
            raise self.NVRTCError("NVRTC_ERROR_COMPILATION")

    def getCUBIN(self, program):
        return b"\x7fELF" + program["source"].encode()

    def getProgramLog(self, program):
        return program.get("log", "")

    def destroyProgram(self, program):
        pass


class DriverError(Exception):
    pass


def fake_cupy(version=(13, 0), refuse: bytes | None = None) -> SimpleNamespace:
    """`refuse`: an image the fake driver will not load (a stale cubin)."""
    nvrtc = FakeNVRTC(version)
    loaded: list[bytes] = []

    class Module:
        def load(self, image: bytes) -> None:
            if image == refuse:
                raise DriverError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
            loaded.append(image)
            self.image = image

        def get_function(self, name: str):
            return (name, self.image)

    return SimpleNamespace(cuda=SimpleNamespace(nvrtc=nvrtc, function=SimpleNamespace(Module=Module),
                                                driver=SimpleNamespace(CUDADriverError=DriverError)),
                           loaded=loaded)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setenv("EMBER_NVRTC_WORKERS", "0")  # the fake NVRTC lives in this process only
    compiler.reset_cache_stats()
    cuda_modules._version_of.cache_clear()
    cuda_modules._write_warned.clear()
    yield
    cuda_modules._version_of.cache_clear()


def entry(cache: Path) -> dict[str, Path]:
    (meta,) = (cache / "nvrtc").glob("*/*.json")
    return {ext: meta.with_suffix(ext) for ext in (".json", ".cubin", ".cu")}


def test_a_miss_builds_and_stores_then_a_hit_loads_without_nvrtc(tmp_path):
    cp = fake_cupy()
    first = cuda_modules.load_module(cp, SOURCE, OPTIONS, cache=tmp_path)
    assert cp.cuda.nvrtc.compiles == 1 and compiler.cache_stats("nvrtc") == {"hits": 0, "misses": 1, "rebuilds": 0}
    # the options CuPy's RawModule used to add are still passed: the same code as before the cache
    assert cp.cuda.nvrtc.options[0] == OPTIONS + cuda_modules.IMPLIED_OPTIONS
    files = entry(tmp_path)
    meta = json.loads(files[".json"].read_text())
    assert files[".cu"].read_text() == SOURCE and meta["nvrtc"] == [13, 0]
    assert meta["options"] == list(OPTIONS + cuda_modules.IMPLIED_OPTIONS)

    cp2 = fake_cupy()  # another process: its own NVRTC, never asked to compile
    second = cuda_modules.load_module(cp2, SOURCE, OPTIONS, cache=tmp_path)
    assert cp2.cuda.nvrtc.compiles == 0 and second.image == first.image
    assert compiler.cache_stats("nvrtc")["hits"] == 1
    assert not [p for p in (tmp_path / "nvrtc").rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("change", ["source", "options", "nvrtc"])
def test_the_key_holds_source_options_and_nvrtc_version(tmp_path, change):
    cuda_modules.load_module(fake_cupy(), SOURCE, OPTIONS, cache=tmp_path)
    cuda_modules._version_of.cache_clear()
    cp = fake_cupy(version=(13, 1) if change == "nvrtc" else (13, 0))
    source = SOURCE + "// v2\n" if change == "source" else SOURCE
    options = OPTIONS + ("-lineinfo",) if change == "options" else OPTIONS
    cuda_modules.load_module(cp, source, options, cache=tmp_path)
    assert cp.cuda.nvrtc.compiles == 1 and len(list((tmp_path / "nvrtc").glob("*/*.cubin"))) == 2


def test_a_corrupt_cubin_is_rebuilt(tmp_path):
    cuda_modules.load_module(fake_cupy(), SOURCE, OPTIONS, cache=tmp_path)
    cubin = entry(tmp_path)[".cubin"]
    cubin.write_bytes(cubin.read_bytes()[:5])  # a crash mid-copy, a full disk
    cp = fake_cupy()
    module = cuda_modules.load_module(cp, SOURCE, OPTIONS, cache=tmp_path)
    assert cp.cuda.nvrtc.compiles == 1 and compiler.cache_stats("nvrtc")["rebuilds"] == 1
    assert module.image == b"\x7fELF" + SOURCE.encode() and cubin.read_bytes() == module.image


def test_a_cubin_the_driver_refuses_is_rebuilt(tmp_path):
    cuda_modules.load_module(fake_cupy(), SOURCE, OPTIONS, cache=tmp_path)
    stale = entry(tmp_path)[".cubin"].read_bytes()
    cp = fake_cupy(refuse=stale)  # e.g. built by a newer NVRTC, now under an older driver
    cp.cuda.nvrtc.getCUBIN = lambda program: b"\x7fELF rebuilt"
    module = cuda_modules.load_module(cp, SOURCE, OPTIONS, cache=tmp_path)
    assert module.image == b"\x7fELF rebuilt" and compiler.cache_stats("nvrtc")["rebuilds"] == 1
    assert entry(tmp_path)[".cubin"].read_bytes() == b"\x7fELF rebuilt"


def test_a_rejected_source_names_the_log_and_keeps_the_source(tmp_path):
    bad = SOURCE + "syntax error here\n"
    with pytest.raises(compiler.CompileError) as info:
        cuda_modules.load_module(fake_cupy(), bad, OPTIONS, name="ember_k3", cache=tmp_path)
    message = str(info.value)
    assert "NVRTC compilation failed for 'ember_k3'" in message and "expected a declaration" in message
    assert info.value.source_path.read_text() == bad and info.value.source_path.parent == tmp_path / "failed"
    assert not list((tmp_path / "nvrtc").glob("*/*.cubin")), "nothing cached for a failed build"


def test_a_full_cache_disk_costs_a_warning_not_the_module(tmp_path, monkeypatch):
    cuda_modules.load_module(fake_cupy(), SOURCE, OPTIONS, cache=tmp_path)

    def full_disk(path, data, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(cuda_modules.pipeline, "write_atomic", full_disk)
    hit = fake_cupy()
    cuda_modules.load_module(hit, SOURCE, OPTIONS, cache=tmp_path)  # a hit writes nothing
    assert hit.cuda.nvrtc.compiles == 0
    miss = fake_cupy()
    with pytest.warns(UserWarning, match="cannot be written.*No space left.*EMBER_CACHE_DIR"):
        module = cuda_modules.load_module(miss, SOURCE + "// new\n", OPTIONS, cache=tmp_path)
    assert miss.cuda.nvrtc.compiles == 1 and module.image.startswith(b"\x7fELF")
    assert len(list((tmp_path / "nvrtc").glob("*/*.json"))) == 1, "no entry for the module that could not be stored"


@pytest.mark.cuda
def test_real_modules_hit_the_cache_in_a_new_process(tmp_path):
    import subprocess
    import sys
    script = (
        "import sys, numpy as np, cupy as cp\n"
        "from ember.codegen import compiler\n"
        "from ember.runtime import cuda_modules\n"
        f"m = cuda_modules.load_module(cp, {SOURCE!r}, ('-std=c++17', "
        "f'-arch=sm_{cp.cuda.Device().compute_capability}'), cache=sys.argv[1])\n"
        "x = cp.arange(32, dtype=cp.float32)\n"
        "m.get_function('twice')((1,), (32,), (x,))\n"
        "assert np.array_equal(x.get(), 2 * np.arange(32, dtype=np.float32))\n"
        "print(compiler.cache_stats('nvrtc'))\n")
    runs = [subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert "'misses': 1" in runs[0].stdout and "'hits': 1" in runs[1].stdout, [r.stdout for r in runs]
    assert np.frombuffer(entry(tmp_path)[".cubin"].read_bytes()[:4], np.uint8).tolist() == [0x7F, 0x45, 0x4C, 0x46]


@pytest.mark.cuda
def test_real_modules_built_on_worker_processes_run(tmp_path):
    import subprocess
    import sys
    script = (
        "import sys, numpy as np, cupy as cp\n"
        "from ember.codegen import compiler\n"
        "from ember.runtime import cuda_modules, nvrtc_workers\n"
        "nvrtc_workers.prestart()\n"
        "srcs = ['extern \"C\" __global__ void add%d(float* x) { x[threadIdx.x] += %d.0f; }' % (i, i) for i in range(12)]\n"
        "arch = f'-arch=sm_{cp.cuda.Device().compute_capability}'\n"
        "mods = cuda_modules.load_modules(cp, srcs, ('-std=c++17', arch), names=[f'add{i}' for i in range(12)], "
        "cache=sys.argv[1])\n"
        "x = cp.zeros(32, dtype=cp.float32)\n"
        "for i, m in enumerate(mods): m.get_function(f'add{i}')((1,), (32,), (x,))\n"
        "assert np.array_equal(x.get(), np.full(32, 66.0, np.float32)), x.get()\n"
        "print(compiler.cache_stats('nvrtc'))\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True,
                         env=dict(os.environ, EMBER_NVRTC_WORKERS="3"))
    assert "'misses': 12" in out.stdout, out.stdout


def test_prefetch_builds_what_the_cache_lacks_and_a_later_load_finds_it(tmp_path):
    """Modules built ahead (a step's GEMMs as a later batch size renders them) are stored and
    nothing is loaded; what the cache holds is not built again; a source NVRTC rejects is left
    out; the later load is a hit, NVRTC not asked."""
    cuda_modules.load_module(fake_cupy(), SOURCE, OPTIONS, cache=tmp_path)
    other = SOURCE.replace("twice", "thrice")
    cp = fake_cupy()
    built = cuda_modules.prefetch(cp, [SOURCE, other, "syntax error"], OPTIONS, names=["a", "b", "c"], cache=tmp_path)
    assert built == 1 and cp.cuda.nvrtc.compiles == 2 and cp.loaded == []
    assert compiler.cache_stats("nvrtc")["misses"] == 1  # the first load's; prefetching counts nothing
    later = fake_cupy()
    module = cuda_modules.load_module(later, other, OPTIONS, cache=tmp_path)
    assert later.cuda.nvrtc.compiles == 0 and module.image == b"\x7fELF" + other.encode()


def test_prefetch_into_a_cache_that_cannot_be_written_is_silent(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(cuda_modules.pipeline, "write_atomic", refuse)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_modules.prefetch(fake_cupy(), [SOURCE], OPTIONS, names=["a"], cache=tmp_path) == 1
    assert not cuda_modules._write_warned.is_set()


def test_a_build_ahead_run_to_its_end_marks_its_step_for_that_cache_options_and_nvrtc(tmp_path):
    """`prefetch(..., step_code=)` marks the step whose variants it built (even with none to
    build); `built_ahead` finds the mark for the same step source, options and NVRTC version in
    the same cache only."""
    step = "// the whole step\n" + SOURCE
    assert not cuda_modules.built_ahead(fake_cupy(), step, OPTIONS, cache=tmp_path)
    cuda_modules.prefetch(fake_cupy(), [SOURCE], OPTIONS, names=["a"], cache=tmp_path, step_code=step)
    assert cuda_modules.built_ahead(fake_cupy(), step, OPTIONS, cache=tmp_path)
    assert (tmp_path / "nvrtc" / "ahead").is_dir() and entry(tmp_path)  # the module entry beside it
    assert not cuda_modules.built_ahead(fake_cupy(), step + "// another\n", OPTIONS, cache=tmp_path)
    assert not cuda_modules.built_ahead(fake_cupy(), step, ("-std=c++17", "-arch=sm_80"), cache=tmp_path)
    cuda_modules._version_of.cache_clear()
    assert not cuda_modules.built_ahead(fake_cupy(version=(13, 1)), step, OPTIONS, cache=tmp_path)
    assert not cuda_modules.built_ahead(fake_cupy(), step, OPTIONS, cache=tmp_path / "elsewhere")
    nothing = "// a step with nothing to build ahead\n"
    assert cuda_modules.prefetch(fake_cupy(), [], OPTIONS, names=[], cache=tmp_path, step_code=nothing) == 0
    assert cuda_modules.built_ahead(fake_cupy(), nothing, OPTIONS, cache=tmp_path)


def test_the_nvrtc_workers_start_unless_every_step_the_build_comes_from_was_built_ahead(monkeypatch, tmp_path):
    """The CUDA target's `prepare_build`: a step planned afresh (no sources), a source unknown or
    one whose build ahead never ended starts the workers; sources all marked do not."""
    from ember.runtime import cuda as runtime_cuda
    cp = fake_cupy()
    cp.cuda.Device = lambda: SimpleNamespace(compute_capability="90")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime_cuda, "_cupy", lambda: cp)
    started = []
    monkeypatch.setattr(runtime_cuda.nvrtc_workers, "prestart", lambda expected=None: started.append(expected))
    built, unbuilt = SimpleNamespace(code="// built ahead\n"), SimpleNamespace(code="// never stepped\n")
    cuda_modules.prefetch(cp, [], OPTIONS, names=[], step_code=built.code)
    for sources, starts in (((), True), ((built,), False), ((built, built), False), ((unbuilt,), True),
                            ((built, unbuilt), True), ((None,), True), ((built, None), True)):
        started.clear()
        runtime_cuda._prepare_build(Graph("traced"), sources)
        assert bool(started) == starts, sources


@pytest.mark.cuda
def test_a_stepped_models_build_ahead_is_marked_and_its_warm_compile_and_later_batch_start_no_workers(
        tmp_path, monkeypatch):
    """On the GPU: a cold compile of the CNN starts the NVRTC workers; its captured steps build
    ahead and mark the step; then a compile from the plan cache and a later batch size start none
    and build no module."""
    from ember.frontends import compile, nn, optim
    from ember.frontends.training import build_model
    from ember.runtime import cuda as runtime_cuda

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EMBER_PLAN_CACHE", "1")
    started = []
    monkeypatch.setattr(runtime_cuda.nvrtc_workers, "prestart", lambda expected=None: started.append(expected))
    x, y = np.zeros((32, 1, 28, 28), np.float32), np.zeros(32, np.int64)

    def fresh():
        return compile(build_model("cnn"), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example_inputs=(x, y),
                       device="cuda")

    step = fresh()
    assert started[0] is not None  # `_prepare_build`'s, with the modules expected (the build's own follow)
    for _ in range(3):
        step(x, y)
    runtime_cuda.wait_for_builds_ahead()
    (_, executor), = step._steps.values()
    cp = runtime_cuda._cupy()
    assert cuda_modules.built_ahead(cp, executor.source.code, runtime_cuda.nvrtc_options(cp))
    started.clear()
    warm = fresh()
    assert warm.compile_stats["plan_cached"] is True
    before = compiler.cache_stats("nvrtc")["misses"]
    warm.precompile((5, 1, 28, 28))
    assert started == [] and compiler.cache_stats("nvrtc")["misses"] == before


def test_the_nvrtc_warm_up_is_opt_in_once_a_process_and_runs_beside_the_passes(monkeypatch):
    """`cuda_modules.warm` (EMBER_NVRTC_WARM=1, called by the target's prepare_build): this
    process's first NVRTC call, an empty kernel, on a thread that ends; once a process; nothing
    without the variable; a failing NVRTC costs nothing."""
    from ember.runtime import cuda as runtime_cuda
    cp = fake_cupy()
    monkeypatch.setattr(cuda_modules, "_warm_thread", None)
    monkeypatch.delenv(cuda_modules.WARM_ENV, raising=False)
    assert cuda_modules.warm(lambda: pytest.fail("CuPy asked for without EMBER_NVRTC_WARM")) is None
    monkeypatch.setenv(cuda_modules.WARM_ENV, "1")
    monkeypatch.setattr(runtime_cuda, "_cupy", lambda: cp)
    monkeypatch.setattr(runtime_cuda.nvrtc_workers, "prestart", lambda expected=None: None)
    runtime_cuda._prepare_build(Graph("traced"))
    thread = cuda_modules._warm_thread
    thread.join(timeout=30)
    assert not thread.is_alive() and not thread.daemon and cp.cuda.nvrtc.compiles == 1
    assert cuda_modules.warm(lambda: cp) is None and cp.cuda.nvrtc.compiles == 1  # once a process
    monkeypatch.setattr(cuda_modules, "_warm_thread", None)
    broken = fake_cupy()
    broken.cuda.nvrtc.compileProgram = lambda program, options: (_ for _ in ()).throw(RuntimeError("no NVRTC"))
    thread = cuda_modules.warm(lambda: broken)
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_function_is_opted_in_to_dynamic_shared_memory_only_past_48_kib():
    """A launch of more than 48 KiB of dynamic shared memory (nhwc_tc's deeper pipelines) needs its
    function's opt-in through the driver; a launch within it changes nothing."""
    calls = []
    driver = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
                             funcSetAttribute=lambda ptr, attribute, value: calls.append((ptr, attribute, value)))
    cp = SimpleNamespace(cuda=SimpleNamespace(driver=driver))
    function = SimpleNamespace(ptr=1234)
    cuda_modules.allow_dynamic_shared(cp, function, 48 * 1024)
    assert calls == []
    cuda_modules.allow_dynamic_shared(cp, function, 72 * 1024)
    assert calls == [(1234, 8, 72 * 1024)]
