"""One thread that owns the model: every MLX call of a front end (loading, prefill,
denoising, cache commits) happens on it, one job at a time, in arrival order.

MLX state is not shared between threads safely and a model is too large to load twice, so a
front end hands its model work to a :class:`ModelWorker` as jobs: callables run on the
worker thread, each with its own cancel flag that the work polls (``stream_generate``'s
``cancel``). Waiting jobs sit in a bounded FIFO; a job cancelled while waiting never runs
and stops counting against the bound at once (a client that left frees its place).

Turns: a job whose ``run`` returns True has more to do; it goes to the back of the rotation and
is run again after the others' turns (the server's requests, one block a turn). Up to
``max_running`` jobs take turns (1, the default: one job at a time, to its end); a new job
joins the rotation when there is room, in arrival order.

Both front ends use it. The server (``mlx_dgemma.server``) runs every request through one
and waits for the load (:meth:`ModelWorker.start`). The chat app (``tui/engine.py``) must
not block its UI on the load: it uses :meth:`ModelWorker.launch`, its load job reports
progress (and stops at :attr:`ModelWorker.stopping`, between tensors); its answers and new
chats are :meth:`submit`-ted jobs, its Escape is :meth:`Ticket.cancel`, and its quit is
:meth:`stop` without waiting, then :meth:`join` while the UI keeps drawing (the interpreter
must never exit while MLX runs on the thread: that aborted the process). No asyncio, no
Textual: the worker reports through the callables it is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .errors import DGemmaError

log = logging.getLogger("mlx_dgemma.worker")

R = TypeVar("R")


class WorkerBusy(DGemmaError):
    """The waiting queue is full; ``waiting`` jobs (none of them cancelled) are ahead."""

    def __init__(self, waiting: int):
        super().__init__(f"the model worker is busy: {waiting} jobs are waiting")
        self.waiting = waiting


class WorkerStopped(DGemmaError):
    """The worker is not running (it was stopped, or its model failed to load)."""


@dataclass(eq=False)
class Ticket:
    """One job: ``run`` is called on the worker thread with the ticket (poll ``cancelled``);
    ``skipped`` instead, if the job was cancelled before it started."""

    run: Callable[["Ticket"], Any]  # True (only): more to do, run it again after the others' turns
    skipped: Callable[["Ticket"], None] | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # run (or skipped) has returned
    started: float | None = None  # time.perf_counter() when the worker took it

    def cancel(self) -> None:
        """Ask the job to stop at its next check (or never to start)."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()


