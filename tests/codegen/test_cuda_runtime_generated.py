"""The generated CUDA kinds (reductions, the softmax cross-entropy loss and its gradient, pointwise
kernels with counts over the batch) on run-time sizes, without a GPU: what a step whose plans came
from a step of another batch size runs (its plan `cuda_choices.RUNTIME`), so the first step of a
model can build them ahead (`cuda.reused_variants`) and a later batch size compiles none of them.
Each is rendered at two batch sizes: one text, the batch a by-value argument; at both sizes it
gives the interpreter's values in the CPU emulation of its own source (cuda_emulator.py), a split
reduction too, whose split count is its launch's (gridDim.y, 1 at a small batch)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda, cuda_choices
from ember.ir import Graph, TensorType, run
from models import plan_for
from test_multi_output_kernels import _inputs, _normalise

rng = np.random.default_rng(17)


def _argmax_rows(shape: tuple[int, ...]) -> Graph:
    g = Graph("argmax_rows")
    x = g.add_input("x", TensorType(shape))
    g.set_output("i", g.add("cast", [g.add("argmax", [x], axis=1)], dtype="float32"))
    return g


def _sum_leading(shape: tuple[int, ...], axes: tuple[int, ...]) -> Graph:
    """sum(x * x) over `axes` (the leading one among them), scaled by 1/count: a bias gradient's
    or a loss mean's shape, the count over the batch computed from the argument."""
    g = Graph("sum_leading")
    x = g.add_input("x", TensorType(shape))
    count = g.add_constant(float(np.prod([shape[a] for a in axes])), "float32")
    g.set_output("s", g.add("div", [g.add("sum", [g.add("mul", [x, x])], axes=axes), count]))
    return g


# (graph at a batch size, the batch sizes): the batch reduced (split or a block an output, one loop
# or several) or kept (lanes, a thread, a block an output), and an argmax's flat walk
CASES = {
    "batch-norm": (lambda n: _normalise((n, 3, 6, 7), (0, 2, 3)), (5, 2)),
    "batch-norm-split": (lambda n: _normalise((n, 4, 16, 16), (0, 2, 3)), (37, 3)),
    "layer-norm": (lambda n: _normalise((n, 5, 50), (2,)), (6, 2)),
    "layer-norm-short": (lambda n: _normalise((n, 5, 7), (2,)), (6, 3)),
    "layer-norm-long": (lambda n: _normalise((n, 3, 300), (2,)), (4, 2)),
    "bias-gradient": (lambda n: _sum_leading((n, 6), (0,)), (40, 3)),
    "column-sums": (lambda n: _sum_leading((n, 5, 8), (0, 1)), (9, 2)),
    # outputs enough to fill the GPU (H200: 8 blocks a multiprocessor): a block an output, flat
    "wide": (lambda n: _sum_leading((n, 1100, 2), (0, 2)), (3, 2)),
    "argmax": (lambda n: _argmax_rows((n, 70)), (5, 3)),
}


def _runtime_reduction(graph: Graph) -> tuple[Graph, cuda_emulator.CudaKernel]:
    planned = plan_for(graph, "cuda")
    (node,) = [n for n in planned.g if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "reduction"]
    sub, spec = planned.attrs(node)["graph"], planned.attrs(node)["kernel"]
    choice = ("reduction", cuda_choices.RUNTIME)
    kernel = cuda_choices.render(sub.name, sub, dataclasses.replace(spec, choice=choice), choice)
    assert kernel.scratch_bytes == cuda_choices.scratch_bytes(sub, spec, choice)
    return sub, kernel


@pytest.mark.parametrize("case", list(CASES))
def test_a_reduction_on_run_time_sizes_is_one_text_and_the_interpreters_values(case, tmp_path):
    make, batches = CASES[case]
    texts = set()
    for batch in batches:
        sub, kernel = _runtime_reduction(make(batch))
        texts.add(kernel.code)
        assert all(ln.scalars == (("int", batch),) for ln in kernel.launches), kernel.launches
        inputs = {k: np.ascontiguousarray(v) for k, v in _inputs(sub).items()}
        cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, f"{case}{batch}", rtol=2e-5, atol=2e-5)
    assert len(texts) == 1


