"""The HTTP front door against its floors, same run: ``python -m benchmarks.http``.

The last line is one JSON object, the stub model throughout:

* ``http_rps_ratio_vs_floor``: non-streaming 1-token completions per second
  through ``python -m frontend --mode zmq``, divided by the same HTTP stack
  (uvicorn, same loop and parser, a raw ASGI app) answering a constant JSON
  body; same client, concurrency 64, alternating rounds, median of each.
  ``floor_starlette_rps`` is that floor written with Starlette (how the ASGI
  stack was chosen: a framework costs more per request than our handler),
  where Starlette is installed (it is not a dependency; null elsewhere).
  ``handler_only_rps`` is ``python -m frontend``'s app and protocol over an
  engine that answers at once (no scheduler round trip): the HTTP side's
  own ceiling.
* ``stream_tokens_ratio_vs_async``: tokens per second over 256 concurrent
  HTTP streams of 256 tokens each, divided by 256 concurrent ``AsyncEngine``
  streams of the same workload (zmq mode, max_batch 256) with no HTTP,
  alternating rounds. The reference process hides its start-up objects from
  the collector (``gc.freeze()``) as the server does.
  ``stream_tokens_ratio_vs_async_32_tokens`` is the same with 32-token
  answers: there each stream's connection and request cost about as much
  as its streaming, and that figure says so.
* ``ttft_overhead_ms_p50``: time to first token over HTTP (request sent to
  first SSE event read) minus the same through ``AsyncEngine`` (``stream()``
  to its first chunk), concurrency 1, p50 of each.
* ``loop_lag_ms_p99``: the server's event-loop lag while the 256 streams run,
  both lengths (its ``tsb_http_loop_lag_seconds`` histogram, a 20 ms probe:
  the p99 is a bucket's bound).
* ``cpu_ratio_vs_floor``: the floor's CPU time per request over the
  frontend's (its scheduler process included), from ``/proc``: on a shared
  box where other work takes the cores, what each request *costs* is
  steadier than how many fit in a second. ``load_avg_1m`` says how shared,
  and ``box_wake_cpu_us`` what a process pays in CPU to wake from a short
  sleep here: the frontend and the scheduler each sleep about every other
  request at concurrency 64 (the floor's loop never does), and at
  concurrency 1 every request costs several wake-ups across the two
  processes and libzmq's I/O threads.
* ``disconnect_to_free_ms_p99``: a stream is closed by its client after its
  first event; the time until ``get_load`` (through the server's rpc door)
  shows the slot free.

The load client is a raw asyncio HTTP/1.1 client (keep-alive, one
connection per concurrent request, chunked SSE parsed by hand) in its own
process (``python -m benchmarks.http client ...``): it shares no interpreter
or GIL with the server, and it costs a fraction of what ``httpx`` does per
request, so on a 2-core box it measures the server rather than itself. The
stream client is a bare ``asyncio.Protocol`` on uvloop (each arriving piece
is one append, nothing parsed until the answer's end): measured against the
``StreamReader`` client it replaced, against one server in one run, 5.8 us
of client CPU a token against 7.6 (start-up included), at the same rate.
``stream_client_cpu_us_per_token`` prints its cost: the share of the box
the HTTP side pays for a client that the in-process reference has not.
Every client, and the ``AsyncEngine`` reference, runs on uvloop as the
server does (the reference ran on the default loop until this round: a
slower loop than a user would give it).
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks._http_client import (  # the load client: its own module
    MODEL,
    RPS_SECONDS,
    SHORT_STREAM_TOKENS,
    STREAM_TOKENS,
    STREAMS,
    TTFT_SAMPLES,
    _run,
    client,
)

ROUNDS = 3
_FLOOR_BODY = json.dumps({"id": "cmpl-0", "object": "text_completion", "created": 0,
                          "model": MODEL, "choices": [{"index": 0, "text": "\u0000",
                                                       "finish_reason": "length",
                                                       "logprobs": None}],
                          "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                    "total_tokens": 3}}).encode()


# -- the floor servers ---------------------------------------------------------------


async def _floor_app(scope: dict[str, object], receive: Callable[[], Awaitable[dict[str, object]]],
                     send: Callable[[dict[str, object]], Awaitable[None]]) -> None:
    """The same stack answering a constant body (the request body is read, as ours is)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"%d" % len(_FLOOR_BODY))]})
    await send({"type": "http.response.body", "body": _FLOOR_BODY})


