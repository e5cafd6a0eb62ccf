"""The GEMM family's CUDA kernels with the batch-dependent sizes taken at run time
(`runtime_batch=True`, what a step renders where its plan was reused from a step of another
batch size), without a GPU: a plan chosen at one batch size renders the same text at another (so
a later batch size finds the NVRTC module in ember's cache), the sizes as by-value launch
arguments; the default, specialised text holds them and is another text at each size; run at a
smaller and at a larger batch than the one it was planned at, in the CPU emulation of its own
source (cuda_emulator.py), the kernel gives the float64 reference's values. Covered: the GEMM
views of the three convolutions (M = images x pixels for forward and grad-input, K = images x
pixels for grad-weight, whose split chunk follows K while its split count stays the plan's, so a
shorter K leaves trailing splits that add zeros) and a batched, transposed matmul (batch, M and
K), each with split-K where the case has it, plus one TF32 tensor-core case."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
from ember.codegen import cuda_kernels as ck

rng = np.random.default_rng(5)

CONV = dict(C=5, H=9, W=9, O=12, KH=3, KW=3, stride=1, padding=(1, 1))
STRIDED = dict(C=6, H=10, W=10, O=16, KH=3, KW=3, stride=2, padding=(1, 1))
DEEP = dict(C=32, H=5, W=5, O=8, KH=3, KW=3, stride=1, padding=(1, 1))  # K = 288: split-K plans


def _gemm_view(kind: str, g: dict) -> tuple[int, int, int, int, bool, bool]:
    """(M, N, K, batch, a_kfast, b_kfast) of a case, as `cuda_choices._gemm_problem` reads it."""
    if kind == "matmul":
        return g["M"], g["N"], g["K"], g["batch"], not g["trans_a"], g["trans_b"]
    HO, WO = cuda_refs.conv_out(g)
    n = g["N"]
    if kind == "conv_fwd":
        return n * HO * WO, g["O"], g["C"] * g["KH"] * g["KW"], 1, False, True
    if kind == "conv_gi":
        return (*ck.grad_input_gemm(n, g["C"], g["H"], g["W"], g["O"], g["KH"], g["KW"], g["stride"], g["padding"]),
                False, True)
    return g["O"], g["C"] * g["KH"] * g["KW"], n * HO * WO, 1, True, True


def _plan(kind: str, g: dict, split: bool, tf32: bool) -> ck.GemmPlan:
    """The cost model's best plan at `g`, or its best with split-K."""
    M, N, K, batch, a_kfast, b_kfast = _gemm_view(kind, g)
    plans = ck.plan_candidates(M, N, K, batch, a_kfast=a_kfast, b_kfast=b_kfast, tf32=tf32)
    plans = [p for p in plans if (p.splits > 1) == split]
    assert plans, f"no plan with{'' if split else 'out'} split-K at {g}"
    return plans[0]


def _render(kind: str, g: dict, plan: ck.GemmPlan, tf32: bool) -> ck.CudaKernel:
    return _render_as(kind, g, plan, tf32, True)


