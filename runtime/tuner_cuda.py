"""The tuner's CUDA measurer: every candidate of one kernel built, run and timed on the GPU.

The candidates of a kernel are rendered under their own names (`t<i>_<kernel>`), compiled together
on the NVRTC thread pool (`cuda.compile_units`: one module each, so a candidate that fails to build
is refused alone), run once on the same random inputs (their results go back for the check
against the reference), then timed: `REPEATS` back-to-back launches captured in one CUDA graph,
replayed `ROUNDS` times, the median per launch taken. A graph keeps the host's launch cost out of
the time of kernels shorter than it, as the step's own graph does.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from ember.codegen import cuda as cuda_codegen
from ember.codegen import cuda_choices
from ember.codegen.choices import Choice
from ember.codegen.cuda_kernels import counter_words, scalar_args, scratch_offset
from ember.codegen.lowering import has_narrow
from ember.ir import Graph, KernelSpec
from ember.ir.dtypes import as_array, as_values

from . import cuda_modules
from .tuner import Trial, trial_output

__all__ = ["CudaMeasurer"]

ROUNDS = 5
#: launches per graph: enough for ~1 ms of work, within these bounds
MIN_REPEATS, MAX_REPEATS = 3, 200
TARGET_MS = 1.0


def _random(cp: Any, rng: np.random.Generator, t: Any) -> Any:
    """Standard normal floats as `t`'s dtype holds them (bfloat16: their bits), zeros otherwise."""
    shape = tuple(t.shape)
    if t.dtype.is_float:
        return cp.asarray(as_array(rng.standard_normal(shape).astype(np.float32 if t.dtype.itemsize < 8 else np.float64),
                                   t.dtype))
    return cp.zeros(shape, dtype=t.dtype.numpy)


class CudaMeasurer:
    """Measures candidates on the current GPU (CuPy)."""

    def __init__(self) -> None:
        from .cuda import _cupy, nvrtc_options
        self.cp = _cupy()
        self.options = nvrtc_options(self.cp)
        self.prelude = cuda_codegen.prelude()
        self.prelude_bf16 = cuda_codegen.prelude(bf16=True)  # for kernels with bfloat16 values

    def measure(self, sub: Graph, spec: KernelSpec, choices: Sequence[Choice], *, seed: int = 0) -> list[Trial]:
        from .cuda import compile_units
        cp = self.cp
        rng = np.random.default_rng(seed)
        # Every buffer is made and filled on the stream the candidates run on: that stream does
        # not wait for the legacy default stream, so a copy issued there (the NaN poison of the
        # output, 11 MB at batch 256) could still be landing over the first launch's results.
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            inputs = {name: _random(cp, rng, sub.type(n)) for name, n in sub.inputs.items()}
        out_types = {name: sub.type(n) for name, n in sub.outputs.items()}  # "out", then "out1"... (multi-output)
        built: list[tuple[Choice, Any, dict, int] | Trial] = []
        units = []
        for i, choice in enumerate(choices):
            c_spec = dataclasses.replace(spec, choice=choice, scratch_bytes=cuda_choices.scratch_bytes(sub, spec, choice))
            try:
                kernel, roles = cuda_codegen.render_contraction(f"t{i}_{sub.name}", sub, c_spec)
            except Exception as exc:  # a plan its template refuses: that candidate is out, the rest go on
                built.append(Trial(choice, error=f"render: {exc}"))
                continue
            units.append((kernel.code, tuple(dict.fromkeys(la.function for la in kernel.launches))))
            built.append((choice, kernel, roles, c_spec.scratch_bytes))
        functions: dict[str, Any] = {}
        prelude = self.prelude_bf16 if has_narrow(sub) else self.prelude
        try:
            functions.update(compile_units(cp, prelude, units, self.options))
        except Exception:  # one at a time, to refuse only the candidates that fail to build
            for code, names in units:
                try:
                    functions.update(compile_units(cp, prelude, [(code, names)], self.options))
                except Exception as exc:
                    functions.update({f: exc for f in names})
        trials = []
        for item in built:
            if isinstance(item, Trial):
                trials.append(item)
                continue
            choice, kernel, roles, scratch = item
            trials.append(self._run(choice, kernel, roles, scratch, inputs, out_types, functions, stream))
        return trials

    def _run(self, choice: Choice, kernel: Any, roles: dict, scratch_bytes: int, inputs: dict, out_types: dict,
             functions: dict, stream: Any) -> Trial:
        cp = self.cp
        failed = [functions[la.function] for la in kernel.launches if isinstance(functions.get(la.function), Exception)]
        if failed:
            return Trial(choice, error=f"compile: {str(failed[0]).splitlines()[0][:200]}")
        with stream:  # ordered before the launches (see measure)
            outs = {name: cp.asarray(as_array(np.full(tuple(t.shape), np.nan, np.float32), t.dtype))  # must be written
                    for name, t in out_types.items()}
            scratch = cp.zeros(max(scratch_bytes, 256), dtype=cp.uint8)
            counters = {r: cp.zeros(words, dtype=cp.uint32) for la in kernel.launches for r in la.args
                        if (words := counter_words(r)) is not None}  # each launch leaves them zero
        buffers = {**inputs, **counters, **outs}

        def buffer(role: str) -> Any:
            region = scratch_offset(role)
            return buffers[roles.get(role, role)] if region is None else scratch[region:]
        try:
            for la in kernel.launches:
                cuda_modules.allow_dynamic_shared(cp, functions[la.function], la.shared_bytes)
        except Exception as e:  # a driver that refuses the opt-in fails this candidate, not the run
            return Trial(choice, error=f"shared memory: {str(e).splitlines()[0][:200]}")
        calls = [(functions[la.function], la.grid, la.block, la.shared_bytes,
                  tuple(buffer(r) for r in la.args) + scalar_args(la.scalars)) for la in kernel.launches]

        def launch() -> None:
            for fn, grid, block, shared, args in calls:
                fn(grid, block, args, shared_mem=shared)

        try:
            with stream:
                launch()
                stream.synchronize()
                # values (bfloat16: from its bits)
                result = trial_output([as_values(cp.asnumpy(outs[name]), t.dtype) for name, t in out_types.items()])
                start, end = stream.record(), None
                launch()
                end = stream.record()
                end.synchronize()
                once_ms = max(cp.cuda.get_elapsed_time(start, end), 1e-3)
                repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, TARGET_MS / once_ms)))
                stream.begin_capture()
                try:
                    for _ in range(repeats):
                        launch()
                finally:
                    graph = stream.end_capture()
                graph.launch(stream)
                times = []
                for _ in range(ROUNDS):
                    start = stream.record()
                    graph.launch(stream)
                    end = stream.record()
                    end.synchronize()
                    times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / repeats)
        except Exception as exc:  # a launch the device refuses (too many resources): that candidate is out
            return Trial(choice, error=f"launch: {str(exc).splitlines()[0][:200]}")
        return Trial(choice, statistics.median(times), result)
