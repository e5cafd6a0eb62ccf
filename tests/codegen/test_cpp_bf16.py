"""The CPU's bfloat16 kernels (codegen/cpp_bf16.py, the bfloat16 spellings of the generated kernels,
max pooling) against the interpreter: every contraction kind, with its epilogues, on the path this
CPU has (`vdpbf16ps` where it has AVX512-BF16) and on the emulated one (16-lane and 8-lane).

A contraction's result may differ from the interpreter's by the last bit where the float32 sum,
taken in another order, lies next to a rounding boundary of bfloat16: allowed one bfloat16 step
(the spacing of bfloat16 at the value: 2^-8 to 2^-7 of it), plus float32's accumulation error;
most elements must agree bit for bit. (The native and emulated paths agree with each other bit
for bit on this CPU: the emulation is the instruction's arithmetic.)
Generated (pointwise, reduction) kernels and pooling round as the interpreter does: exact.

The contractions take the sizes that follow the batch at run time (a convolution's images, a
matmul's batch, rows and reduced length): one compiled kernel, planned for one batch, runs at
several others (one image, fewer than its chunks, more) against the interpreter, with its
scratch sized for each call and not written past.
"""
from __future__ import annotations

import ctypes
import dataclasses
import zlib

import numpy as np
import pytest

from ember import ir
from ember.codegen import cpp_bf16, cpp_units, cpu_vector
from ember.codegen.compiler import compile_cpp
from ember.ir import Graph, TensorType, bfloat16, float32
from ember.ir.dtypes import bf16_bits, bf16_values
from ember.ir.kernel import CONTRACTIONS

from models import plan_for, run_compiled

PATHS = ["native", "emulated", "avx2"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """The bfloat16 product path under test: the CPU's own (AMX tiles or AVX512-BF16; skipped
    without AVX512-BF16), emulated on 16 lanes, emulated on 8 (the avx2 variant)."""
    if request.param == "native":
        if not (cpu_vector.native_isa() == cpu_vector.AVX512 and cpu_vector.native_bf16()):
            pytest.skip("this CPU has no AVX512-BF16: its bfloat16 kernels are the emulated ones")
        monkeypatch.setenv(cpu_vector.BF16_ENV_VAR, "native")
        return cpu_vector.bf16_dot(cpu_vector.AVX512)  # "amx" where the CPU has the tiles
    if request.param == "avx2":
        monkeypatch.setenv(cpu_vector.ENV_VAR, "avx2")
    monkeypatch.setenv(cpu_vector.BF16_ENV_VAR, "emulated")
    return "emulated"


def _bits(rng, *shape, scale=1.0) -> np.ndarray:
    return bf16_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def _check(graph: Graph, inputs: dict, dot: str, reduction: int, device: str = "cpu",
           family: str = "bf16") -> None:
    """`graph` compiled for `device` gives the interpreter's "out" (see the module docstring); on
    the CPU its bfloat16 contractions multiply by `dot` (the bf16 family; the grouped family's
    loops have no `dot`), on CUDA in one kernel of whichever family the prior ranks first (every
    CUDA family's bfloat16 path is tested on its own in test_cuda_bf16_families.py)."""
    want = ir.run(graph, inputs).outputs["out"]
    planned, out = run_compiled(graph, device, inputs)
    specs = [planned.attrs(n)["kernel"] for n in planned.g
             if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind in CONTRACTIONS]
    families = {spec.choice[0]: dict(spec.choice[1]).get("dot") for spec in specs}
    want_families = {family: dot if family == "bf16" else None}
    if device == "cpu":
        assert families == want_families  # the dump shows the path
    else:
        assert len(specs) == 1, families
    got = bf16_values(out["out"]) if out["out"].dtype == np.uint16 else out["out"]
    _assert_close(got, want, reduction)


def _assert_close(got: np.ndarray, want: np.ndarray, reduction: int) -> None:
    """Within one bfloat16 step and float32's accumulation error; mostly bit for bit."""
    assert got.shape == want.shape
    scale = max(float(np.max(np.abs(want))), 1e-30)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.maximum(np.abs(want), np.abs(got)), 1e-30))) - 7)  # one bfloat16 step
    tol = step + 1e-6 * np.sqrt(reduction) * scale
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) - tol))
    assert np.mean(got == want) >= 0.9  # a boundary case now and then, not a different sum


