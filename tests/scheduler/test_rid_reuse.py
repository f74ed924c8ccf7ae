"""A rid reused once its request ended is answered: late cancels act by identity, never by rid.

Both engine modes (ring, zmq). Before the fix, a stream or an awaited
request left *after* its final answer had arrived forgot the rid and sent an
abort for it, which removed and aborted the new request holding the rid:
that one was never answered, even by ``close()``.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from messages import SamplingParams
from scheduler import AsyncEngine, ModelConfig, Overloaded
from scheduler.core.admission import Limits
from scheduler.engine.async_engine import AsyncRequest
from scheduler.engine.handles import Item

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
SP = SamplingParams(max_new_tokens=8)
ANSWER_S = 20.0  # generous: a loaded 2-core box; the failure mode is "never"


# One engine per mode for the module's rid tests (a zmq start is a process start, seconds
# on a busy 2-core host). Each rid test uses its own rids and leaves the engine with
# nothing pending (checked after each by ``engine``), as the next one expects.
@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["ring", "zmq"])
async def shared_engine(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(request.param, SMALL, max_batch=16) as e:
        yield e


@pytest_asyncio.fixture(loop_scope="module")
async def engine(shared_engine: AsyncEngine) -> AsyncIterator[AsyncEngine]:
    """The module's engine of the test's mode, idle before and after the test."""
    await _until(lambda: shared_engine.pending == 0, "the engine to be idle before the test")
    yield shared_engine
    await _until(lambda: shared_engine.pending == 0, "every request of the test to end")


async def _until(cond: Any, what: str, timeout: float = ANSWER_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)  # sleep-ok: pacing of a deadline poll


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stream_left_after_its_final_answer_spares_the_rid_s_next_request(
        engine: AsyncEngine) -> None:
    stream = engine.stream([5, 6, 7], SP, rid="again")
    first = await stream.__anext__()
    assert first.finish_reason is None
    # Its final answer arrives (buffered, unread): the rid is free again.
    await _until(lambda: engine.pending == 0, "the first request's final answer")
    second = engine.submit([5, 6, 7], SP, rid="again")
    await stream.aclose()  # type: ignore[attr-defined]  # leaves after its final answer: must neither forget nor abort
    result = await asyncio.wait_for(second, ANSWER_S)
    assert result.finish_reason == "length" and len(result.token_ids) == 8


@pytest.mark.asyncio(loop_scope="module")
async def test_an_await_cancelled_after_its_answer_spares_the_rid_s_next_request(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    first = engine.submit([1, 2, 3], SP, rid="twice")
    seconds: list[AsyncRequest] = []

    async def wait_first() -> object:
        return await first

    # Run as the answer is handed over, before the task's wake-up: the rid is
    # free, the task not yet resumed.
    put = AsyncRequest.put

    def on_answer(request: AsyncRequest, item: Item) -> None:
        put(request, item)
        if request is first:
            seconds.append(engine.submit([1, 2, 3], SP, rid="twice"))
            task.cancel()

    monkeypatch.setattr(AsyncRequest, "put", on_answer)
    task = asyncio.ensure_future(wait_first())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(seconds) == 1
    result = await asyncio.wait_for(seconds[0], ANSWER_S)
    assert result.finish_reason == "length" and len(result.token_ids) == 8


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stream_left_mid_way_is_still_aborted(engine: AsyncEngine) -> None:
    """The identity check keeps the abort for a request that has not ended."""
    stream = engine.stream([4, 4], SamplingParams(max_new_tokens=2000), rid="long")
    await stream.__anext__()
    await stream.aclose()  # type: ignore[attr-defined]
    await _until(lambda: engine.pending == 0, "the abort's terminal answer")
    again = await asyncio.wait_for(engine.generate([4, 4], SP, rid="long"), ANSWER_S)
    assert again.finish_reason == "length"


@pytest.mark.asyncio
async def test_fire_and_forget_failures_are_counted_not_logged() -> None:
    """An Overloaded answer nobody awaits is counted, never a "never retrieved" log."""
    contexts: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: contexts.append(ctx))
    try:
        async with AsyncEngine("ring", SMALL, max_batch=1,
                               limits=Limits(max_queued_requests=1)) as engine:
            awaited = [engine.submit([3, 3], SamplingParams(max_new_tokens=64))
                       for _ in range(20)]
            for _ in range(200):
                engine.submit([3, 3], SamplingParams(max_new_tokens=64))  # dropped at once
            failed = 0
            for req in awaited:  # these are awaited: they raise, as ever
                try:
                    await asyncio.wait_for(req, ANSWER_S)
                except Overloaded:
                    failed += 1
            assert failed > 0
            await _until(lambda: engine.pending == 0, "every request's answer")
            del awaited, req
            gc.collect()
            assert engine.unawaited_failures > 0
            assert engine.unawaited_failures <= 200
    finally:
        loop.set_exception_handler(None)
    gc.collect()
    assert not [c for c in contexts if "never retrieved" in str(c.get("message"))]


@pytest.mark.asyncio
async def test_an_explicit_abort_waiting_for_room_spares_the_rid_s_next_request() -> None:
    # Without this: an abort() of a request that had ended, kept for a retry by
    # a full channel, was sent after a new request reused the rid, and aborted it.
    async with AsyncEngine("ring", SMALL, max_batch=16) as engine:
        assert (await engine.generate([1, 2], SP, rid="v")).finish_reason == "length"
        running = engine.stream([1, 2], SamplingParams(max_new_tokens=100_000), rid="w")
        await anext(running)  # w is running
        ring = engine._ingress
        assert ring is not None
        real = ring.put_many_nowait
        ring.put_many_nowait = lambda items: 0  # type: ignore[method-assign]
        await engine.abort("v")  # ended: nothing to abort
        await engine.abort("w")  # running: its abort waits for room
        await asyncio.sleep(0)  # sleep-ok: one turn of the loop, the flush finds no room
        ring.put_many_nowait = real  # type: ignore[method-assign]
        # The rid reused at once: it leaves now, before the waiting aborts' retry.
        again = await asyncio.wait_for(engine.generate(
            [1, 2], SamplingParams(max_new_tokens=50), rid="v"), ANSWER_S)
        assert again.finish_reason == "length" and len(again.token_ids) == 50
        ends = [chunk.finish_reason async for chunk in running]
        assert ends[-1] == "abort"  # the abort that waited for room still went
