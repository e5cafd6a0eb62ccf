"""all_reduce through the passes: its VJP checked over simulated worlds, fusion keeping it a kernel
of its own, memory planning of its buffer, simplify never folding it; autodiff's gradient tags
surviving simplify; and a hand-built data-parallel step (grad -> all_reduce(mean) -> SGD) whose
simulated world of N ranks on N shards equals one rank on the whole batch."""
from __future__ import annotations

import numpy as np
import pytest

from ember import ir
from ember.frontends import functional as F
from ember.frontends import spec, trace
from ember.ir import Graph, TensorType, run, run_world
from ember.passes.autodiff import GRAD_TAG, grad, gradients
from ember.passes.fusion import fuse, kernel_counts
from ember.passes.memory import check_plan, plan_memory
from ember.passes.optimizer import SGD, Adam, apply_optimizer
from ember.passes.simplify import simplify
from models import cnn, mlp, params_of


# ---- VJP over a simulated world -------------------------------------------------------------

def _vjp_case(reduce: str, group: str = "world") -> Graph:
    """loss_r = sum(tanh(all_reduce(p_r * a_r)) * ct_r): per-rank parameter, data and cotangent."""
    g = Graph(f"vjp_all_reduce_{reduce}")
    t = TensorType((2, 3))
    p = g.add_parameter("p", t)
    a, ct = g.add_input("a", t), g.add_input("ct", t)
    y = g.add("all_reduce", [g.add("mul", [p, a])], reduce=reduce, group=group)
    g.set_output("out", g.add("sum", [g.add("mul", [g.add("tanh", [y]), ct])], axes=(0, 1)))
    return g


def _world_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    inputs = [{"a": rng.normal(size=(2, 3)), "ct": rng.normal(size=(2, 3))} for _ in range(n)]
    params = [{"p": rng.normal(size=(2, 3))} for _ in range(n)]
    return inputs, params


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_vjp_matches_finite_differences_of_the_summed_loss(reduce, world_size):
    # The objective is L = sum_r loss_r; the gradient rank s computes must be dL/dp_s.
    g = _vjp_case(reduce)
    inputs, params = _world_data(world_size, seed=world_size)
    grads = [r.outputs["grad:p"] for r in run_world(grad(g), inputs, params, precision="float64")]

    def total(ps):
        return sum(float(r.outputs["out"]) for r in run_world(g, inputs, ps, precision="float64"))

    h = 1e-6
    for s in range(world_size):
        numeric = np.zeros((2, 3))
        for idx in np.ndindex(2, 3):
            plus = [dict(q) for q in params]
            minus = [dict(q) for q in params]
            plus[s]["p"] = params[s]["p"].copy()
            minus[s]["p"] = params[s]["p"].copy()
            plus[s]["p"][idx] += h
            minus[s]["p"][idx] -= h
            numeric[idx] = (total(plus) - total(minus)) / (2 * h)
        np.testing.assert_allclose(grads[s], numeric, rtol=1e-6, atol=1e-8, err_msg=f"rank {s}")


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_vjp_hand_derivation(reduce):
    # Linear case loss_r = sum(all_reduce(p_r * a_r) * ct_r): dL/dp_s = a_s * R(ct), R the same reduction.
    g = Graph("linear")
    t = TensorType((4,))
    p, a, ct = g.add_parameter("p", t), g.add_input("a", t), g.add_input("ct", t)
    y = g.add("all_reduce", [g.add("mul", [p, a])], reduce=reduce)
    g.set_output("out", g.add("sum", [g.add("mul", [y, ct])], axes=(0,)))
    rng = np.random.default_rng(3)
    inputs = [{"a": rng.normal(size=4), "ct": rng.normal(size=4)} for _ in range(3)]
    res = run_world(grad(g), inputs, {"p": np.ones(4, np.float32)}, precision="float64")
    cts = np.stack([d["ct"] for d in inputs]).astype(np.float64)
    reduced = cts.sum(0) if reduce == "sum" else cts.mean(0)
    for d, r in zip(inputs, res):
        np.testing.assert_allclose(r.outputs["grad:p"], d["a"] * reduced, rtol=1e-12)


