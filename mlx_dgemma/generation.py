"""Block diffusion generation in layers:

``denoise_block`` (a step generator over one canvas) -> ``stream_generate`` (frozen event
dataclasses: steps, committed blocks, a final summary) -> ``generate`` (the text).
``ChatSession`` keeps the KV cache between turns so a follow-up only prefills new tokens
(where they extend a fresh render of the conversation).
The CLI and the TUI use only ``stream_generate`` / ``ChatSession.stream``.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .canvas import CanvasTemplate
from .chat_template import ParsedAnswer, parse_answer, render_chat
from .distributed import agree
from .errors import MemoryBudgetError, NonFiniteError, ParameterError
from .events import BlockEvent, DoneEvent, Event, PrefillEvent, PrefillProgressEvent, Stats, StepEvent
from .gpu import memory_errors, wired_limit
from .guards import duplicate_cut, empty_answer, loop_start, unconverged
from .memory import check_fits, estimate, peak_memory_bytes, reset_peak_memory
from .model import DEFAULT_PREFILL_CHUNK
from .request import GenerationRequest
from .runtime import Runtime, check_runtime
from .sampler import SamplerParams, finalize_block, temperature, token_logprobs
from .step import StepFunction


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass
class BlockResult:
    tokens: list[int]
    steps: int
    # with ``logprobs=``: the tokens' log-probabilities [C], the top ids and theirs [C, k] (numpy)
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def denoise_block(step_fn: StepFunction, cache: KVCache, params: SamplerParams, key: mx.array, block: int = 1,
                  initial_canvas: mx.array | None = None,
                  logprobs: int | None = None,
                  fixed: list[tuple[int, int]] | None = None) -> Iterator[StepEvent | BlockResult]:
    """Denoise one canvas against ``cache`` with ``step_fn`` (the compiled step: model, dtype and
    the traced sampler fields) under ``params`` (this answer's: steps, temperatures): yields a
    StepEvent per step, then a BlockResult. ``block`` is the block's number, counted from 1 (as
    every event and message counts it).

    Each step is one compiled graph and one device sync; only the canvas, draft, accepted
    mask and entropies ([C] each) reach the host, never the [C, V] logits. With ``logprobs``
    (k >= 0) the committed tokens' log-probabilities and the top k are computed once, after the
    stopping step, from that step's logits (the model's distribution at temperature 1, recovered
    from the step's own temperature-scaled output, so the compiled step is the same with or
    without them).

    ``fixed``: (position, token) pairs of a canvas template (:mod:`mlx_dgemma.canvas`): the
    canvas starts with them and every step holds them; none (the default) is the reference path.
    """
    C, V = step_fn.model.args.canvas_length, step_fn.model.args.vocab_size
    key, k0 = mx.random.split(key)
    canvas = initial_canvas if initial_canvas is not None else \
        mx.random.randint(0, V, (1, C), key=k0).astype(mx.int32)
    held = None
    if fixed:
        mask_np, tokens_np = np.zeros((1, C), dtype=bool), np.zeros((1, C), dtype=np.int32)
        for pos, tok in fixed:
            mask_np[0, pos], tokens_np[0, pos] = True, tok
        held = (mx.array(mask_np), mx.array(tokens_np))
        canvas = mx.where(held[0], held[1], canvas)
    history = step_fn.initial_history((1, C))
    revealed = None  # the confidence-threshold mode's revealed canvas (the step starts it)
    sc_logits = None
    argmax = canvas
    N = params.max_denoising_steps
    for i, left in enumerate(range(N, 0, -1), start=1):
        t0 = time.perf_counter()
        key, sub = mx.random.split(key)
        temp = temperature(left, params)
        out = step_fn(canvas, sc_logits, temp, sub, history, cache, revealed, held)
        mx.eval(out["canvas"], out["argmax"], out["accepted"], out["entropy"], out["processed"], out["stop"],
                out["history"], out["finite"], out["revealed"])
        if not out["finite"].item():
            raise NonFiniteError(f"block {block}, step {i}: the model's logits are NaN or Inf; the weights "
                                 "or the dtype overflow (try --dtype float32, or convert the model again)")
        canvas, argmax, sc_logits, history = out["canvas"], out["argmax"], out["processed"], out["history"]
        revealed = out["revealed"]
        entropy = np.array(out["entropy"][0])
        stopped = bool(out["stop"][0].item())
        yield StepEvent(block=block, step=i, max_steps=N, canvas=_frozen(np.array(canvas[0])),
                        draft=_frozen(np.array(argmax[0])), accepted=_frozen(np.array(out["accepted"][0])),
                        entropy=_frozen(entropy), mean_entropy=float(entropy.mean()), temperature=float(temp),
                        seconds=time.perf_counter() - t0, stopped=stopped)
        if stopped:
            break
    lp = None
    if logprobs is not None:
        # sc_logits is the committing step's logits / its temperature; the model's own distribution
        # is reported (as OpenAI's and llama.cpp's log-probabilities are, whatever the temperature):
        # late in the schedule (t = 0.05 on the demo) the tempered one puts ~0 on every chosen token
        arrays = token_logprobs(sc_logits * temp, argmax, logprobs)
        mx.eval(*arrays)
        lp = tuple(np.array(a[0]) for a in arrays)
    yield BlockResult(np.array(argmax[0]).astype(np.int64).tolist(), i, lp)


def _defaults(runtime: Runtime, generation_config: dict | None) -> dict:
    """The generation config to use: the one given, else the runtime's own (from load())."""
    return generation_config if generation_config is not None else runtime.generation_config


