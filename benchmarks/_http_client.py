"""The HTTP benchmark's load client, run in its own process by ``benchmarks.http``
(``python -m benchmarks.http client KIND PORT ...``): raw asyncio HTTP/1.1 on uvloop
(see ``benchmarks/http.py`` for why this client and what each figure means).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from benchmarks._procs import descendants

T = TypeVar("T")

MODEL = "tiny"
CONCURRENCY = 64
STREAMS = 256
STREAM_TOKENS = 256  # an answer's length (vLLM's serving benchmark: 128; SGLang's: 1024)
SHORT_STREAM_TOKENS = 32
RPS_SECONDS = 1.5
TTFT_SAMPLES = 100
DISCONNECTS = 20


# -- what the server spent, read around the load alone ------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) of ``pid`` alone so far, from ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s living descendants (the frontend's scheduler process)."""
    return sum(proc_cpu_s(c) for c in descendants(pid))


def loop_lag_counts(port: int) -> tuple[list[float], list[float]]:
    """The server's ``tsb_http_loop_lag_seconds`` histogram: (bucket bounds, cumulative counts)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    bounds, counts = [], []
    for line in text.decode().splitlines():
        if line.startswith("tsb_http_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            bounds.append(float("inf") if le == "+Inf" else float(le))
            counts.append(float(line.rsplit(" ", 1)[1]))
    return bounds, counts


class ServerWindow:
    """The server's CPU (its own process, its descendants) and loop-lag probes over
    one window: opened right before the load starts, closed right after it ends,
    so the client's start-up and the idle time between rounds are not in it."""

    def __init__(self, pid: int | None, lag_port: int | None) -> None:
        self.pid, self.lag_port = pid, lag_port
        self.own = self.children = 0.0
        self.lag: list[float] | None = None
        self.bounds: list[float] | None = None

    def __enter__(self) -> ServerWindow:
        if self.lag_port is not None:
            self.bounds, self.lag = loop_lag_counts(self.lag_port)
        if self.pid is not None:
            self.own, self.children = proc_cpu_s(self.pid), descendants_cpu_s(self.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid is not None:
            self.own = proc_cpu_s(self.pid) - self.own
            self.children = descendants_cpu_s(self.pid) - self.children
        if self.lag_port is not None and self.lag is not None:
            after = loop_lag_counts(self.lag_port)[1]
            self.lag = [a - b for a, b in zip(after, self.lag, strict=True)]

    def report(self) -> dict[str, object]:
        return {"cpu_s": self.own, "children_cpu_s": self.children,
                "lag_bounds": self.bounds, "lag_counts": self.lag}


# -- the loads ------------------------------------------------------------------------------------


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def _response(reader: asyncio.StreamReader, on_event: Callable[[bytes], None] | None = None
                    ) -> tuple[int, bytes]:
    """Read one response: (status, body); SSE events (chunked) go to ``on_event``."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    if b"transfer-encoding: chunked" not in lower:
        i = lower.index(b"content-length:") + 15
        n = int(lower[i:lower.index(b"\r\n", i)])
        return status, await reader.readexactly(n)
    buf = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, buf
        buf += chunk[:-2]
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if on_event is not None:
                on_event(event)


async def _rps(port: int, concurrency: int, seconds: float) -> tuple[int, float]:
    """(requests answered, seconds) of ``concurrency`` keep-alive clients for ``seconds``."""
    req = _post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                    "temperature": 0})
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.perf_counter() < stop:
            writer.write(req)
            status, _ = await _response(reader)
            assert status == 200, status
            done += 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.perf_counter() - t0


def _stream_body(tokens: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


_USAGE = re.compile(rb'"usage":\{[^}]*"completion_tokens":(\d+)')


class _StreamRead(asyncio.Protocol):
    """One streamed response, read whole: its bytes kept, nothing parsed until the end.

    A bare protocol rather than a ``StreamReader``: each arriving piece costs
    one append here, not a reader's buffer, a waiter and a task's wake-up.
    """

    def __init__(self, req: bytes, done: asyncio.Future[bytes]) -> None:
        self.req = req
        self.done = done
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.WriteTransport, transport).write(self.req)  # (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if buf.endswith(b"\r\n0\r\n\r\n") and not self.done.done():  # the last chunk
            self.done.set_result(bytes(buf))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(
                f"the server closed a stream early: {bytes(self.buf[-300:])!r}"))


async def _streams(port: int, n: int, tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of ``n`` concurrent streams.

    Each response is kept as it arrives (:class:`_StreamRead`) until the
    chunked body's last chunk, and only its last events are parsed (the usage
    count, ``[DONE]``): a client that parsed every event would spend as much
    CPU as the server on a 2-core box, and measure itself.
    """
    req = _post("/v1/completions", _stream_body(tokens))
    loop = asyncio.get_running_loop()
    total = 0

    async def one() -> None:
        nonlocal total
        done: asyncio.Future[bytes] = loop.create_future()
        transport, _ = await loop.create_connection(lambda: _StreamRead(req, done),
                                                    "127.0.0.1", port)
        try:
            buf = await done
        finally:
            transport.close()
        usage = _USAGE.findall(buf)
        assert buf[9:12] == b"200" and usage == [str(tokens).encode()] \
            and b"data: [DONE]" in buf[-64:], buf[-300:]
        total += tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return total, time.perf_counter() - t0


async def _ttft(port: int, samples: int) -> list[float]:
    req = _post("/v1/completions", _stream_body(4))
    out: list[float] = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(samples):
        first: list[float] = []
        t0 = time.perf_counter()

        def on_event(event: bytes, first: list[float] = first, t0: float = t0) -> None:
            if not first:
                first.append(time.perf_counter() - t0)

        writer.write(req)
        await _response(reader, on_event)
        out.append(first[0] * 1e3)
    writer.close()
    return out


async def _disconnects(port: int, rpc_dir: str, samples: int) -> list[float]:
    from bus import RpcClient

    req = _post("/v1/completions", {**_stream_body(1_000_000)})
    out: list[float] = []
    with RpcClient(f"ipc://{rpc_dir}/rpc") as rpc:
        for _ in range(samples):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            await asyncio.wait_for(reader.readuntil(b"data: "), 30)
            writer.transport.abort()  # the client is gone, no goodbye
            await asyncio.sleep(0)  # (asyncio closes the socket on the loop's next turn)
            t0 = time.perf_counter()
            while True:
                result = rpc.call("get_load", timeout=10.0).result
                assert result is not None
                if result["running"] == 0 and result["queued"] == 0:
                    break
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError(f"the slot was not freed within 10 s: {result}")
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _run(main: Coroutine[Any, Any, T]) -> T:
    """``main`` on uvloop where it is installed, as the server runs: the load clients
    and the in-process ``AsyncEngine`` reference get the loop a user would pick,
    not a slower one than the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def client(args: list[str]) -> None:
    """``rps PORT [PID]``, ``streams PORT TOKENS [PID]``, ``ttft PORT``, ``disconnect PORT DIR``.

    With a PID, ``rps`` and ``streams`` print a JSON object: the count done, the
    seconds, and that server's CPU and loop-lag histogram over the load alone
    (:class:`ServerWindow`; the lag where the server has the metric: ours).
    """
    kind, port = args[0], int(args[1])
    result: object
    if kind in ("rps", "streams"):
        pid = int(args[-1]) if len(args) > (2 if kind == "rps" else 3) else None
        lag_port = port if kind == "streams" and pid is not None else None
        with ServerWindow(pid, lag_port) as window:
            done, seconds = _run(_rps(port, CONCURRENCY, RPS_SECONDS) if kind == "rps"
                                 else _streams(port, STREAMS, int(args[2])))
        result = {"done": done, "seconds": seconds, **window.report()}
    elif kind == "ttft":
        result = _run(_ttft(port, TTFT_SAMPLES))
    else:
        result = _run(_disconnects(port, args[2], DISCONNECTS))
    print(json.dumps(result))
