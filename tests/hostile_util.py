"""Shared helpers of the hostile-input tests: byte-level GGUF edits and the promise checker."""

from __future__ import annotations

import struct
from pathlib import Path

from mlx_dgemma.cli import main

_VALUE_TYPES = {"uint32": 4, "float32": 6, "bool": 7, "string": 8}


def tensor_fields(data: bytes, name: str) -> tuple[int, int]:
    """(position of the ggml type field, position of the offset field) of tensor ``name``."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.rindex(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, i)
    t = i + 4 + 8 * n_dims
    return t, t + 4


def kv_value_pos(data: bytes, key: str) -> tuple[int, int]:
    """(position of the value type field, position of the value) of metadata ``key``."""
    k = struct.pack("<Q", len(key)) + key.encode()
    i = data.index(k) + len(k)
    return i, i + 4


def promise(argv: list[str], capsys, work: Path, keep: set[str]) -> tuple[int, str]:
    """Run the CLI in-process; assert the promise: success, or a non-zero exit with one line of
    stderr and no traceback; nothing but ``keep`` left in ``work``. Returns (code, line)."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines()
             if ln.strip() and not ln.startswith(("converting", "loading", "verifying", "[prefill]", "[done]", "\r"))]
    if code != 0:
        assert len(lines) == 1, err
        left = sorted(p.name for p in work.iterdir() if p.name not in keep)
        assert left == [], f"left behind: {left}"
    return code, lines[0] if lines else ""