CONVS = [  # name, N, C, H, W, O, KH, KW, stride, padding
    ("mnist_conv1", 3, 1, 28, 28, 16, 3, 3, (1, 1), (0, 0)),
    ("mnist_conv2", 2, 16, 26, 26, 32, 3, 3, (1, 1), (0, 0)),
    ("stride2_pad1", 2, 5, 11, 9, 7, 3, 3, (2, 2), (1, 1)),
    ("k1_odd", 1, 3, 5, 7, 33, 1, 1, (1, 1), (0, 0)),
    ("k5_pad2_rect", 2, 4, 9, 12, 9, 5, 3, (1, 2), (2, 1)),
    ("pad1_odd_c", 2, 3, 7, 9, 5, 3, 3, (1, 1), (1, 1)),     # stride 1, padded: the direct mode
    ("k5_pad2", 1, 5, 8, 6, 4, 5, 5, (1, 1), (2, 2)),
    ("k1_pad1", 1, 2, 4, 5, 3, 1, 1, (1, 1), (1, 1)),        # grad-input: padding past the kernel
    ("k1_s2", 2, 4, 7, 8, 6, 1, 1, (2, 2), (0, 0)),           # grad-input: three phases no tap reaches
]


GROUPED = [  # name, N, C, H, W, O, KH, KW, stride, padding, groups
    ("depthwise", 2, 6, 9, 11, 6, 3, 3, (1, 1), (1, 1), 6),
    ("depthwise_s2", 2, 5, 10, 9, 5, 3, 3, (2, 2), (1, 1), 5),
    ("grouped_3x2", 2, 6, 7, 8, 9, 3, 3, (1, 1), (0, 1), 3),    # 2 input and 3 output channels a group
    ("depthwise_x2_k5", 1, 3, 8, 8, 6, 5, 5, (1, 1), (2, 2), 3),  # a channel multiplier, a 5x5 window
]


def _conv_graph(case, kind: str, epilogue: bool) -> tuple[Graph, dict, int]:
    _, n, c, h, w, o, kh, kw, stride, padding = case[:10]
    groups = case[10] if len(case) > 10 else 1
    rng = np.random.default_rng(zlib.crc32(f"{case[0]}/{kind}".encode()))
    g = Graph(kind)
    at = dict(stride=stride, padding=padding, **({"groups": groups} if groups != 1 else {}))
    c_in = c // groups  # the weight's input channels
    ho = (h + 2 * padding[0] - kh) // stride[0] + 1
    wo = (w + 2 * padding[1] - kw) // stride[1] + 1
    if kind == "conv2d":
        x = g.add_input("x", TensorType((n, c, h, w), bfloat16))
        wt = g.add_input("w", TensorType((o, c_in, kh, kw), bfloat16))
        y = g.add("conv2d", [x, wt], **at)
        inputs = {"x": _bits(rng, n, c, h, w), "w": _bits(rng, o, c_in, kh, kw, scale=0.3)}
        if epilogue:
            b = g.add_input("b", TensorType((o,), bfloat16))
            y = g.add("relu", [g.add("add", [y, g.add("reshape", [b], shape=(o, 1, 1))])])
            inputs["b"] = _bits(rng, o)
        reduction = c_in * kh * kw
    elif kind == "conv2d_grad_input":
        dy = g.add_input("dy", TensorType((n, o, ho, wo), bfloat16))
        wt = g.add_input("w", TensorType((o, c_in, kh, kw), bfloat16))
        y = g.add("conv2d_grad_input", [dy, wt], input_shape=(n, c, h, w), **at)
        inputs = {"dy": _bits(rng, n, o, ho, wo), "w": _bits(rng, o, c_in, kh, kw, scale=0.3)}
        if epilogue:  # ReLU's backward: where(mask > 0, ., 0)
            m = g.add_input("m", TensorType((n, c, h, w), bfloat16))
            zero = g.add_constant(0.0, dtype=bfloat16)
            y = g.add("where", [g.add("gt", [m, zero]), y, zero])
            inputs["m"] = _bits(rng, n, c, h, w)
        reduction = o // groups * kh * kw
    else:
        x = g.add_input("x", TensorType((n, c, h, w), bfloat16))
        dy = g.add_input("dy", TensorType((n, o, ho, wo), bfloat16))
        y = g.add("conv2d_grad_weight", [x, dy], weight_shape=(o, c_in, kh, kw), **at)
        inputs = {"x": _bits(rng, n, c, h, w), "dy": _bits(rng, n, o, ho, wo)}
        reduction = n * ho * wo
    g.set_output("out", y)
    return g, inputs, reduction


