"""The process launcher behind `ember launch`: N local ranks with the torchrun contract.

Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

How the ranks form an MPI world: processes started one by one (subprocess) become MPI singletons
that cannot join each other without a process manager, so with `mpi=True` (the default on one
node when `mpiexec` is found) the launcher starts ONE `mpiexec -n N` (hydra, shipped by the
`mpich` wheel next to the Python executable); each rank's wrapper takes RANK from hydra's
PMI_RANK. Without MPI (`mpi=False`, or several nodes: `--nnodes M --node-rank R`) the launcher
starts the ranks of its node itself (global rank = node_rank * nproc_per_node + local rank); the
command then forms its world by other means (MASTER_ADDR/PORT rendezvous, NCCL).

Every rank runs under a wrapper (`launch_rank.py`) that puts the rank's command in a process
group of its own, kills it if the wrapper dies, and records the group and the exit status in a
temporary status folder (removed on every way out). Supervision, from those records:

- a rank that exits non-zero, or vanishes (its wrapper gone without a status), fails the run at
  once; a rank that exits 0 while others still run fails it when they have not finished
  `exit_grace` seconds later (a rank that leaves early leaves the others waiting for it in a
  collective, forever). Either way the other ranks are stopped and `launch` raises LaunchError
  naming the rank;
- SIGINT/SIGTERM reach every rank's group exactly once (not through mpiexec, which would deliver
  them a second time); whatever state the ranks are in, `grace` seconds later what is left of
  them is killed;
- stopping is SIGTERM to every rank's group, then SIGKILL after `grace` seconds to the groups and
  to every process that still carries the status folder in its environment (mpiexec, its proxies,
  wrappers, and ranks that left their group).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: more ranks than this on one node is taken for a typo: each rank is a whole process with its
#: own compiled step and copy of the data, and no node has cores for more
MAX_NPROC_PER_NODE = 1024

_WRAPPER = Path(__file__).with_name("launch_rank.py")
_PROC = Path("/proc")
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A rank failed or the ranks could not be started; `code` is the exit status to use."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def find_mpiexec() -> str | None:
    """The mpiexec of the `mpich` wheel (installed next to this Python), else one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def rank_env(base: dict[str, str], rank: int, local_rank: int, world_size: int, local_world_size: int,
             master_addr: str, master_port: int) -> dict[str, str]:
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(local_world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    return env


def check_world(nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, master_port: int = 29500) -> None:
    """Raises LaunchError (code 2) naming the first argument out of its range."""
    if not 1 <= nproc_per_node <= MAX_NPROC_PER_NODE:
        raise LaunchError(f"--nproc-per-node {nproc_per_node}: expected 1..{MAX_NPROC_PER_NODE} ranks on this node", 2)
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes}: expected an integer >= 1", 2)
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank}: expected 0..{nnodes - 1} (--nnodes {nnodes})", 2)
    if not 1 <= master_port <= 65535:
        raise LaunchError(f"--master-port {master_port}: expected a TCP port in 1..65535", 2)


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"exit code {code} (signal {signal.Signals(code - 128).name})"
    return f"exit code {code}"


