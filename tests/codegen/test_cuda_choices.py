"""The CUDA choice table (codegen/cuda_choices.py), checked without a GPU.

Random small networks (odd sizes, strides 1-3, padding 0-2, 1x1 / 3x3 / 5x5 kernels, batches
1-1024) go through the cuda target's passes: every kernel gets a stamped (family, plan) that is the
first of `candidates`, and every candidate family's kernel launches cover every output. `select`
is deterministic and its choice is in the dump; `force` picks a family or refuses in one line."""
from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

from ember.codegen import cuda_choices, cuda_conv_nhwc, cuda_kernels, tuning_db
from ember.frontends import nn, optim, plan
from ember.ir import format_graph


@pytest.fixture(autouse=True)
def _cost_model_only():
    """These tests are about the table and its cost model: no tuning database takes part."""
    with tuning_db.using(None):
        yield


def _graphs(model, x_shape, precision="float32"):
    example = (np.zeros(x_shape, np.float32), np.zeros(x_shape[0], np.int64))
    return plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.05), example, device="cuda", precision=precision)


def _kernels(graph):
    for n in graph.meta["schedule"]:
        if graph.op(n) == "fused":
            yield graph.attrs(n)["graph"], graph.attrs(n)["kernel"]


def _random_net(rng: random.Random):
    c, o = rng.choice([1, 3, 8]), rng.choice([4, 16, 32])
    k, s, p = rng.choice([1, 3, 5]), rng.randint(1, 3), rng.randint(0, 2)
    h = rng.choice([7, 13, 28, 29])
    if h + 2 * p < k:
        h = k
    ho = (h + 2 * p - k) // s + 1
    n = rng.choice([1, 3, 64, 1024])
    nn.manual_seed(0)
    # a second, stride-1 convolution: its grad-input kernel (and the direct family) is exercised too
    model = nn.Sequential(nn.Conv2d(c, o, k, stride=s, padding=p), nn.ReLU(), nn.Conv2d(o, 8, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * ho * ho, 12), nn.ReLU(), nn.Linear(12, 10))
    return model, (n, c, h, h), f"N{n}_C{c}_O{o}_k{k}_s{s}_p{p}_h{h}"


NETS = [_random_net(random.Random(seed)) for seed in range(10)]


def _covers(family: str, g: dict, kernel) -> None:
    """The main launch of a kernel of `family` covers every output of geometry `g`."""
    consts = {k: int(v) for k, v in re.findall(r"\b([A-Z_][A-Z0-9_]*) = (\d+)\b", kernel.code)}
    main = kernel.launches[0]
    if family in ("gemm", "gemm_x3"):
        p = cuda_choices._gemm_problem(g)
        assert main.grid == (math.ceil(p["M"] / consts["BM"]), math.ceil(p["N"] / consts["BN"]),
                             p["batch"] * consts["SPLITS"])
    elif family == "direct" and g["kind"] != "conv2d_grad_weight":
        rows = g["H"] if g["kind"] == "conv2d_grad_input" else g["HO"]
        assert main.grid[0] * consts["RB"] >= rows > (main.grid[0] - 1) * consts["RB"] and main.grid[1] == g["N"]
    elif family == "small_window" and g["kind"] == "conv2d":
        assert main.grid == (g["N"] * math.ceil(g["HO"] / consts["RB"]), 1, 1)
    elif family == "thin":
        assert main.grid[0] * main.block[0] * 4 >= g["N"] and main.grid[1] * consts["RM"] >= g["M"]
    elif family in ("winograd", "winograd4", "winograd_x3"):  # the last launch: a thread an m x m output block (a 3x3 weight) of every channel
        last, m = kernel.launches[-1], 4 if family == "winograd4" else 2
        blocks = g["O"] * g["C"] if g["kind"] == "conv2d_grad_weight" else \
            g["N"] * (g["C"] if g["kind"] == "conv2d_grad_input" else g["O"]) * \
            math.ceil(g["HO" if g["kind"] == "conv2d" else "H"] / m) * math.ceil(g["WO" if g["kind"] == "conv2d" else "W"] / m)
        assert last.grid[0] * last.block[0] >= blocks > (last.grid[0] - 1) * last.block[0]
    elif family == "winograd_fused":  # the last launch: BT tiles of 2x2 outputs by BCO channels a block
        last, gi = kernel.launches[-1], g["kind"] == "conv2d_grad_input"
        tiles = g["N"] * math.ceil(g["H" if gi else "HO"] / 2) * math.ceil(g["W" if gi else "WO"] / 2)
        channels = g["C"] if gi else g["O"]
        assert last.grid[0] * consts["BT"] >= tiles > (last.grid[0] - 1) * consts["BT"]
        assert last.grid[1] * consts["BCO"] >= channels > (last.grid[1] - 1) * consts["BCO"]
    elif family == "nhwc_tc":  # the GEMM: its m by n tiles over pixels by channels (grad-weight: the reduce's weights)
        gemm, gw = kernel.launches[-2 if g["kind"] == "conv2d_grad_weight" else -1], g["kind"] == "conv2d_grad_weight"
        rows = g["O"] if gw else g["N"] * (g["H"] * g["W"] if g["kind"] == "conv2d_grad_input" else g["HO"] * g["WO"])
        cols = g["C"] * g["KH"] * g["KW"] if gw else g["C"] if g["kind"] == "conv2d_grad_input" else g["O"]
        assert gemm.grid[0] * consts["BM"] >= rows > (gemm.grid[0] - 1) * consts["BM"]
        assert gemm.grid[1] * consts["BN"] >= cols > (gemm.grid[1] - 1) * consts["BN"]
    elif family in ("skinny_narrow", "skinny_short") or kernel.scratch_bytes:
        # split partials (or per-block partials): the reduce launch writes every output
        outs = g["M"] * g["N"] if "M" in g else g["O"] * g["C"] * g["KH"] * g["KW"]
        if len(kernel.launches) > 1:
            red = kernel.launches[-1]
            assert red.grid[0] * red.block[0] >= outs or red.grid[0] * 32 >= outs


