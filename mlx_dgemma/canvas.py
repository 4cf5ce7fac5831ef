"""Canvas templates: positions of the answer fixed to given tokens, the rest denoised.

A diffusion model denoises a whole canvas at once, so part of it can be given: a template
fixes some positions of the answer (counted from 0 across blocks: position p is position
``p % C`` of block ``p // C + 1``) to tokens. The denoiser starts each canvas with them,
keeps them at every step (they count as accepted, with zero entropy, so they neither use up
the EntropyBound budget nor hold the stopping rule back) and commits them; every other
position is denoised as usual, reading them from both sides. No autoregressive engine can do
this: a fixed closing bracket at position 40 shapes what the model writes at 10.

The server fixes a tool call's opening (``<|tool_call>call:NAME{``) this way; the command line
takes ``--canvas-template`` in the text form of :meth:`CanvasTemplate.parse`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ParameterError

# a hole in the text form: {{N}} is N positions the denoiser fills
HOLE = re.compile(r"\{\{(\d+)\}\}")


@dataclass(frozen=True)
class CanvasTemplate:
    """Fixed positions of an answer: ``fixed`` holds (position, token id) pairs, positions
    counted from 0 over the whole answer, each at most once, in order."""

    fixed: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        positions = [p for p, _ in self.fixed]
        if positions != sorted(set(positions)):
            raise ParameterError("template: positions must be distinct and in order", param="template")
        for p, t in self.fixed:
            if isinstance(p, bool) or isinstance(t, bool) or not isinstance(p, int) or not isinstance(t, int) \
                    or p < 0 or t < 0:
                raise ParameterError(f"template: ({p!r}, {t!r}) is not a (position, token id) pair of "
                                     "non-negative integers", param="template")

    @classmethod
    def from_pieces(cls, tokenizer: Any, pieces: Sequence[str | int]) -> "CanvasTemplate":
        """From the answer's start: each string piece is fixed (its tokens, encoded on its own),
        each integer is that many free positions. Positions after the last piece are free."""
        fixed: list[tuple[int, int]] = []
        pos = 0
        for piece in pieces:
            if isinstance(piece, str):
                ids = tokenizer.encode(piece)
                fixed += [(pos + i, t) for i, t in enumerate(ids)]
                pos += len(ids)
            else:
                pos += int(piece)
        return cls(tuple(fixed))

    @classmethod
    def parse(cls, text: str, tokenizer: Any, flag: str = "--canvas-template") -> "CanvasTemplate":
        """The text form: fixed text with holes ``{{N}}`` (N positions the model fills), e.g.
        ``'Name: {{4}}. Age: {{2}}.'``; the answer goes on freely after the template's end."""
        pieces: list[str | int] = []
        at = 0
        for m in HOLE.finditer(text):
            if m.start() > at:
                pieces.append(text[at:m.start()])
            pieces.append(int(m.group(1)))
            at = m.end()
        if at < len(text):
            pieces.append(text[at:])
        template = cls.from_pieces(tokenizer, pieces)
        if not template.fixed:
            raise ParameterError(f"{flag}: fixes no token; give the text to fix, with {{{{N}}}} for N positions "
                                 "the model fills (e.g. 'Name: {{4}}.')", param="template")
        return template

    @classmethod
    def of(cls, value: "CanvasTemplate | Iterable[Sequence[int]] | None") -> "CanvasTemplate | None":
        """A template given as itself, as (position, token) pairs (the JSON form that crosses
        ``mlx.launch``'s broadcast), or None."""
        if value is None or isinstance(value, CanvasTemplate):
            return value
        try:
            pairs = tuple((p, t) for p, t in value)
        except (TypeError, ValueError):
            raise ParameterError(f"template: expected a CanvasTemplate or (position, token id) pairs, got "
                                 f"{type(value).__name__}", param="template") from None
        return cls(pairs)

    def pairs(self) -> list[list[int]]:
        """The JSON form (:meth:`of` reads it back)."""
        return [[p, t] for p, t in self.fixed]

    @property
    def end(self) -> int:
        """One past the last fixed position (0 when nothing is fixed)."""
        return self.fixed[-1][0] + 1 if self.fixed else 0

    def check(self, vocab_size: int, answer_positions: int, name: str = "template") -> None:
        """Every token in the vocabulary, every position within the answer's blocks (``name``:
        what the error names, e.g. the command line's flag)."""
        bad = next(((p, t) for p, t in self.fixed if t >= vocab_size), None)
        if bad is not None:
            raise ParameterError(f"{name}: token id {bad[1]} (position {bad[0]}) is outside [0, {vocab_size})",
                                 param="template")
        if self.end > answer_positions:
            raise ParameterError(f"{name}: fixes position {self.end - 1}, beyond the answer's "
                                 f"{answer_positions} positions; raise max_new_tokens or shorten the template",
                                 param="template")

    def block(self, index: int, canvas_length: int) -> list[tuple[int, int]]:
        """The (position in the canvas, token) pairs of block ``index`` (from 0)."""
        lo, hi = index * canvas_length, (index + 1) * canvas_length
        return [(p - lo, t) for p, t in self.fixed if lo <= p < hi]
