"""The direct convolutions on TF32 tensor cores (codegen/cuda_direct_tc.py, the `direct_tc` family).

Without a GPU, on random stride-1 geometries (odd sizes, padding, 1x1 to 5x5 and non-square
kernels, channel counts that are not multiples of 8) and the MNIST CNN's conv2:
- every plan the tuner may measure compiles with nvcc for sm_90, without a diagnostic;
- its launches write every output exactly once (the kernels' index mapping, with the tile
  sizes read from their own constants);
- the kernels' own source, run on the CPU with the warp's mma emulated from the PTX ISA's fragment
  tables (cuda_emulator.py; outputs, scratch and shared memory poisoned with NaN), matches a
  float64 reference of the TF32-rounded operands up to float32 summation;
- the family takes TF32 geometries only, and the cost model never picks it (unmeasured).
On a GPU (marked cuda): every plan of every stride-1 convolution of random networks, run by the
tuner's measurer, against the interpreter within the tuner's TF32 tolerance (TOLERANCE["tf32"]:
max |diff| / max |ref| <= 1e-2).
"""
from __future__ import annotations

import dataclasses
import math
import random
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cuda_cases
import cuda_emulator
import cuda_refs
from ember.codegen import cuda, cuda_choices, family_prior, tuning_db
from ember.codegen import cuda_direct_tc as ct
from ember.frontends import nn, optim, plan
from ember.ir.dtypes import bf16_bits, bf16_values, round_bf16
from nvcc import assert_compiles, nvcc_or_skip


@pytest.fixture(autouse=True)
def _cost_model_only():
    with tuning_db.using(None):
        yield


def _geometry(seed: int) -> dict:
    rng = random.Random(seed)
    KH, KW = rng.choice([(1, 1), (3, 3), (3, 5), (5, 3), (5, 5), (2, 3)])
    H, W = rng.randint(KH, 17), rng.randint(KW, 19)
    return dict(N=rng.randint(1, 4), C=rng.randint(1, 40), H=H, W=W, O=rng.randint(1, 40), KH=KH, KW=KW, stride=1,
                padding=(rng.randint(0, KH - 1), rng.randint(0, KW - 1)))


CONV2 = dict(N=64, C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0)
GEOMETRIES = [_geometry(seed) for seed in (0, 1, 3, 4)] + [CONV2]
IDS = [f"N{g['N']}_C{g['C']}_O{g['O']}_{g['H']}x{g['W']}_k{g['KH']}x{g['KW']}_p{g['padding']}".replace(" ", "")
       for g in GEOMETRIES]


def _sizes(g: dict) -> tuple[int, int]:
    return cuda_refs.conv_out(g)


def _kernels(g: dict, tag: str) -> list[tuple[str, object]]:
    """(kind, kernel) of every plan the tuner measures for this geometry: forward (+bias +relu),
    grad-input (*relu-mask) and grad-weight."""
    out = []
    HO, WO = _sizes(g)
    for kind, gi in (("conv_fwd", False), ("conv_gi", True)):
        geo = ct.tc_direct_problem(grad_input=gi, **g)
        plans = ct.tc_forward_candidates(g["N"], geo["CI"], geo["CO"], geo["HO_"], geo["WO_"], g["KH"], g["KW"])
        for i, p in enumerate(plans):
            k = ct.render_direct_tc(f"{tag}_{kind}{i}", grad_input=gi, bias=not gi, relu=not gi, relu_mask=gi, plan=p,
                                    **g)
            out.append((kind, k))
    for i, p in enumerate(ct.tc_grad_weight_candidates(g["N"], g["C"], g["O"], g["KH"], g["KW"], HO, WO)):
        out.append(("conv_gw", ct.render_direct_tc_grad_weight(f"{tag}_gw{i}", plan=p, **g)))
    return out


def test_every_geometry_has_plans_of_every_kind():
    for g in GEOMETRIES:
        assert {kind for kind, _ in _kernels(g, "k")} == {"conv_fwd", "conv_gi", "conv_gw"}, g


