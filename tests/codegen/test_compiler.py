"""Tests for ember.codegen.compiler: g++ driver, content-hash cache, dumps, nvcc check."""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.codegen import compiler as C
from ember.codegen import cpus
from ember.codegen.compiler import (
    CompileError, cache_dir, cache_stats, compile_cpp, compile_cuda_check, reset_cache_stats,
    source_key,
)

ADD = 'extern "C" int add(int a, int b) { return a + b; }\n'
BROKEN = 'extern "C" int add(int a, int b) { return a + ; }\n'
OMP = r"""
#include <omp.h>
extern "C" double omp_sum(int n) {
    double s = 0.0;
    #pragma omp parallel for reduction(+:s) schedule(static)
    for (int i = 1; i <= n; ++i) s += (double)i;
    return s;
}
extern "C" int omp_threads() {
    int t = 0;
    #pragma omp parallel
    {
        #pragma omp single
        t = omp_get_num_threads();
    }
    return t;
}
"""
needs_gxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++").split()[0]) is None,
                               reason="no C++ compiler on PATH")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    # Never touch the user's real cache, even from a test that forgets cache=.
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "envcache"))
    reset_cache_stats()


def _add(path: Path) -> int:
    lib = ctypes.CDLL(str(path))
    lib.add.argtypes, lib.add.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return lib.add(40, 2)


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    target = tmp_path / "a" / "b"
    monkeypatch.setenv("EMBER_CACHE_DIR", str(target))
    assert cache_dir() == target and target.is_dir()
    monkeypatch.delenv("EMBER_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "ember"


def test_default_flags_are_ieee_faithful():
    assert "-ffast-math" not in C.DEFAULT_CXX_FLAGS
    for f in ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=c++17"):
        assert f in C.DEFAULT_CXX_FLAGS


@needs_gxx
def test_compile_load_hit_miss(tmp_path):
    cache = tmp_path / "cache"
    a = compile_cpp(ADD, cache=cache)
    assert not a.cache_hit and a.path.is_file() and a.key == source_key(ADD, C.DEFAULT_CXX_FLAGS)
    assert a.path == cache / "cpp" / a.key[:2] / f"{a.key}.so"
    assert a.source_path == a.path.with_suffix(".cpp") and a.source_path.read_text() == ADD
    meta = json.loads(a.path.with_suffix(".json").read_text())
    assert meta["sha256"] == C._sha256_file(a.path) and meta["command"] == list(a.command)
    # the identity recorded is the compiler's own --version banner
    banner = subprocess.run(C._cxx() + ["--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    assert banner and banner in meta["compiler_version"]
    assert _add(a.path) == 42
    assert cache_stats() == {"hits": 0, "misses": 1, "rebuilds": 0}

    b = compile_cpp(ADD, cache=cache)
    assert b.cache_hit and b.path == a.path and b.key == a.key
    assert cache_stats() == {"hits": 1, "misses": 1, "rebuilds": 0}

    c = compile_cpp(ADD.replace("a + b", "a + b + 1"), cache=cache)
    assert not c.cache_hit and c.key != a.key and _add(c.path) == 43
    d = compile_cpp(ADD, flags=(*C.DEFAULT_CXX_FLAGS, "-DEMBER_TEST=1"), cache=cache)
    assert not d.cache_hit and d.key != a.key
    assert cache_stats() == {"hits": 1, "misses": 3, "rebuilds": 0}
    # no temp leftovers in the shard directories
    assert not [p for p in cache.rglob(".*")]


@needs_gxx
@pytest.mark.parametrize("damage", ["truncate", "overwrite", "drop_meta", "drop_so"])
def test_corrupt_cache_entry_is_rebuilt(tmp_path, damage):
    cache = tmp_path / "cache"
    a = compile_cpp(ADD, cache=cache)
    data = a.path.read_bytes()
    if damage == "truncate":
        a.path.write_bytes(data[: len(data) // 2])
    elif damage == "overwrite":
        a.path.write_bytes(data[:64] + b"\xde\xad\xbe\xef" * 16 + data[128:])
    elif damage == "drop_meta":
        a.path.with_suffix(".json").unlink()
    else:
        a.path.unlink()
    b = compile_cpp(ADD, cache=cache)
    assert not b.cache_hit and b.path == a.path
    assert cache_stats() == {"hits": 0, "misses": 1, "rebuilds": 1}
    assert b.path.read_bytes() == data  # g++ output is reproducible
    assert _add(b.path) == 42
    assert compile_cpp(ADD, cache=cache).cache_hit


@needs_gxx
def test_syntax_error_raises_with_details(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(CompileError) as info:
        compile_cpp(BROKEN, cache=cache, name="bad")
    err = info.value
    msg = str(err)
    assert "error" in err.stderr and "expected primary-expression" in err.stderr
    assert "expected primary-expression" in msg  # the compiler's own text
    assert err.source_path.is_file() and err.source_path.read_text() == BROKEN
    assert err.source_path.parent == cache / "failed"
    assert str(err.source_path) in msg
    assert err.command[0] == "g++" and " ".join(err.command) in msg
    # the kept command reproduces the failure as it stands
    r = subprocess.run(err.command, cwd=err.source_path.parent, capture_output=True, text=True)
    assert r.returncode != 0 and "expected primary-expression" in r.stderr
    # nothing half-built is left to be mistaken for a hit
    assert not list((cache / "cpp").rglob("*.so")) and not list((cache / "cpp").rglob("*.json"))


@needs_gxx
def test_long_stderr_is_trimmed(tmp_path):
    src = "".join(f"int f{i}() {{ return undeclared_{i}; }}\n" for i in range(300))
    with pytest.raises(CompileError) as info:
        compile_cpp(src, cache=tmp_path)
    msg = str(info.value)
    assert "undeclared_0" in msg and "undeclared_299" not in msg and "trimmed" in msg
    assert len(msg) < 8000 and "undeclared_299" in info.value.stderr


@needs_gxx
def test_dump_dir_and_rebuild_script(tmp_path):
    dump = tmp_path / "dump"
    a = compile_cpp(ADD, cache=tmp_path / "cache", dump_dir=dump, name="step0")
    assert (dump / "step0.cpp").read_text() == f"// ember cache key: {a.key}\n" + ADD
    assert (dump / "step0.cache_key").read_text().strip() == a.key
    script = (dump / "step0.compile.sh").read_text()
    assert "step0.cpp" in script and "-o step0.so" in script and "-fopenmp" in script
    # run it from elsewhere: the script must cd to its own directory
    subprocess.run(["bash", str(dump / "step0.compile.sh")], cwd=tmp_path, check=True)
    assert _add(dump / "step0.so") == 42


@needs_gxx
def test_dump_dir_keeps_failing_source(tmp_path):
    dump = tmp_path / "dump"
    with pytest.raises(CompileError) as info:
        compile_cpp(BROKEN, cache=tmp_path / "cache", dump_dir=dump, name="bad")
    assert info.value.source_path == dump / "bad.cpp" and (dump / "bad.cpp").read_text().split("\n", 1)[1] == BROKEN
    assert (dump / "bad.compile.sh").is_file() and str(dump / "bad.cpp") in str(info.value)


@needs_gxx
def test_openmp_reduction(tmp_path):
    a = compile_cpp(OMP, cache=tmp_path)
    lib = ctypes.CDLL(str(a.path))
    lib.omp_sum.argtypes, lib.omp_sum.restype = [ctypes.c_int], ctypes.c_double
    lib.omp_threads.restype = ctypes.c_int
    n = 100_000
    assert lib.omp_sum(n) == n * (n + 1) / 2
    gomp = ctypes.CDLL("libgomp.so.1")  # the OpenMP runtime the library runs on (g++ -fopenmp)
    before = gomp.omp_get_max_threads()
    try:
        for n in (1, 3):
            gomp.omp_set_num_threads(n)
            assert lib.omp_threads() == n
            assert lib.omp_sum(n * 1000) == n * 1000 * (n * 1000 + 1) / 2
    finally:
        gomp.omp_set_num_threads(before)


@needs_gxx
def test_env_cache_dir_used_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "via_env"))
    a = compile_cpp(ADD)
    assert a.path.is_relative_to(tmp_path / "via_env" / "cpp")


def test_missing_compiler_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "definitely-not-a-compiler-xyz")
    with pytest.raises(FileNotFoundError, match="OpenMP.*device='cpu'"):
        compile_cpp(ADD, cache=tmp_path)


def test_missing_nvcc_is_clear(tmp_path, monkeypatch):
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="nvcc"):
        compile_cuda_check("__global__ void k() {}", cache=tmp_path)


@needs_nvcc
def test_cuda_check_compiles_and_caches(tmp_path):
    src = '__global__ void scale(float* x, float a, int n) {\n' \
          '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= a; }\n'
    path = compile_cuda_check(src, cache=tmp_path)
    assert path.suffix == ".cubin" and path.is_file() and path.stat().st_size > 0
    assert path.parent.parent == tmp_path / "cubin" and path.name == path.parent.name + path.name[2:]
    assert path.read_bytes()[:4] == b"\x7fELF"  # a cubin is an ELF image
    assert compile_cuda_check(src, cache=tmp_path) == path
    assert cache_stats() == {"hits": 1, "misses": 1, "rebuilds": 0}
    assert compile_cuda_check(src, arch="sm_80", cache=tmp_path) != path


@needs_nvcc
def test_cuda_check_broken_kernel(tmp_path):
    src = "__global__ void k(float* x) { x[threadIdx.x] = undefined_thing; }\n"
    with pytest.raises(CompileError) as info:
        compile_cuda_check(src, cache=tmp_path)
    assert "undefined_thing" in str(info.value) and info.value.command[0] == "nvcc"
    assert info.value.source_path.read_text() == src


@needs_gxx
def test_concurrent_compiles_of_one_key(tmp_path):
    # Several compilers racing on one key: last writer wins, every result is whole.
    from concurrent.futures import ThreadPoolExecutor
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(4) as pool:
        arts = list(pool.map(lambda _: compile_cpp(ADD, cache=cache), range(4)))
    assert len({a.path for a in arts}) == 1
    assert all(_add(a.path) == 42 for a in arts)
    meta = json.loads(arts[0].path.with_suffix(".json").read_text())
    assert meta["sha256"] == C._sha256_file(arts[0].path)
    assert compile_cpp(ADD, cache=cache).cache_hit
    assert not [p for p in cache.rglob(".*")]


@needs_gxx
def test_cached_library_loads_without_a_compiler(tmp_path, monkeypatch):
    """The cache is looked up before the compiler is looked for: a machine whose g++ is gone
    (or a container without one) still loads what was built before."""
    built = compile_cpp(ADD, cache=tmp_path)
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    again = compile_cpp(ADD, cache=tmp_path)
    assert again.cache_hit and again.path == built.path and again.key == built.key
    assert ctypes.CDLL(str(again.path)).add(2, 3) == 5
    with pytest.raises(C.CompilerNotFoundError, match=r"'g\+\+' not found on PATH.*apt-get install g\+\+"):
        compile_cpp(ADD + "// another source\n", cache=tmp_path)


def test_unusable_cache_dir_names_it_and_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(C.CacheDirError, match=r"compile cache .*file/cache cannot be created.*set EMBER_CACHE_DIR"):
        C.cache_dir()
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(C.CacheDirError, match="is a file, not a directory"):
        C.cache_dir()


@needs_gxx
def test_read_only_cache_serves_hits_and_refuses_builds_clearly(tmp_path, monkeypatch):
    # the tests run as root, for whom a chmod'ed folder is still writable: os.access stands in
    compile_cpp(ADD, cache=tmp_path)
    real_access = os.access
    monkeypatch.setattr(C.os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    assert compile_cpp(ADD, cache=tmp_path).cache_hit
    with pytest.raises(C.CacheDirError, match=r"is not writable \(permission denied\); set EMBER_CACHE_DIR"):
        compile_cpp(ADD + "// new\n", cache=tmp_path)


# ---- several translation units (compile_units): a step's kernels, entry and shared header

_HEADER = {"hdr_1.h": "#pragma once\n#define EMBER_KERNEL __attribute__((visibility(\"hidden\")))\n"}
_FLAGS = ("-O2", "-fPIC", "-std=c++17")


def _units(k2: str = "return a * b;") -> list:
    entry = ('#include "hdr_1.h"\nEMBER_KERNEL int k1(int, int);\nEMBER_KERNEL int k2(int, int);\n'
             'extern "C" int add(int a, int b) { return k1(a, b) + 0 * k2(a, b); }\n')
    return [C.Unit("entry", entry, _FLAGS),
            C.Unit("k1", '#include "hdr_1.h"\nEMBER_KERNEL int k1(int a, int b) { return a + b; }\n', _FLAGS,
                   "// k1 implements %1 add\n", "k7_add"),
            C.Unit("k2", '#include "hdr_1.h"\nEMBER_KERNEL int k2(int a, int b) { ' + k2 + ' }\n', _FLAGS, "", "k9_mul")]


@needs_gxx
def test_units_compile_in_parallel_and_a_changed_unit_alone_is_rebuilt(tmp_path):
    first = C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path, jobs=2)
    assert _add(first.path) == 42
    assert cache_stats("obj") == {"hits": 0, "misses": 3, "rebuilds": 0} and cache_stats("cpp")["misses"] == 1
    assert first.stats() == {"objects": 3, "objects_built": 3, "objects_cached": 0, "link_cached": False, "jobs": 2}
    again = C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path)
    assert again.cache_hit and again.path == first.path
    reset_cache_stats()
    changed = C.compile_units(_units("return a - b;"), link_flags=("-shared",), headers=_HEADER, cache=tmp_path)
    assert cache_stats("obj") == {"hits": 2, "misses": 1, "rebuilds": 0}  # k2 alone
    assert cache_stats("cpp")["misses"] == 1 and changed.path != first.path and _add(changed.path) == 42
    # the header takes part in every unit's key
    reset_cache_stats()
    C.compile_units(_units(), link_flags=("-shared",), headers={"hdr_1.h": _HEADER["hdr_1.h"] + "// v2\n"},
                    cache=tmp_path)
    assert cache_stats("obj")["misses"] == 3


@needs_gxx
def test_a_corrupt_cached_object_is_rebuilt(tmp_path):
    first = C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path)
    obj = first.objects[1].path
    damaged = obj.with_name("damaged.tmp")
    damaged.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])
    os.replace(damaged, obj)
    reset_cache_stats()
    again = C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path)
    assert cache_stats("obj") == {"hits": 2, "misses": 0, "rebuilds": 1}
    assert not again.objects[1].cache_hit and _add(again.path) == 42