class ChatSession:
    """A conversation whose KV cache is reused between turns where that cannot change the answer.

    The cache only ever holds tokens that a fresh render of the conversation holds too: each
    turn renders the whole conversation with the chat template and reuses the cache only if
    its tokens are a prefix of that render (mlx-lm's prompt cache works the same way), so a
    cache hit changes the speed, never the prompt. After an answer the cache returns to the
    end of the user's turn (dropping the generation prompt and the committed blocks, padding
    included) and encodes the answer as the template renders an earlier assistant turn.
    Sampler defaults come from ``generation_config``, else the runtime's own."""

    def __init__(self, runtime: Runtime, generation_config: dict | None = None, dtype: mx.Dtype | None = None,
                 enable_thinking: bool = False, system: str | None = None):
        check_runtime(runtime, "ChatSession")
        self.runtime = runtime
        self.model, self.tokenizer = runtime.model, runtime.tokenizer
        self.dtype = dtype or runtime.activation_dtype
        self.params = SamplerParams.from_config(_defaults(runtime, generation_config))
        self.enable_thinking = enable_thinking
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.cache = self.model.make_cache()
        self.history: list[int] = []  # every token in the cache, in order: a prefix of a fresh render
        self.cached_tokens = 0  # tokens the last turn took from the cache instead of encoding them
        self.prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK

    def reset(self) -> None:
        self.cache = self.model.make_cache()
        self.history = []
        self.messages = [m for m in self.messages if m["role"] == "system"]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        return self.tokenizer.encode(render_chat(messages, self.tokenizer.chat_template,
                                                 add_generation_prompt=generation_prompt,
                                                 enable_thinking=self.enable_thinking))

    def stream(self, user: str, cancel: Callable[[], bool] | None = None, logprobs: int | None = None, *,
               request: GenerationRequest | None = None, **overrides: Any) -> Iterator[Event]:
        """Answer ``user``; yields events (see :func:`stream_generate`: ``request``, or its
        keyword form, ``logprobs`` and the sampler settings as ``overrides``). The consumer
        should iterate to the end: after the DoneEvent the cache is brought up to the answer."""
        request = GenerationRequest.build(request, overrides, logprobs=logprobs, who="ChatSession.stream")
        if not isinstance(user, str):
            raise ParameterError(f"prompt: expected the user's message as text, got {type(user).__name__}",
                                 param="prompt")
        if not user.strip():
            raise ParameterError("prompt: empty; give some text")
        params = self.params.with_overrides(**request.params)
        messages = self.messages + [{"role": "user", "content": user}]
        full = self._render(messages, True)
        # the end of the user's turn: what the next turn's render shares with this one
        turn = self._render(messages, False)
        if full[:len(turn)] != turn:
            turn = []
        n = len(self.history)
        if self.cache.offset != n or full[:n] != self.history:
            # not a prefix of this render (an edited conversation, another client's, a turn
            # stopped mid-way): encode it all again
            self.cache, self.history, n = self.model.make_cache(), [], 0
        self.cached_tokens = n
        mark = max(len(turn), n)
        saved: list[tuple] = []
        answer_ids: list[int] = []
        finished = False
        try:
            for ev in _run(self.runtime, self.cache, full[n:], params, self.dtype, cancel,
                           history_len=n, chunk_size=self.prefill_chunk_size,
                           checkpoint=(mark - n, lambda: saved.append(self.cache.checkpoint())),
                           logprobs=request.logprobs, template=request.template):
                if isinstance(ev, DoneEvent):
                    answer_ids = list(ev.tokens)
                yield ev
            finished = True
        finally:
            if not finished:  # the consumer stopped iterating: this turn did not happen
                self.history = []
        if not saved:
            self.cache, self.history = self.model.make_cache(), []
            return
        answer = parse_answer(self.tokenizer.decode(answer_ids)).answer
        self.messages = messages + [{"role": "assistant", "content": answer}]
        # back to the end of the user's turn, then the answer as a fresh render holds it
        self.cache.rollback(saved[0])
        after = self._render(self.messages, False)
        if after[:mark] != full[:mark]:
            self.cache, self.history = self.model.make_cache(), []
            return
        if len(after) > mark:
            self.model.prefill(mx.array([after[mark:]], dtype=mx.int32), self.cache,
                               dtype=self.dtype,
                               chunk_size=self.prefill_chunk_size)
        self.history = after


