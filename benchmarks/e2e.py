"""End to end: generate throughput, bus+router overhead per request, rpc latency, both modes.

Run: ``python -m benchmarks.e2e``. The last line is one JSON object.

* Throughput: N generate requests through the real model, per mode.
* Overhead: the same loop with :class:`~scheduler.StubLM` (near-zero model
  cost), one token per request, through the Engine; against a baseline that
  feeds the very same scheduler by direct calls, with no bus at all. The
  difference per request is what the bus, router and engine add.
* Rpc latency p50/p99, idle and while 1000 generate requests flood the work channel.
* Hello: the wire handshake (:func:`scheduler.hello`) against the idle
  scheduler, p50/p99 (``hello_ms_p50``), and the first one of a process
  (``hello_first_ms``: it computes this side's layout once).
* Metrics overhead: the stub-model Engine in zmq mode with metrics against
  without (9 back-to-back pairs, order alternating; the median of the
  paired differences), and the same scheduler driven in-process
  (``metrics_overhead_us_per_request_direct``), which resolves what the
  two-process figure's noise (tens of µs between runs on 2 cores) cannot.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Literal

from benchmarks._timing import percentiles
from bus import Envelope, Origin, Receiver, Rejected, RpcClient
from messages import Output, Request, SamplingParams, TokenizedGenerateReqInput, token_ids
from router import CallbackSink, scheduler_router
from scheduler import Engine, ModelConfig, Scheduler, StubLM, hello

Mode = Literal["ring", "zmq"]
WORK = Origin("work")


class _DirectInbox:
    """No bus: hands the scheduler envelopes from a list (the baseline)."""

    name = "work"
    rejected = 0

    def __init__(self, reqs: Sequence[Request]) -> None:
        self._items = [Envelope(r, WORK) for r in reqs]
        self._i = 0

    def drain(self, max_n: int) -> list[Envelope[Request] | Rejected]:
        out = self._items[self._i : self._i + max_n]
        self._i += len(out)
        return list(out)

    def pollable(self) -> int:
        import os

        if not hasattr(self, "_fd"):
            self._fd = os.eventfd(1)
        return self._fd

    def close(self) -> None:
        pass


def _requests(n: int, tokens: int) -> list[TokenizedGenerateReqInput]:
    return [TokenizedGenerateReqInput(rid=f"r{i}", input_ids=token_ids(range(1, 33)),
                                      sampling=SamplingParams(max_new_tokens=tokens,
                                                              temperature=0.0))
            for i in range(n)]


def direct_us_per_request(n: int, *, metrics: bool = True) -> float:
    reqs = _requests(n, 1)
    done: list[Output] = []
    sink = CallbackSink(lambda o, g: done.append(o))
    router = scheduler_router(sink, sink)  # type: ignore[arg-type]
    sched = Scheduler(Receiver([_DirectInbox(reqs)]), router,
                      StubLM(ModelConfig(kind="stub")), max_batch=64, metrics=metrics)
    t0 = time.perf_counter()
    while sched.step() or sched.busy:
        pass
    dt = time.perf_counter() - t0
    assert sum(len(o.rids) for o in done if hasattr(o, "rids")) == n  # type: ignore[attr-defined]
    return dt / n * 1e6


def engine_us_per_request(mode: Mode, n: int, *, metrics: bool = True) -> float:
    with Engine(mode, ModelConfig(kind="stub"), max_batch=64, metrics=metrics) as engine:
        prompt = token_ids(range(1, 33))
        sp = SamplingParams(max_new_tokens=1, temperature=0.0)
        for h in [engine.submit(prompt, sp) for _ in range(200)]:  # warm up
            h.result(60)
        t0 = time.perf_counter()
        handles = [engine.submit(prompt, sp) for _ in range(n)]
        for h in handles:
            h.result(60)
        return (time.perf_counter() - t0) / n * 1e6


def throughput(mode: Mode, n: int, tokens: int) -> tuple[float, float]:
    with Engine(mode, ModelConfig(), max_batch=64) as engine:
        engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))  # warm up
        prompt = token_ids(range(1, 33))
        sp = SamplingParams(max_new_tokens=tokens, temperature=0.8, seed=1)
        t0 = time.perf_counter()
        handles = [engine.submit(prompt, sp) for _ in range(n)]
        total = sum(len(h.result(300).token_ids) for h in handles)
        dt = time.perf_counter() - t0
    return n / dt, total / dt


def rpc_latency(mode: Mode, samples: int) -> tuple[list[float], list[float]]:
    with Engine(mode, ModelConfig(), max_batch=64) as engine:
        idle = []
        for _ in range(samples):
            t0 = time.perf_counter()
            engine.collective_rpc("get_load")
            idle.append((time.perf_counter() - t0) * 1e6)
        handles = [engine.submit([1, 2, 3], SamplingParams(max_new_tokens=64))
                   for _ in range(1000)]
        flood = []
        for _ in range(samples):
            t0 = time.perf_counter()
            engine.collective_rpc("get_load")
            flood.append((time.perf_counter() - t0) * 1e6)
        for h in handles:
            engine.abort(h.rid)
        for h in handles:
            h.result(120)
    return idle, flood


def hello_latency(samples: int) -> tuple[float, list[float]]:
    """(first hello of this process, then each of ``samples`` more), in ms, over zmq."""
    with Engine("zmq", ModelConfig()) as engine, RpcClient(engine.endpoints.rpc) as client:
        engine.collective_rpc("get_load")  # connected and serving
        t0 = time.perf_counter()
        hello(client, 30)
        first = (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            hello(client, 30)
            times.append((time.perf_counter() - t0) * 1e3)
    return first, times


def main() -> None:
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    res: dict[str, float] = {}
    n = 3000
    direct = statistics.median(direct_us_per_request(n) for _ in range(3))
    say(f"baseline (stub model, no bus, direct calls): {direct:.1f} us/request")
    for mode in ("ring", "zmq"):
        via = statistics.median(engine_us_per_request(mode, n) for _ in range(3))
        rps, tps = throughput(mode, 256, 32)
        idle, flood = rpc_latency(mode, 200)
        i50, i99 = percentiles(idle)
        f50, f99 = percentiles(flood)
        say(f"{mode}: stub via Engine {via:.1f} us/request -> overhead {via - direct:.1f} us; "
            f"real model {rps:.1f} req/s, {tps:,.0f} tokens/s; rpc us p50/p99 idle "
            f"{i50:.0f}/{i99:.0f}, flood {f50:.0f}/{f99:.0f}")
        res.update({
            f"stub_us_per_request_{mode}": round(via, 1),
            f"overhead_us_per_request_{mode}": round(via - direct, 1),
            f"requests_per_s_{mode}": round(rps, 1),
            f"tokens_per_s_{mode}": round(tps),
            f"rpc_idle_p50_us_{mode}": round(i50, 1),
            f"rpc_idle_p99_us_{mode}": round(i99, 1),
            f"rpc_flood_p50_us_{mode}": round(f50, 1),
            f"rpc_flood_p99_us_{mode}": round(f99, 1),
        })
    first, hellos = hello_latency(300)
    h50, h99 = percentiles(hellos)
    say(f"hello (wire handshake, zmq): first {first:.2f} ms, then p50 {h50:.3f} / "
        f"p99 {h99:.3f} ms")
    res.update({"hello_first_ms": round(first, 3), "hello_ms_p50": round(h50, 3),
                "hello_ms_p99": round(h99, 3)})
    with_m, without_m = [], []
    for i in range(9):  # pairs, alternating which goes first: drift hits both alike
        first, second = (False, True) if i % 2 == 0 else (True, False)
        got = {first: engine_us_per_request("zmq", n, metrics=first),
               second: engine_us_per_request("zmq", n, metrics=second)}
        with_m.append(got[True])
        without_m.append(got[False])
    on, off = statistics.median(with_m), statistics.median(without_m)
    paired = statistics.median(a - b for a, b in zip(with_m, without_m, strict=True))
    say(f"zmq metrics: {on:.2f} us/request with, {off:.2f} without; median of paired "
        f"differences {paired:+.2f} us")
    # The same difference without processes or sockets: the scheduler's own cost.
    d_on, d_off = [], []
    for _ in range(7):
        d_off.append(direct_us_per_request(n, metrics=False))
        d_on.append(direct_us_per_request(n, metrics=True))
    don, doff = statistics.median(d_on), statistics.median(d_off)
    say(f"direct metrics: {don:.2f} us/request with, {doff:.2f} without -> {don - doff:+.2f} us")
    res["metrics_overhead_us_per_request_direct"] = round(don - doff, 2)
    res["stub_us_per_request_zmq_metrics_on"] = round(on, 2)
    res["stub_us_per_request_zmq_metrics_off"] = round(off, 2)
    res["metrics_overhead_us_per_request_zmq"] = round(paired, 2)
    res["direct_us_per_request"] = round(direct, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