@needs_gxx
def test_a_failing_unit_names_itself_its_kernels_and_the_compiler_output(tmp_path):
    with pytest.raises(CompileError) as info:
        C.compile_units(_units("return a * ;"), link_flags=("-shared",), headers=_HEADER, cache=tmp_path, jobs=3)
    message = str(info.value)
    assert "'step.k2' (k9_mul)" in message and "expected primary-expression" in message
    kept = info.value.source_path
    assert kept.exists() and "return a * ;" in kept.read_text() and (kept.parent / "hdr_1.h").exists()
    # the command it shows reruns where the source was kept
    rerun = subprocess.run(info.value.command, cwd=kept.parent, capture_output=True, text=True)
    assert rerun.returncode != 0 and "expected primary-expression" in rerun.stderr


@needs_gxx
def test_units_dump_every_source_and_one_script_that_rebuilds_the_library(tmp_path):
    dump = tmp_path / "dump"
    art = C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path / "c", dump_dir=dump)
    assert sorted(p.name for p in dump.iterdir()) == ["hdr_1.h", "step.cache_key", "step.compile.sh", "step.cpp",
                                                      "step.k1.cpp", "step.k2.cpp"]
    assert (dump / "step.cache_key").read_text().strip() == art.key
    k1 = (dump / "step.k1.cpp").read_text()
    assert k1.startswith(f"// ember cache key: {art.objects[1].key}\n// k1 implements %1 add\n")
    subprocess.run(["bash", str(dump / "step.compile.sh")], check=True, capture_output=True)
    assert _add(dump / "step.so") == 42


