"""Whether this process was started by ``mlx.launch`` (or mpirun), from the environment alone:
the command line asks on every run, before MLX is imported (``mlx-dgemma --version`` stays
instant), and silences ranks other than 0 before anything prints."""

from __future__ import annotations

import os
import sys
from typing import Any

# what mlx.launch (ring, JACCL) and mpirun set in each rank's environment
LAUNCH_ENV = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_RANK")


def launched() -> bool:
    """True when a launcher started this process as one rank of several (maybe)."""
    return any(k in os.environ for k in LAUNCH_ENV)


def launched_rank() -> int:
    """This process's rank as ``mlx.launch`` (or mpirun) set it, without starting the group: the
    command line silences ranks other than 0 before anything prints."""
    for k in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


class _ErrorLines:
    """A rank's stderr that passes only the command's one-line errors, prefixed with the rank."""

    def __init__(self, out: Any, rank: int):
        self.out, self.rank, self.buf = out, rank, ""

    def write(self, text: str) -> int:
        self.buf += text
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            if ": error: " in line:
                self.out.write(f"[rank {self.rank}] {line}\n")
                self.out.flush()
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return False


def quiet_other_ranks() -> None:
    """The command line under ``mlx.launch``: ranks other than 0 print nothing but their errors
    (prefixed ``[rank N]``). (``chat``, which runs in one process, is refused by the command
    line through ``mlx_dgemma.distributed.refuse_ranks``; ``serve`` runs on rank 0, the other
    ranks follow it: ``mlx_dgemma.lockstep``.)"""
    if not launched():
        return
    rank = launched_rank()
    if rank:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorLines(sys.stderr, rank)
