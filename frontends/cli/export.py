"""`ember export-metrics FILE.jsonl --swanlab [--project P] [--experiment-name E]`: replays a
metrics file (what `ember mnist --metrics-file` writes) into a SwanLab run.

The run's settings (its first ``run`` record) become the experiment config; every step and
epoch record becomes scalars at its global step (`trackers.scalars`, the same tags as
`--tensorboard`). Needs the official client, `pip install 'ember[swanlab]'`. The API key is
read from the environment variable SWANLAB_API_KEY only, handed to `swanlab.login(save=False)`
and never written anywhere (not to the config, the metrics or a key file). `--mode offline`
(or `local`) records the run under `--log-dir` without a key, for `swanlab sync` later.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..training.metrics import read_metrics
from ..training.trackers import scalars
from .cli_checks import UsageError, check_input_file, check_output_dir

__all__ = ["export_swanlab", "add_arguments", "main"]

SWANLAB_MISSING = "--swanlab needs the swanlab package: pip install 'ember[swanlab]' (or pip install swanlab)"
# ember's names -> swanlab.init's modes
MODES = {"cloud": "online", "offline": "offline", "local": "local"}


def export_swanlab(records: list[dict[str, Any]], *, project: str, experiment_name: str, mode: str = "cloud",
                   log_dir: str | os.PathLike | None = None) -> int:
    """Logs `records` to a new SwanLab run; returns how many scalar values were logged."""
    try:
        import swanlab
    except ImportError:
        raise UsageError(SWANLAB_MISSING) from None
    if mode == "cloud":
        key = os.environ.get("SWANLAB_API_KEY")
        if not key:
            raise UsageError("--mode cloud needs the SWANLAB_API_KEY environment variable (the key is read from "
                             "there only); or record the run with --mode offline and `swanlab sync` it later")
        swanlab.login(api_key=key, save=False)
    run_rec = next((r for r in records if r.get("type") == "run"), {})
    config = {k: v for k, v in run_rec.items() if k != "type"}
    swanlab.init(project=project, name=experiment_name, mode=MODES[mode], config=config,
                 log_dir=os.fspath(log_dir) if log_dir is not None else None)
    logged = 0
    state = "crashed"
    try:
        for rec in records:
            got = scalars(rec)
            if got is None or not got[1]:
                continue
            step, values = got
            swanlab.log(values, step=step)
            logged += len(values)
        state = "success"
    finally:
        swanlab.finish(state=state)
    return logged


def add_arguments(p: Any) -> None:
    p.add_argument("metrics", metavar="FILE.jsonl", help="metrics file written by `ember mnist --metrics-file`")
    p.add_argument("--swanlab", action="store_true", help="replay into a SwanLab run (the only tracker so far)")
    p.add_argument("--project", default="ember", help="SwanLab project (default: ember)")
    p.add_argument("--experiment-name", default=None, help="experiment name (default: the file's name)")
    p.add_argument("--mode", choices=sorted(MODES), default="cloud",
                   help="cloud (default; needs SWANLAB_API_KEY in the environment), offline (write the run "
                        "under --log-dir for `swanlab sync`) or local")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="where offline/local runs are written "
                                                                   "(default: swanlab's, ./swanlog)")


def main(args: Any) -> int:
    if not args.swanlab:
        raise UsageError("choose a tracker: --swanlab")
    path = check_input_file("metrics file", args.metrics, "a JSON-lines metrics file from `ember mnist --metrics-file`")
    if args.log_dir is not None:
        check_output_dir("--log-dir", args.log_dir)
    records = read_metrics(path, warn=lambda msg: print(f"ember export-metrics: warning: {msg}", file=sys.stderr))
    if not any(r.get("type") in ("step", "epoch") for r in records):
        raise UsageError(f"{path}: no step or epoch records to export")
    name = args.experiment_name or Path(path).stem
    n = export_swanlab(records, project=args.project, experiment_name=name, mode=args.mode, log_dir=args.log_dir)
    print(f"exported {n} values from {path} to SwanLab project {args.project!r}, experiment {name!r} ({args.mode})")
    return 0
