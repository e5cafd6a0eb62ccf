"""Loss and accuracy curves of one or more runs, from their metrics records (`ember plot`).

Left: training loss against the global step (the step records' interval means, and each
epoch's mean train loss, drawn at the middle of the epoch) and the test (and validation) loss after each epoch. Right: test (and validation) accuracy per epoch.
Several files overlay, labelled by file name. Needs matplotlib (`pip install 'ember[plot]'`);
the figure is drawn with the non-interactive Agg backend, so no display is needed.
"""
from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.frontends.checkpoint import atomic_write_bytes
from .metrics import MetricsError

__all__ = ["plot_metrics", "run_title"]

_MISSING = "plotting needs matplotlib: pip install 'ember[plot]' (or pip install matplotlib)"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(_MISSING) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def plot_metrics(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]] | Sequence[dict[str, Any]],
                 out: str | os.PathLike, title: str | None = None) -> Path:
    """Draws the curves of one run (a list of records) or several ((label, records) pairs) to `out`.

    The image is drawn in memory and written through a temporary file renamed over `out`, so a
    full disk leaves `out` as it was (no 0-byte or half image); the OSError names `out`."""
    if runs and isinstance(runs[0], dict):
        runs = [("", runs)]  # type: ignore[list-item]
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    anything = False
    for i, (label, records) in enumerate(runs):  # type: ignore[misc]
        c = colors[i % len(colors)]
        tag = f"{label}: " if label else ""
        steps = [r for r in records if r.get("type") == "step" and r.get("loss_avg", r.get("loss")) is not None]
        epochs = [r for r in records if r.get("type") == "epoch"]
        if steps:
            ax_loss.plot([r["step"] for r in steps], [r.get("loss_avg", r.get("loss")) for r in steps],
                         color=c, alpha=0.55, lw=1, label=f"{tag}train (per {_interval(steps)} steps)")
        ep_train = [r for r in epochs if r.get("train_loss") is not None]
        if ep_train:
            # an epoch's mean loss is drawn at the middle of that epoch's steps
            ax_loss.plot([r["step"] - r.get("steps", 0) / 2 for r in ep_train], [r["train_loss"] for r in ep_train], "s-",
                         color=c, ms=5, label=f"{tag}train (epoch mean)")
        ep_test = [r for r in epochs if r.get("test_loss") is not None]
        if ep_test:
            ax_loss.plot([r["step"] for r in ep_test], [r["test_loss"] for r in ep_test], "o--", color=c,
                         ms=6, label=f"{tag}test")
        ep_val = [r for r in epochs if r.get("val_loss") is not None]  # --val-split
        if ep_val:
            ax_loss.plot([r["step"] for r in ep_val], [r["val_loss"] for r in ep_val], "^:", color=c,
                         ms=6, label=f"{tag}validation")
            ax_acc.plot([r["epoch"] for r in ep_val], [100 * r["val_acc"] for r in ep_val], "^:", color=c, ms=6,
                        label=f"{tag}validation ({100 * ep_val[-1]['val_acc']:.2f}%)")
        ep_acc = [r for r in epochs if r.get("test_acc") is not None]
        if ep_acc:
            ax_acc.plot([r["epoch"] for r in ep_acc], [100 * r["test_acc"] for r in ep_acc], "o-", color=c, ms=6,
                        label=f"{label or 'test'} ({100 * ep_acc[-1]['test_acc']:.2f}%)")
        anything = anything or bool(steps or epochs)
    if not anything:
        plt.close(fig)
        raise MetricsError("no step or epoch records to plot")
    ax_loss.set(xlabel="training step", ylabel="cross-entropy loss", title="loss")
    ax_loss.set_yscale("log")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    ax_acc.grid(True, alpha=0.3)
    ax_acc.xaxis.get_major_locator().set_params(integer=True)
    if ax_acc.lines:
        ax_acc.legend(fontsize=8)
    else:
        ax_acc.text(0.5, 0.5, "no epoch finished yet", ha="center", va="center", transform=ax_acc.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    image = io.BytesIO()
    try:  # a name without an extension is a PNG, as savefig(path) makes it
        fig.savefig(image, dpi=110, format=out.suffix[1:].lower() or "png")
    finally:
        plt.close(fig)
    atomic_write_bytes(out, image.getvalue())
    return out


def _interval(steps: Sequence[dict[str, Any]]) -> int:
    return steps[1]["step"] - steps[0]["step"] if len(steps) > 1 else steps[0]["step"]


def run_title(records: Sequence[dict[str, Any]]) -> str | None:
    """A one-line description from a file's first run record (model, device, optimizer, lr, batch)."""
    run = next((r for r in records if r.get("type") == "run"), None)
    if run is None:
        return None
    return (f"MNIST {run.get('model', '?')} on {run.get('device', '?')}: {run.get('optimizer', '?')} "
            f"lr {run.get('lr', '?')}, batch {run.get('batch_size', '?')}")
