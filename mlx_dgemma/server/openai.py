"""OpenAI formatting: the answer as the client sees it (tokens, ``max_tokens``, ``stop``, the
thought channel kept out of ``content``), stream deltas, and the response objects."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_dgemma.chat_template import (THOUGHT_CLOSE, THOUGHT_OPEN, TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN, ToolCall,
                                      parse_answer, split_tool_calls)
from mlx_dgemma.sampler import max_tokens_cut


def marker_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    """The single-token ids of the thought channel's markers (None where a marker is not one token)."""
    out = []
    for text in (THOUGHT_OPEN, THOUGHT_CLOSE):
        ids = tokenizer.encode(text)
        out.append(ids[0] if len(ids) == 1 else None)
    return out[0], out[1]


# OpenAI's finish_reason for an answer a core guard ended (mlx_dgemma.guards.ENDINGS): the loop
# trim and the duplicate drop leave a whole answer ("stop"); an unconverged block cuts it short,
# as a token limit would ("length": a client may ask again)
GUARD_FINISH = {"repetition": "stop", "duplicate": "stop", "unconverged": "length"}


@dataclass
class Answer:
    """The answer as the client sees it, rebuilt after every committed block.

    ``max_tokens`` cuts the token list exactly (blocks are whole canvases, the API's limit
    is in tokens); ``stop`` cuts the visible text, and ``completion_tokens`` counts the tokens
    up to the one that completed the stop string; the thought channel never reaches content.
    An EOS ends the answer (counted), and so does a block of padding alone (the model has
    ended its answer); padding is never counted, and never text.
    """

    tokenizer: Any
    eos_ids: tuple[int, ...]
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    markers: tuple[int | None, int | None] | None = None  # thought channel ids (marker_ids), found if None
    tools: bool = False  # parse the template's tool calls out of the answer
    raw: bool = False  # a text completion: the text continues the prompt, whitespace kept
    pad_id: int | None = None  # the padding token: where the model writes it, the answer has ended
    tokens: list[int] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    completion_tokens: int = 0  # the answer's tokens, padding not counted
    positions: int = 0  # the answer's positions, padding included (completion_tokens of them are tokens)
    reasoning_tokens: int = 0
    eos: bool = False
    stop_hit: bool = False
    cut: bool = False  # max_tokens ended the answer before an EOS
    end: str | None = None  # the core's guard that ended the answer (BlockEvent.end), if one did
    tool_calls: list[ToolCall] = field(default_factory=list)  # complete, well-formed calls
    call_open: bool = False  # a tool-call block has begun and is not closed yet

    def __post_init__(self) -> None:
        if self.markers is None:
            self.markers = marker_ids(self.tokenizer)
        if self.tools:  # after a call the model waits for its result: the answer ends there
            ids = self.tokenizer.encode(TOOL_RESPONSE_OPEN)
            if len(ids) == 1 and ids[0] not in self.eos_ids:
                self.eos_ids = (*self.eos_ids, ids[0])

    def add(self, block_tokens: tuple[int, ...], text: str, thinking: str, end: str | None = None) -> None:
        """Add one committed block (its tokens and the core's parsed text so far; ``end``: the
        guard that ended the answer with it, mlx_dgemma.guards.ENDINGS)."""
        self.tokens += block_tokens
        self.end = end
        gen = self.tokens
        at = max_tokens_cut(gen, self.max_tokens, self.pad_id)
        if at < len(gen):
            gen = gen[:at]
            parsed = parse_answer(self.tokenizer.decode(gen))
            text, thinking = parsed.answer, parsed.thinking
        eos_at = next((i for i, t in enumerate(gen) if t in self.eos_ids), None)
        gen = gen[: eos_at + 1] if eos_at is not None else gen
        # a block of padding alone (no EOS before it): the model has ended its answer (one that
        # answers a tool result with a canvas of padding has answered nothing, and said so);
        # padding beside text is no text and no token, and the answer goes on
        ended = eos_at is None and self.pad_id is not None and bool(block_tokens) and \
            all(t == self.pad_id for t in block_tokens) and len(gen) == len(self.tokens)
        self.eos = eos_at is not None or ended
        self.cut = not self.eos and len(gen) < len(self.tokens)
        if self.tools:
            text, thinking = self._split_calls(gen)
        elif self.raw:  # the core's text is stripped (a chat answer's); a continuation's is not
            parsed = parse_answer(self.tokenizer.decode(gen), strip=False)
            text, thinking = parsed.answer, parsed.thinking
        hits = [i for i in (text.find(s) for s in self.stop) if i != -1]
        self.stop_hit = bool(hits)
        if hits:
            gen = gen[: self._stop_tokens(gen)]
        self.positions = len(gen)
        self.completion_tokens = len(gen) - (gen.count(self.pad_id) if self.pad_id is not None else 0)
        self.reasoning_tokens = self._thought_tokens(gen)
        self.content = text[: min(hits)] if hits else text
        self.reasoning = thinking

    def _split_calls(self, gen: list[int]) -> tuple[str, str]:
        """(text, thinking) of ``gen`` with its tool calls taken out into ``tool_calls``; a
        malformed call stays in the text verbatim (markers included), so the client sees it."""
        pieces, self.call_open = split_tool_calls(self.tokenizer.decode(gen))
        self.tool_calls = [p for p in pieces if isinstance(p, ToolCall)]
        # the text outside the calls is parsed as any answer (thought channel, specials), with
        # placeholders where malformed blocks go back afterwards
        blocks: list[str] = []
        outside = ""
        for p in pieces:
            if isinstance(p, ToolCall):
                continue
            if p.startswith(TOOL_CALL_OPEN):
                outside += f"\x00{len(blocks)}\x00"
                blocks.append(p)
            else:
                outside += p
        parsed = parse_answer(outside)
        text = parsed.answer
        for i, b in enumerate(blocks):
            text = text.replace(f"\x00{i}\x00", b)
        return text, parsed.thinking

    def _has_stop(self, ids: list[int]) -> bool:
        text = parse_answer(self.tokenizer.decode(ids), strip=not self.raw).answer
        return any(s in text for s in self.stop)

    def _stop_tokens(self, gen: list[int]) -> int:
        """The fewest leading tokens of ``gen`` whose answer holds a stop string (binary search:
        once a prefix holds one, every longer prefix does)."""
        lo, hi = 1, len(gen)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._has_stop(gen[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return hi

    def _thought_tokens(self, ids: list[int]) -> int:
        """Tokens inside the thought channel (markers included)."""
        open_id, close_id = self.markers or (None, None)
        if open_id is None or open_id not in ids:
            return 0
        start = ids.index(open_id)
        end = ids.index(close_id, start) + 1 if close_id is not None and close_id in ids[start:] else len(ids)
        return end - start

    @property
    def finished(self) -> bool:
        return self.eos or self.stop_hit or self.cut or self.end is not None

    @property
    def finish_reason(self) -> str:
        """OpenAI's value: a guard's ending is one OpenAI clients know (GUARD_FINISH), the
        guard itself is :attr:`finish_detail`."""
        if self.tool_calls and self.eos and not self.stop_hit:
            return "tool_calls"
        if self.eos or self.stop_hit:
            return "stop"
        return GUARD_FINISH[self.end] if self.end in GUARD_FINISH and not self.cut else "length"

    @property
    def finish_detail(self) -> str | None:
        """The guard that ended the answer (a non-standard ``finish_detail`` beside OpenAI's
        ``finish_reason``), where the finish reason is the guard's."""
        return self.end if self.end in GUARD_FINISH and not (self.eos or self.stop_hit or self.cut) else None

    def streamable(self) -> tuple[str, str]:
        """(content, reasoning) safe to send before the answer is final: a trailing U+FFFD may be
        half a character the next block completes, a trailing prefix of a stop string may
        become the stop string."""
        content, reasoning = self.content.rstrip("\ufffd"), self.reasoning.rstrip("\ufffd")
        if not self.stop_hit:
            for s in self.stop:
                for k in range(min(len(s) - 1, len(content)), 0, -1):
                    if content.endswith(s[:k]):
                        content = content[:-k]
                        break
        return content, reasoning


class Deltas:
    """Turns successive snapshots of a growing text into append-only deltas."""

    def __init__(self) -> None:
        self.sent = ""

    def __call__(self, text: str) -> str:
        # Normally ``text`` extends what was sent. Rarely it differs behind it (a decode that
        # re-spells earlier bytes): a stream cannot retract, so only what goes beyond is sent.
        delta = text[len(self.sent):]
        if len(text) >= len(self.sent):
            self.sent = text
        return delta


@dataclass(frozen=True)
class Result:
    """A finished answer: what the response body carries."""

    content: str
    reasoning: str
    finish_reason: str
    usage: dict[str, Any]
    tool_calls: tuple[ToolCall, ...] = ()
    # with logprobs: one entry per counted token ({token, logprob, bytes, top_logprobs}), else None
    logprobs: tuple[dict[str, Any], ...] | None = None
    timings: dict[str, Any] | None = None  # llama.cpp's shape, with its "diffusion" part
    finish_detail: str | None = None  # the core's guard that ended the answer (Answer.finish_detail)


class Formatter:
    """The response objects of one request: one subclass per response kind (its object names,
    its id's prefix, the shape of its choices). An endpoint names its kind's class
    (:mod:`.endpoints`); a stream sends :meth:`opening`'s chunks, then :meth:`delta`'s and
    :meth:`extra`'s, and a whole answer is :meth:`final`."""

    object = ""  # the response's object name
    chunk_object = ""  # a stream chunk's
    id_prefix = ""

    def __init__(self, model: str):
        self.model = model
        self.id = self.id_prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object if chunk else self.object, "created": self.created,
                "model": self.model}

    def call_id(self, index: int) -> str:
        """The id of the answer's ``index``-th tool call (the same in a stream and its final)."""
        return f"call_{self.id.split('-', 1)[1][:16]}_{index}"

    def tool_call(self, index: int, call: ToolCall, stream: bool = False) -> dict[str, Any]:
        out = {"index": index} if stream else {}
        return {**out, "id": self.call_id(index), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def opening(self) -> list[dict[str, Any]]:
        """The chunks a stream sends before the answer's first text."""
        return []

    def choice(self, r: Result) -> dict[str, Any]:
        """A whole answer's choice (without ``finish_detail``)."""
        raise NotImplementedError

    def delta_choice(self, content: str, reasoning: str, finish: str | None, role: bool,
                     tool_calls: list[tuple[int, ToolCall]] | None, logprobs: Any) -> dict[str, Any]:
        """A stream chunk's choice (without ``finish_detail``)."""
        raise NotImplementedError

    def logprobs(self, entries: Any) -> dict[str, Any] | None:
        """A choice's ``logprobs`` for ``entries`` (None: not asked)."""
        raise NotImplementedError

    def final(self, r: Result) -> dict[str, Any]:
        choice = self.choice(r)
        if r.finish_detail is not None:
            choice["finish_detail"] = r.finish_detail
        out = {**self._base(False), "choices": [choice], "usage": r.usage}
        if r.timings is not None:
            out["timings"] = r.timings
        return out

    def delta(self, content: str = "", reasoning: str = "", finish: str | None = None,
              role: bool = False, tool_calls: list[tuple[int, ToolCall]] | None = None,
              logprobs: Any = None, detail: str | None = None) -> dict[str, Any]:
        choice = self.delta_choice(content, reasoning, finish, role, tool_calls, logprobs)
        if detail is not None:  # the final chunk of an answer a core guard ended (Result.finish_detail)
            choice["finish_detail"] = detail
        return {**self._base(True), "choices": [choice]}

    def extra(self, **fields: Any) -> dict[str, Any]:
        return {**self._base(True), "choices": [], **fields}


class ChatFormatter(Formatter):
    """``chat.completion``: a message (content, reasoning, tool calls); a stream opens with the role."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def opening(self) -> list[dict[str, Any]]:
        return [self.delta(role=True)]

    def choice(self, r: Result) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": r.content}
        if r.tool_calls:
            message["content"] = r.content or None
            message["tool_calls"] = [self.tool_call(i, c) for i, c in enumerate(r.tool_calls)]
        if r.reasoning:
            message["reasoning_content"] = r.reasoning
        return {"index": 0, "message": message, "finish_reason": r.finish_reason, "logprobs": self.logprobs(r.logprobs)}

    def delta_choice(self, content: str, reasoning: str, finish: str | None, role: bool,
                     tool_calls: list[tuple[int, ToolCall]] | None, logprobs: Any) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant"} if role else {}
        if content or role:
            d["content"] = content
        if reasoning:
            d["reasoning_content"] = reasoning
        if tool_calls:
            d["tool_calls"] = [self.tool_call(i, c, stream=True) for i, c in tool_calls]
        return {"index": 0, "delta": d, "finish_reason": finish, "logprobs": self.logprobs(logprobs)}

    def logprobs(self, entries: Any) -> dict[str, Any] | None:
        """``{"content": [entries]}``."""
        return None if entries is None else {"content": list(entries), "refusal": None}


class TextFormatter(Formatter):
    """``text_completion`` (the legacy API): the answer's text; its chunks are ``text_completion`` too."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, model: str):
        super().__init__(model)
        self.text_offset = 0  # logprobs: where the next token starts in the answer

    def choice(self, r: Result) -> dict[str, Any]:
        return {"index": 0, "text": r.content, "finish_reason": r.finish_reason, "logprobs": self.logprobs(r.logprobs)}

    def delta_choice(self, content: str, reasoning: str, finish: str | None, role: bool,
                     tool_calls: list[tuple[int, ToolCall]] | None, logprobs: Any) -> dict[str, Any]:
        return {"index": 0, "text": content, "finish_reason": finish, "logprobs": self.logprobs(logprobs)}

    def logprobs(self, entries: Any) -> dict[str, Any] | None:
        """The legacy columns (``tokens``, ``token_logprobs``, ``top_logprobs`` as {token: logprob}
        and ``text_offset``, counted on from the entries sent before)."""
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def model_card(model_id: str, created: int, context: int | None = None) -> dict[str, Any]:
    """A model object; ``max_model_len`` (vLLM's field, which clients read the context from) when known."""
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "mlx-dgemma"}
    return {**card, "max_model_len": context} if context else card
