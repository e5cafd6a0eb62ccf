"""The `nhwc_tc` family (codegen/cuda_conv_nhwc.py): bfloat16 convolutions as a GEMM over
channels-innermost operands relaid in the kernel's scratch block.

Without a GPU each kernel runs in the CPU emulation of its own source (cuda_emulator.py: the
copies synchronous, ldmatrix by its definition in warp shuffles, the mma from the PTX fragment
tables) against float64 sums of the same bfloat16 values with the same roundings (the convolution
rounded to bfloat16, the bias add rounded again): a wrong relayout, border, swizzle, fragment read,
split or epilogue index gives wrong numbers here. Every plan the tuner measures compiles with nvcc;
on a GPU (`cuda` mark) every plan of a wide layer matches the interpreter through the tuner's
measurer."""
from __future__ import annotations

import re

import numpy as np
import pytest

import cuda_emulator
import cuda_refs
from ember.codegen import cuda, cuda_choices
from ember.codegen import cuda_conv_nhwc as cn
from ember.codegen.cuda_kernels import PointwiseEpilogue
from ember.codegen.shapes import round_up
from ember.frontends import nn, optim
from ember.frontends import plan as plan_steps
from ember.ir.dtypes import bf16_bits, bf16_values, round_bf16
from ember.runtime.tuner import TOLERANCE
from nvcc import assert_compiles, find_nvcc, nvcc_or_skip

KINDS = {"fwd": "conv2d", "gi": "conv2d_grad_input", "gw": "conv2d_grad_weight"}


def _geometry(kind: str, N, C, H, W, O, KH, KW, stride, padding) -> dict:
    (sh, sw), (ph, pw) = cuda_refs._pair(stride), cuda_refs._pair(padding)
    g = dict(kind=KINDS[kind], epilogues=frozenset(), tf32=False, dtype="bfloat16", N=N, C=C, H=H, W=W, O=O, KH=KH,
             KW=KW, stride=(sh, sw), padding=(ph, pw))
    g["HO"], g["WO"] = cuda_refs.conv_out(g)
    return g


#: small geometries (the emulation runs a CUDA thread as an OS thread), each with features of its
#: own: 3x3 stride 1 with pixels past the last row tile; stride 2 (the forward and grad-weight
#: only); a 1x1 convolution; a 3x5 window with padding (2, 1) and 40 output channels (a 64-wide
#: block, partly past them); a k of 72 (8 channels: a k-tile partly past it); strides 3 x 2 with a
#: 3x2 window on odd sizes
EMULATED = [dict(N=2, C=16, H=6, W=7, O=24, KH=3, KW=3, stride=1, padding=1),
            dict(N=1, C=8, H=9, W=9, O=16, KH=3, KW=3, stride=2, padding=1),
            dict(N=2, C=24, H=5, W=5, O=8, KH=1, KW=1, stride=1, padding=0),
            dict(N=1, C=16, H=6, W=8, O=40, KH=3, KW=5, stride=1, padding=(2, 1)),
            dict(N=1, C=8, H=7, W=7, O=64, KH=3, KW=3, stride=1, padding=0),
            dict(N=1, C=8, H=10, W=11, O=16, KH=3, KW=2, stride=(3, 2), padding=(1, 0))]

#: a generated epilogue reading an operand of the output's shape at the flat NCHW index
EPILOGUE = PointwiseEpilogue(("float e = red * in5[i] + 0.5f;",), "e", (5,))


def _kernels(idx: int, wg: bool = False) -> list[tuple[str, object, cn.NhwcPlan]]:
    """(kind, kernel, plan) of each kind the family serves at EMULATED[idx]: the first plan and the
    last (other blockings, stage counts and split counts), the forward with bias and ReLU, the
    grad-input with the ReLU mask, the grad-weight with a generated epilogue (and the plan of the
    deepest pipeline where neither is); the first forward
    also with a generated epilogue and a float32 output. `wg`: the warpgroup-MMA plans (family
    nhwc_wg)."""
    out = []
    for kind in KINDS:
        g = _geometry(kind, **EMULATED[idx])
        why = cn.wg_serves(g) if wg else cn.serves(g)
        if why is not None:
            assert kind == "gi" and g["stride"] != (1, 1), why
            continue
        plans = cn.wg_plans(g) if wg else cn.plans(g)
        deepest = max(plans, key=lambda q: q.STAGES)  # the last may be a one-warpgroup block of 4 stages
        for i, plan in enumerate(dict.fromkeys([plans[0], plans[-1], deepest])):
            name = f"n{idx}{kind}{i}"
            if kind == "fwd":
                k = cn.render(name, g, plan, bias=True, relu=True, bf16_roles=frozenset({"x", "w", "bias", "out"}))
            elif kind == "gi":
                k = cn.render(name, g, plan, relu_mask=True, bf16_roles=frozenset({"dy", "w", "mask_src", "out"}))
            else:
                k = cn.render(name, g, plan, epilogue=EPILOGUE, bf16_roles=frozenset({"x", "dy"}))
            assert ("wgmma.mma_async" in k.code) == wg
            out.append((kind, k, plan))
    g = _geometry("fwd", **EMULATED[idx])
    first = (cn.wg_plans(g) if wg else cn.plans(g))[0]
    out.append(("fwd_pw", cn.render(f"n{idx}pw", g, first, epilogue=EPILOGUE, bf16_roles=frozenset({"x", "w"})), first))
    return out


