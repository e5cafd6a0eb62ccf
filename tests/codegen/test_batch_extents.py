"""CPU kernels that take the batch at run time: their code is the same text at every batch size
(so one compiled object serves them all), the size itself is an argument (`extents`), and the
constants that are counts over the batch are computed from it, exactly."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ember.codegen import cpp_kernels as ck
from ember.codegen import conv_phase, grouped_conv, pool_kernels
from ember.codegen.compiler import compile_cpp
from ember.codegen.cpu_vector import cxx_flags, resolve
from ember.codegen.cpp import SPELLING
from ember.codegen.lowering import Extent

CONV = dict(C=8, H=12, W=12, O=16, KH=3, KW=3)


def _conv(kind: str, N: int, plan: ck.ConvPlan, **kw) -> ck.KernelSource:
    render = {"conv2d": ck.render_conv2d_forward, "conv2d_grad_input": ck.render_conv2d_grad_input,
              "conv2d_grad_weight": ck.render_conv2d_grad_weight}[kind]
    extra = {"conv2d": dict(bias=True, relu=True), "conv2d_grad_weight": dict(bias=False)}.get(kind, {})
    return render("k", N=N, **CONV, **kw, **extra, plan=plan)


@pytest.mark.parametrize("kind,stride,padding", [
    ("conv2d", 1, 0), ("conv2d", 1, 1), ("conv2d", 2, 1), ("conv2d_grad_input", 1, 1), ("conv2d_grad_input", 2, 1),
    ("conv2d_grad_weight", 1, 1), ("conv2d_grad_weight", 2, 0)])
def test_convolutions_are_one_text_for_every_batch(kind, stride, padding):
    geometry = dict(stride=(stride, stride), padding=(padding, padding))
    for plan in ck.conv_plans(kind, N=64, **CONV, **geometry, tune=True):
        big, small = _conv(kind, 64, plan, **geometry), _conv(kind, 3, plan, **geometry)
        assert big.code == small.code, plan
        assert (big.extents, small.extents) == ((64,), (3,))


@pytest.mark.parametrize("trans_a,trans_b,form", [(False, True, "dot"), (False, True, "axpy"), (True, False, "axpy"),
                                                  (False, False, "axpy")])
def test_matmuls_are_one_text_for_every_row_count_and_axpy_k(trans_a, trans_b, form):
    # x @ W^T (rows: the batch), dy @ W, and a weight gradient (k: the batch)
    for plan in ck.matmul_plans(form, M=64, N=40, K=96, trans_a=trans_a, trans_b=trans_b, tune=True):
        big = ck.render_matmul("k", M=64, N=40, K=96, trans_a=trans_a, trans_b=trans_b, plan=plan)
        k = 96 if form == "dot" else 5  # the dot form's k is the features' (in its code)
        small = ck.render_matmul("k", M=3, N=40, K=k, trans_a=trans_a, trans_b=trans_b, plan=plan)
        assert big.code == small.code, plan
        assert small.extents == ((1, 3) if form == "dot" else (1, 3, 5))
    batched = dict(N=40, K=96, trans_a=trans_a, trans_b=trans_b)  # attention's matrices: the batch times heads
    for plan in ck.matmul_plans(form, M=16, batch=8, **batched)[:1]:
        big = ck.render_matmul("k", M=16, batch=8, plan=plan, **batched)
        assert big.code == ck.render_matmul("k", M=16, batch=3, plan=plan, **batched).code and big.extents[0] == 8


@pytest.mark.parametrize("kind", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
@pytest.mark.parametrize("groups", [1, 4])
def test_phase_convolutions_are_one_text_for_every_batch_and_groups(kind, groups):
    """The images and the groups are run-time sizes: a batch of 7 after 64, or a batch folded into
    the groups (twice the groups of the same channels a group), is the same code."""
    attrs = dict(stride=(2, 2), padding=(1, 1), groups=groups)
    big, small = (grouped_conv.geometry((n, 8, 14, 14), (16, 8 // groups, 3, 3), attrs) for n in (64, 7))
    wide = grouped_conv.geometry((7, 16, 14, 14), (32, 8 // groups, 3, 3), dict(attrs, groups=2 * groups))
    isa = resolve()
    for plan in conv_phase.plans(kind, big, isa, tune=True):  # grad-weight: images stacked past a slot's 1 at N = 7
        a, _ = conv_phase.render("k", kind, big, plan, isa)
        b, _ = conv_phase.render("k", kind, small, plan, isa)
        c, _ = conv_phase.render("k", kind, wide, plan, isa)
        assert a.code == b.code == c.code, plan
        assert (a.extents, b.extents, c.extents) == ((64, groups), (7, groups), (7, 2 * groups)), plan


MM_CASES = [  # (trans_a, relu_mask, plan): a 6-row tile, so most row counts leave a shorter last tile
    (False, True, ck.AxpyPlan(6, 2, 1, False, True)), (True, False, ck.AxpyPlan(6, 1, 2, True, False)),
    (False, False, ck.DotPlan(4, 3, 64, False, True))]


def test_one_compiled_matmul_computes_every_row_count_and_k(tmp_path):
    N, K = 40, 70
    kernels, parts = [], []
    for i, (ta, mask, plan) in enumerate(MM_CASES):
        k = ck.render_matmul(f"mm{i}", M=64, N=N, K=K, trans_a=ta, trans_b=isinstance(plan, ck.DotPlan), plan=plan,
                             relu_mask=mask)
        nargs = 6 if mask else 5
        params = ", ".join([f"float* a{j}" for j in range(nargs)] + ["int64_t b", "int64_t m", "int64_t k"])
        sizes = "b, m" if isinstance(plan, ck.DotPlan) else "b, m, k"
        parts += [k.code, f'extern "C" void call{i}({params}) {{ mm{i}({", ".join(f"a{j}" for j in range(nargs))}, '
                          f'{sizes}); }}\n']
        kernels.append(k)
    lib = ctypes.CDLL(str(compile_cpp("\n".join(parts), flags=cxx_flags(resolve()), cache=tmp_path).path))
    rng = np.random.default_rng(0)
    scratch = np.zeros(1 << 22, np.float32)  # the panels of any k here
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for i, (ta, mask, plan) in enumerate(MM_CASES):
        dot = isinstance(plan, ck.DotPlan)
        for m in (1, 5, 6, 7, 13, 64):
            k = K if dot else m + 3  # the axpy form's k is a size it takes at run time too (a weight gradient's)
            a = rng.standard_normal((k, m) if ta else (m, k), dtype=np.float32)
            b = rng.standard_normal((N, k) if dot else (k, N), dtype=np.float32)
            want = (a.T if ta else a).astype(np.float64) @ (b.T if dot else b).astype(np.float64)
            c = np.full((m, N), np.nan, np.float32)
            fn = getattr(lib, f"call{i}")
            fn.argtypes = [ctypes.c_void_p] * (6 if mask else 5) + [ctypes.c_int64] * 3
            if mask:
                keep = rng.standard_normal((m, N), dtype=np.float32)
                fn(ptr(a), ptr(b), None, ptr(keep), ptr(c), ptr(scratch), 1, m, k)
                want = np.where(keep > 0, want, 0.0)
            else:
                fn(ptr(a), ptr(b), None, ptr(c), ptr(scratch), 1, m, k)
            np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=f"case {i}, m={m}, k={k}")


def test_pooling_and_grouped_convolutions_are_one_text_for_every_batch():
    attrs = dict(kernel=(2, 2), stride=(2, 2), padding=(0, 0))
    for kind in pool_kernels.POOL_KINDS:
        a, _ = pool_kernels.render_cpp("k", kind, pool_kernels.geometry((64, 8, 12, 12), attrs))
        b, _ = pool_kernels.render_cpp("k", kind, pool_kernels.geometry((5, 8, 12, 12), attrs))
        assert a.code == b.code and (a.extents, b.extents) == ((64,), (5,))
    conv = dict(stride=(1, 1), padding=(1, 1), groups=8)
    for kind in grouped_conv.CONV_KINDS:
        a, _ = grouped_conv.render_cpp("k", kind, grouped_conv.geometry((64, 8, 12, 12), (8, 1, 3, 3), conv))
        b, _ = grouped_conv.render_cpp("k", kind, grouped_conv.geometry((5, 8, 12, 12), (8, 1, 3, 3), conv))
        assert a.code == b.code and (a.extents, b.extents) == ((64,), (5,))


def _spell(extent: Extent, value: float) -> str | None:
    return extent.spell(np.float32(value), "float", SPELLING)


def test_counts_over_the_batch_are_computed_from_it_and_others_stay_literals():
    bn = Extent.pointwise((64, 64, 7, 7))       # BatchNorm's backward over N*H*W at N = C = 64
    assert _spell(bn, 64 * 49) == "static_cast<float>(n * 49)"
    assert _spell(bn, 1 / (64 * 49)) == "(1.0f / static_cast<float>(n * 49))"
    assert _spell(bn, 64 * 49 / (64 * 49 - 1)) == \
        "(static_cast<float>(n * 49) / static_cast<float>(n * 49 - 1))"
    assert _spell(bn, 1e-5) is None and _spell(bn, 0.5) is None
    pool = Extent.pointwise((7, 64, 7, 7))      # an average pool's backward, 1/(H*W), at N = 7 = W
    assert _spell(pool, 1 / 49) is None and _spell(pool, 49) is None
    loss = Extent.reduction((64, 10), (1,))     # a per-sample kernel of the loss's gradient: 1/N
    assert _spell(loss, -1 / 64) is None and _spell(loss, 1 / 64) == "(1.0f / static_cast<float>(n))"
    assert _spell(Extent.reduction((10, 10), (1,)), 1 / 10) is None  # a mean over the classes, N = 10
    stats = Extent.reduction((64, 8, 28, 28), (0, 2, 3))
    assert _spell(stats, 64 * 784) == "static_cast<float>(n * 784)" and _spell(stats, 1e-5) is None
    assert _spell(Extent.pointwise((1, 10)), 1.0) is None  # at one sample every whole number would match
    for value in (64 * 49, 1 / (64 * 49), 64 * 49 / (64 * 49 - 1)):  # each spelling is the literal's float
        text = _spell(bn, value).replace("static_cast<float>", "np.float32").replace("1.0f", "np.float32(1)")
        assert eval(text, {"np": np, "n": 64}) == np.float32(value)
