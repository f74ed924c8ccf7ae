"""AsyncEngine, both modes: concurrent streams, cancellation that aborts, rpc under flood, death."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Literal

import pytest
import pytest_asyncio

from bus import WouldBlock
from messages import SamplingParams
from scheduler import (
    AsyncEngine,
    EngineClosed,
    ModelConfig,
    Overloaded,
    SchedulerGone,
    StreamChunk,
)
from scheduler.engine.async_engine import deliver_rows
from scheduler.engine.handles import RequestState, joined

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
Mode = Literal["ring", "zmq"]


# One engine per mode for the module (a zmq start is a process start, ~3 s): each
# test that takes it leaves it idle (_until_idle), as the next one expects.
@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["ring", "zmq"])
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(request.param, SMALL, max_batch=64) as e:
        yield e


async def _until_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict[str, object]:
    """Until the scheduler holds nothing and every pending entry (cancelled ones too) ended."""
    deadline = time.monotonic() + timeout
    while True:
        load = (await engine.collective_rpc("get_load")).result
        assert load is not None
        if load["running"] == 0 and load["queued"] == 0 and engine.pending == 0:
            return dict(load)
        assert time.monotonic() < deadline, f"still busy: {load}, pending {engine.pending}"
        await asyncio.sleep(0.005)  # sleep-ok: pacing of a deadline poll


async def _produced(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Until the scheduler runs nothing (what it made may still wait, unread)."""
    deadline = time.monotonic() + timeout
    while True:
        load = (await engine.collective_rpc("get_load")).result
        assert load is not None
        if load["running"] == 0:
            return
        assert time.monotonic() < deadline, f"still running: {load}"
        await asyncio.sleep(0.01)  # sleep-ok: pacing of a deadline poll


