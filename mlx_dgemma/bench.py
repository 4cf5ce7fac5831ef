"""``mlx-dgemma bench`` (filled in by the benchmark work)."""

from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny")


def main(args: argparse.Namespace) -> int:
    raise SystemExit("bench: not implemented yet")
