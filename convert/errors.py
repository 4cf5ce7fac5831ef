"""Conversion errors (one-line, user-facing)."""

from mlx_dgemma.errors import DGemmaError


class ConvertError(DGemmaError):
    """The input cannot be converted, or the output cannot be written; nothing was left behind."""
