"""A front end's model work on several ranks: rank 0 leads, the others follow in lockstep.

Under ``mlx.launch`` every rank holds a slice of the model (:mod:`mlx_dgemma.distributed`),
so every rank must run every model call, in the same order, with the same inputs: the
collectives inside the sharded model keep them in step, and a rank that skips one leaves the
others blocked in it. A front end (the server, the chat app) runs on rank 0 only; it does
its model work through a :class:`ModelRuntime`, which first broadcasts each operation (a
generation: the prompt, the sampler parameters, the seed; a chat turn; a new chat; the
shutdown) to the other ranks. They run :meth:`ModelRuntime.follow`: receive an operation,
run the same core call, repeat.

Cancellation is decided collectively: the cancel check the core polls between prefill
chunks and denoising steps is rank 0's answer, broadcast (one 4-byte all-reduce per poll), so
every rank stops at the same step. When rank 0's consumer stops iterating early (a stop
string, an error in the front end), its stream is not abandoned mid-way: the next poll says
"cancel" on every rank and rank 0 runs the generator to its end, as the followers do.

In one process (no group) a :class:`ModelRuntime` calls the core directly: no broadcast, no
wrapper, the same events as calling ``stream_generate`` / :class:`ChatSession` yourself.

Broadcast: an ``all_sum`` of a buffer that is zero on ranks > 0 (a fixed 8-byte header with
the payload's length, then the JSON payload as bytes); the ring backend has no broadcast.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import mlx.core as mx
import numpy as np

from .errors import DGemmaError
from .events import Event

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger("mlx_dgemma.lockstep")


class Lockstep:
    """Rank 0's decisions, made the same on every rank of ``group``."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank = group.rank()

    def _sum(self, a: mx.array) -> mx.array:
        out = mx.distributed.all_sum(a, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def broadcast(self, op: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0 passes ``op`` (JSON-serialisable); every rank returns it."""
        data = json.dumps(op).encode() if self.rank == 0 else b""
        n = int(self._sum(mx.array([len(data)], dtype=mx.int64)).item())
        if not n:
            return {}
        buf = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.rank == 0 else mx.zeros((n,), dtype=mx.uint8)
        return json.loads(np.array(self._sum(buf)).tobytes().decode())

    def decide(self, value: int) -> int:
        """Rank 0's ``value`` (a small int) on every rank (the others' ``value`` is ignored)."""
        flag = int(value) if self.rank == 0 else 0
        return int(self._sum(mx.array([flag], dtype=mx.int32)).item())


# what a cancel poll broadcasts: go on, stop (the front end cancelled), stop because rank 0's
# consumer left the stream (a chat turn then did not happen, as in one process)
GO, CANCEL, LEFT = 0, 1, 2


class ModelRuntime:
    """The model calls a front end makes (generations, chat turns, new chats), run on every
    rank when the model is sharded.

    Rank 0 calls :meth:`generate`, :meth:`chat`, :meth:`new_chat` and, when it stops,
    :meth:`shutdown`; ranks > 0 call :meth:`follow`, which returns after the shutdown. All of
    it from one thread per process (the thread that owns the model).
    """

    def __init__(self, runtime: Runtime, generation_config: dict[str, Any] | None = None):
        self.runtime = runtime
        self.generation_config = dict(generation_config if generation_config is not None
                                      else runtime.generation_config)
        group = runtime.group
        self.lockstep = Lockstep(group) if group is not None else None
        self.session: Any = None  # the current ChatSession (:meth:`new_chat`)
        self.closed = False

    @property
    def leader(self) -> bool:
        return self.lockstep is None or self.lockstep.rank == 0

    # rank 0's calls ------------------------------------------------------
    def generate(self, prompt: str | list[dict[str, str]] | list[int], *, cancel: Callable[[], bool] | None = None,
                 enable_thinking: bool = False, chat: bool = True, **params: Any) -> Iterator[Event]:
        """``stream_generate`` with this runtime's generation config (every rank runs it)."""
        return self._lead({"op": "generate", "prompt": prompt, "enable_thinking": enable_thinking, "chat": chat,
                           "params": params}, cancel)

    def new_chat(self, *, enable_thinking: bool = False, system: str | None = None,
                 messages: list[dict[str, str]] | None = None) -> None:
        """Start a new :class:`ChatSession` (every rank), optionally with earlier ``messages``."""
        self._lead_call({"op": "new_chat", "enable_thinking": enable_thinking, "system": system,
                         "messages": messages})

    def chat(self, user: str, *, cancel: Callable[[], bool] | None = None, enable_thinking: bool | None = None,
             messages: list[dict[str, str]] | None = None, **params: Any) -> Iterator[Event]:
        """The next turn of the current session (:meth:`new_chat` first): ``session.stream``.
        ``enable_thinking`` and ``messages`` (the conversation before ``user``) replace the
        session's when given."""
        return self._lead({"op": "chat", "user": user, "enable_thinking": enable_thinking, "messages": messages,
                           "params": params}, cancel)

    def shutdown(self) -> None:
        """Tell the followers to return from :meth:`follow` (once; nothing in one process)."""
        if self.lockstep is not None and self.leader and not self.closed:
            self.closed = True
            self.lockstep.broadcast({"op": "shutdown"})

    # every rank ---------------------------------------------------------------
    def _new_chat(self, op: dict[str, Any]) -> None:
        from .generation import ChatSession

        self.session = ChatSession(self.runtime, self.generation_config,
                                   enable_thinking=bool(op.get("enable_thinking")), system=op.get("system"))
        if op.get("messages") is not None:
            self.session.messages = [dict(m) for m in op["messages"]]

    def _events(self, op: dict[str, Any], cancel: Callable[[], bool] | None) -> Iterator[Event]:
        from .generation import stream_generate

        if op["op"] == "generate":
            return stream_generate(self.runtime, op["prompt"], generation_config=self.generation_config,
                                   enable_thinking=op["enable_thinking"], chat=op["chat"], cancel=cancel,
                                   **op["params"])
        if self.session is None:
            self._new_chat({})
        if op.get("enable_thinking") is not None:
            self.session.enable_thinking = bool(op["enable_thinking"])
        if op.get("messages") is not None:
            self.session.messages = [dict(m) for m in op["messages"]]
        return self.session.stream(op["user"], cancel=cancel, **op["params"])

    def _seeded(self, op: dict[str, Any]) -> dict[str, Any]:
        """``op`` with a seed where it would have none: every rank must draw the same noise."""
        from dataclasses import fields

        from .sampler import SamplerParams

        params = op["params"]
        # the sampler's own fields only: the others (logprobs, template) are stream_generate's
        sampler = {f.name for f in fields(SamplerParams)}
        params_in = {k: v for k, v in params.items() if k in sampler}
        try:
            if op["op"] == "generate":
                seed = SamplerParams.from_config(self.generation_config, **params_in).seed
            else:
                seed = (self.session.params if self.session is not None
                        else SamplerParams.from_config(self.generation_config)).with_overrides(**params_in).seed
        except DGemmaError:
            return op  # every rank raises the same error when it runs
        if seed is None:
            op = {**op, "params": {**params, "seed": time.time_ns() % (2**63)}}
        return op

    def _lead(self, op: dict[str, Any], cancel: Callable[[], bool] | None) -> Iterator[Event]:
        if self.lockstep is None:  # one process: the core's own generator, untouched
            return self._events(op, cancel)
        return self._lead_ranks(op, cancel)

    def _lead_ranks(self, op: dict[str, Any], cancel: Callable[[], bool] | None) -> Iterator[Event]:
        # a generator: nothing is broadcast until the consumer asks for the first event
        ls = self.lockstep
        assert ls is not None and self.leader
        left = threading.Event()  # the consumer stopped iterating (or failed)
        said: list[int] = []

        def check() -> bool:
            said.append(ls.decide(LEFT if left.is_set() else CANCEL if cancel is not None and cancel() else GO))
            return said[-1] != GO

        op = self._seeded(op)
        ls.broadcast(op)
        events = self._events(op, check)
        before = self._before(op)
        try:
            for ev in events:  # not ``yield from``: closing us must not close ``events`` mid-way
                yield ev
        finally:
            # every rank polls the same cancel checks: from the next one on they all say stop,
            # and rank 0 runs the generator to its end as the followers do
            left.set()
            for _ in events:
                pass
            if LEFT in said:  # the followers saw it too: they undo the turn as well
                self._undo(before)

    def _before(self, op: dict[str, Any]) -> Any:
        """What a chat turn that its consumer leaves must leave behind: the messages before it."""
        return None if op["op"] != "chat" or self.session is None else list(self.session.messages)

    def _undo(self, before: Any) -> None:
        """A turn whose consumer left did not happen (as ``ChatSession.stream`` does when its
        consumer stops iterating): the messages before it, the cache encoded afresh next turn."""
        if self.session is not None and before is not None:
            self.session.messages = before
            self.session.history = []

    def _lead_call(self, op: dict[str, Any]) -> None:
        if self.lockstep is not None:
            self.lockstep.broadcast(op)
        self._new_chat(op)

    def follow(self) -> None:
        """Ranks > 0: run what rank 0 broadcasts until it shuts down."""
        assert self.lockstep is not None and not self.leader
        ls = self.lockstep
        while True:
            op = ls.broadcast(None)
            kind = op.get("op")
            if kind == "shutdown":
                return
            if kind == "new_chat":
                self._new_chat(op)
                continue
            said: list[int] = []

            def check() -> bool:
                said.append(ls.decide(GO))
                return said[-1] != GO

            try:
                events = self._events(op, check)
                before = self._before(op)
                for _ in events:
                    pass
                if LEFT in said:
                    self._undo(before)
            except DGemmaError:
                pass  # rank 0 meets the same error and reports it
            except Exception:  # noqa: BLE001 - the follower goes on with the next operation
                log.exception("operation %s failed on rank %d", kind, ls.rank)


def run_follower(runtime: Runtime, command: str) -> NoReturn:
    """A rank > 0 of a front end (``chat``, ``serve``) once its slices are loaded: run every
    model call rank 0 makes until it shuts down, then end the process at once (``os._exit``:
    no C++ static destructors racing MLX state at exit). If rank 0 is gone without a word, the
    ring's connection breaks: one line (``mlx-dgemma COMMAND: error: ...``), exit 1."""
    import os
    import sys

    code = 0
    try:
        ModelRuntime(runtime).follow()
    except Exception as e:  # noqa: BLE001 - the ring broke: rank 0 is gone
        print(f"mlx-dgemma {command}: error: lost rank 0 ({type(e).__name__}: {e}); this rank stops",
              file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)