def stream_generate(runtime: Runtime, prompt: str | list[dict[str, str]] | list[int],
                    *mlx_lm_args: Any, request: GenerationRequest | None = None,
                    generation_config: dict | None = None, dtype: mx.Dtype | None = None,
                    enable_thinking: bool = False, chat: bool = True,
                    cancel: Callable[[], bool] | None = None,
                    prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK, logprobs: int | None = None,
                    template: CanvasTemplate | list | None = None, **params: Any) -> Iterator[Event]:
    """Generate an answer; yields PrefillProgressEvents (one per prefill chunk of
    ``prefill_chunk_size`` tokens, when the prompt spans several), a PrefillEvent, StepEvents,
    BlockEvents, then a DoneEvent.

    Before any work the prompt is checked against the model's context and its memory
    estimate (KV cache and working memory) against the memory available: ParameterError or
    MemoryBudgetError. ``cancel`` is polled between prefill chunks and denoising steps.

    ``prompt`` is a user message (rendered with the chat template unless ``chat=False``: then
    the text is continued and the answer keeps its whitespace, e.g. a leading space),
    a list of messages, or token ids.

    ``request`` (a :class:`~mlx_dgemma.request.GenerationRequest`, checked when it was built)
    holds the answer's settings; or give them as keywords: ``params`` override
    generation_config values (the parameters of ``mlx_dgemma.params``: max_denoising_steps,
    t_min, t_max, entropy_bound, stability_threshold, confidence_threshold, max_new_tokens,
    seed, sc_top_k, accept_probability, the answer guards'), with ``logprobs`` and ``template``
    below. Without ``generation_config`` the runtime's own (``runtime.generation_config``, from
    :func:`mlx_dgemma.load`) is used.

    ``logprobs`` (an integer k >= 0; None, the default, costs nothing): each BlockEvent carries
    its tokens' log-probabilities and the k most likely tokens per position, under the
    distribution of the step that committed the block (its logits at temperature 1).

    ``template`` (a :class:`~mlx_dgemma.canvas.CanvasTemplate`, or its (position, token) pairs):
    positions of the answer fixed to given tokens, held by the denoiser; the rest is denoised.
    """
    check_runtime(runtime, "stream_generate", mlx_lm_args)  # (model, tokenizer, prompt) gets a one-line why
    tokenizer = runtime.tokenizer
    request = GenerationRequest.build(request, params, logprobs=logprobs, template=template)
    p = request.resolve(_defaults(runtime, generation_config))
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ParameterError("prompt: empty; give some text")
        text = render_chat([{"role": "user", "content": prompt}], tokenizer.chat_template,
                           enable_thinking=enable_thinking) if chat else prompt
        ids = tokenizer.encode(text, add_bos=not chat)
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        ids = tokenizer.encode(render_chat(list(prompt), tokenizer.chat_template, enable_thinking=enable_thinking))
    else:
        ids = _token_ids(prompt)
    if not ids:
        raise ParameterError("prompt: no tokens; give some text")
    # a raw text prompt is continued: its answer keeps the whitespace a chat answer's loses
    yield from _run(runtime, runtime.model.make_cache(), ids, p, dtype, cancel, history_len=0,
                    chunk_size=prefill_chunk_size, logprobs=request.logprobs,
                    strip=not (isinstance(prompt, str) and not chat), template=request.template)


