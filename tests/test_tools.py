"""The CUDA kernel tools in tools/ keep up with the renderers they call: without a GPU, each sweep
command and the kernel bench render every kernel they would time (--dry-run), so a renamed plan
helper or argument in codegen fails here rather than on the next device run."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SWEEPS = ("gemm", "gemm-plans", "direct", "direct-occupancy", "direct-staging", "direct-tc", "skinny", "small")


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=300)


def test_the_sweep_commands_are_the_ones_tested():
    r = _run("cuda_sweep.py", "--help")
    assert r.returncode == 0, r.stderr
    listed = re.search(r"\{([a-z,-]+)\}", r.stdout)
    assert listed and tuple(listed.group(1).split(",")) == SWEEPS, r.stdout[:400]


@pytest.mark.parametrize("command", SWEEPS)
def test_every_sweep_variant_renders(command):
    r = _run("cuda_sweep.py", command, "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    # one line a variant: its group, its label, the kernel's name and the plan it was rendered with
    assert len(lines) >= 3 and all(re.match(r"batch=\d+ kernel=\S+ .+ \w+: \S", line) for line in lines), lines[:5]
    labels = [line.split(": ")[0] for line in lines]
    assert len(set(labels)) == len(labels), "two variants of one command have the same label and kernel name"


def test_the_kernel_bench_renders_every_kernel():
    r = _run("cuda_kernel_bench.py", "--dry-run", "--batches", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    kernels = [line.split()[1] for line in r.stdout.splitlines()]
    assert {"conv2_gi+mask", "linear_gw", "softmax_xent", "sgd_cnn"} <= set(kernels) and len(kernels) == 15, kernels


def test_the_speedrun_tool_runs_seeds_on_one_step_and_its_pytorch_twin(tmp_path):
    """tools/speedrun.py end to end on the CPU, cut to 3 steps: a seed run twice on the restarted
    step gives the same evaluations, and the PyTorch twin's summary follows ember's."""
    from conftest import require_mnist
    pytest.importorskip("torch")
    r = _run("speedrun.py", "--device", "cpu", "--seeds", "0,0", "--limit-steps", "3", "--eval-every", "2",
             "--data", str(require_mnist()), "--torch", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    ember = [line for line in lines if line.get("system") == "ember"]
    torch_runs = [line for line in lines if line.get("system") == "pytorch"]
    assert len(ember) == len(torch_runs) == 2 and ember[0]["evals"] == ember[1]["evals"]
    assert [e[0] for e in ember[0]["evals"]] == [2, 3] == [e[0] for e in torch_runs[0]["evals"]]
    summaries = {line["summary"]["system"]: line["summary"] for line in lines if "summary" in line}
    assert set(summaries) == {"ember", "pytorch"} and summaries["ember"]["seeds"] == 2


def test_the_cpu_step_timer_times_each_precision_and_its_kernels():
    """tools/cpu_step_time.py on a small case: a line per precision with both clocks and the ratio
    to the first, then each contraction kernel's CPU time under its precision's total."""
    r = _run("cpu_step_time.py", "--cases", "mlp:8", "--rounds", "1", "--kernels")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    steps = [line for line in lines if line.startswith("mlp:8 ")]
    assert [line.split()[1] for line in steps] == ["float32", "bf16"], lines
    assert all(re.search(r"wall median +[\d.]+ ms .* cpu/2 median +[\d.]+ ms .*ratio to float32: wall [\d.]+, cpu [\d.]+", line)
               for line in steps), steps
    totals = [line for line in lines if "contraction kernels" in line]
    assert [line.split(":")[0].strip() for line in totals] == ["float32", "bf16"], lines
    assert sum(1 for line in lines if re.match(r" +[\d.]+ us +k\d+_matmul +bf16\(", line)) >= 3, lines


def test_the_mma_rounding_lab_compiles_and_checks_its_arguments(tmp_path, monkeypatch):
    """tools/mma_rounding_lab.py (run on a GPU): its kernel compiles for sm_90 warning-free, and
    lengths the mma's k does not divide are refused before CuPy is asked for."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "codegen"))
    monkeypatch.syspath_prepend(str(TOOLS))
    import mma_rounding_lab
    import nvcc as nvcc_tool
    src = tmp_path / "lab.cu"
    src.write_text(mma_rounding_lab.SOURCE)
    nvcc_tool.assert_compiles(nvcc_tool.nvcc_or_skip(), src)
    r = _run("mma_rounding_lab.py", "--ks", "12")
    assert r.returncode == 2 and "multiples of 8" in r.stderr


