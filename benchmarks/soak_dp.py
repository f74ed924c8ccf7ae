"""Soak scenarios of data parallel (part of ``python -m benchmarks.soak``).

Each scenario returns a dict of keys for soak's last JSON line; soak checks
them against its bounds table.

* ``dp_flood_requests``, ``dp_flood_false_losses``, ``dp_flood_failed``:
  ``Engine("zmq", dp_size=2, start_timeout=300).submit_many`` of 12,000 two-token requests,
  three times, with more CPU hogs than cores running beside it; replicas
  declared lost (none died) and requests failed other than ``overloaded``.
* ``dp_pause_false_losses``: the dispatcher's process stopped for 4 s
  (SIGSTOP, then SIGCONT) while streams run; replicas declared lost.
* ``dp_stuck_rpc_client_max_silence_ms``: the longest gap in one client's
  stream while another client sends 12,000 ``metrics`` calls and never
  reads a reply.
* ``dp_short_behind_long_ttft_p50_ms``: the median time to first token of
  20 short requests sent just after a 32k-token prompt (``dp_size=2``).
* ``dp_replica_respawn_ms``: from SIGKILL of a local replica to it taking
  new work again (restarted by the engine itself: forked from the fork server,
  its model built).
* ``log_lines_per_1000_garbage_frames``: stderr lines of ``serve --dp 2``
  per 1000 garbage frames sent to its work socket.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO

import zmq

from bus import RpcCaller, RpcClient, WouldBlock
from messages import RpcReqInput, SamplingParams
from scheduler import Engine, RequestFailed

__all__ = ["SCENARIOS"]


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """``n`` busy-loop processes beside the block; stopped after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _lost(engine: Engine) -> int:
    load = engine.collective_rpc("get_load", timeout=60).result or {}
    lost = load.get("dispatcher.lost", -1)
    return lost if isinstance(lost, int) else -1


def dp_flood(n: int = 12_000, rounds: int = 3) -> dict[str, float]:
    """12,000 two-token requests, three times, beside more CPU hogs than cores."""
    failed = overloaded = 0
    examples: list[str] = []
    t0 = time.perf_counter()
    with hogs((os.cpu_count() or 1) + 1), Engine("zmq", dp_size=2, start_timeout=300) as engine:
        sp = SamplingParams(max_new_tokens=2)
        for _ in range(rounds):
            for h in engine.submit_many([[1 + i % 50, 2 + i % 7] for i in range(n)], sp):
                try:
                    h.result(600)
                except RequestFailed as exc:
                    if exc.code == "overloaded":
                        overloaded += 1
                    else:
                        failed += 1
                        examples.append(str(exc)[:200])
        lost = _lost(engine)
    if examples:
        print(f"dp_flood failures, e.g.: {examples[:3]}", file=sys.stderr)
    return {"dp_flood_requests": n * rounds, "dp_flood_false_losses": lost,
            "dp_flood_failed": failed, "dp_flood_overloaded": overloaded,
            "dp_flood_s": round(time.perf_counter() - t0, 1)}


def dp_pause(streams: int = 20, pause: float = 4.0) -> dict[str, float]:
    """The dispatcher stopped for ``pause`` seconds while streams run."""
    with Engine("zmq", dp_size=2, start_timeout=300) as engine:
        handles = [engine.submit([1 + i, 2, 3], SamplingParams(max_new_tokens=100_000),
                                 stream=True) for i in range(streams)]
        for h in handles:  # every one has started
            next(iter(h))
        pid = engine._core._scheduler.essential[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        time.sleep(pause)  # sleep-ok: the pause under test
        os.kill(pid, signal.SIGCONT)
        time.sleep(2 * 3.0)  # sleep-ok: past the local heartbeat timeout after it
        lost = _lost(engine)
        failed = 0
        for h in handles:
            engine.abort(h.rid)
            try:
                h.result(60)
            except RequestFailed:
                failed += 1
    return {"dp_pause_false_losses": lost, "dp_pause_streams_failed": failed}


def dp_stuck_rpc_client(calls: int = 12_000, seconds: float = 8.0) -> dict[str, float]:
    """One client never reads its rpc replies; the longest silence of another's stream."""
    with Engine("zmq", dp_size=2, start_timeout=300) as engine:
        h = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=1_000_000), stream=True)
        it = iter(h)
        next(it)
        stop = threading.Event()
        sent = [0]

        def stuck() -> None:
            with RpcCaller(engine.endpoints.rpc, name="stuck") as caller:
                i = 0
                while i < calls and not stop.is_set():
                    try:
                        caller.send_nowait(RpcReqInput(rid=f"stuck{i}", method="metrics"))
                        i += 1
                    except WouldBlock:
                        time.sleep(0.001)  # sleep-ok: pacing a sender held back
                sent[0] = i
                stop.wait()  # never reads a reply; keeps its socket open

        t = threading.Thread(target=stuck)
        t.start()
        worst, last = 0.0, time.perf_counter()
        end = last + seconds
        try:
            for _ in it:
                now = time.perf_counter()
                worst, last = max(worst, now - last), now
                if now > end:
                    break
        finally:
            stop.set()
            t.join()
            engine.abort(h.rid)
    return {"dp_stuck_rpc_client_max_silence_ms": round(worst * 1e3, 1),
            "dp_stuck_rpc_client_calls": sent[0]}