@needs_gxx
def test_units_load_without_a_compiler_once_built(tmp_path, monkeypatch):
    first = C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path)
    monkeypatch.setattr(C.shutil, "which", lambda name: None)
    assert C.compile_units(_units(), link_flags=("-shared",), headers=_HEADER, cache=tmp_path).path == first.path
    with pytest.raises(C.CompilerNotFoundError):
        C.compile_units(_units("return 0;"), link_flags=("-shared",), headers=_HEADER, cache=tmp_path)


@needs_gxx
def test_units_started_early_are_compiled_once_and_must_finish_unchanged(tmp_path):
    units = _units()
    with C.UnitBuilds(cache=tmp_path, jobs=2) as builds:
        builds.start(units[1], _HEADER)
        started = builds.started["k1"][2]
        # the kernel's notes may grow (another call of it) without a second compile
        grown = dataclasses.replace(units[1], note=units[1].note + "// k1 implements %7 add\n", what="k7_add, k8_add")
        art = builds.finish([units[0], grown, units[2]], link_flags=("-shared",), headers=_HEADER)
    assert art.objects[1] is started.result() and _add(art.path) == 42
    assert cache_stats("obj") == {"hits": 0, "misses": 3, "rebuilds": 0}
    with C.UnitBuilds(cache=tmp_path / "other") as builds:
        builds.start(units[2], _HEADER)
        changed = dataclasses.replace(units[2], source=units[2].source + "// edited\n")
        with pytest.raises(AssertionError, match="'k2' was started with other contents"):
            builds.finish([units[0], units[1], changed], link_flags=("-shared",), headers=_HEADER)
    # with a dump, the dumped copies carry the final notes: nothing starts before finish
    with C.UnitBuilds(cache=tmp_path / "dumped", dump_dir=tmp_path / "dump") as builds:
        builds.start(units[1], _HEADER)
        assert builds.started == {}


