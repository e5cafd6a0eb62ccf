"""The CPUs this process may run on, for the build jobs it starts (g++ units, NVRTC workers).

On Linux a CPU affinity belongs to a thread, and `os.sched_getaffinity(0)` is the calling
thread's. An OpenMP runtime with `OMP_PROC_BIND` set (as ember's benchmarks recommend) binds
the thread that runs its first parallel region, the main thread here, to one place: after the
first CPU step (or PyTorch's first parallel op, or the FMA-peak probe of `ember bench`) that
thread may run on one core only, and every process it starts inherits that one core. Counted
from the calling thread, a 16-core host compiled a step's units one after another on core 0
(`ember bench --threads 16` read 3-10 s cold compiles there, 0.8-3.2 s on a 2-core machine).

So the CPUs are the process's: those ember's import found (before any binding) together with
every thread's current affinity (a `taskset` or a cgroup's cpuset bounds both), and the threads
that start build processes take that whole set first (`widen_this_thread`), so the processes
inherit it.
"""
from __future__ import annotations

import os


def _calling_thread() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


#: the CPUs of the thread that imported ember, before any OpenMP runtime bound it
_AT_IMPORT = _calling_thread()


def process_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its threads' affinities together with those found at
    import (not the calling thread's alone); every CPU `os.cpu_count` counts where the platform
    has no affinities."""
    cpus = set(_AT_IMPORT)
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                cpus |= os.sched_getaffinity(int(task))
            except (OSError, ValueError):  # a thread that ended meanwhile
                pass
    except (AttributeError, OSError):
        pass
    return frozenset(cpus) if cpus else frozenset(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many CPUs this process may run on (`process_cpus`)."""
    return len(process_cpus())


def widen_this_thread() -> None:
    """Lets the calling thread, and the processes it starts from now on, run on every CPU of the
    process (a build job's thread: `compiler.UnitBuilds`). Never raises: where the affinity
    cannot be set, jobs run where they are put."""
    widen(0)


def widen(pid: int) -> None:
    """`widen_this_thread` for another thread or a child process just started (an NVRTC worker,
    before it starts threads of its own; 0: the calling thread)."""
    try:
        cpus = process_cpus()
        if frozenset(os.sched_getaffinity(pid)) != cpus:
            os.sched_setaffinity(pid, cpus)
    except (AttributeError, OSError, ValueError):
        pass
