"""Outputs that fail late (a full disk, a place no file can be made), a device that cannot run here,
a step whose memory does not fit, and a few flags that were silently ignored: each ends in one line
naming what failed and what was expected (exit 2 for the arguments, 1 for the machine), and no
cut or partial file is left. A full disk is a tiny tmpfs (tests/fullfs.py); the MLP on MNIST
slices keeps the runs short."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ember.frontends import cli
from ember.frontends.cli import bench
from ember.frontends.training import trainer
from ember.frontends.checkpoint import load_checkpoint
from ember.frontends.training.metrics import read_metrics

from fullfs import fill, tiny_tmpfs
from models import MNIST_DIR

NO_CUPY = "--device cuda: device 'cuda' needs CuPy: pip install 'ember[cuda13]' (or 'ember[cuda12]' for CUDA 12)"


@pytest.fixture(scope="module")
def mnist_dir():
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"MNIST not found at {MNIST_DIR}")
    return str(MNIST_DIR)


def _fail(capsys, argv: list[str], code: int) -> str:
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _mnist(mnist_dir: str, *extra: str) -> list[str]:
    return ["mnist", "--model", "mlp", "--device", "cpu", "--data", mnist_dir, "--no-progress", *extra]


@pytest.fixture
def no_compile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("compiled before the arguments were checked")
    monkeypatch.setattr(trainer, "ember_compile", boom)


# ---- 8: a metrics file on a full disk ------------------------------------------------------------

def test_full_disk_under_the_metrics_file_stops_like_ctrl_c(tmp_path, mnist_dir, capsys):
    ck = tmp_path / "c.st"
    with tiny_tmpfs(tmp_path / "fs") as fs:
        fill(fs, room=4096)  # the run record and a few dozen step records fit
        m = fs / "m.jsonl"
        err = _fail(capsys, _mnist(mnist_dir, "--limit-steps", "200", "--log-every", "1", "--metrics-file", str(m),
                                   "--save", str(ck)), code=1)
        got = re.fullmatch(rf"ember mnist: error: --metrics-file {re.escape(str(m))}: a record could not be "
                           rf"written: No space left on device \(errno 28, ENOSPC\); stopped at step (\d+), saved "
                           rf"{re.escape(str(ck))} \(resume with --resume {re.escape(str(ck))}\)", err)
        assert got, err
        stopped = int(got.group(1))
        assert 1 < stopped < 200
        assert load_checkpoint(ck).step == stopped and load_checkpoint(ck).step_in_epoch == stopped
        assert m.read_bytes().endswith(b"\n")  # no cut line
        records = read_metrics(m)
        assert records[-1]["type"] == "step" and records[-1]["step"] == stopped - 1  # the failed one is absent
        assert cli.main(["plot", str(m), "-o", str(tmp_path / "a.png")]) == 0
    capsys.readouterr()


def test_a_resumed_run_does_not_glue_onto_a_cut_line(tmp_path, mnist_dir, capsys):
    ck, m = tmp_path / "c.st", tmp_path / "m.jsonl"
    assert cli.main(_mnist(mnist_dir, "--limit-steps", "4", "--log-every", "1", "--metrics-file", str(m),
                           "--save", str(ck))) == 0
    text = m.read_text()
    m.write_text(text + text.splitlines()[1][:30])  # as a crash mid-write of an older ember left it
    capsys.readouterr()
    assert cli.main(_mnist(mnist_dir, "--epochs", "2", "--limit-steps", "4", "--log-every", "1", "--metrics-file",
                           str(m), "--resume", str(ck))) == 0
    err = capsys.readouterr().err
    assert f"ember mnist: warning: {m}: removed its cut last line (30 bytes" in err, err
    records = read_metrics(m)
    assert [r["type"] for r in records].count("run") == 2 and records[-1]["type"] == "epoch"
    assert m.read_text().startswith(text) and m.read_text()[len(text):].startswith('{"type": "run"')


# ---- 9: --save, --plot, --dump-kernels that cannot be written --------------------------------------

def test_an_unwritable_place_is_refused_before_training(capsys, mnist_dir, no_compile):
    # root passes os.access on /proc, yet no file can be made there
    err = _fail(capsys, _mnist(mnist_dir, "--save", "/proc/x.safetensors"), code=2)
    assert err == ("ember mnist: error: --save /proc/x.safetensors: cannot create a file in /proc: No such file or "
                   "directory (errno 2, ENOENT); expected a path in a writable folder")
    assert "--plot /proc/c.png: cannot create a file in /proc" in _fail(capsys, _mnist(mnist_dir, "--plot", "/proc/c.png"), 2)
    assert "--dump-kernels /proc/d: cannot create a file in /proc" in \
        _fail(capsys, _mnist(mnist_dir, "--dump-kernels", "/proc/d"), 2)


def test_a_full_disk_refuses_up_front_when_not_a_byte_fits(tmp_path, mnist_dir, capsys, no_compile):
    with tiny_tmpfs(tmp_path / "fs") as fs:
        fill(fs)
        err = _fail(capsys, _mnist(mnist_dir, "--save", str(fs / "c.st")), code=2)
        assert err == (f"ember mnist: error: --save {fs / 'c.st'}: cannot write in {fs}: No space left on device "
                       f"(errno 28, ENOSPC); expected a path in a writable folder")
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]


def test_a_checkpoint_that_does_not_fit_keeps_the_old_file(tmp_path, mnist_dir, capsys):
    with tiny_tmpfs(tmp_path / "fs") as fs:  # 64 KiB: the MLP's checkpoint is 95 KB
        ck = fs / "c.st"
        ck.write_bytes(b"the previous checkpoint")
        err = _fail(capsys, _mnist(mnist_dir, "--limit-steps", "3", "--save", str(ck)), code=1)
        assert err == (f"ember mnist: error: --save {ck}: the checkpoint could not be written: No space left on "
                       f"device (errno 28, ENOSPC); the file keeps its previous contents; stopped at step 3")
        assert ck.read_bytes() == b"the previous checkpoint"
        assert sorted(p.name for p in fs.iterdir()) == ["c.st"]  # no temporary file left beside it


def test_a_plot_that_does_not_fit_leaves_no_file(tmp_path, mnist_dir, capsys):
    m = tmp_path / "m.jsonl"
    assert cli.main(_mnist(mnist_dir, "--limit-steps", "4", "--log-every", "1", "--metrics-file", str(m))) == 0
    capsys.readouterr()
    with tiny_tmpfs(tmp_path / "fs") as fs:
        fill(fs, room=4096)  # the up-front check fits; a PNG of the curves does not
        png = fs / "c.png"
        err = _fail(capsys, ["plot", str(m), "-o", str(png)], code=1)
        assert err == f"ember plot: error: {png}: No space left on device (errno 28, ENOSPC)"
        err = _fail(capsys, _mnist(mnist_dir, "--limit-steps", "2", "--plot", str(png)), code=1)
        assert err == f"ember mnist: error: --plot {png}: No space left on device (errno 28, ENOSPC); the file was not written"
        assert sorted(p.name for p in fs.iterdir()) == ["filler"]  # no 0-byte image


def test_a_kernel_dump_that_does_not_fit_leaves_only_whole_files(tmp_path, mnist_dir, capsys):
    with tiny_tmpfs(tmp_path / "fs") as fs:
        fill(fs, room=8192)
        dump = fs / "dump"
        err = _fail(capsys, _mnist(mnist_dir, "--limit-steps", "2", "--dump-kernels", str(dump)), code=1)
        assert re.fullmatch(rf"ember mnist: error: {re.escape(str(dump))}/\S+: No space left on device "
                            rf"\(errno 28, ENOSPC\)", err), err
        files = [p for p in dump.rglob("*") if p.is_file()]
        assert files and not [p for p in files if p.name.endswith(".tmp")]
        assert all(p.read_text().endswith(("\n", "}")) for p in files if p.suffix in (".txt", ".dot"))


def test_kernels_out_must_name_a_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _fail(capsys, ["kernels", "--model", "mlp", "--out", ""], code=2)
    assert err == "ember kernels: error: --out '': an empty path; expected a directory name (use --out . for the current one)"
    assert list(tmp_path.iterdir()) == []


# ---- 10: a CUDA device that cannot run here --------------------------------------------------------

@pytest.fixture
def no_run(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("ran before the device was checked")
    monkeypatch.setattr(bench, "run_bench", boom)
    from ember.frontends.cli import align
    monkeypatch.setattr(align, "run_alignment", boom)


def _fake_cupy(root: Path, body: str) -> Path:
    (root / "cupy").mkdir(parents=True)
    (root / "cupy" / "__init__.py").write_text(textwrap.dedent(body))
    return root


@pytest.fixture
def without_cupy(monkeypatch):
    """No CuPy importable, whatever this machine has (a GPU machine runs these tests too)."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def test_bench_and_align_say_what_mnist_says_without_cupy(mnist_dir, capsys, no_run, without_cupy, no_compile):
    want = f"ember mnist: error: {NO_CUPY}"
    assert _fail(capsys, _mnist(mnist_dir, "--device", "cuda"), code=2) == want
    assert _fail(capsys, ["bench", "--device", "cuda", "--model", "mlp"], code=2) == want.replace("mnist", "bench")
    assert _fail(capsys, ["align", "--device", "cuda", "--data", mnist_dir], code=2) == want.replace("mnist", "align")
    # tune too (it printed CuPy's traceback, session 36's probe)
    assert _fail(capsys, ["tune", "--device", "cuda", "--model", "mlp"], code=2) == want.replace("mnist", "tune")


