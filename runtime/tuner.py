"""The autotuner: measures every candidate (family, plan) of every kernel of a step on the device at
hand and stores the fastest in the tuning database, where `select` finds it from then on.

For each fused kernel with more than one candidate (`ChoiceTable.candidates`) whose key the
database does not hold yet: the target's measurer (`runtime/tuner_cuda.py` for GPUs) builds every
candidate, runs it on the same random inputs, and times it. The cost model's choice is the
reference: a candidate whose result differs from it by more than rounding (relative to the
result's magnitude, `TOLERANCE` per precision) or is not finite is refused and recorded as such;
the fastest of the rest wins. Each kernel's record is written as soon as it is measured, so a
run stopped by its budget or by the user resumes where it stopped; kernels with the same key
(the same convolution twice, or shared by another model) are measured once. A record that lacks a
family serving its kernel now (added since) is measured again for that family alone, beside the
reference and the record's winner (measured again, in the same run, so that the comparison is
fair), and the record keeps its other timings, scaled by how the winner's moved between the runs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ember.codegen import tuning_db
from ember.codegen.choices import Choice, ChoiceTable
from ember.codegen.tuning_db import Record, choice_text
from ember.ir import Graph, KernelSpec

__all__ = ["Trial", "Measurer", "KernelReport", "TuneReport", "tune_graph", "kernels_of", "TOLERANCE", "DEFAULT_BUDGET_S"]

#: largest difference from the reference candidate's result, relative to its largest magnitude,
#: that counts as rounding: float32 sums in another order differ by ~1e-6 (1e-4 leaves room for
#: long split-K sums); TF32 operands are rounded to 10 mantissa bits (~5e-4 a product). A wrong
#: index or a missed tile differs by O(1).
TOLERANCE = {"float32": 1e-4, "tf32": 1e-2,
             # a bfloat16 result may differ by one bfloat16 step (2^-8 to 2^-7 of a value) where a
             # float32 sum in another order lies next to a rounding boundary
             "bf16": 1e-2}
DEFAULT_BUDGET_S = 300.0


@dataclass
class Trial:
    """One candidate's measurement: its median time, or why it could not run; its result (host array)."""
    choice: Choice
    time_us: float | None = None
    output: np.ndarray | tuple[np.ndarray, ...] | None = None  # a tuple: a kernel of several outputs
    error: str | None = None


class Measurer(Protocol):
    def measure(self, sub: Graph, spec: KernelSpec, choices: Sequence[Choice], *, seed: int) -> list[Trial]: ...


@dataclass
class KernelReport:
    name: str
    kind: str
    key: str
    #: "measured", "reused" (the database held it), "single" (one candidate), "budget" (not reached),
    #: "skipped" (no family a narrowed run asked for serves it)
    status: str
    choice: Choice | None = None
    time_us: float | None = None
    default: Choice | None = None
    default_us: float | None = None
    candidates: int = 0
    rejected: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        if self.status in ("single", "budget", "skipped"):
            return f"{self.name:28s} {self.kind:20s} {self.status}"
        gain = (f"  x{self.default_us / self.time_us:.2f} vs cost model {self.default_us:.2f} us"
                if self.default_us and self.time_us and self.default != self.choice else "")
        refused = f"  ({len(self.rejected)} refused)" if self.rejected else ""
        return (f"{self.name:28s} {self.kind:20s} {self.status:8s} {choice_text(self.choice)}  "
                f"{self.time_us:.2f} us of {self.candidates}{gain}{refused}")


@dataclass
class TuneReport:
    kernels: list[KernelReport]
    seconds: float
    budget_s: float

    @property
    def measured(self) -> int:
        return sum(k.status == "measured" for k in self.kernels)

    @property
    def reused(self) -> int:
        return sum(k.status == "reused" for k in self.kernels)

    @property
    def out_of_budget(self) -> int:
        return sum(k.status == "budget" for k in self.kernels)

    def summary(self) -> str:
        return (f"{len(self.kernels)} kernels: {self.measured} measured, {self.reused} from the database, "
                f"{self.out_of_budget} left for lack of budget, in {self.seconds:.1f} s")


def kernels_of(graph: Graph) -> list[tuple[Graph, KernelSpec]]:
    """The (subgraph, spec) of every fused kernel of a graph, in schedule order."""
    return [(graph.attrs(n)["graph"], graph.attrs(n)["kernel"]) for n in graph.meta["schedule"]
            if graph.op(n) == "fused"]


def trial_output(values: list[np.ndarray]) -> np.ndarray | tuple[np.ndarray, ...]:
    """A candidate's result as `Trial.output` holds it: the one output's values, or a tuple of
    them in the kernel's output order (out, out1, ...)."""
    return values[0] if len(values) == 1 else tuple(values)