def _starlette_app() -> object:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def completions(request: Request) -> Response:
        await request.body()
        return Response(_FLOOR_BODY, media_type="application/json")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def serve_floor(port: int, kind: str) -> None:
    import uvicorn

    app = _starlette_app() if kind == "starlette" else _floor_app
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning",  # type: ignore[arg-type]
                access_log=False, lifespan="off")


def serve_handler_only(port: int) -> None:
    """``python -m frontend``'s app and protocol over an engine that answers every
    non-streamed request at once, with no scheduler round trip: what the HTTP
    side and our handler cost alone (the scheduler, in ring mode, idles)."""
    import uvicorn

    from frontend import ByteTokenizer, Frontend, Settings
    from frontend.serving import http_protocol
    from messages import SamplingParams
    from scheduler import AsyncEngine, ModelConfig
    from scheduler.engine.handles import GenerateResult

    class Instant(AsyncEngine):
        def submit(self, input_ids: object, sampling: SamplingParams | None = None, *,
                   return_logprob: bool = False, rid: str | None = None,
                   dp_rank: int | None = None) -> Any:
            done = asyncio.get_running_loop().create_future()
            done.set_result(GenerateResult("instant", [104], "length", None))
            return done

    tok = ByteTokenizer()
    app = Frontend(Settings(mode="ring", model=ModelConfig(vocab_size=tok.vocab_size,
                                                           kind="stub")), tok,
                   engine=lambda s: Instant(s.mode, s.model, max_batch=s.max_batch))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                http=http_protocol(), lifespan="on", proxy_headers=False)



async def _run_client(*args: object) -> object:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.http", "client", *map(str, args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    if proc.returncode:
        raise RuntimeError(f"client {args}: {err.decode()[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])


def _wake_cpu_us() -> float:
    """CPU microseconds a process pays to wake from a 1 ms sleep, on this box: a fixed
    piece of work timed back to back and after each sleep, medians of 3 (Linux VMs
    pay tens of microseconds a wake-up; on bare metal it is a few). A server that
    sleeps between requests pays it per sleep; one never idle under load does not."""
    def work() -> dict[int, str]:
        return {i: str(i) for i in range(300)}

    def per_call(gap: float, n: int = 300) -> float:
        r, w = os.pipe()
        try:
            t0 = time.process_time()
            for _ in range(n):
                if gap:
                    select.select([r], [], [], gap)
                work()
            return (time.process_time() - t0) / n * 1e6
        finally:
            os.close(r)
            os.close(w)

    hot = statistics.median(per_call(0) for _ in range(3))
    cold = statistics.median(per_call(0.001) for _ in range(3))
    return max(0.0, cold - hot)


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended (the load clients)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its descendants so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(_cpu_s(int(c)) for c in f.read().split())
    except OSError:
        pass
    return total


async def _rps_round(port: int, pid: int) -> tuple[float, float]:
    """(requests/s, server CPU microseconds per request) of one round."""
    cpu0 = _cpu_s(pid)
    rps = float(await _run_client("rps", port))  # type: ignore[arg-type]
    cpu = _cpu_s(pid) - cpu0
    return rps, cpu / (rps * RPS_SECONDS) * 1e6


# -- the in-process reference (AsyncEngine, no HTTP) ---------------------------------------


async def _async_streams(engine: object, n: int, tokens: int) -> float:
    from messages import SamplingParams
    from scheduler import AsyncEngine

    assert isinstance(engine, AsyncEngine)
    sp = SamplingParams(max_new_tokens=tokens, temperature=0.0)
    prompt = [104, 105]

    async def one() -> int:
        got = 0
        async for chunk in engine.stream(prompt, sp):
            got += len(chunk.token_ids)
        return got

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(one() for _ in range(n))))
    return total / (time.perf_counter() - t0)


async def _async_ttft(engine: object, samples: int) -> list[float]:
    from messages import SamplingParams
    from scheduler import AsyncEngine

    assert isinstance(engine, AsyncEngine)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        stream = engine.stream([104, 105], sp)
        async for _chunk in stream:
            out.append((time.perf_counter() - t0) * 1e3)
            break
        await stream.aclose()  # type: ignore[attr-defined]
    return out


