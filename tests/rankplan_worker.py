"""Run by tests/test_rank_plan.py under ``mlx.launch -n 2 --backend ring``: two Macs of
different memory, simulated by giving each rank its own device budget (bytes, from argv),
then ``mlx-dgemma ARGS...`` on both ranks.

``rankplan_worker.py BUDGET_RANK0 BUDGET_RANK1 ARGS...``
"""

from __future__ import annotations

import sys

import mlx_dgemma.plan as plan
from mlx_dgemma import distributed
from mlx_dgemma.cli import main

if __name__ == "__main__":
    rank = distributed.launched_rank()
    budget = int(sys.argv[1 + rank])
    plan.device_budget = lambda: (budget, f"rank {rank}'s simulated Mac")  # what make_plan compares with
    sys.exit(main(sys.argv[3:]))
