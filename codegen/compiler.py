"""Compiler driver: generated C++ -> shared library (g++ + OpenMP), CUDA -> cubin (nvcc check).

Artefacts live in a content-addressed cache (DESIGN.md, "Caching"):

    <cache>/cpp/<key[:2]>/<key>.so    the library
    <cache>/cpp/<key[:2]>/<key>.json  metadata: sha256 of the .so, command, compiler version
    <cache>/cpp/<key[:2]>/<key>.cpp   the source it was built from
    <cache>/cubin/...                 the same for nvcc checks of CUDA (.cubin, .json, .cu)
    <cache>/nvrtc/...                 the runtime's CUDA modules (runtime/cuda_modules.py)
    <cache>/failed/<key>.cpp          sources that failed to compile, kept for the error message

The key hashes the source, the flags, the compiler's identity (``--version``, plus the
resolved target when a flag says ``=native``) and FORMAT_VERSION. Every file is written to a
temporary name in its final directory and moved into place with ``os.replace``; the metadata
goes last, and a hit re-checks the library's sha256, so a crash or a corrupt file costs a
rebuild, never a broken load. Compilers run in the directory that holds the source, with
relative file names, so a recorded command (``cd DIR && ...``) reruns exactly.
Loading the result is the runtime's job, not this module's.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from . import cpus

FORMAT_VERSION = 1

# IEEE-faithful on purpose: no -ffast-math (NaN checks and run-to-run determinism must hold).
# -ffp-contract=fast lets g++ fuse a*b+c into FMA (deterministic on one machine);
# -fno-math-errno only drops errno writes, which lets sqrtf & co. vectorise;
# -fno-trapping-math only drops the assumption that a float compare may trap, which lets g++
# turn the selects of relu, where, clamps (and em_exp) into vector blends: no value changes.
DEFAULT_CXX_FLAGS: tuple[str, ...] = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17",
    "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-DNDEBUG", "-pipe",
)

_WHAT = {"cpp": "cpp compilation", "obj": "cpp compilation (of one unit)", "cubin": "cubin compilation"}
_MAX_STDERR_CHARS = 6000
_MAX_STDERR_LINES = 60

_stats_lock = threading.Lock()
_stats: dict[str, dict[str, int]] = {}  # artefact kind ("cpp": a library, "obj", "cubin") -> counters


def cache_stats(kind: str | None = None) -> dict[str, int]:
    """Process-wide counters: hits, misses (nothing cached), rebuilds (cached but corrupt); of
    one artefact kind ("cpp": linked libraries, "obj": object files, "cubin"), or of all."""
    with _stats_lock:
        kinds = [_stats.get(kind, {})] if kind is not None else list(_stats.values())
        return {what: sum(c.get(what, 0) for c in kinds) for what in ("hits", "misses", "rebuilds")}


def reset_cache_stats() -> None:
    with _stats_lock:
        _stats.clear()


def count_cache(kind: str, what: str) -> None:
    """Adds one to a counter of `cache_stats` (also for artefacts built outside this module: the
    runtime's NVRTC modules)."""
    with _stats_lock:
        counters = _stats.setdefault(kind, {})
        counters[what] = counters.get(what, 0) + 1


class CacheDirError(OSError):
    """The cache folder cannot be created or written; the message names it and $EMBER_CACHE_DIR."""


def _cache_fault(path: Path, fault: str) -> CacheDirError:
    return CacheDirError(f"ember's compile cache {path} {fault}; set EMBER_CACHE_DIR to a writable folder to move it")


def cache_dir() -> Path:
    """``$EMBER_CACHE_DIR`` if set, else ``~/.cache/ember``; created on demand."""
    env = os.environ.get("EMBER_CACHE_DIR")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "ember"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise _cache_fault(path, "is a file, not a directory") from None
    except OSError as e:
        raise _cache_fault(path, f"cannot be created ({e.strerror or e})") from None
    return path


def _check_writable(root: Path) -> None:
    """Called before a build writes anything: a read-only cache still serves its hits."""
    if root.exists() and not os.access(root, os.W_OK | os.X_OK):
        raise _cache_fault(root, "is not writable (permission denied)")


class CompileError(RuntimeError):
    """The compiler rejected a generated source. The source is kept at ``source_path``."""

    def __init__(self, message: str, *, source_path: Path, command: Sequence[str], stderr: str):
        super().__init__(message)
        self.source_path = Path(source_path)
        self.command = tuple(command)
        self.stderr = stderr


@dataclass(frozen=True)
class CompiledArtifact:
    path: Path                   # the .so (or .cubin) in the cache
    key: str                     # content hash, see source_key()
    command: tuple[str, ...]     # argv that built it, run in path.parent (relative file names)
    source_path: Path            # the cached source (<key>.cpp)
    cache_hit: bool
    seconds: float               # wall time of this call (lookup, plus the compile on a miss)


# --------------------------------------------------------------------------- compilers

def _cxx() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "g++")