@pytest.mark.parametrize("case", CONVS, ids=[c[0] for c in CONVS])
@pytest.mark.parametrize("kind", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_convolutions(case, kind, path):
    graph, inputs, reduction = _conv_graph(case, kind, epilogue=kind != "conv2d_grad_weight")
    _check(graph, inputs, path, reduction)


@pytest.mark.parametrize("case", GROUPED, ids=[c[0] for c in GROUPED])
@pytest.mark.parametrize("kind", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_grouped_convolutions(case, kind, path):
    """Grouped and depthwise convolutions: the bf16 family's direct mode (forward, grad-input) and
    taps mode (grad-weight); and the grouped family's loops on bfloat16 operands (the tuner's
    other candidate)."""
    graph, inputs, reduction = _conv_graph(case, kind, epilogue=kind != "conv2d_grad_weight")
    _check(graph, inputs, path, reduction)
    from ember.codegen import cpp_choices
    with cpp_choices.force("grouped"):
        _check(graph, inputs, path, reduction, family="grouped")


MATMULS = [  # name, M, N, K, trans_a, trans_b, batch, bias, relu
    ("linear_fwd", 64, 10, 300, False, True, 1, True, False),
    ("linear_grad_w", 10, 70, 64, True, False, 1, False, False),
    ("hidden_relu", 33, 47, 29, False, False, 1, True, True),
    ("batched_tt", 7, 19, 21, True, True, 3, False, False),
]
# the CPU's modes besides (tests/codegen/test_cuda_bf16.py runs MATMULS on a GPU)
CPU_MATMULS = MATMULS + [
    ("batched_abt_tail", 9, 13, 45, False, True, 2, True, True),   # the dot mode, a partial vector of k
    ("odd_k_ta", 17, 40, 17, True, False, 1, False, False),
]


def matmul_graph(case) -> tuple[Graph, dict, int]:
    _, m, n, k, ta, tb, batch, bias, relu = case
    rng = np.random.default_rng(7)
    lead = (batch,) if batch > 1 else ()
    g = Graph("mm")
    a_shape = lead + ((k, m) if ta else (m, k))
    b_shape = lead + ((n, k) if tb else (k, n))
    a, b = g.add_input("a", TensorType(a_shape, bfloat16)), g.add_input("b", TensorType(b_shape, bfloat16))
    perm = tuple(range(len(lead))) + (len(lead) + 1, len(lead))
    y = g.add("matmul", [g.add("transpose", [a], perm=perm) if ta else a, g.add("transpose", [b], perm=perm) if tb else b])
    inputs = {"a": _bits(rng, *a_shape), "b": _bits(rng, *b_shape, scale=0.2)}
    if bias:
        v = g.add_input("v", TensorType((n,), bfloat16))
        y = g.add("add", [y, v])
        inputs["v"] = _bits(rng, n)
    if relu:
        y = g.add("relu", [y])
    g.set_output("out", y)
    return g, inputs, k


@pytest.mark.parametrize("case", CPU_MATMULS, ids=[c[0] for c in CPU_MATMULS])
def test_matmuls(case, path):
    graph, inputs, k = matmul_graph(case)
    _check(graph, inputs, path, k)


def pointwise_and_pooling_graph() -> tuple[Graph, dict]:
    """Casts, bfloat16 arithmetic with broadcasting, a bfloat16 sum (float32 accumulator,
    rounded once), max pooling and its gradient (overlapping windows: sums in float)."""
    g = Graph("pw")
    x = g.add_input("x", TensorType((2, 3, 9, 9), float32))
    b = g.add_input("b", TensorType((3,), float32))
    xb = g.add("cast", [x], dtype=bfloat16)
    y = g.add("mul", [g.add("add", [xb, g.add("reshape", [g.add("cast", [b], dtype=bfloat16)], shape=(3, 1, 1))]), xb])
    y = g.add("relu", [y])
    pool = dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1))
    p = g.add("max_pool2d", [y], **pool)
    dx = g.add("max_pool2d_grad", [y, g.add("sub", [p, g.add_constant(0.3, dtype=bfloat16)])], **pool)
    s = g.add("sum", [dx], axes=(0, 2, 3))
    g.set_output("out", g.add("add", [g.add("cast", [s], dtype=float32),
                                      g.add("cast", [g.add("sum", [p], axes=(0, 2, 3))], dtype=float32)]))
    rng = np.random.default_rng(3)
    inputs = {"x": (rng.standard_normal((2, 3, 9, 9)) * 3).astype(np.float32),
              "b": rng.standard_normal(3).astype(np.float32)}
    return g, inputs


