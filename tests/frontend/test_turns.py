"""Turns on the event loop: work past a slice waits, a few takers per iteration."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from frontend.turns import Turns


async def _iterations(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)  # one loop iteration each


@pytest.mark.asyncio
async def test_within_a_slice_a_take_does_not_wait() -> None:
    turns = Turns(slice_s=60.0)
    order: list[int] = []

    async def work(i: int) -> None:
        await turns.take()
        order.append(i)

    tasks = [asyncio.create_task(work(i)) for i in range(100)]
    await asyncio.sleep(0)  # the tasks' first steps: all within the slice
    assert order == list(range(100)) and turns.waiting == 0
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_past_the_slice_takers_go_a_few_per_iteration_in_order() -> None:
    turns = Turns(slice_s=1e-12, release=4)  # every take after the first is past it
    order: list[int] = []

    async def work(i: int) -> None:
        await turns.take()
        order.append(i)

    tasks = [asyncio.create_task(work(i)) for i in range(13)]
    await asyncio.sleep(0)
    assert order == [0] and turns.waiting == 12  # the first opened the slice
    seen = [len(order)]
    while len(order) < 13:
        await _iterations(1)
        seen.append(len(order))
    assert order == list(range(13))  # first come, first served
    steps = [b - a for a, b in itertools.pairwise(seen)]
    assert max(steps) == 4  # at most 4 an iteration, and 4 when that many wait
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_a_cancelled_taker_leaves_the_queue_and_takes_no_turn() -> None:
    turns = Turns(slice_s=1e-12, release=1)
    order: list[int] = []

    async def work(i: int) -> None:
        await turns.take()
        order.append(i)

    tasks = [asyncio.create_task(work(i)) for i in range(4)]
    await asyncio.sleep(0)
    tasks[1].cancel()  # its client left while it waited
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2, 3] and turns.waiting == 0
    assert tasks[1].cancelled()


def test_a_bad_slice_or_release_is_refused() -> None:
    with pytest.raises(ValueError):
        Turns(slice_s=0)
    with pytest.raises(ValueError):
        Turns(release=0)


@pytest.mark.asyncio
async def test_slow_turns_let_fewer_through_an_iteration_and_cheap_ones_more() -> None:
    """How many go through adapts to what their turns cost: each iteration's turns
    stay near the slice, not ``release`` turns of whatever length."""
    turns = Turns(slice_s=0.002, release=16)
    done: list[int] = []
    cost = [0.001]  # seconds of work per turn

    async def work(i: int) -> None:
        await turns.take()
        end = time.perf_counter() + cost[0]
        while time.perf_counter() < end:  # busy: loop time, as a stream's events are
            pass
        done.append(i)

    tasks = [asyncio.create_task(work(i)) for i in range(300)]
    await asyncio.sleep(0)
    seen = [len(done)]
    for _ in range(12):
        await _iterations(1)
        seen.append(len(done))
    slow = [b - a for a, b in itertools.pairwise(seen)]
    assert max(slow[:3]) == 16  # the first batch, before anything was measured
    assert max(slow[6:]) <= 2, slow  # 1 ms turns, a 2 ms slice: one or two a time
    cost[0] = 0.0
    seen = [len(done)]
    while len(done) < 300:
        await _iterations(1)
        seen.append(len(done))
    cheap = [b - a for a, b in itertools.pairwise(seen)]
    assert max(cheap) > max(slow[6:]), cheap  # grows back, one more a tick
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_a_callback_runs_now_within_the_slice_and_in_its_turn_past_it() -> None:
    turns = Turns(slice_s=1e-12, release=2)
    order: list[str] = []

    async def work(i: int) -> None:
        await turns.take()
        order.append(f"t{i}")

    assert turns.call(lambda: order.append("c0"))  # the first opens the slice: at once
    task = asyncio.create_task(work(1))  # its first step (its take) runs later
    assert not turns.call(lambda: order.append("c2"))  # past the slice: queued
    assert order == ["c0"] and turns.waiting == 1
    while len(order) < 3:
        await _iterations(1)
    assert order == ["c0", "c2", "t1"]  # first come, first served, callbacks and tasks alike
    await task


@pytest.mark.asyncio
async def test_a_callback_that_raises_stalls_nobody_behind_it() -> None:
    turns = Turns(slice_s=1e-12, release=4)
    order: list[str] = []
    raised: list[object] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: raised.append(context.get("exception")))

    def boom() -> None:
        raise RuntimeError("a protocol's parse failed")

    try:
        assert turns.call(lambda: order.append("first"))  # opens the slice
        assert not turns.call(boom)
        assert not turns.call(lambda: order.append("after"))  # queued behind it
        await _iterations(5)
        assert order == ["first", "after"] and turns.waiting == 0
        assert len(raised) == 1 and isinstance(raised[0], RuntimeError)
    finally:
        loop.set_exception_handler(None)