def _close(out: np.ndarray | tuple[np.ndarray, ...], ref: np.ndarray | tuple[np.ndarray, ...],
           tolerance: float) -> str | None:
    """None when `out` matches `ref` up to rounding, else why not (a kernel of several outputs:
    each against its own magnitude)."""
    if isinstance(ref, tuple) or isinstance(out, tuple):
        if not (isinstance(ref, tuple) and isinstance(out, tuple)) or len(out) != len(ref):
            return "not the reference's outputs"
        whys = [(i, _close(o, r, tolerance)) for i, (o, r) in enumerate(zip(out, ref))]
        return next((f"output {i}: {why}" for i, why in whys if why is not None), None)
    if out.shape != ref.shape:
        return f"shape {out.shape}, expected {ref.shape}"
    # Every value finite (the common case): a few passes and one temporary, no masked copies. A
    # non-finite value in either makes the difference or the scale non-finite and falls through to
    # the masked check (a convolution's output at batch 1024 is 51M values: that check takes 0.8 s
    # of this 2-core Xeon a candidate). The float32 difference's rounding is 2^-24 of it.
    floats = np.issubdtype(out.dtype, np.floating) and np.issubdtype(ref.dtype, np.floating) and out.size
    if floats:
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.subtract(out, ref)
            np.abs(diff, out=diff)
            err, scale = float(np.max(diff)), float(np.maximum(np.max(ref), -np.min(ref)))
    if floats and math.isfinite(err) and math.isfinite(scale):
        err /= scale or 1.0
        return None if err <= tolerance else f"differs from the reference by {err:.1e} of its magnitude (> {tolerance:g})"
    if not np.all(np.isfinite(out) == np.isfinite(ref)):
        return "non-finite values where the reference's are finite, or finite where its are not"
    finite = np.isfinite(ref)
    scale = float(np.max(np.abs(ref[finite]), initial=0.0)) or 1.0
    err = float(np.max(np.abs(out[finite].astype(np.float64) - ref[finite]), initial=0.0)) / scale
    return None if err <= tolerance else f"differs from the reference by {err:.1e} of its magnitude (> {tolerance:g})"


def _unmeasured_families(record: tuning_db.Record, candidates: Sequence[Choice]) -> set[str]:
    """The families among a kernel's candidates now that its record never measured (a family
    added since, or one that serves the kernel since): the record is then measured again, without
    `retune`, so a new family is compared where the database had settled a kernel without it."""
    return {family for family, _ in candidates} - set(record.versions)


def tune_graph(graph: Graph, *, table: ChoiceTable, measurer: Measurer | Callable[[], Measurer],
               db: tuning_db.TuningDB | None = None, budget_s: float = DEFAULT_BUDGET_S, retune: bool = False,
               progress: Callable[[KernelReport, int, int], None] | None = None, seed: int = 0,
               families: Collection[str] | None = None) -> TuneReport:
    """Measures the kernels of a selected graph (`select` ran) whose keys `db` (default: the active
    database) does not hold, or holds from a measurement that lacks a family now serving the
    kernel, storing each winner as it is found. `retune` measures every held key again.
    `budget_s` bounds the wall time: a kernel is started only while time is left. `progress(report,
    done, total)` is called after each kernel with more than one candidate.

    `families` narrows the search to those families' candidates, beside the cost model's first
    (the reference) and the kernel's stamped choice: a new family compared with what a step runs
    now in a fraction of the time of every candidate. Kernels no family of them serves are left
    alone ("skipped"). The record lists the versions of the families measured only, so a later
    run without `families` measures the others (`_unmeasured_families`)."""
    db = tuning_db.active() if db is None else db
    if db is None or db.user_dir is None:
        raise ValueError("tuning needs a writable tuning database (a user folder); got none")
    precision = graph.meta.get("precision", "float32")
    device = table.device()
    t0 = time.perf_counter()
    reports: list[KernelReport] = []
    seen: dict[str, KernelReport] = {}
    # a measurer, or a factory (a class) made only once something is measured (it may start a GPU)
    instrument: Measurer | None = None if isinstance(measurer, type) or not hasattr(measurer, "measure") else measurer
    if families is not None and (unknown := set(families) - set(table.families)):
        raise ValueError(f"no kernel family {', '.join(sorted(unknown))} on target {table.target!r} "
                         f"(its families: {', '.join(table.families)})")
    work = []
    for sub, spec in kernels_of(graph):
        if spec.kind in table.no_kernel:
            continue
        cands = table.candidates(sub, spec)
        if len(cands) > 1:
            work.append((sub, spec, cands))
    for done, (sub, spec, cands) in enumerate(work, 1):
        key = table.key(sub, spec)
        versions = table.versions(sub, spec)
        rec = None if retune else db.lookup(table.target, device, key, versions)
        if rec is not None and not table.fits(sub, spec, rec.choice):
            rec = None  # its winner no longer fits: every candidate again
        subset = None  # the candidates `families` asks for, beside the reference and the stamped choice
        if families is not None:
            own = table.own_choice(spec.choice) if spec.choice is not None else None
            subset = [c for i, c in enumerate(cands) if i == 0 or c[0] in families or c == own]
        if key in seen and seen[key].status not in ("budget", "skipped"):  # the same kernel again: its record serves both
            rep = dataclasses.replace(seen[key], name=sub.name, status="reused")
        elif rec is not None and not _unmeasured_families(rec, subset or cands):
            rep = KernelReport(sub.name, spec.kind, key, "reused", rec.choice, rec.time_us, candidates=len(rec.timings_us))
        elif subset is not None and not any(f in families for f, _ in subset):
            rep = KernelReport(sub.name, spec.kind, key, "skipped", candidates=len(cands))
        elif time.perf_counter() - t0 >= budget_s:
            rep = KernelReport(sub.name, spec.kind, key, "budget", candidates=len(cands))
        else:
            if instrument is None:
                instrument = measurer()  # type: ignore[operator]
            rep = _measure_one(sub, spec, cands, key, versions, instrument, db, table, device,
                               TOLERANCE.get(precision, TOLERANCE["float32"]), seed, rec, subset)
        seen.setdefault(key, rep)
        reports.append(rep)
        if progress is not None:
            progress(rep, done, len(work))
    return TuneReport(reports, time.perf_counter() - t0, budget_s)


