"""`ember launch` supervision: whatever the ranks do, the launcher ends, names the rank, and leaves
no rank process and no status folder behind. A rank that exits 0 while the others still run
(they would wait for it forever), a rank whose wrapper is killed (its command orphaned), SIGTERM
to the launcher during start-up and once the ranks run (ranks that ignore SIGTERM included);
arguments out of range and world-setup errors are one line with exit status 2.

Every test that starts processes marks them with a unique string (a temporary path, in their
arguments or environment), bounds its wait, and kills whatever still carries the marker at the
end, pass or fail."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ember.frontends import cli
from ember.runtime import launch as L

BIN = Path(sys.executable).parent
BOUND = 120.0  # seconds any launch below may take to end (a starved 2-core CI machine: ~3 s quiet)


def _mpi() -> bool:
    return bool(shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec"))


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(tmp_path)  # the launcher's status folder lands here, where the test can see it
    return env | extra


def _marked(marker: str) -> list[int]:
    """Live processes (zombies are gone: nobody may reap an orphan) with `marker` in their
    command line or environment."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                continue
            blob = (d / "cmdline").read_bytes() + (d / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in blob:
            found.append(int(d.name))
    return found


def _kill_marked(marker: str) -> None:
    for pid in _marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _gone_within(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _wait_for(cond, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


class Launch:
    """`ember launch ARGS` as a subprocess; `finish()` waits (bounded), and on leaving the `with`
    the launcher and every marked process are killed, whatever happened."""

    def __init__(self, tmp_path: Path, args: list[str], **env: str) -> None:
        self.marker = str(tmp_path)
        self.tmp = tmp_path
        self.p = subprocess.Popen([sys.executable, "-m", "ember.frontends.cli", "launch", *args],
                                  env=_env(tmp_path, **env), stderr=subprocess.PIPE, text=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        _kill_marked(self.marker)

    def finish(self) -> tuple[int, str, float]:
        _, err = self.p.communicate(timeout=BOUND)
        return self.p.returncode, err, time.monotonic() - self.t0

    def status_folder(self) -> Path:
        assert _wait_for(lambda: list(self.tmp.glob("ember-launch-*")))
        return next(self.tmp.glob("ember-launch-*"))


def _sleeper(tmp_path: Path, ignore_term: bool = False) -> str:
    """Python code for a rank that says it is up (a file named after its RANK) and sleeps."""
    return ("import os, signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + f"open(os.path.join({str(tmp_path)!r}, 'up' + os.environ['RANK']), 'w').close()\n"
            "time.sleep(600)\n")  # longer than any bound: a launcher that waits for it fails


def _no_leftovers(tmp_path: Path) -> None:
    assert not _gone_within(str(tmp_path), 5.0), "rank processes left behind"
    assert not list(tmp_path.glob("ember-launch-*")), "status folder left behind"


MODES = [pytest.param(True, id="mpi"), pytest.param(False, id="no-mpi")]


@pytest.mark.parametrize("mpi", MODES)
def test_a_rank_exiting_0_while_the_others_run_fails_the_launch(tmp_path, mpi):
    if mpi and not _mpi():
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    rank = f'[ "$RANK" = 1 ] && exit 0; exec "{sys.executable}" -c "$CODE" {tmp_path}'
    args = ["--nproc-per-node", "2", "--exit-grace", "2", "--grace", "2"] + ([] if mpi else ["--no-mpi"])
    with Launch(tmp_path, args + ["--", "sh", "-c", rank], CODE=_sleeper(tmp_path)) as run:
        code, err, took = run.finish()
    assert code == 1, err
    assert ("ember launch: error: rank 1 exited with code 0 while rank 0 still ran, and had not finished 2 s later "
            "(a rank that leaves early leaves the others waiting for it in a collective); stopped the other ranks") in err, err
    assert took < BOUND
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("plan, want", [
    ("1 1", "limit steps is 1 on rank 1, 2 on rank 0"),
    ("2 2", "epochs is 2 on rank 1, 1 on rank 0"),
])
def test_ranks_with_different_step_plans_stop_at_the_start(tmp_path, plan, want):
    """Rank 1 with another --limit-steps or --epochs used to leave rank 0 spinning in its next
    all-reduce forever (rank 1 waiting in MPI_Finalize): now every rank stops before training."""
    if not _mpi():
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    script = Path(__file__).with_name("dp_plan_script.py")
    rank = f'if [ "$RANK" = 1 ]; then set -- {plan}; else set -- 1 2; fi; exec "{sys.executable}" "{script}" "$@"'
    with Launch(tmp_path, ["--nproc-per-node", "2", "--", "sh", "-c", rank]) as run:
        code, err, took = run.finish()
    assert code == 1, err
    lines = [x for x in err.splitlines() if x.startswith("dp_plan_script: error:")]
    assert lines == [f"dp_plan_script: error: rank 1 differs from rank 0: {want}; every rank must run the same "
                     f"steps"], err
    assert "ember launch: error: rank " in err and "failed (exit code 1)" in err, err
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("nested", [False, True], ids=["rank", "rank-under-sh"])
def test_killing_a_ranks_wrapper_stops_every_rank(tmp_path, nested):
    """The incident: rank 1's wrapper killed, its command orphaned while holding its MPI
    connection, and the launcher waiting on mpiexec forever. Here the ranks also ignore SIGTERM,
    and (rank-under-sh) run as a grandchild of the wrapper, out of reach of the kernel's
    parent-death signal, so only the launcher's group kill can stop them."""
    if not _mpi():
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    py = f'"{sys.executable}" -c "$CODE" {tmp_path}'
    cmd = ["sh", "-c", f"{py}; true"] if nested else [sys.executable, "-c", _sleeper(tmp_path, True), str(tmp_path)]
    with Launch(tmp_path, ["--nproc-per-node", "2", "--grace", "2", "--", *cmd],
                CODE=_sleeper(tmp_path, True)) as run:
        folder = run.status_folder()
        assert _wait_for(lambda: all((tmp_path / f"up{r}").exists() for r in "01") and (folder / "1.pid").exists())
        # The launcher starts watching a wrapper when it reads its pid file (every 0.1 s poll);
        # wrappers that die before it has looked at them once cannot be ordered (mpiexec kills
        # rank 0's a millisecond after rank 1's), so give it polls to spare, as a real run has
        # (a starved machine delays a poll by far more than its 0.1 s).
        time.sleep(3.0)
        wrapper = int((folder / "1.pid").read_text().split()[0])
        os.kill(wrapper, signal.SIGKILL)
        t0 = time.monotonic()
        code, err, _ = run.finish()
    assert time.monotonic() - t0 < BOUND
    assert code != 0
    assert "ember launch: error: rank 1 vanished: its process is gone and it reported no exit status" in err, err
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("when", ["start-up", "running"])
@pytest.mark.parametrize("mpi", MODES)
def test_sigterm_stops_every_rank_within_the_grace(tmp_path, when, mpi):
    if mpi and not _mpi():
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    args = ["--nproc-per-node", "2", "--grace", "2"] + ([] if mpi else ["--no-mpi"])
    with Launch(tmp_path, args + ["--", sys.executable, "-c", _sleeper(tmp_path, True), str(tmp_path)]) as run:
        if when == "start-up":  # the status folder exists: the launcher is starting the ranks
            run.status_folder()
        else:
            assert _wait_for(lambda: all((tmp_path / f"up{r}").exists() for r in "01"))
        run.p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code, err, _ = run.finish()
    assert time.monotonic() - t0 < 60, err  # the grace (2 s) and the time to kill, far below the ranks' 600 s sleep
    assert code == 128 + signal.SIGTERM, err
    assert "ember launch: error: interrupted by SIGTERM; stopped every rank" in err, err
    _no_leftovers(tmp_path)


# ---- one line and exit 2 -------------------------------------------------------------------------

def _fail(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The launcher's temporary folders go to tmp_path, so leftovers can be seen."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_arguments_out_of_range_are_one_line(capsys, private_tmp):
    cases = {
        ("--nproc-per-node", "100000"): "--nproc-per-node 100000: expected 1..1024 ranks on this node",
        ("--nproc-per-node", "0"): "--nproc-per-node 0: expected 1..1024 ranks on this node",
        ("--nproc-per-node", "two"): "--nproc-per-node two: expected an integer in 1..1024",
        ("--master-port", "99999"): "--master-port 99999: expected a TCP port in 1..65535",
        ("--master-port", "-1"): "--master-port -1: expected a TCP port in 1..65535",
        ("--master-port", "http"): "--master-port http: expected a TCP port in 1..65535",
        ("--node-rank", "2"): "--node-rank 2: expected 0..0 (--nnodes 1)",
        ("--grace", "-1"): "--grace -1: expected a number of seconds >= 0",
    }
    for (flag, value), want in cases.items():
        argv = ["launch", "--nproc-per-node", "2", flag, value, "--", "true"]
        assert _fail(capsys, argv) == f"ember launch: error: {want}", (flag, value)
    with pytest.raises(L.LaunchError, match="expected 1..1024"):
        L.launch(["true"], 100000)
    assert not list(private_tmp.iterdir())


def test_no_status_folder_is_left_on_any_way_out(private_tmp, monkeypatch):
    assert L.launch(["true"], 2, mpi=False) == 0
    with pytest.raises(L.LaunchError, match="rank 1 failed \\(exit code 3\\)"):
        L.launch(["sh", "-c", 'exit $(( RANK * 3 ))'], 2, mpi=False, grace=1)

    def refuse(*a, **k):
        raise OSError(7, "Argument list too long")
    monkeypatch.setattr(L.subprocess, "Popen", refuse)
    with pytest.raises(L.LaunchError, match="could not start the ranks .*: Argument list too long"):
        L.launch(["true"], 2, mpi=False)
    assert not list(private_tmp.iterdir())


def test_launch_without_mpi4py_is_one_line(capsys, monkeypatch, private_tmp):
    if not _mpi():
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    assert _fail(capsys, ["launch", "--nproc-per-node", "2", "--", "true"]) == (
        "ember launch: error: the ranks form an MPI world through mpi4py, which is not installed: "
        "pip install 'ember[mpi]' (or --no-mpi to start plain processes)")
    assert not list(private_tmp.iterdir())


@pytest.mark.parametrize("env, want", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc: expected the number of ranks, an integer >= 1"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 is outside a world of WORLD_SIZE=2 ranks: expected 0..1"),
    ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK=x: expected this process's rank, an integer in 0..1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: expected the number of ranks, an integer >= 1"),
])
def test_a_bad_world_in_the_environment_is_one_line(capsys, monkeypatch, env, want):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _fail(capsys, ["mnist", "--device", "cpu"]) == f"ember mnist: error: {want}"


def _ember(tmp_path: Path, args: list[str], **env: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "ember.frontends.cli", *args], env=_env(tmp_path, **env),
                              capture_output=True, text=True, timeout=BOUND)
    finally:
        _kill_marked(str(tmp_path))


def test_a_stray_world_size_is_one_line(tmp_path):
    """WORLD_SIZE=2 left in the environment of a process started alone: MPI says a world of 1."""
    if not _mpi():
        pytest.skip("no mpi4py/mpiexec (pip install 'ember[mpi]')")
    r = _ember(tmp_path, ["mnist", "--device", "cpu"], WORLD_SIZE="2")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        "ember mnist: error: the environment says rank 0 of 2 (RANK, WORLD_SIZE), MPI says rank 0 of 1 (started "
        "alone, not by a launcher: unset WORLD_SIZE to run one process); start the ranks with "
        "`ember launch --nproc-per-node 2` or `mpiexec -n 2`"), r.stderr


def test_ranks_without_mpi4py_say_it_once(tmp_path):
    """Under `ember launch`, ranks whose Python lacks mpi4py (shadowed here by a package that
    fails to import): rank 0 alone prints one line, no traceback; the run exits 2."""
    if not _mpi():
        pytest.skip("no mpiexec (pip install 'ember[mpi]')")
    shadow = tmp_path / "shadow" / "mpi4py"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named mpi4py (shadowed by the test)')\n")
    r = _ember(tmp_path, ["launch", "--nproc-per-node", "2", "--", sys.executable, "-m", "ember.frontends.cli",
                          "mnist", "--device", "cpu"], PYTHONPATH=str(shadow.parent))
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("ember mnist: error:")]
    assert lines == ["ember mnist: error: data parallel on the CPU needs mpi4py (No module named mpi4py (shadowed "
                     "by the test)); pip install 'ember[mpi]'"], r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.glob("ember-launch-*"))
