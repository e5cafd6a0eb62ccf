"""`ember launch`: start the ranks of a data-parallel job (the torchrun contract).

    ember launch --nproc-per-node 2 -- ember mnist --device cpu ...
    ember launch --nproc-per-node 4 --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 -- CMD

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. On one
node the ranks form an MPI world (the launcher runs the `mpich` wheel's mpiexec; `--no-mpi`
starts plain processes). SIGINT/SIGTERM reach every rank; when one rank fails the others are
stopped and the command exits with that rank's code, naming it.
"""
from __future__ import annotations

import argparse
import sys

from ember.runtime import launch as _launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's host (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=29500, help="rank 0's port (default 29500)")
    p.add_argument("--no-mpi", action="store_true", help="start plain processes, not an MPI world")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command every rank runs")


def main(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        return _launch.launch(cmd, args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                              master_addr=args.master_addr, master_port=args.master_port,
                              mpi=False if args.no_mpi else None)
    except _launch.LaunchError as e:
        print(f"ember launch: error: {e}", file=sys.stderr)
        return e.code
