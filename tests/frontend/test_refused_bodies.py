"""What the door does with what it will not read, under each HTTP protocol: a body it
refused (413) is not read (the connection closes after the answer; without it the
server read and dropped a 1 GB body for as long as the client kept the connection
busy); h11 bounds a head by ``max_head_bytes`` as httptools does (without it: h11's
own 16 KiB, and none at all for a head that arrives in one read); a 404 quotes at
most a bounded part of the path (without it: the path echoed whole, up to
``max_head_bytes``); a client that half-closes after its request gets its answer if
it begins within a second (without it: the connection was closed at the client's end
of file, unanswered), and one whose whole answer takes longer is taken for a client
that left (its request aborted)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgspec
import pytest

from frontend import ByteTokenizer, Settings
from scheduler import ModelConfig
from tests.frontend.server import Server, raw_post

TOK = ByteTokenizer()
#: Longer than any wait below: a connection closed in these tests was closed by the
#: behaviour under test, not by the idle timer.
KEEP_ALIVE = 60
WAIT = 20.0
MAX_BODY = 1 << 16
MAX_HEAD = 4096


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(Settings(model=ModelConfig(vocab_size=TOK.vocab_size, kind="stub"),
                        max_body_bytes=MAX_BODY), TOK, timeout_keep_alive=KEEP_ALIVE,
               max_head_bytes=MAX_HEAD, http=request.param)
    yield s
    s.stop()


def _until_closed(sock: socket.socket, feed: bytes = b"") -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and the seconds that took
    after its first byte; ``feed``: sent again and again meanwhile (a body on its way).

    Raises:
        AssertionError: still open ``WAIT`` seconds after the first byte (or none came).
    """
    got = b""
    first: float | None = None
    deadline = time.monotonic() + WAIT
    sock.setblocking(False)
    while True:
        now = time.monotonic()
        assert now < deadline, f"still open after {WAIT} s; got {got[:300]!r}"
        if feed:
            try:
                sock.send(feed)
            except BlockingIOError:
                pass  # (the server reads nothing: its buffers are full)
            except (BrokenPipeError, ConnectionResetError):
                feed = b""  # closed: what it sent before is still to read
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            time.sleep(0.005)  # sleep-ok: pacing of a body sent slowly
            continue
        except ConnectionResetError:
            data = b""
        if not data:
            assert first is not None, "closed without an answer"
            return got, time.monotonic() - first
        if first is None:
            first = time.monotonic()
            deadline = first + WAIT / 2
        got += data


def _announces_close(raw: bytes) -> bool:
    """Whether the answer's head says ``connection: close`` (a client that keeps its
    connections learns from it not to send its next request there)."""
    head = raw.partition(b"\r\n\r\n")[0].lower()
    return b"\r\nconnection: close\r\n" in head + b"\r\n"


def _error(raw: bytes, status: int) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:300]
    error = msgspec.json.decode(body)["error"]
    assert isinstance(error, dict)
    return error


def test_a_body_past_the_limit_is_not_read(server: Server) -> None:
    # 1 GB declared, sent in 16 KiB pieces: the 413 comes at once, and the connection
    # closes after it (before: the server read and dropped the body until the idle
    # timer, KEEP_ALIVE seconds; a fast client could push gigabytes through it).
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            b"content-length: 1000000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(head)
        raw, closed_after = _until_closed(sock, feed=b"x" * (16 << 10))
    assert _error(raw, 413)["code"] == "body_too_large"
    assert closed_after < WAIT / 2
    assert _announces_close(raw), raw[:300]


def test_an_unread_body_of_another_answer_is_not_read_either(server: Server) -> None:
    # The class, not the 413 alone: /health answers without reading a body.
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\ncontent-length: 1000000000\r\n\r\n")
        raw, _ = _until_closed(sock, feed=b"x" * (16 << 10))
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]
    assert _announces_close(raw), raw[:300]