def _token_ids(prompt: Any) -> list[int]:
    """A prompt of token ids (a list, tuple or range of integers, or a NumPy/MLX integer array)
    as a list; anything else (bytes, floats, None) is a ParameterError, not silently converted."""
    if hasattr(prompt, "tolist") and hasattr(prompt, "dtype"):  # a NumPy or MLX array
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple, range)):
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is None:
            return [int(t) for t in prompt]
        got = f"a list holding {bad!r:.40}"
    else:
        got = f"{type(prompt).__name__} {prompt!r:.40}" if isinstance(prompt, (int, float, bytes)) else \
            type(prompt).__name__
    raise ParameterError(f"prompt: expected text, a list of messages or a list of token ids, got {got}"
                         f"{'; decode bytes to str first' if isinstance(prompt, (bytes, bytearray)) else ''}",
                         param="prompt")


def _run(runtime: Runtime, *args: Any, **kwargs: Any) -> Iterator[Event]:
    """:func:`_answer` on this thread under MLX's wired limit on a Mac's GPU (as mlx-lm
    generates), a GPU out of memory raised as :class:`MemoryBudgetError` (``mlx_dgemma.gpu``)."""
    with wired_limit(runtime.model), memory_errors("generation"):
        yield from _answer(runtime, *args, **kwargs)


