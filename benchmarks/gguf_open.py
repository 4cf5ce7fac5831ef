"""Opening the published GGUF's header: gguf-py's reader against the converter's own.

    python benchmarks/gguf_open.py [--reps 3] [--json results/gguf-open-cpu.json]

Writes the published model's metadata (``../shared/reference``'s header: every key, the
262,144-token vocabulary, scores and token types at their published lengths) with its tiny
tensors only (norms, scales, rope factors; ~1 MB), then times, in fresh child processes taking
turns: gguf-py's ``GGUFReader`` (what ``open_gguf`` used) plus the metadata and tokenizer
values read through it; and ``open_gguf`` (the pre-scan's walk, values decoded from the file)
plus the same values. Both do the bounded pre-scan first. Peak RSS from ``getrusage``.
Every command that takes a .gguf (chat, generate, serve, plan, convert, verify, doctor) pays
this once per start, before a weight is read.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import full_size as fs  # noqa: E402

_CHILD = {
    "gguf-py reader": """
import resource, sys, time
import numpy as np
from gguf import GGUFReader, GGUFValueType
from mlx_dgemma.convert.scan import scan_gguf
def field_value(f, full):  # the converter's reading through gguf-py (main before convert/header.py)
    if f.types[0] == GGUFValueType.ARRAY:
        if not full and len(f.data) > 4096:
            return f"<array of {len(f.data)}>"
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
        return np.concatenate([f.parts[i] for i in f.data]).tolist() if f.data else []
    return f.contents()
t = time.perf_counter()
scan_gguf(sys.argv[1], None)
r = GGUFReader(sys.argv[1])
md = {k: field_value(f, False) for k, f in r.fields.items() if not k.startswith("GGUF.")}
tok = {k: field_value(f, k in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                              "tokenizer.ggml.merges"))
       for k, f in r.fields.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""",
    "ours (open_gguf)": """
import resource, sys, time
from mlx_dgemma.convert.source import open_gguf, tokenizer_payload
from mlx_dgemma.convert.metadata import read_metadata
t = time.perf_counter()
h = open_gguf(sys.argv[1], architecture=None)
md, tok = read_metadata(h), tokenizer_payload(h)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    header = fs.load_header()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "published-header.gguf"

        def tiny(name: str) -> bool:
            ne = next(t["ne"] for t in header["tensors"] if t["name"] == name)
            return int(fs.np.prod(ne)) <= 4096

        fs.write_inventory_gguf(path, header, select=tiny, seed=0)
        runs: dict[str, list[tuple[float, int]]] = {k: [] for k in _CHILD}
        for _ in range(a.reps):
            for name, code in _CHILD.items():
                out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                                     check=True).stdout.split()
                runs[name].append((float(out[0]), int(out[1])))
        size = path.stat().st_size
    rows = {k: {"seconds": sorted(s for s, _ in v)[len(v) // 2], "runs_s": [s for s, _ in v],
                "peak_rss_mb": max(r for _, r in v) / 1024} for k, v in runs.items()}
    base = rows["gguf-py reader"]["seconds"]
    print(f"published header ({size / 1e6:.1f} MB file, {fs.vocab_size(header)} tokens), median of {a.reps}, "
          f"{platform.machine()} {platform.system()}")
    print(f"{'reader':<18}{'median s':>10}{'peak RSS MB':>13}{'speed-up':>10}")
    for k, r in rows.items():
        print(f"{k:<18}{r['seconds']:>10.2f}{r['peak_rss_mb']:>13.0f}{base / r['seconds']:>9.1f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"machine": {"platform": platform.platform(), "python": platform.python_version()},
                                      "file_bytes": size, "rows": rows,
                                      "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