def _ranks(rs: Sequence[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


# ---- processes, as /proc shows them (zombies count as gone: nobody may reap an orphan) ----------

def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, pgrp, ...), None when gone or a zombie."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()
    return None if rest[0] in "ZXx" else rest


def _alive(pid: int, start: str | None) -> bool:
    """Whether `pid` still runs and is the process first seen with start time `start`."""
    if not _PROC.is_dir():
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    rest = _stat(pid)
    return rest is not None and (start is None or rest[19] == start)


def _start_time(pid: int) -> str | None:
    rest = _stat(pid)
    return rest[19] if rest is not None else None


def _live_groups(groups: set[int]) -> set[int]:
    """Those of `groups` with a process that is not a zombie."""
    if not groups:
        return set()
    if not _PROC.is_dir():
        live = set()
        for g in groups:
            try:
                os.killpg(g, 0)
                live.add(g)
            except (ProcessLookupError, PermissionError):
                pass
        return live
    live = set()
    for d in _PROC.iterdir():
        if d.name.isdigit():
            rest = _stat(int(d.name))
            if rest is not None and int(rest[2]) in groups:
                live.add(int(rest[2]))
    return live


def _marked(marker: bytes) -> list[int]:
    """Processes (not zombies) whose environment holds `marker`: every process of this launch."""
    found = []
    if not _PROC.is_dir():
        return found
    for d in _PROC.iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                env = (d / "environ").read_bytes()
            except OSError:
                continue
            if marker in env.split(b"\0") and _stat(int(d.name)) is not None:
                found.append(int(d.name))
    return found


def _kill(pid: int, signum: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_launcher() -> None:
    """In a child before exec: the kernel kills it when the launcher dies (even by SIGKILL), so
    mpiexec or a rank's wrapper is never left behind; their ranks die with them in turn."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


# ---- the ranks, as their status folder records them ----------------------------------------------

@dataclass
class _Rank:
    rank: int
    wrapper: int | None = None   # pid of its launch_rank.py
    start: str | None = None     # the wrapper's start time, so a reused pid is not taken for it
    group: int | None = None     # its command's process group
    status: int | None = None    # exit status, once reported
    ended: float = 0.0           # when it reported (wall clock), or was found vanished
    order: int = 0               # ties of `ended`: the order its end was seen in
    vanished: bool = False
    sent: int = 0                # how many of the received signals it was sent
    pidfd: int | None = None


class _Watch:
    """Reads what the wrappers record, and sees each wrapper end. A wrapper is watched through a
    pidfd where the system has them: epoll hands back ends in the order they happened, which
    names the rank that died first even when mpiexec kills the others a millisecond later (it
    does, with SIGKILL). Elsewhere its liveness is read from /proc every poll."""

    def __init__(self, ranks: list[_Rank], folder: Path) -> None:
        import selectors
        self.ranks, self.folder, self.seen = ranks, folder, 0
        self.selector = selectors.DefaultSelector()

    def watch(self, r: _Rank, pid: int) -> None:
        r.wrapper, r.start = pid, _start_time(pid)
        try:
            r.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfds (or already gone): /proc says
            return
        self.selector.register(r.pidfd, 1, r)  # 1: EVENT_READ, readable once the process ended

    def _ended(self, r: _Rank) -> None:
        """Its wrapper is gone: it wrote its status before it exited, or it never will."""
        if r.pidfd is not None:
            self.selector.unregister(r.pidfd)
            os.close(r.pidfd)
            r.pidfd = None
        f = self.folder / f"{r.rank}.status"
        self.seen += 1
        try:
            r.status, r.ended = int(f.read_text().strip() or "1"), f.stat().st_mtime
        except (OSError, ValueError):
            r.vanished, r.ended, r.order = True, time.time(), self.seen

    def refresh(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for a wrapper to end, then reads every record."""
        if self.selector.get_map():
            events = self.selector.select(timeout)
        else:
            events = []
            time.sleep(timeout)
        for key, _ in events:
            self._ended(key.data)
        for r in self.ranks:
            if r.status is not None or r.vanished:
                continue
            if r.group is None:
                try:
                    pid, group = (int(v) for v in (self.folder / f"{r.rank}.pid").read_text().split())
                except (OSError, ValueError):
                    pid = group = None
                if group is not None:
                    r.group = group
                    if r.wrapper is None:
                        self.watch(r, pid)
            # liveness before status: a wrapper writes its status and then exits, so one gone
            # before its status was looked for, and still without one, never wrote it
            gone = r.wrapper is not None and r.pidfd is None and not _alive(r.wrapper, r.start)
            f = self.folder / f"{r.rank}.status"
            if gone or f.exists():
                self._ended(r)

    def close(self) -> None:
        for r in self.ranks:
            if r.pidfd is not None:
                os.close(r.pidfd)
                r.pidfd = None
        self.selector.close()


def _failure(ranks: list[_Rank], exit_grace: float) -> tuple[str, int] | None:
    """The first rank to fail (message, exit code), or None: a non-zero status, a vanished rank,
    or a rank that exited 0 while others still ran, once they have not finished `exit_grace`
    seconds later, or have since been killed or vanished (mpiexec kills the others when a rank
    leaves without MPI_Finalize: the rank that left is the news, not them)."""
    def when(r: _Rank) -> tuple[float, int]:
        return r.ended, r.order

    events = [r for r in ranks if r.vanished or r.status not in (None, 0)]
    zero = [r for r in ranks if r.status == 0]
    timed_out = False
    if zero:
        first = min(zero, key=when)
        later = [r.rank for r in ranks if r.status is None and not r.vanished
                 or (r.vanished or r.status) and when(r) > when(first)]
        timed_out = bool(later) and time.time() - first.ended > exit_grace
        killed = bool(events) and all(r.vanished or r.status > 128 for r in events)
        if later and (timed_out or killed):
            events.append(first)
    if not events:
        return None
    r = min(events, key=when)
    if r.vanished:
        return (f"rank {r.rank} vanished: its process is gone and it reported no exit status (its wrapper was "
                f"killed?); stopped the other ranks", 1)
    if r.status == 0:
        waited = f", and had not finished {exit_grace:g} s later" if timed_out else ""
        return (f"rank {r.rank} exited with code 0 while {_ranks(later)} still ran{waited} (a rank that leaves early "
                f"leaves the others waiting for it in a collective); stopped the other ranks", 1)
    code = r.status
    return f"rank {r.rank} failed ({_describe(code)}); stopped the other ranks", code if 0 < code < 256 else 1


def _stop(ranks: list[_Rank], procs: Sequence[subprocess.Popen], marker: bytes, grace: float, poll: float) -> None:
    """SIGTERM to every rank's group; after `grace` seconds SIGKILL to what is left of them and to
    every process of this launch (mpiexec included)."""
    groups = {r.group for r in ranks if r.group is not None}
    for g in _live_groups(groups):
        _kill(g, signal.SIGTERM, group=True)
    for p in procs:  # reaches the ranks not started yet (a rank may see SIGTERM twice: harmless)
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) and not _live_groups(groups):
            break
        time.sleep(poll)
    for g in _live_groups(groups):
        _kill(g, signal.SIGKILL, group=True)
    for pid in _marked(marker):
        _kill(pid, signal.SIGKILL)
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def launch(command: Sequence[str], nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int = 29500, mpi: bool | None = None,
           grace: float = 5.0, exit_grace: float = 30.0, poll: float = 0.1) -> int:
    """Runs `command` as the ranks of this node; returns 0 when every rank succeeded, raises
    LaunchError (naming the first failed rank and its exit code) otherwise."""
    if not command:
        raise LaunchError("no command given: ember launch --nproc-per-node N -- COMMAND ...", 2)
    check_world(nproc_per_node, nnodes, node_rank, master_port)
    world = nproc_per_node * nnodes
    mpiexec = find_mpiexec()
    if mpi is None:
        mpi = nnodes == 1 and mpiexec is not None and world > 1
    if mpi and nnodes > 1:
        raise LaunchError("MPI ranks over several nodes: run mpiexec with a host file (ember launch starts one node's MPI world)", 2)
    if mpi and mpiexec is None:
        raise LaunchError("no mpiexec found: pip install 'ember[mpi]' (the mpich wheel ships it)", 2)
    if mpi:
        import importlib.util
        if importlib.util.find_spec("mpi4py") is None:
            raise LaunchError("the ranks form an MPI world through mpi4py, which is not installed: "
                              "pip install 'ember[mpi]' (or --no-mpi to start plain processes)", 2)

    received: list[int] = []

    def on_signal(signum, frame):  # noqa: ARG001 (acted on in the loop below)
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    folder: Path | None = None
    procs: list[subprocess.Popen] = []
    ranks = [_Rank(node_rank * nproc_per_node + i) for i in range(nproc_per_node)]
    marker = b""
    watch: _Watch | None = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="ember-launch-"))
        watch = _Watch(ranks, folder)
        marker = f"EMBER_LAUNCH_STATUS={folder}".encode()
        base = dict(os.environ, EMBER_LAUNCH_STATUS=str(folder))
        for k in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "RANK", "LOCAL_RANK"):  # never inherited
            base.pop(k, None)
        wrap = [sys.executable, "-I", "-S", str(_WRAPPER), *command]
        try:
            if mpi:
                env = rank_env(base, 0, 0, world, nproc_per_node, master_addr, master_port)
                del env["RANK"], env["LOCAL_RANK"]  # each wrapper takes its own from PMI_RANK
                procs.append(subprocess.Popen([mpiexec, "-n", str(nproc_per_node), *wrap],
                                              env=env, start_new_session=True, preexec_fn=_die_with_launcher))
            else:
                for i, r in enumerate(ranks):
                    procs.append(subprocess.Popen(wrap, env=rank_env(base, r.rank, i, world, nproc_per_node,
                                                                     master_addr, master_port),
                                                  start_new_session=True, preexec_fn=_die_with_launcher))
                    watch.watch(r, procs[-1].pid)
        except OSError as e:
            raise LaunchError(f"could not start the ranks ({mpiexec if mpi else sys.executable}): "
                              f"{e.strerror or e}", 1) from None
        return _supervise(watch, procs, marker, mpi, received, grace, exit_grace, poll)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if any(p.poll() is None for p in procs) or (folder is not None and _marked(marker)):
            _stop(ranks, procs, marker, grace, poll)
        if watch is not None:
            watch.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _supervise(watch: _Watch, procs: list[subprocess.Popen], marker: bytes, mpi: bool, received: list[int],
               grace: float, exit_grace: float, poll: float) -> int:
    ranks = watch.ranks
    interrupted = finished = None  # monotonic times: the first signal; every rank reported 0
    watch.refresh(0.0)
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        if received:
            interrupted = interrupted or now
            for r in ranks:  # every signal reaches every rank's group once, however late it started
                if r.group is not None and r.sent < len(received):
                    for s in received[r.sent:]:
                        _kill(r.group, s, group=True)
                    r.sent = len(received)
            done = all(r.status is not None or r.vanished for r in ranks) or all(c is not None for c in codes)
            if done or now - interrupted > grace:
                late = [r.rank for r in ranks if r.status is None and not r.vanished]
                _stop(ranks, procs, marker, grace=0.0 if not done else grace, poll=poll)
                name = signal.Signals(received[0]).name
                raise LaunchError(f"interrupted by {name}; stopped every rank"
                                  + (f" ({_ranks(late)} killed after the {grace:g} s grace)" if late and not done
                                     else ""), 128 + received[0])
        elif (fail := _failure(ranks, exit_grace)) is not None:
            _stop(ranks, procs, marker, grace, poll)
            raise LaunchError(*fail)
        elif all(r.status == 0 for r in ranks):
            if all(c is not None for c in codes):
                if mpi and codes[0]:
                    raise LaunchError(f"mpiexec failed ({_describe(codes[0])}) after every rank exited 0", codes[0])
                return 0
            finished = finished or now
            if now - finished > grace:  # every rank is done; a launcher process hanging on is not a failure
                _stop(ranks, procs, marker, grace, poll)
                return 0
        elif all(c is not None for c in codes):  # mpiexec (or every wrapper) ended without every rank reporting
            watch.refresh(poll)  # a wrapper's end seen after mpiexec's
            if _failure(ranks, exit_grace) is None:
                missing = [r.rank for r in ranks if r.status is None]
                how = f"mpiexec ended ({_describe(codes[0])})" if mpi else "their wrappers ended"
                raise LaunchError(f"{_ranks(missing)} never reported an exit status: {how} before "
                                  f"{'it' if len(missing) == 1 else 'they'} did", (codes[0] or 1) if mpi else 1)
            continue
        watch.refresh(poll)