def _answer(runtime: Runtime, cache: KVCache, ids: list[int], p: SamplerParams,
            dtype: mx.Dtype | None, cancel: Callable[[], bool] | None, history_len: int,
            chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
            checkpoint: tuple[int, Callable[[], None]] | None = None, logprobs: int | None = None,
            strip: bool = True, template: CanvasTemplate | None = None) -> Iterator[Event]:
    """Prefill ``ids`` into ``cache`` (in chunks) and generate. ``checkpoint`` (k, call): call
    ``call()`` once the first k of ``ids`` are encoded (a chat session returns there later).
    ``strip``: strip the answer's surrounding whitespace (a chat answer; not a raw continuation)."""
    model, tokenizer = runtime.model, runtime.tokenizer
    C = model.args.canvas_length
    n_blocks = math.ceil(p.max_new_tokens / C)
    limit = model.args.max_position_embeddings
    if history_len + len(ids) + n_blocks * C > limit:
        raise ParameterError(f"prompt: {history_len + len(ids)} tokens plus {n_blocks} block(s) of {C} exceed "
                             f"the context of {limit}; shorten the prompt or max_new_tokens", param="max_new_tokens")
    if max(ids) >= model.args.vocab_size or min(ids) < 0:
        raise ParameterError(f"prompt: token ids must be in [0, {model.args.vocab_size})")
    if template is not None:
        template.check(model.args.vocab_size, n_blocks * C)
    if chunk_size is not None and chunk_size < 1:
        raise ParameterError(f"prefill_chunk_size: {chunk_size}; expected a positive number of tokens")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= model.args.vocab_size:
            raise ParameterError(f"logprobs: {logprobs!r}; expected an integer in [0, {model.args.vocab_size}] "
                                 "(the most likely tokens to report per position) or None", param="logprobs")
        if runtime.group is not None:  # the logits' vocabulary is split across ranks
            raise ParameterError("logprobs: not available under mlx.launch (each rank holds part of the "
                                 "vocabulary); leave it out", param="logprobs")
    dtype = dtype or runtime.activation_dtype  # the runtime precision's
    group = runtime.group
    try:
        # --memory-limit, when given, is this check's budget too (the plan's): one budget
        available, budget = runtime.prompt_budget(cache.nbytes)
        check_fits(estimate(runtime.rank_args, len(ids), cached_tokens=history_len, new_blocks=n_blocks,
                            chunk_size=chunk_size, existing_kv_bytes=cache.nbytes, dtype=dtype), len(ids),
                   available, budget)
    except MemoryBudgetError as e:
        if group is None:
            raise
        agree(e, group)  # several ranks: each checks its own memory; all stop if one must
    else:
        if group is not None:
            agree(None, group)
    reset_peak_memory()
    key = mx.random.key(p.seed if p.seed is not None else time.time_ns() % (2**63))
    t0 = time.perf_counter()
    chunked = chunk_size is not None and len(ids) > chunk_size  # progress only for prompts of several chunks
    split = min(max(checkpoint[0], 0), len(ids)) if checkpoint is not None else len(ids)
    for start, part in ((0, ids[:split]), (split, ids[split:])):
        if part:
            for done in model.prefill_chunks(mx.array([part], dtype=mx.int32), cache, dtype=dtype,
                                             chunk_size=chunk_size):
                if chunked:
                    yield PrefillProgressEvent(tokens_done=start + done, tokens_total=len(ids),
                                               seconds=time.perf_counter() - t0)
                if start + done < len(ids) and cancel is not None and cancel():
                    yield DoneEvent.cancelled(len(ids), time.perf_counter() - t0, peak_memory_bytes())
                    return
        if start == 0 and checkpoint is not None:
            checkpoint[1]()
    stats = Stats(pad_id=p.pad_token_id)  # the DoneEvent's figures, folded from the events below
    prefilled = PrefillEvent(tokens=len(ids), seconds=time.perf_counter() - t0)
    stats.add(prefilled)
    yield prefilled
    out: list[int] = []
    reason = "length"
    step_fn = runtime.step(p, dtype)  # traced once per runtime, reused by every block and answer
    for b in range(n_blocks):
        key, sub = mx.random.split(key)
        result: BlockResult | None = None
        fixed = template.block(b, C) if template is not None else None
        attempt, rerolled, empty_left = 0, False, p.empty_rerolls if b == 0 else 0
        while True:
            attempt += 1
            result, last = yield from _attempt(step_fn, cache, p, sub, b + 1, attempt, cancel, logprobs, stats, fixed)
            if result is None:
                reason = "cancelled"
                break
            # the guards that re-roll (mlx_dgemma.guards), each with a key none of the previous
            # attempt's draws used (a 3-way split): a block that ran out of steps still uncertain,
            # once (the commit guard); a first block that ends the turn before any text
            rejected = unconverged(last.stopped, last.mean_entropy, p.commit_entropy)
            if rejected and not rerolled:
                rerolled = True
            elif not rejected and empty_left and empty_answer(
                    parse_answer(tokenizer.decode(finalize_block(result.tokens, p.eos_token_id, p.pad_token_id)[0]),
                                 strip=strip).answer, result.tokens, p.eos_token_id):
                empty_left -= 1
            else:
                break
            sub = mx.random.split(sub, 3)[2]
        if reason == "cancelled":
            break
        assert result is not None
        end: str | None = None
        if rejected:  # twice unconverged: the answer ends before this block, which is never committed
            block, finished, end = [], True, "unconverged"
        else:
            block, finished = finalize_block(result.tokens, p.eos_token_id, p.pad_token_id)
            loop = loop_start(result.tokens, p.eos_token_id, p.repetition_trim, pad_id=p.pad_token_id)
            if loop is not None:  # TensorSharp's trim: the loop and all after it go, the answer ends
                block, finished, end = result.tokens[:loop], True, "repetition"
        if (finished or b + 1 == n_blocks) and p.duplicate_drop:  # the answer ends with this block
            keep = duplicate_cut(out + block, lambda ids: parse_answer(tokenizer.decode(list(ids)), strip=strip).answer,
                                 start=len(out), min_chars=p.duplicate_drop)
            if keep is not None:
                block, finished, end = block[:keep - len(out)], True, "duplicate"
        out += block
        raw = tokenizer.decode(out)
        parsed = parse_answer(raw, strip=strip)
        lp: dict[str, np.ndarray] = {}
        if result.logprobs is not None:  # the generated positions only: up to the EOS, not its padding (none: [0])
            n = next((i + 1 for i, t in enumerate(block) if t in p.eos_token_id), len(block)) if finished \
                else len(block)
            lp = dict(zip(("logprobs", "top_ids", "top_logprobs"), (_frozen(a[:n]) for a in result.logprobs)))
        committed = BlockEvent(block=b + 1, tokens=tuple(block), steps=result.steps, finished=finished,
                               text=parsed.answer, thinking=parsed.thinking, raw_text=raw, end=end, **lp)
        stats.add(committed)
        yield committed
        last_block = finished or b + 1 == n_blocks
        if not last_block:  # commit the block through the encoder: the next block's canvas reads it
            model.prefill(mx.array([block], dtype=mx.int32), cache, dtype=dtype)
        if finished:
            reason = end or "eos"
            break
    parsed: ParsedAnswer = parse_answer(tokenizer.decode(out), strip=strip)
    yield stats.done(parsed.answer, parsed.thinking, tuple(out), reason, peak_memory_bytes(), runtime.precision.label)


