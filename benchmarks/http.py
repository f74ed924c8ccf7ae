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
  the p99 is a bucket's bound), read by the load client right before and
  right after each HTTP stream round: the loaded rounds only, not the idle
  time between them nor the client's start-up.
* CPU from ``/proc``, read by the load client around its load alone (on a
  shared box where other work takes the cores, what each request *costs* is
  steadier than how many fit in a second):
  ``frontend_cpu_us_per_request`` is the door's process alone (``python -m
  frontend``, every thread: HTTP, tokenizer, engine client, libzmq's I/O
  threads) and ``floor_cpu_us_per_request`` the constant-answering uvicorn
  floor, over the same 1-token concurrency-64 load, divided by the requests
  answered; ``frontend_cpu_ratio_vs_floor`` is the first over the second.
  ``scheduler_cpu_us_per_request`` is the door's child processes (the
  scheduler, zmq mode, stub model) over the same load, and
  ``cpu_ratio_vs_floor`` the floor's over the door's and its scheduler's
  together. ``frontend_cpu_us_per_token`` and ``scheduler_cpu_us_per_token``
  are the door's process and its scheduler over the 256 streams of 256
  tokens, divided by the tokens streamed;
  ``frontend_cpu_per_token_ratio_vs_scheduler`` is the first over the second.
  ``load_avg_1m`` says how shared the box was, and ``box_wake_cpu_us`` what
  a process pays in CPU to wake from a short sleep here: the frontend and
  the scheduler each sleep about every other request at concurrency 64 (the
  floor's loop never does), and at concurrency 1 every request costs several
  wake-ups across the two processes and libzmq's I/O threads.
* ``disconnect_to_free_ms_p99``: a stream is closed by its client after its
  first event; the time until ``get_load`` (through the server's rpc door)
  shows the slot free.
* ``door_pinned``: whether the door's process had a core of its own
  (``HTTP_PIN=1 python -m benchmarks.http``, where the box has 2 cores or
  more): every thread of ``python -m frontend`` on the first core, its
  scheduler and each load client on the others (the benchmark's own
  ``AsyncEngine`` reference and the floors float). Unpinned (the default),
  the scheduler and the load client take the door's core in turns, and the
  loop lag counts those preemptions.

The load client is a raw asyncio HTTP/1.1 client (keep-alive, one
connection per concurrent request, chunked SSE parsed by hand) in its own
process (``python -m benchmarks.http client ...``): it shares no interpreter
or GIL with the server, and it costs a fraction of what ``httpx`` does per
request, so on a 2-core box it measures the server rather than itself. The
stream client is a bare ``asyncio.Protocol`` on uvloop (each arriving piece
is one append, nothing parsed until the answer's end), cheaper per token
than a ``StreamReader`` client at the same rate.
``stream_client_cpu_us_per_token`` prints its cost: the share of the box
the HTTP side pays for a client that the in-process reference has not.
Every client, and the ``AsyncEngine`` reference, runs on uvloop as the
server does (the default loop would be slower than a user would give it).
Every server gets one uncounted round of the 1-token load first, and both
stream paths (HTTP and the reference) one round of 32-token streams.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    SHORT_STREAM_TOKENS,
    STREAM_TOKENS,
    STREAMS,
    TTFT_SAMPLES,
    _run,
    client,
)
from benchmarks._procs import descendants, pin
from benchmarks._timing import print_checked

ROUNDS = 3
#: Every key of the JSON object ``main`` prints (checked once printed), so a figure
#: quoted elsewhere can be traced to this benchmark without running it.
KEYS = frozenset({
    "http_rps_ratio_vs_floor", "frontend_rps", "floor_rps", "floor_starlette_rps",
    "frontend_cpu_ratio_vs_floor", "frontend_cpu_us_per_request", "floor_cpu_us_per_request",
    "scheduler_cpu_us_per_request", "cpu_ratio_vs_floor", "floor_starlette_cpu_us_per_request",
    "handler_only_rps", "handler_only_cpu_us_per_request", "stream_tokens_ratio_vs_async",
    "http_stream_tokens_per_s", "stream_client_cpu_us_per_token", "frontend_cpu_us_per_token",
    "scheduler_cpu_us_per_token", "frontend_cpu_per_token_ratio_vs_scheduler",
    "async_stream_tokens_per_s", "stream_tokens_ratio_vs_async_32_tokens",
    "http_stream_tokens_per_s_32_tokens", "async_stream_tokens_per_s_32_tokens",
    "ttft_overhead_ms_p50", "http_ttft_ms_p50", "async_ttft_ms_p50", "loop_lag_ms_p99",
    "disconnect_to_free_ms_p99", "disconnect_to_free_ms_p50", "bars", "load_avg_1m",
    "box_wake_cpu_us", "client", "server", "rpc_concurrent_16_vs_one", "door_pinned",
})
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
                   stream: bool = False, return_logprob: bool = False,
                   rid: str | None = None, dp_rank: int | None = None) -> Any:
            done = asyncio.get_running_loop().create_future()
            done.set_result(GenerateResult("instant", [104], "length", None))
            return done

    tok = ByteTokenizer()
    app = Frontend(Settings(mode="ring", model=ModelConfig(vocab_size=tok.vocab_size,
                                                           kind="stub")), tok,
                   engine=lambda s: Instant(s.mode, s.model, max_batch=s.max_batch))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                http=http_protocol(), lifespan="on", proxy_headers=False)


