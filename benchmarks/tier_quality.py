"""Every precision against exact on the trained demo model: top-1 agreement of one decoder step
(plain and self-conditioned) overall and at the positions where exact is confident (p >= 0.5),
max relative logit error, and whole answers with the same seeds. Prints a table and writes JSON.

    python benchmarks/tier_quality.py [--prompts 3] [--steps 24]

Models: the demo as shipped (Q8_0 only: fast changes nothing there) and its K-quant copy
(``demo-kq``: the same trained weights re-quantized under llama.cpp's Q4_K_M type rule by
``mlx_dgemma.convert.kquant``), where fast re-quantizes the Q6_K head and the tiers start from
Q4_K. The yardstick row compares that K-quant copy with the Q8_0 original: the difference a
Q4_K_M file itself makes, which llama.cpp users accept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_dgemma import load
from mlx_dgemma.bench import block_agreement
from mlx_dgemma.bench.studies import confident_agreement as step_agreement
from mlx_dgemma.convert.kquant import write_kquant_copy
from mlx_dgemma.demo import demo_file

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", default="tier-quality.json")
    ap.add_argument("--workdir", default=".bench-cache")
    a = ap.parse_args()
    kq = Path(a.workdir) / "demo-q4_k_m.gguf"
    if not kq.is_file():
        kq.parent.mkdir(parents=True, exist_ok=True)
        write_kquant_copy(demo_file("trained"), kq)
    rows = []
    original = load(demo_file("trained"), precision="exact")
    for model, path in (("demo Q8_0", demo_file("trained")), ("demo Q4_K_M", kq)):
        exact = load(path, precision="exact")
        tok = exact.tokenizer
        if model == "demo Q4_K_M":  # the yardstick: what the Q4_K_M file itself changes
            rows.append({"model": "Q4_K_M vs Q8_0", "precision": "(yardstick)",
                         **step_agreement(original.model, exact.model, tok),
                         **block_agreement(original, exact, prompts=a.prompts, gen_steps=a.steps)})
        for p in ("fast", "q4", "q3"):
            other = load(path, precision=p)
            row = {"model": model, "precision": other.precision.label, **step_agreement(exact.model, other.model, tok),
                   **block_agreement(exact, other, prompts=a.prompts, gen_steps=a.steps)}
            rows.append(row)
            print(f"[tiers] {model} {p} done", file=sys.stderr)
    print(f"{'model':<16}{'precision':<16}{'top-1':>8}{'conf.':>8}{'SC top-1':>10}{'SC conf.':>10}{'max rel err':>13}"
          f"{'same blocks':>13}{'same tokens':>13}")
    for r in rows:
        print(f"{r['model']:<16}{r['precision']:<16}{r['step_top1']:>8.1%}{r['step_top1_confident']:>8.1%}{r['sc_step_top1']:>10.1%}"
              f"{r['sc_step_top1_confident']:>10.1%}{r['step_max_rel_logit_error']:>13.2e}"
              f"{r['blocks_identical']:>6}/{r['blocks_compared']:<6}{r['token_agreement']:>13.1%}")
    Path(a.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
