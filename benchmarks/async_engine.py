"""AsyncEngine against the threaded Engine, same run: overhead, cancellation, streaming.

Run: ``python -m benchmarks.async_engine``. The last line is one JSON object:

* ``sync_overhead_us_per_request_{ring,zmq}`` and
  ``async_overhead_us_per_request_{ring,zmq}``: stub model, one token per
  request, n requests in flight at once (the sync face submits them all and
  waits on each handle; the async face awaits one task per request), minus
  the same scheduler fed by direct calls (no bus, no engine). Medians of
  interleaved runs.
* ``cancel_to_free_ms_p99``: a stream is cancelled after its first chunk;
  the time until ``get_load`` shows its slot free.
* ``tokens_per_s_{sync,async}_256_streams``: the real model, 256 concurrent
  streams of 32 tokens, the same workload on each face.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from typing import Literal

from benchmarks._timing import percentiles
from benchmarks.e2e import direct_us_per_request
from messages import SamplingParams, token_ids
from scheduler import AsyncEngine, Engine, ModelConfig

Mode = Literal["ring", "zmq"]
STUB = ModelConfig(kind="stub")
PROMPT = token_ids(range(1, 33))
ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def sync_us_per_request(mode: Mode, n: int) -> float:
    with Engine(mode, STUB, max_batch=64) as engine:
        for h in [engine.submit(PROMPT, ONE) for _ in range(200)]:  # warm up
            h.result(60)
        t0 = time.perf_counter()
        for h in [engine.submit(PROMPT, ONE) for _ in range(n)]:
            h.result(60)
        return (time.perf_counter() - t0) / n * 1e6


async def _async_us(mode: Mode, n: int) -> float:
    async with AsyncEngine(mode, STUB, max_batch=64) as engine:
        await asyncio.gather(*(engine.generate(PROMPT, ONE) for _ in range(200)))
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(PROMPT, ONE) for _ in range(n)))
        return (time.perf_counter() - t0) / n * 1e6


def async_us_per_request(mode: Mode, n: int) -> float:
    return asyncio.run(_async_us(mode, n))


async def _cancel_to_free(samples: int) -> list[float]:
    out: list[float] = []
    async with AsyncEngine("ring", ModelConfig(), max_batch=64) as engine:
        for _ in range(samples):
            first = asyncio.Event()

            async def consume(first: asyncio.Event = first) -> None:
                async for _ in engine.stream([1, 2, 3], SamplingParams(max_new_tokens=100_000)):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            t0 = time.perf_counter()
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            while True:
                load = (await engine.collective_rpc("get_load")).result or {}
                if load.get("running") == 0:
                    break
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _sync_streams(mode: Mode, n: int, tokens: int) -> float:
    with Engine(mode, ModelConfig(), max_batch=64) as engine:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))  # warm up
        sp = SamplingParams(max_new_tokens=tokens, temperature=0.8, seed=1)
        t0 = time.perf_counter()
        handles = [engine.submit([1 + i % 100, 2, 3], sp, stream=True) for i in range(n)]
        total = sum(len(c.token_ids) for h in handles for c in h)
        return total / (time.perf_counter() - t0)


async def _async_streams(mode: Mode, n: int, tokens: int) -> float:
    async with AsyncEngine(mode, ModelConfig(), max_batch=64) as engine:
        await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        sp = SamplingParams(max_new_tokens=tokens, temperature=0.8, seed=1)

        async def one(i: int) -> int:
            return sum([len(c.token_ids) async for c in engine.stream([1 + i % 100, 2, 3], sp)])

        t0 = time.perf_counter()
        total = sum(await asyncio.gather(*(one(i) for i in range(n))))
        return total / (time.perf_counter() - t0)


def main() -> None:
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    res: dict[str, float] = {}
    n = 3000
    direct = statistics.median(direct_us_per_request(n) for _ in range(3))
    say(f"direct (no bus, no engine): {direct:.1f} us/request")
    for mode in ("ring", "zmq"):
        sync_runs, async_runs = [], []
        for _ in range(3):  # interleaved: drift on a noisy box hits both alike
            sync_runs.append(sync_us_per_request(mode, n))
            async_runs.append(async_us_per_request(mode, n))
        s, a = statistics.median(sync_runs), statistics.median(async_runs)
        say(f"{mode}: sync {s:.1f} us/request (overhead {s - direct:.1f}), "
            f"async {a:.1f} (overhead {a - direct:.1f})")
        res[f"sync_overhead_us_per_request_{mode}"] = round(s - direct, 1)
        res[f"async_overhead_us_per_request_{mode}"] = round(a - direct, 1)
    cancels = asyncio.run(_cancel_to_free(100))
    c50, c99 = percentiles(cancels)
    say(f"cancel to free: p50 {c50:.2f} ms, p99 {c99:.2f} ms")
    res["cancel_to_free_ms_p50"] = round(c50, 2)
    res["cancel_to_free_ms_p99"] = round(c99, 2)
    sync_tps, async_tps = [], []
    for _ in range(3):
        sync_tps.append(_sync_streams("zmq", 256, 32))
        async_tps.append(asyncio.run(_async_streams("zmq", 256, 32)))
    st, at = statistics.median(sync_tps), statistics.median(async_tps)
    say(f"256 streams x 32 tokens (zmq): sync {st:,.0f} tokens/s, async {at:,.0f} tokens/s")
    res["tokens_per_s_sync_256_streams"] = round(st)
    res["tokens_per_s_async_256_streams"] = round(at)
    res["direct_us_per_request"] = round(direct, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