def _render_as(kind: str, g: dict, plan: ck.GemmPlan, tf32: bool, runtime_batch: bool) -> ck.CudaKernel:
    common = dict(plan=plan, tf32=tf32, runtime_batch=runtime_batch)
    if kind == "matmul":
        return ck.render_matmul("k", **g, bias=True, **common)
    sizes = {k: g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW", "stride", "padding")}
    if kind == "conv_fwd":
        return ck.render_conv2d_forward("k", **sizes, bias=True, relu=True, **common)
    if kind == "conv_gi":
        return ck.render_conv2d_grad_input("k", **sizes, relu_mask=True, **common)
    return ck.render_conv2d_grad_weight("k", **sizes, bias=True, **common)


def _extra(kind: str) -> dict:
    return {"conv_fwd": dict(bias=True, relu=True), "conv_gi": dict(relu_mask=True), "conv_gw": dict(bias=True),
            "matmul": {}}[kind]


def _at(kind: str, g: dict, batch: int) -> dict:
    """`g` at another batch size: a convolution's images, a matmul's batch and rows (and, for its
    A^T case, the reduced length: the rows of a weight gradient's operands)."""
    if kind != "matmul":
        return dict(g, N=batch)
    scale = batch / g["batch"]
    out = dict(g, batch=batch, M=max(1, round(g["M"] * scale)))
    if g["trans_a"]:
        out["K"] = max(1, round(g["K"] * scale))
    return out


CASES = [
    ("conv_fwd", dict(N=6, **CONV), False),
    ("conv_fwd", dict(N=6, **STRIDED), False),
    ("conv_fwd", dict(N=2, **DEEP), True),
    ("conv_gi", dict(N=6, **CONV), False),
    ("conv_gi", dict(N=4, **STRIDED), False),
    ("conv_gi", dict(N=2, **DEEP), True),
    ("conv_gw", dict(N=6, **CONV), True),
    ("conv_gw", dict(N=6, **STRIDED), False),
    ("matmul", dict(M=24, N=20, K=40, batch=3, trans_a=False, trans_b=True), False),
    ("matmul", dict(M=24, N=20, K=300, batch=2, trans_a=True, trans_b=False), True),
]


@pytest.mark.parametrize("kind,g,split", CASES, ids=[f"{k}{i}{'_split' if s else ''}" for i, (k, _, s) in enumerate(CASES)])
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
def test_a_gemm_kernel_planned_at_one_batch_runs_any_batch_from_the_same_text(kind, g, split, tf32, tmp_path):
    if tf32 and (kind, split) not in (("conv_gw", True), ("matmul", False)):
        pytest.skip("TF32: one convolution and one matmul (the run-time sizes are the FMA path's)")
    plan = _plan(kind, g, split, tf32)
    assert (plan.splits > 1) == split
    planned = _render(kind, g, plan, tf32)
    n0 = g["batch"] if kind == "matmul" else g["N"]
    kernels = {}
    for batch in (max(1, n0 // 3), n0 + 3):
        at = _at(kind, g, batch)
        kernel = _render(kind, at, plan, tf32)
        assert kernel.code == planned.code, f"{kind} at batch {batch}: another text than at {n0}"
        assert all(ln.scalars for ln in kernel.launches)
        specialised = _render_as(kind, at, plan, tf32, False)
        assert specialised.code != kernel.code and all(not ln.scalars for ln in specialised.launches)
        kernels[batch] = (kernel, at)
    if kind in ("conv_gw", "matmul") and split:  # the smaller K leaves trailing splits with no k: zeros
        M, N, K, *_ = _gemm_view(kind, kernels[max(1, n0 // 3)][1])
        assert ck.ceil_div(K, ck.round_up(ck.ceil_div(K, plan.splits), plan.BK)) < plan.splits
    tf = cuda_emulator.tf32 if tf32 else (lambda a: a)
    for batch, (kernel, at) in kernels.items():
        # one library a batch: the same text twice in one would define its functions twice
        lib = cuda_emulator.build([kernel], tmp_path, f"rt{batch}")
        ins, _, lengths = cuda_refs.make_case(kind, dict(at, bias=True) if kind == "matmul" else at, _extra(kind), rng)
        # operands rounded to TF32 as the tensor cores read them: the reference is then exact
        ins = {k: tf(v) if k in ("x", "w", "dy", "a", "b") else v for k, v in ins.items()}
        refs = _reference(kind, at, ins)
        bufs = dict(ins, **{k: np.full(np.shape(v), np.nan, np.float32) for k, v in refs.items()})
        cuda_emulator.run(lib, 0, kernel, bufs)
        for role, want in refs.items():
            got = bufs[role].reshape(np.shape(want))
            length = lengths[role]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * length + 1e-6,
                                       err_msg=f"{kind} {role} at {at}")


def _reference(kind: str, g: dict, ins: dict) -> dict:
    """float64 references of the (possibly TF32-rounded) inputs."""
    if kind == "conv_fwd":
        return dict(out=cuda_refs.conv_fwd_ref(ins["x"], ins["w"], ins["bias"], g, True))
    if kind == "conv_gi":
        return dict(out=cuda_refs.conv_grad_input_ref(ins["dy"], ins["w"], g, ins["mask_src"]))
    if kind == "conv_gw":
        dw, db = cuda_refs.conv_grad_weight_ref(ins["x"], ins["dy"], g)
        return dict(out=dw, db=db)
    return dict(out=cuda_refs.matmul_ref(ins["a"], ins["b"], g, ins["bias"]).reshape(g["batch"], g["M"], g["N"]))


@pytest.fixture
def gemm_and_direct(monkeypatch):
    """The CUDA table without the winograd families (their kernels hold the batch: not reused
    across batch sizes), so the family prior leaves ResNet-8's 3x3 convolutions to the GEMM and
    direct families, whose reuse these tests are about."""
    from ember.codegen import cuda_choices
    monkeypatch.delitem(cuda_choices.FAMILIES, "winograd")
    monkeypatch.delitem(cuda_choices.FAMILIES, "winograd4")


def test_later_batch_sizes_of_a_step_reuse_its_plans_and_share_their_texts(gemm_and_direct):
    """ResNet-8's CUDA step at batch 5 and at 11, each given the plans of its step at 8
    (`Target.reusable`, as `compile` passes them): every GEMM-family kernel and every direct
    forward and grad-input keeps its family and plan ("reused"); the GEMMs are specialised at 8
    (the step the model trains with) and one run-time-size text at 5 and 11; a direct kernel
    (the images are its grid's y alone) is one text at all three."""
    import ember.runtime
    from ember.codegen import cuda
    from ember.frontends.training.recipes import build_model
    from ember.passes.pipeline import run_passes
    from models import train_graph

    target = ember.runtime.target("cuda")
    steps, reuse = {}, ()
    for batch in (8, 5, 11):
        graph = train_graph(build_model("resnet8"), (batch, 1, 28, 28))
        if reuse:
            graph.meta["kernel_reuse"] = reuse
        planned = run_passes(graph, target.passes())
        reuse = reuse or target.reusable(planned)
        source = cuda.render_step(planned)
        by_function = {f: code for code, functions in source.units for f in functions}
        kernels = {planned.attrs(n)["graph"].name: planned.attrs(n)["kernel"] for n in planned.g
                   if planned.op(n) == "fused"}
        units = {la.kernel: by_function[la.function] for la in source.launches}
        steps[batch] = kernels, units
    (kernels8, units8), (kernels5, units5), (kernels11, units11) = steps[8], steps[5], steps[11]
    gemms = [name for name, spec in kernels8.items() if spec.choice is not None and spec.choice[0] == "gemm"]
    directs = [name for name, spec in kernels8.items() if spec.choice is not None and spec.choice[0] == "direct"
               and spec.kind != "conv2d_grad_weight"]
    assert len(gemms) >= 12 and directs, (gemms, directs)
    for name in gemms + directs:
        for kernels in (kernels5, kernels11):
            assert kernels[name].choice == kernels8[name].choice, name
            assert kernels[name].why.startswith("reused"), (name, kernels[name].why)
        assert units5[name] == units11[name], name
    for name in gemms:
        assert units8[name] != units5[name] and "const int rM" not in units8[name] + "".join(
            units8[k] for k in gemms), name
    for name in directs:
        assert units8[name] == units5[name], name


def test_a_reused_gemm_plan_fits_by_its_tile_and_a_stored_one_only_as_the_cost_model_has_it():
    """A plan from a step of another batch size (rendered on run-time sizes) fits a grad-weight
    whose K it was not made for, where a database record with that split chunk would not (the
    specialised kernel holds its K and chunk); a tile the templates do not build fits neither."""
    from ember.codegen import cuda_choices
    gemm = cuda_choices.FAMILIES["gemm"]
    g = dict(kind="conv2d_grad_weight", epilogues=frozenset(), tf32=False, N=64, C=16, H=14, W=14, O=32, KH=3, KW=3,
             stride=1, padding=(1, 1), HO=14, WO=14)
    plan = cuda_choices._gemm_plans(g)[0]
    assert gemm.fits(g, plan) and gemm.fits_reused(g, plan)
    smaller = dict(g, N=3)
    assert gemm.fits_reused(smaller, plan)
    if dict(plan)["splits"] > 1:
        assert not gemm.fits(smaller, plan)
    nonsense = (("BM", 7), ("BN", 3), ("BK", 5), ("TM", 2), ("TN", 2), ("splits", 1), ("kchunk", 5))
    assert not gemm.fits(g, nonsense) and not gemm.fits_reused(g, nonsense)


def test_the_variants_built_ahead_are_the_units_a_later_batch_size_renders():
    """`cuda.reused_variants` of ResNet-8's step at 8 (what its executor builds ahead): every unit
    of its step at 5 given 8's plans is one of 8's own or one of them (a kernel whose family holds
    the batch in its code, Winograd, is taken as the first-ranked family that does not), but for
    a kernel or two the later step plans itself; GEMMs and the generated kinds (pointwise,
    reductions) all are."""
    from ember.codegen import cuda
    from models import first_and_later

    first, later = first_and_later("resnet8", 8, 5)
    ahead = {code for code, _ in cuda.reused_variants(first)}
    own = {code for code, _ in cuda.render_step(first).units}
    units = cuda.render_step(later).units
    specs = {later.attrs(n)["graph"].name: later.attrs(n)["kernel"] for n in later.g if later.op(n) == "fused"}

    def spec_of(function: str):
        return specs[function] if function in specs else specs[function.rsplit("_", 1)[0]]

    missing = {functions[0]: spec_of(functions[0]) for code, functions in units if code not in own | ahead}
    assert len(missing) <= 2 and not any(s.why.startswith("reused") for s in missing.values()), \
        {f: (s.choice[0], s.why) for f, s in missing.items()}
    # its Winograd kernels run as the GEMM on run-time sizes the first step built ahead
    assert any(s.choice[0] == "winograd" for n in first.g if first.op(n) == "fused"
               for s in [first.attrs(n)["kernel"]])
    assert not any(s.choice[0] == "winograd" for s in specs.values())
    found = {f for code, functions in units if code in ahead - own for f in functions}
    assert {spec_of(f).kind for f in found} >= {"conv2d", "conv2d_grad_input", "conv2d_grad_weight", "pointwise",
                                                "reduction"}
    # built ahead and not run: a kernel the later step plans for itself (a thin matmul the first
    # step's record gave another family), a few at most
    assert len(ahead - own) >= 30 and len(ahead - own - {code for code, _ in units}) <= 3
    # a later step's kernels are the variants already, but for those it planned itself
    why = {name: s.why for name, s in specs.items()}
    again = [functions[0].rsplit("_", 1)[0] for _, functions in cuda.reused_variants(later)]
    assert len(again) <= 3 and not any(why[name].startswith("reused") for name in again), again


def test_a_step_builds_its_reused_variants_on_a_thread(monkeypatch):
    """The CUDA executor's build ahead (`runtime/cuda._prefetch_reused`), with NVRTC faked: the
    first step of a model hands `cuda_modules.prefetch` its kernels' run-time-size units as one
    build, on a thread that ends; a step of another batch size given its plans builds none of
    them again (its kernels take run-time sizes); EMBER_PREFETCH=0 starts nothing."""
    import ember.runtime
    from ember.codegen import cuda
    from ember.frontends.training.recipes import build_model
    from ember.passes.pipeline import run_passes
    from ember.runtime import cuda as runtime_cuda
    from models import train_graph

    target = ember.runtime.target("cuda")
    first = run_passes(train_graph(build_model("resnet8"), (8, 1, 28, 28)), target.passes())
    asked = []
    marked = []

    def prefetch(cp, sources, options, names, step_code):
        asked.append(list(zip(names, sources)))
        marked.append(step_code)
        return len(sources)

    monkeypatch.setattr(runtime_cuda.cuda_modules, "prefetch", prefetch)
    source = SimpleNamespace(prelude="// prelude\n", code="// the step\n")
    monkeypatch.setenv("EMBER_PREFETCH", "0")
    assert runtime_cuda._prefetch_reused(object(), first, source, ()) is None
    monkeypatch.delenv("EMBER_PREFETCH")
    thread = runtime_cuda._prefetch_reused(object(), first, source, ("-arch=sm_90",))
    thread.join(timeout=120)
    assert not thread.is_alive() and not thread.daemon
    want = cuda.reused_variants(first)
    (build,) = asked
    assert marked == [source.code]  # the step marked as built ahead (`cuda_modules.built_ahead`)
    assert [source for _, source in build] == ["// prelude\n" + code for code, _ in want]
    assert [name for name, _ in build] == [functions[0] for _, functions in want]
    later_graph = train_graph(build_model("resnet8"), (5, 1, 28, 28))
    later_graph.meta["kernel_reuse"] = target.reusable(first)
    later = run_passes(later_graph, target.passes())
    asked.clear()
    thread = runtime_cuda._prefetch_reused(object(), later, source, ())
    thread.join(timeout=120)
    assert sum(len(build) for build in asked) == len(cuda.reused_variants(later)) <= 3


def test_the_build_ahead_starts_once_when_the_steps_graph_is_captured(monkeypatch):
    """`CudaExecutor._replay` with CUDA faked: the first call runs the launches (no build ahead:
    its rendering would hold the GIL beside the rest of a cold compile, 0.05-0.25 s on an H100
    host), the second captures the graph and starts the build ahead, later replays start
    nothing more."""
    from ember.runtime import cuda as runtime_cuda

    started, launched = [], []

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            launched.append("capture")

        def end_capture(self):
            return Graph()

    class Graph:
        def launch(self, stream):
            launched.append("replay")

    monkeypatch.setattr(runtime_cuda, "_prefetch_reused", lambda *args: started.append(args) or "thread")
    ex = runtime_cuda.CudaExecutor.__new__(runtime_cuda.CudaExecutor)
    ex._graph, ex.stream, ex.prefetch, ex._build_ahead = None, Stream(), None, ("cp", "graph", "source", ())
    ex._launch_all = lambda rings=False: launched.append("launches")
    ex._replay()
    assert launched == ["launches"] and started == [] and ex.prefetch is None
    ex._replay()
    assert launched == ["launches", "capture", "launches", "replay"] and started == [("cp", "graph", "source", ())]
    assert ex.prefetch == "thread"
    ex._replay()
    ex._replay()
    assert launched[-2:] == ["replay", "replay"] and len(started) == 1


def test_plan_candidates_are_remembered_per_problem_and_device():
    from ember.codegen import device
    args = dict(M=64, N=3136, K=144, batch=16, a_kfast=False, b_kfast=True)
    first = ck.plan_candidates(**args)
    entries = len(ck._CANDIDATES)
    first.pop()  # the caller's list: changing it changes no later answer
    again = ck.plan_candidates(**args)
    assert len(ck._CANDIDATES) == entries and again[:-1] == first and len(again) == len(first) + 1
    with device.using(device.L4):  # another GPU: its own answer (58 multiprocessors: other waves)
        l4 = ck.plan_candidates(**args)
        fresh = ck._plan_candidates(**args)
    assert len(ck._CANDIDATES) == entries + 1 and l4 == fresh != again


def test_waiting_for_the_builds_ahead_returns_when_they_end():
    """`wait_for_builds_ahead` (what `ember bench` calls before it times) joins every thread that
    builds ahead and no other."""
    import threading

    from ember.runtime import cuda as runtime_cuda

    release, release_other = threading.Event(), threading.Event()
    build = threading.Thread(target=lambda: release.wait(120), name=runtime_cuda.PREFETCH_THREAD)
    other = threading.Thread(target=lambda: release_other.wait(120), name="user-thread")
    build.start()
    other.start()
    runtime_cuda.wait_for_builds_ahead(timeout=0.05)
    assert build.is_alive()  # (the timeout: still building)
    threading.Timer(0.05, release.set).start()
    runtime_cuda.wait_for_builds_ahead()
    assert not build.is_alive() and other.is_alive()
    release_other.set()
    other.join()