def test_a_read_body_keeps_the_connection(server: Server) -> None:
    # A request read whole leaves its connection open for the next one.
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        for _ in range(2):
            sock.sendall(raw_post("/v1/nowhere", {"x": 1}))
            got = b""
            while b"\r\n\r\n" not in got or not got.endswith(b"}"):
                data = sock.recv(65536)
                assert data, got
                got += data
            assert got.startswith(b"HTTP/1.1 404 "), got[:300]


def test_a_head_past_max_head_bytes_is_431(server: Server) -> None:
    # Whole, in one write (h11 bounded only a head still incomplete, at 16 KiB), and
    # one that never ends, in pieces.
    pad = b"a" * (MAX_HEAD + 10)
    for whole in (True, False):
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
            head = b"GET /health HTTP/1.1\r\nhost: test\r\nx-pad: " + pad
            try:
                sock.sendall(head + b"\r\n\r\n" if whole else head)
            except (BrokenPipeError, ConnectionResetError):
                pass
            raw, _ = _until_closed(sock)
        assert _error(raw, 431)["code"] == "headers_too_large", whole
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\nx-pad: " + pad[:MAX_HEAD // 2]
                     + b"\r\nconnection: close\r\n\r\n")
        raw, _ = _until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]


def test_a_404_quotes_a_bounded_part_of_the_path(server: Server) -> None:
    for path in ("/x" + "y" * 3000, "/v1/models/" + "m" * 3000):  # (under MAX_HEAD)
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
            sock.sendall(b"GET %s HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n"
                         % path.encode())
            raw, _ = _until_closed(sock)
        message = _error(raw, 404)["message"]
        assert isinstance(message, str)
        assert len(message) < 600 and "…" in message, message[:300]
        assert path.removeprefix("/v1/models/")[:100] in message


def test_a_half_closed_client_gets_its_answer(server: Server) -> None:
    for request in (b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n",
                    raw_post("/v1/completions", {"model": "tiny", "prompt": "ab",
                                                 "max_tokens": 3})):
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            raw, _ = _until_closed(sock)  # (closed after the answer: nothing more comes)
        assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]
        assert raw.endswith(b"}"), raw[-300:]


def test_a_half_closed_client_gets_every_pipelined_answer(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n" * 3)
        sock.shutdown(socket.SHUT_WR)
        raw, _ = _until_closed(sock)
    assert raw.count(b"HTTP/1.1 200 ") == 3, raw[-300:]


def test_a_half_closed_client_with_a_long_stream_reads_it_and_one_with_a_long_whole_answer_is_taken_for_gone(  # noqa: E501
        server: Server) -> None:
    # The same end of file whether the client half-closed or closed: a stream's writes
    # tell which (its answer is read here past the second of grace); a whole answer not
    # begun in a second is taken for a client that left, and its request is aborted.
    endless = {"model": "tiny", "prompt": "x", "max_tokens": 1_000_000, "temperature": 0,
               "ignore_eos": True}
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(raw_post("/v1/completions", {**endless, "stream": True}))
        sock.shutdown(socket.SHUT_WR)
        got = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:  # (past the grace)
            data = sock.recv(65536)
            assert data, got[-300:]
            got += data
        assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"data: ") > 1
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(raw_post("/v1/completions", endless))
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(WAIT)
        assert sock.recv(65536) == b""  # closed, unanswered
    engine = server.engine
    deadline = time.monotonic() + WAIT
    while server.on_loop(lambda: engine.pending):
        assert time.monotonic() < deadline, "the requests were not aborted"
        time.sleep(0.01)  # sleep-ok: pacing of a deadline poll


def test_a_half_closed_unfinished_request_is_closed_at_once(server: Server) -> None:
    # Its body can never come: the connection closes now, not at the body's deadline.
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-length: 50\r\n"
                     b"\r\n{")
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(WAIT)
        t0 = time.monotonic()
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        assert time.monotonic() - t0 < WAIT
    assert not data.startswith(b"HTTP/1.1 2"), data[:300]
