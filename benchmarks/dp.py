"""Data parallel: the dispatcher hop, balance, replica loss, rpc fan-out. Same run, side by side.

Run: ``python -m benchmarks.dp``. The last line is one JSON object:

* ``dispatch_overhead_us_per_request``: the hop. Stub model, one token per
  request, 1000 in flight; one replica behind a dispatcher minus
  ``Engine("zmq")`` direct, alternating rounds, medians.
  ``dp2_us_per_request`` is ``Engine("zmq", dp_size=2)`` in the same rounds:
  on this 2-core machine two replicas, a dispatcher and the frontend share
  two cores, so it shows the contention more than the hop.
* ``prefill_us_per_token`` / ``decode_us_per_token``: what a replica of the
  default model spends reading one prompt token (4 prompts of 1024, one
  token out) and sampling one token in a running batch of 32 (1-token
  prompts, 32 tokens out), one scheduler, medians of 3: the weights of the
  ledger's score (``scheduler/dp/ledger.py``). ``sampled_token_in_prompt_tokens``
  is the second over the first: what a sampled token weighs, in prompt tokens.
* ``makespan_ratio_ours_vs_round_robin``: the default (real) model, 2
  replicas, 80 requests sent at once, 20 of them long (a 1024-token
  prompt) at random positions, the rest 32-token prompts, 4/16/64 tokens
  out at random. Makespan: from the first submit to the last answer. Per
  seed, least loaded and round robin in turns (who goes first alternates),
  each on its own engine; the figure is the median over the seeds of ours
  / round robin (< 1: ours finishes sooner); every seed's is printed.
  ``busy_imbalance_*``: max/min CPU seconds the replicas' processes
  actually spent (``/proc``), the work each did, medians over the seeds.
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
from scheduler.dp.ledger import DECODE_US_PER_TOKEN, PREFILL_US_PER_TOKEN
from scheduler.engine import async_engine
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
    return mock.patch.object(async_engine, "start_processes",
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


def calibrate(rounds: int = 3) -> tuple[float, float]:
    """(us per prompt token read, us per token sampled in a batch of 32), default model."""
    pre: list[float] = []
    dec: list[float] = []
    with Engine("zmq", ModelConfig(), max_batch=64, start_timeout=600) as engine:
        engine.generate([1] * 600, SamplingParams(max_new_tokens=8))  # warm up
        for _ in range(rounds):
            t0 = time.perf_counter()
            for h in [engine.submit([1 + k] * 1024, SamplingParams(max_new_tokens=1))
                      for k in range(4)]:
                h.result(300)
            pre.append((time.perf_counter() - t0) / (4 * 1024) * 1e6)
            sp = SamplingParams(max_new_tokens=32, temperature=0.0)
            t0 = time.perf_counter()
            for h in [engine.submit([1 + k], sp) for k in range(32)]:
                h.result(300)
            dec.append((time.perf_counter() - t0) / (32 * 32) * 1e6)
    return statistics.median(pre), statistics.median(dec)


def _cpu_seconds(pids: tuple[int, ...]) -> float:
    """utime + stime of ``pids`` so far (what the processes actually spent)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / os.sysconf("SC_CLK_TCK")


def workload(seed: int, n: int = 80, long: int = 20
             ) -> list[tuple[list[int], SamplingParams]]:
    """``n`` requests, ``long`` of them with a 1024-token prompt, at random positions."""
    rng = random.Random(seed)
    kinds = [True] * long + [False] * (n - long)
    rng.shuffle(kinds)
    return [([1 + rng.randrange(100)] * (1024 if k else 32),
             SamplingParams(max_new_tokens=rng.choice([4, 16, 64]), temperature=0.0))
            for k in kinds]


def makespan(engine: Engine, work: list[tuple[list[int], SamplingParams]]
             ) -> tuple[float, list[float]]:
    """(seconds until the last answer, CPU seconds each replica spent on it)."""
    before = [_cpu_seconds(p) for p in engine.replica_pids]
    t0 = time.perf_counter()
    handles = [engine.submit(prompt, sp) for prompt, sp in work]
    for h in handles:
        h.result(600)
    took = time.perf_counter() - t0
    return took, [_cpu_seconds(p) - b for p, b in zip(engine.replica_pids, before, strict=True)]


