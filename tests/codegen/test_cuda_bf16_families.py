"""The CUDA families that compute bfloat16 contractions in float32 FMAs (the matmuls that are passes
over memory: thin, skinny_narrow, skinny_short; small_window convolutions; direct's stride-1
grad-weight) with bfloat16 operands (precision "bf16"), without a GPU. They read bfloat16 through the views and
vector loads of `bf16.j2` (four values in one 8-byte access), sum the widened values' products
in float32 FMAs, round the value to bfloat16 before the epilogue (the bias add rounded again, as
the interpreter's add) and store the output's dtype. Here each runs in the CPU emulation of its
own source (cuda_emulator.py) against float64 sums of the same bfloat16 values with the same
roundings: equal but for the last bit where a float32 sum lands near a bfloat16 tie. A kernel
that read a bfloat16 operand as floats, skipped a rounding or stored the wrong halves fails."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
from ember.codegen import cuda_direct, cuda_skinny
from ember.ir.dtypes import bf16_bits, bf16_values, round_bf16

rng = np.random.default_rng(29)


def _operands(M: int, N: int, K: int, trans_a: bool, trans_b: bool) -> dict[str, np.ndarray]:
    a = (K, M) if trans_a else (M, K)
    b = (N, K) if trans_b else (K, N)
    return {"a": round_bf16(rng.standard_normal(a).astype(np.float32)),
            "b": round_bf16(rng.standard_normal(b).astype(np.float32)),
            "bias": round_bf16(rng.standard_normal(N).astype(np.float32))}


def _reference(v: dict[str, np.ndarray], trans_a: bool, trans_b: bool, bias: bool, relu: bool) -> np.ndarray:
    a = v["a"].astype(np.float64).T if trans_a else v["a"].astype(np.float64)
    b = v["b"].astype(np.float64).T if trans_b else v["b"].astype(np.float64)
    out = round_bf16((a @ b).astype(np.float32))
    if bias:
        out = round_bf16(out + v["bias"][None, :])
    return np.maximum(out, 0) if relu else out


def _run(kernel, v: dict[str, np.ndarray], bf16: frozenset[str], shape: tuple[int, int], tmp_path) -> np.ndarray:
    bufs = {r: bf16_bits(x) if r in bf16 else x for r, x in v.items()}
    out_bf16 = "out" in bf16
    bufs["out"] = np.full(shape, 0x7FC0, np.uint16) if out_bf16 else np.full(shape, np.nan, np.float32)
    cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, "mm"), 0, kernel, bufs)
    return bf16_values(bufs["out"]) if out_bf16 else bufs["out"]


def _check(got: np.ndarray, want: np.ndarray) -> None:
    assert np.all(np.isfinite(got)), int(np.isnan(got).sum())  # every output written
    assert np.max(np.abs(got - want)) <= 2.0 ** -7 * np.max(np.abs(want))
    assert np.mean(got == want) >= 0.97, np.mean(got == want)


ALL = frozenset({"a", "b", "bias", "out"})

# (family, M, N, K, trans_a, trans_b, bias, relu, bfloat16 roles)
CASES = [
    ("thin", 37, 24, 10, False, False, True, True, ALL),
    ("thin", 19, 12, 7, True, False, False, False, ALL),
    ("thin", 21, 16, 5, False, False, False, False, frozenset({"a", "b"})),  # a float32 output
    ("skinny_narrow", 45, 10, 512, False, True, True, False, ALL),
    ("skinny_narrow", 13, 3, 96, False, True, False, True, frozenset({"a", "b"})),
    ("skinny_short", 10, 48, 300, True, False, False, False, ALL),
    ("skinny_short", 7, 32, 129, False, False, True, True, ALL),
]


def _render(family, M, N, K, trans_a, trans_b, bias, relu, bf16):
    low = bf16 if bias else bf16 - {"bias"}
    if family == "thin":
        return cuda_direct.render_matmul_thin("t", M=M, N=N, K=K, trans_a=trans_a, trans_b=trans_b, bias=bias,
                                              relu=relu, rows=8, bf16_roles=low)
    if family == "skinny_narrow":  # a long k split in two (the reduce launch rounds and stores)
        plan = cuda_skinny.narrow_plan(M, N, K)
        if K >= 512:
            plan = dataclasses.replace(plan, S=2, KC=K // 2)
        return cuda_skinny.render_matmul_narrow("t", M=M, N=N, K=K, trans_a=trans_a, trans_b=trans_b, bias=bias,
                                                relu=relu, plan=plan, bf16_roles=low)
    plan = cuda_skinny.short_m_plan(M, N, K)
    return cuda_skinny.render_matmul_short_m("t", M=M, N=N, K=K, trans_a=trans_a, trans_b=trans_b, bias=bias,
                                             relu=relu, plan=plan, bf16_roles=low)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bfloat16_memory_pass_matmuls_give_the_bfloat16_reference(case, tmp_path):
    family, M, N, K, trans_a, trans_b, bias, relu, bf16 = case
    kernel = _render(*case)
    assert kernel is not None and "em_bf16_round(v" in kernel.code
    v = _operands(M, N, K, trans_a, trans_b)
    if not bias:
        del v["bias"]
    want = _reference(v, trans_a, trans_b, bias, relu)
    _check(_run(kernel, v, bf16, (M, N), tmp_path), want)


def test_every_skinny_narrow_candidate_gives_the_bfloat16_reference(tmp_path):
    """Every tiling the tuner measures for skinny_narrow (rows a lane, k steps in flight, splits;
    a k of three and a half rounds, rows past a block's), emulated."""
    from ember.codegen import cuda_choices
    M, N, K = 45, 10, 1664
    plans = cuda_choices._narrow_candidates(dict(M=M, N=N, K=K))
    assert len(plans) >= 4
    v = _operands(M, N, K, False, True)
    want = _reference(v, False, True, True, False)
    for i, plan in enumerate(plans):
        kernel = cuda_skinny.render_matmul_narrow("t", M=M, N=N, K=K, trans_a=False, trans_b=True, bias=True,
                                                  plan=cuda_skinny.NarrowPlan(**dict(plan)), bf16_roles=ALL)
        (tmp_path / str(i)).mkdir()
        _check(_run(kernel, dict(v), ALL, (M, N), tmp_path / str(i)), want)


# the direct grad-weight (stride 1): (n, c, h, w, o, k, padding, bfloat16 roles)
GW_CASES = [
    (2, 16, 8, 8, 32, 3, 1, frozenset({"x", "dy", "out"})),  # float4 reads of dy (4 output channels a thread)
    (2, 8, 8, 11, 16, 3, 0, frozenset({"x", "dy"})),  # a float32 gradient (the value still rounded)
]


def _direct_gw(n, c, h, w, o, k, pad, bf16):
    return cuda_direct.render_direct_grad_weight("gw", N=n, C=c, H=h, W=w, O=o, KH=k, KW=k, padding=(pad, pad),
                                                 bf16_roles=bf16)


def _direct_tc_gw(n, c, h, w, o, k, pad, bf16):
    from ember.codegen import cuda_direct_tc as ct
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    plan = ct.tc_grad_weight_candidates(n, c, o, k, k, ho, wo)[0]
    return ct.render_direct_tc_grad_weight("tg", N=n, C=c, H=h, W=w, O=o, KH=k, KW=k, padding=(pad, pad), plan=plan,
                                           bf16_roles=bf16)


@pytest.mark.parametrize("family", ["direct", "direct_tc"])
@pytest.mark.parametrize("case", GW_CASES, ids=[f"gw-{i}" for i in range(len(GW_CASES))])
def test_bfloat16_stride_1_grad_weights_give_the_bfloat16_reference(case, family, tmp_path):
    """direct's grad-weight (x and dy widened as they are staged, float32 FMAs) and direct_tc's
    (pixel pairs on the bfloat16 mma), both staged without cp.async: the block partials summed in
    block order and the sum rounded to bfloat16 before the store."""
    n, c, h, w, o, k, pad, bf16 = case
    kernel = (_direct_gw if family == "direct" else _direct_tc_gw)(*case)
    assert kernel is not None and "em_bf16_round(v)" in kernel.code and "stage1(" not in kernel.code
    ho, wo = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    v = {"x": round_bf16(rng.standard_normal((n, c, h, w)).astype(np.float32)),
         "dy": round_bf16(rng.standard_normal((n, o, ho, wo)).astype(np.float32))}
    dw, _ = cuda_refs.conv_grad_weight_ref(v["x"], v["dy"], dict(stride=1, padding=(pad, pad), KH=k, KW=k))
    _check(_run(kernel, v, bf16, (o, c, k, k), tmp_path), round_bf16(dw.astype(np.float32)))


# small-window convolutions: (kind, n, c, h, w, o, k, stride, padding, bfloat16 roles)
SMALL_CASES = [
    ("conv2d", 2, 1, 12, 12, 8, 3, 1, 0, frozenset({"x", "w", "bias", "out"})),
    ("conv2d", 2, 2, 11, 9, 4, 3, 2, 1, frozenset({"x", "w", "bias", "out"})),
    ("conv2d_grad_weight", 3, 1, 10, 12, 16, 3, 1, 0, frozenset({"x", "dy", "out"})),
    ("conv2d_grad_weight", 2, 2, 9, 9, 8, 3, 2, 1, frozenset({"x", "dy"})),
]


def _small(kind, n, c, h, w, o, k, stride, pad, bf16):
    from ember.codegen import cuda_small_conv
    geo = dict(N=n, C=c, H=h, W=w, O=o, KH=k, KW=k, stride=(stride, stride), padding=(pad, pad))
    if kind == "conv2d":
        return cuda_small_conv.render_small_forward("s", **geo, bias=True, relu=True, bf16_roles=bf16)
    return cuda_small_conv.render_small_grad_weight("s", **geo, bf16_roles=bf16)


@pytest.mark.parametrize("case", SMALL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SMALL_CASES)])
def test_bfloat16_small_window_convolutions_give_the_bfloat16_reference(case, tmp_path):
    kind, n, c, h, w, o, k, stride, pad, bf16 = case
    kernel = _small(*case)
    assert kernel is not None and "em_bf16_round(" in kernel.code
    bf = lambda shape: round_bf16(rng.standard_normal(shape).astype(np.float32))
    g = dict(N=n, C=c, H=h, W=w, O=o, KH=k, KW=k, stride=stride, padding=(pad, pad))
    ho, wo = cuda_refs.conv_out(g)
    x = bf((n, c, h, w))
    if kind == "conv2d":
        v = {"x": x, "w": bf((o, c, k, k)), "bias": bf(o)}
        conv = round_bf16(cuda_refs.conv_fwd_ref(x, v["w"], None, g, relu=False).astype(np.float32))
        want = np.maximum(round_bf16(conv + v["bias"][None, :, None, None]), 0)
        shape = (n, o, ho, wo)
    else:
        v = {"x": x, "dy": bf((n, o, ho, wo))}
        want = round_bf16(cuda_refs.conv_grad_weight_ref(x, v["dy"], g)[0].astype(np.float32))
        shape = (o, c, k, k)
    _check(_run(kernel, v, bf16, shape, tmp_path), want)


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["cnn", "lenet5", "resnet8"])
def test_every_bfloat16_candidate_matches_the_interpreter_on_the_gpu(model):
    """Every candidate the tuner measures for every contraction of a bf16 step (these families,
    direct_tc's bfloat16 pairs and TF32 plans, the GEMM's) run on the GPU against the
    interpreter's bfloat16 result on the measurer's inputs, within the tuner's bf16 tolerance."""
    pytest.importorskip("cupy")
    from ember.codegen import cuda_choices, tuning_db
    from ember.frontends import nn, optim, plan
    from ember.frontends.training import build_model
    from ember.ir import interpreter
    from ember.ir.dtypes import as_array, as_values
    from ember.ir.kernel import CONTRACTIONS
    from ember.runtime.tuner import TOLERANCE, _close, kernels_of
    from ember.runtime.tuner_cuda import CudaMeasurer
    shape = (784,) if model == "mlp" else (1, 28, 28)
    example = (np.zeros((16, *shape), np.float32), np.zeros(16, np.int64))
    with tuning_db.using(None):
        graph = next(iter(plan(build_model(model), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example,
                               device="cuda", precision="bf16").values()))
    measurer, families = CudaMeasurer(), set()
    for sub, spec in kernels_of(graph):
        if spec.kind not in CONTRACTIONS:
            continue
        choices = cuda_choices.candidates(sub, spec)
        trials = measurer.measure(sub, spec, choices, seed=0)
        rng = np.random.default_rng(0)  # the measurer's inputs: standard normal in input order, as the dtype holds them
        inputs = {name: as_values(as_array(rng.standard_normal(sub.type(n).shape).astype(np.float32), sub.type(n).dtype),
                                  sub.type(n).dtype) for name, n in sub.inputs.items()}
        want = interpreter.run(sub, inputs).outputs["out"]
        for trial in trials:
            assert trial.error is None, (sub.name, trial.choice, trial.error)
            assert _close(trial.output, want, TOLERANCE["bf16"]) is None, (sub.name, trial.choice)
            families.add(trial.choice[0])
    assert families & {"thin", "skinny_narrow", "skinny_short", "small_window", "direct"}, families


