"""The repository's scripts (benchmarks/, scripts/) as modules, for tests of their functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """``relative`` (e.g. ``"benchmarks/full_size.py"``) imported as a module of its own name;
    these folders are not packages, and a test must not depend on the current directory."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
