"""Kernel dumps: graphs after every pass, fusion groups, sources with headers, a rebuildable library."""
from __future__ import annotations

import ctypes
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
    source = (d / "step.cpp").read_text()
    key = (d / "step.cache_key").read_text().strip()
    assert source.startswith(f"// ember cache key: {key}")
    assert "//   implements %" in source and "extern \"C\"" in source
    # a user can rebuild the library by hand from the dump
    subprocess.run(["bash", str(d / "step.compile.sh")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(d / "step.so"))
    assert lib.ember_abi_version() == cpp.ABI_VERSION


def test_environment_variable_selects_the_dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_DUMP_DIR", str(tmp_path))
    _compile()
    assert (tmp_path / "train-8x784" / "step.cpp").exists()
