"""Shared geometry lists for the CUDA kernel tests (no GPU needed to import)."""
from __future__ import annotations

from ember.codegen import cuda_direct as cd
from ember.codegen import cuda_direct_tc as ct
from ember.codegen import cuda_kernels as ck
from ember.codegen import cuda_skinny as cs
from ember.codegen import cuda_small_conv as sc

# (N, C, H, W, O, KH, KW, stride, padding)
MNIST_CONVS = {
    "conv1": dict(C=1, H=28, W=28, O=16, KH=3, KW=3, stride=1, padding=0),
    "conv2": dict(C=16, H=26, W=26, O=32, KH=3, KW=3, stride=1, padding=0),
}
ODD_CONVS = [
    dict(N=3, C=3, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1),
    dict(N=2, C=1, H=13, W=17, O=7, KH=3, KW=5, stride=2, padding=1),
    dict(N=5, C=6, H=10, W=10, O=33, KH=1, KW=1, stride=1, padding=0),
    dict(N=1, C=4, H=9, W=8, O=3, KH=4, KW=2, stride=(2, 3), padding=(2, 1)),
    dict(N=2, C=19, H=12, W=12, O=18, KH=5, KW=5, stride=1, padding=2),
    dict(N=4, C=2, H=7, W=7, O=9, KH=7, KW=7, stride=1, padding=0),
    dict(N=2, C=40, H=5, W=5, O=70, KH=3, KW=3, stride=1, padding=1),
]
# matmul (M, N, K, trans_a, trans_b, batch)
def mnist_matmuls(B: int):
    return {
        "linear_fwd": dict(M=B, N=10, K=18432, trans_a=False, trans_b=True, bias=True),
        "linear_gi": dict(M=B, N=18432, K=10, trans_a=False, trans_b=False),
        "linear_gw": dict(M=10, N=18432, K=B, trans_a=True, trans_b=False),
        "mlp1_fwd": dict(M=B, N=30, K=784, trans_a=False, trans_b=True, bias=True, relu=True),
        "mlp2_fwd": dict(M=B, N=10, K=30, trans_a=False, trans_b=True, bias=True),
        "mlp2_gi": dict(M=B, N=30, K=10, trans_a=False, trans_b=False),
        "mlp1_gw": dict(M=30, N=784, K=B, trans_a=True, trans_b=False),
        "mlp2_gw": dict(M=10, N=30, K=B, trans_a=True, trans_b=False),
    }


ODD_MATMULS = [
    dict(M=1, N=1, K=1, trans_a=False, trans_b=False),
    dict(M=7, N=13, K=5, trans_a=True, trans_b=False, bias=True, relu=True),
    dict(M=33, N=65, K=129, trans_a=False, trans_b=True, bias=True),
    dict(M=100, N=3, K=3000, trans_a=True, trans_b=True),
    dict(M=5, N=300, K=7000, trans_a=False, trans_b=False, relu=True),
    dict(M=17, N=19, K=23, trans_a=True, trans_b=True, batch=3, bias=True),
    dict(M=130, N=70, K=40, trans_a=False, trans_b=False, batch=2),
]


def tf32_kernels():
    """The contractions again on TF32 tensor cores (precision="tf32"): MNIST shapes at batch 64 and
    the odd geometries (tails in every dimension, k not a multiple of 8, split-K, batched)."""
    out = []
    t = dict(tf32=True)
    for cname, g in MNIST_CONVS.items():
        spec = dict(N=64, **g)
        out.append((ck.render_conv2d_forward(f"{cname}_fwd_tf32", bias=True, relu=True, tf32=True, **spec),
                    ("conv_fwd", spec, dict(bias=True, relu=True) | t)))
        out.append((ck.render_conv2d_grad_weight(f"{cname}_gw_tf32", bias=True, tf32=True, **spec),
                    ("conv_gw", spec, dict(bias=True) | t)))
        out.append((ck.render_conv2d_grad_input(f"{cname}_gi_tf32", relu_mask=True, tf32=True, **spec),
                    ("conv_gi", spec, dict(relu_mask=True) | t)))
    for i, g in enumerate(ODD_CONVS):
        out.append((ck.render_conv2d_forward(f"odd{i}_fwd_tf32", bias=True, relu=False, tf32=True, **g),
                    ("conv_fwd", g, dict(bias=True, relu=False) | t)))
        out.append((ck.render_conv2d_grad_weight(f"odd{i}_gw_tf32", bias=True, tf32=True, **g),
                    ("conv_gw", g, dict(bias=True) | t)))
        out.append((ck.render_conv2d_grad_input(f"odd{i}_gi_tf32", relu_mask=False, tf32=True, **g),
                    ("conv_gi", g, dict(relu_mask=False) | t)))
    for mname, m in mnist_matmuls(64).items():
        out.append((ck.render_matmul(f"{mname}_tf32", tf32=True, **m), ("matmul", m, t)))
    for i, m in enumerate(ODD_MATMULS):
        out.append((ck.render_matmul(f"oddmm{i}_tf32", tf32=True, **m), ("matmul", m, t)))
    return out


