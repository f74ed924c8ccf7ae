"""A whole (non-streamed) answer leaves the server in one write: its head and its body
together (``frontend.serving``'s whole-answer path), where uvicorn's ``send`` wrote
them in two (each write a system call that, on loopback, runs the reader's side of
TCP too). Its bytes are what uvicorn would have sent: the default headers, the
request id, ``connection: close`` when asked, no body to HEAD."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from frontend import ByteTokenizer, Settings
from scheduler import ModelConfig
from tests.conftest import eventually
from tests.frontend.server import Server, raw_post

TOK = ByteTokenizer()
WAIT = 30.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(Settings(model=ModelConfig(vocab_size=TOK.vocab_size, kind="stub")), TOK)
    yield s
    s.stop()


class Recorded:
    """A transport that records each write and hands everything to the real one."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.real = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.real.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def recorded(server: Server, client: socket.socket) -> Recorded:
    """Record the writes of the server's side of ``client``'s connection (the protocol
    hands its transport to each new request's cycle)."""
    me = client.getsockname()
    eventually(lambda: any(p.transport.get_extra_info("peername") == me
                           for p in list(server._server.server_state.connections)),
               10.0, f"the server to accept {me}")
    protocol = next(p for p in list(server._server.server_state.connections)
                    if p.transport.get_extra_info("peername") == me)
    record = Recorded(protocol.transport)

    def swap() -> None:
        protocol.transport = record  # type: ignore[assignment]  # (its writes, recorded)

    server.on_loop(swap)
    return record


def read_until_closed(sock: socket.socket) -> bytes:
    deadline = time.monotonic() + WAIT
    got = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the connection was not closed in {WAIT} s; got {got!r}"
        sock.settimeout(left)
        data = sock.recv(65536)
        if not data:
            return got
        got += data


@pytest.mark.parametrize("request_bytes", [
    raw_post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2},
             close=True),
    b"GET /no/such/path HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n",
    b"GET /v1/models HTTP/1.0\r\nhost: test\r\n\r\n",
], ids=["completion", "404", "http-1.0"])
def test_a_whole_answer_is_one_write(server: Server, request_bytes: bytes) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        record = recorded(server, client)
        client.sendall(request_bytes)
        got = read_until_closed(client)
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 "), got
    assert b"connection: close" in lines and b"server: uvicorn" in lines, got
    assert any(line.startswith(b"date: ") for line in lines), got
    assert any(line.startswith(b"x-request-id: ") for line in lines), got
    assert f"content-length: {len(body)}".encode() in lines, got
    assert record.writes == [got], f"{len(record.writes)} writes: {record.writes!r}"


def test_a_head_answer_is_one_write_with_no_body(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        record = recorded(server, client)
        client.sendall(b"HEAD /v1/models HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
        got = read_until_closed(client)
    head, _, body = got.partition(b"\r\n\r\n")
    assert body == b"", got
    assert b"content-length: 0" not in head.lower(), got  # (a GET's length, not 0)
    assert record.writes == [got], f"{len(record.writes)} writes: {record.writes!r}"


def test_pipelined_whole_answers_are_one_write_each_in_order(server: Server) -> None:
    one = raw_post("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 1})
    last = raw_post("/v1/completions", {"model": "tiny", "prompt": "b", "max_tokens": 1},
                    close=True)
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        record = recorded(server, client)
        client.sendall(one + one + last)
        got = read_until_closed(client)
    assert got.count(b"HTTP/1.1 200 OK") == 3, got
    assert len(record.writes) == 3 and b"".join(record.writes) == got, record.writes
