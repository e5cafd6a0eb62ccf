"""The tuner's CPU measurer: every candidate of one kernel built, run and timed on this CPU, at the
thread count the step runs with.

The candidates of a kernel are rendered (`cpp_choices.render_kernel`, each under its own name, so
candidates whose code is the same are one function) and compiled as one library through the
compile cache (`compiler.compile_units`: one object a kernel, in parallel), with a small entry,
`ember_tune_run(which, buffers, reps)`, that calls candidate `which` `reps` times on the given
buffers and returns the seconds it took (`omp_get_wtime`), so short kernels are timed without
Python between the calls. A library that fails to build is built again one candidate at a time,
so a candidate that does not compile is refused alone.

Every candidate runs once on the same random inputs (its result goes back for the check against
the reference), then `ROUNDS` rounds time each candidate in turn (`reps` calls, about
`TARGET_S` of work), interleaved so that a noisy neighbour slows them all alike; the median per
call is its time. The OpenMP team is set to the step's (`cpp_choices.threads()`) while measuring.
"""
from __future__ import annotations

import ctypes
import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.codegen import cpp, cpp_choices, cpp_units, cpu_vector
from ember.codegen.choices import Choice
from ember.codegen.compiler import CompileError, compile_units
from ember.codegen.tuning_db import choice_text
from ember.ir import Graph, KernelSpec
from ember.ir.dtypes import as_array, as_values

from .tuner import Trial, trial_output

__all__ = ["CpuMeasurer", "ROUNDS", "TARGET_S"]

ROUNDS = 5
#: work per candidate per round: enough calls to take this long (at most MAX_REPS)
TARGET_S = 0.01
MAX_REPS = 10_000


def _random(rng: np.random.Generator, t: Any) -> np.ndarray:
    """Standard normal floats as `t`'s dtype holds them (bfloat16: their bits), zeros otherwise."""
    shape = tuple(t.shape)
    if t.dtype.is_float:
        return as_array(rng.standard_normal(shape).astype(np.float32 if t.dtype.itemsize < 8 else np.float64),
                        t.dtype)
    return np.zeros(shape, dtype=t.dtype.numpy)


def _poisoned(t: Any) -> np.ndarray:
    """An output buffer of NaNs (as `t`'s dtype holds them): a kernel must write every element."""
    return as_array(np.full(tuple(t.shape), np.nan, dtype=np.float32), t.dtype)


