"""The CUDA `winograd`, `winograd4` and `winograd_x3` families (codegen/cuda_winograd.py, F(2x2, 3x3),
F(4x4, 3x3), and F(2x2) with its GEMM as 3xTF32) without a GPU: their kernels (the transforms and the GEMM skeleton's batched matmul on regions
of the scratch block) run in the CPU emulation of their own source (cuda_emulator.py) against
float64 references, for the three kinds with their epilogues (the forward's bias and ReLU, the
grad-input's ReLU mask, a generated pointwise epilogue), odd and even planes (planes that are not
whole tiles), padding 0-2, channels past the GEMM's tiles, with and without split-K; nvcc compiles
them for sm_90; the choice table offers the families for 3x3 stride-1 ungrouped float32
convolutions only and never picks them without a measurement. On a GPU the kernels run in
tests/codegen/test_cuda_winograd_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
import nvcc as nvcc_tool
from ember.codegen import cuda_choices, cuda_winograd
from ember.codegen.cuda_kernels import PointwiseEpilogue, scratch_offset

rng = np.random.default_rng(11)
KIND = {"conv2d": "conv_fwd", "conv2d_grad_input": "conv_gi", "conv2d_grad_weight": "conv_gw"}


def _geometry(kind: str, N: int, C: int, H: int, W: int, O: int, p: int) -> dict:
    return dict(kind=kind, N=N, C=C, H=H, W=W, O=O, KH=3, KW=3, stride=(1, 1), padding=(p, p),
                HO=H + 2 * p - 2, WO=W + 2 * p - 2, tf32=False, epilogues=())


CASES = [(kind, _geometry(kind, *sizes)) for kind in KIND for sizes in (
    (2, 5, 7, 9, 6, 1),      # odd planes: tiles past the output
    (3, 17, 8, 6, 20, 0),    # no padding; channels past a tile
    (1, 4, 5, 5, 3, 2),      # padding 2 (the grad-input's correlation crops)
)]
#: each family's output tile (F(m x m, 3x3)) and whether its GEMM is 3xTF32
FAMILIES = {"winograd": (2, False), "winograd4": (4, False), "winograd_x3": (2, True)}
TILES = {name: m for name, (m, x3) in FAMILIES.items() if not x3}


def _plan(g: dict, split: bool | None = None, m: int = 2, x3: bool = False):
    """The planner's best plan, or its best with (or without) split-K."""
    plans = cuda_winograd.plans(g, top=400, m=m, x3=x3)
    if split is not None:
        plans = [p for p in plans if (p.splits > 1) == split]
    return plans[0]


def _run(g: dict, plan, tmp_path, tag: str, epilogue: PointwiseEpilogue | None = None, m: int = 2,
         x3: bool = False) -> None:
    kind = g["kind"]
    extra = {"conv2d": dict(bias=True, relu=True), "conv2d_grad_input": dict(relu_mask=True),
             "conv2d_grad_weight": dict(bias=False)}[kind]
    kernel = cuda_winograd.render("k", g, plan, epilogue=epilogue, m=m, x3=x3,
                                  **{k: v for k, v in extra.items() if v})
    assert ("split_tf32(" in kernel.code) == x3
    reads = ["mask_src["] * (kind == "conv2d_grad_input") + ["pw_epilogue("] * (epilogue is not None)
    if kind != "conv2d_grad_weight":  # a block's epilogue values (their operand reads) all before its stores
        for block in kernel.code.split("the block's values first")[1:]:
            values = block.split("p.out[", 1)[0]
            assert all(r in values for r in reads)
            assert all("for (int a = 0; a < MT; ++a)" in values.rsplit(r, 1)[1] for r in reads)
    assert kernel.scratch_bytes == cuda_winograd.scratch_bytes(g, plan, m)
    assert all(scratch_offset(r) is None or scratch_offset(r) < kernel.scratch_bytes
               for la in kernel.launches for r in la.args)
    lib = cuda_emulator.build([kernel], tmp_path, tag)
    spec = {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}
    ins, refs, lengths = cuda_refs.make_case(KIND[kind], spec, extra, rng)
    bufs = dict(ins, out=np.full(np.shape(refs["out"]), np.nan, np.float32))
    cuda_emulator.run(lib, 0, kernel, bufs)
    want = refs["out"] * (0.5 if epilogue is not None else 1.0)
    np.testing.assert_allclose(bufs["out"], want, rtol=1e-5, atol=4e-6 * lengths["out"] + 1e-6,
                               err_msg=f"{kind} {g} {plan}")


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{k}_{i % 3}" for i, (k, _) in enumerate(CASES)])
def test_winograd_kernels_match_float64_in_the_emulation(case, family, tmp_path):
    kind, g = CASES[case]
    m, x3 = FAMILIES[family]
    _run(g, _plan(g, m=m, x3=x3), tmp_path, f"w{case}", m=m, x3=x3)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kind", list(KIND))