def test_generated_kernels_and_pooling_round_as_the_interpreter():
    """The generated kernels and pooling round as the interpreter does: exact."""
    g, inputs = pointwise_and_pooling_graph()
    want = ir.run(g, inputs).outputs["out"]
    _, got = run_compiled(g, "cpu", inputs)
    assert np.array_equal(got["out"], want)


# --------------------------------------------------------------------------- one kernel, any batch

def _conv_geometry(case, kind: str, dot: str, epilogue: bool) -> dict:
    """The family's geometry of a CONVS case (cpp_choices.geometry's keys)."""
    _, n, c, h, w, o, kh, kw, stride, padding = case[:10]
    groups = case[10] if len(case) > 10 else 1
    ho, wo = (h + 2 * padding[0] - kh) // stride[0] + 1, (w + 2 * padding[1] - kw) // stride[1] + 1
    eps = {"conv2d": ("bias", "relu"), "conv2d_grad_input": ("relu_mask",)}.get(kind, ()) if epilogue else ()
    return dict(kind=kind, epilogues=eps, N=n, C=c, H=h, W=w, O=o, KH=kh, KW=kw, stride=stride, padding=padding,
                HO=ho, WO=wo, dtype="bfloat16", bf16_dot=dot, **({"groups": groups} if groups != 1 else {}))


def _mm_geometry(case, dot: str) -> dict:
    _, m, n, k, ta, tb, batch, bias, relu = case
    eps = tuple(e for e, on in (("bias", bias), ("relu", relu)) if on)
    return dict(kind="matmul", epilogues=eps, M=m, N=n, K=k, batch=batch, trans_a=ta, trans_b=tb, dtype="bfloat16",
                bf16_dot=dot)