@pytest.mark.asyncio(loop_scope="module")
async def test_generate_stream_embed_and_the_same_tokens_as_sync(engine: AsyncEngine) -> None:
    from scheduler import Engine

    sp = SamplingParams(max_new_tokens=6, temperature=0.8, seed=7)
    r = await engine.generate([9, 8, 7], sp, return_logprob=True)
    assert len(r.token_ids) == 6 and r.finish_reason == "length"
    assert r.logprobs is not None and len(r.logprobs) == 6
    chunks = [c async for c in engine.stream([9, 8, 7], sp)]
    assert [c.token_ids[0] for c in chunks] == r.token_ids
    with Engine("ring", SMALL) as sync:
        assert sync.generate([9, 8, 7], sp, timeout=30).token_ids == r.token_ids
    vec = await engine.embed([4, 5, 6])
    assert vec.shape == (32,)
    assert engine.pending == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_hundreds_of_concurrent_streams(engine: AsyncEngine) -> None:
    async def one(i: int) -> int:
        n = 0
        async for chunk in engine.stream([1 + i % 100, 2], SamplingParams(max_new_tokens=12)):
            n += len(chunk.token_ids)
        return n

    counts = await asyncio.gather(*(one(i) for i in range(300)))
    assert counts == [12] * 300
    assert engine.pending == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_cancel_mid_stream_frees_the_slot(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.stream([1, 2], SamplingParams(max_new_tokens=1_000_000)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until_idle(engine)
    assert engine.pending == 0
    # A generate cancelled while it waits is aborted too.
    gen = asyncio.create_task(engine.generate([3], SamplingParams(max_new_tokens=1_000_000)))
    await asyncio.sleep(0)  # let it submit
    deadline = time.monotonic() + 10
    while engine.pending == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)  # sleep-ok: pacing of a deadline poll
    gen.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gen
    await _until_idle(engine)
    assert engine.pending == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_leaving_a_stream_early_aborts_it(engine: AsyncEngine) -> None:
    stream = engine.stream([5], SamplingParams(max_new_tokens=1_000_000))
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    await _until_idle(engine)
    assert engine.pending == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_submit_then_await_each_and_a_timed_out_await_aborts(engine: AsyncEngine) -> None:
    requests = [engine.submit([1 + i % 100], SamplingParams(max_new_tokens=3))
                for i in range(200)]
    results = [await r for r in requests]
    assert [len(r.token_ids) for r in results] == [3] * 200
    assert [r.rid for r in results] == [r.rid for r in requests]
    assert engine.pending == 0
    long = engine.submit([2], SamplingParams(max_new_tokens=1_000_000))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(long, 0.2)  # cancels the await: the request is aborted
    await _until_idle(engine)
    with pytest.raises(RuntimeError, match="awaited a second time"):  # not a wait for ever
        await asyncio.wait_for(requests[0], 5)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stream_dropped_unfinished_is_aborted_when_collected(engine: AsyncEngine) -> None:
    async def leave() -> None:
        async for _ in engine.stream([6], SamplingParams(max_new_tokens=1_000_000)):
            break  # no aclose(): the generator is dropped, unfinished, on return

    await leave()
    gc.collect()  # the loop's asyncgen finalizer runs its aclose(), which aborts
    await _until_idle(engine)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_disconnecting_client_while_hundreds_stream(engine: AsyncEngine) -> None:
    async def one(i: int) -> int:
        n = 0
        async for chunk in engine.stream([1 + i % 100], SamplingParams(max_new_tokens=20)):
            n += len(chunk.token_ids)
        return n

    others = [asyncio.create_task(one(i)) for i in range(200)]
    leaver = asyncio.create_task(one(999))
    await asyncio.sleep(0.01)  # sleep-ok: let the leaver get going before it leaves
    leaver.cancel()
    assert await asyncio.gather(*others) == [20] * 200
    with pytest.raises(asyncio.CancelledError):
        await leaver
    await _until_idle(engine)
    assert engine.pending == 0


@pytest.mark.asyncio(loop_scope="module")
async def test_rpc_is_answered_while_streams_flood(engine: AsyncEngine) -> None:
    started = time.perf_counter()
    flood = [asyncio.create_task(engine.generate([1 + i % 100], SamplingParams(
        max_new_tokens=64))) for i in range(300)]
    deadline = time.monotonic() + 30
    while True:  # until the scheduler holds the flood: an rpc before it proves nothing
        load = (await engine.collective_rpc("get_load")).result
        assert load is not None
        if isinstance(load["queued"], int) and load["queued"] > 0:  # the batch (64) is full
            break
        assert time.monotonic() < deadline, f"the flood never queued: {load}"
        await asyncio.sleep(0.001)  # sleep-ok: pacing of a deadline poll
    t0 = time.perf_counter()
    reply = await engine.collective_rpc("get_load")
    rpc_s = time.perf_counter() - t0
    assert reply.success and reply.result is not None
    assert reply.result["queued"] != 0, "answered only once the flood was gone"
    await asyncio.gather(*flood)
    flood_s = time.perf_counter() - started
    assert rpc_s < flood_s / 2, f"the rpc took {rpc_s:.3f} s of a {flood_s:.3f} s flood"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_slow_consumer_is_bounded_and_loses_nothing() -> None:
    async with AsyncEngine("ring", SMALL) as engine:
        stream = engine.stream([1], SamplingParams(max_new_tokens=400, temperature=0.0))
        first = await stream.__anext__()
        # Do not read while the rest is produced: the handle merges chunks.
        await _produced(engine)
        rest = [c async for c in stream]
        assert len(rest) <= RequestState.max_buffered
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 400
        assert rest[-1].finish_reason == "length"


@pytest.mark.asyncio(loop_scope="module")
async def test_stream_steps_hands_over_what_arrived_as_one_list() -> None:
    sp = SamplingParams(max_new_tokens=40, temperature=0.0)
    async with AsyncEngine("ring", SMALL) as engine:
        want = [t async for c in engine.stream([1], sp) for t in c.token_ids]
        steps = engine.stream_steps([1], sp)
        first = await anext(steps)
        await _produced(engine)  # the rest is produced while nobody reads
        rest = [chunks async for chunks in steps]
        assert len(rest) == 1  # all of it at once, one chunk per step in it
        chunks = first + rest[0]
        assert all(len(c.token_ids) == 1 for c in chunks)
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[-1].finish_reason == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.asyncio(loop_scope="module")
async def test_leaving_stream_steps_early_frees_the_slot() -> None:
    async with AsyncEngine("ring", SMALL) as engine:
        steps = engine.stream_steps([1], SamplingParams(max_new_tokens=100_000))
        await anext(steps)
        await steps.aclose()  # type: ignore[attr-defined]
        await _until_idle(engine)  # the slot is freed, and the abort's answer reached us


@pytest.mark.asyncio(loop_scope="module")
async def test_a_dead_scheduler_fails_every_waiting_task_promptly(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = AsyncEngine("zmq", SMALL)
    await engine.start()
    try:
        # 50 x 20k tokens stays inside the default max_queued_tokens: none is
        # refused as overloaded before the kill.
        tasks = [asyncio.create_task(engine.generate([1], SamplingParams(
            max_new_tokens=20_000))) for _ in range(50)]
        await asyncio.sleep(0)  # let them submit
        pid = engine._scheduler.essential[0].pid
        assert pid is not None
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, SchedulerGone) for r in results)
        assert time.monotonic() - t0 < 2
        assert engine.pending == 0
        # ... and the operator's log says so, once (without it: not a word)
        gone = [r.getMessage() for r in caplog.records if "exited (exit code -9)" in
                r.getMessage()]
        assert len(gone) == 1 and "requests in flight fail" in gone[0], gone
    finally:
        await engine.close()
    with pytest.raises(EngineClosed):
        await engine.abort("x")


