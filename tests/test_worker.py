"""The core's model worker (mlx_dgemma/worker.py): one thread, jobs in order, a bounded queue
that counts only live jobs, cancellation before and during a job, a stop that joins."""

from __future__ import annotations

import threading

import pytest

from mlx_dgemma.worker import ModelWorker, WorkerBusy, WorkerStopped


def test_jobs_run_in_order_on_the_worker_thread():
    threads, order = set(), []
    w = ModelWorker(lambda: threads.add(threading.get_ident()) or "runtime")
    assert w.start() == "runtime" and w.runtime == "runtime"
    tickets = [w.submit(lambda t, i=i: (order.append(i), threads.add(threading.get_ident()))) for i in range(5)]
    assert all(t.done.wait(10) for t in tickets)
    assert order == list(range(5)) and len(threads) == 1 and threading.get_ident() not in threads
    assert w.stop() and not w.alive
    with pytest.raises(WorkerStopped):
        w.submit(lambda t: None)


def test_load_errors_are_raised_by_start():
    def fail():
        raise ValueError("no model here")

    w = ModelWorker(fail)
    with pytest.raises(ValueError, match="no model here"):
        w.start()
    assert not w.alive


def test_cancelled_waiters_never_run_and_free_their_place():
    gate, ran, skipped = threading.Event(), [], []
    w = ModelWorker(lambda: None, max_waiting=2)
    w.start()
    began = threading.Event()
    running = w.submit(lambda t: (began.set(), gate.wait(10)))
    assert began.wait(10)
    a = w.submit(lambda t: ran.append("a"), skipped=lambda t: skipped.append("a"))
    w.submit(lambda t: ran.append("b"))
    with pytest.raises(WorkerBusy) as e:
        w.submit(lambda t: ran.append("c"))
    assert e.value.waiting == 2
    a.cancel()
    assert w.waiting == 1
    d = w.submit(lambda t: ran.append("d"))  # a's place is free at once
    gate.set()
    assert d.done.wait(10) and running.done.is_set()
    assert ran == ["b", "d"] and skipped == ["a"]
    w.stop()


def test_a_failing_job_does_not_stop_the_worker():
    w = ModelWorker(lambda: None)
    w.start()
    bad = w.submit(lambda t: 1 / 0)
    good = w.submit(lambda t: None)
    assert bad.done.wait(10) and good.done.wait(10) and w.alive
    w.stop()


def test_stop_cancels_the_running_job_and_joins():
    started, seen = threading.Event(), []

    def long_job(t):
        started.set()
        while not t.cancelled:
            t.cancel_event.wait(0.01)
        seen.append("stopped at a check")

    w = ModelWorker(lambda: None)
    w.start()
    w.submit(long_job)
    assert started.wait(10)
    assert w.stop(timeout=10) and seen == ["stopped at a check"]


def test_finish_runs_last_on_the_worker_thread_and_not_after_a_failed_load():
    # a sharded model's runtime tells the other ranks to leave there (mlx_dgemma.lockstep)
    seen = []
    w = ModelWorker(lambda: None, finish=lambda: seen.append(threading.current_thread().name), name="w")
    w.start()
    w.submit(lambda t: seen.append("job")).done.wait(5)
    assert w.stop() and seen == ["job", "w"]

    def fail():
        raise ValueError("no model")

    w = ModelWorker(fail, finish=lambda: seen.append("finish"))
    with pytest.raises(ValueError):
        w.start()
    w.stop()
    assert seen == ["job", "w"]


def test_launch_returns_at_once_and_jobs_wait_for_the_load():
    # the chat app's way: its UI must not wait for the load; a message sent meanwhile waits
    gate, order = threading.Event(), []
    w = ModelWorker(lambda: (gate.wait(10), order.append("load"))[1])
    w.launch()
    assert not w.started and w.alive and w.running
    job = w.submit(lambda t: order.append("job"))
    assert not job.done.wait(0.2)
    gate.set()
    assert job.done.wait(10) and order == ["load", "job"]
    assert w.stop() and not w.running


