"""CUDA launch geometry covers every output, checked without a GPU.

A grid one block short computes nothing for the elements it misses, and only a GPU run with
poisoned outputs notices; the contract test checks only that grids are positive. Here the launch
records of the GEMM, direct and small-window families (cuda_cases: MNIST and odd geometries) are
held to each kernel's mapping of blocks to outputs, with the tile sizes read from the kernel's
own constants and the output sizes from the geometry."""
from __future__ import annotations

import math
import re

import pytest

import cuda_cases
from cuda_refs import conv_out
from ember.codegen import cuda_kernels as ck

CASES = cuda_cases.all_kernels(batches=(64,))


def _consts(code: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b([A-Z_][A-Z0-9_]*) = (\d+)\b", code)}


#: the GEMM skeleton's run-time sizes (by-value arguments, `cuda_kernels._RUNTIME_SIZES`) by name
_RUNTIME = {"rM": "M", "rK": "K", "rB": "BATCH", "rKC": "KCHUNK"}


def _sizes(kernel, ln) -> dict[str, int]:
    """The kernel's constants and, for a launch taking sizes at run time, their values for it."""
    c = _consts(kernel.code)
    (params,) = re.findall(rf"{ln.function}\(([^)]*)\)", kernel.code)
    names = re.findall(r"const int (r[A-Z]+)\b", params)
    assert len(names) == len(ln.scalars), (names, ln.scalars)
    return c | {_RUNTIME[name]: value for name, (_, value) in zip(names, ln.scalars)}


def _main(kernel, suffix: str):
    (ln,) = [ln for ln in kernel.launches if ln.function.endswith(suffix)]
    return ln


@pytest.mark.parametrize("idx", [i for i, (k, _) in enumerate(CASES) if k.launches[0].function.endswith("_small")],
                         ids=lambda i: CASES[i][0].name)
def test_small_window_forward_grid_covers_every_row_of_every_image(idx):
    kernel, (kind, g, _) = CASES[idx]
    c = _consts(kernel.code)
    HO, WO = conv_out(g)
    ln = _main(kernel, "_small")
    # block b: image b // GROUPS, rows [RB * (b % GROUPS), + RB): every (image, row group) once
    assert ln.grid == (g["N"] * math.ceil(HO / c["RB"]), 1, 1)
    assert WO % c["V"] == 0 and g["O"] % c["OT"] == 0
    assert ln.block[0] == (g["O"] // c["OT"]) * c["TL"]


@pytest.mark.parametrize("idx", [i for i, (k, spec) in enumerate(CASES)
                                 if k.launches[0].function.endswith("_direct") and spec[0] != "conv_gw"],
                         ids=lambda i: CASES[i][0].name)
def test_direct_grid_covers_every_row_of_every_image(idx):
    kernel, (kind, g, _) = CASES[idx]
    c = _consts(kernel.code)
    HO, _ = conv_out(g)
    rows = g["H"] if kind == "conv_gi" else HO
    ln = _main(kernel, "_direct")
    assert ln.grid[0] * c["RB"] >= rows and (ln.grid[0] - 1) * c["RB"] < rows and ln.grid[1] == g["N"]


@pytest.mark.parametrize("idx", [i for i, (k, _) in enumerate(CASES) if k.launches[0].function.endswith("_gemm")],
                         ids=lambda i: CASES[i][0].name)
def test_gemm_grid_covers_every_output_tile(idx):
    kernel, (kind, g, extra) = CASES[idx]
    ln = _main(kernel, "_gemm")
    c = _sizes(kernel, ln)
    if kind == "matmul":
        m, n, batch = g["M"], g["N"], g.get("batch", 1)
        assert (c["M"], c["N"], c["BATCH"]) == (m, n, batch)
    else:  # the GEMM view of a convolution: its sizes come from the kernel; only the tiling is checked
        m, n, batch = c["M"], c["N"], c["BATCH"]
    # block (x, y, z): rows [BM x, +BM), columns [BN y, +BN), batch z // SPLITS, split z % SPLITS
    assert ln.grid[0] == math.ceil(m / c["BM"]) and ln.grid[1] == math.ceil(n / c["BN"])
    assert ln.grid[2] == batch * c["SPLITS"]


def test_the_small_window_forward_of_conv1_covers_all_64_images():
    k = [k for k, _ in CASES if k.name == "conv1_64_sfwd1"][0]
    assert k.launches[0].grid[0] == 64 * math.ceil(26 / _consts(k.code)["RB"])