#: The cores a load client runs on (all of them, unless the door is pinned: :func:`_pin_door`).
_CLIENT_CORES: set[int] | None = None


def _pin_door(pid: int) -> bool:
    """Every thread of the door's process ``pid`` on the first core; its descendants
    (the scheduler) and the load clients on the others. Returns whether it pinned
    (not on a box of one core). Threads the door starts later inherit its core."""
    global _CLIENT_CORES
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return False
    rest = set(cores[1:])
    pin(pid, {cores[0]})
    for child in descendants(pid):
        pin(child, rest)
    _CLIENT_CORES = rest
    return True


async def _run_client(*args: object) -> object:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.http", "client", *map(str, args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    if _CLIENT_CORES is not None:
        with contextlib.suppress(OSError):  # (one that has ended already)
            os.sched_setaffinity(proc.pid, _CLIENT_CORES)
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


async def _load(kind: str, port: int, pid: int, *args: object) -> dict[str, Any]:
    """One round of ``kind`` (``rps`` or ``streams``) from its own client process,
    with the server's CPU and loop lag read over the load alone."""
    got = await _run_client(kind, port, *args, pid)
    assert isinstance(got, dict)
    return got


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


def _p99_bound(bounds: list[float], delta: list[float]) -> float:
    """The first bucket bound under which 99% of the (cumulative) counts fall."""
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
        pinned = os.environ.get("HTTP_PIN") == "1" and _pin_door(pids["frontend"])
        # The reference: the same scheduler (zmq, stub, max_batch) with no HTTP, in this
        # process, its rounds alternating with the HTTP ones (the box's noise hits both).
        async with AsyncEngine("zmq", model, max_batch=STREAMS) as engine:
            gc.freeze()  # the reference runs as the server does (frontend.app)
            # Every server warmed alike, and both stream paths: one round each, not counted.
            for name in names:
                await _load("rps", ports[name], pids[name])
            await _load("streams", ports["frontend"], pids["frontend"], SHORT_STREAM_TOKENS)
            await _async_streams(engine, STREAMS, SHORT_STREAM_TOKENS)
            rps: dict[str, list[dict[str, Any]]] = {k: [] for k in names}
            for _ in range(ROUNDS):
                for name in names:
                    rps[name].append(await _load("rps", ports[name], pids[name]))
            streams: dict[int, tuple[list[dict[str, Any]], list[float]]] = {
                n: ([], []) for n in (STREAM_TOKENS, SHORT_STREAM_TOKENS)}
            client_cpu: list[float] = []  # the stream client's CPU, us a token
            for _ in range(ROUNDS):
                for n, (http_rounds, async_rates) in streams.items():
                    before_client = _children_cpu_s()
                    http_rounds.append(await _load("streams", ports["frontend"],
                                                   pids["frontend"], n))
                    if n == STREAM_TOKENS:
                        client_cpu.append((_children_cpu_s() - before_client)
                                          / (STREAMS * n) * 1e6)
                    async_rates.append(await _async_streams(engine, STREAMS, n))
            long_http, async_streams = streams[STREAM_TOKENS]
            short_rounds, short_async = streams[SHORT_STREAM_TOKENS]
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
        return float(med(r["done"] / r["seconds"] for r in rps[name]))

    def cpu(name: str, part: str = "both") -> float:
        """The server's CPU microseconds a request: its own process, its children, or both."""
        keys = {"own": ("cpu_s",), "children": ("children_cpu_s",),
                "both": ("cpu_s", "children_cpu_s")}[part]
        return float(med(sum(r[k] for k in keys) / r["done"] * 1e6 for r in rps[name]))

    def starlette(figure: Callable[[str], float]) -> int | None:
        return round(figure("starlette")) if "starlette" in rps else None

    def per_token(part: str) -> float:
        return float(med(r[part] / r["done"] * 1e6 for r in long_http))

    http_streams = [r["done"] / r["seconds"] for r in long_http]
    short_http = [r["done"] / r["seconds"] for r in short_rounds]
    # The loop lag over the HTTP stream rounds alone (both lengths), each read around its load.
    lag = [sum(c) for c in zip(*(r["lag_counts"] for r in long_http + short_rounds),
                                 strict=True)]
    lag_bounds = long_http[0]["lag_bounds"]
    http_ttft_p50, async_ttft_p50 = med(http_ttft), med(async_ttft)
    dis = sorted(disconnects)
    return {
        "http_rps_ratio_vs_floor": round(rate("frontend") / rate("floor"), 3),
        "frontend_rps": round(rate("frontend")),
        "floor_rps": round(rate("floor")),
        "floor_starlette_rps": starlette(rate),
        "frontend_cpu_ratio_vs_floor": round(cpu("frontend", "own") / cpu("floor"), 3),
        "frontend_cpu_us_per_request": round(cpu("frontend", "own")),
        "floor_cpu_us_per_request": round(cpu("floor")),
        "scheduler_cpu_us_per_request": round(cpu("frontend", "children")),
        "cpu_ratio_vs_floor": round(cpu("floor") / cpu("frontend"), 3),
        "floor_starlette_cpu_us_per_request": starlette(cpu),
        "handler_only_rps": round(rate("handler")),
        "handler_only_cpu_us_per_request": round(cpu("handler")),
        "stream_tokens_ratio_vs_async": round(med(http_streams) / med(async_streams), 3),
        "http_stream_tokens_per_s": round(med(http_streams)),
        "stream_client_cpu_us_per_token": round(med(client_cpu), 2),
        "frontend_cpu_us_per_token": round(per_token("cpu_s"), 2),
        "scheduler_cpu_us_per_token": round(per_token("children_cpu_s"), 2),
        "frontend_cpu_per_token_ratio_vs_scheduler": round(
            per_token("cpu_s") / per_token("children_cpu_s"), 3),
        "async_stream_tokens_per_s": round(med(async_streams)),
        "stream_tokens_ratio_vs_async_32_tokens": round(med(short_http) / med(short_async), 3),
        "http_stream_tokens_per_s_32_tokens": round(med(short_http)),
        "async_stream_tokens_per_s_32_tokens": round(med(short_async)),
        "ttft_overhead_ms_p50": round(http_ttft_p50 - async_ttft_p50, 3),
        "http_ttft_ms_p50": round(http_ttft_p50, 3),
        "async_ttft_ms_p50": round(async_ttft_p50, 3),
        "loop_lag_ms_p99": _p99_bound(lag_bounds, lag) * 1e3,
        "disconnect_to_free_ms_p99": round(dis[min(len(dis) - 1, int(len(dis) * 0.99))], 3),
        "disconnect_to_free_ms_p50": round(med(dis), 3),
        "rpc_concurrent_16_vs_one": round(rpc_concurrent, 3),
        "door_pinned": pinned,
        "bars": {"http_rps_ratio_vs_floor": ">= 0.5", "stream_tokens_ratio_vs_async": ">= 0.8",
                 "ttft_overhead_ms_p50": "<= 1.0", "loop_lag_ms_p99": "<= 10",
                 "disconnect_to_free_ms_p99": "<= 50", "frontend_cpu_ratio_vs_floor": "<= 2.0",
                 "frontend_cpu_per_token_ratio_vs_scheduler": "<= 1.2",
                 "rpc_concurrent_16_vs_one": "<= 1.5"},
        "load_avg_1m": os.getloadavg()[0],
        "box_wake_cpu_us": round(_wake_cpu_us(), 1),
        "client": "raw asyncio HTTP/1.1 on uvloop, own process (streams: a bare protocol)",
        "server": "uvicorn (loop=auto, http=auto), zmq mode, stub model",
    }


def main() -> None:
    print_checked(_run(run()), KEYS, "benchmarks.http")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        client(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "floor":
        serve_floor(int(sys.argv[2]), sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "handler":
        serve_handler_only(int(sys.argv[2]))
    else:
        main()