def test_the_fused_winograd_bench_imports_its_renderers_and_needs_a_gpu():
    """tools/winograd_fused_bench.py (run on a GPU): --help, and without CuPy or a GPU one line
    saying so, not a traceback."""
    assert _run("winograd_fused_bench.py", "--help").returncode == 0
    r = _run("winograd_fused_bench.py", "--batch", "2", "--layers", "4x4x6")
    if r.returncode != 0:  # no GPU here (CI): the one-line exit of cuda_lab.require_cupy
        assert "needs CuPy and an NVIDIA GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tuning_moves_names_the_steps_a_record_changes(tmp_path):
    """tools/tuning_moves.py: a user record that picks another family for the CNN's first
    convolution on an H200 moves exactly that kernel of the CNN's batch-64 step; the shipped
    record copied unchanged moves nothing."""
    shipped = json.loads((TOOLS.parent / "codegen" / "tuning" / "cuda-nvidia-h200.json").read_text())
    key = json.dumps(dict(C=1, H=28, HO=26, KH=3, KW=3, N=64, O=16, W=28, WO=26, epilogues=["bias", "relu"],
                          kind="conv2d", padding=[0, 0], stride=[1, 1], tf32=False), separators=(",", ":"))
    record = shipped["records"][key]
    assert record["family"] == "gemm", "the fixture assumes the shipped record picks gemm"
    label, _ = min(((c, us) for c, us in record["timings_us"].items() if c.startswith("direct(")), key=lambda x: x[1])
    plan = [[k, int(v)] for k, v in (kv.split("=") for kv in label[len("direct("):-1].split(","))]
    args = ("--gpu", "h200", "--models", "cnn", "--batch-sizes", "64", "--show")
    for name, changed in (("same", dict(record)), ("moved", dict(record, family="direct", plan=plan))):
        db = tmp_path / name
        db.mkdir()
        (db / "cuda-nvidia-h200.json").write_text(json.dumps(dict(shipped, records={key: changed})))
        r = _run("tuning_moves.py", str(db), *args)
        assert r.returncode == 0, r.stderr[-3000:]
        counts = re.findall(r"h200 cnn:64\s+(\d+) of\s+(\d+) kernels change", r.stdout)
        assert len(counts) == 1 and int(counts[0][1]) > 1, r.stdout
        if name == "same":
            assert counts[0][0] == "0", r.stdout
        else:
            assert counts[0][0] == "1" and "choice=gemm(" in r.stdout and "-> conv2d" in r.stdout \
                and f"choice={label}" in r.stdout, r.stdout
        assert ("to time on h200: python tools/step_time.py --cases cnn:64" in r.stdout) == (name == "moved"), r.stdout
    # a GPU named in full (spaces in it) names the steps to time alike
    r = _run("tuning_moves.py", str(tmp_path / "moved"), "--gpu", "NVIDIA H200", "--models", "cnn", "--batch-sizes", "64")
    assert r.returncode == 0 and "to time on NVIDIA H200: python tools/step_time.py --cases cnn:64" in r.stdout, \
        r.stdout + r.stderr[-3000:]
    # --precision plans the bf16 step (its own kernels: the casts, bfloat16 contractions), which
    # the float32 record of the same convolution leaves as it was
    r = _run("tuning_moves.py", str(tmp_path / "moved"), *args, "--precision", "bf16")
    assert r.returncode == 0, r.stderr[-3000:]
    bf16 = re.findall(r"h200 cnn:64\s+(\d+) of\s+(\d+) kernels change", r.stdout)
    assert len(bf16) == 1 and bf16[0][0] == "0" and bf16[0][1] != counts[0][1], r.stdout


