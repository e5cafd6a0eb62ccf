"""NVRTC in worker processes, beside the compiling process's own threads.

NVRTC compiles one program at a time per process (two threads compiled 40 ResNet-8 units in
0.76 s, one in 0.74 s on the H200's 16-core host; ~20 ms a unit), so a step's modules are built
in worker processes as well: with 8 of them, ResNet-8's 57 units took 0.21-0.23 s instead of
1.1 s. Session 12 measured the workers making cold compiles slower (a worker takes ~0.8 s to
start and its first NVRTC call costs another ~0.5 s); session 17 measured them on a warm host and
kept them on by default (docs/benchmarks.md, "NVRTC in worker processes by default"). A worker
now makes its first NVRTC call (a tiny program) before it says it is ready, so that cost is
paid while the passes run: the workers are started before them (`Target.prepare_build`, for a
step planned afresh that reuses no other step's plans; a cached plan or a later batch size, whose
modules were built before or ahead, starts them only when its build finds enough missing), and
this process's threads take jobs until the workers are up.

With workers, the misses go to a queue that the threads and the workers drain together: the
threads start at once, each worker joins when its interpreter is up. A worker is `python -c` of
a short loop that imports only CuPy's NVRTC binding (never `__main__`, never CUDA), reads pickled
(source, options, name) frames on stdin and answers (cubin, log) frames on stdout. A worker that
dies or answers another NVRTC version is dropped and its job goes back to the queue; the threads
alone always finish the work.

``EMBER_NVRTC_WORKERS``: the worker count (default: `default_workers()`, half the cores this
process may use, at most 8, and none below 8 cores; 0 turns them off).
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import Callable

from ember.codegen import cpus

ENV_VAR = "EMBER_NVRTC_WORKERS"
LOCAL_THREADS = 2  # NVRTC's own lock: more in-process threads were slower
MIN_JOBS = 4       # fewer misses than this never start workers (the threads finish first)
#: Without EMBER_NVRTC_WORKERS, workers start only for a build of at least this many modules
#: (expected before the passes, `prestart(expected)`, or counted after them): starting 8 slowed
#: the MNIST CNN's 12 modules (cold 0.55 -> 0.76-0.82 s, a new batch 0.30 -> 0.46-0.50 s on the
#: H200's host) while ResNet-8's 57 and ViT's ~50 went faster (cold 2.1 -> 1.1 s, 1.5 -> 1.0 s).
MIN_DEFAULT_JOBS = 24

_WORKER = r'''
import os, pickle, struct, sys
try:
    os.sched_setaffinity(0, CPUS)
except (AttributeError, OSError, ValueError):
    pass
try:  # a helper: the compiling process's passes (and a training step's host work) go first
    os.nice(NICE)
except OSError:
    pass
from cupy_backends.cuda.libs import nvrtc
pipe_in, pipe_out = sys.stdin.buffer, sys.stdout.buffer
sys.stdout = sys.stderr  # nothing but frames on the pipe
def send(obj):
    data = pickle.dumps(obj, protocol=4)
    pipe_out.write(struct.pack("<Q", len(data)) + data)
    pipe_out.flush()
try:  # NVRTC's first call in a process loads its builtins (~0.5 s): paid before the first job
    _p = nvrtc.createProgram('extern "C" __global__ void ember_warm() {}', "warm.cu", (), ())
    nvrtc.compileProgram(_p, [])
    nvrtc.destroyProgram(_p)
except Exception:
    pass  # a real job reports what is wrong
send(("ready", tuple(nvrtc.getVersion())))
while True:
    head = pipe_in.read(8)
    if len(head) < 8:
        break
    source, options, name = pickle.loads(pipe_in.read(struct.unpack("<Q", head)[0]))
    program = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError:
            send((b"", nvrtc.getProgramLog(program)))
        else:
            send((nvrtc.getCUBIN(program), ""))
    finally:
        nvrtc.destroyProgram(program)
'''

Job = tuple[str, tuple[str, ...], str]  # source, options, program name
Result = tuple[bytes, str]               # cubin (empty on failure), NVRTC's log


NICE = 10  # the workers' niceness (see _WORKER)
MAX_DEFAULT_WORKERS = 8
MIN_CORES = 8  # fewer cores: no workers by default (they would take the cores the passes run on)


def default_workers(cores: int | None = None) -> int:
    """The worker count without ``EMBER_NVRTC_WORKERS``: half the cores, at most 8, none below 8
    cores (the compiling process keeps a core for its passes, the GPU's feeding for its own)."""
    if cores is None:
        cores = cpus.usable_cores()
    return min(MAX_DEFAULT_WORKERS, cores // 2) if cores >= MIN_CORES else 0


def workers_wanted() -> int:
    env = os.environ.get(ENV_VAR, "").strip()
    try:
        return max(0, int(env)) if env else default_workers()
    except ValueError:
        raise ValueError(f"${ENV_VAR} must be a whole number of worker processes, got {env!r}") from None


def _read_frame(stream) -> object:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("worker closed its pipe")
    size = struct.unpack("<Q", head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("worker closed its pipe mid-frame")
    return pickle.loads(data)


class _Worker:
    def __init__(self) -> None:
        # its first act: every CPU of this process, not the one core an OpenMP runtime may have
        # bound the thread starting it to (`cpus`), before it starts threads of its own
        source = _WORKER.replace("NICE", str(NICE)).replace("CPUS", repr(sorted(cpus.process_cpus())))
        self.proc = subprocess.Popen([sys.executable, "-c", source],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = threading.Event()
        self.dead = False
        self.version: tuple[int, int] | None = None
        threading.Thread(target=self._handshake, daemon=True).start()

    def _handshake(self) -> None:
        try:
            tag, version = _read_frame(self.proc.stdout)
            self.version = tuple(version) if tag == "ready" else None
        except Exception:
            self.dead = True
        self.ready.set()

    def compile(self, job: Job) -> Result:
        data = pickle.dumps(job, protocol=4)
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()
        image, log = _read_frame(self.proc.stdout)
        return bytes(image), str(log)

    def close(self) -> None:
        try:
            if self.ready.is_set():
                self.proc.stdin.close()  # the worker's loop ends at end of input
            else:  # still starting (no job of ours in it): a process that exits now need not wait for it
                self.proc.kill()
            self.proc.wait(timeout=0.1 if self.dead else 2)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    def __init__(self, size: int) -> None:
        self._workers = [_Worker() for _ in range(size)]
        self._lock = threading.Lock()

    def compile(self, jobs: list[Job], version: tuple[int, int], local: Callable[[Job], Result]) -> list[Result]:
        """Every job's result, in order: `local` (an in-process NVRTC call) on LOCAL_THREADS
        threads, and each live worker of NVRTC `version` once it is up."""
        with self._lock:
            todo: queue.Queue[int] = queue.Queue()
            for i in range(len(jobs)):
                todo.put(i)
            results: list[Result | None] = [None] * len(jobs)
            remaining = threading.Semaphore(0)

            def drain(compile_one: Callable[[Job], Result], worker: _Worker | None = None) -> None:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        results[i] = compile_one(jobs[i])
                    except Exception as exc:
                        if worker is None:  # this process's own NVRTC failed: the caller sees why
                            results[i] = exc
                        else:
                            # dead before its job goes back: once another consumer finishes that
                            # job this call may return, and must see the worker dead to drop it
                            worker.dead = True
                            todo.put(i)
                            return
                    remaining.release()

            def by_worker(worker: _Worker) -> None:
                while not worker.ready.wait(0.005):
                    if todo.empty():
                        return
                if worker.dead or worker.version != tuple(version):
                    worker.dead = True
                    return
                drain(worker.compile, worker)
                if worker.dead:
                    # its job went back to the queue, maybe after every other consumer found the
                    # queue empty and left: whoever puts a job back also drains, so none is stranded
                    drain_here()

            def drain_here() -> None:
                cpus.widen_this_thread()  # NVRTC on every core of the process (`cpus`)
                drain(local)

            threads = [threading.Thread(target=drain_here, daemon=True) for _ in range(LOCAL_THREADS)]
            threads += [threading.Thread(target=by_worker, args=(w,), daemon=True) for w in self._workers if not w.dead]
            for t in threads:
                t.start()
            for _ in jobs:
                remaining.acquire()
            for w in self._workers:
                if w.dead:
                    w.close()
            self._workers = [w for w in self._workers if not w.dead]
            for r in results:
                if isinstance(r, Exception):
                    raise r
            return results  # type: ignore[return-value]

    def close(self) -> None:
        for w in self._workers:
            w.close()
        self._workers = []


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


def _explicit() -> bool:
    return bool(os.environ.get(ENV_VAR, "").strip())


def prestart(expected_jobs: int | None = None) -> None:
    """Starts the workers (if any are wanted and none run yet), without waiting for them; by
    default only for a build expected to compile at least MIN_DEFAULT_JOBS modules."""
    global _pool
    if not _explicit() and expected_jobs is not None and expected_jobs < MIN_DEFAULT_JOBS:
        return
    with _pool_lock:
        if _pool is None and (n := workers_wanted()) > 0:
            _pool = WorkerPool(n)


def compile_all(jobs: list[Job], version: tuple[int, int], local: Callable[[Job], Result]) -> list[Result]:
    """Results of `jobs`: on the workers (started now, for MIN_JOBS or more with
    EMBER_NVRTC_WORKERS, MIN_DEFAULT_JOBS without, if `prestart` did not) and this process's
    threads; with no workers, on the threads alone."""
    if len(jobs) >= (MIN_JOBS if _explicit() else MIN_DEFAULT_JOBS):
        prestart()
    pool = _pool
    if pool is None:
        return _threads_only(jobs, local)
    return pool.compile(jobs, version, local)


def _threads_only(jobs: list[Job], local: Callable[[Job], Result]) -> list[Result]:
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(LOCAL_THREADS, len(jobs))),
                                               initializer=cpus.widen_this_thread) as pool:
        return list(pool.map(local, jobs))


@atexit.register
def _shutdown() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None
