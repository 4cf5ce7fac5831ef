#!/usr/bin/env bash
# The GPU benchmark run (MLX CUDA backend), as recorded in benchmarks/RESULTS.md.
# On the device machine, from the project root, after `bash ../shared/gpu/prepare.sh` here:
#   . .gpu/setup.sh && bash benchmarks/gpu.sh "$OUT" [extra bench args...]
# One process per measurement (mlx_dgemma.bench.isolate); MLX's CUDA JIT caches compiled kernels in
# MLX_PTX_CACHE_DIR, so only the first process pays for each kernel.
set -uo pipefail
OUT="${1:?output directory}"; shift
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}"
# kernels compiled by an earlier run (MLX 0.32.4, sm_90): each saves ~40 s of NVRTC at first use
for c in benchmarks/gpu/ptx-cache-*.tar.xz .gpu/ptx.tar.xz; do
  [ -f "$c" ] && mkdir -p "$MLX_PTX_CACHE_DIR" && tar -C "$MLX_PTX_CACHE_DIR" -xJf "$c"
done
mkdir -p "$OUT" "$MLX_PTX_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" >> "$OUT/gpu.txt" 2>&1
timeout "${BENCH_TIMEOUT:-540}" python3 -X faulthandler -m mlx_dgemma.cli bench --configs real-shapes \
  --workdir /tmp/bench-cache --json "$OUT/bench.json" "$@" > "$OUT/bench.txt" 2> "$OUT/bench.err"
echo "exit $?" >> "$OUT/bench.txt"
# the compiled kernels, to carry into a later run on a fresh machine (saves the JIT minutes)
tar -C "$MLX_PTX_CACHE_DIR" -cJf "$OUT/ptx.tar.xz" . 2>/dev/null || true
