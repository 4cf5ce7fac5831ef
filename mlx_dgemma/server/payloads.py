"""The pieces of a response built from the core's events on the worker thread: each answer
token's ``logprobs`` entry (OpenAI's: text, log-probability, UTF-8 bytes, the top tokens) and
``stream_steps``' step and block events. :mod:`.openai` puts them into response objects."""

from __future__ import annotations

from typing import Any


def token_text(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """A token as OpenAI's logprobs show it: its text and its UTF-8 bytes (a byte that is not
    a whole character on its own is written ``\\xNN`` in the text; the bytes are exact)."""
    b = tokenizer.token_bytes(token_id)
    return b.decode("utf-8", "backslashreplace"), list(b)


def logprob_entry(tokenizer: Any, token_id: int, logprob: float, top_ids: list[int],
                  top_lps: list[float]) -> dict[str, Any]:
    """One answer token's ``logprobs`` entry, with its ``top_logprobs``."""
    text, raw = token_text(tokenizer, token_id)
    top = []
    for t, lp in zip(top_ids, top_lps):
        tt, tb = token_text(tokenizer, t)
        top.append({"token": tt, "logprob": lp, "bytes": tb})
    return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": top}


def step_payload(tokenizer: Any, ev: Any) -> dict[str, Any]:
    """``stream_steps``' event for a :class:`~mlx_dgemma.events.StepEvent`: the draft's text and
    pieces, which positions were accepted, the mean entropy and the temperature."""
    draft = ev.draft.tolist()
    return {"type": "step", "block": ev.block, "step": ev.step, "max_steps": ev.max_steps,
            "draft": tokenizer.decode(draft), "tokens": [tokenizer.piece(t) for t in draft],
            "accepted": ev.accepted.astype(int).tolist(), "mean_entropy": round(float(ev.mean_entropy), 6),
            "temperature": round(float(ev.temperature), 6)}


def block_payload(ev: Any) -> dict[str, Any]:
    """``stream_steps``' event for a committed :class:`~mlx_dgemma.events.BlockEvent`."""
    return {"type": "block", "block": ev.block, "steps": ev.steps, "finished": ev.finished,
            **({"end": ev.end} if ev.end else {})}
