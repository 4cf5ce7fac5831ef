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
