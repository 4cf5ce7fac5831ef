"""Peak memory of converting a multi-GB GGUF: writes a random DiffusionGemma GGUF with the
published layer shapes (Q4_K_M mix, N layers), converts it in a child process and reports the
child's peak RSS against the input and output sizes.

    python3 benchmarks/convert_memory.py --layers 3 --workdir /tmp/convmem
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mlx_dgemma.bench import CONFIGS
from mlx_dgemma.convert.synthetic import TinySpec, write_tiny_gguf


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--workdir", default=".convert-memory")
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = dict(CONFIGS["real-shapes"], num_layers=a.layers, global_layers=(a.layers - 1,))
    gguf = work / f"real-shapes-{a.layers}L.gguf"
    if not gguf.is_file():
        write_tiny_gguf(gguf, TinySpec(**spec), types="q4_k_m", seed=0, weight_std=0.02)
    out = work / "converted"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mlx_dgemma", "convert", str(gguf), str(out)], check=True)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    size_in = gguf.stat().st_size
    size_out = sum(f.stat().st_size for f in out.iterdir())
    res = {"layers": a.layers, "input_bytes": size_in, "output_bytes": size_out, "peak_rss_bytes": peak,
           "seconds": seconds, "peak_over_input": peak / size_in}
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
