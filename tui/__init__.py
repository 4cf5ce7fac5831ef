"""Textual terminal UI (installed as mlx_dgemma.tui)."""