def test_split_k_and_a_generated_epilogue(kind, family, tmp_path):
    """The grad-weight's product sums over the tiles: with split-K its partials are summed in
    split order by the GEMM's second launch, on another region of the scratch; a generated
    pointwise epilogue (here red * 0.5) is applied where each output is stored."""
    m, x3 = FAMILIES[family]
    side = 9 if m == 2 else 17  # the grad-weight's reduction over the tiles long enough to split
    g = _geometry(kind, 4, 6, side, side, 8, 1)
    half = PointwiseEpilogue(body=(), result="red * 0.5f", inputs=())
    split = kind == "conv2d_grad_weight"
    _run(g, _plan(g, split=split if split else None, m=m, x3=x3), tmp_path, f"s{kind}", epilogue=half, m=m, x3=x3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_kernels_compile_for_sm_90(family, tmp_path):
    nvcc = nvcc_tool.nvcc_or_skip()
    m, x3 = FAMILIES[family]
    for i, (kind, g) in enumerate(CASES[::3] + [("big", _geometry("conv2d", 64, 256, 14, 14, 256, 1))]):
        g = dict(g, kind="conv2d") if kind == "big" else g
        kernel = cuda_winograd.render(f"k{i}", g, _plan(g, m=m, x3=x3), bias=g["kind"] == "conv2d",
                                      relu=g["kind"] == "conv2d", relu_mask=g["kind"] == "conv2d_grad_input", m=m, x3=x3)
        src = tmp_path / f"k{i}.cu"
        src.write_text(kernel.code)
        nvcc_tool.assert_compiles(nvcc, src)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_table_offers_it_for_3x3_stride_1_float32_convolutions_only(family):
    """F(2x2) wherever the operands are float32; F(4x4), which rounds several times more, only
    where precision "tf32" allows more rounding than float32's; F(2x2) with its GEMM as 3xTF32
    only under precision "float32" (under "tf32", one TF32 product is what is asked for)."""
    g = dict(_geometry("conv2d", 64, 256, 14, 14, 256, 1), epilogues=("bias",), tf32=family == "winograd4")
    fam = cuda_choices.FAMILIES[family]
    assert cuda_choices.TABLE.applies(fam, g) is None
    if family == "winograd4":
        assert "tf32" in cuda_choices.TABLE.applies(fam, dict(g, tf32=False))
    elif family == "winograd_x3":
        assert "float32" in cuda_choices.TABLE.applies(fam, dict(g, tf32=True))
    else:
        assert cuda_choices.TABLE.applies(fam, dict(g, tf32=True)) is None
    assert fam.preferred(g) is False  # taken where measured only
    assert fam.all_plans(g) and fam.fits(g, fam.plans(g)[0]) and len(fam.all_plans(g)) > 1
    # V and M for the whole batch: (m+2)^2 points of every tile
    m = FAMILIES[family][0]
    tiles = 64 * (-(-14 // m)) ** 2
    assert fam.scratch(g, fam.plans(g)[0]) > 2 * (m + 2) ** 2 * 256 * tiles * 4
    for other, why in ((dict(g, stride=(2, 2)), "ungrouped 3x3"), (dict(g, KH=5, KW=5), "ungrouped 3x3"),
                       (dict(g, groups=2), "ungrouped"), (dict(g, dtype="bfloat16"), "float32")):
        assert why in (cuda_choices.TABLE.applies(fam, other) or ""), other
    huge = dict(g, N=4096)
    assert "GB of scratch" in cuda_choices.TABLE.applies(fam, huge)


@pytest.mark.parametrize("m", TILES.values(), ids=list(TILES))
@pytest.mark.parametrize("kind", list(KIND))
def test_nan_and_inf_give_the_direct_sums_non_finite_values(kind, m, tmp_path):
    """A NaN or an infinity among the operands sets the kernel's flag and its last launch computes
    its outputs by the direct sums: NaN, +inf and -inf where the float64 reference has them (not the
    NaN Winograd's transforms would spread over a tile), the other values as close as ever."""
    g = _geometry(kind, 3, 5, 7, 8, 6, 1)
    extra = {"conv2d": dict(bias=True, relu=False), "conv2d_grad_input": dict(relu_mask=False),
             "conv2d_grad_weight": dict(bias=False)}[kind]
    kernel = cuda_winograd.render("k", g, _plan(g, m=m), bias=kind == "conv2d", m=m)
    lib = cuda_emulator.build([kernel], tmp_path, f"nf{kind}{m}")
    spec = {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}
    ins, _, lengths = cuda_refs.make_case(KIND[kind], spec, extra, rng)
    src = "x" if kind != "conv2d_grad_input" else "dy"
    ins[src][1, 0, 3, 2] = np.nan
    ins[src][2, 1, 4, 3] = np.inf
    ins[src][0, 2, 1, 1] = -np.inf
    if kind == "conv2d_grad_weight":
        ins["dy"][0, 1, 2, 5] = np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        if kind == "conv2d":
            want = cuda_refs.conv_fwd_ref(ins["x"], ins["w"], ins["bias"], spec, False)
        elif kind == "conv2d_grad_input":
            want = cuda_refs.conv_grad_input_ref(ins["dy"], ins["w"], spec)
        else:
            want = cuda_refs.conv_grad_weight_ref(ins["x"], ins["dy"], spec)[0]
    bufs = dict(ins, out=np.full(np.shape(want), 7.0, np.float32))
    cuda_emulator.run(lib, 0, kernel, bufs)
    got = bufs["out"].reshape(np.shape(want))
    for test in (np.isnan, np.isposinf, np.isneginf):
        np.testing.assert_array_equal(test(got), test(want), err_msg=f"{kind}: {test.__name__}")
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=4e-6 * lengths["out"] + 1e-6)
