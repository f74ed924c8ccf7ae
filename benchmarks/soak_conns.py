"""Soak: a thousand connections and more against ``python -m frontend`` under the usual limit.

Run: ``python -m benchmarks.soak connections_past_soft_limit`` (or
``python -m benchmarks.soak_conns``). The last line is one JSON object:

* ``connections_served_of_1200_at_soft_limit_1024`` (must be 1200): a
  ``python -m frontend`` (ring mode, the tiny model) started with its soft
  limit on open files at 1,024 (the hard one left as it is) takes 1,200
  concurrent streamed completions, each on its own connection, all
  connected before any asks; the connections that got an HTTP answer (its
  status line). Start-up raises the soft limit to the hard one, so all are
  served where the hard limit allows 1,200 connections; past a low hard
  limit the rest are answered 503, which counts as an answer too.
* ``connections_status``: the answers by status (and ``no answer`` for a
  connection closed without one); ``frontend_soft_limit``: the frontend's
  soft limit once started; ``connections_wall_s``: the run's seconds.

The client raises its own soft limit (it holds 1,200 sockets). Every
process it starts is stopped.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tests.procs import stop

__all__ = ["BOUNDS", "SCENARIOS", "connections_past_soft_limit"]

STREAMS = 1200
SOFT_LIMIT = 1024
_BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 32,
                    "stream": True}).encode()
_REQUEST = (b"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n" % len(_BODY)) + _BODY


def _soft_limit_at_exec() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (SOFT_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


async def _stream(port: int, go: asyncio.Event, connected: list[int]) -> str:
    """One streamed completion on its own connection, asked once all are connected."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"no connection ({type(exc).__name__})"
    connected[0] += 1
    if connected[0] == STREAMS:
        go.set()
    try:
        await asyncio.wait_for(go.wait(), 60)
        writer.write(_REQUEST)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 300)
        if not line.startswith(b"HTTP/1."):
            return "no answer"
        await asyncio.wait_for(reader.read(), 300)  # the stream, to its end
        return line.split()[1].decode()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return "no answer"
    finally:
        writer.close()


async def _streams(port: int) -> collections.Counter[str]:
    go = asyncio.Event()
    connected = [0]
    got = await asyncio.gather(*(_stream(port, go, connected) for _ in range(STREAMS)))
    return collections.Counter(got)


def connections_past_soft_limit() -> dict[str, object]:
    """``connections_served_of_1200_at_soft_limit_1024`` and its parts (module docstring)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * STREAMS
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY
                                                    else min(want, hard), hard))
    with tempfile.TemporaryDirectory(prefix="tsb-soak-conns-") as tmp:
        log = Path(tmp) / "frontend.log"
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "frontend", "--port", "0", "--endpoint",
                 str(Path(tmp) / "ep")],
                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_soft_limit_at_exec)
        try:
            port = _port(proc, log)
            with open(f"/proc/{proc.pid}/limits") as f:
                limit = next(ln for ln in f if ln.startswith("Max open files")).split()[3]
            t0 = time.monotonic()
            status = asyncio.run(_streams(port))
            wall = time.monotonic() - t0
        finally:
            stop(proc, 30)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    answered = sum(n for k, n in status.items() if k.isdigit())
    return {"connections_served_of_1200_at_soft_limit_1024": answered,
            "connections_status": dict(status), "frontend_soft_limit": int(limit),
            "connections_wall_s": round(wall, 1)}


def _port(proc: subprocess.Popen[bytes], log: Path) -> int:
    """The port the frontend's start-up line names, once it serves."""
    deadline = time.monotonic() + 180
    while True:
        m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log.read_text())
        if m:
            return int(m.group(1))
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the frontend did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)  # sleep-ok: pacing of a deadline poll


#: The scenarios :mod:`benchmarks.soak` runs from here.
SCENARIOS: list[Callable[[], Mapping[str, object]]] = [connections_past_soft_limit]

#: key -> (comparison, bound), merged into :data:`benchmarks.soak.BOUNDS`.
BOUNDS: dict[str, tuple[str, float]] = {
    "connections_served_of_1200_at_soft_limit_1024": ("==", STREAMS),
}


if __name__ == "__main__":
    print(json.dumps(connections_past_soft_limit()))
