"""`ember plot metrics.jsonl [more.jsonl ...] -o curves.png`: loss and accuracy curves of earlier
runs (several files overlay, labelled by file name); the drawing is
`ember.frontends.training.plotting`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..training.metrics import read_metrics
from ..training.plotting import plot_metrics, run_title
from .cli_checks import check_input_file, check_plot_file

__all__ = ["add_arguments", "main"]


def add_arguments(p: Any) -> None:
    p.add_argument("metrics", nargs="+", help="metrics file(s) written by `ember mnist --metrics-file` (JSON lines)")
    p.add_argument("-o", "--output", default="curves.png", help="PNG to write (default: curves.png)")
    p.add_argument("--title", default=None, help="figure title (default: from the run record)")


def main(args: Any) -> int:
    check_plot_file("-o", args.output)
    runs = []
    for path in args.metrics:
        check_input_file("metrics file", path, "a JSON-lines file from `ember mnist --metrics-file`")
        records = read_metrics(path, warn=lambda msg: print(f"ember plot: warning: {msg}", file=sys.stderr))
        runs.append((Path(path).stem if len(args.metrics) > 1 else "", records))
    title = args.title or (run_title(runs[0][1]) if len(runs) == 1 else None)
    out = plot_metrics(runs, args.output, title=title)
    print(f"wrote {out}")
    return 0
