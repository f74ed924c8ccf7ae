"""The blocking Engine against its close: every call on any thread ends, whatever the
interleaving (each race window held open on an Event); one loop per AsyncEngine; timeouts."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from bus import RpcClient
from messages import AbortReq, Request, SamplingParams
from scheduler import AsyncEngine, Engine, EngineClosed, ModelConfig, RequestFailed
from scheduler.engine import async_engine

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
LONG = SamplingParams(max_new_tokens=100_000)
WAIT = 20.0  # seconds a condition that must come is polled for


class _Call(threading.Thread):
    """``fn()`` on a thread of its own: its outcome (a value or the exception) in ``got``."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.got: list[object] = []

    def run(self) -> None:
        try:
            self.got.append(self.fn())
        except BaseException as exc:  # the outcome under test
            self.got.append(exc)

    def outcome(self) -> object:
        """Its outcome, waited for up to WAIT seconds (failing if it never ends)."""
        self.join(WAIT)
        assert not self.is_alive(), "the call never returned"
        return self.got[0]


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)  # sleep-ok: pacing of a deadline poll


def test_a_call_in_the_window_between_the_loops_stop_and_its_close_is_refused() -> None:
    engine = Engine("ring", SMALL)
    in_window, go = threading.Event(), threading.Event()
    real_close = engine._loop.close

    def held_close() -> None:  # the loop is stopped; hold it open, not closed yet
        in_window.set()
        go.wait(WAIT)
        real_close()

    engine._loop.close = held_close  # type: ignore[method-assign]
    closer = _Call(engine.close)
    closer.start()
    try:
        assert in_window.wait(WAIT)
        caller = _Call(lambda: engine.collective_rpc("get_load"))
        caller.start()
        assert isinstance(caller.outcome(), EngineClosed)
    finally:
        go.set()
    assert closer.outcome() is None
    assert engine._loop.is_closed() and not engine._loop_thread.is_alive()


def test_a_call_still_running_when_the_loop_stops_ends_with_engine_closed() -> None:
    engine = Engine("ring", SMALL)
    started = threading.Event()

    async def never_answered(timeout: float = 30.0) -> str:  # (a call the close does not end)
        started.set()
        await asyncio.Event().wait()
        return ""

    engine._core.metrics = never_answered  # type: ignore[method-assign]
    caller = _Call(engine.metrics)
    caller.start()
    assert started.wait(WAIT)
    engine.close()
    got = caller.outcome()
    assert isinstance(got, EngineClosed) and "closed before the call finished" in str(got)
    with pytest.raises(EngineClosed):
        engine.collective_rpc("get_load")


def test_a_submit_waiting_for_room_ends_at_once_when_another_thread_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine("ring", SMALL)
    # A retry far past the test's deadline: only the close can wake the waiting submits.
    monkeypatch.setattr(async_engine, "_RETRY_S", 3600.0)
    refused = threading.Semaphore(0)

    def full(reqs: Sequence[Request]) -> int:
        refused.release()
        return 0

    engine._core._send_nowait = full  # type: ignore[method-assign]
    submits = [_Call(lambda: engine.submit([1, 2], SamplingParams(max_new_tokens=2)))
               for _ in range(3)]
    for call in submits:
        call.start()
    for _ in submits:
        assert refused.acquire(timeout=WAIT)  # each waits for room
    engine.close()
    for call in submits:
        assert isinstance(call.outcome(), EngineClosed)
    assert engine.pending == 0


def test_close_from_two_threads_waits_for_the_one_close() -> None:
    engine = Engine("ring", SMALL)
    handle = engine.submit([1, 2], LONG)
    run_dir = engine._core._dir
    held, go = threading.Event(), threading.Event()
    scheduler = engine._core._scheduler
    real_stop = scheduler.stop

    def held_stop(rpc: RpcClient, timeout: float) -> None:  # the first close, held inside
        held.set()  # its core close
        go.wait(WAIT)
        real_stop(rpc, timeout)

    scheduler.stop = held_stop  # type: ignore[method-assign]
    first = _Call(engine.close)
    first.start()
    try:
        assert held.wait(WAIT)
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
            engine.close(timeout=0.05)  # bounded by its own timeout
        second_waits = threading.Event()
        done = engine._closed_done
        real_wait = done.wait

        def watched_wait(timeout: float | None = None) -> bool:
            second_waits.set()
            return real_wait(timeout)

        done.wait = watched_wait  # type: ignore[method-assign]
        second = _Call(engine.close)
        second.start()
        assert second_waits.wait(WAIT)  # the second waits for the first's close
        assert engine._loop_thread.is_alive()  # and stopped nothing
    finally:
        go.set()
    assert first.outcome() is None and second.outcome() is None
    with pytest.raises((RequestFailed, EngineClosed)):
        handle.result(WAIT)  # a terminal answer
    assert not engine._loop_thread.is_alive() and not os.path.exists(run_dir)


