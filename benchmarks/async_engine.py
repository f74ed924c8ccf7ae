"""AsyncEngine against the threaded Engine, same run: overhead, cancellation, streaming.

Run: ``python -m benchmarks.async_engine``. The last line is one JSON object:

* ``sync_overhead_us_per_request_{ring,zmq}`` and
  ``async_overhead_us_per_request_{ring,zmq}``: stub model, one token per
  request, n requests in flight at once, minus the same scheduler fed by
  direct calls (no bus, no engine), as ``benchmarks/e2e.py`` measures it:
  each face submits them all and then waits on each (``Engine.submit`` and
  ``handle.result()``; ``AsyncEngine.submit`` and ``await request``).
  ``async_gather_overhead_us_per_request_*`` is the same with one task per
  request (``asyncio.gather(*(engine.generate(...)))``): it adds what asyncio
  itself charges for a task, a future and gather's bookkeeping (about 11 us
  a request on the 2-core box, with no engine at all). One engine of each face
  stays open for the whole mode and the three are measured in alternating
  rounds; each figure is the median round. On a 2-core box a single run of
  a few thousand requests swings by 2x, so only paired, interleaved rounds
  compare the faces fairly.
* ``cancel_to_free_ms_p99`` (and ``_p50``): a stream of the real model is
  cancelled after its first chunk; the time until ``get_load`` shows its
  slot free. Both modes, pooled.
* ``tokens_per_s_{sync,async}_256_streams``: the real model, 256 concurrent
  streams of 32 tokens (zmq mode), the same workload on each face, in
  alternating rounds; the median round of each.
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


def _sync_round(engine: Engine, n: int) -> float:
    t0 = time.perf_counter()
    for h in [engine.submit(PROMPT, ONE) for _ in range(n)]:
        h.result(60)
    return (time.perf_counter() - t0) / n * 1e6


async def _async_round(engine: AsyncEngine, n: int) -> float:
    t0 = time.perf_counter()
    for request in [engine.submit(PROMPT, ONE) for _ in range(n)]:
        await request
    return (time.perf_counter() - t0) / n * 1e6


async def _gather_round(engine: AsyncEngine, n: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.generate(PROMPT, ONE) for _ in range(n)))
    return (time.perf_counter() - t0) / n * 1e6


async def overheads(mode: Mode, rounds: int, n: int
                    ) -> tuple[float, float, float, float]:
    """Median us/request of (direct, sync, async, async with a task each), alternating."""
    direct: list[float] = []
    sync: list[float] = []
    aio: list[float] = []
    gathered: list[float] = []
    with Engine(mode, STUB, max_batch=64) as s_engine:
        async with AsyncEngine(mode, STUB, max_batch=64) as a_engine:
            _sync_round(s_engine, 500)  # warm up
            await _async_round(a_engine, 500)
            for r in range(rounds):
                # Alternate who goes first: drift on a noisy box hits both alike.
                # (A sync round blocks the loop; the async engine is idle then.)
                if r % 2:
                    sync.append(_sync_round(s_engine, n))
                    aio.append(await _async_round(a_engine, n))
                else:
                    aio.append(await _async_round(a_engine, n))
                    sync.append(_sync_round(s_engine, n))
                gathered.append(await _gather_round(a_engine, n))
                direct.append(direct_us_per_request(n))
    return (statistics.median(direct), statistics.median(sync), statistics.median(aio),
            statistics.median(gathered))


async def cancel_to_free(mode: Mode, samples: int) -> list[float]:
    """Ms from cancelling a stream's task to ``get_load`` showing no request running."""
    out: list[float] = []
    async with AsyncEngine(mode, ModelConfig(), max_batch=64) as engine:
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
                if load.get("running") == 0 and load.get("queued") == 0:
                    break
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _sync_streams(engine: Engine, n: int, sp: SamplingParams) -> float:
    t0 = time.perf_counter()
    handles = [engine.submit([1 + i % 100, 2, 3], sp, stream=True) for i in range(n)]
    total = sum(len(c.token_ids) for h in handles for c in h)
    return total / (time.perf_counter() - t0)


async def _async_streams(engine: AsyncEngine, n: int, sp: SamplingParams) -> float:
    async def one(i: int) -> int:
        return sum([len(c.token_ids) async for c in engine.stream([1 + i % 100, 2, 3], sp)])

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return total / (time.perf_counter() - t0)


async def streams(mode: Mode, rounds: int, n: int, tokens: int) -> tuple[float, float]:
    """Median tokens/s of (sync face, async face), n concurrent streams, alternating rounds."""
    sp = SamplingParams(max_new_tokens=tokens, temperature=0.8, seed=1)
    sync: list[float] = []
    aio: list[float] = []
    with Engine(mode, ModelConfig(), max_batch=64) as s_engine:
        async with AsyncEngine(mode, ModelConfig(), max_batch=64) as a_engine:
            s_engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))  # warm up
            await a_engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
            for r in range(rounds):
                if r % 2:
                    sync.append(_sync_streams(s_engine, n, sp))
                    aio.append(await _async_streams(a_engine, n, sp))
                else:
                    aio.append(await _async_streams(a_engine, n, sp))
                    sync.append(_sync_streams(s_engine, n, sp))
    return statistics.median(sync), statistics.median(aio)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def run() -> dict[str, float]:
    res: dict[str, float] = {}
    for mode in ("ring", "zmq"):
        d, s, a, g = await overheads(mode, rounds=25, n=1000)
        say(f"{mode}: direct {d:.1f} us/request; sync {s:.1f} (overhead {s - d:.1f}); "
            f"async {a:.1f} (overhead {a - d:.1f}); async, a task each {g:.1f} "
            f"(overhead {g - d:.1f})")
        res[f"sync_overhead_us_per_request_{mode}"] = round(s - d, 1)
        res[f"async_overhead_us_per_request_{mode}"] = round(a - d, 1)
        res[f"async_gather_overhead_us_per_request_{mode}"] = round(g - d, 1)
        res[f"direct_us_per_request_{mode}_run"] = round(d, 1)
    cancels = await cancel_to_free("ring", 50) + await cancel_to_free("zmq", 50)
    c50, c99 = percentiles(cancels)
    say(f"cancel to free (both modes): p50 {c50:.2f} ms, p99 {c99:.2f} ms")
    res["cancel_to_free_ms_p50"] = round(c50, 2)
    res["cancel_to_free_ms_p99"] = round(c99, 2)
    st, at = await streams("zmq", rounds=5, n=256, tokens=32)
    say(f"256 streams x 32 tokens (zmq): sync {st:,.0f} tokens/s, async {at:,.0f} tokens/s")
    res["tokens_per_s_sync_256_streams"] = round(st)
    res["tokens_per_s_async_256_streams"] = round(at)
    return res


def main() -> None:
    print(json.dumps(asyncio.run(run())))


if __name__ == "__main__":
    main()
