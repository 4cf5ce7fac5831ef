"""The process's resident memory, without MLX: the converter reports its peak and must not pay
for importing MLX (~0.25 GB resident) to do so. ``mlx_dgemma.memory`` re-exports both."""

from __future__ import annotations

import os


def peak_rss_bytes() -> int:
    """The process's peak resident memory (getrusage), never below the resident memory now:
    Linux updates the two counters at different times, and a peak a little below the current
    figure (seen: 414.67 vs 414.92 MB) would read as nonsense."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux
    return max(peak, _statm_rss() or 0)


def _statm_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc); the peak elsewhere."""
    now = _statm_rss()
    return now if now is not None else peak_rss_bytes()


def process_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now (another process: a server under load), or 0
    where it cannot be read: Linux's ``/proc/PID/status``, else ``ps -o rss=`` (POSIX; macOS)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except (OSError, ValueError, IndexError):
        pass
    import subprocess

    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=10)
        return int(out.stdout.split()[0]) * 1024 if out.returncode == 0 and out.stdout.split() else 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def physical_ram_bytes() -> int:
    """The machine's RAM (POSIX sysconf: Linux and macOS), or 0 where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