@pytest.mark.parametrize("model", ["cnn", "lenet5"])
def test_a_bf16_steps_contractions_emulated_match_the_interpreter(model, tmp_path):
    """Every contraction kernel of a planned bf16 step (its fused epilogues too: ReLU's backward
    and the SGD updates ride in bfloat16 contractions on CUDA), rendered with the first candidate
    of every family that serves it, run in the CPU emulation against the interpreter's bfloat16
    result on the same values, within the tuner's bf16 tolerance. (The GPU twin above measures
    every candidate on the hardware.)"""
    from ember.codegen import cuda, cuda_choices, tuning_db
    from ember.frontends import nn, optim, plan
    from ember.frontends.training import build_model
    from ember.ir import interpreter
    from ember.ir.dtypes import as_array, as_values
    from ember.ir.kernel import CONTRACTIONS
    from ember.runtime.tuner import TOLERANCE, _close, kernels_of
    from ember.codegen.cuda_kernels import counter_words, scratch_offset
    example = (np.zeros((2, 1, 28, 28), np.float32), np.zeros(2, np.int64))
    with tuning_db.using(None):
        graph = next(iter(plan(build_model(model), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example,
                               device="cuda", precision="bf16").values()))
    cases = []  # (kernel, sub, roles, values, want)
    for sub, spec in kernels_of(graph):
        if spec.kind not in CONTRACTIONS:
            continue
        values = {name: as_values(as_array(rng.standard_normal(sub.type(n).shape).astype(np.float32),
                                           sub.type(n).dtype), sub.type(n).dtype) for name, n in sub.inputs.items()}
        want = interpreter.run(sub, values).outputs["out"]
        firsts = {}
        for choice in cuda_choices.candidates(sub, spec):
            firsts.setdefault(choice[0], choice)
        roles = {role: f"in{i}" for role, i in spec.roles}
        if "mask" in roles:
            roles["mask_src"] = roles["mask"]
        for choice in firsts.values():
            kernel = cuda_choices.render(f"e{len(cases)}", sub, spec, choice, cuda.pointwise_epilogue(sub, spec))
            cases.append((kernel, sub, roles, values, want, choice))
    assert {c[5][0] for c in cases} >= {"gemm", "direct_tc", "direct", "small_window", "thin"} - (
        {"direct_tc", "direct"} if model == "lenet5" else set()), {c[5][0] for c in cases}
    lib = cuda_emulator.build([c[0] for c in cases], tmp_path, model)
    for i, (kernel, sub, roles, values, want, choice) in enumerate(cases):
        out_t = sub.type(sub.outputs["out"])
        bufs = {"out": as_array(np.full(out_t.shape, np.nan, np.float32), out_t.dtype)}
        for ln in kernel.launches:
            for r in ln.args:
                if r != "out" and r != "scratch" and scratch_offset(r) is None and counter_words(r) is None:
                    name = roles.get(r, r)
                    bufs[r] = np.ascontiguousarray(as_array(values[name], sub.type(sub.inputs[name]).dtype))
        cuda_emulator.run(lib, i, kernel, bufs)
        got = as_values(bufs["out"], out_t.dtype)
        assert np.all(np.isfinite(got)), (sub.name, choice)
        assert _close(got, want, TOLERANCE["bf16"]) is None, (sub.name, choice, _close(got, want, TOLERANCE["bf16"]))


