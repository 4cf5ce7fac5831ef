"""The status line: block, step, temperature, speed, memory."""

from __future__ import annotations

from textual.widgets import Static


class StatusLine(Static):
    def show_step(self, ev, blocks: int, spf: float, tpf: float | None, prefill_tps: float | None,
                  memory: int, note: str = "", precision: str = "") -> None:
        parts = [f"block {ev.block + 1}/{blocks}", f"step {ev.step}/{ev.max_steps}", f"T={ev.temperature:.3f}",
                 f"{ev.seconds:.2f} s/step" if spf == 0 else f"{spf:.2f} s/step"]
        if tpf is not None:
            parts.append(f"{tpf:.2f} tok/fwd")
        if prefill_tps is not None:
            parts.append(f"prefill {prefill_tps:.0f} tok/s")
        parts.append(f"mem {memory / 1e9:.2f} GB")
        if precision:  # which runtime precision is running: "fast (bfloat16)", "exact (float32)"
            parts.append(precision)
        if note:
            parts.append(note)
        self.update("  ".join(parts))
