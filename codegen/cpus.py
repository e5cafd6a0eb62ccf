"""The CPUs this process may run on, for the build jobs it starts (g++ units, NVRTC work).

On Linux a CPU affinity belongs to a thread, and `os.sched_getaffinity(0)` is the calling
thread's. An OpenMP runtime with `OMP_PROC_BIND` set (as ember's benchmarks recommend) binds
the thread that runs its first parallel region, the main thread here, to one place: after the
first CPU step (or PyTorch's first parallel op, or the FMA-peak probe of `ember bench`) that
thread may run on one core only, and every process it starts inherits that one core. Counted
from the calling thread, a 16-core host compiled a step's units one after another on core 0
(`ember bench --threads 16` read 3-10 s cold compiles there, 0.8-3.2 s on a 2-core machine).

So the CPUs are the process's: those of the thread that first imported this module together
with every thread's current affinity, and the threads that run build work take that whole set
first (`widen_this_thread`), so the processes they start inherit it. Limits set when the process
started (`taskset`, a cgroup's cpuset) bound both. Two cases it does not see: an OpenMP region
that ran before ember's import with a team of one thread (nothing then shows the other cores),
and a narrowing of the whole process after the import (build jobs may still use the cores it
took away; the kernel enforces a cgroup's cpuset regardless).
"""
from __future__ import annotations

import os
import threading


def _calling_thread_cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset()


#: the CPUs of the thread that first imported this module, before an OpenMP runtime bound it
_AT_IMPORT = _calling_thread_cpus()


def _threads_cpus() -> set[int]:
    """Every thread's affinity together, from /proc/self/task where it is this process's own
    (it lists the calling thread: a /proc of another pid namespace lists other tasks)."""
    cpus: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
        if str(threading.get_native_id()) not in tasks:
            return cpus
        for task in tasks:
            try:
                cpus |= os.sched_getaffinity(int(task))
            except (OSError, ValueError):  # a thread that ended meanwhile, or an entry not a thread id
                pass
    except (AttributeError, OSError):
        pass
    return cpus


def process_cpus() -> frozenset[int]:
    """The CPUs this process may run on: its threads' affinities together with those found at
    import (not the calling thread's alone); every CPU `os.cpu_count` counts where the platform
    has no affinities."""
    cpus = set(_AT_IMPORT) | _threads_cpus()
    return frozenset(cpus) if cpus else frozenset(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many CPUs this process may run on (`process_cpus`)."""
    return len(process_cpus())


def widen_this_thread() -> None:
    """Lets the calling thread, and the processes it starts from now on, run on every CPU of the
    process (a thread that compiles: `compiler.UnitBuilds`' jobs, NVRTC's threads, a CUDA build
    ahead). Never raises: where the affinity cannot be set, the work runs where it is put."""
    try:
        cpus = process_cpus()
        if frozenset(os.sched_getaffinity(0)) != cpus:
            os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError, ValueError):
        pass
