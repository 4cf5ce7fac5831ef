"""Errors a user can act on: each prints as one line (file, tensor or parameter; what was
expected; what to do) and exits non-zero without a traceback unless --debug is given."""


class DGemmaError(Exception):
    """Base class of every user-facing error."""

    exit_code = 2


class ModelFilesError(DGemmaError):
    """A model directory or file is missing something or is inconsistent."""


class ParameterError(DGemmaError, ValueError):
    """A parameter value is out of its allowed range.

    ``name`` (the API's parameter name) and ``rule`` (what it must be), when set, let the CLI
    and the TUI restate the error with the flag or label the user actually typed.
    """

    def __init__(self, message: str, name: str | None = None, rule: str | None = None):
        super().__init__(message)
        self.name, self.rule = name, rule