def dp_short_behind_long(shorts: int = 20, long_tokens: int = 32_768) -> dict[str, float]:
    """20 short requests just after a 32k-token prompt: their time to first token."""
    with Engine("zmq", dp_size=2, start_timeout=300) as engine:
        engine.generate([1, 2], SamplingParams(max_new_tokens=1))  # warm
        long = engine.submit([i % 500 + 1 for i in range(long_tokens)],
                             SamplingParams(max_new_tokens=2))
        ttft: list[float] = []
        t0 = time.perf_counter()
        handles = [engine.submit([3 + i, 4], SamplingParams(max_new_tokens=4), stream=True)
                   for i in range(shorts)]
        for h in handles:
            next(iter(h))
            ttft.append(time.perf_counter() - t0)
            h.result(120)
        long.result(600)
    return {"dp_short_behind_long_ttft_p50_ms": round(statistics.median(ttft) * 1e3, 1)}


def dp_respawn() -> dict[str, float]:
    """SIGKILL a local replica of an engine; time until it takes new work."""
    with Engine("zmq", dp_size=2, start_timeout=300) as engine:
        sp = SamplingParams(max_new_tokens=1)
        engine.generate([1, 2], sp, dp_rank=0)
        t0 = time.perf_counter()
        for pid in engine.replica_pids[0]:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                engine.generate([1, 2], sp, dp_rank=0, timeout=60)
                break
            except RequestFailed:
                time.sleep(0.01)  # sleep-ok: pacing a deadline poll
        ms = (time.perf_counter() - t0) * 1e3
    return {"dp_replica_respawn_ms": round(ms, 1)}


def garbage_logs(n: int = 5000) -> dict[str, float]:
    """Garbage frames into ``serve --dp 2``: how many log lines they cost."""
    d = tempfile.mkdtemp(prefix="tsb-soak-dp-")
    os.rmdir(d)
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                                 "--endpoint", d], stderr=err, text=True)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(f"{d}/rpc"):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.01)  # sleep-ok: pacing a deadline poll
            with RpcClient(f"ipc://{d}/rpc", ctx=ctx) as rpc:
                while not rpc.call("get_load", timeout=120).success:
                    assert time.monotonic() < deadline
                err.flush()
                before = _lines(err)
                rng = random.Random(3)
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(f"ipc://{d}/work")
                for _ in range(n):
                    sock.send(rng.randbytes(rng.randrange(1, 64)))
                sock.close()
                deadline = time.monotonic() + 120
                while True:  # all taken (and rejected) by the dispatcher
                    load = rpc.call("get_load", timeout=60).result or {}
                    got = load.get("dispatcher.rejected", 0)
                    if (isinstance(got, int) and got >= n) or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)  # sleep-ok: pacing a deadline poll
                rpc.call("shutdown", timeout=60)
            proc.wait(60)
            lines = _lines(err) - before
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            ctx.term()
    return {"log_lines_per_1000_garbage_frames": round(lines * 1000 / n, 2),
            "garbage_frames": n}


def _lines(f: IO[str]) -> int:
    f.seek(0)
    n = len(f.read().splitlines())
    f.seek(0, 2)
    return n


#: In the order soak runs them.
SCENARIOS: list[Callable[[], dict[str, float]]] = [
    dp_flood, dp_pause, dp_stuck_rpc_client, dp_short_behind_long, dp_respawn, garbage_logs]
