"""The process's resident memory, without MLX: the converter reports its peak and must not pay
for importing MLX (~0.25 GB resident) to do so. ``mlx_dgemma.memory`` re-exports both."""

from __future__ import annotations

import os


def peak_rss_bytes() -> int:
    """The process's peak resident memory (getrusage)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


def current_rss_bytes() -> int:
    """Resident memory now (Linux /proc); the peak elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()