def test_a_split_reductions_count_is_its_launchs():
    """BatchNorm's statistics over 37 images of 16x16 split (the count follows the batch, one
    split at 3 images), the code reading gridDim.y: the same text either way."""
    make, _ = CASES["batch-norm-split"]
    (big_sub, big), (_, small) = _runtime_reduction(make(37)), _runtime_reduction(make(3))
    assert big.code == small.code and "gridDim.y" in big.code
    assert big.launches[0].grid[1] > 1 and small.launches[0].grid[1] == 1
    assert big.scratch_bytes > small.scratch_bytes > 0


@pytest.mark.parametrize("rows", [5, 300])
def test_the_loss_and_its_gradient_on_run_time_rows(rows, tmp_path):
    """One text at 5 and 300 rows; loss and dlogits as the float64 reference (1/N as the
    specialised kernels' literal: the same bits for the gradient)."""
    from ember.codegen import cuda_kernels as ck
    classes = 10
    z = rng.normal(0, 3, (rows, classes)).astype(np.float32)
    labels = rng.integers(0, classes, rows).astype(np.int64)
    labels[0] = classes  # out of range: a one-hot row of zeros
    loss, grad = (ck.render_softmax_cross_entropy("kl", N=rows, C=classes, runtime_rows=True),
                  ck.render_softmax_cross_entropy_grad("kg", N=rows, C=classes, runtime_rows=True))
    assert loss.code == ck.render_softmax_cross_entropy("kl", N=7, C=classes, runtime_rows=True).code
    assert grad.code == ck.render_softmax_cross_entropy_grad("kg", N=7, C=classes, runtime_rows=True).code
    special = ck.render_softmax_cross_entropy_grad("s", N=rows, C=classes)
    z64 = z.astype(np.float64)
    p = np.exp(z64 - z64.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.zeros_like(p)
    valid = labels < classes
    onehot[np.arange(rows)[valid], labels[valid]] = 1
    want_loss = -(np.log(p) * onehot).sum() / rows
    lib = cuda_emulator.build([loss, grad, special], tmp_path, f"loss{rows}")
    got = {}
    for index, kernel, out in ((0, loss, "loss"), (1, grad, "dlogits"), (2, special, "dlogits")):
        b = {"logits": z, "labels": labels, out: np.full((1,) if out == "loss" else z.shape, np.nan, np.float32)}
        _run_with_int64(lib, index, kernel, b)
        got[index] = b[out]
    np.testing.assert_allclose(got[0][0], want_loss, rtol=2e-6)
    np.testing.assert_allclose(got[1], (p - onehot) / rows, rtol=2e-5, atol=1e-7)
    np.testing.assert_array_equal(got[1], got[2])


def _run_with_int64(lib, index, kernel, bufs) -> None:
    """`cuda_emulator.run` for the loss kernels, whose labels are int64 (its checks take float buffers)."""
    import ctypes
    entry = getattr(lib, f"emu_launch_{index}")
    for i, ln in enumerate(kernel.launches):
        arrays = [bufs[r] for r in ln.args]
        ptrs = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
        entry(ctypes.c_int(i), ptrs)


def test_a_later_steps_generated_kernels_take_run_time_sizes_and_the_first_builds_them_ahead():
    """ResNet-8's step at 6 given the plans of its step at 4: every reduction and every pointwise
    kernel not writing parameters alone is stamped RUNTIME (its scratch reserved as its kernel
    needs: `render_step` checks) and is a unit `reused_variants` of the step at 4 built."""
    from models import first_and_later

    first, later = first_and_later("resnet8", 4, 6)
    ahead = {code for code, _ in cuda.reused_variants(first)}
    source = cuda.render_step(later)
    by_function = {f: code for code, functions in source.units for f in functions}
    generated = [n for n in later.g if later.op(n) == "fused" and later.attrs(n)["kernel"].kind in ("pointwise", "reduction")
                 and not cuda._writes_state_alone(later, n)]
    assert len(generated) >= 20
    for n in generated:
        spec, name = later.attrs(n)["kernel"], later.attrs(n)["graph"].name
        assert spec.choice[1] == cuda_choices.RUNTIME and spec.why.startswith("reused"), (name, spec.choice, spec.why)
        for la in source.launches:
            if la.kernel == name:
                assert la.scalars == (("int", 6),) and by_function[la.function] in ahead, name


@pytest.mark.parametrize("trans_a, rows", [(False, 8), (True, 8), (False, 2), (True, 32)])
def test_the_thin_matmul_on_run_time_rows(trans_a, rows, tmp_path):
    """A linear layer's grad-input (K = 10 classes, M the batch) and weight gradient (K the batch)
    as a later batch size runs them: one text at 37 rows and K = 10, 5 rows and K = 7, 16 and 16
    (a block's rows the first's plan, the tuner's smallest and largest among them), the float64
    product's values at each."""
    from ember.codegen import cuda_direct
    texts = set()
    for m, k in ((37, 10), (5, 7), (16, 16)):
        kernel = cuda_direct.render_matmul_thin("th", M=m, N=24, K=k, trans_a=trans_a, trans_b=False, rows=rows,
                                                runtime_rows=True)
        assert kernel.launches[0].scalars == (("int", m), ("int", k)) and kernel.launches[0].grid[1] == -(-m // rows)
        texts.add(kernel.code)
        a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
        b = rng.standard_normal((k, 24)).astype(np.float32)
        bufs = dict(a=a, b=b, out=np.full((m, 24), np.nan, np.float32))
        cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, f"thin{m}{k}{trans_a}{rows}"), 0, kernel, bufs)
        want = (a.T if trans_a else a).astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(bufs["out"], want, rtol=1e-5, atol=1e-5)
    assert len(texts) == 1