def _attempt(step_fn: StepFunction, cache: KVCache, p: SamplerParams, key: mx.array, block: int, attempt: int,
             cancel: Callable[[], bool] | None, logprobs: int | None, stats: Stats,
             fixed: list[tuple[int, int]] | None = None
             ) -> Generator[StepEvent, None, tuple[BlockResult | None, StepEvent | None]]:
    """One denoising of block ``block``: yields its StepEvents (``attempt`` > 1: a guard's
    re-roll), each folded into ``stats``; returns (its BlockResult, None if ``cancel`` stopped
    it; its last StepEvent)."""
    last: StepEvent | None = None
    for ev in denoise_block(step_fn, cache, p, key, block=block, logprobs=logprobs, fixed=fixed):
        if isinstance(ev, BlockResult):
            return ev, last
        if attempt > 1:
            ev = replace(ev, attempt=attempt)
        last = ev
        stats.add(ev)
        yield ev
        if cancel is not None and cancel():
            break
    return None, last


def generate(runtime: Runtime, prompt: str | list[dict[str, str]] | list[int], *mlx_lm_args: Any,
             **kwargs: Any) -> str:
    """The answer text (thought channel removed). Same arguments as :func:`stream_generate`."""
    check_runtime(runtime, "generate", mlx_lm_args)  # (model, tokenizer, prompt) gets a one-line why
    done = None
    for ev in stream_generate(runtime, prompt, **kwargs):
        if isinstance(ev, DoneEvent):
            done = ev
    assert done is not None
    return done.text