# The GEMM family's bfloat16 path: operands staged two k a word (k, k + 1), fragments read as
# they are. (kind, geometry, split-K, run-time sizes)
GEMM_CASES = [
    ("matmul", dict(M=37, N=24, K=53, batch=1, trans_a=False, trans_b=False), False, False),  # odd K: a lone last k
    ("matmul", dict(M=20, N=40, K=96, batch=2, trans_a=True, trans_b=True), False, False),
    ("matmul", dict(M=16, N=12, K=300, batch=1, trans_a=False, trans_b=True), True, False),
    ("matmul", dict(M=24, N=32, K=77, batch=3, trans_a=True, trans_b=False), False, True),
    ("conv_fwd", dict(N=2, C=5, H=9, W=9, O=12, KH=3, KW=3, stride=1, padding=(1, 1)), False, False),
    ("conv_fwd", dict(N=2, C=6, H=10, W=10, O=16, KH=3, KW=3, stride=2, padding=(1, 1)), False, True),
    ("conv_gi", dict(N=2, C=6, H=10, W=10, O=16, KH=3, KW=3, stride=2, padding=(1, 1)), False, False),
    ("conv_gw", dict(N=2, C=8, H=7, W=7, O=8, KH=3, KW=3, stride=1, padding=(1, 1)), True, False),
    ("conv_gw", dict(N=3, C=4, H=9, W=8, O=6, KH=3, KW=3, stride=2, padding=(0, 1)), False, True),
    # the loaders' (k, k + 1) pairs: a pair across rows and images (odd planes), an odd K (the
    # last pair's high half outside), the no-padding pixel table (ptab) and the padded gather
    ("conv_gw", dict(N=3, C=4, H=7, W=7, O=8, KH=3, KW=3, stride=1, padding=(0, 0)), False, False),
    ("conv_gw", dict(N=2, C=4, H=8, W=9, O=8, KH=3, KW=3, stride=1, padding=(0, 0)), True, True),
    ("conv_gw", dict(N=3, C=4, H=5, W=5, O=6, KH=3, KW=3, stride=1, padding=(1, 1)), False, False),
    ("conv_gw", dict(N=3, C=5, H=6, W=7, O=6, KH=3, KW=3, stride=1, padding=(1, 1)), True, True),
]


