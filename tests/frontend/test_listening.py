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
from typing import cast

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