@pytest.mark.parametrize("splits", [1, 2])
def test_the_narrow_matmul_on_run_time_rows(splits, tmp_path):
    """A linear layer's forward (N = 10 classes, a long K) as a later batch size runs it: one
    text at 37 and 3 rows (the first's tiling and k splits), the float64 product (+ bias) at both."""
    from ember.codegen import cuda_skinny
    plan = cuda_skinny.narrow_plan(37, 10, 384, splits=splits)
    assert plan.S == splits
    texts = set()
    for m in (37, 3):
        kernel = cuda_skinny.render_matmul_narrow("nw", M=m, N=10, K=384, trans_a=False, trans_b=True, bias=True,
                                                  plan=plan, runtime_rows=True)
        assert all(ln.scalars == (("int", m),) for ln in kernel.launches) and len(kernel.launches) == (splits > 1) + 1
        texts.add(kernel.code)
        a, b = rng.standard_normal((m, 384)).astype(np.float32), rng.standard_normal((10, 384)).astype(np.float32)
        bias = rng.standard_normal(10).astype(np.float32)
        bufs = dict(a=a, b=b, bias=bias, out=np.full((m, 10), np.nan, np.float32))
        cuda_emulator.run(cuda_emulator.build([kernel], tmp_path, f"narrow{m}{splits}"), 0, kernel, bufs)
        np.testing.assert_allclose(bufs["out"], a.astype(np.float64) @ b.T.astype(np.float64) + bias, rtol=1e-5,
                                   atol=1e-4)
    assert len(texts) == 1