def test_vjp_is_the_same_collective_over_the_same_group():
    gg = grad(_vjp_case("mean", group="dp"))
    collectives = [n for n in gg.nodes() if gg.op(n) == "all_reduce"]
    assert len(collectives) == 2  # the forward one and its transpose
    assert all(gg.attrs(n) == {"reduce": "mean", "group": "dp"} for n in collectives)


# ---- fusion and memory ---------------------------------------------------------------------

def _sandwich() -> Graph:
    """pointwise -> all_reduce -> pointwise, each value used once (fusion could chain them all)."""
    g = Graph("sandwich")
    t = TensorType((16, 8))
    x = g.add_input("x", t)
    pre = g.add("exp", [g.add("neg", [x])])
    r = g.add("all_reduce", [pre], reduce="mean")
    g.set_output("y", g.add("relu", [g.add("mul", [r, x])]))
    return g


def test_fusion_keeps_the_collective_a_kernel_of_its_own():
    g = _sandwich()
    fused = fuse(g)
    assert kernel_counts(fused) == {"collective": 1, "pointwise": 2}
    (coll,) = [n for n in fused.nodes() if fused.op(n) == "fused" and fused.attrs(n)["kernel"].kind == "collective"]
    sub = fused.attrs(coll)["graph"]
    assert [sub.op(n) for n in sub.nodes()] == ["input", "all_reduce"]
    assert sub.attrs(fused.attrs(coll)["kernel"].core) == {"reduce": "mean", "group": "world"}
    (before,) = fused.operands(coll)
    assert fused.attrs(before)["kernel"].kind == "pointwise"
    pre = fused.attrs(before)["graph"]
    assert sorted(pre.op(n) for n in pre.nodes()) == ["exp", "input", "neg"]
    ((after, _),) = fused.users(coll)
    post = fused.attrs(after)["graph"]
    assert fused.attrs(after)["kernel"].kind == "pointwise" and fused.outputs["y"] == after
    assert sorted(post.op(n) for n in post.nodes()) == ["input", "input", "mul", "relu"]
    # the fused graph means the same thing, in a world of one and of three
    xs = [np.random.default_rng(r).standard_normal((16, 8)).astype(np.float32) for r in range(3)]
    np.testing.assert_array_equal(run(fused, {"x": xs[0]}).outputs["y"], run(g, {"x": xs[0]}).outputs["y"])
    for a, b in zip(run_world(g, [{"x": x} for x in xs]), run_world(fused, [{"x": x} for x in xs])):
        np.testing.assert_array_equal(a.outputs["y"], b.outputs["y"])


def test_collective_is_never_absorbed_by_a_reduction():
    g = Graph("reduce_after")
    x = g.add_input("x", TensorType((4, 8)))
    g.set_output("y", g.add("sum", [g.add("exp", [g.add("all_reduce", [x], reduce="sum")])], axes=(1,)))
    assert kernel_counts(fuse(g)) == {"collective": 1, "reduction": 1}


def test_memory_plan_gives_the_collective_its_own_arena_buffer():
    planned = plan_memory(fuse(_sandwich()))
    check_plan(planned)
    (coll,) = [n for n in planned.nodes() if planned.op(n) == "fused" and planned.attrs(n)["kernel"].kind == "collective"]
    (src,) = planned.operands(coll)
    notes, live = planned.notes(coll), planned.meta["liveness"]
    assert notes["storage"] == "arena" and coll in live and src in live
    # operand and result are live together at the collective, in disjoint memory
    lo, hi = sorted([(notes["offset"], planned.type(coll).nbytes), (planned.notes(src)["offset"], planned.type(src).nbytes)])
    assert lo[0] + lo[1] <= hi[0]


def test_update_through_a_collective_is_never_in_place():
    # p <- all_reduce(p): the collective reads p at the index it writes, but it is no pointwise kernel.
    g = Graph("avg_params")
    p = g.add_parameter("p", TensorType((32,)))
    g.set_update("p", g.add("all_reduce", [p], reduce="mean"))
    planned = plan_memory(fuse(g))
    node = planned.updates["p"]
    assert planned.attrs(node)["kernel"].kind == "collective"
    assert planned.notes(node)["storage"] == "arena"