async def _rpc_concurrent_16_vs_one(engine: object, rounds: int = 7) -> float:
    """Median time of 16 ``get_load`` rpc calls at once over that of one, through the
    ``AsyncEngine`` while :data:`STREAMS` streams run (served one after another, 16
    calls take about 16 times one)."""
    from messages import SamplingParams
    from scheduler import AsyncEngine

    assert isinstance(engine, AsyncEngine)
    stop = asyncio.Event()

    async def stream() -> None:
        while not stop.is_set():
            async for _ in engine.stream([104, 105], SamplingParams(max_new_tokens=256)):
                if stop.is_set():
                    break

    streams = [asyncio.create_task(stream()) for _ in range(STREAMS)]
    one: list[float] = []
    many: list[float] = []
    try:
        while engine.pending < STREAMS:
            await asyncio.sleep(0.01)
        for _ in range(rounds):
            t0 = time.perf_counter()
            await engine.collective_rpc("get_load")
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.collective_rpc("get_load") for _ in range(16)))
            many.append(time.perf_counter() - t0)
    finally:
        stop.set()
        await asyncio.gather(*streams)
    return statistics.median(many) / statistics.median(one)


# -- the run ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cmd: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()  # (a server that hangs in its start is not left running)
                proc.wait()
                raise RuntimeError(f"{cmd} did not start") from None
            time.sleep(0.1)  # sleep-ok: pacing of a start-up poll