def test_the_small_window_convolutions_on_run_time_images(tmp_path):
    """The MNIST CNN's first layer (1 -> 8 channels, 3x3) as a later batch size runs it: forward
    and grad-weight one text at 5 and 2 images, the grad-weight's blocks the first's (at 2 images
    more blocks than units: some add nothing), the float64 references at both."""
    import cuda_refs
    from ember.codegen import cuda_small_conv as sc
    shape = dict(C=1, H=12, W=12, O=8, KH=3, KW=3, stride=(1, 1), padding=(1, 1))
    fwd_plan = sc.small_forward_plan(5, 1, 8, 3, 3, 12, 12, 1, 12, 1, 1)
    gw_plan = sc.small_grad_weight_plan(5, 1, 8, 3, 3, 12, 12, 1, 12, 1, 1)
    texts: dict[str, set] = {"fwd": set(), "gw": set()}
    for n in (5, 2):
        g = dict(shape, N=n)
        fwd = sc.render_small_forward("sf", **g, bias=True, plan=fwd_plan, runtime_images=True)
        gw = sc.render_small_grad_weight("sg", **g, plan=gw_plan, runtime_images=True)
        texts["fwd"].add(fwd.code)
        texts["gw"].add(gw.code)
        assert gw.launches[0].scalars == (("int", n),) and gw.launches[0].grid[0] == gw_plan.blocks
        x = rng.standard_normal((n, 1, 12, 12)).astype(np.float32)
        w = rng.standard_normal((8, 1, 3, 3)).astype(np.float32)
        b = rng.standard_normal(8).astype(np.float32)
        dy = rng.standard_normal((n, 8, 12, 12)).astype(np.float32)
        lib = cuda_emulator.build([fwd, gw], tmp_path, f"small{n}")
        out = dict(x=x, w=w, bias=b, out=np.full((n, 8, 12, 12), np.nan, np.float32))
        cuda_emulator.run(lib, 0, fwd, out)
        np.testing.assert_allclose(out["out"], cuda_refs.conv_fwd_ref(x, w, b, g, False), rtol=1e-5, atol=1e-5)
        grads = dict(x=x, dy=dy, out=np.full((8, 1, 3, 3), np.nan, np.float32))
        cuda_emulator.run(lib, 1, gw, grads)
        np.testing.assert_allclose(grads["out"], cuda_refs.conv_grad_weight_ref(x, dy, g)[0], rtol=1e-5, atol=1e-4)
    assert len(texts["fwd"]) == len(texts["gw"]) == 1


def test_a_column_sum_of_the_first_step_runs_on_run_time_sizes_at_a_later_batch():
    """A bias gradient the first step ran row by row (the `columns` family, which holds its
    sizes): a step of another batch size runs it as the general reduction on run-time sizes, the
    unit the first step built ahead."""
    import ember.runtime
    from ember.passes.pipeline import run_passes
    target = ember.runtime.target("cuda")

    def reduction(graph):
        (n,) = [n for n in graph.g if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "reduction"]
        return graph.attrs(n)["kernel"]

    with cuda_choices.force(reduction="columns"):
        first = run_passes(_sum_leading((64, 40), (0,)), target.passes())
    assert reduction(first).choice[0] == "columns"
    later_graph = _sum_leading((7, 40), (0,))
    later_graph.meta["kernel_reuse"] = target.reusable(first)
    later = run_passes(later_graph, target.passes())
    spec = reduction(later)
    assert spec.choice == ("reduction", cuda_choices.RUNTIME) and spec.why.startswith("reused"), spec
    ahead = {code for code, _ in cuda.reused_variants(first)}
    (unit,) = [code for code, functions in cuda.render_step(later).units if any("reduction" in f for f in functions)]
    assert unit in ahead


def _not_built(first, later) -> list[str]:
    """The later step's units that are neither the first step's own nor among what it builds
    ahead (`reused_variants`): what a later batch size would compile."""
    built = {code for code, _ in cuda.render_step(first).units} | {code for code, _ in cuda.reused_variants(first)}
    return [functions[0] for code, functions in cuda.render_step(later).units if code not in built]