def _case(kind: str, g: dict, rng: np.random.Generator) -> tuple[dict, np.ndarray, bool]:
    """(buffers by role: bfloat16 bits or float32, the output poisoned with NaN; the reference as
    floats; whether the output is bfloat16)."""
    N, C, H, W, O, KH, KW = (g[k] for k in ("N", "C", "H", "W", "O", "KH", "KW"))
    HO, WO = cuda_refs.conv_out(g)
    u = lambda *shape: round_bf16(rng.uniform(-1, 1, shape).astype(np.float32))  # noqa: E731
    x, w, dy = u(N, C, H, W), u(O, C, KH, KW), u(N, O, HO, WO)
    if kind == "fwd":
        bias = u(O)
        conv = round_bf16(cuda_refs.conv_fwd_ref(x, w, None, g, relu=False).astype(np.float32))
        ref = np.maximum(round_bf16(conv + bias[None, :, None, None]), 0)
        return dict(x=x, w=w, bias=bias), ref, True
    if kind == "fwd_pw":
        e = rng.uniform(-1, 1, (N, O, HO, WO)).astype(np.float32)
        conv = round_bf16(cuda_refs.conv_fwd_ref(x, w, None, g, relu=False).astype(np.float32))
        return dict(x=x, w=w, in5=e), conv * e + np.float32(0.5), False
    if kind == "gi":
        mask = u(N, C, H, W)
        ref = round_bf16(cuda_refs.conv_grad_input_ref(dy, w, g, mask).astype(np.float32))
        return dict(dy=dy, w=w, mask_src=mask), ref, True
    e = rng.uniform(-1, 1, (O, C, KH, KW)).astype(np.float32)
    dw = round_bf16(cuda_refs.conv_grad_weight_ref(x, dy, g)[0].astype(np.float32))
    return dict(x=x, dy=dy, in5=e), dw * e + np.float32(0.5), False


def _run(lib, index: int, kernel, vals: dict, ref: np.ndarray, out_bf16: bool) -> np.ndarray:
    bf16 = {"x", "w", "dy", "bias", "mask_src"}
    bufs = {r: bf16_bits(v) if r in bf16 else np.ascontiguousarray(v, np.float32) for r, v in vals.items()}
    bufs["out"] = np.full(ref.shape, 0x7FC0, np.uint16) if out_bf16 else np.full(ref.shape, np.nan, np.float32)
    cuda_emulator.run(lib, index, kernel, bufs)
    return bf16_values(bufs["out"]) if out_bf16 else bufs["out"]


@pytest.mark.parametrize("wg", [False, True], ids=["mma_sync", "wgmma"])
@pytest.mark.parametrize("idx", range(len(EMULATED)))
def test_the_kernels_emulated_on_the_cpu_give_the_bfloat16_reference(idx, wg, tmp_path):
    """Both GEMM cores: mma.sync (nhwc_tc) and warpgroup MMA (nhwc_wg, its operands read through
    the descriptors' swizzled addressing as the emulation models the hardware's: K-major for the
    forward and grad-input, MN-major atoms of 64 channels for the grad-weight)."""
    kernels = _kernels(idx, wg)
    lib = cuda_emulator.build([k for _, k, _ in kernels], tmp_path, f"nhwc{idx}{'wg' if wg else ''}")
    rng = np.random.default_rng(idx)
    for i, (kind, k, plan) in enumerate(kernels):
        g = dict(EMULATED[idx])
        g["stride"], g["padding"] = cuda_refs._pair(g["stride"]), cuda_refs._pair(g["padding"])
        vals, ref, out_bf16 = _case(kind, g, rng)
        got = _run(lib, i, k, vals, ref, out_bf16)
        assert np.all(np.isfinite(got)), (k.name, plan, int(np.isnan(got).sum()))  # every output written
        # float32 sums of exact products against float64 ones: equal but where a sum lands near a
        # bfloat16 tie (the last bit)
        assert np.max(np.abs(got - ref)) <= 2.0 ** -7 * np.max(np.abs(ref)), (k.name, plan)
        assert np.mean(got == ref) >= 0.97, (k.name, plan, np.mean(got == ref))