def _gemm_bf16(kind, g, split, runtime, pair_words=False):
    from ember.codegen import cuda_kernels as ck
    HO, WO = cuda_refs.conv_out(g) if kind != "matmul" else (0, 0)
    if kind == "matmul":
        view = (g["M"], g["N"], g["K"], g["batch"], not g["trans_a"], g["trans_b"])
    elif kind == "conv_fwd":
        view = (g["N"] * HO * WO, g["O"], g["C"] * 9, 1, False, True)
    elif kind == "conv_gi":
        view = (*ck.grad_input_gemm(g["N"], g["C"], g["H"], g["W"], g["O"], 3, 3, g["stride"], g["padding"]), False, True)
    else:
        view = (g["O"], g["C"] * 9, g["N"] * HO * WO, 1, True, True)
    M, N, K, batch, a_kfast, b_kfast = view
    # pair_words: the tiles (and k-tiles of 32) that fit a k pair a word, as the tuner offers them
    plans = [p for p in ck.plan_candidates(M, N, K, batch, a_kfast=a_kfast, b_kfast=b_kfast, bf16=True,
                                           pair_words=pair_words) if (p.splits > 1) == split]
    assert plans, (kind, g, split)
    common = dict(plan=plans[0], runtime_batch=runtime)
    if kind == "matmul":
        return ck.render_matmul("k", **g, bias=True, bf16_roles=frozenset({"a", "b", "bias", "out"}), **common)
    if kind == "conv_fwd":
        return ck.render_conv2d_forward("k", **g, bias=True, relu=True, bf16_roles=frozenset({"x", "w", "bias", "out"}),
                                        **common)
    if kind == "conv_gi":
        return ck.render_conv2d_grad_input("k", **g, relu_mask=True, bf16_roles=frozenset({"dy", "w", "mask_src", "out"}),
                                           **common)
    return ck.render_conv2d_grad_weight("k", **g, bias=True, bf16_roles=frozenset({"x", "dy", "out"}), **common)