def test_every_plan_compiles_with_nvcc(tmp_path):
    nvcc = nvcc_or_skip()
    units = []
    for i, g in enumerate(GEOMETRIES):
        src = tmp_path / f"direct_tc_{i}.cu"
        src.write_text(cuda.prelude() + "\n".join(k.code for _, k in _kernels(g, f"g{i}")))
        units.append(src)
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda src: assert_compiles(nvcc, src), units))


# --------------------------------------------------------------------------- launch geometry

def _consts(code: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b([A-Z_][A-Z0-9_]*) = (\d+)\b", code)}


def _grid(*sizes: int) -> list[np.ndarray]:
    return [a.ravel() for a in np.meshgrid(*[np.arange(s) for s in sizes], indexing="ij")]


def forward_writes(kernel, images: int) -> np.ndarray:
    """How many times the forward / grad-input kernel writes each output, from its index mapping:
    block (x, image, share of the output channels), warp (wm, wn), lane (g, t), tile (i, j),
    accumulator r."""
    c = _consts(kernel.code)
    (ln,) = kernel.launches
    assert ln.grid[1] == images and ln.block[0] == 32 * c["WM"] * c["WN"]
    assert ln.grid[2] == c.get("TILES", 1)
    bx, n, z, warp, lane, i, j, r = _grid(ln.grid[0], images, ln.grid[2], c["WM"] * c["WN"], 32, c["FM"], c["FN"], 4)
    wm, wn, g, t = warp % c["WM"], warp // c["WM"], lane // 4, lane % 4
    q = (wm * c["FM"] + i) * 16 + g + 8 * (r // 2)
    co = z * c["WN"] * c["FN"] * 8 + (wn * c["FN"] + j) * 8 + 2 * t + r % 2
    ho, wo = bx * c["RB"] + q // c["WO"], q % c["WO"]
    live = (q < c["RB"] * c["WO"]) & (ho < c["HO"]) & (co < c["CO"])
    oi = ((n * c["CO"] + co) * c["HO"] + ho) * c["WO"] + wo
    return np.bincount(oi[live], minlength=images * c["CO"] * c["HO"] * c["WO"])


def grad_weight_writes(kernel) -> np.ndarray:
    """How many times each block of the grad-weight kernel's first launch writes each partial, and
    that its blocks take every (image, rows) unit once and the reduce launch covers every weight."""
    c = _consts(kernel.code)
    c.update(WM=math.ceil(c["O"] / 16) // c["FM"], WN=math.ceil(c["C"] / 8) // c["FN"], WK=c["KH"] // c["KHW"],
             UNITS=c["N_"] * math.ceil(c["HO"] / c["RB"]), OUTS=c["O"] * c["C"] * c["KH"] * c["KW"])
    main, red = kernel.launches
    warps = c["WM"] * c["WN"] * c["WK"]
    assert main.block[0] == 32 * warps and main.grid[0] == c["BLOCKS"]
    bounds = [b * c["UNITS"] // c["BLOCKS"] for b in range(c["BLOCKS"] + 1)]
    assert bounds[0] == 0 and bounds[-1] == c["UNITS"] and all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert red.grid[0] * 32 >= c["OUTS"]
    warp, lane, i, j, k, r = _grid(warps, 32, c["FM"], c["FN"], c["KHW"] * c["KW"], 4)
    wm, wn, wk = warp % c["WM"], warp // c["WM"] % c["WN"], warp // (c["WM"] * c["WN"])
    g, t = lane // 4, lane % 4
    o, ch = (wm * c["FM"] + i) * 16 + g + 8 * (r // 2), (wn * c["FN"] + j) * 8 + 2 * t + r % 2
    kh, kw = wk * c["KHW"] + k // c["KW"], k % c["KW"]
    live = (o < c["O"]) & (ch < c["C"])
    idx = ((o * c["C"] + ch) * c["KH"] + kh) * c["KW"] + kw
    return np.bincount(idx[live], minlength=c["OUTS"])


def test_a_grad_inputs_mask_reads_come_before_its_stores():
    """The stores follow every value of the thread's tile (the ReLU mask's reads in flight
    together), in a loop of their own after the values' loop."""
    for kind, k in _kernels(GEOMETRIES[0], "k"):
        if kind != "conv_gi":
            continue
        values, stores = k.code.split("acc[i][j][r] = v;", 1)
        assert "mask_src[" in values.rsplit("the values first, then the stores", 1)[1] and "p.out[" not in values
        assert "p.out[" in stores.split("for (int i = 0; i < FM; ++i)", 1)[1]


@pytest.mark.parametrize("idx", range(len(GEOMETRIES)), ids=IDS)
def test_every_plan_writes_every_output_exactly_once(idx):
    g = GEOMETRIES[idx]
    for kind, k in _kernels(g, "k"):
        if kind == "conv_gw":
            assert np.all(grad_weight_writes(k) == 1), k.name
        else:
            assert np.all(forward_writes(k, g["N"]) == 1), k.name


@pytest.mark.parametrize("idx", range(len(cuda_cases.direct_tc_kernels(batches=(64,)))))
def test_the_shared_cases_write_every_output_exactly_once(idx):
    """The kernels every CUDA kernel test shares (cuda_cases: compiled, and run on a GPU with NaN
    poisoning and twice for determinism)."""
    kernel, (kind, g, extra) = cuda_cases.direct_tc_kernels(batches=(64,))[idx]
    assert extra["tf32"]
    counts = grad_weight_writes(kernel) if kind == "conv_gw" else forward_writes(kernel, g["N"])
    assert np.all(counts == 1), kernel.name


# --------------------------------------------------------------------------- the kernels, emulated

def _case(kind: str, g: dict, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """Inputs (by role; the output poisoned with NaN) and the float64 reference of the kernel,
    its operands rounded to TF32 as the kernel rounds them."""
    N, C, H, W, O, KH, KW = (g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW"))
    HO, WO = _sizes(g)
    u = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)  # noqa: E731
    x, w, dy = u(N, C, H, W), u(O, C, KH, KW), u(N, O, HO, WO)
    tf = cuda_emulator.tf32
    if kind == "conv_fwd":
        b = u(O)
        return dict(x=x, w=w, bias=b, out=np.full((N, O, HO, WO), np.nan, np.float32)), \
            cuda_refs.conv_fwd_ref(tf(x), tf(w), b, g, relu=True)
    if kind == "conv_gi":
        mask = u(N, C, H, W)
        return dict(dy=dy, w=w, mask_src=mask, out=np.full(x.shape, np.nan, np.float32)), \
            cuda_refs.conv_grad_input_ref(tf(dy), tf(w), g, mask)
    return dict(x=x, dy=dy, out=np.full(w.shape, np.nan, np.float32)), cuda_refs.conv_grad_weight_ref(tf(x), tf(dy), g)[0]


#: the emulated geometries: small (one OS thread per CUDA thread), each with features of its own:
#: two channel stages (39 channels, 24 a stage) and padding on both axes; output-channel and column
#: tails with a 3 x 5 window; padding as tall as the window allows; a 1 x 1 convolution; a 4 x 2
#: window (grad-weight warps of 2 kernel rows)
EMULATED = [dict(N=1, C=39, H=6, W=7, O=26, KH=3, KW=3, stride=1, padding=(2, 2)),
            dict(N=2, C=5, H=7, W=9, O=19, KH=3, KW=5, stride=1, padding=(1, 2)),
            dict(N=1, C=8, H=5, W=11, O=33, KH=5, KW=3, stride=1, padding=(4, 2)),
            dict(N=2, C=11, H=3, W=3, O=20, KH=1, KW=1, stride=1, padding=0),
            dict(N=1, C=17, H=6, W=6, O=40, KH=4, KW=2, stride=1, padding=(1, 1))]


def _pick(plans: list, features) -> list:
    """The planner's best plan, and the one with the most of `features(plan)` (the ways it splits
    the work) that the best one lacks."""
    best = set(features(plans[0]))
    other = max(plans, key=lambda p: (len(set(features(p)) - best), len(features(p))))
    return list(dict.fromkeys((plans[0], other)))


def _emulated_kernels(g: dict, tag: str) -> list[tuple[str, object]]:
    """Of each kind, the planner's best plan and one that splits the work other ways (several
    tiles a warp, several warps along each axis)."""
    HO, WO = _sizes(g)
    out = []
    for kind, gi in (("conv_fwd", False), ("conv_gi", True)):
        geo = ct.tc_direct_problem(grad_input=gi, **g)
        plans = ct.tc_forward_plans(g["N"], geo["CI"], geo["CO"], geo["HO_"], geo["WO_"], g["KH"], g["KW"])
        for i, p in enumerate(_pick(plans, lambda p: [f for f in ("FM", "FN", "WM", "WN") if getattr(p, f) > 1])):
            out.append((kind, ct.render_direct_tc(f"{tag}_{kind}{i}", grad_input=gi, bias=not gi, relu=not gi,
                                                  relu_mask=gi, plan=p, **g)))
    for i, p in enumerate(_grad_weight_plans(g)):
        out.append(("conv_gw", ct.render_direct_tc_grad_weight(f"{tag}_gw{i}", plan=p, **g)))
    return out


def _grad_weight_plans(g: dict, pairs: bool = False) -> list:
    """The grad-weight planner's best plan and one that splits the work other ways."""
    HO, WO = _sizes(g)
    MT, NT = -(-g["O"] // 16), -(-g["C"] // 8)
    plans = ct.tc_grad_weight_plans(g["N"], g["C"], g["O"], g["KH"], g["KW"], HO, WO, pairs)
    ways = dict(FM=lambda p: p.FM > 1, FN=lambda p: p.FN > 1, KHW=lambda p: p.KHW > 1, WM=lambda p: MT > p.FM,
                WN=lambda p: NT > p.FN, WK=lambda p: g["KH"] > p.KHW)
    return _pick(plans, lambda p: [f for f, has in ways.items() if has(p)])


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """(kernels, library) of each emulated geometry, built two at a time."""
    folder = tmp_path_factory.mktemp("emulated")
    kernels = [_emulated_kernels(g, f"e{i}") for i, g in enumerate(EMULATED)]
    with ThreadPoolExecutor(2) as ex:
        libs = list(ex.map(lambda i: cuda_emulator.build([k for _, k in kernels[i]], folder, f"direct_tc_{i}"),
                           range(len(EMULATED))))
    return list(zip(kernels, libs))


@pytest.mark.parametrize("idx", range(len(EMULATED)))
def test_the_kernels_emulated_on_the_cpu_match_the_reference(idx, emulated):
    g = EMULATED[idx]
    kernels, lib = emulated[idx]
    assert {kind for kind, _ in kernels} == {"conv_fwd", "conv_gi", "conv_gw"}
    rng = np.random.default_rng(idx)
    for i, (kind, k) in enumerate(kernels):
        bufs, ref = _case(kind, g, rng)
        cuda_emulator.run(lib, i, k, bufs)
        got = bufs["out"]
        assert np.all(np.isfinite(got)), (k.name, int(np.isnan(got).sum()))
        # float32 sums of at most a few hundred terms against float64 ones
        err = np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30)
        assert err <= 1e-5, (k.name, err)


def _bf16_kernels(g: dict, tag: str) -> list[tuple[str, object]]:
    """The forward (+bias +relu) and grad-input (*relu-mask) with every operand and the output
    bfloat16 (precision "bf16"): the bfloat16 planner's best (stages of 16-channel steps: bfloat16
    pairs on mma.m16n8k16) and, where the float planner's best stages 8 or 24 channels, that plan
    too (TF32 mma on the exact bfloat16 values: a tuned plan of that kind stays valid); the
    grad-weight's (pixel pairs on mma.m16n8k16) best plan and one that splits the work other ways."""
    out = []
    for kind, gi in (("conv_fwd", False), ("conv_gi", True)):
        geo = ct.tc_direct_problem(grad_input=gi, **g)
        sizes = (g["N"], geo["CI"], geo["CO"], geo["HO_"], geo["WO_"], g["KH"], g["KW"])
        plans = [ct.tc_forward_plans(*sizes, pairs=True)[0]]
        plans += [p for p in ct.tc_forward_plans(*sizes)[:1] if p.CC % 16]
        roles = frozenset({"dy", "w", "mask_src", "out"} if gi else {"x", "w", "bias", "out"})
        for i, plan in enumerate(plans):
            k = ct.render_direct_tc(f"{tag}_{kind}{i}", grad_input=gi, bias=not gi, relu=not gi, relu_mask=gi,
                                    plan=plan, bf16_roles=roles, **g)
            assert ("mma_bf16(" in k.code) == (plan.CC % 16 == 0) != ("mma_tf32(" in k.code)
            out.append((kind, k))
    for i, plan in enumerate(_grad_weight_plans(g, pairs=True)):
        k = ct.render_direct_tc_grad_weight(f"{tag}_gw{i}", plan=plan, bf16_roles=frozenset({"x", "dy", "out"}), **g)
        assert "mma_bf16(" in k.code and "mma_tf32(" not in k.code
        out.append(("conv_gw", k))
    return out


def _bf16_case(kind: str, g: dict, bufs: dict) -> tuple[dict, np.ndarray]:
    """A forward, grad-input or grad-weight case's inputs rounded to bfloat16, as bits by role (the output
    poisoned with NaN: every output must be written), and the bfloat16 reference: float64 sums of
    the values, the convolution rounded, the bias add rounded again and ReLU, or the ReLU mask."""
    vals = {r: round_bf16(v) for r, v in bufs.items() if r != "out"}
    if kind == "conv_fwd":
        conv = round_bf16(cuda_refs.conv_fwd_ref(vals["x"], vals["w"], None, g, relu=False).astype(np.float32))
        ref = np.maximum(round_bf16(conv + vals["bias"][None, :, None, None]), 0)
    elif kind == "conv_gw":
        ref = round_bf16(cuda_refs.conv_grad_weight_ref(vals["x"], vals["dy"], g)[0].astype(np.float32))
    else:
        ref = round_bf16(cuda_refs.conv_grad_input_ref(vals["dy"], vals["w"], g, vals["mask_src"]).astype(np.float32))
    bits = {r: bf16_bits(v) for r, v in vals.items()}
    bits["out"] = np.full(bufs["out"].shape, 0x7FC0, np.uint16)
    return bits, ref


@pytest.mark.parametrize("idx", [0, 1, 2])
def test_bfloat16_operands_emulated_match_the_bfloat16_reference(idx, tmp_path):
    """bfloat16 pairs on the bfloat16 mma, or values exact in TF32 on the TF32 mma: either way the
    kernel's products are the bfloat16 ones, summed in fp32, the convolution rounded to bfloat16,
    the bias add rounded again (the interpreter's ops), the output stored as bfloat16 bits; the
    grad-weight's partials summed in block order, the sum rounded.
    Against float64 sums of the same values with the same roundings: equal but for the last bit
    where the fp32 sum lands on a bfloat16 tie. (Channel counts 39/26, 5/19, 8/33: odd pairs,
    a stage partly past the channels.)"""
    g = EMULATED[idx]
    kernels = _bf16_kernels(g, f"b{idx}")
    lib = cuda_emulator.build([k for _, k in kernels], tmp_path, f"bf16_{idx}")
    rng = np.random.default_rng(100 + idx)
    for i, (kind, k) in enumerate(kernels):
        bits, ref = _bf16_case(kind, g, _case(kind, g, rng)[0])
        cuda_emulator.run(lib, i, k, bits)
        got = bf16_values(bits["out"])
        assert np.all(np.isfinite(got)), (k.name, int(np.isnan(got).sum()))
        assert np.max(np.abs(got - ref)) <= 2.0 ** -7 * np.max(np.abs(ref)), k.name
        assert np.mean(got == ref) >= 0.97, (k.name, np.mean(got == ref))


def test_bfloat16_kernels_compile_with_nvcc_and_the_table_offers_them(tmp_path):
    src = tmp_path / "bf16.cu"
    src.write_text(cuda.prelude(bf16=True) + "\n".join(k.code for _, k in _bf16_kernels(CONV2, "nb")))
    assert_compiles(nvcc_or_skip(), src)
    model, shape = NETS[0]
    kinds = set()
    for sub, spec in _conv_kernels(model, shape, "bf16"):
        g = cuda_choices.geometry(sub, spec)
        assert g.get("dtype") == "bfloat16"
        offered = any(f == "direct_tc" for f, _ in cuda_choices.candidates(sub, spec))
        # every stride-1 kind the direct kernels take (the grad-weight where a plan of it fits)
        assert offered == (cuda_choices.TABLE.applies(cuda_choices.FAMILIES["direct"], dict(g, dtype=None)) is None
                           and bool(cuda_choices.FAMILIES["direct_tc"].all_plans(g))), (spec.describe(), offered)
        kinds |= {spec.kind} if offered else set()
    assert kinds == {"conv2d", "conv2d_grad_input", "conv2d_grad_weight"}


def test_the_emulated_mma_holds_the_ptx_fragment_layout(tmp_path):
    """A wrong fragment index fails the comparison above: a kernel with A's rows g and g + 8
    swapped (a1 read where a2 belongs) differs from the reference by O(1)."""
    g = EMULATED[1]
    kind, k = _kernels(g, "swap")[0]
    good = "a[i][1] = __float_as_uint(xk[kh * WS + kw + base[i][1]]);"
    assert good in k.code
    bad = dataclasses.replace(k, code=k.code.replace(good, good.replace("base[i][1]", "base[i][0]")))
    lib = cuda_emulator.build([bad], tmp_path, "swapped")
    bufs, ref = _case(kind, g, np.random.default_rng(0))
    cuda_emulator.run(lib, 0, bad, bufs)
    assert np.max(np.abs(bufs["out"] - ref)) > 0.1 * np.max(np.abs(ref))


# --------------------------------------------------------------------------- the choice table

def _net(seed: int):
    """Two stride-1 convolutions (the second's forward, grad-input with ReLU's mask and grad-weight
    are direct_tc's), odd sizes and padding."""
    rng = random.Random(seed)
    c, o, o2 = rng.choice([1, 3, 8, 16]), rng.choice([5, 16, 24, 32]), rng.choice([8, 12])
    k, k2, h = rng.choice([1, 3, 5]), rng.choice([3, 5]), rng.choice([9, 13, 28])
    p, p2 = rng.randint(0, k - 1), rng.randint(0, k2 - 1)
    ho = h + 2 * p - k + 1
    ho2 = ho + 2 * p2 - k2 + 1
    nn.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(c, o, k, padding=p), nn.ReLU(), nn.Conv2d(o, o2, k2, padding=p2), nn.ReLU(),
                          nn.Flatten(), nn.Linear(o2 * ho2 * ho2, 10))
    return model, (rng.choice([3, 64]), c, h, h)


NETS = [_net(seed) for seed in range(3)]


def _conv_kernels(model, shape, precision: str):
    example = (np.zeros(shape, np.float32), np.zeros(shape[0], np.int64))
    graph = next(iter(plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda",
                           precision=precision).values()))
    for n in graph.meta["schedule"]:
        if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind in cuda_choices.CONVS:
            yield graph.attrs(n)["graph"], graph.attrs(n)["kernel"]


def test_records_of_the_widened_bf16_grad_weight_are_stale_and_the_others_are_not():
    """The bf16 grad-weight's code changed (pixel pairs on the bf16 mma): its records, which timed
    the widened TF32 kernel, are of version 1 and stale; the forward's, grad-input's and every
    TF32 record keep version 1."""
    model, shape = NETS[0]
    seen = set()
    for precision in ("bf16", "tf32"):
        for sub, spec in _conv_kernels(model, shape, precision):
            versions = cuda_choices.TABLE.versions(sub, spec)
            if "direct_tc" not in versions:
                continue
            bf16_gw = precision == "bf16" and spec.kind == "conv2d_grad_weight"
            assert versions["direct_tc"] == (2 if bf16_gw else 1), (precision, spec.kind)
            seen.add((precision, spec.kind))
    assert {("bf16", "conv2d_grad_weight"), ("tf32", "conv2d_grad_weight"), ("bf16", "conv2d")} <= seen


def test_the_family_serves_tf32_only_and_is_the_cost_models_pick_only_where_measured(monkeypatch):
    model, shape = NETS[0]
    # with no measurement at all (an empty sample for the cost model's prior: family_prior)
    monkeypatch.setattr(family_prior, "sample", lambda db, target, device: {})
    for sub, spec in _conv_kernels(model, shape, "float32"):
        assert all(f != "direct_tc" for f, _ in cuda_choices.candidates(sub, spec))
        g = cuda_choices.geometry(sub, spec)
        assert cuda_choices.TABLE.applies(cuda_choices.FAMILIES["direct_tc"], g) == \
            "it runs on TF32 tensor cores: precision 'tf32' or bfloat16 operands only"
    served = 0
    for sub, spec in _conv_kernels(model, shape, "tf32"):
        cands = cuda_choices.candidates(sub, spec)
        assert spec.choice[0] != "direct_tc" and cands[0] == spec.choice
        tc = [p for f, p in cands if f == "direct_tc"]
        served += bool(tc)
        assert len(tc) == len(set(tc))
    assert served >= 3  # forward, grad-input and grad-weight of the stride-1 convolutions
    with cuda_choices.force(conv2d="direct_tc"), pytest.raises(ValueError) as info:
        list(_conv_kernels(model, shape, "float32"))
    assert "forced family 'direct_tc' does not apply: it runs on TF32 tensor cores" in str(info.value)
    assert "\n" not in str(info.value)
    monkeypatch.undo()  # the shipped records: where the cost model takes it, its prior says why
    for sub, spec in _conv_kernels(model, shape, "tf32"):
        if spec.choice[0] == "direct_tc":
            assert "prior of" in spec.why and "direct_tc" in spec.why or spec.why.startswith("tuned"), spec.why


@pytest.mark.parametrize("idx", range(len(NETS)))
def test_every_candidate_of_the_choice_table_renders_and_covers_its_outputs(idx, tmp_path):
    """Through the table, as the tuner renders them: with the epilogues fusion gives (bias, ReLU,
    its mask, a generated pointwise epilogue) and the stamped scratch; those of the first network
    compile (the others' templates are the geometries' above)."""
    model, shape = NETS[idx]
    codes = []
    for sub, spec in _conv_kernels(model, shape, "tf32"):
        g = cuda_choices.geometry(sub, spec)
        for i, choice in enumerate(c for c in cuda_choices.candidates(sub, spec) if c[0] == "direct_tc"):
            c_spec = dataclasses.replace(spec, choice=choice, scratch_bytes=cuda_choices.scratch_bytes(sub, spec, choice))
            kernel, _ = cuda.render_contraction(f"t{i}_{sub.name}", sub, c_spec)
            assert kernel.scratch_bytes == c_spec.scratch_bytes
            if spec.kind == "conv2d_grad_weight":
                assert np.all(grad_weight_writes(kernel) == 1)
            else:
                assert np.all(forward_writes(kernel, g["N"]) == 1)
            codes.append(kernel.code)
    assert codes
    if idx == 0:
        src = tmp_path / "table.cu"
        src.write_text(cuda.prelude() + "\n".join(codes))
        assert_compiles(nvcc_or_skip(), src)


# --------------------------------------------------------------------------- on a GPU

def _cnn(batch: int):
    from models import cnn
    return cnn(), (batch, 1, 28, 28)


GPU_NETS = NETS + [_net(seed) for seed in range(3, 6)] + [_cnn(256)]


@pytest.mark.cuda
@pytest.mark.parametrize("idx", range(len(GPU_NETS)))
def test_every_plan_matches_the_interpreter_on_the_gpu(idx):
    pytest.importorskip("cupy")
    from ember.runtime.tuner import TOLERANCE
    from ember.runtime.tuner_cuda import CudaMeasurer
    measurer = CudaMeasurer()
    model, shape = GPU_NETS[idx]
    measured = 0
    for sub, spec in _conv_kernels(model, shape, "tf32"):
        choices = [c for c in cuda_choices.candidates(sub, spec) if c[0] == "direct_tc"]
        if choices:
            measured += cuda_refs.measured_against_interpreter(measurer, sub, spec, choices, TOLERANCE["tf32"])
    assert measured > 0


def test_a_tuned_plan_that_tiles_the_geometry_stays_valid_when_the_planner_no_longer_lists_it():
    """The bfloat16 planner (16-channel stages) lists other plans than the one its shipped records
    measured; a record's plan that tiles the convolution (its blocks owning every output channel
    or a share of them) and fits shared memory is still taken, one that does not tile it is refused."""
    g = dict(kind="conv2d_grad_input", epilogues=("relu_mask",), tf32=False, dtype="bfloat16", N=1024, C=16, H=26,
             W=26, O=32, KH=3, KW=3, HO=24, WO=24, stride=(1, 1), padding=(0, 0))
    family = cuda_choices.FAMILIES["direct_tc"]
    listed = set(family.all_plans(g))
    kept = (("RB", 13), ("CC", 16), ("FM", 3), ("FN", 2), ("WM", 8), ("WN", 1))
    assert kept not in listed and family.fits(g, kept)
    assert not family.fits(g, (("RB", 13), ("CC", 16), ("FM", 1), ("FN", 2), ("WM", 8), ("WN", 1)))  # 128 < 13 x 26 pixels
    assert family.fits(g, (("RB", 13), ("CC", 16), ("FM", 3), ("FN", 1), ("WM", 8), ("WN", 1)))  # 8 of 16 channels a block
    assert not family.fits(g, (("RB", 13), ("CC", 16), ("FM", 3), ("FN", 3), ("WM", 8), ("WN", 1)))  # 24 > 16 channels


#: more than 64 output channels (forward: O; grad-input: C), so the planner offers blocks owning a
#: share of them (grid z over the shares, the last share partly past the channels)
WIDE = dict(N=1, C=72, H=5, W=6, O=76, KH=3, KW=3, stride=1, padding=(1, 1))


@pytest.mark.parametrize("bf16", [False, True], ids=["tf32", "bf16"])
def test_plans_owning_a_share_of_the_output_channels_match_the_reference(bf16, tmp_path):
    """A block that stages only its share's weights (all of a wide layer's: 9 x 16 x 264 words at
    256 channels, over a block's shared memory) computes the same convolution: TF32 on floats, and
    bfloat16 pairs on the bfloat16 mma, forward (+bias +relu) and grad-input (*relu-mask)."""
    g = WIDE
    kernels = []
    for kind, gi in (("conv_fwd", False), ("conv_gi", True)):
        geo = ct.tc_direct_problem(grad_input=gi, **g)
        NT = -(-geo["CO"] // 8)
        plans = ct.tc_forward_plans(g["N"], geo["CI"], geo["CO"], geo["HO_"], geo["WO_"], g["KH"], g["KW"], pairs=bf16)
        shared = [p for p in plans if p.WN * p.FN < NT and NT % (p.WN * p.FN)]  # a partial last share
        assert shared, (kind, NT)
        roles = frozenset({"dy", "w", "mask_src", "out"} if gi else {"x", "w", "bias", "out"}) if bf16 else frozenset()
        k = ct.render_direct_tc(f"w_{kind}", grad_input=gi, bias=not gi, relu=not gi, relu_mask=gi, plan=shared[0],
                                bf16_roles=roles, **g)
        assert k.launches[0].grid[2] == -(-NT // (shared[0].WN * shared[0].FN)) > 1 and "co0 + " in k.code
        assert ("mma_bf16(" in k.code) == bf16
        kernels.append((kind, k))
    lib = cuda_emulator.build([k for _, k in kernels], tmp_path, "wide")
    rng = np.random.default_rng(7)
    for i, (kind, k) in enumerate(kernels):
        bufs, ref = _case(kind, g, rng)
        if bf16:
            bits, ref = _bf16_case(kind, g, bufs)
            cuda_emulator.run(lib, i, k, bits)
            got = bf16_values(bits["out"])
            assert np.all(np.isfinite(got)) and np.max(np.abs(got - ref)) <= 2.0 ** -7 * np.max(np.abs(ref)), k.name
            assert np.mean(got == ref) >= 0.97, (k.name, np.mean(got == ref))
        else:
            cuda_emulator.run(lib, i, k, bufs)
            got = bufs["out"]
            assert np.all(np.isfinite(got)), (k.name, int(np.isnan(got).sum()))
            assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) <= 1e-5, k.name
        assert np.all(forward_writes(k, g["N"]) == 1), k.name
    src = tmp_path / "wide.cu"
    src.write_text(cuda.prelude(bf16=True) + "\n".join(k.code for _, k in kernels))
    assert_compiles(nvcc_or_skip(), src)
