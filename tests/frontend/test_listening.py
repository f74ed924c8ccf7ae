"""``frontend.listening.Acceptor`` out of file descriptors: a connection it cannot take is
answered 503 on the descriptor it holds in reserve, never closed without a word.

In-process, on real sockets: the test lowers its own soft limit on open
files so that only a few more can be opened, then connects 30 clients at
once (their sockets made before the limit was lowered).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
from collections.abc import Callable
from typing import Any, ClassVar, cast

import pytest

from frontend.listening import Acceptor, ConnectionBudget, open_listeners

_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _Answers(asyncio.Protocol):
    """Answers 200 at once and closes: a served connection."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.WriteTransport, transport).write(_OK)  # (uvloop's is none by class)
        transport.close()


def _limit_to(more: int) -> None:
    """Lower the soft limit so that exactly ``more`` more descriptors can be opened."""
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    free = [n for n in range(max(used) + more + 2) if n not in used]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (free[more], hard))


async def _run(n: int) -> list[bytes]:
    loop = asyncio.get_running_loop()
    listener = open_listeners("127.0.0.1", 0, 128)[0]
    port = listener.getsockname()[1]
    clients = [socket.socket() for _ in range(n)]
    for c in clients:
        c.setblocking(False)
    acceptor = Acceptor([listener], _Answers, set(), ConnectionBudget(1 << 20, 10_000, 10_000))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    _limit_to(4)
    try:
        for c in clients:  # (no descriptor needed: the sockets exist)
            assert c.connect_ex(("127.0.0.1", port)) in (0, 115)  # EINPROGRESS

        async def answer(c: socket.socket) -> bytes:
            got = b""
            while chunk := await loop.sock_recv(c, 4096):
                got += chunk
            return got

        return await asyncio.wait_for(asyncio.gather(*(answer(c) for c in clients)), 30)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        acceptor.close()
        for c in clients:
            c.close()


def _loops() -> list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]]:
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
        ("asyncio", asyncio.new_event_loop)]
    try:
        import uvloop
        loops.append(("uvloop", uvloop.new_event_loop))
    except ImportError:
        pass
    return loops


@pytest.mark.parametrize("factory", [f for _, f in _loops()], ids=[n for n, _ in _loops()])
def test_past_the_last_descriptor_connections_are_answered_503(
        factory: Callable[[], asyncio.AbstractEventLoop],
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="frontend"), \
            asyncio.Runner(loop_factory=factory) as runner:
        answers = runner.run(_run(30))
    statuses = [a.split(b" ", 2)[1] if a.startswith(b"HTTP/1.1 ") else a for a in answers]
    assert set(statuses) == {b"200", b"503"}, statuses  # each answered; some refused
    refused = next(a for a in answers if b" 503 " in a)
    assert b'"code":"too_many_connections"' in refused and b"retry-after: 1" in refused
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "connections answered 503 for lack of file descriptors" in said
    assert "out of file descriptors" in said


class _Served(asyncio.Protocol):
    """Runs its ``app`` on the first bytes it reads (a stand-in for uvicorn's protocol,
    whose ``.app`` the acceptor replaces on a connection past the budget)."""

    made: ClassVar[list[_Served]] = []

    def __init__(self) -> None:
        self.app: Callable[..., Any] | None = None
        self.transport: asyncio.WriteTransport | None = None
        _Served.made.append(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.WriteTransport, transport)

    def data_received(self, data: bytes) -> None:
        assert self.app is not None and self.transport is not None
        transport = self.transport

        async def send(event: dict[str, Any]) -> None:
            if event["type"] == "http.response.start":
                transport.write(b"HTTP/1.1 %d -\r\n\r\n" % event["status"])
            else:
                transport.write(event["body"])
                transport.close()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        asyncio.get_running_loop().create_task(self.app({"type": "http"}, receive, send))


async def _past_the_budget() -> tuple[int, bytes]:
    loop = asyncio.get_running_loop()
    listener = open_listeners("127.0.0.1", 0, 128)[0]
    port = listener.getsockname()[1]
    _Served.made.clear()
    open_now = [object()] * 5  # the budget's one served connection is taken
    acceptor = Acceptor([listener], _Served, open_now, ConnectionBudget(1 << 20, 1, 100))
    silent, asking = socket.socket(), socket.socket()
    try:
        for c in (silent, asking):
            c.setblocking(False)
        await loop.sock_connect(silent, ("127.0.0.1", port))
        while not _Served.made or _Served.made[-1].transport is None:
            await asyncio.sleep(0.005)  # sleep-ok: pacing of a deadline-bound poll
        silent.close()  # accepted past the budget, and gone without a request
        await loop.sock_connect(asking, ("127.0.0.1", port))
        await loop.sock_sendall(asking, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        got = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(asking, 4096), 30):
            got += chunk
        return acceptor.refused, got
    finally:
        acceptor.close()
        silent.close()
        asking.close()


def test_only_connections_answered_503_are_counted_as_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    # Two connections past the budget, one of which never asks: one 503 is sent, and one
    # is counted and logged (not a connection merely handed to the refusing protocol).
    with caplog.at_level(logging.WARNING, logger="frontend"), asyncio.Runner() as runner:
        refused, answer = runner.run(asyncio.wait_for(_past_the_budget(), 60))
    assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
    assert refused == 1
    said = [r.getMessage() for r in caplog.records]
    assert said == ["connections answered 503 for lack of file descriptors: 1 on "
                    "'past the connection budget' (e.g. 5 connections open, 1 served under "
                    f"the open-file limit of {1 << 20})"], said