def balance(seeds: int) -> dict[str, float]:
    """Least loaded against round robin on the same workloads, seed by seed."""
    ratios: list[float] = []
    spans: dict[str, list[float]] = {"least_loaded": [], "round_robin": []}
    busy: dict[str, list[float]] = {"least_loaded": [], "round_robin": []}
    # A 60 s heartbeat: on a saturated box a healthy replica is otherwise
    # declared lost (#18), which would measure the liveness bug, not balance.
    slow_heartbeat = mock.patch.object(processes, "LOCAL_HEARTBEAT_TIMEOUT", 60.0)
    slow_heartbeat.start()
    engines = {policy: Engine("zmq", ModelConfig(), max_batch=64, dp_size=2, start_timeout=600,
                              dp_policy=policy)
               for policy in ("least_loaded", "round_robin")}
    try:
        for engine in engines.values():  # warm up
            makespan(engine, workload(-1, n=8, long=2))
        for seed in range(seeds):
            work = workload(seed)
            order = list(engines) if seed % 2 == 0 else list(engines)[::-1]
            got = {policy: makespan(engines[policy], work) for policy in order}
            for policy, (span, cpu) in got.items():
                spans[policy].append(span)
                busy[policy].append(max(cpu) / max(min(cpu), 1e-9))
            ratio = got["least_loaded"][0] / got["round_robin"][0]
            ratios.append(ratio)
            say(f"  seed {seed}: makespan least loaded {got['least_loaded'][0]:.2f} s, "
                f"round robin {got['round_robin'][0]:.2f} s (ratio {ratio:.3f}); replica "
                f"CPU s: ours {[round(c, 2) for c in got['least_loaded'][1]]}, "
                f"round robin {[round(c, 2) for c in got['round_robin'][1]]}")
    finally:
        for engine in engines.values():
            engine.close()
        slow_heartbeat.stop()
    return {
        "makespan_ratio_ours_vs_round_robin": round(statistics.median(ratios), 3),
        "makespan_s_ours": round(statistics.median(spans["least_loaded"]), 2),
        "makespan_s_round_robin": round(statistics.median(spans["round_robin"]), 2),
        "busy_imbalance_ours": round(statistics.median(busy["least_loaded"]), 3),
        "busy_imbalance_round_robin": round(statistics.median(busy["round_robin"]), 3),
        "makespan_seeds": seeds,
    }


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
    # BENCH_PARTS=balance runs the calibration and the makespan contest alone.
    if os.environ.get("BENCH_PARTS", "all") == "balance":
        balance_part(res)
        print(json.dumps(res))
        return
    d, h, p = overhead(rounds=15, n=1000)
    say(f"stub, 1000 in flight: direct {d:.1f} us/request; one replica behind the "
        f"dispatcher {h:.1f} (the hop: {h - d:.1f}); two replicas {p:.1f}")
    res["direct_us_per_request"] = round(d, 1)
    res["dispatched_us_per_request"] = round(h, 1)
    res["dispatch_overhead_us_per_request"] = round(h - d, 1)
    res["dp2_us_per_request"] = round(p, 1)
    balance_part(res)
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


def balance_part(res: dict[str, float]) -> None:
    """The ledger's weights, measured, and the makespan contest."""
    pre, dec = calibrate()
    say(f"default model, one replica: {pre:.1f} us per prompt token read, {dec:.1f} us per "
        f"token sampled in a batch of 32 (the ledger weighs {PREFILL_US_PER_TOKEN} and "
        f"{DECODE_US_PER_TOKEN})")
    res["prefill_us_per_token"] = round(pre, 1)
    res["decode_us_per_token"] = round(dec, 1)
    res["sampled_token_in_prompt_tokens"] = round(dec / pre, 2)
    seeds = int(os.environ.get("BENCH_SEEDS", 5))
    say(f"makespan, 80 requests (20 long at random positions), {seeds} seeds:")
    res.update(balance(seeds))


if __name__ == "__main__":
    main()
