"""fast vs exact runtime precision: how far apart, on the same weights and inputs.

For each model and each fast activation dtype: max relative logit error and top-1 agreement of
one decoder step (without and with self-conditioning), and over whole generations with the same
seeds, how many committed blocks are identical. Models: the trained demo (Q8_0; the yardstick
whose answers mean something) and the random tiny/medium bench models (Q4_K_M mix with a Q6_K
embedding, which fast re-quantizes). Prints a table and writes JSON.

    python benchmarks/precision_quality.py [--models demo,tiny] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mlx_dgemma import load
from mlx_dgemma.bench import block_agreement, build, logit_agreement
from mlx_dgemma.demo import demo_file


def model_path(name: str, workdir: Path) -> Path:
    return demo_file("trained") if name == "demo" else build(name, workdir, None)[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="demo,tiny", help="comma-separated: demo, tiny, medium")
    p.add_argument("--dtypes", default="float32,bfloat16", help="fast activation dtypes to compare with exact")
    p.add_argument("--prompts", type=int, default=5, help="generations per model and dtype")
    p.add_argument("--steps", type=int, default=48, help="max denoising steps per block in the generations")
    p.add_argument("--workdir", default=".bench-cache")
    p.add_argument("--json", default="precision-quality.json")
    args = p.parse_args()
    rows = []
    for name in args.models.split(","):
        path = model_path(name, Path(args.workdir))
        exact = load(path, precision="exact")
        for dt in args.dtypes.split(","):
            t0 = time.perf_counter()
            fast = load(path, precision="fast", dtype=dt)
            row = {"model": name, "fast": fast.precision.label,
                   **logit_agreement(exact.model, fast.model, prompt_len=64),
                   **block_agreement(exact, fast, prompts=args.prompts, gen_steps=args.steps)}
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(f"[quality] {name} {row['fast']}: done in {row['seconds']:.0f} s", file=sys.stderr)
    print(f"{'model':<8} {'fast':<18} {'max rel err':>12} {'(SC step)':>10} {'top-1':>7} {'(SC)':>7} {'same blocks':>12} "
          f"{'same tokens':>11}")
    for r in rows:
        print(f"{r['model']:<8} {r['fast']:<18} {r['step_max_rel_logit_error']:>12.2e} "
              f"{r['sc_step_max_rel_logit_error']:>10.2e} {r['step_top1_agreement']:>7.1%} "
              f"{r['sc_step_top1_agreement']:>7.1%} {r['blocks_identical']:>5}/{r['blocks_compared']:<6} "
              f"{r['token_agreement']:>11.1%}")
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