#: (case, kind or "matmul", the batch it is planned for, the batches it runs at), each run with
#: every plan the tuner may pick: convolutions in every mode (direct of stride 1 and 2, its
#: grad-weight, gemm; grouped: direct and taps), matmuls (dot, gemm) whose rows, k and batch
#: follow the batch. The
#: forward runs without its bias: `_assert_close` allows a step of the result, and where the bias
#: cancels the sum the sum's step is larger (1 of 313k outputs at 17 images, the step compiled for 17
#: as well); grad-input keeps its ReLU mask (read at each image's offset)
_EPILOGUE = {"conv2d_grad_input"}
BATCH_RUNS = [
    *((CONVS[1], kind, 24, (24, 1, 3, 17)) for kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")),
    *((CONVS[2], kind, 24, (24, 1, 5, 19)) for kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")),
    *((GROUPED[1], kind, 6, (6, 1, 3, 19)) for kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")),
    *((GROUPED[2], kind, 6, (6, 1, 4)) for kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")),
    (MATMULS[0], "matmul", 64, ((64, 300, 1), (1, 300, 1), (7, 300, 1))),       # (M, K, batch): x @ W^T's rows
    (MATMULS[1], "matmul", 64, ((10, 64, 1), (10, 1, 1), (10, 23, 1))),         # a weight gradient's k
    (MATMULS[3], "matmul", 3, ((7, 21, 3), (1, 21, 1), (9, 5, 2))),             # batched, transposed
    (CPU_MATMULS[4], "matmul", 2, ((9, 45, 2), (1, 45, 1), (20, 13, 3), (5, 64, 1))),  # a @ b^T: dot, k's tail
]


def _with_batch(case, kind: str, run) -> tuple:
    if kind == "matmul":
        m, k, b = run
        return (case[0], m, case[2], k, *case[4:6], b, *case[7:])
    return (case[0], run, *case[2:])


@pytest.mark.parametrize("dot", ["emulated", "avx512bf16"])
def test_one_compiled_kernel_serves_every_batch(tmp_path, dot):
    """Each kernel planned for one batch (every plan of the tuner's list: each mode) is the same
    code at another, and, compiled once, computes the interpreter's result at every batch it runs
    at, within the scratch sized for that batch."""
    isa = cpu_vector.resolve()
    if dot == "avx512bf16" and not (isa == cpu_vector.AVX512 and cpu_vector.native_bf16()):
        pytest.skip("this CPU has no AVX512-BF16")
    todo = _every_batch_cases(dot, isa, lambda g: cpp_bf16.plans(g, isa, tune=True))
    assert {p.mode for *_, p in todo} == {"direct", "gemm", "dot", "taps"}
    _run_every_batch(tmp_path, dot, isa, todo)


AMX_MODES = ("amx", "direct_amx")
#: channels past one AMX step on both sides (40 in: 20 pairs, two steps of 16 with a zero tail; 20
#: out: a tile of 32 rows half filled; a grad-weight's 40 input channels: three column tiles of 16
#: at each tap, a 32-column plan pairing them across taps)
WIDE = ("wide_pad1", 2, 40, 9, 8, 20, 3, 3, (1, 1), (1, 1))
AMX_RUNS = BATCH_RUNS + [(WIDE, kind, 2, (2, 1, 3)) for kind in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")]


def _amx_plans(g: dict, isa) -> list:
    """The plans on AMX tiles (the GEMM mode's and the direct mode's) of the tuner's list where the
    CPU has AMX, for `g`'s products."""
    plans = cpp_bf16.plans({**g, "bf16_dot": "amx"}, isa, tune=True)
    return [dataclasses.replace(p, dot=g["bf16_dot"]) for p in plans if p.mode in AMX_MODES]


@pytest.mark.parametrize("variant", ["native", "avx2"])
def test_the_amx_mode_emulated_serves_every_batch(tmp_path, variant):
    """The modes on AMX tiles (the GEMM mode's and the direct mode's, every tile of the tuner's
    list: 16 or 32 rows and columns) with the tile instructions' arithmetic in C++: A packed row by
    row (direct: a tap's weight), k padded to whole steps of 16 pairs (direct: zero channel planes),
    C through the tiles, at every batch each kernel runs at, against the interpreter (on this CPU's
    vectors and on 8-lane ones); and the same kernels with the instructions compile."""
    isa = cpu_vector.resolve() if variant == "native" else cpu_vector.AVX2
    todo = _amx_cases("emulated", isa)
    kinds = {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"}
    assert {(kind, p.mode) for _, kind, _, _, p in todo} == \
        {("matmul", "amx")} | {(k, m) for k in kinds for m in AMX_MODES}
    _run_every_batch(tmp_path, "emulated", isa, todo)
    # the instructions themselves: a kernel of each tile, mode and case, compiled for a CPU with AMX
    avx512 = cpu_vector.AVX512
    firsts = {(c[0], kind, p.mode, p.mr, p.nv): (g, p) for c, kind, _, g, p in todo}
    code = "\n".join(cpp_bf16.render(f"x{i}", {**g, "bf16_dot": "amx"}, dataclasses.replace(p, dot="amx", nv=p.nv * isa.lanes // 16),
                                      avx512)[0].code for i, (g, p) in enumerate(firsts.values()))
    assert "_tile_dpbf16ps(" in code
    compile_cpp(cpp_units.prelude(bf16=True)[1] + "\n" + code + "\n",
                flags=cpu_vector.cxx_flags(avx512) + cpu_vector.bf16_flags(avx512, {"amx"}) + ("-c",),
                cache=tmp_path / "amx")


def test_the_amx_mode_on_the_tiles_serves_every_batch(tmp_path):
    """Where the CPU has AMX (and Linux grants this process the tile state: `native_amx` asks),
    every tile of the amx mode with the instructions themselves, at every batch each kernel runs
    at, against the interpreter: the planner ranks the mode last there, so the native-path tests
    above no longer run it."""
    if cpu_vector.bf16_dot(cpu_vector.AVX512, "native") != "amx":
        pytest.skip("this CPU has no AMX tiles (or Linux refused the tile state)")
    _run_every_batch(tmp_path, "amx", cpu_vector.AVX512, _amx_cases("amx", cpu_vector.AVX512))


def _amx_cases(dot: str, isa) -> list:
    """The batch runs with every AMX tile of the tuner's list (the GEMM mode's: ungrouped; the
    direct mode's: a grouped forward and grad-input too), products by `dot`."""
    todo = _every_batch_cases(dot, isa, lambda g: _amx_plans(g, isa), AMX_RUNS)
    for mode in AMX_MODES:
        assert {(p.mr, p.nv * isa.lanes) for *_, p in todo if p.mode == mode} == set(cpp_bf16.AMX_TILES)
    assert any(len(case) > 10 and p.mode == "direct_amx" for case, *_, p in todo)
    return todo


def _geometry(case, kind: str, dot: str) -> dict:
    return _mm_geometry(case, dot) if kind == "matmul" else _conv_geometry(case, kind, dot, kind in _EPILOGUE)


def _every_batch_cases(dot: str, isa, plans_of, runs=None) -> list:
    todo = []
    for case, kind, planned, runs_at in runs or BATCH_RUNS:
        g = _geometry(_with_batch(case, kind, planned if kind != "matmul" else runs_at[0]), kind, dot)
        todo += [(case, kind, runs_at, g, plan) for plan in plans_of(g)]
    return todo


def _run_every_batch(tmp_path, dot: str, isa, todo: list) -> None:
    parts, kernels = [cpp_units.prelude(bf16=True)[1]], []
    for i, (case, kind, runs, g, plan) in enumerate(todo):
        ks, roles = cpp_bf16.render(f"k{i}", g, plan, isa)
        for run in runs:  # the same text at every batch it runs at
            assert cpp_bf16.render(f"k{i}", _geometry(_with_batch(case, kind, run), kind, dot), plan, isa)[0].code == ks.code
        sizes = ["int64_t e0", "int64_t e1", "int64_t e2"][:len(ks.extents)]
        params = ", ".join([f"void* a{j}" for j in range(len(roles))] + sizes)
        args = [f"static_cast<{'float' if r == 'scratch' else 'uint16_t'}*>(a{j})" for j, r in enumerate(roles)]
        parts += [ks.code, f'extern "C" void call{i}({params}) {{ k{i}({", ".join(args + [z.split()[1] for z in sizes])}); }}']
        kernels.append((plan, roles, len(ks.extents)))
    flags = cpu_vector.cxx_flags(isa) + cpu_vector.bf16_flags(isa, {dot})
    lib = ctypes.CDLL(str(compile_cpp("\n".join(parts) + "\n", flags=flags, cache=tmp_path).path))
    ptr = lambda a: None if a is None else a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for i, (case, kind, runs, _, _) in enumerate(todo):
        plan, roles, nsizes = kernels[i]
        for run in runs:
            c = _with_batch(case, kind, run)
            graph, inputs, reduction = matmul_graph(c) if kind == "matmul" else \
                _conv_graph(c, kind, epilogue=kind in _EPILOGUE)
            want = ir.run(graph, inputs).outputs["out"]
            data = {"x": inputs.get("x"), "w": inputs.get("w"), "dy": inputs.get("dy"), "a": inputs.get("a"),
                    "b": inputs.get("b") if kind == "matmul" else None,
                    "bias": inputs.get("v") if kind == "matmul" else inputs.get("b"), "mask": inputs.get("m")}
            out = np.zeros(want.shape, np.uint16)
            words = cpp_bf16.scratch_bytes(_geometry(c, kind, dot), plan, isa) // 4
            scratch = np.full(words + 64, np.nan, np.float32)
            scratch[words:] = 1234.5
            fn = getattr(lib, f"call{i}")
            fn.argtypes = [ctypes.c_void_p] * len(roles) + [ctypes.c_int64] * nsizes
            arrays = [out if r == "out" else scratch if r == "scratch" else None if r is None else data[r] for r in roles]
            extents = (c[6], c[1], c[3]) if kind == "matmul" else (c[1],)
            fn(*map(ptr, arrays), *extents[:nsizes])
            assert np.all(scratch[words:] == 1234.5), f"{kind} {case[0]} at {run}: wrote past its scratch"
            try:
                _assert_close(bf16_values(out), want, reduction)
            except AssertionError as e:
                raise AssertionError(f"{kind} {case[0]} planned {plan} run at {run}") from e


# strided (direct in phase planes; grad-input: GEMM), cropped (grad-input of padding past the
# kernel), a rectangular stride; matmuls of every layout, odd and partial k, batched (dot, GEMM)
EVERY_PLAN = [("conv", c, k) for c in CONVS for k in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
              if c[0] == "stride2_pad1" or (c[0], k) in {("k1_pad1", "conv2d_grad_input"), ("k5_pad2_rect", "conv2d"),
                                                          ("k1_s2", "conv2d_grad_input")}] + \
    [("matmul", c, None) for c in CPU_MATMULS if c[0] in ("hidden_relu", "batched_tt", "batched_abt_tail", "odd_k_ta")]


@pytest.mark.parametrize("what,case,kind", EVERY_PLAN, ids=[f"{c[0]}-{k or 'matmul'}" for _, c, k in EVERY_PLAN])
def test_every_plan_matches_the_interpreter(what, case, kind):
    """Every plan the tuner may pick (each mode: direct, dot, GEMM; tile heights and widths) gives
    the interpreter's result within one bfloat16 step, on this CPU's product path."""
    from ember.codegen import cpp_choices
    from ember.codegen.tuning_db import choice_text
    from ember.runtime.tuner import kernels_of
    from ember.runtime.tuner_cpu import CpuMeasurer
    graph = _conv_graph(case, kind, epilogue=kind != "conv2d_grad_weight")[0] if what == "conv" else matmul_graph(case)[0]
    planned = plan_for(graph, "cpu")
    [(sub, spec)] = [(s, k) for s, k in kernels_of(planned) if k.kind in CONTRACTIONS]
    measurer = CpuMeasurer(rounds=1, target_s=0.0)
    inputs = measurer.inputs(sub)
    want = ir.run(sub, inputs).outputs["out"]
    want = (bf16_values(want) if want.dtype == np.uint16 else want).astype(np.float64)
    choices = cpp_choices.candidates(sub, spec)
    modes = {dict(plan)["mode"] for _, plan in choices}
    assert "gemm" in modes and ("direct" in modes) == (what == "conv")
    scale = max(float(np.max(np.abs(want))), 1e-30)
    for trial in measurer.measure(sub, spec, choices):
        assert trial.error is None, trial.error
        got = trial.output.astype(np.float64)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.maximum(np.abs(want), np.abs(got)), 1e-30))) - 7)
        assert np.all(np.abs(got - want) <= step + 1e-6 * scale), choice_text(trial.choice)


@pytest.mark.parametrize("k,s,p,size,taps", [
    (3, 2, 1, 11, [(1, 1), (1, 2), (2, 1), (2, 2)]),  # rows a = 0: kh 1; a = 1: kh 0, 2
    (1, 2, 0, 7, [(1, 1), None, None, None]),
    (5, 3, 2, 10, [(1, 1), (1, 2), (1, 2), (2, 1), (2, 2), (2, 2), (2, 1), (2, 2), (2, 2)]),
])
def test_a_strided_grad_input_runs_as_its_output_phases(k, s, p, size, taps):
    """Each output phase (a, b) of a stride-s grad-input reads the taps kh = (a + p) mod s, + s, ...
    of the window: its (rows, columns) of taps, and its outputs the dx positions of the phase."""
    from ember.codegen import cpp_bf16
    ho = (size + 2 * p - k) // s + 1
    g = dict(kind="conv2d_grad_input", N=2, C=3, H=size, W=size, O=4, KH=k, KW=k, stride=(s, s), padding=(p, p),
             HO=ho, WO=ho, epilogues=[])
    phases = cpp_bf16.grad_input_phases(cpp_bf16.direct_of(g))
    assert [(dp.KH, dp.KW) if dp else None for _, _, dp in phases] == taps
    for a, b, dp in phases:
        reach = [len([kh for kh in range(k) if (e + p - kh) % s == 0]) for e in (a, b)]
        assert (dp.KH, dp.KW) == tuple(reach) if dp else 0 in reach
        if dp is not None:
            assert (dp.HOUT, dp.WOUT, dp.SH, dp.DH) == (len(range(a, size, s)), len(range(b, size, s)), 1, 1)
