"""Data parallel: the dispatcher hop, balance, replica loss, rpc fan-out. Same run, side by side.

Run: ``python -m benchmarks.dp``. The last line is one JSON object:

* ``dispatch_overhead_us_per_request``: the hop. Stub model, one token per
  request, 1000 in flight; one replica behind a dispatcher minus
  ``Engine("zmq")`` direct, alternating rounds, medians.
  ``dp2_us_per_request`` is ``Engine("zmq", dp_size=2)`` in the same rounds:
  on this 2-core machine two replicas, a dispatcher and the frontend share
  two cores, so it shows the contention more than the hop.
* ``imbalance_ratio_ours`` and ``imbalance_ratio_round_robin``: max/min
  tokens (prompt + max_new_tokens) dispatched per replica, 2 replicas, a
  skewed workload (1 prompt in 4 is 40x longer, output lengths vary 16x),
  submitted in waves; read from the dispatcher's own ledger (``get_load``).
* ``replica_loss_all_answered_ms``: from SIGKILL of a replica running 64
  streams until the last of them is answered (``replica_lost``). Median of
  a few kills.
* ``rpc_fanout_p50_us`` / ``rpc_fanout_p99_us``: ``collective_rpc("get_load")``
  through the dispatcher, idle, 2 replicas; ``rpc_direct_p99_us`` is one
  scheduler's, same run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import statistics
import sys
import time
from unittest import mock

from benchmarks._timing import percentiles
from messages import SamplingParams, token_ids
from scheduler import Engine, ModelConfig, RequestFailed
from scheduler.engine import core as engine_core
from scheduler.launch import processes

STUB = ModelConfig(kind="stub")
PROMPT = token_ids(range(1, 33))
ONE = SamplingParams(max_new_tokens=1, temperature=0.0)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _round(engine: Engine, n: int) -> float:
    t0 = time.perf_counter()
    for h in [engine.submit(PROMPT, ONE) for _ in range(n)]:
        h.result(60)
    return (time.perf_counter() - t0) / n * 1e6


def _dispatched() -> contextlib.AbstractContextManager[object]:
    """Engines built inside put a dispatcher in front even of one replica."""
    return mock.patch.object(engine_core, "start_processes",
                             functools.partial(processes.start_processes, dispatch=True))


def overhead(rounds: int, n: int) -> tuple[float, float, float]:
    """Median us/request of (direct, one replica behind the dispatcher, two replicas),
    alternating rounds."""
    direct: list[float] = []
    hop: list[float] = []
    dp: list[float] = []
    with _dispatched():
        behind = Engine("zmq", STUB, max_batch=64)
    with Engine("zmq", STUB, max_batch=64) as one, behind, \
            Engine("zmq", STUB, max_batch=64, dp_size=2) as two:
        for engine in (one, behind, two):
            _round(engine, 500)
        for r in range(rounds):
            order = [(one, direct), (behind, hop), (two, dp)]
            for engine, out in order[r % 3:] + order[:r % 3]:
                out.append(_round(engine, n))
    return statistics.median(direct), statistics.median(hop), statistics.median(dp)


def imbalance(policy: str, seed: int = 0) -> float:
    """max/min tokens dispatched per replica, for a skewed workload in waves."""
    rng = random.Random(seed)
    with Engine("zmq", STUB, max_batch=256, dp_size=2, dp_policy=policy) as engine:  # type: ignore[arg-type]
        for _ in range(10):  # waves: completions in between shift the in-flight loads
            handles = []
            for k in range(100):
                long = k % 4 == 0
                prompt = [1 + rng.randrange(100)] * (1280 if long else 32)
                sp = SamplingParams(max_new_tokens=rng.choice([2, 8, 32]), temperature=0.0)
                handles.append(engine.submit(prompt, sp))
            for h in handles:
                h.result(60)
        result = engine.collective_rpc("get_load").result or {}
    served = [float(str(result[f"replica{i}.dispatched_tokens"])) for i in range(2)]
    return max(served) / min(served)


def replica_loss_ms(kills: int) -> float:
    """Median ms from SIGKILL until the last of that replica's streams is answered."""
    out: list[float] = []
    slow = SamplingParams(max_new_tokens=50_000)  # 64 of them stay within the token limit
    for _ in range(kills):
        with Engine("zmq", STUB, max_batch=256, dp_size=2) as engine:
            mine = [engine.submit([1, 2, 3], slow, stream=True, dp_rank=0) for _ in range(64)]
            for h in mine:
                next(iter(h))
            t0 = time.perf_counter()
            for pid in engine.replica_pids[0]:
                os.kill(pid, signal.SIGKILL)
            for h in mine:
                try:
                    h.result(30)
                except RequestFailed as exc:
                    assert exc.code == "replica_lost", exc
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def rpc_latency(engine: Engine, n: int) -> tuple[float, float]:
    samples: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.collective_rpc("get_load")
        samples.append((time.perf_counter() - t0) * 1e6)
    return percentiles(samples)


def main() -> None:
    res: dict[str, float] = {}
    d, h, p = overhead(rounds=15, n=1000)
    say(f"stub, 1000 in flight: direct {d:.1f} us/request; one replica behind the "
        f"dispatcher {h:.1f} (the hop: {h - d:.1f}); two replicas {p:.1f}")
    res["direct_us_per_request"] = round(d, 1)
    res["dispatched_us_per_request"] = round(h, 1)
    res["dispatch_overhead_us_per_request"] = round(h - d, 1)
    res["dp2_us_per_request"] = round(p, 1)
    ours, rr = imbalance("least_loaded"), imbalance("round_robin")
    say(f"imbalance (max/min tokens per replica): least loaded {ours:.3f}, round robin {rr:.3f}")
    res["imbalance_ratio_ours"] = round(ours, 3)
    res["imbalance_ratio_round_robin"] = round(rr, 3)
    loss = replica_loss_ms(5)
    say(f"SIGKILL to the last of its 64 streams answered: {loss:.1f} ms (median of 5)")
    res["replica_loss_all_answered_ms"] = round(loss, 1)
    with Engine("zmq", STUB, dp_size=2) as two, Engine("zmq", STUB) as one:
        rpc_latency(two, 50)
        f50, f99 = rpc_latency(two, 500)
        _, d99 = rpc_latency(one, 500)
    say(f"rpc get_load, idle: fan-out to 2 p50 {f50:.0f} us, p99 {f99:.0f} us "
        f"(one scheduler p99 {d99:.0f} us)")
    res["rpc_fanout_p50_us"] = round(f50)
    res["rpc_fanout_p99_us"] = round(f99)
    res["rpc_direct_p99_us"] = round(d99)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
