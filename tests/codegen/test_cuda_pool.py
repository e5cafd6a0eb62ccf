"""The CUDA pooling family's gradient modes, without a GPU.

`gather` (a thread an input element, summing the windows whose first maximum it is) serves any
pooling; `tile` (a thread a window, writing its stride's whole tile) only windows that do not
overlap, where it is the cost model's first plan. Both kernels' own sources run on the CPU
(cuda_emulator.py) on inputs with ties, NaN and negative zeros, and must equal the interpreter's
gradient bit for bit (the first maximum in row-major order, NaN wins, 0 + dy)."""
from __future__ import annotations

import random
import types

import numpy as np
import pytest

import cuda_emulator
from ember.codegen import cuda, cuda_choices, pool_kernels, tuning_db
from ember.frontends import nn, optim, plan
from ember.ir import interpreter
from nvcc import assert_compiles, nvcc_or_skip


def _attrs(k, s, p=(0, 0), ceil=False) -> dict:
    return dict(kernel=k, stride=s, padding=p, ceil_mode=ceil)


def _case(seed: int) -> tuple[tuple[int, ...], dict]:
    """A random pooling with windows that do not overlap: odd sizes, floor and ceil mode."""
    rng = random.Random(seed)
    kh, kw = rng.choice([(1, 1), (2, 2), (2, 3), (3, 3), (1, 2)])
    sh, sw = kh + rng.choice([0, 0, 1]), kw + rng.choice([0, 0, 1])
    h, w = rng.randint(kh, 11), rng.randint(kw, 11)
    return (rng.randint(1, 3), rng.randint(1, 3), h, w), _attrs((kh, kw), (sh, sw), ceil=rng.random() < 0.4)


CASES = [_case(seed) for seed in range(6)] + [((2, 3, 24, 24), _attrs((2, 2), (2, 2)))]


