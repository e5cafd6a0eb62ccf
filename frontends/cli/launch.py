"""`ember launch`: start the ranks of a data-parallel job (the torchrun contract).

    ember launch --nproc-per-node 2 -- ember mnist --device cpu ...
    ember launch --nproc-per-node 4 --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 -- CMD

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. On one
node the ranks form an MPI world (the launcher runs the `mpich` wheel's mpiexec; `--no-mpi`
starts plain processes). SIGINT/SIGTERM reach every rank, and what is left of the ranks
`--grace` seconds later is killed; when one rank fails or vanishes, or exits while the others
still run `--exit-grace` seconds later, the others are stopped and the command exits non-zero,
naming it.
"""
from __future__ import annotations

import argparse
import math
import sys

from ember.runtime import launch as _launch

from .cli_checks import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    # strings, checked in main: a bad value is one line there, not argparse's usage dump
    p.add_argument("--nproc-per-node", required=True, metavar="N",
                   help=f"ranks on this node (1..{_launch.MAX_NPROC_PER_NODE})")
    p.add_argument("--nnodes", default="1", metavar="M", help="nodes in the job (default 1)")
    p.add_argument("--node-rank", default="0", metavar="R", help="this node's index (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's host (default 127.0.0.1)")
    p.add_argument("--master-port", default="29500", metavar="PORT", help="rank 0's port, 1..65535 (default 29500)")
    p.add_argument("--no-mpi", action="store_true", help="start plain processes, not an MPI world")
    p.add_argument("--grace", default="5", metavar="SECONDS",
                   help="after SIGINT/SIGTERM or a failed rank, how long the ranks get to stop before they are "
                        "killed (default 5)")
    p.add_argument("--exit-grace", default="30", metavar="SECONDS",
                   help="how long the other ranks may still run after one rank exited 0 before the run is "
                        "taken for hung (they would wait for it in a collective) and stopped (default 30)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command every rank runs")


def _integer(flag: str, text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} {text}: expected {expected}") from None


def _seconds(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{flag} {text}: expected a number of seconds >= 0")
    return value


def main(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    nproc = _integer("--nproc-per-node", args.nproc_per_node, f"an integer in 1..{_launch.MAX_NPROC_PER_NODE}")
    nnodes = _integer("--nnodes", args.nnodes, "an integer >= 1")
    node_rank = _integer("--node-rank", args.node_rank, "an integer in 0..NNODES-1")
    port = _integer("--master-port", args.master_port, "a TCP port in 1..65535")
    grace, exit_grace = _seconds("--grace", args.grace), _seconds("--exit-grace", args.exit_grace)
    try:
        return _launch.launch(cmd, nproc, nnodes=nnodes, node_rank=node_rank, master_addr=args.master_addr,
                              master_port=port, mpi=False if args.no_mpi else None, grace=grace,
                              exit_grace=exit_grace)
    except _launch.LaunchError as e:
        print(f"ember launch: error: {e}", file=sys.stderr)
        return e.code
