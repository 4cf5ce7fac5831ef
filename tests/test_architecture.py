"""The package layout rules (docs/architecture.md), checked without running the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_events_are_plain_data_without_mlx():
    # The trace, the TUI screens and the TUI's test fakes read events: none of them may need MLX.
    code = ("import sys; import mlx_dgemma.events, mlx_dgemma.trace, tests.tui_fakes; "
            "from mlx_dgemma import StepEvent, DoneEvent; "
            "assert StepEvent is mlx_dgemma.events.StepEvent; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'); "
            "assert not bad, f'MLX imported: {bad}'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_fakes_and_generation_share_the_event_classes():
    # generation.py re-exports the events: old imports and the package name the same classes.
    import mlx_dgemma
    from mlx_dgemma import events, generation

    for name in events.__all__:
        assert getattr(generation, name) is getattr(events, name) is getattr(mlx_dgemma, name), name
