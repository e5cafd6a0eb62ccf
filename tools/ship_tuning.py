"""Copy tuning records measured by `ember tune` into the database shipped with ember.

    python tools/ship_tuning.py DIR [--into codegen/tuning]

DIR is a tuning database folder (`ember tune --db DIR`, or `$EMBER_CACHE_DIR/tuning`). Every
record of every `<target>-<device>.json` there is merged into the shipped file of the same name
(a record of the same kernel is replaced), so an untuned install compiles the tuned models with
the measured kernels. Records are copied as `ember tune` wrote them, never edited by hand.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ember.codegen import tuning_db


def merge(source: Path, into: Path) -> list[tuple[str, int, int]]:
    """Merges every database file of `source` into `into`; returns (file, records added or
    replaced, records in the shipped file after)."""
    done = []
    for path in sorted(source.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("schema") != tuning_db.SCHEMA:
            raise SystemExit(f"{path}: tuning database schema {data.get('schema')!r}, expected {tuning_db.SCHEMA}")
        target = into / path.name
        shipped = json.loads(target.read_text()) if target.exists() else {
            "schema": tuning_db.SCHEMA, "target": data["target"], "device": data["device"], "records": {}}
        shipped["records"].update(data["records"])
        shipped["records"] = dict(sorted(shipped["records"].items()))
        into.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(shipped, indent=1, sort_keys=True) + "\n")
        done.append((path.name, len(data["records"]), len(shipped["records"])))
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--into", type=Path, default=tuning_db.SHIPPED_DIR)
    args = ap.parse_args()
    for name, added, total in merge(args.source, args.into):
        print(f"{name}: {added} records merged, {total} shipped")


if __name__ == "__main__":
    main()
