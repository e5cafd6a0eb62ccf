"""The CUDA `winograd_fused` family (codegen/cuda_winograd_fused.py: F(2x2, 3x3) forward and
grad-input in one launch) without a GPU: its kernels run in the CPU emulation of their own source
(cuda_emulator.py) against float64 references with their epilogues, for odd and even planes, padding
0-2, channels past a block and chunks past the input channels, every blocking; a NaN or an infinity
gives the direct sums' non-finite values in the tiles it reaches and the Winograd values elsewhere;
nvcc compiles every blocking for sm_90; the table offers it for the forward and grad-input of 3x3
stride-1 ungrouped float32 convolutions and never picks it without a measurement. On a GPU:
tests/codegen/test_cuda_winograd_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
import nvcc as nvcc_tool
from ember.codegen import cuda_choices, cuda_winograd_fused as fused
from ember.codegen.cuda_kernels import PointwiseEpilogue

rng = np.random.default_rng(23)
KIND = {"conv2d": "conv_fwd", "conv2d_grad_input": "conv_gi"}
EXTRA = {"conv2d": dict(bias=True, relu=True), "conv2d_grad_input": dict(relu_mask=True)}


def _geometry(kind: str, N: int, C: int, H: int, W: int, O: int, p: int) -> dict:
    return dict(kind=kind, N=N, C=C, H=H, W=W, O=O, KH=3, KW=3, stride=(1, 1), padding=(p, p),
                HO=H + 2 * p - 2, WO=W + 2 * p - 2, tf32=False, epilogues=())


def _spec(g: dict) -> dict:
    return {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}


def _run(g: dict, plan: fused.FusedPlan, tmp_path, tag: str, epilogue: PointwiseEpilogue | None = None) -> None:
    kind = g["kind"]
    kernel = fused.render("k", g, plan, epilogue=epilogue, **EXTRA[kind])
    assert [la.function for la in kernel.launches] == ["k_clear", "k_wt", "k_fused"]
    assert kernel.launches[-1].shared_bytes == plan.shared_bytes() <= 48 * 1024
    assert kernel.scratch_bytes == fused.scratch_bytes(g, plan)
    lib = cuda_emulator.build([kernel], tmp_path, tag)
    ins, refs, lengths = cuda_refs.make_case(KIND[kind], _spec(g), EXTRA[kind], rng)
    bufs = dict(ins, out=np.full(np.shape(refs["out"]), np.nan, np.float32))
    cuda_emulator.run(lib, 0, kernel, bufs)
    want = refs["out"] * (0.5 if epilogue is not None else 1.0)
    np.testing.assert_allclose(bufs["out"], want, rtol=1e-5, atol=4e-6 * lengths["out"] + 1e-6,
                               err_msg=f"{kind} {g} {plan}")


CASES = [(kind, _geometry(kind, *sizes)) for kind in KIND for sizes in (
    (2, 5, 7, 9, 6, 1),      # odd planes: tiles past the output; one chunk, most of it past the channels
    (3, 17, 8, 6, 20, 0),    # no padding; channels past a block of 16, three chunks of 8
    (1, 4, 5, 5, 3, 2),      # padding 2 (the grad-input's correlation crops)
)]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{k}_{i % 3}" for i, (k, _) in enumerate(CASES)])
def test_the_fused_kernels_match_float64_in_the_emulation(case, tmp_path):
    kind, g = CASES[case]
    _run(g, fused.plans(g)[0], tmp_path, f"f{case}")


def _plan_id(q: fused.FusedPlan) -> str:
    return f"{q.BT}x{q.BCO}mb{q.min_blocks}{'p' if q.pipelined else ''}"


@pytest.mark.parametrize("plan", fused.PLANS, ids=_plan_id)
def test_every_blocking_with_a_generated_epilogue(plan, tmp_path):
    """More tiles than a block and channels past a block and a chunk in both directions, each
    blocking (a pipelined one reads U's padding, which the emulation's scratch starts as NaN: the
    weight transform must have zeroed it); a generated pointwise epilogue (red * 0.5) where each
    output is stored."""
    half = PointwiseEpilogue(body=(), result="red * 0.5f", inputs=())
    kind = "conv2d_grad_input" if (plan.min_blocks + plan.pipelined) % 2 else "conv2d"
    _run(_geometry(kind, 2, 19, 10, 11, 21, 1), plan, tmp_path, f"b{_plan_id(plan)}", epilogue=half)


@pytest.mark.parametrize("pipelined", (0, 1))
@pytest.mark.parametrize("kind", list(KIND))
def test_a_non_finite_input_gives_its_tiles_the_direct_sums(kind, pipelined, tmp_path):
    """NaN, +inf and -inf where the float64 reference has them (not the NaN Winograd's transforms
    would spread over a tile), the other values as close as ever; a non-finite weight sends every
    tile to the direct sums."""
    g = _geometry(kind, 3, 5, 7, 8, 6, 1)
    extra = {"conv2d": dict(bias=True, relu=False), "conv2d_grad_input": dict(relu_mask=False)}[kind]
    plan = fused.FusedPlan(32, 16, 1, pipelined)  # the pipelined kernel keeps its tile flags in dynamic shared memory
    kernel = fused.render("k", g, plan, **{k: v for k, v in extra.items() if v})
    lib = cuda_emulator.build([kernel], tmp_path, f"nf{kind}{pipelined}")
    src = "x" if kind == "conv2d" else "dy"
    for poison in ("input", "weight"):
        ins, _, lengths = cuda_refs.make_case(KIND[kind], _spec(g), extra, rng)
        if poison == "input":
            ins[src][1, 0, 3, 2] = np.nan
            ins[src][2, 1, 4, 3] = np.inf
            ins[src][0, 2, 1, 1] = -np.inf
        else:
            ins["w"][1, 2, 0, 1] = np.inf
        with np.errstate(invalid="ignore", over="ignore"):
            if kind == "conv2d":
                want = cuda_refs.conv_fwd_ref(ins["x"], ins["w"], ins["bias"], _spec(g), False)
            else:
                want = cuda_refs.conv_grad_input_ref(ins["dy"], ins["w"], _spec(g))
        bufs = dict(ins, out=np.full(np.shape(want), 7.0, np.float32))
        cuda_emulator.run(lib, 0, kernel, bufs)
        got = bufs["out"].reshape(np.shape(want))
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(got), test(want), err_msg=f"{kind}, {poison}: {test.__name__}")
        finite = np.isfinite(want)
        assert finite.any() and (~finite).any()
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=4e-6 * lengths["out"] + 1e-6)


def test_every_blocking_compiles_for_sm_90(tmp_path):
    nvcc = nvcc_tool.nvcc_or_skip()
    for i, plan in enumerate(fused.PLANS):  # each blocking once, the kinds in turn (their code differs in loads only)
        kind = list(KIND)[i % 2]
        g = _geometry(kind, 64, 256, 14, 14, 256, 1)
        src = tmp_path / f"k{i}{kind}.cu"
        src.write_text(fused.render(f"k{i}", g, plan, **EXTRA[kind]).code)
        nvcc_tool.assert_compiles(nvcc, src)


def test_the_table_offers_it_for_3x3_stride_1_forward_and_grad_input_only():
    fam = cuda_choices.FAMILIES["winograd_fused"]
    g = dict(_geometry("conv2d", 64, 256, 14, 14, 256, 1), epilogues=("bias",))
    assert cuda_choices.TABLE.applies(fam, g) is None
    assert cuda_choices.TABLE.applies(fam, dict(g, kind="conv2d_grad_input", epilogues=("relu_mask",))) is None
    assert cuda_choices.TABLE.applies(fam, dict(g, tf32=True)) is None  # float32 products, which TF32 permits
    assert fam.preferred(g) is False  # taken where measured only
    assert len(fam.all_plans(g)) == len(fused.PLANS) and fam.fits(g, fam.plans(g)[0])
    # the transformed weights and a flag: nothing that grows with the batch
    assert fam.scratch(g, fam.plans(g)[0]) == fam.scratch(dict(g, N=4096), fam.plans(g)[0]) < 16 * 256 * 256 * 4 + 4096
    for other, why in ((dict(g, kind="conv2d_grad_weight"), "serves conv2d, conv2d_grad_input"), (dict(g, stride=(2, 2)), "ungrouped 3x3"),
                       (dict(g, KH=5, KW=5), "ungrouped 3x3"), (dict(g, groups=2), "ungrouped"),
                       (dict(g, dtype="bfloat16"), "float32")):
        assert why in (cuda_choices.TABLE.applies(fam, other) or ""), other
    assert fused.plans(dict(g, O=16))[0].BCO == 16
    with pytest.raises(ValueError, match="blocking"):
        fused.render("k", g, fused.FusedPlan(16, 64))