def test_simplify_never_folds_a_collective():
    g = Graph("const")
    c = g.add_constant(np.array([1.0, 2.0], np.float32))
    g.set_output("y", g.add("all_reduce", [c], reduce="sum"))
    s = simplify(g)
    assert s.count("all_reduce") == 1
    for res in run_world(s, [{}, {}, {}]):
        np.testing.assert_array_equal(res.outputs["y"], [3.0, 6.0])


# ---- gradient tags --------------------------------------------------------------------------

def test_grad_tags_each_parameter_gradient():
    g = Graph("two")
    t = TensorType((3,))
    a, b, w = g.add_parameter("a", t), g.add_parameter("b", t), g.add_parameter("w", t)
    x = g.add_input("x", t)
    g.set_output("out", g.add("sum", [g.add("mul", [g.add("add", [a, b]), x])], axes=(0,)))
    gg = grad(g)
    found = gradients(gg)
    assert list(found) == ["a", "b", "w"]
    assert found == {p: gg.outputs[f"grad:{p}"] for p in "abw"}
    assert found["a"] == found["b"]  # add passes one cotangent node to both: one node, two tags
    assert gg.notes(found["a"])[GRAD_TAG] == ("a", "b")


def test_tags_survive_cse_folding_and_rewrites():
    g = Graph("rewrites")
    w = g.add_parameter("w", TensorType((3, 4)))
    v = g.add_parameter("v", TensorType((3, 4)))
    x = g.add_input("x", TensorType((5, 3)))
    # w enters through a transpose: its gradient is transpose(matmul(..)), rewritten to a new matmul;
    # v and the second use of w give identical backward subgraphs that CSE merges.
    h = g.add("matmul", [x, w])
    k = g.add("matmul", [x, v])
    g.set_output("out", g.add("sum", [g.add("add", [g.add("tanh", [h]), g.add("tanh", [k])])], axes=(0, 1)))
    s = simplify(apply_optimizer(grad(g), SGD(lr=0.1)))
    found = gradients(s)
    assert set(found) == {"w", "v"}
    rng = np.random.default_rng(0)
    inputs, params = {"x": rng.standard_normal((5, 3))}, {"w": rng.standard_normal((3, 4)), "v": rng.standard_normal((3, 4))}
    direct = run(grad(g), inputs, params, precision="float64").outputs
    _check_tagged_values(s, found, inputs, params, direct)


def _check_tagged_values(graph: Graph, found: dict[str, int], inputs, params, direct, rtol=1e-10):
    probe = graph.copy()
    for p, n in found.items():
        probe.set_output(f"probe:{p}", n)
    out = run(probe, inputs, params, {k: np.zeros(probe.type(n).shape) for k, n in probe.states.items()},
              precision="float64").outputs
    for p in found:
        np.testing.assert_allclose(out[f"probe:{p}"], direct[f"grad:{p}"], rtol=rtol, atol=1e-12, err_msg=p)


def test_tag_moves_to_a_folded_constant_and_to_a_rewritten_node():
    g = Graph("fold")
    p = g.add_parameter("p", TensorType((2,)))
    c = g.add_constant(np.array([1.0, 2.0], np.float32))
    n = g.add("mul", [c, g.add_constant(np.float32(3.0))])  # folds to a new constant
    m = g.add("mul", [p, g.add_constant(np.float32(1.0))])  # x*1 -> p
    g.annotate(n, GRAD_TAG, ("p",))
    g.annotate(m, GRAD_TAG, ("q",))
    g.set_output("a", n)
    g.set_output("b", m)
    s = simplify(g)
    assert s.notes(s.outputs["a"])[GRAD_TAG] == ("p",) and s.op(s.outputs["a"]) == "constant"
    assert s.outputs["b"] == s.parameters["p"] and s.notes(s.outputs["b"])[GRAD_TAG] == ("q",)


def test_higher_order_grad_retags():
    g = Graph("second")
    p = g.add_parameter("p", TensorType((3,)))
    g.set_output("out", g.add("sum", [g.add("tanh", [p])], axes=(0,)))
    g1 = grad(g)
    g1.outputs = {"out2": g1.add("sum", [g1.outputs["grad:p"]], axes=(0,))}
    assert gradients(g1) == {"p": g1.operands(g1.outputs["out2"])[0]}
    g2 = grad(g1, loss="out2")
    assert gradients(g2) == {"p": g2.outputs["grad:p"]}


