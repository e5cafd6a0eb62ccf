"""The wrapper `ember launch` runs every rank under: `python -I -S launch_rank.py COMMAND...`.

It is run as a script and imports only the standard library, so it starts in milliseconds and
never imports ember (nor anything a rank's environment could shadow). For its rank it:

- sets RANK and LOCAL_RANK from hydra's PMI_RANK when the launcher left them to it (under
  `mpiexec -n N` every rank gets the same command line, whatever N is);
- starts the command in a process group of its own, so that the launcher can signal the rank and
  everything the rank started as one group, even once this wrapper is gone;
- has the kernel kill the command when this wrapper dies (PR_SET_PDEATHSIG), so a rank cannot
  outlive its wrapper holding its MPI connection open (which kept `mpiexec` waiting forever);
- passes SIGINT/SIGTERM that reach the wrapper (mpiexec forwards them) on to that group;
- records `<wrapper pid> <group id>` in $EMBER_LAUNCH_STATUS/<rank>.pid once the command runs,
  and its exit status (128 + N for signal N, as a shell says it) in <rank>.status when it ends,
  both atomically, then exits with that status. A rank whose wrapper is gone without a status
  file vanished: the launcher takes that as a failure.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv: list[str]) -> int:
    env = os.environ
    if "RANK" not in env and "PMI_RANK" in env:
        env["RANK"] = env["LOCAL_RANK"] = env["PMI_RANK"]
    folder, rank = env["EMBER_LAUNCH_STATUS"], env["RANK"]
    wrapper = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the launcher's group kill still reaches the rank
        prctl = None

    def in_child() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != wrapper:  # the wrapper died before the line above took effect
                os._exit(128 + signal.SIGKILL)

    child: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:  # noqa: ARG001
        if not child:
            pending.append(signum)  # arrived before the command started: passed on once it has
            return
        try:
            os.killpg(child[0].pid, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, forward)
    try:
        # close_fds=False: the command inherits hydra's PMI socket (PMI_FD), how its MPI joins the world
        child.append(subprocess.Popen(argv, preexec_fn=in_child, close_fds=False))
    except OSError as e:
        print(f"ember launch: rank {rank}: cannot run {argv[0] if argv else 'an empty command'}: "
              f"{e.strerror or e}", file=sys.stderr, flush=True)
        code = 127
    else:
        _write(os.path.join(folder, f"{rank}.pid"), f"{wrapper} {child[0].pid}\n")
        for s in pending:
            forward(s, None)
        rc = child[0].wait()
        code = rc if rc >= 0 else 128 - rc
    _write(os.path.join(folder, f"{rank}.status"), f"{code}\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