@pytest.mark.parametrize("lab, defines", [
    ("cpu_layout_lab.cpp", ["-DCC=32", "-DHH=14", "-DOO=64", "-DRB=7", "-DOV=2"]),
    ("cpu_layout_lab.cpp", ["-DCC=16", "-DHH=28", "-DOO=32", "-DRB=14", "-DOV=1", "-DTWO"]),
    ("cpu_layout_lab.cpp", ["-DCC=8", "-DHH=9", "-DOO=16", "-DSS=1", "-DRB=4", "-DOV=1"]),
    ("cpu_layout_lab_grad_weight.cpp", ["-DCC=32", "-DHH=14", "-DOO=64", "-DCB=6", "-DOV=4", "-DIB=4"]),
    ("cpu_layout_lab_grad_weight.cpp", ["-DCC=9", "-DHH=11", "-DOO=16", "-DSS=3", "-DCB=4", "-DOV=1", "-DIB=3"]),
], ids=["7x7-out", "two-rows", "stride-1-ragged", "grad-weight", "grad-weight-ragged"])
def test_the_cpu_layout_labs_match_float64(tmp_path, lab, defines):
    """tools/cpu_layout_lab*.cpp (the channels-innermost convolutions measured in session 36):
    tiles, two-row tiles, ragged row ends and channel blocks, image blocks that do not divide the
    batch, against their float64 loops, built for any x86 CPU."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    exe = tmp_path / "lab"
    subprocess.run(["g++", "-O1", "-fopenmp", "-Wno-psabi", "-DNN=5" if "grad" in lab else "-DNN=1", *defines,
                    str(TOOLS / lab),
                    "-o", str(exe)], check=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0 and "max error" in r.stdout, r.stdout + r.stderr


def test_the_channels_innermost_conv_lab_renders_every_plan_of_the_family_and_needs_a_gpu(monkeypatch):
    """tools/cuda_conv_nhwc_lab.py times the nhwc_tc family's own kernels (run on a GPU): every
    layer of its tables, each kind and precision, is served and every plan renders; --help, and
    without CuPy or a GPU one line saying so."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import cuda_conv_nhwc_lab as lab
    from ember.codegen import cuda_conv_nhwc as cn
    rendered = 0
    for layer in (lay for layers in lab.LAYERS.values() for lay in layers):
        for kind in lab.KINDS:
            for precision in ("bf16", "float32", "tf32"):
                g = lab.geometry(kind, 64, layer, precision)
                assert cn.serves(g) is None, (layer, kind, precision, cn.serves(g))
                assert cn.precision(g) == {"bf16": "bf16", "float32": "x3", "tf32": "tf32"}[precision]
                operands = {"forward": {"x", "w"}, "grad_input": {"dy", "w"}, "grad_weight": {"x", "dy"}}[kind]
                for plan in cn.plans(g):
                    cn.render("lab", g, plan, bf16_roles=frozenset(operands) if precision == "bf16" else frozenset())
                    rendered += 1
    assert rendered > 100
    assert _run("cuda_conv_nhwc_lab.py", "--help").returncode == 0
    r = _run("cuda_conv_nhwc_lab.py", "--batch", "2", "--cases", "cnn")
    if r.returncode != 0:  # no GPU here (CI): the one-line exit of cuda_lab.require_cupy
        assert "needs CuPy and an NVIDIA GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_compile_time_tool_refuses_an_unknown_model_in_one_line():
    r = _run("compile_time.py", "--device", "cpu", "--models", "airbench")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown model 'airbench' (a zoo model: zoo:airbench)" in r.stderr


def test_tree_ab_runs_a_tool_under_an_exported_revision_and_a_patched_arm(tmp_path):
    """tools/tree_ab.py: HEAD exported from git imports from its own folder (not the editable
    install), a patched arm runs with its replacement in place, and the rows of each arm land in
    one table; a patch of a name the module lacks stops the run with a message."""
    sys.path.insert(0, str(TOOLS))
    try:
        import tree_ab
    finally:
        sys.path.remove(str(TOOLS))
    if not tree_ab.in_git_checkout():
        pytest.skip("not a git checkout (or no git): nothing to export")
    base = tmp_path / "base"
    r = _run("tree_ab.py", "export", "HEAD", str(base))
    assert r.returncode == 0, r.stderr[-3000:]
    assert (base / "ember" / "codegen" / "templates" / "cpp" / "prelude.j2").is_file()
    assert (base / "ember" / "frontends" / "cli" / "__init__.py").is_file()
    out = tmp_path / "ab.json"
    r = _run("tree_ab.py", "run", "--arm", f"base={base}", "--arm", "slow=head", "--patch",
             "slow:ember.codegen.cpp_units:CHEAP_GROUPS=1", "--rounds", "1", "--out", str(out), "--",
             str(TOOLS / "step_time.py"), "--device", "cpu", "--cases", "mlp:64", "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ember from {base / 'ember'}" in r.stderr and "1 patch(es)" in r.stderr, r.stderr
    found = json.loads(out.read_text())
    assert set(found["mlp:64 step_ms"]) == {"head", "base", "slow"}, found
    r = _run("tree_ab.py", "run", "--arm", "x=head", "--patch", "x:ember.codegen.cuda:no_such_name=0", "--rounds", "1",
             "--", str(TOOLS / "step_time.py"), "--device", "cpu", "--cases", "mlp:64", "--steps", "1")
    assert r.returncode != 0 and "has no no_such_name to replace" in r.stderr, r.stderr[-2000:]
