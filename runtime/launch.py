"""The process launcher behind `ember launch`: N local ranks with the torchrun contract.

Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

How the ranks form an MPI world: processes started one by one (subprocess) become MPI singletons
that cannot join each other without a process manager, so with `mpi=True` (the default on one
node when `mpiexec` is found) the launcher starts ONE `mpiexec` (hydra, shipped by the `mpich`
wheel next to the Python executable) in MPMD form, `-n 1 -env RANK 0 ... CMD : -n 1 -env RANK 1
... CMD : ...`, which gives each rank its own variables. Each rank runs under `sh -c` that writes
the rank's exit code to a status folder, so the launcher can name the first rank that failed.
Without MPI (`mpi=False`, or several nodes: `--nnodes M --node-rank R`) the launcher starts the
ranks of its node itself (global rank = node_rank * nproc_per_node + local rank); the command
then forms its world by other means (MASTER_ADDR/PORT rendezvous, NCCL).

Supervision, either way: SIGINT/SIGTERM are forwarded to the children (mpiexec forwards them to
the ranks); when one rank exits non-zero, the others are terminated (SIGTERM, then SIGKILL after
`grace` seconds) and `launch` returns that rank's code with a one-line message naming it, well
within 30 s.
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
from pathlib import Path

# `sh -c` body: run the command, record its status under $EMBER_LAUNCH_STATUS/<rank>, pass it on.
# The trap (a command, not "ignore") keeps sh alive to record a signalled status, while the
# command itself gets the default dispositions back (ignored signals would stay ignored).
_RANK_SHELL = 'trap : INT TERM; "$@"; rc=$?; echo $rc > "$EMBER_LAUNCH_STATUS/$RANK.tmp" && ' \
              'mv "$EMBER_LAUNCH_STATUS/$RANK.tmp" "$EMBER_LAUNCH_STATUS/$RANK"; exit $rc'


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


def _describe(code: int) -> str:
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    if code > 128 and code - 128 in signal.Signals._value2member_map_:
        return f"exit code {code} (signal {signal.Signals(code - 128).name})"
    return f"exit code {code}"


def _signal(p: subprocess.Popen, signum: int, group: bool) -> None:
    """To the process, or to its whole process group (a plain rank: its `sh` and the command, which
    the trap in `sh` would otherwise shield; mpiexec forwards signals to its ranks itself)."""
    try:
        if group:
            os.killpg(p.pid, signum)
        elif p.poll() is None:
            p.send_signal(signum)
    except ProcessLookupError:
        pass


def _stop(procs: Sequence[subprocess.Popen], grace: float, group: bool) -> None:
    for p in procs:
        if p.poll() is None:
            _signal(p, signal.SIGTERM, group)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL, True)
            p.wait()


def launch(command: Sequence[str], nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int = 29500, mpi: bool | None = None,
           grace: float = 5.0, poll: float = 0.1) -> int:
    """Runs `command` as the ranks of this node; returns 0 when every rank succeeded, raises
    LaunchError (naming the first failed rank and its exit code) otherwise."""
    if not command:
        raise LaunchError("no command given: ember launch --nproc-per-node N -- COMMAND ...", 2)
    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(f"bad world: --nproc-per-node {nproc_per_node}, --nnodes {nnodes}, --node-rank {node_rank}", 2)
    world = nproc_per_node * nnodes
    mpiexec = find_mpiexec()
    if mpi is None:
        mpi = nnodes == 1 and mpiexec is not None and world > 1
    if mpi and nnodes > 1:
        raise LaunchError("MPI ranks over several nodes: run mpiexec with a host file (ember launch starts one node's MPI world)", 2)
    if mpi and mpiexec is None:
        raise LaunchError("no mpiexec found: pip install 'ember[mpi]' (the mpich wheel ships it)", 2)
    status = Path(tempfile.mkdtemp(prefix="ember-launch-"))
    base = dict(os.environ, EMBER_LAUNCH_STATUS=str(status))
    for k in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT"):  # never inherit an outer MPI world
        base.pop(k, None)
    ranks = [node_rank * nproc_per_node + i for i in range(nproc_per_node)]
    wrap = ["sh", "-c", _RANK_SHELL, "ember-rank", *command]
    if mpi:
        argv = [mpiexec]
        for i, r in enumerate(ranks):
            if i:
                argv.append(":")
            argv += ["-n", "1"]
            for k, v in rank_env({}, r, i, world, nproc_per_node, master_addr, master_port).items():
                argv += ["-env", k, v]
            argv += wrap
        procs = [subprocess.Popen(argv, env=base, start_new_session=True)]
    else:
        procs = [subprocess.Popen(wrap, env=rank_env(base, r, i, world, nproc_per_node, master_addr, master_port),
                                  start_new_session=True) for i, r in enumerate(ranks)]

    received: list[int] = []

    def forward(signum, frame):  # noqa: ARG001
        received.append(signum)
        for p in procs:
            _signal(p, signum, not mpi)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            failed = sorted((int(f.read_text().strip() or 1), int(f.name), f.stat().st_mtime)
                            for f in status.iterdir() if not f.name.endswith(".tmp")
                            and f.read_text().strip() not in ("", "0"))
            codes = [p.poll() for p in procs]
            if failed or (not mpi and any(c not in (None, 0) for c in codes)):
                if failed:
                    code, rank, _ = min(failed, key=lambda t: t[2])
                else:
                    i = next(i for i, c in enumerate(codes) if c not in (None, 0))
                    code, rank = codes[i], ranks[i]
                _stop(procs, grace, not mpi)
                why = f"interrupted by {signal.Signals(received[0]).name}: " if received else ""
                raise LaunchError(f"{why}rank {rank} failed ({_describe(code)}); stopped the other ranks",
                                  code if 0 < code < 256 else 1)
            if all(c is not None for c in codes):
                if any(codes):
                    if received:
                        raise LaunchError(f"interrupted by signal {signal.Signals(received[0]).name}",
                                          128 + received[0])
                    raise LaunchError(f"mpiexec failed ({_describe(codes[0])}) before any rank reported", codes[0] or 1)
                return 0
            time.sleep(poll)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs, grace, not mpi)
        shutil.rmtree(status, ignore_errors=True)