def test_a_3xtf32_gemm_of_the_first_step_is_built_ahead_on_run_time_sizes():
    """A first step whose GEMMs took `gemm_x3` (3xTF32): a step at another batch size takes those
    plans on run-time sizes, another text, which the first step builds ahead (`reused_variants`);
    session 34 found it missing there (a later batch compiled them again)."""
    from models import first_and_later

    first, later = first_and_later("cnn", 32, 5, first_force={"matmul": "gemm_x3"})
    taken = {first.attrs(n)["kernel"].choice[0] for n in first.g
             if first.op(n) == "fused" and first.attrs(n)["kernel"].kind == "matmul"}
    assert taken == {"gemm_x3"}, taken
    reused = [later.attrs(n)["kernel"] for n in later.g if later.op(n) == "fused" and later.attrs(n)["kernel"].kind == "matmul"]
    assert reused and all(k.choice[0] == "gemm_x3" and k.why.startswith("reused") for k in reused), reused
    missing = _not_built(first, later)
    assert not missing, missing


@pytest.mark.parametrize("model, first_batch, first_untuned, families", [
    ("cnn", 32, False, set()), ("resnet8", 32, False, set()), ("lenet5", 32, False, set()),
    ("cnn", 32, True, {("conv2d_grad_input", "winograd")}),
    # a direct grad-weight (whose code holds the images, the direct forward's does not) and Winograd
    ("resnet8", 32, True, {("conv2d_grad_weight", "direct"), ("conv2d", "winograd")}),
    # a first batch of 16 or fewer: the linear layer's weight gradient (K = the batch) on `thin`
    ("cnn", 8, False, {("matmul", "thin")}),
])
def test_a_later_batch_size_compiles_nothing_the_first_step_neither_built_nor_built_ahead(
        model, first_batch, first_untuned, families):
    """Every unit of a step at another batch size given the first step's plans is one of the
    first step's own or of what it builds ahead (`reused_variants`), whichever families the first
    step took (`families`: some it must have taken, so the case covers them): where a family's
    code holds the batch (a direct grad-weight, Winograd), the later step takes the first-ranked
    family that does not, with the plan exported for it."""
    from models import first_and_later

    first, later = first_and_later(model, first_batch, 5, first_untuned=first_untuned)
    took = {(first.attrs(n)["kernel"].kind, first.attrs(n)["kernel"].choice[0]) for n in first.g if first.op(n) == "fused"}
    assert families <= took, took
    missing = _not_built(first, later)
    assert not missing, missing


def test_inference_at_another_size_compiles_nothing_the_steps_before_it_did_not_build_ahead():
    """ResNet-8 in eval mode: an inference step at 64 beside the training step at 64 takes its
    plans, and each builds its variants ahead (`runtime/cuda._prefetch_reused` builds for every
    step); an inference step at 7 then finds every unit among those steps' own and their variants
    (without the inference step's own variants, most of them would be new)."""
    import ember.runtime
    from ember.frontends.tracing import example_type, trace
    from ember.frontends.training.recipes import build_model
    from ember.passes.pipeline import run_passes
    from models import train_graph

    target = ember.runtime.target("cuda")
    model = build_model("resnet8")
    training = run_passes(train_graph(model, (64, 1, 28, 28)), target.passes())
    model.eval()
    plans: dict = {}

    def inference(batch: int) -> Graph:
        forward = trace(model, example_type(np.zeros((batch, 1, 28, 28), np.float32)), name="inference")
        forward.meta["precision"] = "float32"
        forward.meta["kernel_reuse"] = tuple(plans.items())
        return run_passes(forward, target.passes())

    for key, plan in target.reusable(training):
        plans.setdefault(key, plan)
    beside = inference(64)
    for key, plan in target.reusable(beside):
        plans.setdefault(key, plan)
    later = inference(7)
    built = {code for step in (training, beside) for code, _ in cuda.render_step(step).units}
    ahead = {code for code, _ in cuda.reused_variants(training)}
    units = cuda.render_step(later).units
    assert len([1 for code, _ in units if code not in built | ahead]) >= 3  # the inference step's own variants matter
    ahead |= {code for code, _ in cuda.reused_variants(beside)}
    assert not [functions[0] for code, functions in units if code not in built | ahead]


