"""ember.codegen.cpus: the process's CPUs for build jobs, whatever CPU the calling thread was bound to.
Each test binds a thread of its own (an affinity is a thread's on Linux), never pytest's."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from ember.codegen import cpus

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinities")


def _process_cpus() -> frozenset[int]:
    """What the tests expect: the process's CPUs (pytest's own thread may be bound already, e.g.
    under OMP_PROC_BIND after an earlier test's CPU step); two at least, to bind to one of them."""
    every = cpus.process_cpus()
    if len(every) < 2:
        pytest.skip("needs two CPUs")
    return every


def _in_bound_thread(work):
    """`work()` on a new thread bound to one CPU (as OpenMP binds its first parallel region's)."""
    result: dict = {}

    def run() -> None:
        os.sched_setaffinity(0, {min(cpus.process_cpus())})
        try:
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_bound_thread_counts_the_process_cores_not_its_own():
    every = _process_cpus()
    bound, counted, cpus_seen = _in_bound_thread(lambda: (os.sched_getaffinity(0), cpus.usable_cores(), cpus.process_cpus()))
    assert len(bound) == 1
    assert counted == len(every) and cpus_seen == every


def test_widening_gives_a_bound_thread_and_the_processes_it_starts_every_core():
    every = sorted(_process_cpus())
    probe = [sys.executable, "-c", "import os, sys; sys.stdin.read(); print(sorted(os.sched_getaffinity(0)))"]

    def work():
        cpus.widen_this_thread()
        child = subprocess.Popen(probe, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return child.communicate("", timeout=60)[0].strip(), sorted(os.sched_getaffinity(0))

    child_cpus, thread_cpus = _in_bound_thread(work)
    assert thread_cpus == every and child_cpus == str(every)
