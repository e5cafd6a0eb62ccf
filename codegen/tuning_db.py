"""The tuning database: which (family, plan) measured fastest for a kernel, per device.

A record is keyed by what decides a kernel's speed and nothing else: the target ("cuda", "cpu"),
the device model (the GPU's name; the CPU's vector variant and thread count), and the kernel's
key (kind, sizes, stride/padding, epilogues, precision; `kernel_key`). It holds the winning
choice, the time of every candidate measured (so `ember kernels` and the docs can show the
margin), the candidates refused (their result differed beyond rounding) and the version of every
kernel family measured: a record whose families changed since is stale and ignored, so a new
template never runs with a plan measured for its predecessor.

Records live in JSON files, one per (target, device model):
- the user's, under `$EMBER_CACHE_DIR/tuning/`, written by `ember tune` / `compile(tune=True)`;
- the shipped ones, package data in `codegen/tuning/`, produced by `ember tune` on that device
  (`tools/ship_tuning.py` copies a user database there) so an untuned install keeps the speed
  the shipped models were tuned to.
A lookup reads the user's file first, then the shipped one. Writes replace the whole file
atomically (a temporary file renamed over it), so an interrupted tuner leaves the previous
database whole; every measured kernel is written as soon as it is measured, which makes a tuning
run resumable.

Which database a compile reads is the active one (`active()`): the default (user + shipped),
or one given with `using(db)` (tests use a fixed one; `using(None)` reads nothing, leaving every
choice to the cost model).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Record", "TuningDB", "kernel_key", "device_slug", "active", "using", "default_db", "SHIPPED_DIR"]

#: format of the files; a file of another format is ignored (and rewritten by the next tuning run)
SCHEMA = 1
SHIPPED_DIR = Path(__file__).parent / "tuning"

Choice = tuple[str, tuple[tuple[str, Any], ...]]


def kernel_key(geometry: Mapping[str, Any]) -> str:
    """The canonical text of a kernel's geometry (sorted keys, JSON values): the part of a record's
    key that names the kernel. Only plain values take part (numbers, strings, booleans, tuples)."""
    plain = {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(geometry.items())
             if isinstance(v, (int, float, str, bool, tuple)) or v is None}
    return json.dumps(plain, sort_keys=True, separators=(",", ":"))


def sizes_key(key: str) -> tuple[str, frozenset[str]]:
    """A kernel key without its epilogues, and its epilogues: kernels of one sizes key run the
    same main loop and differ in what they do before each store."""
    g = json.loads(key)
    epilogues = frozenset(g.pop("epilogues", ()) or ())
    return json.dumps(g, sort_keys=True, separators=(",", ":")), epilogues


def device_slug(target: str, device: str) -> str:
    """The file stem of a (target, device model) database: `cuda-nvidia-h200`."""
    return re.sub(r"[^a-z0-9]+", "-", f"{target}-{device}".lower()).strip("-")


def _plan_json(plan: tuple[tuple[str, Any], ...]) -> list:
    return [[k, list(v) if isinstance(v, tuple) else v] for k, v in plan]


def _plan_tuple(plan: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((str(k), tuple(v) if isinstance(v, list) else v) for k, v in plan)


def choice_text(choice: Choice) -> str:
    """One line naming a choice: `gemm(BM=64,BN=32,...)`."""
    family, plan = choice
    return family + (f"({','.join(f'{k}={v}' for k, v in plan)})" if plan else "")


@dataclass(frozen=True)
class Record:
    """What tuning found for one kernel on one device."""
    choice: Choice
    #: candidate (choice_text) -> median microseconds; the winner's is the smallest
    timings_us: dict[str, float]
    #: family name -> version, for every family measured
    versions: dict[str, int]
    #: candidate (choice_text) -> why it was refused
    rejected: dict[str, str] = field(default_factory=dict)
    #: seconds since the epoch when it was measured
    when: float = 0.0
    #: "shipped" or "user": where the lookup found it (not stored)
    source: str = "user"

    @property
    def time_us(self) -> float:
        return self.timings_us[choice_text(self.choice)]

    def summary(self) -> str:
        """`tuned: 12.3 us, best of 14 (next: 13.1 us)` for dumps and `ember kernels`."""
        others = sorted(t for c, t in self.timings_us.items() if c != choice_text(self.choice))
        text = f"tuned ({self.source}): {self.time_us:.2f} us, best of {len(self.timings_us)}"
        return text + (f" (next {others[0]:.2f} us)" if others else "")

    def to_json(self) -> dict:
        return dict(family=self.choice[0], plan=_plan_json(self.choice[1]), timings_us=self.timings_us,
                    versions=self.versions, rejected=self.rejected, when=self.when)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> "Record":
        return cls(choice=(str(data["family"]), _plan_tuple(data["plan"])),
                   timings_us={str(k): float(v) for k, v in data["timings_us"].items()},
                   versions={str(k): int(v) for k, v in data["versions"].items()},
                   rejected={str(k): str(v) for k, v in data.get("rejected", {}).items()},
                   when=float(data.get("when", 0.0)), source=source)


class TuningDB:
    """Records of one or more (target, device) files: a writable user folder (None: read only)
    and read-only folders after it (the shipped database)."""

    def __init__(self, user_dir: str | os.PathLike | None, shipped_dirs: tuple[str | os.PathLike, ...] = ()) -> None:
        self.user_dir = None if user_dir is None else Path(user_dir)
        self.shipped_dirs = tuple(Path(d) for d in shipped_dirs)
        # (folder, slug) -> (the file's (mtime, size) when read, its records): a file is read again
        # only when it changed (another process tuned), so a lookup per kernel costs a stat
        self._files: dict[tuple[Path, str], tuple[tuple[int, int] | None, dict[str, Record]]] = {}
        # id of a loaded records dict -> (that dict, its keys by `sizes_key`), built on first use
        self._by_sizes: dict[int, tuple[dict[str, Record], dict[str, list[tuple[frozenset[str], str]]]]] = {}

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _load(self, folder: Path, slug: str, source: str) -> dict[str, Record]:
        key = (folder, slug)
        path = folder / f"{slug}.json"
        stamp = self._stamp(path)
        held = self._files.get(key)
        if held is not None and held[0] == stamp:
            return held[1]
        records: dict[str, Record] = {}
        try:
            data = json.loads(path.read_text())
            if data.get("schema") == SCHEMA:
                records = {k: Record.from_json(v, source) for k, v in data["records"].items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # an unreadable or damaged database costs speed, never a compile: the cost model decides
            records = {}
        self._files[key] = (stamp, records)
        return records

    def lookup(self, target: str, device: str, key: str, versions: Mapping[str, int]) -> Record | None:
        """The record of this kernel, the user's before the shipped one; None when there is none
        or a family of `versions` (the families that apply to the kernel, as they are now) was
        measured at another version. Families a record lists that no longer apply (records once
        listed every family of the kernel's kind, the bfloat16 one in a float32 record) are not
        compared: their code never ran for this kernel."""
        slug = device_slug(target, device)
        folders = ([(self.user_dir, "user")] if self.user_dir is not None else []) + \
            [(d, "shipped") for d in self.shipped_dirs]
        for folder, source in folders:
            rec = self._load(folder, slug, source).get(key)
            if rec is not None and all(versions[f] == v for f, v in rec.versions.items() if f in versions):
                return rec
        return None

    def lookup_other_epilogues(self, target: str, device: str, key: str,
                               versions: Mapping[str, int]) -> tuple[Record, frozenset[str]] | None:
        """Where `lookup` finds no record of this kernel: the record of a kernel of the same sizes
        and precision with other epilogues (the user's before the shipped ones; of several, the
        one whose epilogues differ least, then by key), and those epilogues. Its plan was measured
        on the same main loop: better evidence than a prediction from other sizes."""
        wanted, epilogues = sizes_key(key)
        layers = self.layers(target, device)
        live = {id(records) for records in layers}  # a file read again (a tuner's store) drops its old index
        self._by_sizes = {i: held for i, held in self._by_sizes.items() if i in live}
        for records in layers:
            held = self._by_sizes.get(id(records))
            if held is None or held[0] is not records:
                index: dict[str, list[tuple[frozenset[str], str]]] = {}
                for k in sorted(records):
                    try:
                        sk, eps = sizes_key(k)
                    except (ValueError, AttributeError):  # a damaged key costs its record, never a compile
                        continue
                    index.setdefault(sk, []).append((eps, k))
                held = self._by_sizes[id(records)] = (records, index)
            siblings = sorted(held[1].get(wanted, ()), key=lambda ek: (len(ek[0] ^ epilogues), ek[1]))
            for eps, k in siblings:
                rec = records[k]
                if k != key and all(versions[f] == v for f, v in rec.versions.items() if f in versions):
                    return rec, eps
        return None

    def store(self, target: str, device: str, key: str, record: Record) -> None:
        """Adds (or replaces) a record in the user's file, written whole and atomically."""
        if self.user_dir is None:
            raise ValueError("this tuning database is read-only (it has no user folder)")
        from .compiler import _atomic_write  # the compile cache's writer: temporary file, then rename

        slug = device_slug(target, device)
        records = dict(self._load(self.user_dir, slug, "user"))
        records[key] = Record(**{**record.__dict__, "when": record.when or time.time(), "source": "user"})
        data = {"schema": SCHEMA, "target": target, "device": device,
                "records": {k: r.to_json() for k, r in sorted(records.items())}}
        path = self.user_dir / f"{slug}.json"
        _atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        self._files[(self.user_dir, slug)] = (self._stamp(path), records)

    def fingerprint(self, target: str, device: str) -> str:
        """A hash of the files a lookup for (target, device) reads: what a cached plan depends on."""
        import hashlib

        h = hashlib.sha256()
        slug = device_slug(target, device)
        for folder in ([self.user_dir] if self.user_dir is not None else []) + list(self.shipped_dirs):
            try:
                h.update((folder / f"{slug}.json").read_bytes())
            except OSError:
                h.update(b"-")
        return h.hexdigest()

    def layers(self, target: str, device: str) -> list[dict[str, Record]]:
        """The records for (target, device) as `lookup` reads them: the user's file, then each
        shipped one (a stale user record does not hide the shipped record of the same kernel)."""
        slug = device_slug(target, device)
        return ([self._load(self.user_dir, slug, "user")] if self.user_dir is not None else []) + \
            [self._load(d, slug, "shipped") for d in self.shipped_dirs]

    def records(self, target: str, device: str) -> dict[str, Record]:
        """Every record for (target, device), shipped ones overridden by the user's."""
        slug = device_slug(target, device)
        out: dict[str, Record] = {}
        for d in reversed(self.shipped_dirs):
            out.update(self._load(d, slug, "shipped"))
        if self.user_dir is not None:
            out.update(self._load(self.user_dir, slug, "user"))
        return out


_DEFAULTS: dict[Path, TuningDB] = {}


def default_db() -> TuningDB:
    """The user's database under the compile cache (`$EMBER_CACHE_DIR/tuning`), then the shipped one:
    one object per cache folder, so its files are parsed once, not once per kernel chosen."""
    from .compiler import cache_dir

    folder = cache_dir() / "tuning"
    if folder not in _DEFAULTS:
        _DEFAULTS[folder] = TuningDB(folder, (SHIPPED_DIR,))
    return _DEFAULTS[folder]


_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("ember_tuning_db", default=...)


def active() -> TuningDB | None:
    """The database kernel selection reads now (None: none, the cost model decides)."""
    db = _ACTIVE.get()
    return default_db() if db is ... else db


@contextlib.contextmanager
def using(db: TuningDB | None) -> Iterator[None]:
    """Within the block, kernel selection reads `db` (None: no database)."""
    token = _ACTIVE.set(db)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