def _loop_lag_counts(port: int) -> tuple[list[float], list[float]]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    bounds, counts = [], []
    for line in text.decode().splitlines():
        if line.startswith("tsb_http_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            bounds.append(float("inf") if le == "+Inf" else float(le))
            counts.append(float(line.rsplit(" ", 1)[1]))
    return bounds, counts


def _p99_bound(bounds: list[float], before: list[float], after: list[float]) -> float:
    delta = [a - b for a, b in zip(after, before, strict=True)]
    total = delta[-1]
    for bound, n in zip(bounds, delta, strict=True):
        if total and n >= 0.99 * total:
            return bound
    return float("inf")


async def run() -> dict[str, object]:
    from scheduler import AsyncEngine, ModelConfig

    rpc_dir = tempfile.mkdtemp(prefix="tsb-bench-http-")
    os.rmdir(rpc_dir)  # the server makes it, private
    # Starlette is not a dependency: its floor (how the ASGI stack was chosen) is run
    # where it is installed, and printed as null elsewhere.
    names = ["floor", "frontend", "handler"]
    if importlib.util.find_spec("starlette") is not None:
        names.insert(2, "starlette")
    ports = {k: _free_port() for k in names}
    commands = {
        "frontend": ["-m", "frontend", "--mode", "zmq", "--tiny-model", "stub", "--port",
                     str(ports["frontend"]), "--max-batch", str(STREAMS), "--endpoint",
                     rpc_dir, "--log-level", "warning"],
        "floor": ["-m", "benchmarks.http", "floor", str(ports["floor"]), "raw"],
        "starlette": ["-m", "benchmarks.http", "floor", str(ports.get("starlette")),
                      "starlette"],
        "handler": ["-m", "benchmarks.http", "handler", str(ports["handler"])],
    }
    procs: list[subprocess.Popen[bytes]] = []  # (those started are stopped, whatever fails)
    model = ModelConfig(vocab_size=259, kind="stub")
    try:
        for k in names:
            procs.append(_start([sys.executable, *commands[k]], ports[k]))
        pids = {k: proc.pid for k, proc in zip(names, procs, strict=True)}
        # The reference: the same scheduler (zmq, stub, max_batch) with no HTTP, in this
        # process, its rounds alternating with the HTTP ones (the box's noise hits both).
        async with AsyncEngine("zmq", model, max_batch=STREAMS) as engine:
            gc.freeze()  # the reference runs as the server does (frontend.app)
            await _run_client("rps", ports["frontend"])  # warm-up
            rps: dict[str, list[tuple[float, float]]] = {k: [] for k in ports}
            for _ in range(ROUNDS):
                for name in names:
                    rps[name].append(await _rps_round(ports[name], pids[name]))
            streams: dict[int, tuple[list[float], list[float]]] = {
                n: ([], []) for n in (STREAM_TOKENS, SHORT_STREAM_TOKENS)}
            client_cpu: list[float] = []  # the stream client's CPU, us a token
            bounds, before = _loop_lag_counts(ports["frontend"])
            for _ in range(ROUNDS):
                for n, (http_rates, async_rates) in streams.items():
                    before_client = _children_cpu_s()
                    http_rates.append(float(await _run_client(  # type: ignore[arg-type]
                        "streams", ports["frontend"], n)))
                    if n == STREAM_TOKENS:
                        client_cpu.append((_children_cpu_s() - before_client)
                                          / (STREAMS * n) * 1e6)
                    async_rates.append(await _async_streams(engine, STREAMS, n))
            _, after = _loop_lag_counts(ports["frontend"])
            http_streams, async_streams = streams[STREAM_TOKENS]
            short_http, short_async = streams[SHORT_STREAM_TOKENS]
            http_ttft: list[float] = []
            async_ttft: list[float] = []
            for _ in range(ROUNDS):
                got = await _run_client("ttft", ports["frontend"])
                assert isinstance(got, list)
                http_ttft += got
                async_ttft += await _async_ttft(engine, TTFT_SAMPLES)
            disconnects = await _run_client("disconnect", ports["frontend"], rpc_dir)
            rpc_concurrent = await _rpc_concurrent_16_vs_one(engine)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert isinstance(disconnects, list)
    med = statistics.median

    def rate(name: str) -> float:
        return med(r for r, _ in rps[name])

    def cpu(name: str) -> float:
        return med(c for _, c in rps[name])

    def starlette(figure: Callable[[str], float]) -> int | None:
        return round(figure("starlette")) if "starlette" in rps else None

    http_ttft_p50, async_ttft_p50 = med(http_ttft), med(async_ttft)
    dis = sorted(disconnects)
    return {
        "http_rps_ratio_vs_floor": round(rate("frontend") / rate("floor"), 3),
        "frontend_rps": round(rate("frontend")),
        "floor_rps": round(rate("floor")),
        "floor_starlette_rps": starlette(rate),
        "cpu_ratio_vs_floor": round(cpu("floor") / cpu("frontend"), 3),
        "frontend_cpu_us_per_request": round(cpu("frontend")),
        "floor_cpu_us_per_request": round(cpu("floor")),
        "floor_starlette_cpu_us_per_request": starlette(cpu),
        "handler_only_rps": round(rate("handler")),
        "handler_only_cpu_us_per_request": round(cpu("handler")),
        "stream_tokens_ratio_vs_async": round(med(http_streams) / med(async_streams), 3),
        "http_stream_tokens_per_s": round(med(http_streams)),
        "stream_client_cpu_us_per_token": round(med(client_cpu), 2),
        "async_stream_tokens_per_s": round(med(async_streams)),
        "stream_tokens_ratio_vs_async_32_tokens": round(med(short_http) / med(short_async), 3),
        "http_stream_tokens_per_s_32_tokens": round(med(short_http)),
        "async_stream_tokens_per_s_32_tokens": round(med(short_async)),
        "ttft_overhead_ms_p50": round(http_ttft_p50 - async_ttft_p50, 3),
        "http_ttft_ms_p50": round(http_ttft_p50, 3),
        "async_ttft_ms_p50": round(async_ttft_p50, 3),
        "loop_lag_ms_p99": _p99_bound(bounds, before, after) * 1e3,
        "disconnect_to_free_ms_p99": round(dis[min(len(dis) - 1, int(len(dis) * 0.99))], 3),
        "disconnect_to_free_ms_p50": round(med(dis), 3),
        "rpc_concurrent_16_vs_one": round(rpc_concurrent, 3),
        "bars": {"http_rps_ratio_vs_floor": ">= 0.5", "stream_tokens_ratio_vs_async": ">= 0.8",
                 "ttft_overhead_ms_p50": "<= 1.0", "loop_lag_ms_p99": "<= 10",
                 "disconnect_to_free_ms_p99": "<= 50", "rpc_concurrent_16_vs_one": "<= 1.5"},
        "load_avg_1m": os.getloadavg()[0],
        "box_wake_cpu_us": round(_wake_cpu_us(), 1),
        "client": "raw asyncio HTTP/1.1 on uvloop, own process (streams: a bare protocol)",
        "server": "uvicorn (loop=auto, http=auto), zmq mode, stub model",
    }


def main() -> None:
    print(json.dumps(_run(run())))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "floor":
        serve_floor(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "handler":
        serve_handler_only(int(sys.argv[2]))
    else:
        main()