BROKEN = """
    raise ImportError("libcudart.so.13: cannot open shared object file: No such file or directory")
"""
NO_GPU = """
    class _Runtime:
        @staticmethod
        def getDeviceCount():
            return 0
    class cuda:
        runtime = _Runtime
"""


def test_a_broken_cupy_is_reported_with_its_import_error(tmp_path, capsys, no_run, monkeypatch):
    monkeypatch.syspath_prepend(str(_fake_cupy(tmp_path, BROKEN)))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    err = _fail(capsys, ["bench", "--device", "cuda", "--model", "mlp"], code=2)
    assert err == ("ember bench: error: --device cuda: device 'cuda': CuPy is installed but cannot be imported "
                   "(ImportError: libcudart.so.13: cannot open shared object file: No such file or directory); "
                   "expected a CuPy build that matches this machine's CUDA (cupy-cuda13x or cupy-cuda12x)")


def test_a_cupy_without_a_gpu_says_so(tmp_path, capsys, no_run, monkeypatch):
    monkeypatch.syspath_prepend(str(_fake_cupy(tmp_path, NO_GPU)))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    try:
        assert _fail(capsys, ["align", "--device", "cuda"], code=2) == \
            "ember align: error: --device cuda: device 'cuda' found no NVIDIA GPU"
    finally:
        sys.modules.pop("cupy", None)  # the fake must not outlive this test