@pytest.mark.parametrize("padding", [1, 0])
def test_the_tiled_relayouts_write_the_bordered_nhwc_image_and_dy_by_pixel(padding, tmp_path):
    """nhwc_wg's relayouts (`to_nhwc_tiles`) alone, where the GEMMs' emulated tests have one tile:
    72 channels (a second channel tile of 8) of 9 x 9 pixels (a second pixel tile of 17), bordered
    or not; the scratch holds x as the zero-bordered NHWC image and dy as [pixel][o], every
    element written (the scratch starts NaN)."""
    from dataclasses import replace
    geo = dict(N=2, C=72, H=9, W=9, O=72, KH=3, KW=3, stride=1, padding=padding)
    g = _geometry("gw", **geo)
    plan = cn.wg_plans(g)[0]
    k = cn.render("rl", g, plan, bf16_roles=frozenset({"x", "dy"}))
    relays = tuple(ln for ln in k.launches if ln.function.endswith(("_src", "_dy")))
    ho = 9 + 2 * padding - 2
    # dy (ho x ho pixels, no border block), then x (81 pixels: two tiles, and a border block where padded)
    assert [ln.grid for ln in relays] == [(2 * -(-ho * ho // 64), 2, 1), (2 * (2 + padding), 2, 1)]
    k = replace(k, launches=relays)
    lib = cuda_emulator.build([k], tmp_path, f"relayout{padding}")
    rng = np.random.default_rng(5)
    x, dy = (round_bf16(rng.uniform(-1, 1, shape).astype(np.float32)) for shape in ((2, 72, 9, 9), (2, 72, ho, ho)))
    scratch = np.full(k.scratch_bytes // 4, np.nan, np.float32)
    cuda_emulator.run(lib, 0, k, dict(x=bf16_bits(x), dy=bf16_bits(dy), out=np.zeros((72, 72, 3, 3), np.float32),
                                      scratch=scratch))
    words = scratch.view(np.uint16)
    regions = cn._regions(g, plan)
    want_x = np.pad(x.transpose(0, 2, 3, 1), ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    got_x = bf16_values(words[regions["src"] // 2:][:want_x.size].reshape(want_x.shape))
    np.testing.assert_array_equal(got_x, want_x)
    want_dy = dy.transpose(0, 2, 3, 1).reshape(-1, 72)
    got_dy = bf16_values(words[regions["dyt"] // 2:][:want_dy.size].reshape(want_dy.shape))
    np.testing.assert_array_equal(got_dy, want_dy)


@pytest.mark.parametrize("idx", [0, 1, 3])
def test_a_grad_weight_reading_other_kernels_images_gives_the_reference(idx, tmp_path):
    """A grad-weight with `XI` / `DYI` (`share_relayouts`) launches no relayout of x / dy and reads
    the image the forward / the grad-input left at the start of its scratch (dy's bordered by K - 1 -
    padding): each owner plan's image (mma.sync's row relayout, warpgroup MMA's tiled one) under
    each grad-weight core, against the bfloat16 reference; its scratch loses those regions. The
    stride-2 layer's grad-input is not this family's: x's image alone."""
    from dataclasses import replace
    geo = dict(EMULATED[idx])
    fwd, gi, gw = (_geometry(k, **geo) for k in ("fwd", "gi", "gw"))
    strided = cn.serves(gi) is not None
    assert cn.shares_image(fwd, gw) is None and (cn.shares_image(gi, gw) is None) != strided
    assert cn.shares_image(fwd, dict(gw, padding=(0, 0))) == "their images differ in PH, PW"
    assert cn.shares_image(fwd, dict(gw, dtype=None)) == "their operands' precisions differ"
    assert cn.shares_image(gw, gw) == "a forward's or a grad-input's image serves a grad-weight"
    owners = [("f_tc", fwd, cn.plans(fwd)[0]), ("f_wg", fwd, cn.wg_plans(fwd)[0])]
    if not strided:
        owners += [("i_tc", gi, cn.plans(gi)[0]), ("i_wg", gi, cn.wg_plans(gi)[0])]
    both = dict(XI=1) if strided else dict(XI=1, DYI=1)
    readers = [("g_tc", replace(cn.plans(gw)[-1], **both)), ("g_wg", replace(cn.wg_plans(gw)[0], **both))]
    if not strided:
        readers += [("g_tc_dy", replace(cn.plans(gw)[0], DYI=1)), ("g_wg_x", replace(cn.wg_plans(gw)[-1], XI=1))]
    kernels = [cn.render(n, g, p, bf16_roles=frozenset({"x", "dy", "w", "out"})) for n, g, p in owners]
    kernels += [cn.render(n, gw, p, epilogue=EPILOGUE, bf16_roles=frozenset({"x", "dy"})) for n, p in readers]
    for (_, p), k in zip(readers, kernels[len(owners):]):
        relays = ["dy"] * (not p.DYI) + ["src"] * (not p.XI)
        assert [ln.function.split("_")[-1] for ln in k.launches] == relays + ["gemm", "reduce"]
        images = ("x_image",) * p.XI + ("dy_image",) * p.DYI
        assert all(ln.args[-1 - len(images):] == ("scratch", *images) for ln in k.launches)
        saved = p.XI * round_up(cn.image_bytes(gw), 256) + p.DYI * round_up(2 * gw["N"] * gw["O"] * gw["HO"] * gw["WO"], 256)
        assert k.scratch_bytes == cn.scratch_bytes(gw, replace(p, XI=0, DYI=0)) - saved
    with pytest.raises(ValueError, match="grad-weight's"):
        cn.render("f", fwd, replace(owners[0][2], XI=1), bf16_roles=frozenset({"x", "w", "out"}))
    lib = cuda_emulator.build(kernels, tmp_path, f"shared{idx}")
    g = dict(geo, stride=cuda_refs._pair(geo["stride"]), padding=cuda_refs._pair(geo["padding"]))
    rng = np.random.default_rng(10 + idx)
    vals, ref, _ = _case("gw", g, rng)
    w = round_bf16(rng.uniform(-1, 1, (geo["O"], geo["C"], geo["KH"], geo["KW"])).astype(np.float32))
    scratch = {}
    for i, (name, og, _) in enumerate(owners):
        scratch[name] = np.full(kernels[i].scratch_bytes // 4, np.nan, np.float32)
        out = np.zeros(vals["dy"].shape if og is fwd else vals["x"].shape, np.uint16)
        cuda_emulator.run(lib, i, kernels[i], dict(x=bf16_bits(vals["x"]), dy=bf16_bits(vals["dy"]), w=bf16_bits(w),
                                                   out=out, scratch=scratch[name]))
    # each reader with each forward's image and (not strided) each grad-input's
    pairs = [(f, i) for f in ("f_tc", "f_wg") for i in ((None,) if strided else ("i_tc", "i_wg"))]
    for r, (rname, plan) in enumerate(readers):
        for f, i in pairs:
            bufs = dict(x=np.full(vals["x"].shape, 0x7FC0, np.uint16) if plan.XI else bf16_bits(vals["x"]),
                        dy=np.full(vals["dy"].shape, 0x7FC0, np.uint16) if plan.DYI else bf16_bits(vals["dy"]),
                        in5=vals["in5"], out=np.full(ref.shape, np.nan, np.float32))
            bufs |= ({"x_image": scratch[f]} if plan.XI else {}) | ({"dy_image": scratch[i]} if plan.DYI else {})
            cuda_emulator.run(lib, len(owners) + r, kernels[len(owners) + r], bufs)
            got = bufs["out"]
            assert np.max(np.abs(got - ref)) <= 2.0 ** -7 * np.max(np.abs(ref)), (rname, f, i)
            assert np.mean(got == ref) >= 0.97, (rname, f, i, np.mean(got == ref))


def _bn_gelu_grad_inputs(precision: str) -> list[tuple]:
    """(subgraph, spec) of each grad-input whose generated epilogue recomputes a BatchNorm's
    normalize and GELU's derivative (airbench's blocks) in a small step: 8 -> 24 -> 16 channels (a
    32-wide block partly past the 24), two images of 6 x 6 in one 128-pixel tile."""
    model = nn.Sequential(nn.Conv2d(8, 24, 3, padding=1, bias=False), nn.BatchNorm2d(24), nn.GELU(),
                          nn.Conv2d(24, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.GELU(),
                          nn.Flatten(), nn.Linear(16 * 36, 10))
    example = (np.zeros((2, 8, 6, 6), np.float32), np.zeros(2, np.int64))
    graph = next(iter(plan_steps(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda",
                                 precision=precision).values()))
    return [(graph.attrs(n)["graph"], graph.attrs(n)["kernel"]) for n in graph.meta["schedule"]
            if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind == "conv2d_grad_input"
            and "pointwise" in graph.attrs(n)["kernel"].epilogues]


@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_staged_stores_compute_a_channels_epilogue_values_once_and_match_the_interpreter(precision, tmp_path):
    """Stores through shared memory where a generated epilogue reads operands at every element
    (nhwc_wg's plans always, nhwc_tc's plans stamped ST=1, the tuner measuring them beside the
    direct stores): a warp a channel, its lanes along the pixels, the channel's values (the
    variance's square root, the scale and shift) computed before its pixels' loop; against the
    interpreter (bfloat16 operands; float32 ones as 3xTF32)."""
    from dataclasses import replace
    cases = _bn_gelu_grad_inputs(precision)
    assert cases
    rng = np.random.default_rng(17)
    sources = []
    for sub, spec in cases:
        candidates = cuda_choices.candidates(sub, spec)
        direct = [c for c in candidates if c[0] == "nhwc_tc" and ("ST", 1) not in c[1]]
        staged = [c for c in candidates if c[0] == "nhwc_wg" or c[0] == "nhwc_tc" and ("ST", 1) in c[1]]
        assert len(staged) >= len(direct) > 0 and (precision == "bf16") == any(c[0] == "nhwc_wg" for c in staged)
        out_shape = sub.type(sub.outputs["out"]).shape
        inputs = {}
        for k, n in sub.inputs.items():
            shape = sub.type(n).shape
            v = rng.standard_normal(shape).astype(np.float32)
            inputs[k] = v if shape == out_shape or len(shape) == 4 and shape[0] == out_shape[0] else np.abs(v) + 0.5
        for i, choice in enumerate(dict.fromkeys([staged[0], staged[-1], direct[0]])):
            kernel, roles = cuda.render_contraction(sub.name, sub, replace(spec, choice=choice))
            assert ("the output staged in shared memory by channel" in kernel.code) == (choice != direct[0])
            if choice != direct[0]:
                per_channel, per_pixel = kernel.code.split("for (int c = warp;", 1)[1].split("for (int r0 = 0;", 1)
                per_pixel = per_pixel.split("\n  }\n", 1)[0]
                assert "em_sqrt" in per_channel and "em_sqrt" not in per_pixel
                assert "erf" in per_pixel  # GELU's derivative, at each element
                # a lane's pixels read their operands before any of them computes or stores: the reads
                # in flight together
                reads = [m.end() for m in re.finditer(r"\bin\d+\[", per_pixel)]
                assert len(reads) == per_pixel.count("erf(") > 1, per_pixel[:400]
                assert max(reads) < per_pixel.index("erf(") and max(reads) < per_pixel.index("p.out[")
            else:  # the direct stores: a pixel's epilogue values (their reads) all before its stores
                stores = kernel.code.split("v = pw_epilogue(p, oi, v);", 1)[1]
                assert "p.out[" not in stores.split("vals[j][e] = v;", 1)[0] and "= vals[j][e];" in stores
            cuda_emulator.check_against_interpreter(sub, kernel, inputs, tmp_path, f"bngelu{precision}{i}",
                                                    rtol=1e-2 if precision == "bf16" else 1e-4, atol=1e-2 if precision == "bf16" else 1e-4,
                                                    roles=roles)
            sources.append(kernel.code.replace(sub.name, f"{sub.name}_{i}"))
    if find_nvcc() is not None:  # (the emulation above runs without it)
        src = tmp_path / "staged.cu"
        src.write_text(cuda.prelude(bf16=True) + "".join(sources))
        assert_compiles(find_nvcc(), src)


#: float32 operands (forward and grad-weight at stride 1 and 2, the stride-1 grad-input): channel
#: counts multiples of 4 (a 16-byte run), 12 of them three runs of a 16-float k-tile
F32 = [dict(N=2, C=12, H=6, W=7, O=20, KH=3, KW=3, stride=1, padding=1),
       dict(N=1, C=4, H=9, W=9, O=8, KH=3, KW=3, stride=2, padding=1)]


@pytest.mark.parametrize("prec", ["tf32", "x3"])
@pytest.mark.parametrize("idx", range(len(F32)))
def test_float32_operands_emulated_match_float64_as_tf32_and_as_3xtf32(idx, prec, tmp_path):
    """Precision "tf32": the operands rounded to TF32 (cvt.rna) before the mma, against float64 sums
    of the rounded values; float32 (3xTF32: big and small parts, three products): against float64
    sums of the values themselves, within float32's rounding of a few hundred terms."""
    geo = dict(F32[idx])
    kernels = []
    for kind in ("fwd", "gi", "gw"):
        g = dict(_geometry(kind, **geo), dtype=None, tf32=prec == "tf32")
        if cn.serves(g) is not None:
            assert kind == "gi" and g["stride"] != (1, 1), cn.serves(g)
            continue
        assert cn.precision(g) == prec and "m16n8k8" in cn.render("k", g, cn.plans(g)[0]).code
        for i, plan in enumerate(dict.fromkeys([cn.plans(g)[0], cn.plans(g)[-1]])):
            k = cn.render(f"f{idx}{prec}{kind}{i}", g, plan, bias=kind == "fwd", relu=kind == "fwd",
                          relu_mask=kind == "gi")
            assert k.launches[-1 if kind != "gw" else -2].shared_bytes == plan.shared_bytes(g)
            kernels.append((kind, k, plan))
    lib = cuda_emulator.build([k for _, k, _ in kernels], tmp_path, f"f32_{idx}_{prec}")
    rng = np.random.default_rng(40 + idx)
    geo["stride"], geo["padding"] = cuda_refs._pair(geo["stride"]), cuda_refs._pair(geo["padding"])
    rounded = cuda_emulator.tf32 if prec == "tf32" else (lambda a: a)
    for i, (kind, k, plan) in enumerate(kernels):
        N, C, H, W, O, KH, KW = (geo[key] for key in ("N", "C", "H", "W", "O", "KH", "KW"))
        HO, WO = cuda_refs.conv_out(geo)
        u = lambda *shape: rng.uniform(-1, 1, shape).astype(np.float32)  # noqa: E731
        w = u(O, C, KH, KW)
        if kind == "fwd":
            x, bias = u(N, C, H, W), u(O)
            bufs = dict(x=x, w=w, bias=bias, out=np.full((N, O, HO, WO), np.nan, np.float32))
            ref = cuda_refs.conv_fwd_ref(rounded(x), rounded(w), bias, geo, relu=True)
        elif kind == "gi":
            dy, mask = u(N, O, HO, WO), u(N, C, H, W)
            bufs = dict(dy=dy, w=w, mask_src=mask, out=np.full((N, C, H, W), np.nan, np.float32))
            ref = cuda_refs.conv_grad_input_ref(rounded(dy), rounded(w), geo, mask)
        else:
            x, dy = u(N, C, H, W), u(N, O, HO, WO)
            bufs = dict(x=x, dy=dy, out=np.full((O, C, KH, KW), np.nan, np.float32))
            ref = cuda_refs.conv_grad_weight_ref(rounded(x), rounded(dy), geo)[0]
        cuda_emulator.run(lib, i, k, bufs)
        got = bufs["out"]
        assert np.all(np.isfinite(got)), (k.name, plan, int(np.isnan(got).sum()))
        err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert err <= 1e-5, (k.name, plan, err)


#: airbench's layers at batch 1024 and the MNIST CNN's bfloat16 conv2 at 64 (every plan compiles)
COMPILED = [dict(N=1024, C=64, H=28, W=28, O=64, KH=3, KW=3, stride=1, padding=1),
            dict(N=1024, C=64, H=14, W=14, O=256, KH=3, KW=3, stride=1, padding=1),
            dict(N=1024, C=256, H=7, W=7, O=256, KH=3, KW=3, stride=1, padding=1),
            dict(N=64, C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0),
            dict(N=64, C=32, H=15, W=15, O=64, KH=3, KW=3, stride=2, padding=1)]


def test_every_plan_compiles_with_nvcc(tmp_path):
    nvcc = nvcc_or_skip()
    sources = []
    for i, geo in enumerate(COMPILED):
        for kind in KINDS:
            g = _geometry(kind, **geo)
            if cn.serves(g) is not None:
                continue
            roles = {"fwd": {"x", "w", "out"}, "gi": {"dy", "w", "out"}, "gw": {"x", "dy"}}[kind]
            for j, plan in enumerate(cn.plans(g)):
                k = cn.render(f"c{i}{kind}{j}", g, plan, bf16_roles=frozenset(roles))
                assert k.scratch_bytes == cn.scratch_bytes(g, plan)
                assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in k.code and "ldmatrix" in k.code
                sources.append(k.code)
            # warpgroup MMA (nhwc_wg): every plan (the grad-weight's operands MN-major)
            for j, plan in enumerate(cn.wg_plans(g) if cn.wg_serves(g) is None else ()):
                k = cn.render(f"c{i}{kind}wg{j}", g, plan, bf16_roles=frozenset(roles))
                (gemm,) = [ln for ln in k.launches if ln.function.endswith("_gemm")]
                assert "wgmma.mma_async.sync.aligned.m64n" in k.code and gemm.block[0] == 2 * plan.BM
                assert gemm.shared_bytes == plan.shared_bytes(g) > 1024
                assert ("p, 1, 1, 1, 1;" in k.code) == (kind == "gw")  # transposed: MN-major operands
                sources.append(k.code)
            # float32 operands, as 3xTF32 and as TF32: the first plan of each
            for prec, tf32 in (("x3", False), ("tf32", True)):
                k = cn.render(f"c{i}{kind}{prec}", dict(g, dtype=None, tf32=tf32), cn.plans(g)[0])
                assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in k.code
                assert ("split_tf32(" in k.code) == (prec == "x3")
                sources.append(k.code)
    src = tmp_path / "nhwc.cu"
    src.write_text(cuda.prelude(bf16=True) + "".join(sources))
    assert_compiles(nvcc, src)


def test_the_table_offers_it_for_convolutions_of_whole_channel_runs_and_never_picks_it_unmeasured():
    wide = _geometry("fwd", **COMPILED[1])
    fam = cuda_choices.FAMILIES["nhwc_tc"]
    assert cuda_choices.TABLE.applies(fam, wide) is None and not fam.preferred(wide)
    # float32 operands: as 3xTF32, or TF32 under precision "tf32"; 4 channels a 16-byte run
    f32 = dict(wide, dtype=None)
    assert cuda_choices.TABLE.applies(fam, dict(f32, C=12)) is None and cn.precision(f32) == "x3"
    assert cn.precision(dict(f32, tf32=True)) == "tf32"
    assert "not a multiple of 8" in cuda_choices.TABLE.applies(fam, dict(wide, C=12))
    assert "not a multiple of 4" in cuda_choices.TABLE.applies(fam, dict(f32, C=6))
    assert "not a multiple of 4" in cuda_choices.TABLE.applies(fam, _geometry("gw", **COMPILED[1]) | dict(dtype=None, O=66))
    assert "ungrouped" in cuda_choices.TABLE.applies(fam, dict(wide, groups=2))
    strided_gi = _geometry("gi", **COMPILED[4])
    assert "stride 1" in cn.serves(strided_gi)
    # a record of another batch size (its split count made for that length) still fits
    gw = _geometry("gw", **COMPILED[1])
    plan = cn.stamped(cn.plans(gw)[0])
    assert fam.fits(gw, plan) and fam.fits(dict(gw, N=64, HO=14, WO=14), plan)
    assert fam.fits(gw, cn.stamped(cn.NhwcPlan(128, 128, 2, 4, 4, SPLITS=3)))
    assert not fam.fits(gw, cn.stamped(cn.NhwcPlan(96, 128, 2, 4, 4, SPLITS=3)))  # rows of the swizzle: 64s
    assert not fam.fits(wide, cn.stamped(cn.NhwcPlan(128, 128, 2, 4, 3, SPLITS=2)))  # a forward does not split
    # the relayouts, then the GEMM over every output pixel and channel; a grad-weight's last launch
    # sums every weight's partials
    first = cn.plans(wide)[0]
    k = cn.render("k", wide, first, bf16_roles=frozenset({"x", "w", "out"}))
    assert [ln.function for ln in k.launches] == ["k_src", "k_wt", "k_gemm"]
    assert k.launches[0].grid[0] == 1024 * 16  # a block a bordered row
    assert k.launches[-1].grid[:2] == (-(-1024 * 14 * 14 // first.BM), -(-256 // first.BN))
    k = cn.render("k", gw, cn.plans(gw)[0], bf16_roles=frozenset({"x", "dy"}))
    assert [ln.function for ln in k.launches] == ["k_dy", "k_src", "k_gemm", "k_reduce"]
    assert k.launches[-1].grid[0] * 256 >= 256 * 64 * 9 and k.launches[2].grid[2] == cn.plans(gw)[0].SPLITS


def test_the_warpgroup_family_serves_bfloat16_convolutions_on_sm_90a_only():
    from ember.codegen import device
    fam = cuda_choices.FAMILIES["nhwc_wg"]
    wide, gi, gw = (_geometry(kind, **COMPILED[1]) for kind in ("fwd", "gi", "gw"))
    assert all(cuda_choices.TABLE.applies(fam, g) is None for g in (wide, gi, gw))
    assert not fam.preferred(wide)  # taken where measured
    assert "bfloat16" in cuda_choices.TABLE.applies(fam, dict(wide, dtype=None))
    assert "not a multiple of 8" in cuda_choices.TABLE.applies(fam, dict(wide, C=12))
    assert "stride 1" in cn.wg_serves(_geometry("gi", **COMPILED[4]))
    with device.using(device.A100_SXM_80GB):
        assert "sm_90a" in cuda_choices.TABLE.applies(fam, wide)
    with device.using(device.H100_SXM):
        assert cuda_choices.TABLE.applies(fam, wide) is None
    # one warpgroup a 64 rows, every plan within a block's shared memory, a grad-weight's columns
    # whole atoms of 64 channels; the two families' plans are each other's strangers
    for g in (wide, gw):
        for plan in cn.wg_plans(g):
            assert plan.WG and plan.threads == 2 * plan.BM and plan.shared_bytes(g) <= device.H200.shared_per_block_optin
            assert fam.fits(g, cn.stamped(plan)) and not cuda_choices.FAMILIES["nhwc_tc"].fits(g, cn.stamped(plan))
            assert g is wide or plan.BN % 64 == 0 and plan.SPLITS >= 1
        assert not fam.fits(g, cn.stamped(cn.plans(g)[0]))
    assert not fam.fits(gw, cn.stamped(cn.NhwcPlan(128, 96, 8, 1, 4, SPLITS=2, WG=1)))  # 96: not whole atoms
    assert [ln.function for ln in cn.render("k", wide, cn.wg_plans(wide)[0], bf16_roles=frozenset({"x", "w", "out"})).launches] \
        == ["k_src", "k_wt", "k_gemm"]
    assert [ln.function for ln in cn.render("k", gw, cn.wg_plans(gw)[0], bf16_roles=frozenset({"x", "dy"})).launches] \
        == ["k_dy", "k_src", "k_gemm", "k_reduce"]


@pytest.mark.parametrize("precision", ["bf16", "float32"])
def test_a_step_whose_convolutions_all_take_the_family_renders_and_compiles_with_nvcc(precision, tmp_path):
    """Every convolution of a training step (8 -> 16 -> 32 channels, the second strided: its
    grad-input goes to another family) forced onto the family: the step renderer binds its
    launches and scratch, and the whole source compiles."""
    nvcc = nvcc_or_skip()
    from ember.passes import targets
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(32 * 6 * 6, 10))
    example = (np.zeros((4, 8, 12, 12), np.float32), np.zeros(4, np.int64))
    kinds = dict(conv2d="nhwc_tc", conv2d_grad_weight="nhwc_tc")
    with cuda_choices.TABLE.force(**kinds):
        graphs = plan_steps(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda", precision=precision)
    graph = graphs["train"] if "train" in graphs else next(iter(graphs.values()))
    chosen = [graph.attrs(n)["kernel"].choice[0] for n in graph.meta["schedule"]
              if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind in kinds]
    assert chosen == ["nhwc_tc"] * 4, chosen  # two forwards, two grad-weights
    src = tmp_path / "step.cu"
    src.write_text(targets.get("cuda").source(graph))
    assert_compiles(nvcc, src)


@pytest.mark.parametrize("dtype", ["bfloat16", None])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_scratch_regions_hold_what_each_launch_writes_without_overlapping(kind, dtype):
    """The bordered source, the relaid weights (forward, grad-input) or dy and the split partials
    (grad-weight) each get a region of their own, sized in the operands' element (a float32
    grad-weight's dy once overlapped its partials: emulated, only its later blocks went wrong)."""
    g = dict(_geometry(kind, **COMPILED[4]), dtype=dtype)
    if kind == "gi":
        g = dict(_geometry(kind, **COMPILED[3]), dtype=dtype)
    e, q = cn.element_bytes(g), cn.problem(g)
    for plan in cn.plans(g):
        r = cn._regions(g, plan)
        sizes = {"src": e * q["N"] * (q["HI"] + 2 * q["PH"]) * (q["WI"] + 2 * q["PW"]) * q["CI"]}
        kdim = q["KH"] * q["KW"] * q["CI"]
        if kind == "gw":
            sizes |= {"dyt": e * q["N"] * q["HO"] * q["WO"] * q["CO"], "part": 4 * plan.SPLITS * q["CO"] * kdim}
        else:
            sizes["wt"] = e * q["CO"] * kdim
        spans = sorted((r[k], r[k] + n) for k, n in sizes.items())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= r["end"], (kind, dtype, plan)
        assert all(r[k] % 256 == 0 for k in sizes)


#: the GPU test's layers, each behind a stride-1 convolution of its input's channels (so its
#: grad-input is a kernel of the step): a wide one and a strided one (its grad-input is another
#: family's)
GPU_LAYERS = {"wide": dict(N=32, C=64, H=14, W=14, O=256, KH=3, KW=3, stride=1, padding=1),
              "strided": dict(N=8, C=32, H=15, W=15, O=40, KH=3, KW=3, stride=2, padding=1)}


def _gpu_cases(geo: dict, precision: str) -> list[tuple]:
    """(subgraph, spec, the family's candidates: nhwc_tc's and nhwc_wg's) of every convolution
    kernel of the layer's step."""
    ho, wo = cuda_refs.conv_out(geo)
    model = nn.Sequential(nn.Conv2d(geo["C"], geo["C"], 3, padding=1, bias=False), nn.ReLU(),
                          nn.Conv2d(geo["C"], geo["O"], geo["KH"], stride=geo["stride"], padding=geo["padding"],
                                    bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(geo["O"] * ho * wo, 10))
    example = (np.zeros((geo["N"], geo["C"], geo["H"], geo["W"]), np.float32), np.zeros(geo["N"], np.int64))
    graph = next(iter(plan_steps(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda",
                           precision=precision).values()))
    cases = []
    for n in graph.meta["schedule"]:
        if graph.op(n) == "fused" and graph.attrs(n)["kernel"].kind in cuda_choices.CONVS:
            sub, spec = graph.attrs(n)["graph"], graph.attrs(n)["kernel"]
            cases.append((sub, spec, [c for c in cuda_choices.candidates(sub, spec) if c[0] in ("nhwc_tc", "nhwc_wg")]))
    return cases


@pytest.mark.parametrize("precision", ["bf16", "float32"])
@pytest.mark.parametrize("layer", list(GPU_LAYERS))
def test_the_gpu_test_measures_every_kind_the_family_serves(layer, precision):
    """What the GPU test below measures, without a GPU: every plan of each kind the family serves
    in these steps (the strided layer's grad-input aside)."""
    cases = _gpu_cases(GPU_LAYERS[layer], precision)
    served = {spec.kind for _, spec, choices in cases if choices}
    want = set(cuda_choices.CONVS) - ({"conv2d_grad_input"} if layer == "strided" else set())
    assert want <= served, served
    for sub, spec, choices in cases:
        g = cuda_choices.geometry(sub, spec)
        wg = cn.wg_plans(g) if cn.wg_serves(g) is None else []
        assert (precision == "bf16" and spec.kind in cn.WG_KINDS) == bool(wg) or cn.serves(g) is not None
        assert len(choices) == len(cn.plans(g)) + len(wg) if cn.serves(g) is None else not choices


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "float32"])
@pytest.mark.parametrize("layer", list(GPU_LAYERS))
def test_every_plan_matches_the_interpreter_on_the_gpu(layer, precision):
    """Every plan of every kernel of the family in the layer's step (bf16: bfloat16 operands;
    float32: 3xTF32) through the tuner's measurer, against the interpreter in float64 within the
    precision's tolerance."""
    pytest.importorskip("cupy")
    from ember.runtime.tuner_cuda import CudaMeasurer
    measurer = CudaMeasurer()
    measured = 0
    for sub, spec, choices in _gpu_cases(GPU_LAYERS[layer], precision):
        if choices:
            measured += cuda_refs.measured_against_interpreter(measurer, sub, spec, choices, TOLERANCE[precision])
    assert measured > 0
