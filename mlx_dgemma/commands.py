"""Subcommands beyond convert/verify (generate, chat, bench)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add the model-running subcommands to the ``mlx-dgemma`` parser."""