def test_a_broken_cupy_on_pythonpath_in_a_fresh_process(tmp_path):
    """As a user meets it: the package on PYTHONPATH, `ember mnist --device cuda` in a new process."""
    env = {"PYTHONPATH": str(_fake_cupy(tmp_path, BROKEN)), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "ember.frontends.cli", "mnist", "--device", "cuda"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ember mnist: error: --device cuda: device 'cuda': CuPy is installed but cannot be imported (ImportError: "
        "libcudart.so.13: cannot open shared object file: No such file or directory); expected a CuPy build that "
        "matches this machine's CUDA (cupy-cuda13x or cupy-cuda12x)"]


# ---- 13: a step whose memory does not fit --------------------------------------------------------

def test_an_arena_that_cannot_be_allocated_is_one_line(mnist_dir, capsys, monkeypatch):
    from ember.runtime import cpu

    def no_memory(nbytes: int, align: int = 64):
        raise MemoryError(f"Unable to allocate {nbytes / 2**30:.2f} GiB for an array with shape ({nbytes},) "
                          f"and data type uint8")
    monkeypatch.setattr(cpu, "_aligned", no_memory)
    err = _fail(capsys, _mnist(mnist_dir, "--batch-size", "100", "--limit-steps", "1"), code=1)
    assert re.fullmatch(r"ember mnist: error: the training step for batch 100 plans [\d.]+ MiB of memory \(its arena\), "
                        r"which could not be allocated \(Unable to allocate .*\); expected a smaller batch or more "
                        r"memory", err), err


def test_an_arena_beyond_the_address_space_limit_is_one_line(tmp_path):
    """The real allocation under RLIMIT_AS (as `ulimit -v`): the planned size, not NumPy's traceback."""
    script = textwrap.dedent("""
        import resource, sys
        from ember.frontends import compile, nn, optim
        from ember.frontends.training import build_model
        from ember.ir import TensorType, float32, int64
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        batch = 1 << 21  # the MLP's arena at this batch is over 6 GiB
        try:
            compile(build_model("mlp"), nn.CrossEntropyLoss(), optim.SGD(lr=0.05), device="cpu",
                    example_inputs=(TensorType((batch, 784), float32), TensorType((batch,), int64)))
        except MemoryError as e:
            print(e)
            sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert re.fullmatch(r"the training step for batch 2097152 plans [\d.]+ GiB of memory \(its arena\), which could "
                        r"not be allocated \(.*\); expected a smaller batch or more memory", proc.stdout.strip()), proc.stdout


# ---- 15: flags that were ignored or misread --------------------------------------------------------

def test_bench_refuses_tf32_on_the_cpu(capsys, no_run):
    assert _fail(capsys, ["bench", "--device", "cpu", "--tf32", "--model", "mlp"], code=2) == \
        "ember bench: error: --tf32: TF32 is a CUDA tensor-core mode; --device cpu computes in float32"


def test_resuming_past_limit_steps_says_no_step_ran(tmp_path, mnist_dir, capsys):
    ck = tmp_path / "c.st"
    from ember.frontends.training import Trainer, build_model, make_optimizer
    from ember.runtime.data import load_mnist
    x, y = load_mnist(mnist_dir, "train", flat=True)
    t = Trainer(build_model("mlp"), make_optimizer("sgd", 0.05), (x[:640], y[:640]), device="cpu", limit_steps=4,
                config={"model": "mlp", "optimizer": "sgd"})
    t.train_epoch()
    t.epoch, t.step_in_epoch = 0, 4  # 4 steps into epoch 1, as Ctrl-C leaves it
    t.save(ck)
    assert cli.main(_mnist(mnist_dir, "--limit-steps", "3", "--resume", str(ck), "--metrics-file",
                           str(tmp_path / "m.jsonl"))) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("epoch 1/1"))
    assert line.startswith("epoch 1/1: no step ran: the checkpoint is at step 5 of the epoch, past --limit-steps 3, "
                           "test loss "), line
    assert read_metrics(tmp_path / "m.jsonl")[-1]["train_loss"] is None  # not a loss of 0
