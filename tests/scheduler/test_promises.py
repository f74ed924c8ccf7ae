"""Two README promises that had no test: ``Engine(metrics=False)``, and one slow
consumer never delays the others."""

from __future__ import annotations

import asyncio
import time

import pytest

from messages import SamplingParams
from scheduler import AsyncEngine, Engine, ModelConfig, RequestFailed

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)


def test_metrics_false_records_nothing_and_serves_the_same() -> None:
    sp = SamplingParams(max_new_tokens=5, temperature=0.0)
    with Engine("ring", SMALL) as on, Engine("ring", SMALL, metrics=False) as off:
        assert off.generate([1, 2, 3], sp).token_ids == on.generate([1, 2, 3], sp).token_ids
        assert "tsb_generated_tokens" in on.metrics()
        with pytest.raises(RequestFailed):
            off.metrics()


@pytest.mark.asyncio
async def test_one_slow_consumer_never_delays_the_others() -> None:
    async with AsyncEngine("ring", SMALL, max_batch=64) as engine:
        slow = engine.stream([1], SamplingParams(max_new_tokens=400, temperature=0.0))
        first = await slow.__anext__()  # then not read while everything else runs

        async def reader(n: int) -> int:
            got = 0
            async for chunk in engine.stream([2 + n], SamplingParams(max_new_tokens=100)):
                got += len(chunk.token_ids)
            return got

        t0 = time.monotonic()
        counts = await asyncio.wait_for(asyncio.gather(*(reader(n) for n in range(4))), 60)
        assert counts == [100] * 4, counts
        assert time.monotonic() - t0 < 60
        # The slow one was produced meanwhile (merged in its handle), and nothing is lost.
        rest = [c async for c in slow]
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 400
