"""A whole (non-streamed) answer leaves the server in one write: its head and its body
together (``frontend.serving``'s whole-answer path), where uvicorn's ``send`` wrote
them in two (each write a system call that, on loopback, runs the reader's side of
TCP too). Its bytes are what uvicorn would have sent: the default headers, the
request id, ``connection: close`` when asked, no body to HEAD.

A stream's pieces take their own path (``frontend.serving._send_piece``): one chunk
written per piece, no ASGI message built or read back on either side. Its bytes are
uvicorn's, so only a count of the calls tells that the path is taken."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

import frontend.serving
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


def test_each_piece_of_a_stream_is_one_write_through_the_piece_path(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[bool] = []  # each piece's ``more``, as the piece path was given it
    real = frontend.serving._send_piece

    async def counted(cycle_ref: object, body: bytes, more: bool) -> None:
        taken.append(more)
        await real(cycle_ref, body, more)  # type: ignore[arg-type]

    # (looked up as each request's scope is made: this server's next request takes it)
    monkeypatch.setattr(frontend.serving, "_send_piece", counted)
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        record = recorded(server, client)
        client.sendall(raw_post("/v1/completions", {"model": "tiny", "prompt": "hi",
                                                    "max_tokens": 4, "stream": True},
                                close=True))
        got = read_until_closed(client)
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), got
    assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), got
    assert taken and taken[-1] is False and all(taken[:-1]), taken
    # The head is one write; each piece is one more (the last with the chunked end).
    assert len(record.writes) == 1 + len(taken), record.writes
    assert b"".join(record.writes) == got, record.writes
