"""The pass pipeline costs the same per kernel at any depth (no pass is quadratic in kernels).

Fusion once re-sorted the whole graph per kernel and scheduling copied and re-sorted it per
in-place update candidate: a 12-block ResNet-like step spent 30 s in fusion. The check is a
ratio of CPU time per kernel between a deep and a shallow model, so a busy machine does not
fail it and a quadratic pass (8x the kernels -> about 8x the time per kernel) cannot pass it.
"""
from __future__ import annotations

import gc
import time

import pytest

from ember.frontends import functional as F
from ember.frontends import nn, optim, spec, trace
from ember.frontends.training.recipes import BasicBlock
from ember.passes.pipeline import run_passes, train_passes
from ember.runtime import target


class DeepResNet(nn.Module):
    """A stem and `blocks` identity basic blocks (conv-BN-ReLU-conv-BN + residual), then a head."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(*[BasicBlock(8, 8, 1) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(F.flatten(self.pool(self.blocks(self.stem(x))), 1))


def _seconds_per_kernel(blocks: int, device: str) -> tuple[float, int]:
    model = DeepResNet(blocks)
    loss_fn = nn.CrossEntropyLoss()
    forward = trace(lambda x, y: loss_fn(model(x), y), spec((4, 1, 12, 12), "float32"), spec((4,), "int64"),
                    modules={"": model})
    passes = train_passes(optim.SGD(model.parameters(), lr=0.1, momentum=0.9).config) + target(device).passes()
    gc.collect()
    gc.disable()  # a collection landing in one run but not another is noise of the whole heap's size
    try:
        start = time.process_time()
        graph = run_passes(forward, passes)
        spent = time.process_time() - start
    finally:
        gc.enable()
    kernels = graph.count("fused")
    return spent / kernels, kernels


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_pass_time_per_kernel_does_not_grow_with_depth(device, monkeypatch):
    monkeypatch.setenv("EMBER_VERIFY", "0")  # compile()'s default: the full check is linear too, but slow
    _seconds_per_kernel(2, device)  # warm imports and caches out of the measurement
    per_kernel = {}
    for blocks in (3, 6, 12, 24):
        # the shallow model, the ratio's denominator, is cheap: its best of three steadies the ratio
        per_kernel[blocks], kernels = min(_seconds_per_kernel(blocks, device) for _ in range(3 if blocks == 3 else 1))
        assert kernels > 15 * blocks  # the model really grows (about 20 kernels a block)
    ratio = per_kernel[24] / per_kernel[3]
    shown = ", ".join(f"{b} blocks: {1e3 * t:.2f} ms" for b, t in per_kernel.items())
    assert ratio < 3, f"pass time per kernel grew {ratio:.1f}x from 3 to 24 blocks ({shown})"