class CompilerNotFoundError(FileNotFoundError):
    """The C++ (or CUDA) compiler is not on PATH; the message says which and how to get one."""


_INSTALL_GXX = ("install it (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++; macOS: brew install gcc), "
                "or set $CXX to another C++ compiler with OpenMP, or use --device reference")


def _found(argv: Sequence[str]) -> bool:
    return bool(argv) and _which(shutil.which, argv[0], os.environ.get("PATH")) is not None


@functools.lru_cache(maxsize=64)
def _which(which: Callable[[str], str | None], name: str, path: str | None) -> str | None:
    # Planning asks for the compiler once per kernel (the vector variant decides its geometry);
    # a PATH walk each time cost ViT 30 ms per compile (380 kernels' geometries). Keyed on PATH
    # and on the lookup function itself, so a changed PATH (or a test's stand-in for `which`)
    # looks again.
    return which(name)


def _require(argv: Sequence[str], why: str) -> None:
    if not _found(argv):
        name = argv[0] if argv else "(empty $CXX)"
        raise CompilerNotFoundError(f"C++ compiler {name!r} not found on PATH: {why}; {_INSTALL_GXX}")


@functools.lru_cache(maxsize=None)
def _native_target(argv: tuple[str, ...]) -> str | None:
    """``-march=native -Q --help=target`` of the compiler (what native resolves to), or None
    when the compiler does not answer it (not GCC, or no such option on this target)."""
    try:
        r = subprocess.run([*argv, "-march=native", "-Q", "--help=target"], capture_output=True, text=True)
    except OSError:
        return None
    return r.stdout if r.returncode == 0 else None


def native_target_enables(option: str) -> bool | None:
    """Whether ``$CXX -march=native`` turns ``option`` (e.g. ``-mavx512f``) on, as the compiler
    itself reports it (the CPU features generated code may use are the compiler's view of this
    CPU); None when there is no compiler to ask (a cached library may still load) or it does
    not say."""
    compiler = _cxx()
    report = _native_target(tuple(compiler)) if _found(compiler) else None
    if not report:
        return None
    return option in _enabled_options(report)


@functools.lru_cache(maxsize=8)
def _enabled_options(report: str) -> frozenset[str]:
    """The options a ``--help=target`` report lists as ``[enabled]``."""
    return frozenset(words[0] for line in report.splitlines()
                     if len(words := line.split()) >= 2 and words[1] == "[enabled]")


@functools.lru_cache(maxsize=None)
def _identity(argv: tuple[str, ...], native: bool) -> str:
    """The compiler's ``--version`` (and its resolved native target), once per process."""
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise FileNotFoundError(f"cannot run {shlex.join(argv)} --version: {exc}") from exc
    if native:  # -march=native means different code on a different CPU: key on what it resolves to
        report = _native_target(argv)
        out += "\n" + hashlib.sha256(report.encode()).hexdigest() if report is not None else ""
    return out.strip()


