"""Guards on what an answer commits and returns: pure functions on token lists and text.

Each acts after a block is sampled, at the block boundary (``generation._run`` calls them), on
what is committed to the KV cache and returned, never inside the denoising step: where none
fires, the answer is the reference sampler's, token for token. Each is a registry parameter
(``mlx_dgemma.params``; 0 turns it off) and each ending has its own ``finish_reason``:

- :func:`loop_start` (``repetition_trim``): TensorSharp's repetition-loop trim. The block is cut
  where the loop starts and the answer ends there (``"repetition"``).
- :func:`duplicate_half` / :func:`duplicate_cut` (``duplicate_drop``): the llama.cpp
  DiffusionGemma PR's trailing-duplicate drop. An answer that is one text twice keeps it once
  (``"duplicate"``).
- :func:`unconverged` (``commit_entropy``): a block that ran out of steps with a high last-step
  mean entropy is re-rolled once with a new key; if the re-roll is no better, the answer ends
  before it (``"unconverged"``), and the block is never committed to the cache.
- :func:`empty_answer` (``empty_rerolls``): an answer whose first block ends the turn before
  any text is re-rolled with a new key, up to ``empty_rerolls`` times (then it stays empty,
  ``"eos"``).

No MLX, no NumPy: the rules are testable on plain lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# finish_reason of an answer a guard ended (DoneEvent, BlockEvent.end), with what it means
ENDINGS = {
    "repetition": "a repetition loop was trimmed",
    "duplicate": "a repeated copy of the answer was dropped",
    "unconverged": "a block did not converge, twice",
}
# the registry parameter (mlx_dgemma.params) that turns off the guard behind each ending (0)
GUARD_PARAMS = {"repetition": "repetition_trim", "duplicate": "duplicate_drop", "unconverged": "commit_entropy"}

# TensorSharp's strides: a token recurring at every position or at every other one
LOOP_STRIDES = (1, 2)


def loop_start(tokens: Sequence[int], eos_ids: Sequence[int], repeats: int = 6,
               strides: Sequence[int] = LOOP_STRIDES, pad_id: int | None = None) -> int | None:
    """Where a repetition loop starts in one block's argmax canvas, or None.

    TensorSharp's rule (``DiffusionGemmaSampler.TrimCanvas``, zhongkaifu/TensorSharp,
    ``TensorSharp.Models/Models/DiffusionGemma/DiffusionGemmaSampler.cs``): the cut starts at
    the first end-of-generation token (or the canvas' end); the first position ``i`` with
    ``i + 1 < cut`` where, for a stride of 1 or 2, ``tokens[j] == tokens[j + stride]`` holds for
    ``repeats`` (6) consecutive ``j = i, i + stride, ...`` is a loop's onset (the run may reach
    past the end token, as it does there: only its start must come before it). TensorSharp
    then keeps ``tokens[:i]`` and ends the answer. ``repeats`` 0 is off (None).

    ``pad_id``: padding counts as an end too. A model that pads out its canvas has stopped
    writing; a run of padding is not a loop (on the trained demo, "... heal." and 43 pads was
    trimmed and reported as a loop).
    """
    if repeats <= 0:
        return None
    n = len(tokens)
    ends = set(eos_ids) | ({pad_id} if pad_id is not None else set())
    cut = next((i for i, t in enumerate(tokens) if t in ends), n)
    for i in range(cut - 1):
        for stride in strides:
            reps, j = 0, i
            while j + stride < n and tokens[j] == tokens[j + stride]:
                reps += 1
                j += stride
            if reps >= repeats:
                return i
    return None


# what the llama.cpp rule strips from the answer's start before comparing its halves
_LEAD = " \n\t"


def duplicate_half(text: str, min_chars: int = 1) -> int | None:
    """The length of ``text`` to keep when it is one text twice, or None.

    The llama.cpp DiffusionGemma PR's rule (ggml-org/llama.cpp#24427,
    ``examples/diffusion-gemma/diffusion-gemma-cli.cpp``, "drop a trailing exact-duplicate of
    the answer if the canvas repeated it"): with the leading spaces, newlines and tabs stripped
    (``s``), ``half = len(s) // 2``; if ``half > 0`` and the first ``half`` characters equal the
    last ``half``, the answer becomes ``s[:half]`` ("X X" -> "X": with an odd length the middle
    character, a separator, is in neither half). Here ``half`` must be at least ``min_chars``
    (1: the PR's ``half > 0``; 0 is off) and the length is counted in characters (the PR counts
    UTF-8 bytes; a half then never splits a character). The leading whitespace is kept in the
    length returned: a raw continuation keeps its leading space.
    """
    if min_chars <= 0:
        return None
    s = text.lstrip(_LEAD)
    half = len(s) // 2
    if half >= min_chars and s[:half] == s[len(s) - half:]:
        return len(text) - len(s) + half
    return None


def duplicate_cut(tokens: Sequence[int], answer_of: Callable[[Sequence[int]], str], start: int,
                  min_chars: int = 1) -> int | None:
    """How many of ``tokens`` (an answer's, through its last block) to keep when the answer is
    one text twice (:func:`duplicate_half`), or None.

    ``answer_of(ids)`` is the visible answer of the first ``ids`` (thought channel and end of
    turn left out, as the answer is shown). The cut is the fewest tokens whose answer is the
    first copy (up to trailing whitespace), and only at or after ``start`` (the last block's
    first token): what came before was committed to the cache and streamed already. None where
    no token boundary falls there.
    """
    text = answer_of(tokens)
    keep = duplicate_half(text, min_chars)
    if keep is None:
        return None
    first = text[:keep].rstrip()
    for k in range(max(start, 0), len(tokens) + 1):
        got = answer_of(tokens[:k]).rstrip()
        if got == first:
            return k
        if len(got) > len(first):
            return None
    return None


def unconverged(stopped: bool, last_mean_entropy: float, threshold: float) -> bool:
    """The block-commit guard's test: the stopping rule was not met (the block ran out of steps)
    and the last step's mean entropy is above ``threshold`` (0: off)."""
    return threshold > 0 and not stopped and last_mean_entropy > threshold


def empty_answer(text: str, block: Sequence[int], eos_ids: Sequence[int]) -> bool:
    """The empty-answer guard's test, on an answer's first block: it ends the turn (holds an end
    token) and the answer's visible ``text`` through it is empty (the end came first, or after
    the thought channel and whitespace only)."""
    eos = set(eos_ids)
    return not text.strip() and any(t in eos for t in block)