@needs_gxx
def test_a_failing_unit_started_early_raises_at_finish_and_close_drops_queued_units(tmp_path):
    units = _units("return a * ;")
    with C.UnitBuilds(cache=tmp_path, jobs=1) as builds:
        builds.start(units[2], _HEADER)  # fails to compile, on the pool's one thread
        with pytest.raises(CompileError, match="'step.k2' \\(k9_mul\\)"):
            builds.finish(units, link_flags=("-shared",), headers=_HEADER)
    # generation that stops half-way (an exception while rendering): the units not begun are dropped
    builds = C.UnitBuilds(cache=tmp_path / "dropped", jobs=1)
    for i in range(6):
        builds.start(dataclasses.replace(units[1], name=f"k1_{i}", source=units[1].source + f"// {i}\n"), _HEADER)
    builds.close()
    done = [f for _, _, f in builds.started.values() if not f.cancelled()]
    assert 1 <= len(done) < 6 and all(f.done() for _, _, f in builds.started.values())


_BOUND_CHILD = r"""
import json, os, subprocess, sys
from ember.codegen import compiler
start = sorted(os.sched_getaffinity(0))
if len(start) < 2:
    print(json.dumps({"start": start}))
    sys.exit(0)
os.sched_setaffinity(0, {start[0]})  # what libgomp does to the thread of its first parallel region under OMP_PROC_BIND
units = [compiler.Unit("entry", 'extern "C" int one() { return 1; }\n', ("-fPIC",)),
         compiler.Unit("k1", 'int k1() { return 2; }\n', ("-fPIC",))]
compiler.compile_units(units, link_flags=("-shared",), cache=sys.argv[1])
print(json.dumps({"start": start, "main": sorted(os.sched_getaffinity(0)), "usable": compiler.usable_cores()}))
"""