class ModelWorker(Generic[R]):
    """The thread that owns a model (or any MLX state), and its bounded FIFO of jobs.

    ``load`` runs first, on the worker thread; what it returns is :attr:`runtime`. Jobs may be
    submitted while it runs; they wait for it, and if it fails they never run (their
    ``skipped`` runs instead) and the thread ends.
    ``max_waiting`` bounds the jobs that may wait behind the running one (None: unbounded).
    ``finish`` runs last on the worker thread once it stops after a successful load (a
    sharded model's runtime tells the other ranks to exit there: see ``mlx_dgemma.lockstep``).
    ``max_running``: jobs that take turns (see the module's doc); may be changed at any time.
    """

    def __init__(self, load: Callable[[], R], *, max_waiting: int | None = None,
                 name: str = "mlx-dgemma-worker", finish: Callable[[], None] | None = None, max_running: int = 1):
        self._load = load
        self._finish = finish
        self.max_waiting = max_waiting
        self.max_running = max_running
        self._turns: deque[Ticket] = deque()  # started jobs waiting for their next turn, in turn order
        self.runtime: R | None = None
        self.current: Ticket | None = None
        self.completed = 0  # jobs run to their end (errors included), skipped ones not
        self._waiting: deque[Ticket] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    # lifecycle ------------------------------------------------------------
    def launch(self) -> None:
        """Start the thread and return at once: ``load`` runs on it, and reports its own
        progress and failure (a front end whose UI must not wait for the load)."""
        self._thread.start()

    def start(self) -> R:
        """Start the thread, run ``load`` on it and wait; its exception is raised here."""
        self.launch()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self.runtime  # type: ignore[return-value]

    def cancel_all(self) -> None:
        """Cancel the running job (at its next check) and every waiting one; the worker goes on."""
        with self._cv:
            for t in (*self._waiting, *self._turns):
                t.cancel()
            if self.current is not None:
                self.current.cancel()

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel the running and waiting jobs, let the thread end and wait for it (bounded).
        Returns whether it ended (a job stuck inside one MLX call may outlast ``timeout``).
        ``timeout=0`` only asks: a caller that must keep serving (a UI) then polls
        :attr:`running` or calls :meth:`join`. A load still running stops where it checks
        :attr:`stopping`."""
        with self._cv:
            self._stopping = True
            for t in (*self._waiting, *self._turns):
                t.cancel()
            if self.current is not None:
                self.current.cancel()
            self._cv.notify_all()
        return self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the thread to end; whether it has (or never began)."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def started(self) -> bool:
        """The load has returned (or failed)."""
        return self._ready.is_set()

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called: a load polls this between its pieces and gives up
        (raising :class:`WorkerStopped`), as jobs poll their ticket's ``cancelled``."""
        return self._stopping

    @property
    def running(self) -> bool:
        """The thread is alive: loading, serving, or finishing its current job after :meth:`stop`
        (:attr:`alive` says whether it takes jobs)."""
        return self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._load_error is None and not self._stopping

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self._turns)

    @property
    def waiting(self) -> int:
        """Jobs waiting for their first turn, not counting those cancelled while waiting."""
        with self._cv:
            return sum(1 for t in self._waiting if not t.cancelled)

    @property
    def in_progress(self) -> int:
        """Jobs started and not finished: the one running and those waiting for their next turn."""
        with self._cv:
            return len(self._turns) + (self.current is not None)

    @property
    def running_seconds(self) -> float:
        """How long the running job has run (0 when idle)."""
        cur = self.current
        return time.perf_counter() - cur.started if cur is not None and cur.started is not None else 0.0

    # jobs -----------------------------------------------------------------
    def submit(self, run: Callable[[Ticket], Any], *, skipped: Callable[[Ticket], None] | None = None,
               cancel: threading.Event | None = None, bypass_limit: bool = False) -> Ticket:
        """Queue a job; :class:`WorkerBusy` when ``max_waiting`` live jobs already wait (unless
        ``bypass_limit``: the front end's own work, e.g. the server's warm-up),
        :class:`WorkerStopped` when the worker is not running. ``cancel``: the job's cancel
        flag, where the caller already has one (a new one otherwise)."""
        ticket = Ticket(run, skipped) if cancel is None else Ticket(run, skipped, cancel)
        with self._cv:
            if not self.alive:
                raise WorkerStopped("the model worker is not running")
            if self.max_waiting is not None and not bypass_limit:
                live = [t for t in self._waiting if not t.cancelled]
                if len(live) >= self.max_waiting:
                    raise WorkerBusy(len(live))
            self._waiting.append(ticket)
            self._cv.notify()
        return ticket

    def _next(self) -> Ticket | None:
        with self._cv:
            while True:
                # a new job joins the rotation at its end while there is room
                if self._waiting and len(self._turns) < max(1, self.max_running):
                    ticket = self._waiting.popleft()
                    if ticket.cancelled:  # cancelled while it waited: skipped, never run
                        return ticket
                    self._turns.append(ticket)
                    continue
                if self._turns:
                    ticket = self._turns.popleft()
                    if ticket.cancelled and ticket.started is None:  # cancelled before its first turn
                        return ticket
                    self.current = ticket  # under the lock: a stop() from now on cancels it
                    return ticket
                if self._stopping:
                    return None
                self._cv.wait()

    def _main(self) -> None:
        try:
            self.runtime = self._load()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that called start()
            with self._cv:  # under the lock: no job slips in after the drain (alive is False now)
                self._load_error = e
                left = list(self._waiting)
                self._waiting.clear()
            self._ready.set()
            for ticket in left:  # submitted while loading: they never run
                ticket.cancel()
                self._skip(ticket)
            return
        self._ready.set()
        try:
            self._loop()
        finally:
            if self._finish is not None:
                try:
                    self._finish()
                except Exception:  # noqa: BLE001 - the thread ends anyway
                    log.exception("finish failed")

    def _loop(self) -> None:
        while True:
            ticket = self._next()
            if ticket is None:
                return
            if ticket.cancelled and self.current is not ticket:  # cancelled while it waited
                self._skip(ticket)
                continue
            more = False
            try:
                if ticket.started is None:
                    ticket.started = time.perf_counter()
                cancelled = ticket.cancelled  # before this turn: the turn is the job's chance to see it
                try:
                    more = ticket.run(ticket) is True  # only True: a callable returning anything else is done
                    if more and cancelled:
                        # a job that asks for more turns after a whole turn with its cancel set would
                        # hold the model for ever (a test job once did, for the rest of the suite)
                        log.warning("a cancelled job asked for another turn; it is ended")
                        more = False
                finally:
                    if not more:
                        self.completed += 1
            except Exception:  # noqa: BLE001 - one failing job must not stop the worker
                log.exception("job failed")
            finally:
                with self._cv:
                    self.current = None
                    if more:  # to the back of the rotation: the others' turns first
                        self._turns.append(ticket)
                if not more:
                    ticket.done.set()

    def _skip(self, ticket: Ticket) -> None:
        """A job cancelled before it started: its ``skipped`` runs instead, then it is done."""
        try:
            if ticket.skipped is not None:
                ticket.skipped(ticket)
        except Exception:  # noqa: BLE001 - one failing callback must not stop the worker
            log.exception("skipped callback failed")
        finally:
            ticket.done.set()
