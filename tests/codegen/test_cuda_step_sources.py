"""The `cuda` target without a GPU: `ember kernels` writes every source of the MNIST models'
training and inference steps, and each compiles with `nvcc -cubin -arch=sm_90` warning-free (the
runtime compiles the same source with NVRTC). In CI nvcc must be there; elsewhere a missing nvcc
skips."""
from __future__ import annotations

import subprocess

import pytest

from ember.frontends.cli import main as ember_main
from nvcc import nvcc_command, nvcc_or_skip


def _compile_all(nvcc: str, sources: list) -> None:
    procs = [(src, subprocess.Popen(nvcc_command(nvcc, src, str(src.with_suffix(".cubin"))),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) for src in sources]
    for src, proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0 and not err.strip() and not out.strip(), f"{src.name}:\n{out}{err}"


# lenet5: max pooling (forward and gradient kernels); resnet8: BatchNorm, residual adds, strided
# and 1x1 convolutions, global average pooling
@pytest.mark.parametrize("model,tf32", [("cnn", False), ("mlp", False), ("lenet5", False), ("resnet8", False),
                                        ("cnn", True), ("mlp", True)])
def test_every_generated_cuda_source_compiles_with_nvcc(model, tf32, tmp_path, capsys):
    nvcc = nvcc_or_skip()
    assert ember_main(["kernels", "--model", model, "--device", "cuda", "--out", str(tmp_path)]
                      + (["--tf32"] if tf32 else [])) == 0
    sources = sorted(tmp_path.glob("*.cu"))
    assert [p.name for p in sources] == [f"{model}-inference-{'64x784' if model == 'mlp' else '64x1x28x28'}.cu",
                                         f"{model}-train-{'64x784' if model == 'mlp' else '64x1x28x28'}.cu"]
    _compile_all(nvcc, sources)
    text = (tmp_path / sources[-1].name).read_text()
    assert "extern \"C\" __global__" in text and "implements" in text
    assert ("mma.sync.aligned.m16n8k8" in text) == tf32  # tensor cores exactly when asked
    if model == "lenet5":
        assert "max_pool2d_fwd(" in text and "max_pool2d_grad_grad(" in text


# zoo models (PyTorch definitions, as `from_torch` imports them): GELU and LayerNorm, whose
# elementwise values the contractions' generated epilogues recompute (passes/fusion_recompute.py)
@pytest.mark.parametrize("model", ["vit", "airbench"])
def test_zoo_training_sources_compile_with_nvcc(model, tmp_path):
    nvcc = nvcc_or_skip()
    pytest.importorskip("torch")
    assert ember_main(["kernels", "--model", model, "--device", "cuda", "--out", str(tmp_path)]) == 0
    (train,) = sorted(tmp_path.glob(f"{model}-train-*.cu"))
    assert "erf" in train.read_text()
    _compile_all(nvcc, [train])


def test_dropout_and_overlapping_ceil_mode_pooling_compile_with_nvcc(tmp_path):
    """What the recipes lack: Dropout's Philox masks, and pooling with overlapping windows,
    padding and ceil_mode, in a training and an inference step."""
    nvcc = nvcc_or_skip()
    import numpy as np

    from ember.frontends import nn, optim, plan
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                          nn.Dropout(0.25), nn.Flatten(), nn.Linear(4 * 15 * 15, 10), nn.Dropout(0.5))
    example = (np.zeros((16, 1, 28, 28), np.float32), np.zeros(16, np.int64))
    graphs = plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda")
    from ember.runtime import target
    sources = []
    for name, graph in graphs.items():
        src = tmp_path / f"{name}.cu"
        src.write_text(target("cuda").source(graph))
        sources.append(src)
    train = next(s for s in sources if s.name.startswith("train")).read_text()
    assert "em_philox_uniform(0u, 1u," in train and "max_pool2d_grad_grad(" in train
    _compile_all(nvcc, sources)


def test_kernels_command_refuses_a_device_without_sources(tmp_path, capsys):
    assert ember_main(["kernels", "--model", "mlp", "--device", "reference", "--out", str(tmp_path)]) == 2
    assert "generates no source code" in capsys.readouterr().err


def test_identical_kernels_are_one_function_and_every_unit_compiles_alone(tmp_path):
    """Kernels whose code differs only in their name (ResNet-8's repeated shapes) are rendered
    once and launched under the first one's name; the runtime compiles each distinct kernel as
    a module of its own (prelude + its code), so each unit must compile alone."""
    import re

    import numpy as np

    from ember.codegen.cuda import render_step
    from ember.frontends import nn, optim, plan
    from ember.frontends.training.recipes import build_model

    model = build_model("resnet8")
    example = (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int64))
    graph = next(g for k, g in plan(model, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example, device="cuda").items()
                 if k.startswith("train"))
    source = render_step(graph)
    defined = {f for _, functions in source.units for f in functions}
    launched = {la.function for la in source.launches if not la.function.startswith("collective:")}
    assert launched == defined  # every launch finds its function, and no unit is dead
    assert len(source.units) < len(source.kernels) - 10, (len(source.units), len(source.kernels))
    for code, functions in source.units:
        for f in functions:  # a unit defines its own functions, nothing else
            assert re.search(rf'extern "C" __global__[^\n]*\b{f}\(', code), f
    assert source.code.count("(the same code as ") == len(source.kernels) - len(source.units)
    nvcc = nvcc_or_skip()
    biggest = sorted(source.units, key=lambda u: -len(u[0]))[:2] + source.units[:2]
    paths = []
    for i, (code, _) in enumerate(biggest):
        paths.append(tmp_path / f"unit{i}.cu")
        paths[-1].write_text(source.prelude + code)
    _compile_all(nvcc, paths)


@pytest.mark.parametrize("model", ["resnet8", "mobilenet", "lenet5"])
def test_the_variants_a_later_batch_size_runs_compile_with_nvcc(model, tmp_path):
    """A model's kernels as a step of another batch size renders them (`reused_variants`: GEMMs,
    grouped convolutions, max pooling, reductions, pointwise kernels and the loss on run-time
    sizes), one source, warning-free."""
    import numpy as np

    from ember.codegen.cuda import prelude, reused_variants
    from ember.frontends import nn, optim, plan
    from ember.frontends.training.recipes import build_model

    nvcc = nvcc_or_skip()
    if model == "mobilenet":
        pytest.importorskip("torch")
        from ember.frontends.training.zoo import ember_zoo_model
        net = ember_zoo_model(model, seed=0)
    else:
        net = build_model(model)
    example = (np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int64))
    graph = next(g for k, g in plan(net, nn.CrossEntropyLoss(), optim.SGD(lr=0.1, momentum=0.9),
                                    example, device="cuda").items() if k.startswith("train"))
    units = reused_variants(graph)
    functions = {f for _, fs in units for f in fs}
    assert any(f.endswith("_loss") for f in functions) and any(f.endswith("_grad") for f in functions)
    assert any(f.endswith("_reduction_part0") for f in functions) and any(f.endswith("_gemm") for f in functions)
    assert (model == "mobilenet") == any(f.endswith("_grouped") for f in functions)
    assert (model == "lenet5") == any("_max_pool2d_" in f for f in functions)
    path = tmp_path / "variants.cu"
    path.write_text(prelude() + "".join(code for code, _ in units))
    _compile_all(nvcc, [path])
