"""Kernel dumps: graphs after every pass, fusion groups, sources with headers, a rebuildable library."""
from __future__ import annotations

import ctypes
import json
import subprocess

import numpy as np

from ember.codegen import cpp
from ember.frontends import compile, nn, optim

from models import mlp


def _compile(dump_dir=None):
    m = mlp()
    x = np.zeros((8, 784), np.float32)
    y = np.zeros(8, np.int64)
    return compile(m, nn.CrossEntropyLoss(), optim.SGD(lr=0.1), example_inputs=(x, y), device="cpu", dump_dir=dump_dir)


def test_dump_dir_holds_graphs_sources_and_a_rebuild_script(tmp_path):
    _compile(tmp_path)
    d = tmp_path / "train-8x784"
    names = sorted(p.name for p in d.iterdir())
    for stem in ("00-input", "01-autodiff", "02-optimizer", "03-simplify", "04-fusion", "05-select", "06-schedule",
                 "07-memory"):
        assert f"{stem}.txt" in names and f"{stem}.dot" in names, names
    fusion = (d / "04-fusion.txt").read_text()
    assert "kernel=matmul[trans_b]+bias" in fusion and "implements=" in fusion  # the groups and their plans
    memory = (d / "07-memory.txt").read_text()
    assert "storage='arena'" in memory and "offset=" in memory
    source = (d / "step.cpp").read_text()  # the entry: every call, with the nodes it implements
    assert source.startswith("// ember cache key: ")
    assert "//     implements %" in source and "extern \"C\"" in source
    kernels = sorted(d.glob("step.e[kg]_*.cpp"))  # the kernels' units, each headed by the calls it serves
    assert kernels and all("//   implements %" in k.read_text() for k in kernels)
    assert len(list(d.glob("ember_prelude_*.h"))) == 1
    stats = json.loads((d / "compile_stats.json").read_text())
    assert stats["objects"] == len(kernels) + 1 and {"passes_s", "render_s", "compiler_s"} <= set(stats)
    # a user can rebuild the library by hand from the dump: all the commands are in one script
    script = (d / "step.compile.sh").read_text()
    assert script.count(" -c ") == len(kernels) + 1 and (d / "step.cache_key").read_text().strip() in script
    subprocess.run(["bash", str(d / "step.compile.sh")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(d / "step.so"))
    assert lib.ember_abi_version() == cpp.ABI_VERSION


def test_environment_variable_selects_the_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_DUMP_DIR", str(tmp_path))
    _compile()
    assert (tmp_path / "train-8x784" / "step.cpp").exists()
