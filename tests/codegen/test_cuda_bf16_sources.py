"""precision="bf16" on the `cuda` target without a GPU: every contraction of the MNIST models' steps
is served by a family that takes bfloat16 operands: on tensor cores by the GEMM family's bfloat16
path (mma.sync m16n8k16, fp32 accumulation) or, for a stride-1 convolution's forward or
grad-input, by direct_tc (bfloat16 pairs on mma m16n8k16 where a stage is whole 16-channel
steps, else TF32's mma m16n8k8, in which bfloat16 values are exact; the value rounded to bfloat16); or, for a matmul or small-window convolution that is a pass over memory, by thin /
skinny_narrow / skinny_short / small_window, and for a stride-1 grad-weight by direct (the widened values' products summed in float32 FMAs,
the value rounded to bfloat16), whichever
the cost model's prior ranks first; the families that compute in float32 only refuse bfloat16
operands in one line, pooling and the generated kernels take bfloat16 buffers (`unsigned
short`), and every source compiles with `nvcc -cubin -arch=sm_90` warning-free (the runtime
compiles the same with NVRTC). The numerics run on a GPU: tests/codegen/test_cuda_bf16.py and
tests/e2e/test_bf16_vs_torch.py (marked cuda); the memory-pass families' also in the CPU
emulation (tests/codegen/test_cuda_bf16_families.py)."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ember.codegen import cuda_choices, tuning_db
from ember.frontends import nn, optim, plan
from ember.frontends.cli import main as ember_main
from ember.frontends.training import build_model
from ember.ir.kernel import CONTRACTIONS
from ember.runtime.tuner import kernels_of
from test_cuda_step_sources import _compile_all
from nvcc import nvcc_or_skip


def _plans(model: str) -> dict:
    shape = (784,) if model == "mlp" else (1, 28, 28)
    example = (np.zeros((64, *shape), np.float32), np.zeros(64, np.int64))
    with tuning_db.using(None):
        return plan(build_model(model), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example, device="cuda",
                    precision="bf16")


#: families that compute a bfloat16 contraction without tensor cores: passes over memory
MEMORY_PASSES = ("thin", "skinny_narrow", "skinny_short", "small_window")
#: families that refuse bfloat16 operands (they compute in float32 only), by kind
FLOAT32_ONLY = {"direct": ("conv2d", "conv2d_grad_input")}


@pytest.mark.parametrize("model", ["cnn", "mlp", "lenet5", "resnet8"])
def test_every_contraction_runs_on_a_family_that_takes_bfloat16(model):
    for graph in _plans(model).values():
        contractions = [(sub, spec) for sub, spec in kernels_of(graph) if spec.kind in CONTRACTIONS]
        assert contractions
        for sub, spec in contractions:
            g = cuda_choices.geometry(sub, spec)
            assert g["dtype"] == "bfloat16" and spec.choice[0] in ("gemm", "direct_tc", "direct", "nhwc_tc", "nhwc_wg") + MEMORY_PASSES
            assert '"dtype":"bfloat16"' in cuda_choices.TABLE.key(sub, spec)  # tuned apart from float32
            code = cuda_choices.render(sub.name, sub, spec, spec.choice).code
            if spec.choice[0] == "gemm":
                assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in code and "m16n8k8" not in code
            elif spec.choice[0] == "direct_tc":
                # bfloat16 pairs (grad-weight: of pixels; else stages of 16 channels) or TF32 on exact values
                pairs = spec.kind == "conv2d_grad_weight" or dict(spec.choice[1])["CC"] % 16 == 0
                mma = "m16n8k16.row.col.f32.bf16" if pairs else "m16n8k8.row.col.f32.tf32"
                assert mma in code and ("em_bf16_round(acc" in code or "em_bf16_round(v)" in code)
            elif spec.choice[0] == "nhwc_tc":  # where the shipped database has it measured faster
                assert "m16n8k16.row.col.f32.bf16" in code and "m16n8k8" not in code and "em_bf16_round(" in code
            elif spec.choice[0] == "nhwc_wg":  # warpgroup MMA, where the shipped database has it measured faster
                assert "wgmma.mma_async.sync.aligned.m64n" in code and ".f32.bf16.bf16" in code and "em_bf16_round(" in code
            else:  # float32 FMAs on the widened values, the value rounded before its epilogue
                assert ("em_bf16_round(v" in code or "em_bf16_round(acc" in code) and "mma" not in code
            # direct_tc takes a convolution the direct kernels take (stride 1); every other
            # family that serves the kind says why it does not serve bfloat16
            for f in cuda_choices.FAMILIES.values():
                if f.name == "direct_tc" and \
                        cuda_choices.TABLE.applies(cuda_choices.FAMILIES["direct"], dict(g, dtype=None)) is None:
                    assert cuda_choices.TABLE.applies(f, g) is None
                elif spec.kind in FLOAT32_ONLY.get(f.name, ()):
                    assert cuda_choices.TABLE.applies(f, g) is not None, f.name


@pytest.mark.parametrize("model", ["cnn", "mlp", "lenet5", "resnet8"])
def test_every_bf16_source_compiles_with_nvcc(model, tmp_path):
    nvcc = nvcc_or_skip()
    assert ember_main(["kernels", "--model", model, "--device", "cuda", "--bf16", "--out", str(tmp_path)]) == 0
    sources = sorted(tmp_path.glob("*.cu"))
    assert len(sources) == 2
    _compile_all(nvcc, sources)
    text = sources[-1].read_text()
    assert "em_bf16_round" in text and "mma.sync.aligned.m16n8k16" in text
    # generated kernels take bfloat16 buffers as 16-bit words
    assert re.search(r"const unsigned short\* __restrict__ in\d+", text)
    if model == "lenet5":
        assert "max pooling gradient of bf16[" in text