def test_an_async_engine_refuses_another_loop_at_once_naming_both() -> None:
    loop_a = asyncio.new_event_loop()
    thread = threading.Thread(target=loop_a.run_forever, daemon=True)
    thread.start()
    engine = AsyncEngine("ring", SMALL)
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), loop_a).result(WAIT)

        async def submitted() -> async_engine.AsyncRequest:
            return engine.submit([1, 2], SamplingParams(max_new_tokens=2))

        request = asyncio.run_coroutine_threadsafe(submitted(), loop_a).result(WAIT)

        async def from_loop_b(work: Callable[[], Any]) -> object:
            return await asyncio.wait_for(work(), WAIT)

        for work in (lambda: engine.generate([1, 2], SamplingParams(max_new_tokens=2)),
                     lambda: request,
                     lambda: engine.collective_rpc("get_load")):
            t0 = time.monotonic()
            with pytest.raises(RuntimeError,
                               match=r"started on event loop <.*called from event loop <"):
                asyncio.run(from_loop_b(work))
            assert time.monotonic() - t0 < WAIT / 2
    finally:
        asyncio.run_coroutine_threadsafe(engine.close(), loop_a).result(WAIT)
        loop_a.call_soon_threadsafe(loop_a.stop)
        thread.join(WAIT)
        loop_a.close()


def test_an_async_engine_refuses_a_later_loop_on_its_own_thread() -> None:
    """The engine's loop stopped, another loop runs on the same thread: a call from it
    is refused as one from any other loop (the thread alone does not say which loop)."""
    loop_a = asyncio.new_event_loop()
    engine = AsyncEngine("ring", SMALL)
    try:
        loop_a.run_until_complete(engine.start())

        async def from_loop_b() -> object:
            return await asyncio.wait_for(
                engine.generate([1, 2], SamplingParams(max_new_tokens=2)), WAIT)

        t0 = time.monotonic()
        with pytest.raises(RuntimeError,
                           match=r"started on event loop <.*called from event loop <"):
            asyncio.run(from_loop_b())
        assert time.monotonic() - t0 < WAIT / 2
    finally:
        loop_a.run_until_complete(engine.close())
        loop_a.close()


def test_timeouts_generate_aborts_and_a_handles_result_keeps_the_request() -> None:
    with Engine("ring", SMALL, max_batch=4) as engine:
        with pytest.raises(TimeoutError):
            engine.generate([1, 2], LONG, rid="gen-timeout", timeout=0.05)
        _until(lambda: engine.pending == 0, "the timed-out generate was aborted")
        handle = engine.submit([1, 2], LONG, stream=True, rid="kept")
        with pytest.raises(TimeoutError, match=r"request 'kept': no whole answer within"):
            handle.result(timeout=0.05)
        assert engine.pending == 1  # still running: the caller's to keep
        engine.abort("kept")
        result = handle.result(WAIT)
        assert result.finish_reason == "abort" and len(result.token_ids) > 0


def test_an_abort_of_a_submit_waiting_for_room_is_answered_and_never_sent() -> None:
    with Engine("ring", SMALL) as engine:
        offered: list[Request] = []
        full = threading.Event()
        full.set()
        refused = threading.Event()
        real = engine._core._send_nowait

        def gated(reqs: Sequence[Request]) -> int:
            offered.extend(reqs)
            if full.is_set():
                refused.set()
                return 0
            return real(reqs)

        engine._core._send_nowait = gated  # type: ignore[method-assign]
        submit = _Call(lambda: engine.submit([1, 2], LONG, rid="held-1"))
        submit.start()
        assert refused.wait(WAIT)
        engine.abort("held-1")
        handle = submit.outcome()
        full.clear()
        assert not isinstance(handle, BaseException), handle
        result = handle.result(WAIT)  # type: ignore[attr-defined]
        assert result.finish_reason == "abort" and result.token_ids == []
        assert not any(isinstance(r, AbortReq) for r in offered)  # nothing to abort
        assert engine.pending == 0
        assert len(engine.generate([1, 2], SamplingParams(max_new_tokens=2),
                                   rid="held-1").token_ids) == 2
