"""Paths as the user typed them: ``~`` and ``$VARS`` expanded, as a shell would.

A path reaches us unexpanded whenever no shell did the work: quoted on the command line
(``--model "~/models/dgemma"``), from an environment variable (``MLX_DGEMMA_MODEL``), or
from Python (``load("~/models/dgemma")``). Every entry point that accepts a path calls this.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_path(path: str | os.PathLike) -> Path:
    """``path`` with environment variables and a leading ``~`` expanded (nothing else changes)."""
    return Path(os.path.expanduser(os.path.expandvars(os.fspath(path))))
