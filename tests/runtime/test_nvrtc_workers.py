"""NVRTC worker processes (`runtime/nvrtc_workers.py`) without a GPU: the workers run their real
loop against a fake `cupy_backends.cuda.libs.nvrtc` put first on their PYTHONPATH, so the
protocol, the sharing of jobs with this process's threads, a worker that dies mid-job, a worker
of another NVRTC version and the results' order are all exercised as on a GPU machine."""
from __future__ import annotations

import os
import textwrap
import threading
import time

import pytest

from ember.runtime import nvrtc_workers

FAKE_NVRTC = textwrap.dedent('''
    import os, time
    time.sleep(float(os.environ.get("FAKE_NVRTC_IMPORT_S", "0")))  # a slow start: the interpreter, CuPy
    class NVRTCError(Exception):
        pass
    def getVersion():
        return tuple(int(v) for v in os.environ.get("FAKE_NVRTC_VERSION", "13.0").split("."))
    def createProgram(source, name, headers, include_names):
        return {"source": source, "name": name}
    def compileProgram(program, options):
        if "crash" in program["source"]:
            os._exit(3)  # a worker killed mid-job
        time.sleep(0.01)
        if "syntax error" in program["source"]:
            program["log"] = program["name"] + ": error: expected a declaration"
            raise NVRTCError("NVRTC_ERROR_COMPILATION")
    def getCUBIN(program):
        return ("ELF|worker %d|" % os.getpid() + program["source"]).encode()
    def getProgramLog(program):
        return program.get("log", "")
    def destroyProgram(program):
        pass
''')


@pytest.fixture
def fake_nvrtc_path(tmp_path, monkeypatch):
    libs = tmp_path / "cupy_backends" / "cuda" / "libs"
    libs.mkdir(parents=True)
    for d in (tmp_path / "cupy_backends", tmp_path / "cupy_backends" / "cuda", libs):
        (d / "__init__.py").write_text("")
    (libs / "nvrtc.py").write_text(FAKE_NVRTC)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return tmp_path


def slow_local(job):
    time.sleep(0.05)  # this process's NVRTC, slower than the workers: they must take jobs too
    return ("ELF|local|" + job[0]).encode(), ""


def wait_until_up(pool: nvrtc_workers.WorkerPool) -> None:
    for w in pool._workers:
        assert w.ready.wait(30), "a worker did not start"


def test_jobs_are_shared_between_threads_and_workers_and_come_back_in_order(fake_nvrtc_path):
    pool = nvrtc_workers.WorkerPool(2)
    try:
        wait_until_up(pool)
        jobs = [(f"source {i}", ("-arch=sm_90",), f"u{i}.cu") for i in range(40)]
        results = pool.compile(jobs, (13, 0), slow_local)
    finally:
        pool.close()
    assert [r[0].decode().split("|")[2] for r in results] == [j[0] for j in jobs]
    by = {r[0].decode().split("|")[1] for r in results}
    assert "local" in by and len(by - {"local"}) == 2, by  # both workers and the threads compiled


def test_a_rejected_source_comes_back_from_a_worker_as_its_log(fake_nvrtc_path):
    pool = nvrtc_workers.WorkerPool(1)
    try:
        wait_until_up(pool)
        worker = pool._workers[0]
        assert worker.compile(("syntax error here", (), "bad.cu")) == (b"", "bad.cu: error: expected a declaration")
        assert worker.compile(("fine", (), "ok.cu"))[0].endswith(b"|fine"), "the worker goes on after a rejection"
    finally:
        pool.close()


def test_a_worker_that_dies_mid_job_costs_nothing_but_itself(fake_nvrtc_path):
    pool = nvrtc_workers.WorkerPool(2)
    try:
        wait_until_up(pool)
        procs = [w.proc for w in pool._workers]

        def local_after_a_death(job):
            # this process's threads hold one job each until a worker has died, so the crashing
            # job (last in the queue) reaches a worker, whatever the scheduling
            deadline = time.monotonic() + 20
            while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.005)
            return ("ELF|local|" + job[0]).encode(), ""

        crash = 11
        jobs = [(f"source {i}" + (" crash" if i == crash else ""), (), f"u{i}.cu") for i in range(12)]
        results = pool.compile(jobs, (13, 0), local_after_a_death)
        assert any(p.poll() is not None for p in procs), "a worker took the crashing job"
        assert [r[0].decode().split("|")[2] for r in results] == [j[0] for j in jobs]
        assert results[crash][0].startswith(b"ELF|local|"), "the crashing job finished on this process's threads"
        assert any(b"|worker " in r[0] for r in results), "the workers compiled the other jobs"
        assert len(pool._workers) <= 1, "the dead worker is dropped"
    finally:
        pool.close()


class _WorkerDyingLast:
    """A worker that takes a job, holds it until this process's threads have finished theirs and
    found the queue empty, then dies: its job goes back to a queue no thread drains any more."""

    def __init__(self, locals_done: list[int]) -> None:
        self.ready, self.dead, self.version = threading.Event(), False, (13, 0)
        self.ready.set()
        self.took, self.locals_done = threading.Event(), locals_done

    def compile(self, job):
        self.took.set()
        deadline = time.monotonic() + 20
        while len(self.locals_done) < nvrtc_workers.LOCAL_THREADS and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # the threads' last look at the queue
        raise EOFError("worker closed its pipe")

    def close(self) -> None:
        pass


