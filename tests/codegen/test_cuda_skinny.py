"""The skinny matmuls (codegen/cuda_skinny.py) without a GPU: which shapes they take, that the CUDA
step of the CNN uses them at batch 64 and 1024 where the shipped measurements found them fastest
(the cost model alone, through its prior), the MLP's first layer never (they do not apply), and that
the generated epilogue (an in-place update, S = 1 and split) compiles. Their values are checked on a
GPU with the other kernels (cuda_cases.skinny_kernels, test_cuda_kernels_gpu.py)."""
from __future__ import annotations

import re

import pytest

from ember.codegen import tuning_db
from ember.codegen import cuda_kernels as ck
from ember.codegen import cuda_skinny as cs
from ember.codegen.device import H200
from ember.frontends.cli import main as ember_main
from nvcc import assert_compiles, find_nvcc, nvcc_or_skip

FWD = dict(M=1024, N=10, K=18432, trans_a=False, trans_b=True)
GW = dict(M=10, N=18432, K=1024, trans_a=True, trans_b=False)


@pytest.mark.parametrize("render,shape", [
    (cs.render_matmul_narrow, dict(FWD, trans_a=True)),         # a stored (K, M)
    (cs.render_matmul_narrow, dict(FWD, trans_b=False)),        # b stored (K, N)
    (cs.render_matmul_narrow, dict(FWD, N=17)),                 # too many columns
    (cs.render_matmul_narrow, dict(FWD, batch=2)),
    (cs.render_matmul_short_m, dict(GW, M=17)),                 # too many rows
    (cs.render_matmul_short_m, dict(GW, N=18430)),              # columns not in float4s
    (cs.render_matmul_short_m, dict(GW, trans_b=True)),
    (cs.render_matmul_short_m, dict(GW, batch=3)),
])
def test_unsuited_shapes_are_refused(render, shape):
    assert render("k", **shape) is None


def test_mnist_plans_split_and_fill_the_gpu():
    fwd = cs.render_matmul_narrow("f", bias=True, **FWD)
    gw = cs.render_matmul_short_m("g", **GW)
    for k, splits in ((fwd, fwd.launches[0].grid[0]), (gw, gw.launches[0].grid[1])):
        main, red = k.launches
        blocks = main.grid[0] * main.grid[1]
        if k is fwd:  # one wave: as many blocks as fit, and no more
            assert cs.narrow_target_blocks(H200) // 2 < blocks <= cs.narrow_target_blocks(H200)
        else:
            assert blocks >= cs.short_target_blocks(H200)
        assert red.function == f"{k.name}_reduce"
        assert splits > 1 and k.scratch_bytes == -(-4 * splits * 10 * (1024 if k is fwd else 18432) // 256) * 256
    # one split: no scratch, one launch, the epilogue in the first launch
    one = cs.render_matmul_short_m("o", plan=cs.short_m_plan(10, 18432, 64, groups=8, splits=1),
                                   **dict(GW, K=64))
    assert len(one.launches) == 1 and one.scratch_bytes == 0 and "scratch" not in one.launches[0].args


def test_in_place_epilogue_compiles(tmp_path):
    """An SGD-style epilogue reading and writing the output's buffer (in2 = the parameter)."""
    nvcc = nvcc_or_skip()
    pw = ck.PointwiseEpilogue(("const float e1 = in2[i];", "const float e2 = e1 + -0.05f * red;"), "e2", (2,))
    kernels = [cs.render_matmul_short_m("sm_split", epilogue=pw, **GW),
               cs.render_matmul_short_m("sm_one", epilogue=pw, plan=cs.short_m_plan(10, 18432, 64, groups=8, splits=1),
                                        **dict(GW, K=64)),
               cs.render_matmul_narrow("nw_split", epilogue=pw, bias=True, **FWD),
               cs.render_matmul_narrow("nw_one", epilogue=pw, relu=True, **dict(FWD, K=40))]
    for k in kernels:
        assert "in2" in k.launches[-1].args and "float* out" in k.code and "float* __restrict__ out" not in k.code
    src = tmp_path / "epi.cu"
    src.write_text("\n".join(k.code for k in kernels))
    assert_compiles(nvcc, src)


def test_the_cost_model_uses_skinny_kernels_where_measurements_found_them_fastest(tmp_path):
    with tuning_db.using(None):  # no exact lookup: the cost model and its prior from the shipped records
        _check_skinny_use(tmp_path)


def _check_skinny_use(tmp_path):
    for batch in (1024, 64):
        out = tmp_path / str(batch)
        assert ember_main(["kernels", "--model", "cnn", "--device", "cuda", "--batch-size", str(batch),
                           "--out", str(out)]) == 0
        text = (out / f"cnn-train-{batch}x1x28x28.cu").read_text()
        assert "_narrow(" in text and "_shortm(" in text
        dump = (out / f"cnn-train-{batch}x1x28x28.txt").read_text()
        assert re.search(r"choice=skinny_narrow\(.*\(cost model \(prior of \d tuned kernels \(nearest 0\.0\)", dump)
    assert ember_main(["kernels", "--model", "mlp", "--device", "cuda", "--batch-size", "1024",
                       "--out", str(tmp_path / "mlp")]) == 0
    text = (tmp_path / "mlp" / "mlp-train-1024x784.cu").read_text()
    assert "_shortm(" not in text  # its weight gradients are (30, 784) and (10, 30): M > SHORT_MAX_M or N % 4
    nvcc = find_nvcc()
    if nvcc:
        assert_compiles(nvcc, tmp_path / "1024" / "cnn-train-1024x1x28x28.cu")