def _family_renders(model: str, batch: int, precision: str = "float32") -> dict[str, set[bool]]:
    """For every family that could serve a kernel of `model`'s CUDA training step and whose
    plans a later batch size takes as they are, whether each of its renders there differs (up to
    the kernel's name) between the step's own (its sizes in the code) and a reused plan's."""
    from ember.frontends import nn, optim, plan
    from ember.frontends.training.recipes import MODELS, build_model

    if model in MODELS:
        net = build_model(model)
    else:
        from ember.frontends.training.zoo import ember_zoo_model
        net = ember_zoo_model(model, seed=0)
    example = (np.zeros((batch, 1, 28, 28), np.float32), np.zeros(batch, np.int64))
    graph = next(g for k, g in plan(net, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda",
                                    precision=precision).items() if k.startswith("train"))
    table = cuda_choices.TABLE
    seen: dict[str, set[bool]] = {}
    for n in graph.g:
        if graph.op(n) != "fused":
            continue
        sub, spec = graph.attrs(n)["graph"], graph.attrs(n)["kernel"]
        g = cuda_choices._geometry(sub, spec)
        for family in table.families.values():
            if family.reused_plan is not None or table.applies(family, g) is not None or family.runtime_code(g) is None:
                continue
            plans = family.all_plans(g)
            for plan in dict.fromkeys(plans[:1] + plans[-1:]):  # the cost model's, and the tuner's last
                choice = (family.name, plan)
                own = cuda_choices.render(sub.name, sub, dataclasses.replace(spec, choice=choice, why="cost model"),
                                          choice)
                reused = cuda_choices.render(sub.name, sub, dataclasses.replace(spec, choice=choice,
                                                                                why=cuda.REUSED_WHY), choice)
                seen.setdefault(family.name, set()).add(own.code != reused.code)
    return seen


def test_every_family_whose_code_takes_run_time_sizes_is_built_ahead():
    """`cuda.RUNTIME_VARIANTS` (the families whose kernels a later batch size renders as another
    text, so the first step builds them ahead) holds exactly the families whose render differs
    under a reused plan, checked on every family that serves a kernel of the recipe and zoo
    models (convolutions of every shape there, grouped ones, pooling, matmuls thin to square,
    float32 and bfloat16): a family that reads `runtime_sizes` and is missing from the list is
    compiled again by every later batch size (gemm_x3 was, for two sessions)."""
    pytest.importorskip("torch")  # the zoo models (MobileNet: the grouped family; the ViT) come from PyTorch
    seen: dict[str, set[bool]] = {}
    for model, batch, precision in [("cnn", 8, "float32"), ("cnn", 64, "float32"), ("lenet5", 64, "float32"),
                                    ("resnet8", 32, "float32"), ("mobilenet", 16, "float32"),
                                    ("vit", 16, "float32"), ("cnn", 64, "bf16")]:
        for name, differs in _family_renders(model, batch, precision).items():
            seen.setdefault(name, set()).update(differs)
    covered = {f.name for f in cuda_choices.TABLE.families.values() if f.code_geometry is not None and f.reused_plan is None}
    assert covered <= set(seen), f"families no model here exercises: {covered - set(seen)}"
    # (a family whose text differs at some geometries only is listed too: the same text dedupes)
    differing = {name for name, d in seen.items() if True in d}
    assert differing <= cuda.RUNTIME_VARIANTS, f"not built ahead, compiled again by every later batch: {differing - cuda.RUNTIME_VARIANTS}"
    assert cuda.RUNTIME_VARIANTS <= differing, f"listed, yet the same text on run-time sizes: {cuda.RUNTIME_VARIANTS - differing}"