def _inputs(x_shape, attrs, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(-2, 3, x_shape).astype(np.float32)  # ties in most windows
    x.reshape(-1)[rng.integers(0, x.size, max(1, x.size // 20))] = np.nan
    g = pool_kernels.geometry(x_shape, attrs)
    dy = rng.standard_normal((g.N, g.C, g.HO, g.WO)).astype(np.float32)
    dy.reshape(-1)[rng.integers(0, dy.size, max(1, dy.size // 10))] = -0.0
    return x, dy


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pool")
    kernels = []
    for i, (shape, attrs) in enumerate(CASES):
        g = pool_kernels.geometry(shape, attrs)
        assert g.windows_disjoint
        kernels += [pool_kernels.render_cuda(f"p{i}_tile", "max_pool2d_grad", g, tile=True),
                    pool_kernels.render_cuda(f"p{i}_gather", "max_pool2d_grad", g)]
    return kernels, cuda_emulator.build(kernels, folder, "pool_grad")


@pytest.mark.parametrize("idx", range(len(CASES)))
def test_both_gradient_modes_equal_the_interpreter_bit_for_bit(idx, emulated):
    kernels, lib = emulated
    shape, attrs = CASES[idx]
    x, dy = _inputs(shape, attrs, np.random.default_rng(idx))
    ref = interpreter.IMPLS["max_pool2d_grad"]((x, dy), attrs, None)
    for k in (2 * idx, 2 * idx + 1):
        out = np.full(x.shape, np.nan, np.float32)  # every element must be written
        cuda_emulator.run(lib, k, kernels[k], dict(x=x, dy=dy, out=out))
        assert np.array_equal(out.view(np.uint32), ref.astype(np.float32).view(np.uint32)), kernels[k].name


def test_the_tile_mode_launches_a_thread_a_window_tile_and_refuses_overlapping_windows():
    g = pool_kernels.geometry((4, 3, 9, 9), _attrs((2, 2), (2, 2)))  # floor mode leaves row and column 8 out
    k = pool_kernels.render_cuda("t", "max_pool2d_grad", g, tile=True)
    (launch,) = k.launches
    assert launch.grid[0] * launch.block[0] >= 4 * 3 * 5 * 5 > (launch.grid[0] - 1) * launch.block[0]
    with pytest.raises(ValueError, match="windows that do not overlap"):
        pool_kernels.render_cuda("t", "max_pool2d_grad", pool_kernels.geometry((1, 1, 9, 9), _attrs((3, 3), (2, 2))),
                                 tile=True)


def _pool_grads(kernel: int, stride: int):
    nn.manual_seed(0)
    side = (26 - kernel) // stride + 1
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(kernel, stride), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * side * side, 10))
    example = (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int64))
    with tuning_db.using(None):
        graph = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda").values()))
        return [(graph.attrs(n)["graph"], graph.attrs(n)["kernel"]) for n in graph.meta["schedule"]
                if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "max_pool2d_grad"]


def test_the_table_offers_the_tile_mode_first_where_windows_do_not_overlap():
    ((sub, spec),) = _pool_grads(2, 2)
    assert cuda_choices.candidates(sub, spec) == [("pool", (("mode", "tile"),)),
                                                               ("pool", (("mode", "gather"),))]
    assert spec.choice == ("pool", (("mode", "tile"),)) and "choice=pool(mode=tile)" in spec.describe()
    ((sub, spec),) = _pool_grads(3, 2)  # overlapping windows: an element may take several cotangents
    assert cuda_choices.candidates(sub, spec) == [("pool", (("mode", "gather"),))]
    key = cuda_choices.TABLE.key(sub, spec)
    assert '"KH":3' in key and '"SH":2' in key and '"H":26' in key  # the sizes key the database's records


def test_both_modes_compile_with_nvcc(emulated, tmp_path):
    kernels, _ = emulated
    src = tmp_path / "pool.cu"
    src.write_text(cuda.prelude(bf16=True) + "\n".join(k.code for k in kernels)
                   + pool_kernels.render_cuda("b", "max_pool2d_grad", pool_kernels.geometry(
                       (2, 3, 24, 24), _attrs((2, 2), (2, 2))), bf16=True, tile=True).code)
    assert_compiles(nvcc_or_skip(), src)


@pytest.mark.parametrize("tile", [False, True], ids=["gather", "tile"])
def test_pooling_on_run_time_images_is_one_text_and_the_interpreters_values(tile, tmp_path):
    """What a step of a later batch size runs (the first step's plan, `cuda_choices.runtime_sizes`):
    the forward and the gradient take the images as a by-value argument, one text at 3 images and
    at 1, and the interpreter's values at both (the gradient bit for bit)."""
    attrs = _attrs((2, 2), (2, 2), ceil=True)
    texts: dict[str, set] = {"fwd": set(), "grad": set()}
    for n in (3, 1):
        shape = (n, 4, 9, 10)
        g = pool_kernels.geometry(shape, attrs)
        fwd = pool_kernels.render_cuda("pf", "max_pool2d", g, runtime_images=True)
        grad = pool_kernels.render_cuda("pg", "max_pool2d_grad", g, tile=tile, runtime_images=True)
        assert fwd.launches[0].scalars == grad.launches[0].scalars == (("int", n),)
        texts["fwd"].add(fwd.code)
        texts["grad"].add(grad.code)
        x, dy = _inputs(shape, attrs, np.random.default_rng(n))
        lib = cuda_emulator.build([fwd, grad], tmp_path, f"pool_rt{n}{tile}")
        out = np.full((n, 4, g.HO, g.WO), 7.0, np.float32)
        cuda_emulator.run(lib, 0, fwd, dict(x=x, out=out))
        out_type = types.SimpleNamespace(shape=out.shape)  # (the interpreter's pooling reads its output's shape)
        np.testing.assert_array_equal(out, interpreter.IMPLS["max_pool2d"]((x,), attrs, out_type))
        dx = np.full(x.shape, np.nan, np.float32)
        cuda_emulator.run(lib, 1, grad, dict(x=x, dy=dy, out=dx))
        ref = interpreter.IMPLS["max_pool2d_grad"]((x, dy), attrs, None)
        assert np.array_equal(dx.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    assert len(texts["fwd"]) == len(texts["grad"]) == 1
