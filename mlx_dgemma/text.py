"""Text from the model made safe for a terminal (used by the CLI and the chat app)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """Control characters (a model can emit any byte) shown as \\xNN instead of reaching the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
