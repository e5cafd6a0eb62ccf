"""passes/data_parallel.py on graphs alone: bucket contents and order, every gradient reduced
exactly once, updates reading reduced gradients, the loss averaged, and a simulated world of N
ranks on N shards equal to one rank on the whole batch (MLP, float32 tolerance stated below)."""
from __future__ import annotations

import numpy as np
import pytest

from ember.frontends import functional as F
from ember.frontends import spec, trace
from ember.ir import run, run_world
from ember.passes.autodiff import gradients, grad
from ember.passes.data_parallel import data_parallel, plan_buckets
from ember.passes.optimizer import SGD, Adam, apply_optimizer
from ember.passes.simplify import simplify
from models import cnn, mlp, params_of


def _case(model_fn, x_shape, opt=SGD(lr=0.5)):
    m = model_fn()
    fwd = trace(lambda x, y: F.cross_entropy(m(x), y), spec(x_shape), spec((x_shape[0],), "int64"), modules={"": m})
    rng = np.random.default_rng(7)
    inputs = {"x": rng.random(x_shape, dtype=np.float32), "y": rng.integers(0, 10, x_shape[0])}
    return simplify(apply_optimizer(grad(fwd), opt)), params_of(m), inputs


def _reduces(g):
    return [n for n in g.nodes() if g.op(n) == "all_reduce"]


def test_buckets_hold_parameters_in_reverse_order_of_use():
    step, params, _ = _case(mlp, (8, 784))
    one = plan_buckets(step)  # 25 MiB: the MLP fits in one bucket
    assert len(one) == 1
    assert one[0]["params"] == ["2.bias", "2.weight", "0.bias", "0.weight"] or \
        one[0]["params"] == ["2.weight", "2.bias", "0.weight", "0.bias"]
    assert one[0]["bytes"] == sum(p.nbytes for p in params.values())
    # a cap below every gradient: one bucket per gradient, in the same order
    tiny = plan_buckets(step, bucket_bytes=1)
    assert [b["params"] for b in tiny] == [[p] for p in one[0]["params"]]
    # a cap of 1300 bytes: 2.* (40 + 1200 bytes) share a bucket, 0.bias (120) starts the next
    mid = plan_buckets(step, bucket_bytes=1300)
    assert [p for b in mid for p in b["params"]] == one[0]["params"]
    assert all(b["bytes"] <= 1300 or len(b["nodes"]) == 1 for b in mid)


def test_a_gradient_that_exactly_fills_the_cap_joins_the_bucket():
    """The cap is inclusive (PyTorch DDP's bucket_cap_mb is a limit a bucket may reach): the
    exact split at the boundary, one byte either side."""
    step, params, _ = _case(mlp, (8, 784))
    order = plan_buckets(step)[0]["params"]
    size = {p: params[p].nbytes for p in order}
    assert sorted(size.values()) == [40, 120, 1200, 94080]
    cap = size[order[0]] + size[order[1]]   # the two gradients of layer 2 exactly
    split = plan_buckets(step, bucket_bytes=cap)
    assert [b["params"] for b in split] == [order[:2], [order[2]], [order[3]]]
    assert [b["bytes"] for b in split] == [cap, size[order[2]], size[order[3]]]
    assert plan_buckets(step, bucket_bytes=cap - 1)[0]["params"] == [order[0]]
    # a cap that the first three fill exactly
    three = plan_buckets(step, bucket_bytes=cap + size[order[2]])
    assert [b["params"] for b in three] == [order[:3], [order[3]]]


@pytest.mark.parametrize("opt", [SGD(lr=0.05, momentum=0.9), Adam()], ids=["sgd", "adam"])
@pytest.mark.parametrize("model_fn,x_shape", [(mlp, (8, 784)), (cnn, (2, 1, 28, 28))], ids=["mlp", "cnn"])
def test_every_gradient_reduced_once_and_updates_read_it(model_fn, x_shape, opt):
    step, params, _ = _case(model_fn, x_shape, opt)
    dp = data_parallel(step, world_size=2, bucket_bytes=4096)
    found = gradients(step)
    reduces = _reduces(dp)
    assert len(reduces) == len(set(found.values())) + 1  # + the loss
    reduced_of = {dp.operands(r)[0]: r for r in reduces}
    assert set(found.values()) <= set(reduced_of)
    assert dp.outputs["loss"] in reduces and dp.attrs(dp.outputs["loss"])["reduce"] == "mean"
    for p, gnode in found.items():
        r = reduced_of[gnode]
        assert dp.attrs(r) == {"reduce": "mean", "group": "world"}
        assert isinstance(dp.notes(r)["bucket"], int)
        # the update of p reads the reduced gradient, and no longer the local one
        upd = dp.updates[p]
        anc = _ancestors(dp, upd)
        assert r in anc
        assert not any(u in anc and u != r for u, _ in dp.users(gnode) if u != r and u not in _ancestors(dp, r))
    assert sorted(p for b in dp.meta["buckets"] for p in b["params"]) == sorted(found)
    assert dp.meta["world_size"] == 2


def _ancestors(g, root):
    seen, stack = {root}, [root]
    while stack:
        for o in g.operands(stack.pop()):
            if o not in seen:
                seen.add(o)
                stack.append(o)
    return seen