# a stand-in for g++ that records the CPUs it may run on (a file a run: runs go in parallel), then runs g++
_RECORDING_CXX = """#!/bin/sh
PYTHON -c 'import json, os, sys; print(json.dumps([sys.argv[1:], sorted(os.sched_getaffinity(0))]))' "$@" > "$EMBER_TEST_AFFINITY_LOG/$$.json"
exec g++ "$@"
"""


@needs_gxx
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinities")
def test_units_compile_on_every_core_of_the_process_when_openmp_bound_the_calling_thread(tmp_path):
    """With OMP_PROC_BIND set, an OpenMP runtime binds the thread of its first parallel region
    (the main thread: a CPU step, PyTorch, the bench's FMA probe) to one core, and processes it
    starts inherit that core: the build jobs then ran one at a time on it (a 16-core host's
    cold compiles took 3-10 s). They count and use the process's cores, not the thread's."""
    compiler_script = tmp_path / "recording-cxx"
    compiler_script.write_text(_RECORDING_CXX.replace("PYTHON", shlex.quote(sys.executable)))
    compiler_script.chmod(0o755)
    log = tmp_path / "affinity"
    log.mkdir()
    env = dict(os.environ, CXX=str(compiler_script), EMBER_TEST_AFFINITY_LOG=str(log))

    def run_child() -> subprocess.CompletedProcess:
        cpus.widen_this_thread()  # the child starts on all of this process's CPUs, whatever pytest's thread has
        return subprocess.run([sys.executable, "-c", _BOUND_CHILD, str(tmp_path / "cache")], env=env,
                              capture_output=True, text=True, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        out = pool.submit(run_child).result()
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if len(seen["start"]) < 2:
        pytest.skip("needs two CPUs")
    assert seen["main"] == seen["start"][:1]  # the binding took
    assert seen["usable"] == len(seen["start"])
    runs = [json.loads(run.read_text()) for run in log.iterdir()]
    compiles = [cpus for args, cpus in runs if "-c" in args]  # (not the link, nor asking its version)
    assert len(compiles) == 2, runs
    assert all(cpus == seen["start"] for cpus in compiles), (compiles, seen)