def _contractions_again(tag: str, flags: dict, ref_flags: dict, matmuls: dict) -> list:
    """The GEMM contractions rendered with `flags` (kernel names suffixed `_tag`), each with the
    flags its reference and tolerance read (`ref_flags`): the MNIST convolutions at batch 64 and
    the odd geometries (tails in every dimension, k not a multiple of 8, split-K, batched), then
    `matmuls` and the odd matmuls."""
    out = []
    convs = [(cname, dict(N=64, **g)) for cname, g in MNIST_CONVS.items()]
    convs += [(f"odd{i}", g) for i, g in enumerate(ODD_CONVS)]
    for cname, spec in convs:
        odd = cname.startswith("odd")
        out.append((ck.render_conv2d_forward(f"{cname}_fwd_{tag}", bias=True, relu=not odd, **flags, **spec),
                    ("conv_fwd", spec, dict(bias=True, relu=not odd) | ref_flags)))
        out.append((ck.render_conv2d_grad_weight(f"{cname}_gw_{tag}", bias=True, **flags, **spec),
                    ("conv_gw", spec, dict(bias=True) | ref_flags)))
        out.append((ck.render_conv2d_grad_input(f"{cname}_gi_{tag}", relu_mask=not odd, **flags, **spec),
                    ("conv_gi", spec, dict(relu_mask=not odd) | ref_flags)))
    named = list(matmuls.items()) + [(f"oddmm{i}", m) for i, m in enumerate(ODD_MATMULS)]
    for mname, m in named:
        out.append((ck.render_matmul(f"{mname}_{tag}", **flags, **m), ("matmul", m, ref_flags)))
    return out


def x3_kernels():
    """The GEMM contractions again as 3xTF32 (family gemm_x3: float32 on TF32 tensor cores), held to
    the float32 kernels' tolerance (no tf32 flag for the reference)."""
    return _contractions_again("x3", dict(x3=True), {}, {})


def tf32_kernels():
    """The contractions again on TF32 tensor cores (precision="tf32"), the MNIST matmuls too."""
    return _contractions_again("tf32", dict(tf32=True), dict(tf32=True), mnist_matmuls(64))


def direct_kernels(batches=(64, 1024)):
    """The direct (stride-1) convolutions of `cuda_direct`: conv2 of the MNIST CNN and every odd
    stride-1 geometry (padding, 1x1, 5x5, 7x7, column tails) that has a direct plan."""
    out = []
    geos = [(f"conv2_{B}", dict(N=B, **MNIST_CONVS["conv2"])) for B in batches]
    geos += [(f"odd{i}", g) for i, g in enumerate(ODD_CONVS) if g["stride"] == 1]
    for tag, g in geos:
        for bias in (False, True):
            k = cd.render_direct(f"{tag}_dfwd{int(bias)}", grad_input=False, bias=bias, relu=bias, **g)
            if k is not None:
                out.append((k, ("conv_fwd", g, dict(bias=bias, relu=bias))))
            k = cd.render_direct(f"{tag}_dgi{int(bias)}", grad_input=True, relu_mask=bias, **g)
            if k is not None:
                out.append((k, ("conv_gi", g, dict(relu_mask=bias))))
        k = cd.render_direct_grad_weight(f"{tag}_dgw", **g)
        if k is not None:
            out.append((k, ("conv_gw", g, dict(bias=False))))
    # short-contraction matmuls (K <= 16): the CNN's linear grad-input and odd shapes
    thin = [(f"linear_gi_thin_{B}", dict(M=B, N=18432, K=10, trans_a=False, trans_b=False)) for B in batches]
    thin += [("thin_odd0", dict(M=7, N=12, K=5, trans_a=True, trans_b=False)),
             ("thin_odd1", dict(M=33, N=36, K=16, trans_a=False, trans_b=False, bias=True, relu=True)),
             ("thin_odd2", dict(M=1000, N=4, K=1, trans_a=False, trans_b=False, bias=True)),
             ("thin_odd3", dict(M=5, N=1028, K=3, trans_a=True, trans_b=False, relu=True))]
    for tag, m in thin:
        k = cd.render_matmul_thin(tag, **m)
        assert k is not None, tag
        out.append((k, ("matmul", m, {})))
    return out


