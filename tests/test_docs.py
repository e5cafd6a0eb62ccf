"""The documentation holds on a real clone: every README code block runs, the README's two
commands are the ones CI runs, and every module is named in ARCHITECTURE.md."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PACKAGES = ("ir", "passes", "codegen", "runtime", "frontends", "ember")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_the_test_command_is_what_ci_runs():
    install_and_train, install_and_test = _blocks("bash")[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert install_and_test.strip() in ci
    assert install_and_train.strip().startswith("python3 -m venv .venv && . .venv/bin/activate && pip install")


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_every_python_block_runs(index, tmp_path, mnist_dir):
    code = _blocks("python")[index]
    env = dict(os.environ, EMBER_CACHE_DIR=os.environ.get("EMBER_CACHE_DIR", str(tmp_path / "cache")))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, f"README block {index} failed:\n{code}\n{res.stdout}\n{res.stderr}"


def test_the_training_command_prints_pytorchs_accuracy(mnist_dir, tmp_path):
    """The README's first command, after its install: one epoch of the CNN, PyTorch's 96.83% within
    one test image (the vector width's summation order: 96.82% to 96.84%), as the README says."""
    command = _blocks("bash")[0].split("&&")[-1].strip()
    argv = shlex.split(command)
    assert argv[:2] == ["ember", "mnist"]
    ember = Path(sys.executable).with_name("ember")
    argv[0] = str(ember) if ember.exists() else "ember"
    res = subprocess.run(argv + ["--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"test loss 0\.108\d, test accuracy 96\.8[234]%", res.stdout), res.stdout
    assert "data: mnist from ../shared/data/mnist" in res.stdout  # the first run says where its data comes from


def _modules() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name != "__init__.py" or path.parent.name in ("cli", "training", "ember"):
                out.append(path.relative_to(ROOT).as_posix())
    return out


def test_every_module_is_named_in_architecture():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    missing = []
    for module in _modules():
        stem = Path(module).stem if Path(module).name != "__init__.py" else Path(module).parent.name
        if module not in text and f"`{stem}`" not in text and f"{stem}.py" not in text:
            missing.append(module)
    assert not missing, f"ARCHITECTURE.md does not name: {', '.join(missing)}"