def _model_case(model_fn, x_shape):
    m = model_fn()
    fwd = trace(lambda x, y: F.cross_entropy(m(x), y), spec(x_shape), spec((x_shape[0],), "int64"), modules={"": m})
    rng = np.random.default_rng(7)
    inputs = {"x": rng.random(x_shape, dtype=np.float32), "y": rng.integers(0, 10, x_shape[0])}
    return fwd, params_of(m), inputs


@pytest.mark.parametrize("model_fn,x_shape", [(mlp, (16, 784)), (cnn, (4, 1, 28, 28))], ids=["mlp", "cnn"])
@pytest.mark.parametrize("opt", [SGD(lr=0.05, momentum=0.9), Adam()], ids=["sgd", "adam"])
def test_model_gradient_tags_survive_simplify(model_fn, x_shape, opt):
    fwd, params, inputs = _model_case(model_fn, x_shape)
    step = simplify(apply_optimizer(grad(fwd), opt))
    found = gradients(step)
    assert list(found) == list(fwd.parameters), "every parameter's gradient is found, in parameter order"
    direct = run(grad(fwd), inputs, params, precision="float64").outputs
    _check_tagged_values(step, found, inputs, params, direct, rtol=1e-9)


# ---- a data-parallel step built by hand -----------------------------------------------------

def _data_parallel(step: Graph) -> Graph:
    """step with every tagged gradient replaced by its all_reduce(mean) on the optimizer's side."""
    dp = step.copy(step.name + "_dp")
    found = gradients(dp)
    for p, node in found.items():
        users = dp.users(node)
        others = {m for q, m in found.items() if q != p}
        # For the MLP every use of a gradient is the optimizer's: none leads to another gradient.
        assert not any(o in _ancestors(dp, m) for m in others for o in [node] + [u for u, _ in users]), p
        ar = dp.add("all_reduce", [node], reduce="mean")
        for u, k in users:
            dp.set_operand(u, k, ar)
        for table in (dp.outputs, dp.updates):
            for name, n in table.items():
                if n == node:
                    table[name] = ar
    return dp.verify()


def _ancestors(g: Graph, root: int) -> set[int]:
    seen, stack = {root}, [root]
    while stack:
        for o in g.operands(stack.pop()):
            if o not in seen:
                seen.add(o)
                stack.append(o)
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_n_ranks_on_n_shards_equal_one_rank_on_the_whole_batch(world_size):
    batch = 24
    fwd, params, inputs = _model_case(mlp, (batch, 784))
    step = simplify(apply_optimizer(grad(fwd), SGD(lr=0.5)))
    dp = _data_parallel(step)
    assert dp.count("all_reduce") == len(fwd.parameters)
    shard = batch // world_size
    shards = [{k: v[r * shard:(r + 1) * shard] for k, v in inputs.items()} for r in range(world_size)]
    shard_fwd, _, _ = _model_case(mlp, (shard, 784))
    dp_shard = _data_parallel(simplify(apply_optimizer(grad(shard_fwd), SGD(lr=0.5))))

    # Tolerances, on the step (p - p_new) relative to the largest step of the tensor:
    # - float64 compute: 1e-7. The graphs' 1/batch constants are float32; 1/24 and 1/8 round by
    #   3e-8 relative, which is the whole difference (it is ~1e-15 when they are exact).
    # - float32 compute: 2e-6 (observed <= 5e-7): per-shard sums, their mean and the whole-batch
    #   sum round differently, a few float32 ulps of the gradient (and of the parameter).
    for precision, tol in (("float64", 1e-7), (None, 2e-6)):
        whole = run(step, inputs, params, precision=precision)
        ranks = run_world(dp_shard, shards, params, precision=precision)
        for r, res in enumerate(ranks):
            for name, p in params.items():
                # every rank applies the same reduced gradient: bit-identical updates on all ranks
                assert res.updates[name].tobytes() == ranks[0].updates[name].tobytes()
                want, got = p - whole.updates[name], p - res.updates[name]
                np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(),
                                           err_msg=f"{name}, rank {r}, {precision or 'float32'}")
        np.testing.assert_allclose(np.mean([float(r.outputs["loss"]) for r in ranks]), float(whole.outputs["loss"]),
                                   rtol=1e-6)