def _measure_one(sub: Graph, spec: KernelSpec, cands: list[Choice], key: str, versions: dict[str, int],
                 measurer: Measurer, db: tuning_db.TuningDB, table: ChoiceTable, device: str, tolerance: float,
                 seed: int, earlier: tuning_db.Record | None = None, subset: list[Choice] | None = None) -> KernelReport:
    """Measures the candidates (`subset` of them where given: its first is the reference; those of
    the families `earlier` lacks, with the reference and its winner, where a record of the kernel
    lacks some) and stores the record, which lists the versions of the families measured, now or
    in `earlier`."""
    measured = subset or cands
    if earlier is not None:
        new = _unmeasured_families(earlier, measured)
        measured = [c for i, c in enumerate(measured) if i == 0 or c[0] in new or c == earlier.choice]
        if earlier.choice not in measured:
            measured.append(earlier.choice)
    if subset is not None:
        kept = {f for f, _ in measured} | (set(earlier.versions) if earlier is not None else set())
        versions = {f: v for f, v in versions.items() if f in kept}
    trials = measurer.measure(sub, spec, measured, seed=seed)
    by_choice = {t.choice: t for t in trials}
    reference = by_choice.get(cands[0])
    rejected: dict[str, str] = {}
    timings: dict[str, float] = {}
    for t in trials:
        why = t.error
        if why is None and t.time_us is None:
            why = "not timed"
        if why is None and reference is not None and reference.output is not None and t is not reference:
            why = _close(t.output, reference.output, tolerance) if t.output is not None else "no result"
        if why is None:
            timings[choice_text(t.choice)] = round(float(t.time_us), 3)
        else:
            rejected[choice_text(t.choice)] = why
    if not timings:
        raise RuntimeError(f"tuning {sub.name} ({spec.describe()}): no candidate ran: "
                           + "; ".join(f"{c}: {w}" for c, w in list(rejected.items())[:3]))
    best = min((t for t in trials if choice_text(t.choice) in timings), key=lambda t: t.time_us)
    stored_timings, stored_rejected = timings, rejected
    if earlier is not None:
        stored_timings, stored_rejected = _with_earlier(earlier, timings, rejected, cands)
    db.store(table.target, device, key, Record(best.choice, stored_timings, versions, stored_rejected))
    default_us = timings.get(choice_text(cands[0]))
    return KernelReport(sub.name, spec.kind, key, "measured", best.choice, timings[choice_text(best.choice)],
                        cands[0], default_us, len(trials), rejected)


def _with_earlier(earlier: tuning_db.Record, timings: dict[str, float], rejected: dict[str, str],
                  cands: list[Choice]) -> tuple[dict[str, float], dict[str, str]]:
    """This run's timings and refusals with the earlier record's for the candidates not measured
    again (those still among `cands`). The earlier timings are scaled by how the earlier winner,
    measured in both runs, moved between them (the GPU's clocks, another process), so that they
    compare with this run's and the winner's stays the smallest; where the earlier winner has no
    time this run, they are left out."""
    not_again = {choice_text(c) for c in cands} - set(timings) - set(rejected)
    kept = {c: w for c, w in earlier.rejected.items() if c in not_again}
    again = timings.get(choice_text(earlier.choice))
    if again is None or not earlier.time_us:
        return timings, {**kept, **rejected}
    drift = again / earlier.time_us
    old = {c: round(t * drift, 3) for c, t in earlier.timings_us.items() if c in not_again}
    return {**old, **timings}, {**kept, **rejected}

