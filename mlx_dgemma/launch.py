"""Whether this process was started by ``mlx.launch`` (or mpirun), from the environment alone:
the command line asks on every run, before MLX is imported (``mlx-dgemma --version`` stays
instant), and silences ranks other than 0 before anything prints."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
    (prefixed ``[rank N]``). ``serve`` and ``chat`` run on rank 0, the other ranks follow it
    (``mlx_dgemma.lockstep``)."""
    if not launched():
        return
    rank = launched_rank()
    if rank:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorLines(sys.stderr, rank)


def need_terminal(command: str = "chat") -> None:
    """Refuse, in one line, to start a full-screen app without a terminal: Textual reads the keys
    from stdin and draws on stderr, so with either redirected (a script, cron, ``< /dev/null``)
    the app drew escape codes into a file and waited for keys that never came. Standard library
    only: the command line asks before Textual's and MLX's imports (they took 5-14 s before this
    answer). Under ``mlx.launch`` rank 0's keys arrive through the launcher's pipe
    (:func:`rank_terminal` checks that terminal)."""
    from .errors import ParameterError

    if launched():
        return
    for name, stream in (("standard input", sys.__stdin__), ("standard error", sys.__stderr__)):
        if stream is None or not stream.isatty():
            raise ParameterError(f"the {command} app needs a terminal and {name} is not one; run it in a terminal, "
                                 "or from a script use `mlx-dgemma generate --prompt TEXT` (or `serve`)")


# What leaves a full-screen app's terminal modes, written when rank 0's terminal is handed
# back (harmless when the app already did): mouse reports, bracketed paste, the kitty keyboard
# protocol and focus reports off; the cursor shown. Not the alternate screen's exit: the app
# leaves it itself, and a second one moves the cursor back over the lines printed since.
_TERMINAL_RESET = "\x1b[?1000l\x1b[?1003l\x1b[?1015l\x1b[?1006l\x1b[?2004l\x1b[<u\x1b[?1004l\x1b[?25h"


@contextmanager
def rank_terminal(command: str) -> Iterator[None]:
    """Rank 0's terminal for a full-screen app (``chat``) under ``mlx.launch`` on one machine.

    ``mlx.launch`` gives each rank pipes: its stdin carries what the launcher reads from its
    own terminal (to every rank), stdout and stderr are read back and printed. A rank started
    on the launcher's machine still has the launcher's controlling terminal, so rank 0 writes
    the app's screen straight to ``/dev/tty`` (stdout and stderr are pointed at it: Textual
    draws on stderr and asks stdout for the size) and puts that terminal in raw mode, while
    the keys keep arriving through stdin: the launcher stays the terminal's only reader (it
    reads its stdin whatever we do; two readers of one terminal would each lose keys).
    Everything is restored on the way out.

    A rank started over ssh (a hostfile: ``ssh -tt``, even to the launcher's own machine) has
    ssh's terminal, whose screen reaches the user only line by line through the launcher's
    pipes: refused in one line, as is a rank with no terminal at all.
    """
    import termios

    from .errors import ParameterError

    where = ("; run it on one machine from a terminal (`mlx.launch -n 2 --backend ring -- python -m mlx_dgemma "
             f"{command} ...`), or across Macs run `serve` under mlx.launch and chat with any OpenAI client "
             "(README: Several Macs)")
    if sys.stdin is None or sys.stdin.isatty():  # ssh -tt's terminal, not the user's
        raise ParameterError(f"{command} under mlx.launch needs rank 0 on the machine that runs mlx.launch; "
                             f"this rank was started over ssh{where}")
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError as e:
        raise ParameterError(f"{command} under mlx.launch: rank 0 has no terminal ({e.strerror}){where}") from None
    try:
        saved_modes = termios.tcgetattr(fd)
    except termios.error:
        os.close(fd)
        raise ParameterError(f"{command} under mlx.launch: /dev/tty is not a terminal{where}") from None
    raw = [list(x) if isinstance(x, list) else x for x in saved_modes]
    # as Textual's own driver sets its terminal (it leaves a piped stdin alone): no echo, no
    # line editing, no signals from keys (Ctrl+C reaches the app), no CR translation
    raw[3] &= ~(termios.ECHO | termios.ICANON | termios.IEXTEN | termios.ISIG)
    raw[0] &= ~(termios.IXON | termios.IXOFF | termios.ICRNL | termios.INLCR | termios.IGNCR)
    raw[6][termios.VMIN], raw[6][termios.VTIME] = 1, 0
    for f in (sys.stdout, sys.stderr):
        f.flush()
    saved_fds = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        termios.tcsetattr(fd, termios.TCSANOW, raw)
        yield
    finally:
        try:
            os.write(fd, _TERMINAL_RESET.encode())
            termios.tcsetattr(fd, termios.TCSADRAIN, saved_modes)
        except (OSError, termios.error):
            pass
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os.dup2(saved_fds[0], 1)
        os.dup2(saved_fds[1], 2)
        for d in (*saved_fds, fd):
            os.close(d)