def direct_tc_kernels(batches=(64, 1024)):
    """The direct convolutions on TF32 tensor cores (`cuda_direct_tc`, the planner's best plan):
    conv2 of the MNIST CNN and every odd stride-1 geometry, with and without their epilogues."""
    out = []
    t = dict(tf32=True)
    geos = [(f"conv2_{B}", dict(N=B, **MNIST_CONVS["conv2"])) for B in batches]
    geos += [(f"odd{i}", g) for i, g in enumerate(ODD_CONVS) if g["stride"] == 1]
    for tag, g in geos:
        for bias in (False, True):
            k = ct.render_direct_tc(f"{tag}_tcfwd{int(bias)}", grad_input=False, bias=bias, relu=bias, **g)
            if k is not None:
                out.append((k, ("conv_fwd", g, dict(bias=bias, relu=bias) | t)))
            k = ct.render_direct_tc(f"{tag}_tcgi{int(bias)}", grad_input=True, relu_mask=bias, **g)
            if k is not None:
                out.append((k, ("conv_gi", g, dict(relu_mask=bias) | t)))
        k = ct.render_direct_tc_grad_weight(f"{tag}_tcgw", **g)
        if k is not None:
            out.append((k, ("conv_gw", g, dict(bias=False) | t)))
    return out


def skinny_kernels(batches=(64, 1024)):
    """The skinny matmuls of `cuda_skinny`: the CNN's linear forward (narrow) and grad-weight
    (short-M) at each batch, and odd shapes: row, column and k tails, k vectors of 1, 2 and 4
    floats, one split (the epilogue in the first launch) and many, a and b in both layouts."""
    narrow = [(f"linear_fwd_narrow_{B}", dict(M=B, N=10, K=18432, trans_a=False, trans_b=True, bias=True))
              for B in batches]
    narrow += [("narrow_odd0", dict(M=7, N=3, K=4100, trans_a=False, trans_b=True)),
               ("narrow_odd1", dict(M=1000, N=13, K=37, trans_a=False, trans_b=True, bias=True, relu=True)),
               ("narrow_odd2", dict(M=16, N=4, K=1, trans_a=False, trans_b=True, relu=True)),
               ("narrow_odd3", dict(M=45, N=16, K=4098, trans_a=False, trans_b=True, bias=True)),
               ("narrow_odd4", dict(M=3000, N=1, K=512, trans_a=False, trans_b=True))]
    short = [(f"linear_gw_shortm_{B}", dict(M=10, N=18432, K=B, trans_a=True, trans_b=False)) for B in batches]
    short += [("shortm_odd0", dict(M=5, N=1028, K=3000, trans_a=True, trans_b=False)),
              ("shortm_odd1", dict(M=16, N=4, K=1, trans_a=False, trans_b=False, bias=True)),
              ("shortm_odd2", dict(M=3, N=64, K=999, trans_a=False, trans_b=False, bias=True, relu=True)),
              ("shortm_odd3", dict(M=7, N=36, K=20, trans_a=True, trans_b=False, bias=True, relu=True)),
              ("shortm_odd4", dict(M=16, N=8, K=5000, trans_a=True, trans_b=False)),
              ("shortm_odd5", dict(M=1, N=12, K=77, trans_a=False, trans_b=False))]
    out = []
    for render, cases in ((cs.render_matmul_narrow, narrow), (cs.render_matmul_short_m, short)):
        for tag, m in cases:
            k = render(tag, **m)
            assert k is not None, tag
            out.append((k, ("matmul", m, {})))
    # plan variants `tools/cuda_sweep.py skinny` compares, at the CNN's batch-1024 shapes
    fwd = dict(M=1024, N=10, K=18432, trans_a=False, trans_b=True, bias=True)
    for tag, plan in (("narrow_rt2", cs.narrow_plan(1024, 10, 18432, rows_per_lane=2, warps=4)),
                      ("narrow_s8", cs.narrow_plan(1024, 10, 18432, splits=8, unroll=1))):
        out.append((cs.render_matmul_narrow(tag, plan=plan, **fwd), ("matmul", fwd, {})))
    gw = dict(M=10, N=18432, K=1024, trans_a=True, trans_b=False)
    for tag, plan in (("shortm_kg8", cs.short_m_plan(10, 18432, 1024, groups=8, splits=4)),
                      ("shortm_kg2", cs.short_m_plan(10, 18432, 1024, groups=2, splits=4, unroll=4))):
        assert plan is not None, tag
        out.append((cs.render_matmul_short_m(tag, plan=plan, **gw), ("matmul", gw, {})))
    return out