def test_a_job_put_back_after_every_thread_left_is_still_compiled():
    locals_done: list[int] = []
    worker = _WorkerDyingLast(locals_done)

    def local(job):
        worker.took.wait(20)  # one job a thread, until the worker holds the last one
        locals_done.append(1)
        return ("ELF|local|" + job[0]).encode(), ""

    pool = nvrtc_workers.WorkerPool(0)
    pool._workers = [worker]
    jobs = [(f"source {i}", (), f"u{i}.cu") for i in range(nvrtc_workers.LOCAL_THREADS + 1)]
    out: dict = {}
    caller = threading.Thread(target=lambda: out.setdefault("results", pool.compile(jobs, (13, 0), local)),
                              daemon=True)
    caller.start()
    caller.join(60)
    assert not caller.is_alive(), "compile() hung on the job the dead worker put back"
    assert [r[0].decode().split("|")[2] for r in out["results"]] == [j[0] for j in jobs]
    assert pool._workers == [], "the dead worker is dropped"


def test_workers_of_another_nvrtc_are_not_used(fake_nvrtc_path, monkeypatch):
    monkeypatch.setenv("FAKE_NVRTC_VERSION", "12.9")
    pool = nvrtc_workers.WorkerPool(2)
    try:
        wait_until_up(pool)
        results = pool.compile([(f"s{i}", (), "u.cu") for i in range(6)], (13, 0), slow_local)
    finally:
        pool.close()
    assert all(r[0].startswith(b"ELF|local|") for r in results) and pool._workers == []


def test_a_failing_local_compile_raises_instead_of_hanging(fake_nvrtc_path, monkeypatch):
    monkeypatch.setenv(nvrtc_workers.ENV_VAR, "0")

    def broken(job):
        raise MemoryError("out of memory in NVRTC")
    with pytest.raises(MemoryError):
        nvrtc_workers.compile_all([("s", (), "u.cu")] * 5, (13, 0), broken)
    pool = nvrtc_workers.WorkerPool(0)
    with pytest.raises(MemoryError):
        pool.compile([("s", (), "u.cu")] * 3, (13, 0), broken)


def test_the_worker_count_setting(monkeypatch):
    monkeypatch.delenv(nvrtc_workers.ENV_VAR, raising=False)
    assert nvrtc_workers.workers_wanted() == 0  # opt-in: measured slower than two threads in a compile
    monkeypatch.setenv(nvrtc_workers.ENV_VAR, "3")
    assert nvrtc_workers.workers_wanted() == 3
    monkeypatch.setenv(nvrtc_workers.ENV_VAR, "many")
    with pytest.raises(ValueError, match="EMBER_NVRTC_WORKERS must be a whole number"):
        nvrtc_workers.workers_wanted()


def test_default_worker_count_follows_the_cores(monkeypatch):
    assert [nvrtc_workers.default_workers(c) for c in (1, 2, 4, 7, 8, 12, 16, 64)] == [0, 0, 0, 0, 4, 6, 8, 8]
    monkeypatch.delenv(nvrtc_workers.ENV_VAR, raising=False)
    assert nvrtc_workers.workers_wanted() == nvrtc_workers.default_workers()
    monkeypatch.setenv(nvrtc_workers.ENV_VAR, "0")
    assert nvrtc_workers.workers_wanted() == 0
    monkeypatch.setenv(nvrtc_workers.ENV_VAR, "3")
    assert nvrtc_workers.workers_wanted() == 3


def test_default_workers_start_only_for_large_builds(monkeypatch):
    started = []
    monkeypatch.setattr(nvrtc_workers, "WorkerPool", lambda n: started.append(n) or object())
    monkeypatch.setattr(nvrtc_workers, "_pool", None)
    monkeypatch.setattr(nvrtc_workers, "default_workers", lambda cores=None: 8)
    monkeypatch.delenv(nvrtc_workers.ENV_VAR, raising=False)
    nvrtc_workers.prestart(nvrtc_workers.MIN_DEFAULT_JOBS - 1)  # a small model: the threads alone
    assert started == []
    local = lambda job: (b"ELF", "")  # noqa: E731
    assert nvrtc_workers.compile_all([("s", (), "u.cu")] * 5, (13, 0), local) == [(b"ELF", "")] * 5
    assert started == []
    nvrtc_workers.prestart(nvrtc_workers.MIN_DEFAULT_JOBS)
    assert started == [8]
    # asked for explicitly, workers start for any build
    monkeypatch.setattr(nvrtc_workers, "_pool", None)
    monkeypatch.setenv(nvrtc_workers.ENV_VAR, "2")
    nvrtc_workers.prestart(1)
    assert started == [8, 2]


def test_expected_modules_of_a_traced_step_tell_small_models_from_large():
    import numpy as np
    from ember.frontends import nn
    from ember.frontends.compile import example_type
    from ember.frontends.tracing import trace
    from ember.frontends.training.recipes import build_model
    from ember.runtime.cuda import expected_modules

    def traced(name):
        model, loss = build_model(name), nn.CrossEntropyLoss()
        x = np.zeros((8, 1, 28, 28), np.float32)
        return trace(lambda a, b: loss(model(a), b), example_type(x), example_type(np.zeros(8, np.int64)),
                     name="train_step", modules={"": model})

    assert expected_modules(traced("cnn")) < nvrtc_workers.MIN_DEFAULT_JOBS <= expected_modules(traced("resnet8"))


def test_workers_still_starting_do_not_hold_up_the_exit(fake_nvrtc_path, monkeypatch):
    """Workers start before the passes (and on a cached plan never built ahead), so a short
    process may end before they are up: closing the pool then kills them at once instead of
    waiting for their start (~1.3 s on a GPU host)."""
    monkeypatch.setenv("FAKE_NVRTC_IMPORT_S", "20")
    pool = nvrtc_workers.WorkerPool(2)
    procs = [w.proc for w in pool._workers]
    t = time.perf_counter()
    pool.close()
    assert time.perf_counter() - t < 1 and all(p.poll() is not None for p in procs)  # before: 2 s a worker
