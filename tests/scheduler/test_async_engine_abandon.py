"""An AsyncEngine its user drops without a close (an exception path, a forgotten close, a
notebook cell run again) is collected, and what it started is stopped: its scheduler
thread or processes, its run directory, its readers on the loop, with a ResourceWarning
that says so; the loop goes on serving the other engines. (Without it: the loop's
readers, the watchdog task and the scheduler thread held the engine, so it and its
scheduler lived as long as the loop, or the process.)"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Literal

import pytest

from messages import SamplingParams
from scheduler import AsyncEngine, ModelConfig

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
TWO = SamplingParams(max_new_tokens=2)
WAIT = 30.0  # seconds a condition that must come is polled for


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)  # sleep-ok: pacing of a deadline poll


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["ring", "zmq"])
async def test_an_async_engine_collected_unclosed_stops_its_scheduler(
        mode: Literal["ring", "zmq"]) -> None:
    async with AsyncEngine("ring", SMALL) as other:  # on the same loop, kept
        engine = await AsyncEngine(mode, SMALL).start()
        assert len((await engine.generate([1, 2], TWO)).token_ids) == 2
        thread, run_dir = engine._scheduler.thread, engine._dir
        pids = [p.pid for p in engine._scheduler.processes.all() if p.pid is not None]
        assert (thread is not None) == (mode == "ring") and bool(pids) == (mode == "zmq")
        gone = weakref.ref(engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            del engine
            gc.collect()
        assert gone() is None, "the engine was not collected"
        said = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(said) == 1 and "AsyncEngine" in said[0] and "without close()" in said[0] \
            and str(run_dir) in said[0], said
        await _until(lambda: thread is None or not thread.is_alive(),
                     "the scheduler thread stopped")
        await _until(lambda: not any(_running(pid) for pid in pids),
                     "the scheduler processes stopped")
        await _until(lambda: not os.path.exists(run_dir), "the run directory removed")
        # The loop still serves the engine that was kept.
        assert len((await other.generate([3, 4], TWO)).token_ids) == 2
        assert (await other.collective_rpc("get_load")).success


def test_an_async_engine_never_started_is_stopped_when_collected() -> None:
    engine = AsyncEngine("ring", SMALL)
    thread = engine._scheduler.thread
    assert thread is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del engine
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    thread.join(WAIT)
    assert not thread.is_alive(), "the scheduler thread still runs"


def test_a_closed_async_engine_says_nothing_when_collected() -> None:
    async def run() -> weakref.ref[AsyncEngine]:
        async with AsyncEngine("ring", SMALL) as engine:
            assert len((await engine.generate([1, 2], TWO)).token_ids) == 2
        return weakref.ref(engine)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gone = asyncio.run(run())
        gc.collect()
    assert gone() is None