@pytest.mark.parametrize("pair_words", [False, True], ids=["planned", "pair_words"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GEMM_CASES)])
def test_bfloat16_gemm_kernels_give_the_bfloat16_reference(case, pair_words, tmp_path):
    """The pairs are staged as the loaders read them (a k past K a zero half), so odd K, split-K,
    run-time sizes, k-fast and n-fast operands and the grad-weight's fused row sum (db, float32)
    all give float64 sums of the bfloat16 values, rounded as the interpreter rounds; with the
    planner's tile and with the best of the tuner's word-counted ones (k-tiles of 32)."""
    kind, g, split, runtime = case
    kernel = _gemm_bf16(*case, pair_words=pair_words)
    assert "mma_bf16(" in kernel.code and "unsigned As[KS][SA]" in kernel.code
    bf = lambda shape: round_bf16(rng.standard_normal(shape).astype(np.float32))
    if kind == "matmul":
        a = bf((g["batch"], g["K"], g["M"]) if g["trans_a"] else (g["batch"], g["M"], g["K"]))
        b = bf((g["batch"], g["N"], g["K"]) if g["trans_b"] else (g["batch"], g["K"], g["N"]))
        v = {"a": a, "b": b, "bias": bf(g["N"])}
        mm = round_bf16(cuda_refs.matmul_ref(a, b, g).astype(np.float32))
        want, shape = round_bf16(mm + v["bias"]), (g["batch"], g["M"], g["N"])
    elif kind == "conv_fwd":
        HO, WO = cuda_refs.conv_out(g)
        v = {"x": bf((g["N"], g["C"], g["H"], g["W"])), "w": bf((g["O"], g["C"], 3, 3)), "bias": bf(g["O"])}
        conv = round_bf16(cuda_refs.conv_fwd_ref(v["x"], v["w"], None, g, relu=False).astype(np.float32))
        want, shape = np.maximum(round_bf16(conv + v["bias"][None, :, None, None]), 0), (g["N"], g["O"], HO, WO)
    elif kind == "conv_gi":
        HO, WO = cuda_refs.conv_out(g)
        v = {"dy": bf((g["N"], g["O"], HO, WO)), "w": bf((g["O"], g["C"], 3, 3)),
             "mask_src": bf((g["N"], g["C"], g["H"], g["W"]))}
        want = round_bf16(cuda_refs.conv_grad_input_ref(v["dy"], v["w"], g, v["mask_src"]).astype(np.float32))
        shape = want.shape
    else:
        HO, WO = cuda_refs.conv_out(g)
        v = {"x": bf((g["N"], g["C"], g["H"], g["W"])), "dy": bf((g["N"], g["O"], HO, WO))}
        dw, db = cuda_refs.conv_grad_weight_ref(v["x"], v["dy"], g)
        want, shape = round_bf16(dw.astype(np.float32)), dw.shape
    bf16 = frozenset(r for r in ("a", "b", "bias", "x", "w", "dy", "mask_src") if r in v) | {"out"}
    if kind == "conv_gw":
        v["db"] = np.full(g["O"], np.nan, np.float32)  # the row sum: float32 (a role of its own)
        bf16 = bf16 - {"db"}
    got = _run(kernel, v, bf16, shape, tmp_path)
    _check(got, want)
    if kind == "conv_gw":
        np.testing.assert_allclose(v["db"], db, rtol=1e-5, atol=1e-5)


def test_every_bfloat16_kernel_here_compiles_with_nvcc(tmp_path):
    """The sources above as NVRTC would get them (the bfloat16 helpers first), warning-free."""
    from ember.codegen import cuda
    from nvcc import assert_compiles, nvcc_or_skip
    nvcc = nvcc_or_skip()
    kernels = [_render(*case) for case in CASES] + [_direct_gw(*case) for case in GW_CASES] + [
        _small(*case) for case in SMALL_CASES] + [_gemm_bf16(*case, pair_words=w) for case in GEMM_CASES for w in (False, True)] + [
        _direct_tc_gw(*case) for case in GW_CASES]
    for i, kernel in enumerate(kernels):
        path = tmp_path / f"k{i}.cu"
        path.write_text(cuda.prelude(bf16=True) + kernel.code)
        assert_compiles(nvcc, path)
