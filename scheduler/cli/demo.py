"""The demo workload (``python -m scheduler demo [--async]``): both engine faces, one table.

A few hundred generate requests through the real model, ``save_checkpoint``
timed over rpc while idle and while busy, and a summary (tokens/s, request
latency p50/p99, rpc latency). With ``--async`` the requests come from
concurrent asyncio tasks on :class:`~scheduler.AsyncEngine`.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from messages import SamplingParams
from scheduler.engine.async_engine import AsyncEngine
from scheduler.engine.engine import Engine
from scheduler.engine.handles import RequestHandle
from scheduler.models.tiny import ModelConfig

__all__ = ["demo"]


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


def _progress(done: int, total: int, t0: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.perf_counter() - t0, 1e-9)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"requests  {rate:6.1f} req/s")
    sys.stderr.flush()


@dataclass
class _Run:
    """The workload and what was measured."""

    mode: str
    requests: int
    max_new_tokens: int
    seed: int
    ckdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="tsb-demo-"))
    idle: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    steps: object = None

    def prompts(self) -> list[tuple[npt.NDArray[np.int64], SamplingParams]]:
        rng = np.random.default_rng(self.seed)
        vocab = ModelConfig().vocab_size
        return [(rng.integers(0, vocab, size=int(rng.integers(4, 64))),
                 SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.8,
                                top_p=0.95, seed=self.seed + i))
                for i in range(self.requests)]

    def done(self, n: int, t0: float) -> None:
        if n % max(1, self.requests // 50) == 0 or n == self.requests:
            _progress(n, self.requests, t0)

    def summary(self, face: str) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
        lat = self.latencies
        rows = [
            ("mode", f"{self.mode} ({face})"),
            ("requests", f"{self.requests}"),
            ("tokens generated", f"{self.tokens}"),
            ("throughput", f"{self.tokens / self.wall:,.0f} tokens/s  "
                           f"({self.requests / self.wall:,.1f} req/s)"),
            ("request latency p50 / p99", f"{_pct(lat, .5):,.1f} / {_pct(lat, .99):,.1f} ms"),
            ("rpc save_checkpoint idle p50 / max", f"{statistics.median(self.idle):.2f} / "
                                                   f"{max(self.idle):.2f} ms"),
            ("rpc save_checkpoint busy p50 / max", f"{statistics.median(self.busy):.2f} / "
                                                   f"{max(self.busy):.2f} ms"),
            ("scheduler steps", f"{self.steps}"),
        ]
        width = max(len(k) for k, _ in rows)
        print("-" * (width + 40))
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        print("-" * (width + 40))
        shutil.rmtree(self.ckdir, ignore_errors=True)


def _sync(run: _Run) -> int:
    with Engine(run.mode, ModelConfig()) as engine:  # type: ignore[arg-type]
        for i in range(5):
            t = time.perf_counter()
            reply = engine.collective_rpc("save_checkpoint", path=f"{run.ckdir}/idle-{i}.ckpt")
            run.idle.append((time.perf_counter() - t) * 1e3)
            if not reply.success:
                print(f"save_checkpoint failed: {reply.message}", file=sys.stderr)
                return 1
        t0 = time.perf_counter()
        sent: list[tuple[RequestHandle, float]] = [
            (engine.submit(prompt, sp), time.perf_counter()) for prompt, sp in run.prompts()]
        for i in range(5):
            t = time.perf_counter()
            engine.collective_rpc("save_checkpoint", path=f"{run.ckdir}/busy-{i}.ckpt")
            run.busy.append((time.perf_counter() - t) * 1e3)
        for n, (handle, started) in enumerate(sent, 1):
            result = handle.result(timeout=300)
            run.latencies.append((time.perf_counter() - started) * 1e3)
            run.tokens += len(result.token_ids)
            run.done(n, t0)
        run.wall = time.perf_counter() - t0
        run.steps = (engine.collective_rpc("get_load").result or {}).get("steps")
    run.summary("threads")
    return 0


async def _async(run: _Run) -> int:
    async with AsyncEngine(run.mode, ModelConfig()) as engine:  # type: ignore[arg-type]
        for i in range(5):
            t = time.perf_counter()
            reply = await engine.collective_rpc("save_checkpoint",
                                                path=f"{run.ckdir}/idle-{i}.ckpt")
            run.idle.append((time.perf_counter() - t) * 1e3)
            if not reply.success:
                print(f"save_checkpoint failed: {reply.message}", file=sys.stderr)
                return 1
        t0 = time.perf_counter()
        finished = 0

        async def one(prompt: npt.NDArray[np.int64], sp: SamplingParams) -> None:
            nonlocal finished
            started = time.perf_counter()
            result = await engine.generate(prompt, sp)
            run.latencies.append((time.perf_counter() - started) * 1e3)
            run.tokens += len(result.token_ids)
            finished += 1
            run.done(finished, t0)

        tasks = [asyncio.create_task(one(prompt, sp)) for prompt, sp in run.prompts()]
        await asyncio.sleep(0)  # the tasks submit before the busy rpcs
        for i in range(5):
            t = time.perf_counter()
            await engine.collective_rpc("save_checkpoint", path=f"{run.ckdir}/busy-{i}.ckpt")
            run.busy.append((time.perf_counter() - t) * 1e3)
        await asyncio.gather(*tasks)
        run.wall = time.perf_counter() - t0
        run.steps = ((await engine.collective_rpc("get_load")).result or {}).get("steps")
    run.summary(f"asyncio, {run.requests} tasks")
    return 0


def demo(mode: str, requests: int, max_new_tokens: int, seed: int, *,
         use_async: bool = False) -> int:
    """Run the workload on one face; print the summary. Returns an exit status."""
    print(f"typed-sched-bus demo: mode={mode}{' (async)' if use_async else ''}, "
          f"{requests} requests x {max_new_tokens} tokens", flush=True)
    run = _Run(mode, requests, max_new_tokens, seed)
    return asyncio.run(_async(run)) if use_async else _sync(run)
