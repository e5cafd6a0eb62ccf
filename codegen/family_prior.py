"""The cost model's prior between kernel families, learned from the tuning database's measurements.

Where several families serve a kernel nobody tuned, which is faster depends on its shape in ways
no single size threshold captures (the direct convolution beats the implicit GEMM at a wide
window and many positions; a skinny matmul beats it when the operands are big and one side is
narrow). Every tuning record holds the time of every candidate it measured, so the records are
a sample of which family wins where. The prior ranks a kernel's families by what the nearest
measured kernels of the same kind and precision say:

- each kernel is placed by its table's `features` (the log2 of its sizes: a factor of two in
  one size is a distance of 1);
- the `NEIGHBOURS` nearest records that measured at least two of this kernel's families are
  consulted, each weighted by 4^-distance (an exact match outweighs a record at twice one size
  four to one);
- a family's score is the weighted mean of log2(its best time / the best time of this kernel's
  families in that record): 0 where it won, 1 where it took twice as long; where the plan the
  cost model would run names a `mode` (a CPU convolution's flat or generic loops), only the
  family's plans of that mode count (the direct family's best is its flat mode at stride 1, but
  a stride-2 kernel gets its generic loops: scored by the family's best, they ranked first and
  ran 6-19x slower than the tuned pick at 16 threads);
- families with a score rank first, lowest score first, except that a family whose neighbours
  weigh less than `WEAK` of the best-measured family's (only far records timed it) ranks after
  the well-measured ones; those no neighbour measured keep the table's structural order after
  them.

The records are the active database's for this device (the user's, then the shipped ones); for
a device with none, every shipped record of the target (another GPU's relative speeds beat none).
`predict_for` also weighs the shipped records of the target's other devices (another GPU, another
thread count) among the device's own, each as if `ELSEWHERE` farther than its sizes put it: a
record of the same kernel on another GPU outranks the device's own records of shapes 2x or more
away in one size. A device tuned on other models only had nothing but far records for a new
model's kernels, and they chose worse than another device's records of those very kernels
(docs/benchmarks.md, session 30: the H100's float32 CNN at batch 1024). Dumps count the
consulted records of other devices.
A family's timings in a record whose version of it is not the family's version now are stale and
left out, as the exact lookup (`tuning_db.lookup`) leaves the whole record out.
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import tuning_db

#: records consulted per kernel: enough to average out one noisy measurement, few enough that
#: far-away shapes do not outvote the near ones
NEIGHBOURS = 3
#: how much farther a record of another device counts than one of the device's own of the same
#: sizes (the distance of a factor of two in one size): near enough that another GPU's record of
#: the very kernel wins over the device's own records of other models, far enough that the
#: device's own of the same shape wins over it
ELSEWHERE = 1.0
#: a family whose neighbours' weight is less than this share of the best-measured family's ranks
#: after the others: a factor of two in two sizes farther (4^-2)
WEAK = 1 / 16

Features = Callable[[Mapping[str, Any]], tuple[float, ...]]


@dataclass(frozen=True)
class Prior:
    #: family -> weighted mean log2(time / best time) over the neighbours that measured it
    scores: dict[str, float]
    #: how many records were consulted and the nearest one's distance
    neighbours: int
    nearest: float
    #: how many of the consulted records were measured on other devices (shipped records of the target)
    elsewhere: int = 0
    #: family -> the mode its scores were restricted to (the mode of the plan it would run)
    modes: tuple[tuple[str, str], ...] = ()
    #: family -> the summed weight of the neighbours that measured it (how much evidence its score has)
    weights: dict[str, float] = field(default_factory=dict)

    def order_key(self, family: str) -> tuple[bool, float, float]:
        """Lowest score first among the families the near records measured; a family whose
        evidence weighs less than `WEAK` of the best-measured family's (only far records timed
        it) after them: its score rests on kernels of other shapes (session 34: `gemm_x3`, timed
        only in an H100 record of airbench's matmul 6 doublings away, won it and outranked
        `skinny_short`, which had won the H200's own record of the CNN's kernel by the same
        score to 2.6e-5). Of equal scores, the better-measured family first."""
        weight = self.weights.get(family, 0.0)
        return weight < WEAK * max(self.weights.values(), default=0.0), self.scores[family], -weight

    def describe(self) -> str:
        """`prior of 3 tuned kernels (nearest 0.0): direct 1.00x, gemm 1.31x` for dumps."""
        ranked = sorted(self.scores.items(), key=lambda kv: self.order_key(kv[0]))
        modes = dict(self.modes)
        rel = ", ".join(f"{f}{f' (mode={modes[f]})' if f in modes else ''} {2 ** s:.2f}x" for f, s in ranked)
        where = (f", {'all' if self.elsewhere == self.neighbours else self.elsewhere} of them other devices' records"
                 if self.elsewhere else "")
        return (f"prior of {self.neighbours} tuned kernel{'s' * (self.neighbours != 1)} "
                f"(nearest {self.nearest:.1f}{where}): {rel}")


@functools.lru_cache(maxsize=4096)
def _geometry_of(key: str) -> dict[str, Any]:
    """A record's kernel geometry; {} (of no kind: compared with nothing) for a key that is none
    (a damaged database costs its records, never a compile)."""
    try:
        g = json.loads(key)
    except ValueError:
        return {}
    return g if isinstance(g, dict) else {}


def plan_mode(plan: Any) -> str | None:
    """The `mode` a plan names (a CPU convolution's loops: flat, generic, ...), else None."""
    return next((str(v) for k, v in plan if k == "mode"), None) if plan else None


def _text_mode(text: str) -> str | None:
    """The mode named in a timing's choice text, `conv_forward(mode=flat,VB=4,OB=4)`: flat."""
    at = text.find("(mode=")
    if at < 0:
        at = text.find(",mode=")
    if at < 0:
        return None
    rest = text[at + 6:]
    return rest[:min((i for i in (rest.find(","), rest.find(")")) if i >= 0), default=len(rest))]


def _family_times(record: tuning_db.Record, versions: Mapping[str, int],
                  modes: Mapping[str, str] | None = None) -> dict[str, float]:
    """The best time each family of `versions` reached in a record measured with that version
    (a family of `modes`: its best over the plans of that mode)."""
    best: dict[str, float] = {}
    for text, t in record.timings_us.items():
        family = text.split("(", 1)[0]
        if family in versions and record.versions.get(family) == versions[family] and math.isfinite(t) and t > 0:
            if modes and family in modes and _text_mode(text) != modes[family]:
                continue
            best[family] = min(t, best.get(family, math.inf))
    return best


def predict(records: Sample, g: Mapping[str, Any], families: Mapping[str, int],
            features: Features, modes: Mapping[str, str] | None = None) -> Prior | None:
    """The prior for a kernel of geometry `g` among `families` (the ones that serve it, with their
    versions now; `modes`: the mode of the plan a family would run, where it names one); None
    when no record of its kind measured two of them. A key may hold several records (`sample`):
    the first that compares two current families counts."""
    modes = _modes(families, modes)
    return _weigh([(d, times, False) for _, d, times in _near(records, g, families, features, modes)], modes)


def _modes(families: Mapping[str, int], modes: Mapping[str, str | None] | None) -> dict[str, str]:
    return {f: m for f, m in (modes or {}).items() if m is not None and f in families}


def _near(records: Sample, g: Mapping[str, Any], families: Mapping[str, int], features: Features,
          modes: Mapping[str, str]) -> list[tuple[str, float, dict[str, float]]]:
    """(key, distance, best time per family) of every record comparable with g."""
    here = features(g)
    return [(key, math.dist(here, there), times)
            for key, there, times in _comparable(records, g, families, features, modes) if len(there) == len(here)]


def _weigh(near: list[tuple[float, dict[str, float], bool]], modes: Mapping[str, str]) -> Prior | None:
    """The prior from the `NEIGHBOURS` nearest of (distance, times, measured elsewhere)."""
    if not near:
        return None
    near = sorted(near, key=lambda dte: dte[0])[:NEIGHBOURS]
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for distance, times, _ in near:
        w, best = 4.0 ** -distance, min(times.values())
        for f, t in times.items():
            sums[f] = sums.get(f, 0.0) + w * math.log2(t / best)
            weights[f] = weights.get(f, 0.0) + w
    return Prior({f: sums[f] / weights[f] for f in sums if weights[f] > 0}, len(near), near[0][0],
                 elsewhere=sum(e for _, _, e in near), modes=tuple(sorted(modes.items())),
                 weights=weights)


def _precision(g: Mapping[str, Any]) -> tuple[str, bool]:
    """What a kernel computes in: the families' relative speeds in bfloat16 or TF32 (tensor cores
    for some families, not for others) say nothing of float32's."""
    return str(g.get("dtype", "float32")), bool(g.get("tf32", False))


def predict_for(db: tuning_db.TuningDB | None, target: str, device: str, g: Mapping[str, Any],
                families: Mapping[str, int], features: Features,
                modes: Mapping[str, str] | None = None) -> Prior | None:
    """`predict` over the device's sample (`sample`) and the shipped records of the target's other
    devices, those `ELSEWHERE` farther (counted in `elsewhere`)."""
    modes = _modes(families, modes)
    own = sample(db, target, device)
    near = [(d, times, False) for _, d, times in _near(own, g, families, features, modes)]
    every = sample(None, target, device)
    if every is not own:  # (a device with no records of its own learns from every shipped one already)
        near += [(d + ELSEWHERE, times, True) for key, d, times in _near(every, g, families, features, modes)
                 if key not in own]
    return _weigh(near, modes)


def _comparable(records: Sample, g: Mapping[str, Any], families: Mapping[str, int],
                features: Features, modes: Mapping[str, str] | None = None
                ) -> list[tuple[str, tuple[float, ...], dict[str, float]]]:
    """(key, features, best time per family) of every record of g's kind and precision that compares
    two of `families`: what `predict` measures distances to. Computed once per sample, kind and
    precision where the sample is one `sample` keeps (a compile asks for every kernel of a kind
    alike)."""
    index = records.index if isinstance(records, _IndexedSample) else None
    key = (g["kind"], "groups" in g, _precision(g), tuple(sorted(families.items())),
           tuple(sorted((modes or {}).items())), features)
    if index is not None and key in index:
        return index[key]
    found = []
    for rkey, recs in records.items():
        other = _geometry_of(rkey)
        if other.get("kind") != g["kind"] or ("groups" in other) != ("groups" in g) or \
                _precision(other) != _precision(g):
            continue
        comparing = (t for rec in (recs if isinstance(recs, tuple) else (recs,))
                     if len(t := _family_times(rec, families, modes)) >= 2)
        times = next(comparing, None)
        if times is not None:
            found.append((rkey, features(other), times))
    if index is not None:
        index[key] = found
    return found


def shipped_records(target: str, shipped_dir: Path = tuning_db.SHIPPED_DIR) -> dict[str, tuning_db.Record]:
    """Every shipped record of a target, whatever its device (the fallback sample)."""
    db = tuning_db.TuningDB(None, (shipped_dir,))
    out: dict[str, tuning_db.Record] = {}
    for path in sorted(shipped_dir.glob(f"{tuning_db.device_slug(target, 'x').rsplit('-', 1)[0]}-*.json")):
        try:
            device = json.loads(path.read_text())["device"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for key, rec in db.records(target, device).items():
            out.setdefault(key, rec)
    return out


Sample = Mapping[str, "tuning_db.Record | tuple[tuning_db.Record, ...]"]


class _IndexedSample(dict):
    """A sample `sample` keeps between calls, with `_comparable`'s results per kind."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.index: dict[tuple, list] = {}


_SHIPPED: dict[str, _IndexedSample] = {}
#: (database, target, device) -> (the layers a sample was built from, the sample): a database
#: file's records are a new dict whenever it is read again or stored to (`TuningDB._load`,
#: `store`), so the same layer objects mean the same records
_LAYERED: dict[tuple[int, str, str], tuple[tuple, _IndexedSample]] = {}


def sample(db: tuning_db.TuningDB | None, target: str, device: str) -> Sample:
    """The records the prior learns from for (target, device): see the module's docstring. A
    kernel measured in several files keeps them all, in lookup order (the user's first): as the
    exact lookup skips a stale user record for the shipped one, `predict` takes the first of them
    whose current families compare."""
    layers = tuple(db.layers(target, device)) if db is not None else ()
    held = _LAYERED.get((id(db), target, device))
    if held is not None and len(held[0]) == len(layers) and all(a is b for a, b in zip(held[0], layers)):
        return held[1]
    layered: dict[str, tuple[tuning_db.Record, ...]] = {}
    for layer in layers:
        for key, rec in layer.items():
            layered[key] = layered.get(key, ()) + (rec,)
    if layered:
        kept = _IndexedSample(layered)
        if len(_LAYERED) >= 64:  # databases come and go (tests, a tuner's temporary ones)
            _LAYERED.clear()
        _LAYERED[(id(db), target, device)] = (layers, kept)
        return kept
    if target not in _SHIPPED:
        _SHIPPED[target] = _IndexedSample(shipped_records(target))
    return _SHIPPED[target]


def log2_sizes(*sizes: float) -> tuple[float, ...]:
    """Features from sizes: their log2 (a size below 1 counts as 1)."""
    return tuple(math.log2(max(1.0, float(s))) for s in sizes)


__all__ = ["NEIGHBOURS", "Prior", "predict", "predict_for", "sample", "shipped_records", "log2_sizes", "plan_mode"]
