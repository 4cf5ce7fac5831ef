"""Errors a user can act on: each prints as one line (file, tensor or parameter; what was
expected; what to do) and exits non-zero without a traceback unless --debug is given."""


class DGemmaError(Exception):
    """Base class of every user-facing error."""

    exit_code = 2


class ModelFilesError(DGemmaError):
    """A model directory or file is missing something or is inconsistent."""


class ParameterError(DGemmaError, ValueError):
    """A parameter value is out of its allowed range."""


class MemoryBudgetError(DGemmaError, MemoryError):
    """A prompt's KV cache and working memory would not fit in the memory available."""