def _key(kind: str, compiler: Sequence[str], flags: Sequence[str], source: str,
         extra: Mapping[str, str] | None = None) -> str:
    native = any(f.endswith("=native") for f in flags)
    ident = _identity(tuple(compiler), native)
    blob = json.dumps({"format": FORMAT_VERSION, "kind": kind, "compiler": ident,
                       "flags": list(flags), "source": source, **({"extra": dict(extra)} if extra else {})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _alias(kind: str, compiler: Sequence[str], flags: Sequence[str], source: str,
           extra: Mapping[str, str] | None = None) -> str:
    """The key without the compiler's identity (which needs the compiler to run): it finds a
    library built earlier when the compiler is no longer on PATH."""
    blob = json.dumps({"format": FORMAT_VERSION, "kind": kind, "compiler_argv": list(compiler),
                       "flags": list(flags), "source": source, **({"extra": dict(extra)} if extra else {})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _lookup_without_compiler(kind: str, out_ext: str, src_ext: str, argv_for: Callable[[str, str], list[str]],
                             compiler: Sequence[str], flags: Sequence[str], source: str,
                             cache: Path | None) -> CompiledArtifact | None:
    t0 = time.perf_counter()
    env_root = Path(cache) if cache is not None else None
    try:
        root = env_root or cache_dir()
        key = json.loads((root / kind / "alias" / f"{_alias(kind, compiler, flags, source)}.json").read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    shard = root / kind / str(key)[:2]
    out, meta, src = (shard / f"{key}{ext}" for ext in (out_ext, ".json", src_ext))
    if _cached(out, meta) != "hit":
        return None
    count_cache(kind, "hits")
    return CompiledArtifact(out, key, tuple(argv_for(src.name, out.name)), src, True, time.perf_counter() - t0)


def source_key(source: str, flags: Sequence[str] = DEFAULT_CXX_FLAGS) -> str:
    """Cache key compile_cpp() uses for this exact source and flags with the current $CXX."""
    compiler = _cxx()
    _require(compiler, "a C++ compiler with OpenMP (g++) is needed for device='cpu'")
    return _key("cpp", compiler, flags, source)


# --------------------------------------------------------------------------- files

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, data: str, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def trim_log(text: str) -> str:
    """A compiler's output cut to what an error message should carry."""
    lines = text.strip().splitlines()
    out = "\n".join(lines[:_MAX_STDERR_LINES])[:_MAX_STDERR_CHARS]
    return out if len(out) == len("\n".join(lines)) else out + f"\n... ({len(lines)} lines in all, trimmed)"


def _cached(out: Path, meta: Path) -> str:
    """'hit', 'miss' (nothing there) or 'corrupt' (something there that must be rebuilt)."""
    if not out.exists() and not meta.exists():
        return "miss"
    try:
        ok = json.loads(meta.read_text())["sha256"] == _sha256_file(out)
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    return "hit" if ok else "corrupt"


def _build(kind: str, src_ext: str, out_ext: str, argv_for: Callable[[str, str], list[str]],
           compiler: Sequence[str], flags: Sequence[str], source: str, cache: Path | None,
           name: str, dump_dir: Path | None, *, extra: Mapping[str, str] | None = None,
           dump_note: str = "", what: str = "", dump_script: bool = True) -> CompiledArtifact:
    """One cached artefact. `extra`: files the source includes (name -> text), part of the key,
    written beside it; `dump_note`: comment lines for the dumped copy only (not compiled, not
    keyed); `what`: added to a compile error's first line (e.g. the kernels a unit holds)."""
    t0 = time.perf_counter()
    root = Path(cache) if cache is not None else cache_dir()
    key = _key(kind, compiler, flags, source, extra)
    alias = root / kind / "alias" / f"{_alias(kind, compiler, flags, source, extra)}.json"
    shard = root / kind / key[:2]
    out, meta, src = (shard / f"{key}{ext}" for ext in (out_ext, ".json", src_ext))
    command = tuple(argv_for(src.name, out.name))
    extra = dict(extra or {})

    if dump_dir is not None:  # written first, so a failing build is dumped too
        dump_dir = Path(dump_dir)
        dump_cmd = argv_for(f"{name}{src_ext}", f"{name}{out_ext}")
        # The dumped copy names its cache key in a first comment line (the key hashes the source
        # without it); the comment changes nothing the compiler produces.
        _atomic_write(dump_dir / f"{name}{src_ext}", f"// ember cache key: {key}\n{dump_note}{source}")
        for fname, text in extra.items():
            _atomic_write(dump_dir / fname, text)
        if dump_script:
            _atomic_write(dump_dir / f"{name}.cache_key", key + "\n")
            _atomic_write(dump_dir / f"{name}.compile.sh", "#!/usr/bin/env bash\n"
                          f"# ember: rebuild {name}{out_ext} from {name}{src_ext} (cache key {key})\n"
                          f'set -euo pipefail\ncd "$(dirname "$0")"\n{shlex.join(dump_cmd)}\n', 0o755)

    state = _cached(out, meta)
    if state == "hit":
        count_cache(kind, "hits")
        try:  # a read-only cache still serves its hits
            if not src.exists():
                _atomic_write(src, source)
            for fname, text in extra.items():
                if not (shard / fname).exists():
                    _atomic_write(shard / fname, text)
            if not alias.exists():
                _atomic_write(alias, json.dumps({"key": key}) + "\n")
        except OSError:
            pass
        return CompiledArtifact(out, key, command, src, True, time.perf_counter() - t0)
    count_cache(kind, "misses" if state == "miss" else "rebuilds")

    _check_writable(root)
    try:
        shard.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_fault(root, f"cannot be written ({e.strerror or e})") from None
    with tempfile.TemporaryDirectory(dir=shard, prefix=f".{key[:12]}.") as tmp:
        (Path(tmp) / src.name).write_text(source)
        for fname, text in extra.items():
            (Path(tmp) / fname).write_text(text)
        proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not (Path(tmp) / out.name).exists():
            stderr = proc.stderr or proc.stdout
            if dump_dir is not None:
                kept, kept_cmd = dump_dir / f"{name}{src_ext}", tuple(dump_cmd)
            else:
                kept, kept_cmd = root / "failed" / src.name, command
                _atomic_write(kept, source)
                for fname, text in extra.items():  # so that the command reruns there
                    _atomic_write(kept.parent / fname, text)
            raise CompileError(
                f"{_WHAT.get(kind, kind)} failed (exit {proc.returncode}) for {name!r}{what}, key {key[:16]}\n"
                f"source kept at: {kept}\n"
                f"command: cd {shlex.quote(str(kept.parent))} && {shlex.join(kept_cmd)}\n"
                f"--- compiler output ---\n{trim_log(stderr)}",
                source_path=kept, command=kept_cmd, stderr=stderr)
        digest = _sha256_file(Path(tmp) / out.name)
        for fname in extra:  # content-named (the source includes them by name): any copy will do
            os.replace(Path(tmp) / fname, shard / fname)
        os.replace(Path(tmp) / src.name, src)
        os.replace(Path(tmp) / out.name, out)
    _atomic_write(meta, json.dumps({
        "format": FORMAT_VERSION, "key": key, "sha256": digest, "command": list(command),
        "compiler_version": _identity(tuple(compiler), False).splitlines()[0],
        "flags": list(flags), "created": time.time()}, indent=1) + "\n")
    _atomic_write(alias, json.dumps({"key": key}) + "\n")  # after the metadata: it points at a complete entry
    return CompiledArtifact(out, key, command, src, False, time.perf_counter() - t0)


# --------------------------------------------------------------------------- public entry points

def compile_cpp(source: str, *, flags: Sequence[str] = DEFAULT_CXX_FLAGS, name: str = "step",
                cache: Path | None = None, dump_dir: Path | None = None) -> CompiledArtifact:
    """Compile a C++ translation unit to a shared library, through the cache.

    The compiler is ``$CXX`` (may hold arguments, e.g. ``ccache g++``) else ``g++``.
    With ``dump_dir`` also writes ``<name>.cpp``, ``<name>.compile.sh`` (rebuilds
    ``<name>.so`` there) and ``<name>.cache_key``. Raises CompileError on a failed compile.
    """
    compiler = _cxx()
    flags = tuple(flags)
    argv_for = lambda s, o: [*compiler, *flags, s, "-o", o]  # noqa: E731
    if not _found(compiler):
        # The cache is looked up first: a library built earlier loads without any compiler.
        hit = _lookup_without_compiler("cpp", ".so", ".cpp", argv_for, compiler, flags, source, cache)
        if hit is not None:
            return hit
        _require(compiler, "a C++ compiler with OpenMP (g++) is needed for device='cpu'")
    return _build("cpp", ".cpp", ".so", argv_for, compiler, flags, source, cache, name, dump_dir)


def compile_cuda_check(source: str, *, arch: str = "sm_90", name: str = "kernels",
                       cache: Path | None = None) -> Path:
    """Compile CUDA C++ with ``nvcc -cubin -arch=<arch>`` and return the cached .cubin.

    A build-time check that generated CUDA compiles (the runtime itself uses NVRTC).
    """
    if shutil.which("nvcc") is None:
        raise CompilerNotFoundError("nvcc not found on PATH: compile_cuda_check needs the CUDA toolkit "
                                "(e.g. add /usr/local/cuda/bin to PATH)")
    compiler, flags = ("nvcc",), ("-cubin", f"-arch={arch}")
    return _build("cubin", ".cu", ".cubin", lambda s, o: [*compiler, *flags, s, "-o", o],
                  compiler, flags, source, cache, name, None).path


# --------------------------------------------------------------------------- several translation units

@dataclass(frozen=True)
class Unit:
    """One translation unit of a library built from several (compile_units)."""
    name: str                    # file stem in a dump (``<library>.<name>.cpp``; the entry is the library's name)
    source: str
    flags: tuple[str, ...]       # compiler flags; compile_units adds ``-c``
    note: str = ""               # comment lines for the dumped copy only (e.g. which graph nodes it implements)
    what: str = ""               # what a compile error adds to the unit's name (e.g. the kernels it holds)


@dataclass(frozen=True)
class UnitsArtifact:
    path: Path                   # the linked .so in the cache
    key: str                     # the link's key (it hashes the objects' keys and the link flags)
    objects: tuple[CompiledArtifact, ...]   # one per unit, in unit order
    link: CompiledArtifact
    seconds: float               # wall time: lookups, compiles (in parallel), link
    jobs: int                    # compilers run at once

    @property
    def cache_hit(self) -> bool:
        return self.link.cache_hit and all(o.cache_hit for o in self.objects)

    def stats(self) -> dict[str, int | float | bool]:
        built = [o for o in self.objects if not o.cache_hit]
        return {"objects": len(self.objects), "objects_built": len(built),
                "objects_cached": len(self.objects) - len(built), "link_cached": self.link.cache_hit,
                "jobs": self.jobs}


def usable_cores() -> int:
    """The cores this process may run on (taskset, cgroups' cpusets; the process's, not the
    calling thread's, which an OpenMP runtime may have bound to one core: `cpus`)."""
    return cpus.usable_cores()


def _step_alias(compiler: Sequence[str], units: Sequence[Unit], headers: Mapping[str, str],
                link_flags: Sequence[str]) -> str:
    """Every input of a multi-unit library, without the compiler's identity: finds the library
    when no compiler is on PATH (the object keys, which need it, cannot be computed then)."""
    return _alias("cpp", compiler, link_flags, json.dumps([[u.source, list(u.flags)] for u in units]), headers)


def compile_units(units: Sequence[Unit], *, link_flags: Sequence[str], name: str = "step",
                  headers: Mapping[str, str] | None = None, cache: Path | None = None,
                  dump_dir: Path | None = None, jobs: int | None = None) -> UnitsArtifact:
    """Compiles each unit to an object file (``$CXX <flags> -c``), at most `jobs` at once
    (default: the cores this process may use), each cached by its own source, flags, included
    `headers` and the compiler's identity; then links them into a shared library (``$CXX <link_flags> *.o``),
    cached by the objects' keys. So a library that differs from an earlier one in one unit
    compiles that unit only, and libraries sharing a kernel share its object.

    `headers` (file name -> text) are the files the units include by name; name them by their
    content. With `dump_dir`, writes every unit as ``<name>.<unit>.cpp`` (the first unit, the
    entry, as ``<name>.cpp``), the headers, ``<name>.compile.sh`` (all the commands: it rebuilds
    ``<name>.so`` there) and ``<name>.cache_key`` (the library's key). A unit that fails raises
    its CompileError (the first failing unit in unit order, once all have finished).
    `UnitBuilds` does the same with units handed over one by one while the rest are generated."""
    with UnitBuilds(name=name, cache=cache, dump_dir=dump_dir, jobs=jobs) as builds:
        return builds.finish(units, link_flags=link_flags, headers=headers)


class UnitBuilds:
    """`compile_units` in two steps, so that compiling starts before the last unit exists:
    `start(unit, headers)` compiles a unit that is final as soon as it is generated (a kernel in a
    unit of its own), `finish(units, ...)` compiles the others (largest first) and links all of
    them. A started unit is matched by name and must have the same source, flags and headers in
    `finish` (its notes may have grown: more calls of the kernel). With a dump, `start` leaves
    the unit to `finish`, so that the dumped copies carry the final notes."""

    def __init__(self, *, name: str = "step", cache: Path | None = None, dump_dir: Path | None = None,
                 jobs: int | None = None) -> None:
        self.t0 = time.perf_counter()
        self.compiler = _cxx()
        self.root = Path(cache) if cache is not None else None
        self.name = name
        self.jobs = max(1, jobs or usable_cores())
        self.dump = Path(dump_dir) if dump_dir is not None else None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.jobs)
        self.started: dict[str, tuple[Unit, dict[str, str], concurrent.futures.Future]] = {}

    def __enter__(self) -> "UnitBuilds":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the compiles under way and drops those not begun (after `finish`, none)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _one(self, unit: Unit, stem: str, headers: dict[str, str]) -> CompiledArtifact:
        # the compiler runs on every core of the process, wherever the thread that made this
        # pool's threads was bound (`cpus`)
        cpus.widen_this_thread()
        return _build("obj", ".cpp", ".o", lambda s, o: [*self.compiler, *unit.flags, "-c", s, "-o", o], self.compiler,
                      unit.flags, unit.source, self.root or cache_dir(), stem, self.dump, extra=headers,
                      dump_note=unit.note, what=f" ({unit.what})" if unit.what else "", dump_script=False)

    def start(self, unit: Unit, headers: Mapping[str, str]) -> None:
        """Begins compiling `unit` (not the entry: it is dumped as `<name>.<unit>.cpp`) with the
        headers it includes; without a compiler this does nothing (`finish` may still find the
        whole library in the cache)."""
        if self.dump is None and unit.name not in self.started and _found(self.compiler):
            headers = dict(headers)
            self.started[unit.name] = (unit, headers, self.pool.submit(self._one, unit, f"{self.name}.{unit.name}", headers))

    def finish(self, units: Sequence[Unit], *, link_flags: Sequence[str],
               headers: Mapping[str, str] | None = None) -> UnitsArtifact:
        """Compiles the units not started yet and links all of `units` (in their order)."""
        compiler, name = self.compiler, self.name
        headers, link_flags = dict(headers or {}), tuple(link_flags)
        if not _found(compiler):
            # a library built earlier loads without any compiler
            hit = _units_without_compiler(compiler, units, headers, link_flags, self.root)
            if hit is not None:
                return hit
            _require(compiler, "a C++ compiler with OpenMP (g++) is needed for device='cpu'")
        root = self.root = self.root or cache_dir()
        stems = [name if i == 0 else f"{name}.{u.name}" for i, u in enumerate(units)]
        futures: dict[int, concurrent.futures.Future] = {}
        for i, u in enumerate(units):
            if i > 0 and u.name in self.started:
                first, first_headers, future = self.started[u.name]
                if (first.source, first.flags, first_headers) != (u.source, u.flags, headers):
                    raise AssertionError(f"unit {u.name!r} was started with other contents than it finished with")
                futures[i] = future
        # largest first: the long compiles start at once and the short ones fill in around them
        for i in sorted((i for i in range(len(units)) if i not in futures), key=lambda i: -len(units[i].source)):
            futures[i] = self.pool.submit(self._one, units[i], stems[i], headers)
        concurrent.futures.wait(futures.values())
        for i in range(len(units)):
            if futures[i].exception() is not None:
                raise futures[i].exception()
        objects = tuple(futures[i].result() for i in range(len(units)))

        manifest = json.dumps({"objects": [o.key for o in objects]}, indent=1) + "\n"
        obj_paths = [str(o.path) for o in objects]
        link = _build("cpp", ".link", ".so", lambda s, o: [*compiler, *link_flags, *obj_paths, "-o", o], compiler,
                      link_flags, manifest, root, name, None)
        try:
            _atomic_write(root / "cpp" / "alias" / f"{_step_alias(compiler, units, headers, link_flags)}.json",
                          json.dumps({"key": link.key}) + "\n")
        except OSError:
            pass  # a read-only cache still serves its hits
        dump = self.dump
        if dump is not None:
            cmds = [shlex.join([*compiler, *u.flags, "-c", f"{s}.cpp", "-o", f"{s}.o"]) for u, s in zip(units, stems)]
            cmds.append(shlex.join([*compiler, *link_flags, *[f"{s}.o" for s in stems], "-o", f"{name}.so"]))
            _atomic_write(dump / f"{name}.cache_key", link.key + "\n")
            _atomic_write(dump / f"{name}.compile.sh", "#!/usr/bin/env bash\n"
                          f"# ember: rebuild {name}.so from its {len(units)} translation units (cache key {link.key}); "
                          f"ember runs the compiles {self.jobs} at a time\n"
                          'set -euo pipefail\ncd "$(dirname "$0")"\n' + "\n".join(cmds) + "\n", 0o755)
        return UnitsArtifact(link.path, link.key, objects, link, time.perf_counter() - self.t0, self.jobs)


def _units_without_compiler(compiler: Sequence[str], units: Sequence[Unit], headers: Mapping[str, str],
                            link_flags: tuple[str, ...], cache: Path | None) -> UnitsArtifact | None:
    t0 = time.perf_counter()
    try:
        root = cache or cache_dir()
        key = json.loads((root / "cpp" / "alias" / f"{_step_alias(compiler, units, headers, link_flags)}.json")
                         .read_text())["key"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    shard = root / "cpp" / str(key)[:2]
    out, meta = shard / f"{key}.so", shard / f"{key}.json"
    if _cached(out, meta) != "hit":
        return None
    count_cache("cpp", "hits")
    try:
        command = tuple(json.loads(meta.read_text())["command"])
    except (OSError, ValueError, KeyError, TypeError):
        command = ()
    link = CompiledArtifact(out, key, command, shard / f"{key}.link", True, time.perf_counter() - t0)
    return UnitsArtifact(out, key, (), link, time.perf_counter() - t0, 0)
