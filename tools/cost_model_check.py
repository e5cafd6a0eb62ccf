"""How far the cost model's pick is from the tuner's, kernel by kernel, over a tuning file's records
(a diagnostic, not a test): each record is left out in turn, the cost model decides the kernel
from the others (the family prior of its neighbours, then the family's first plan), and the pick's
measured time in that record is compared with the record's best.

    OMP_NUM_THREADS=16 python tools/cost_model_check.py codegen/tuning/cpu-x86-avx512-16t.json
    python tools/cost_model_check.py codegen/tuning/cpu-x86-avx512-2t.json --worst 20

Set OMP_NUM_THREADS to the file's thread count: the CPU families' plans depend on the team (the
tool refuses a file of another count). A pick the record never timed (a plan the tuner did not
measure) is listed as "untimed". Prints one line a kernel (worst first) and the geometric mean.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ember.codegen import cpp_choices, tuning_db


def _geometry(key: str) -> dict:
    g = json.loads(key)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}


def _matches(g: dict, held_out: dict | None) -> bool:
    return bool(held_out) and all(g.get(k) == v for k, v in held_out.items())


def check(path: Path, held_out: dict | None = None) -> list[tuple[float | None, str, str, str]]:
    data = json.loads(path.read_text())
    if data.get("target") != "cpu":
        raise SystemExit(f"{path}: only CPU tuning files are checked (target {data.get('target')!r})")
    device = data["device"]
    team = cpp_choices.threads()
    if not device.endswith(f"/{team}t"):
        raise SystemExit(f"{path} holds {device}'s records; this process plans for {team} threads: "
                         f"set OMP_NUM_THREADS to the file's count")
    records = tuning_db.TuningDB(None, (path.parent,)).records("cpu", device)
    geometries = {key: _geometry(key) for key in records}
    sample = {k: r for k, r in records.items() if not _matches(geometries[k], held_out)}
    rows = []
    for key, rec in records.items():
        g = geometries[key]
        fams, _ = cpp_choices.TABLE.ranked_from(g, {k: r for k, r in sample.items() if k != key})
        pick = next(((f.name, plans[0]) for f in fams if (plans := f.plans(g))), None)
        if pick is None:
            continue
        text = tuning_db.choice_text(pick)
        best = min(t for t in rec.timings_us.values() if math.isfinite(t) and t > 0)
        t = rec.timings_us.get(text)
        what = f"{g['kind']} C{g.get('C', g.get('K'))} O{g.get('O', g.get('N'))} {g.get('H', g.get('M'))}x" \
               f"{g.get('W', '')} s{g.get('stride', '')}"
        rows.append((t / best if t else None, what, text, tuning_db.choice_text(rec.choice)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--held-out", default="", metavar="JSON",
                    help='also leave out every record whose geometry has these values, e.g. \'{"stride": [2, 2]}\': '
                         'what the cost model picks for such kernels before any of them was tuned')
    ap.add_argument("--worst", type=int, default=0, help="print only this many kernels (worst first)")
    args = ap.parse_args()
    held = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.held_out).items()} \
        if args.held_out else None
    rows = check(args.file, held)
    rows.sort(key=lambda r: -(r[0] if r[0] is not None else math.inf))
    for ratio, what, pick, best in rows[:args.worst or None]:
        print(f"{'untimed' if ratio is None else f'{ratio:6.2f}x'}  {what:38s} model {pick:48s} tuned {best}")
    timed = [r[0] for r in rows if r[0] is not None]
    if timed:
        print(f"{len(rows)} kernels, {len(timed)} picks timed: geometric mean {math.exp(sum(map(math.log, timed)) / len(timed)):.2f}x "
              f"the tuned time, {sum(r > 2 for r in timed)} over 2x, worst {max(timed):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