def _aligned(nbytes: int, fill: float = np.nan) -> np.ndarray:
    """A 64-byte aligned float32 block (NaN: a kernel must not read scratch it did not write)."""
    raw = np.full(nbytes // 4 + 32, fill, dtype=np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + max(nbytes // 4, 16)]


@dataclasses.dataclass
class _Candidate:
    choice: Choice
    function: cpp_units.KernelFunction
    args: list[str]       # C expressions of its call's arguments (buffer locals, nullptr)
    lib: Any = None
    which: int = -1


class CpuMeasurer:
    """Measures candidates on this CPU with `threads` OpenMP threads (default: the step's), for the
    vector variant `isa` (default: the step's); `rounds` of timing, each about `target_s` a candidate.
    `cpu_time`: each round timed by the CPU time this process used (all its threads) divided by
    `threads` instead of the wall clock, for machines shared with other work (with OpenMP's waiting
    threads asleep, OMP_WAIT_POLICY=passive, it is what the kernel takes on idle cores)."""

    def __init__(self, threads: int | None = None, isa: cpu_vector.VectorISA | None = None, *,
                 rounds: int = ROUNDS, target_s: float = TARGET_S, cpu_time: bool = False) -> None:
        if rounds < 1:
            raise ValueError(f"rounds={rounds}: expected at least one round of timing")
        self.isa = isa or cpu_vector.resolve()
        self.threads = threads or cpp_choices.threads()
        self.rounds, self.target_s, self.cpu_time = rounds, target_s, cpu_time
        self.flags = cpu_vector.cxx_flags(self.isa)
        self._gomp = ctypes.CDLL("libgomp.so.1")

    @staticmethod
    def inputs(sub: Graph, seed: int = 0) -> dict[str, np.ndarray]:
        """The random inputs `measure` runs a kernel's candidates on (standard normal floats)."""
        rng = np.random.default_rng(seed)
        return {name: _random(rng, sub.type(n)) for name, n in sub.inputs.items()}

    def measure(self, sub: Graph, spec: KernelSpec, choices: Sequence[Choice], *, seed: int = 0) -> list[Trial]:
        inputs = self.inputs(sub, seed)
        outs = {name: sub.type(n) for name, n in sub.outputs.items()}  # "out", then "out1"... (multi-output)
        out_t = outs["out"]
        roles = {role: f"in{i}" for role, i in spec.roles}
        trials: dict[int, Trial] = {}
        cands: dict[int, _Candidate] = {}
        scratch_bytes = 64
        for i, choice in enumerate(choices):
            try:
                c_spec = dataclasses.replace(spec, choice=choice,
                                             scratch_bytes=cpp_choices.scratch_bytes(sub, spec, choice))
                ks, order = cpp_choices.render_kernel(f"t{i}_{sub.name}", sub, c_spec, self.isa)
            except Exception as exc:  # a plan its template refuses: that candidate is out, the rest go on
                trials[i] = Trial(choice, error=f"render: {str(exc).splitlines()[0][:200]}")
                continue
            scratch_bytes = max(scratch_bytes, ks.scratch_bytes)
            fname, code, declaration = cpp_units.name_by_content(ks.code, ks.name)
            args = ["nullptr" if r is None else roles.get(r, r) for r in order] + [str(e) for e in ks.extents]
            fn = cpp_units.KernelFunction(fname, spec.kind, code, declaration)
            fn.calls.append(cpp.KernelCode(i, f"{ks.name} {choice_text(choice)}", c_spec.describe(), str(out_t), [],
                                           code, "", -1, fname))
            cands[i] = _Candidate(choice, fn, args)
        self._build(sub, list(cands.values()), inputs, outs, trials, cands)
        buffers = {**inputs, **{name: _poisoned(t) for name, t in outs.items()}, "scratch": _aligned(scratch_bytes)}
        names = [*inputs, *outs, "scratch"]
        ptrs = (ctypes.c_void_p * len(names))(*[buffers[n].ctypes.data for n in names])
        before = int(self._gomp.omp_get_max_threads())
        self._gomp.omp_set_num_threads(self.threads)
        try:
            trials.update(self._time(cands, buffers, ptrs, outs))
        finally:
            self._gomp.omp_set_num_threads(before)
        return [trials[i] for i in range(len(choices))]

    # -- building

    def _library(self, sub: Graph, cands: list[_Candidate], inputs: dict[str, np.ndarray], outs: dict[str, Any]) -> Any:
        """Compiles the candidates with the timing entry; returns the loaded library."""
        ctype = cpp.SPELLING.ctype
        locals_ = [f"{ctype(sub.type(n).dtype)}* const {name} = static_cast<{ctype(sub.type(n).dtype)}*>(buf[{i}]);"
                   for i, (name, n) in enumerate(sub.inputs.items())]
        locals_ += [f"{ctype(t.dtype)}* const {name} = static_cast<{ctype(t.dtype)}*>(buf[{len(inputs) + k}]);"
                    for k, (name, t) in enumerate(outs.items())]
        locals_ += [f"float* const scratch = static_cast<float*>(buf[{len(inputs) + len(outs)}]);"]
        functions = list({c.function.name: c.function for c in cands}.values())
        narrow = cpp.has_narrow(sub)  # bfloat16 values: the prelude's helpers, and maybe -mavx512bf16
        header, header_text = cpp_units.prelude(bf16=narrow)
        cases = [f"  case {k}: for (int64_t r = 0; r < reps; ++r) {c.function.name}({', '.join(c.args)}); break;"
                 for k, c in enumerate(cands)]
        entry = "\n".join([
            cpp_units.entry_preamble(header, functions), "", 'extern "C" {',
            "double ember_tune_run(int64_t which, void* const* buf, int64_t reps) {",
            *(f"  {line}" for line in locals_),
            "  (void)scratch; " + " ".join(f"(void){name};" for name in outs),
            "  const double t0 = omp_get_wtime();", "  switch (which) {", *cases, "  default: return -1.0;", "  }",
            "  return omp_get_wtime() - t0;", "}", "}", ""])
        flags = self.flags + (cpu_vector.bf16_flags(self.isa, {cpu_vector.bf16_dot(self.isa)}) if narrow else ())
        units = cpp_units.step_units(entry, functions, header, flags, cheap_flags=cpu_vector.auto_vector_flags(self.isa))
        art = compile_units(units, link_flags=cpp_units.LINK_FLAGS, name=f"tune_{sub.name}",
                            headers={header: header_text})
        lib = ctypes.CDLL(str(art.path))
        lib.ember_tune_run.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.ember_tune_run.restype = ctypes.c_double
        for k, c in enumerate(cands):
            c.lib, c.which = lib, k
        return lib

    def _build(self, sub: Graph, cands: list[_Candidate], inputs: dict[str, np.ndarray], outs: dict[str, Any],
               trials: dict[int, Trial], by_index: dict[int, _Candidate]) -> None:
        if not cands:
            return
        try:
            self._library(sub, cands, inputs, outs)
            return
        except CompileError:
            pass  # one at a time: the failing candidates are refused alone
        for i, c in list(by_index.items()):
            try:
                self._library(sub, [c], inputs, outs)
            except CompileError as exc:
                trials[i] = Trial(c.choice, error=f"compile: {str(exc).splitlines()[0][:200]}")
                del by_index[i]

    # -- running

    def _run(self, c: _Candidate, ptrs: Any, reps: int) -> float:
        """Seconds `reps` calls of candidate `c` took (wall clock, or CPU time / threads)."""
        if not self.cpu_time:
            return c.lib.ember_tune_run(c.which, ptrs, reps)
        t0 = time.process_time()
        c.lib.ember_tune_run(c.which, ptrs, reps)
        return (time.process_time() - t0) / self.threads

    def _time(self, cands: dict[int, _Candidate], buffers: dict[str, np.ndarray], ptrs: Any,
              outs: dict[str, Any]) -> dict[int, Trial]:
        results: dict[int, np.ndarray | tuple[np.ndarray, ...]] = {}
        reps: dict[int, int] = {}
        for i, c in cands.items():
            for name, t in outs.items():
                buffers[name][...] = _poisoned(t)
            c.lib.ember_tune_run(c.which, ptrs, 1)
            results[i] = trial_output([np.array(as_values(buffers[name], t.dtype), copy=True)  # the check's values
                                       for name, t in outs.items()])
            once = max(self._run(c, ptrs, 1), 1e-7)
            reps[i] = int(min(MAX_REPS, max(1, self.target_s / once)))
        times: dict[int, list[float]] = {i: [] for i in cands}
        for _ in range(self.rounds):
            for i, c in cands.items():
                times[i].append(self._run(c, ptrs, reps[i]) / reps[i])
        return {i: Trial(c.choice, statistics.median(times[i]) * 1e6, results[i]) for i, c in cands.items()}