# Small windows / few weights beyond ODD_CONVS: a column count that is odd (scalar vectors) or a
# multiple of 4 (float4), padding wider than the window's reach, a single output channel, a
# window as tall as the input.
SMALL_CONVS = [
    dict(N=3, C=1, H=11, W=9, O=5, KH=3, KW=3, stride=1, padding=1),
    dict(N=2, C=2, H=7, W=13, O=3, KH=5, KW=5, stride=1, padding=0),
    dict(N=2, C=3, H=10, W=12, O=8, KH=3, KW=3, stride=1, padding=1),
    dict(N=2, C=2, H=9, W=16, O=6, KH=2, KW=3, stride=1, padding=(0, 2)),
    dict(N=1, C=1, H=5, W=5, O=4, KH=3, KW=3, stride=1, padding=2),
    dict(N=2, C=1, H=6, W=5, O=1, KH=6, KW=5, stride=1, padding=0),
    dict(N=5, C=3, H=32, W=32, O=16, KH=3, KW=3, stride=1, padding=1),
]


def small_kernels(batches=(64, 1024)):
    """The memory-bound small-window kernels of `cuda_small_conv`: conv1 of the MNIST CNN (forward
    with and without bias + ReLU, grad-weight) and every geometry of ODD_CONVS and SMALL_CONVS that
    they accept (strides, padding, tails, 1, 2 or 4 columns a vector)."""
    out = []
    geos = [(f"conv1_{B}", dict(N=B, **MNIST_CONVS["conv1"])) for B in batches]
    geos += [(f"odd{i}", g) for i, g in enumerate(ODD_CONVS)] + [(f"sodd{i}", g) for i, g in enumerate(SMALL_CONVS)]
    for tag, g in geos:
        for bias in (False, True):
            k = sc.render_small_forward(f"{tag}_sfwd{int(bias)}", bias=bias, relu=bias, **g)
            if k is not None:
                out.append((k, ("conv_fwd", g, dict(bias=bias, relu=bias))))
        k = sc.render_small_grad_weight(f"{tag}_sgw", **g)
        if k is not None:
            out.append((k, ("conv_gw", g, dict(bias=False))))
    return out


def all_kernels(batches=(64, 1024)):
    """(kernel, spec) for every geometry the tests cover: MNIST CNN/MLP shapes and odd ones."""
    out = []
    for B in batches:
        for cname, g in MNIST_CONVS.items():
            spec = dict(N=B, **g)
            out.append((ck.render_conv2d_forward(f"{cname}_fwd_{B}", bias=True, relu=True, **spec),
                        ("conv_fwd", spec, dict(bias=True, relu=True))))
            out.append((ck.render_conv2d_grad_weight(f"{cname}_gw_{B}", bias=True, **spec),
                        ("conv_gw", spec, dict(bias=True))))
            if cname == "conv2":
                out.append((ck.render_conv2d_grad_input(f"{cname}_gi_{B}", relu_mask=True, **spec),
                            ("conv_gi", spec, dict(relu_mask=True))))
        for mname, m in mnist_matmuls(B).items():
            out.append((ck.render_matmul(f"{mname}_{B}", **m), ("matmul", m, {})))
        out.append((ck.render_softmax_cross_entropy(f"sce_{B}", N=B, C=10), ("sce", dict(N=B, C=10), {})))
    for i, g in enumerate(ODD_CONVS):
        for bias in (False, True):
            out.append((ck.render_conv2d_forward(f"odd{i}_fwd{int(bias)}", bias=bias, relu=bias, **g),
                        ("conv_fwd", g, dict(bias=bias, relu=bias))))
            out.append((ck.render_conv2d_grad_weight(f"odd{i}_gw{int(bias)}", bias=bias, **g),
                        ("conv_gw", g, dict(bias=bias))))
            out.append((ck.render_conv2d_grad_input(f"odd{i}_gi{int(bias)}", relu_mask=bias, **g),
                        ("conv_gi", g, dict(relu_mask=bias))))
    for i, m in enumerate(ODD_MATMULS):
        out.append((ck.render_matmul(f"oddmm{i}", **m), ("matmul", m, {})))
    for n, C in ((1, 1), (7, 3), (64, 10), (1024, 10), (2000, 17)):
        out.append((ck.render_softmax_cross_entropy_grad(f"sceg_{n}_{C}", N=n, C=C), ("sce_grad", dict(N=n, C=C), {})))
    for n, C in ((1, 1), (7, 3), (2000, 17)):
        out.append((ck.render_softmax_cross_entropy(f"sce_odd_{n}_{C}", N=n, C=C), ("sce", dict(N=n, C=C), {})))
    out += tf32_kernels()
    out += x3_kernels()
    out += direct_kernels(batches)
    out += direct_tc_kernels(batches)
    out += skinny_kernels(batches)
    out += small_kernels(batches)
    for numel, mom, wd in ((4618, 0.0, 0.0), (18433 * 10 + 3, 0.9, 1e-4), (3, 0.5, 0.0)):
        out.append((ck.render_sgd_update(f"sgd_{numel}_{int(mom * 10)}", numel=numel, lr=0.05,
                                         momentum=mom, weight_decay=wd),
                    ("sgd", dict(numel=numel, lr=0.05, momentum=mom, weight_decay=wd), {})))
    return out