def test_after_a_failed_load_the_waiting_jobs_are_skipped_and_the_thread_ends():
    gate, ran, skipped = threading.Event(), [], []

    def fail():
        gate.wait(10)
        raise ValueError("no model")

    w = ModelWorker(fail)
    w.launch()
    job = w.submit(lambda t: ran.append("job"), skipped=lambda t: skipped.append(t.cancelled))
    gate.set()
    assert job.done.wait(10) and ran == [] and skipped == [True]
    assert w.join(10) and not w.alive
    with pytest.raises(WorkerStopped):
        w.submit(lambda t: None)


def test_a_load_stops_where_it_checks_stopping_and_stop_0_does_not_wait():
    # Ctrl+Q during the chat app's load: stop() only asks; the load gives up between tensors
    began, release, pieces = threading.Event(), threading.Event(), []

    def load():
        for i in range(1000):
            began.set()
            release.wait(10)  # one tensor; the check comes between tensors
            if w.stopping:
                raise WorkerStopped("stopped while loading")
            pieces.append(i)

    w = ModelWorker(load)
    w.launch()
    assert began.wait(10)
    assert w.stop(timeout=0) is False and w.stopping and w.running  # asked, not waited for
    release.set()
    assert w.join(10) and pieces == []
    with pytest.raises(WorkerStopped):
        w.submit(lambda t: None)


def test_a_stop_right_after_a_job_is_taken_still_cancels_it():
    # the job leaves the queue and becomes the current one under the same lock: a stop() at
    # that moment cannot miss it (it would run to its end, and Ctrl+Q would wait for all of it)
    w = ModelWorker(lambda: None)
    real_next = w._next

    def next_then_stop():
        ticket = real_next()
        if ticket is not None:
            w.stop(timeout=0)  # Ctrl+Q between taking the job and running it
        return ticket

    w._next = next_then_stop
    w.start()
    ran = []
    job = w.submit(lambda t: ran.append(t.cancelled))
    assert job.done.wait(10) and ran == [True]
    assert w.join(10)


def test_jobs_take_turns_up_to_max_running():
    # issue 31: a job that returns True has more to do and goes to the back of the rotation, so a
    # short job waits for one turn of each running one, not for a long one's end
    order: list[str] = []
    gate = threading.Event()
    w = ModelWorker(lambda: None, max_running=2)
    w.start()
    began = threading.Event()
    hold = w.submit(lambda t: (began.set(), gate.wait(10)))  # keeps the worker while the others are queued
    assert began.wait(10)
    turns = {"long": 3}

    def long(t):
        order.append("long")
        turns["long"] -= 1
        return turns["long"] > 0

    lt = w.submit(long)
    short = w.submit(lambda t: order.append("short"))
    third = w.submit(lambda t: order.append("third"))  # waits for room: two are taking turns
    assert w.waiting == 3
    gate.set()
    assert all(t.done.wait(10) for t in (hold, lt, short, third))
    assert order == ["long", "short", "long", "third", "long"]
    assert w.completed == 4
    w.stop()


def test_a_job_cancelled_before_its_first_turn_never_runs():
    gate, ran, skipped = threading.Event(), [], []
    w = ModelWorker(lambda: None, max_running=3)
    w.start()
    w.submit(lambda t: gate.wait(10) and None)  # True would ask for another turn, forever
    a = w.submit(lambda t: ran.append("a"), skipped=lambda t: skipped.append("a"))
    a.cancel()
    gate.set()
    assert a.done.wait(10) and ran == [] and skipped == ["a"]
    w.stop()


def test_a_cancelled_job_that_asks_for_more_turns_is_ended():
    # a job returning True after its cancel (it never polls it) was given turns for ever: the
    # worker span, and stop() could not end it; it now gets one turn to see the cancel, no more
    turns = []
    w = ModelWorker(lambda: None)
    w.start()
    stubborn = w.submit(lambda t: turns.append(t.cancelled) or True)
    while not turns:
        threading.Event().wait(0.01)
    stubborn.cancel()
    assert stubborn.done.wait(10), "the cancelled job is still taking turns"
    # one whole turn after the cancel (two where it landed between the worker's look and the job's)
    assert turns[-1] is True and 1 <= turns.count(True) <= 2
    after = w.submit(lambda t: None)
    assert after.done.wait(10)
    assert w.stop()