@pytest.mark.parametrize("precision", ["float32", "tf32"])
@pytest.mark.parametrize("idx", range(len(NETS)), ids=[tag for _, _, tag in NETS])
def test_every_kernel_has_a_stamped_family_that_is_the_first_candidate(idx, precision):
    model, x_shape, _ = NETS[idx]
    for graph in _graphs(model, x_shape, precision).values():
        for sub, spec in _kernels(graph):
            if spec.kind == "collective":
                continue
            assert spec.choice is not None, spec
            cands = cuda_choices.candidates(sub, spec)
            # (a grad-weight reading its forward's or grad-input's image: share_relayouts' fields)
            assert cands and cands[0] == cuda_conv_nhwc.unshared(spec.choice), (spec, cands[:3])
            assert spec.scratch_bytes == cuda_choices.scratch_bytes(sub, spec, spec.choice)
            if spec.kind in cuda_choices.CONVS + ("matmul",):
                assert "gemm" in {f for f, _ in cands}  # the fallback serves every contraction
                if precision == "tf32" and spec.choice[0] == "gemm":  # its tensor-core plans: k-tiles of 8
                    assert dict(spec.choice[1])["BK"] % 8 == 0


@pytest.mark.parametrize("idx", range(0, len(NETS), 2), ids=[tag for _, _, tag in NETS[::2]])
def test_the_launches_of_every_candidate_cover_every_output(idx):
    model, x_shape, _ = NETS[idx]
    graph = next(iter(_graphs(model, x_shape).values()))  # the training step
    for sub, spec in _kernels(graph):
        if spec.kind not in cuda_choices.CONVS + ("matmul",):
            continue
        g = cuda_choices.geometry(sub, spec)
        for family, plan_ in cuda_choices.candidates(sub, spec):  # every plan the tuner may pick
            kernel = cuda_choices.render(sub.name, sub, spec, (family, plan_))
            assert kernel.scratch_bytes == cuda_choices.FAMILIES[family].scratch(g, plan_), family
            _covers(family, g, kernel)


def test_select_is_deterministic_and_its_choice_is_in_the_dump():
    from models import cnn
    graphs = [_graphs(cnn(), (1024, 1, 28, 28)) for _ in range(2)]
    for step in graphs[0]:
        specs = [[s for _, s in _kernels(gs[step])] for gs in graphs]
        assert specs[0] == specs[1]
    text = format_graph(next(iter(graphs[0].values())))
    for family in ("small_window", "direct", "skinny_narrow", "skinny_short", "thin"):
        assert f"choice={family}(" in text, family


def test_forcing_a_family_serves_every_kernel_it_applies_to():
    from models import cnn
    with cuda_choices.force("gemm"):
        graphs = _graphs(cnn(), (1024, 1, 28, 28))
    for graph in graphs.values():
        for _, spec in _kernels(graph):
            if spec.kind in cuda_choices.CONVS + ("matmul",):
                assert spec.choice[0] == "gemm"
    # outside the block, the defaults again
    graph = next(iter(_graphs(cnn(), (1024, 1, 28, 28)).values()))
    assert {s.choice[0] for _, s in _kernels(graph) if s.kind == "conv2d"} == {"small_window", "direct"}


def test_forcing_a_family_where_it_does_not_apply_is_refused_in_one_line():
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.Flatten(), nn.Linear(4 * 13 * 13, 10))
    with cuda_choices.force(conv2d="direct"), pytest.raises(ValueError) as info:
        _graphs(model, (8, 1, 28, 28))
    assert "forced family 'direct' does not apply: stride is not 1" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="no CUDA kernel family 'fastest'"):
        with cuda_choices.force("fastest"):
            pass
    with pytest.raises(ValueError, match="family 'thin' does not serve conv2d kernels"):
        with cuda_choices.force(conv2d="thin"):
            pass


def test_the_gemm_scratch_from_a_plan_is_the_rendered_kernels():
    for splits in (1, 3):
        plan_ = cuda_kernels.plan_gemm(10, 18432, 64, a_kfast=False, b_kfast=False)
        plan_ = cuda_kernels.GemmPlan(plan_.BM, plan_.BN, plan_.BK, plan_.TM, plan_.TN, splits,
                                      math.ceil(64 / splits / plan_.BK) * plan_.BK)
        k = cuda_kernels.render_matmul("k", M=10, N=18432, K=64, trans_a=True, trans_b=False, plan=plan_)
        assert k.scratch_bytes == cuda_kernels.gemm_scratch_bytes(plan_, 10, 18432)