@pytest.mark.asyncio(loop_scope="module")
async def test_a_stopped_scheduler_fails_every_waiting_rpc_caller_at_once() -> None:
    # 16 rpc calls wait for a stopped scheduler, each with its own deadline: they are
    # in flight together (a lock held for a call let one in at a time), and when the
    # scheduler dies every one of them fails at once, long before its timeout.
    engine = AsyncEngine("zmq", SMALL)
    await engine.start()
    pid = engine._scheduler.essential[0].pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        calls = [asyncio.create_task(engine.collective_rpc("get_load", timeout=60))
                 for _ in range(16)]
        deadline = time.monotonic() + 10
        while engine._rpc.in_flight < 16:  # every call sent, none answered
            assert time.monotonic() < deadline, engine._rpc.in_flight
            await asyncio.sleep(0.01)  # sleep-ok: pacing of a deadline poll
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        assert all(isinstance(r, SchedulerGone) for r in results), results
        assert time.monotonic() - t0 < 2
        assert engine._rpc.in_flight == 0
    finally:
        await engine.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_rpc_calls_waiting_when_the_engine_closes_end_with_engine_closed() -> None:
    engine = AsyncEngine("zmq", SMALL)
    await engine.start()
    pid = engine._scheduler.essential[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # nothing is answered; close kills it past its timeout
    calls = [asyncio.create_task(engine.collective_rpc("get_load", timeout=60))
             for _ in range(4)]
    await asyncio.sleep(0)  # let them send
    await engine.close(timeout=0.5)
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    assert all(isinstance(r, EngineClosed | SchedulerGone) for r in results), results


@pytest.mark.asyncio(loop_scope="module")
async def test_a_cancelled_rid_is_not_reused_before_its_request_ended(engine: AsyncEngine) -> None:
    from scheduler import InvalidRequest

    long = SamplingParams(max_new_tokens=1_000_000)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(engine.generate([1, 2], long, rid="job-1"), 0.2)
    try:  # right away: either refused (still in flight) or, if already ended, served
        again = await engine.generate([5, 6], SamplingParams(max_new_tokens=4), rid="job-1")
        assert len(again.token_ids) == 4 and again.finish_reason == "length"
    except InvalidRequest as exc:
        assert "in flight" in exc.reason
    await _until_idle(engine)
    again = await engine.generate([5, 6], SamplingParams(max_new_tokens=4), rid="job-1")
    assert len(again.token_ids) == 4 and again.finish_reason == "length"
    await _until_idle(engine)


def test_chunks_are_merged_past_the_bound() -> None:
    h = RequestState("r")
    for i in range(RequestState.max_buffered + 10):
        h.put(StreamChunk("r", (i,), None, None))
    h.put(StreamChunk("r", (999,), "length", None))
    assert len(h.items) == RequestState.max_buffered
    items = h.take()
    tokens = [t for c in items if isinstance(c, StreamChunk) for t in c.token_ids]
    assert tokens == [*range(RequestState.max_buffered + 10), 999]


class _OneBuffered(RequestState):
    max_buffered = 1  # every chunk merged into the first: its prompt logprobs too


@pytest.mark.parametrize("state", [RequestState, _OneBuffered])
def test_merged_chunks_keep_top_logprobs_and_the_first_chunks_prompt_logprobs(
        state: type[RequestState]) -> None:
    """Past the bound, each token's alternatives are merged with it, and the prompt's
    logprobs (on a request's first chunk only) survive into the joined answer."""
    n = RequestState.max_buffered + 10
    h = state("r")
    for i in range(n):
        h.put(StreamChunk("r", (i,), None, (-1.0,), None, (((i, -1.0), (i + 1, -2.0)),),
                          *(((-0.5,), (((7, -0.25),),)) if i == 0 else (None, None))))
    h.put(StreamChunk("r", (999,), "length", (-3.0,), None, (((999, -3.0), (1, -4.0)),)))
    items = h.take()
    assert len(items) == state.max_buffered
    result = joined("r", items)
    assert result.token_ids == [*range(n), 999]
    assert result.top_logprobs == [*(((i, -1.0), (i + 1, -2.0)) for i in range(n)),
                                   ((999, -3.0), (1, -4.0))]
    assert result.prompt_logprobs == (-0.5,) and result.prompt_top_logprobs == (((7, -0.25),),)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_full_work_channel_never_blocks_the_loop(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.stream([1, 2], SamplingParams(max_new_tokens=100_000)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    # The work channel is full (a scheduler that stopped reading): simulate it.
    channel = engine._ingress if engine._ingress is not None else engine._work_out
    assert channel is not None

    def full(*args: object, **kwargs: object) -> None:
        raise WouldBlock("work", "full")

    def taken_none(*args: object, **kwargs: object) -> int:
        return 0

    # A turn's sends leave together: none of it is taken; an abort retried alone neither.
    monkeypatch.setattr(channel, "put_many_nowait" if engine.mode == "ring"
                        else "send_many_nowait", taken_none)
    monkeypatch.setattr(channel, "put_nowait" if engine.mode == "ring" else "send_nowait", full)
    t0 = time.monotonic()
    with pytest.raises(Overloaded, match="work channel is full"):
        await engine.submit([3, 4])  # refused at once, not after a send timeout
    assert time.monotonic() - t0 < 0.5
    assert engine.pending == 1  # the refused request left nothing behind
    task.cancel()  # its abort cannot be sent now: it waits, in order, for room
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while len(engine._unsent_aborts) != 1:  # (after this turn's sends)
        assert time.monotonic() < deadline
        await asyncio.sleep(0)  # sleep-ok: one turn of the loop
    monkeypatch.undo()  # room again: the abort goes out and the slot frees
    await _until_idle(engine)
    assert not engine._unsent_aborts


def test_a_poll_is_delivered_a_share_of_rows_at_a_time_in_order() -> None:
    """The event loop delivers a backlog of step outputs ~N requests per callback (one
    callback once delivered 1024 outputs of 256 requests: 100 ms of a held loop)."""
    from bus import Envelope, Origin, Rejected
    from messages import BatchTokenIDOut, Output

    handles = [RequestState(f"r{i}") for i in range(256)]
    requests = {h.rid: h for h in handles}
    origin = Origin("out")
    backlog: deque[Envelope[Output] | Rejected] = deque(
        Envelope(BatchTokenIDOut.from_lists([h.rid for h in handles], [[step]] * 256,
                                            [None] * 256), origin) for step in range(4))
    deliver_rows(requests, backlog, 512)
    assert len(backlog) == 2  # two outputs of 256 rows: the share
    assert all([c.token_ids for c in h.items] == [(0,), (1,)]  # type: ignore[union-attr]
               for h in handles)
    deliver_rows(requests, backlog, 1)  # at least one output, never split
    assert len(backlog) == 1 and all(len(h.items) == 3 for h in handles)


def test_each_delivered_row_gets_its_own_columns() -> None:
    """Rows of different lengths in one output: each chunk gets its own slice of the ids,
    logprobs and alternatives, and its own cached count (not another row's)."""
    import msgspec
    import numpy as np

    from bus import Envelope, Origin
    from messages import BatchTokenIDOut, packed_u32

    out = BatchTokenIDOut.from_lists(["a", "b", "c"], [[1], [2, 3, 4], [5, 6]],
                                     [None, "length", None],
                                     [[-0.5], [-1.0, -1.5, -2.0], [-2.5, -3.0]], [7, 8, 9])
    out = msgspec.structs.replace(
        out, top_ids=packed_u32([10, 11, 20, 21, 30, 31, 40, 41, 50, 51, 60, 61],
                                field="top_ids"),
        top_logprobs=np.arange(12, dtype=np.float64) / -8)
    states = {rid: RequestState(rid) for rid in ("a", "b", "c")}
    got = dict(states)
    deliver_rows(states, deque([Envelope(out, Origin("out"))]), 8)
    assert list(states) == ["a", "c"]  # "b" ended: no longer tracked
    chunks = {rid: h.items[0] for rid, h in got.items()}
    assert all(isinstance(c, StreamChunk) for c in chunks.values())
    b = chunks["b"]
    assert isinstance(b, StreamChunk)
    assert (b.token_ids, b.finish_reason, b.logprobs, b.cached_tokens) == \
        ((2, 3, 4), "length", (-1.0, -1.5, -2.0), 8)
    assert b.top_logprobs == (((20, -2 / 8), (21, -3 / 8)), ((30, -4 / 8), (31, -5 / 8)),
                              ((40, -6 / 8), (41, -7 / 8)))
    c = chunks["c"]
    assert isinstance(c, StreamChunk)
    assert (c.token_ids, c.logprobs, c.cached_tokens) == ((5, 6), (-2.5, -3.0), 9)
    assert c.top_logprobs == (((50, -8 / 8), (51, -9 / 8)), ((60, -10 / 8), (61, -11 / 8)))


def test_a_delivered_chunk_is_not_tracked_by_the_collector() -> None:
    """A stream's buffered chunks never make a full collection longer (256 streams'
    tracked chunks and id lists made one hold the loop 43 ms)."""
    from bus import Envelope, Origin
    from messages import BatchTokenIDOut

    got = RequestState("r")
    out = BatchTokenIDOut.from_lists(["r"], [[1, 2]], [None], [[-0.5, -0.25]])
    deliver_rows({"r": got}, deque([Envelope(out, Origin("out"))]), 1)
    chunk = got.items[0]
    assert isinstance(chunk, StreamChunk) and chunk.token_ids == (1, 2)
    gc.collect()  # a tuple of numbers is untracked by the first collection that sees it
    assert not gc.is_tracked(chunk) and not gc.is_tracked(chunk.token_ids)
    assert not gc.is_tracked(chunk.logprobs)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_close_timeout_that_is_no_number_stops_nothing() -> None:
    # Without this: close("5") got as far as cancelling the watchdog (Engine: as far as
    # marking itself closed) before the timeout was refused.
    engine = AsyncEngine("zmq", SMALL)  # (its watchdog: the scheduler's process)
    try:
        await engine.start()
        with pytest.raises(TypeError):
            await engine.close("5")  # type: ignore[arg-type]
        assert not engine.closed
        assert engine._watchdog is not None and not engine._watchdog.cancelling()
        out = await engine.generate([1], SamplingParams(max_new_tokens=2))
        assert len(out.token_ids) == 2
    finally:
        await engine.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_every_call_before_start_is_refused_as_not_started() -> None:
    engine = AsyncEngine("ring", SMALL)
    try:
        with pytest.raises(EngineClosed, match="not started"):
            engine.submit([1])
        with pytest.raises(EngineClosed, match="not started"):
            await engine.embed([1])
        with pytest.raises(EngineClosed, match="not started"):
            await anext(engine.stream([1]))
        with pytest.raises(EngineClosed, match="not started"):
            await engine.abort("r")
        with pytest.raises(EngineClosed, match="not started"):
            await engine.collective_rpc("get_load")
    finally:
        await engine.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_timeout_names_its_request_and_its_seconds(engine: AsyncEngine) -> None:
    """Among many concurrent calls, the one that timed out is told apart by its message."""
    long = SamplingParams(max_new_tokens=1_000_000)
    with pytest.raises(TimeoutError, match=r"request 'slow-1': no answer within 0.2 s"):
        await engine.generate([1, 2], long, rid="slow-1", timeout=0.2)
    with pytest.raises(TimeoutError, match=r"request 'emb-1': no answer within 0 s"):
        await engine.embed([1, 2, 3], rid="emb-1", timeout=0)
    await _until_idle(engine)