def test_backward_uses_of_a_tagged_gradient_stay_local():
    # loss = sum(p * x) -> grad p = x, a forward value: the forward must keep reading x itself
    from ember.ir import Graph, TensorType
    g = Graph("fwd_value")
    t = TensorType((4,))
    p, x = g.add_parameter("p", t), g.add_input("x", t)
    g.set_output("out", g.add("sum", [g.add("mul", [p, x])], axes=(0,)))
    step = simplify(apply_optimizer(grad(g), SGD(lr=0.1)))
    dp = data_parallel(step, world_size=2)
    (mul,) = [n for n in dp.nodes() if dp.op(n) == "mul" and dp.inputs["x"] in dp.operands(n)
              and dp.parameters["p"] in dp.operands(n)]
    assert mul  # the forward product still reads the local x
    xs = [np.arange(4, dtype=np.float32), np.ones(4, np.float32)]
    res = run_world(dp, [{"x": v} for v in xs], {"p": np.zeros(4, np.float32)})
    for r in res:
        np.testing.assert_allclose(r.updates["p"], -0.1 * (xs[0] + xs[1]) / 2, rtol=1e-6)


def test_world_of_one_is_the_plain_step():
    step, params, inputs = _case(mlp, (8, 784))
    a, b = run(step, inputs, params), run(data_parallel(step, world_size=1), inputs, params)
    for k in params:
        assert a.updates[k].tobytes() == b.updates[k].tobytes()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt", [SGD(lr=0.5), SGD(lr=0.1, momentum=0.9)], ids=["sgd", "momentum"])
def test_n_ranks_on_n_shards_equal_one_rank_on_the_whole_batch(world_size, opt):
    batch = 24
    whole_step, params, inputs = _case(mlp, (batch, 784), opt)
    shard = batch // world_size
    dp = data_parallel(_case(mlp, (shard, 784), opt)[0], world_size, bucket_bytes=2048)
    shards = [{k: v[r * shard:(r + 1) * shard] for k, v in inputs.items()} for r in range(world_size)]
    # float32 tolerance: the parameter step (p - p_new) within 2e-6 of the largest step of its
    # tensor (observed <= 5e-7): per-shard sums, their mean and the whole-batch sum round apart
    # by a few float32 ulps. The loss: relative 1e-6.
    states = {k: np.full(dp.type(n).shape, 0.01, np.float32) for k, n in dp.states.items()}
    whole = run(whole_step, inputs, params, states)
    ranks = run_world(dp, shards, params, states)
    for r, res in enumerate(ranks):
        for name, p in params.items():
            assert res.updates[name].tobytes() == ranks[0].updates[name].tobytes()  # identical on every rank
            want, got = p - whole.updates[name], p - res.updates[name]
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"{name} rank {r}")
        np.testing.assert_allclose(float(res.outputs["loss"]), float(whole.outputs["loss"]), rtol=1e-6)


def test_pipeline_inserts_the_pass_after_simplify_only_for_several_ranks():
    from ember.passes.pipeline import passes_for, with_data_parallel
    import ember.runtime  # noqa: F401  (registers the targets)
    for target in ("reference", "cpu"):
        base = passes_for(target)
        assert [n for n, _ in with_data_parallel(base, 1)] == [n for n, _ in base]
        names = [n for n, _ in with_data_parallel(base, 2)]
        assert names[names.index("simplify") + 1] == "data_parallel"


def test_schedule_gathers_the_collectives_at_one_point_unless_the_target_overlaps_them():
    # without early collectives (the schedule's default) the updates (readers of the collectives)
    # wait until nothing else is ready, so every all_reduce of the step meets at one segment
    # boundary: one flat communicator call
    import functools
    import ember.runtime
    from ember.codegen.cpp import render_step
    from ember.passes.pipeline import run_passes
    from ember.passes.schedule import schedule
    step, _, _ = _case(cnn, (2, 1, 28, 28))
    passes = [(n, schedule if n == "schedule" else p) for n, p in ember.runtime.target("cpu").passes()]
    src = render_step(run_passes(data_parallel(step, 2), passes))
    assert len(src.collectives) == 1 and len(src.collectives[0]) == len(gradients(step)) + 1
    # the cpu target overlaps: each bucket's all_reduces as soon as its last gradient exists (the
    # loss's mean alone), the updates after the whole backward pass
    cpu = ember.runtime.target("cpu").passes()
    assert ember.runtime.target("cpu").early_collectives
    planned = run_passes(data_parallel(step, 2, bucket_bytes=100_000), cpu)
    src = render_step(planned)
    buckets = planned.meta["buckets"]
    assert [b["params"] for b in buckets] == [["5.bias"], ["5.weight"], ["2.bias", "2.weight", "0.bias", "0.weight"]]
    at = [sorted(dst for _, dst, _ in calls) for calls in src.collectives]
    assert at[:3] == [sorted(b["reduced"]) for b in buckets] and len(at) == 4  # then the loss
    kinds = [[src.kernels[i].kind.split()[0] for i in seg] for seg in src.segments]
    assert kinds[1] == ["matmul[trans_a]"]  # the last layer's weight gradient, alone before its all_reduce
    assert "conv2d_grad_input" in kinds[2]  # the convolutions' backward runs while it is reduced
    assert set(kinds[-1]) == {"pointwise"} and len(kinds[-1]) == len(gradients(step))  # the updates
