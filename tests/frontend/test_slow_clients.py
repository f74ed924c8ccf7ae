"""A client that sends headers and then dribbles its body, or never sends it, is answered
408 at the body-read deadline (without it: it held a handler for ever); one that
dribbles its headers is answered 408 at theirs, and one whose headers never end 431
(without it: 64 MB of headers were read and kept, half a head held a connection)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from frontend import ByteTokenizer, Settings
from frontend.asgi import Event, read_body
from frontend.errors import ApiError
from scheduler import AsyncEngine, ModelConfig
from scheduler.engine.handles import GenerateResult
from tests.conftest import eventually
from tests.frontend.server import Server, raw_post

TOK = ByteTokenizer()
#: The server's deadline; each test waits far longer for it (a busy box).
BODY_TIMEOUT = 1.0
WAIT = 30.0
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n")


#: The server's bound on a request's head (line and headers), small for the tests.
MAX_HEAD = 4096


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(Settings(model=ModelConfig(vocab_size=TOK.vocab_size, kind="stub"),
                        body_timeout=BODY_TIMEOUT), TOK, timeout_keep_alive=1,
               head_timeout=BODY_TIMEOUT, max_head_bytes=MAX_HEAD)
    yield s
    s.stop()


def answer(sock: socket.socket, dribble: bool) -> bytes:
    """Everything the server sends until it closes the connection (sending one more
    byte of body every quarter second meanwhile, with ``dribble``).

    Raises:
        AssertionError: the connection is still open after ``WAIT`` seconds.
    """
    deadline = time.monotonic() + WAIT
    got = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no answer in {WAIT} s; got {got!r}"
        if dribble and not got:
            try:
                sock.sendall(b" ")
            except BrokenPipeError:  # closed after its answer: read what it sent
                dribble = False
        sock.settimeout(min(left, 0.25) if dribble else left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue  # (dribble: the next byte is due)
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data


@pytest.mark.parametrize("dribble", [False, True], ids=["never", "dribbles"])
def test_a_body_not_sent_in_time_is_408(server: Server, dribble: bool) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(HEAD + b'{"model": "tiny", ')
        t0 = time.monotonic()
        raw = answer(sock, dribble)
    took = time.monotonic() - t0
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), raw
    assert b"connection: close" in head.lower()  # the rest of the body is not read
    assert took >= BODY_TIMEOUT * 0.9, took
    error = msgspec.json.decode(body.split(b"\r\n")[1] if b"transfer-encoding: chunked"
                                in head.lower() else body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "body_timeout" and "--body-timeout" in error["message"]
    # The handler is gone with the connection, and the 408 is counted.
    metrics = server.app.metrics
    assert metrics is not None
    eventually(lambda: metrics.in_flight == 0, WAIT, "the handler to end")
    text = httpx.get(f"{server.url}/metrics").text
    assert 'tsb_http_requests_total{endpoint="completions",status="408"}' in text


def test_a_body_sent_in_time_is_served(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_shutdown_while_reading_stays_a_cancellation() -> None:
    """Only the deadline's own cancel becomes a 408; any other propagates."""
    async def main() -> None:
        entered = asyncio.Event()

        async def receive() -> Event:
            entered.set()
            await asyncio.Event().wait()  # a body that never comes
            raise AssertionError("unreachable")

        shut = asyncio.create_task(read_body({"headers": []}, receive, 100, 60.0))
        await entered.wait()
        shut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await shut
        entered.clear()
        late = asyncio.create_task(read_body({"headers": []}, receive, 100, 0.05))
        with pytest.raises(ApiError) as info:
            await asyncio.wait_for(late, WAIT)
        assert info.value.status == 408
        assert late.cancelling() == 0  # its own cancel taken back

    asyncio.run(main())


def test_a_connection_that_never_sends_a_byte_is_closed(server: Server) -> None:
    # uvicorn armed its idle timer only after a response: ~20,000 silent
    # connections took every file descriptor and turned everyone away.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        t0 = time.monotonic()
        assert answer(sock, dribble=False) == b""  # closed, nothing said
        assert time.monotonic() - t0 < WAIT
    assert httpx.get(f"{server.url}/health", timeout=WAIT).status_code == 200


def _error(raw: bytes, status: int) -> dict[str, object]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:300]
    assert b"connection: close" in head.lower()
    error = msgspec.json.decode(body)["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("dribble", [False, True], ids=["stops", "dribbles"])
def test_a_head_not_sent_in_time_is_408(server: Server, dribble: bool) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\nx-slow: ")
        t0 = time.monotonic()
        raw = answer(sock, dribble)  # (dribble: one more byte of the header value a time)
    assert time.monotonic() - t0 >= BODY_TIMEOUT * 0.9
    assert _error(raw, 408)["code"] == "header_timeout"
    assert httpx.get(f"{server.url}/health", timeout=WAIT).status_code == 200


@pytest.mark.parametrize("split", [True, False], ids=["in-pieces", "one-read"])
def test_a_head_past_the_bound_is_431(server: Server, split: bool) -> None:
    head = b"GET /health HTTP/1.1\r\nhost: test\r\nx-pad: " + b"a" * (MAX_HEAD + 10)
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        if split:  # a header that never ends, sent in pieces: refused as it passes the bound
            for i in range(0, len(head), 1000):
                try:
                    sock.sendall(head[i:i + 1000])
                except (BrokenPipeError, ConnectionResetError):
                    break
        else:  # whole, in one write (the server may read it in one piece)
            sock.sendall(head + b"\r\n\r\n")
        raw = answer(sock, dribble=False)
    assert _error(raw, 431)["code"] == "headers_too_large"
    # A head under the bound is served, on a server that still answers everyone.
    ok = httpx.get(f"{server.url}/health", headers={"x-pad": "a" * (MAX_HEAD // 2)},
                   timeout=WAIT)
    assert ok.status_code == 200


def test_blank_lines_alone_do_not_hold_a_connection(server: Server) -> None:
    # The parser skips blank lines before a request without beginning one: a client
    # sending one CRLF (then nothing) cancelled the idle timer and was held for ever.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"\r\n")
        t0 = time.monotonic()
        assert answer(sock, dribble=False) == b""  # closed at the idle timeout
        assert time.monotonic() - t0 < WAIT
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # after an answer
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n")
        got = b""
        while not got.endswith(b'{"status":"ok"}'):  # the whole answer (head, body)
            data = sock.recv(65536)
            assert data, got
            got += data
        assert got.startswith(b"HTTP/1.1 200")
        sock.sendall(b"\r\n")
        assert answer(sock, dribble=False) == b""


def test_blank_lines_trickled_do_not_extend_the_idle_time(server: Server) -> None:
    # A CRLF begins nothing and must not restart the idle timer (else one every 3 s
    # holds a connection for ever): the idle time runs from when it began.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        t0 = time.monotonic()
        closed = False
        while not closed and time.monotonic() - t0 < WAIT:
            try:
                sock.sendall(b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(0.25)  # (the pace of the blank lines: a read that waits)
            try:
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
        took = time.monotonic() - t0
    assert took < 10, f"still open after {took:.1f} s of blank lines (idle timeout 1 s)"


def test_trailers_past_the_bound_are_431(server: Server) -> None:
    # A chunked body's trailers are headers too: 64 MB of them took 1.2 GB before.
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json"
            b"\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(head)
        for _ in range(3 * MAX_HEAD // 100):
            try:
                sock.sendall(b"x-trailer: " + b"t" * 87 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        raw = answer(sock, dribble=False)
    assert _error(raw, 431)["code"] == "headers_too_large"


def test_a_large_body_pipelined_before_a_head_is_not_counted_as_head(
        server: Server) -> None:
    # A read holding a request's body and the next one's first bytes counted the body
    # as head bytes: a false 431, and the valid request went unanswered.
    post = raw_post("/v1/completions", {"model": "tiny", "prompt": "x" * (3 * MAX_HEAD),
                                        "max_tokens": 1})
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(post + b"GET /he")
        raw = answer(sock, dribble=False)  # the POST's answer, then the GET's 408
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    assert b"HTTP/1.1 408 " in raw and b"HTTP/1.1 431" not in raw


class SlowEngine(AsyncEngine):
    """The real engine, each non-streamed answer held back ``SLOW`` seconds: a model
    slower than the server's idle timeout."""

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().submit(*args, **kwargs)

        async def later() -> GenerateResult:
            await asyncio.sleep(SLOW)  # sleep-ok: the slow model being simulated
            return await inner

        return later()


SLOW = 1.5  # seconds; the idle timeout is 1, the head deadline 0.5


@pytest.fixture(scope="module")
def slow_server() -> Iterator[Server]:
    s = Server(Settings(model=ModelConfig(vocab_size=TOK.vocab_size, kind="stub")), TOK,
               engine=lambda st: SlowEngine(st.mode, st.model, max_batch=st.max_batch),
               timeout_keep_alive=1, head_timeout=0.5)
    yield s
    s.stop()


def test_a_request_slower_than_the_idle_timeout_is_answered(slow_server: Server) -> None:
    # Re-arming the idle timer after a read must wait for the answer: a timer armed
    # while a request is still being answered closes its connection mid-answer.
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=WAIT) as sock:
        sock.sendall(raw_post("/v1/completions", {"model": "tiny", "prompt": "x",
                                                  "max_tokens": 2}))
        got = b""
        while b'"usage"' not in got:
            data = sock.recv(65536)
            assert data, f"closed before the answer: {got!r}"
            got += data
    assert got.startswith(b"HTTP/1.1 200")


def test_a_late_pipelined_head_is_refused_after_the_answer_before_it(
        slow_server: Server) -> None:
    # Answers go in order: a head pipelined behind a request still being answered
    # (1.5 s) passes its deadline (0.5 s) first; its 408 waits for that answer, which
    # is neither cut nor preceded.
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=WAIT) as sock:
        sock.sendall(raw_post("/v1/completions", {"model": "tiny", "prompt": "x",
                                                  "max_tokens": 2}) + b"GET /hea")
        raw = answer(sock, dribble=False)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]
    _, _, rest = raw.partition(b'"usage"')
    assert b"HTTP/1.1 408 " in rest, raw[-400:]


def test_pipelined_heads_past_the_bound_together_are_each_answered(server: Server) -> None:
    # Small heads, pipelined in one write, past the bound together: each is its own
    # head (without it: a read holding them was charged to the last one, a false
    # refusal of valid requests).
    one = b"GET /health HTTP/1.1\r\nhost: test\r\nx-pad: " + b"p" * 400 + b"\r\n\r\n"
    n = 3 * MAX_HEAD // len(one) + 1
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        # The last head's start arrives with the others, its rest only once they
        # were answered (so it is surely read apart).
        sock.sendall(one * (n - 1) + one[:60])
        got = b""
        deadline = time.monotonic() + WAIT
        for want, rest in ((n - 1, one[60:]), (n, b"")):
            while got.count(b'{"status":"ok"}') < want:
                assert time.monotonic() < deadline, got[-300:]
                data = sock.recv(65536)
                assert data, f"closed after {got.count(b'HTTP/1.1 200')} of {n}: {got[-300:]!r}"
                got += data
            if rest:
                sock.sendall(rest)
    assert got.count(b"HTTP/1.1 200 ") == n


def test_a_body_the_answer_did_not_wait_for_does_not_hold_the_connection(
        server: Server) -> None:
    # /health answers without reading a body; one more byte of it (then silence)
    # cancelled the idle timer, and nothing armed it again (without it: 200 held).
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\ncontent-length: 1000000\r\n\r\n")
        got = b""
        while not got.endswith(b'{"status":"ok"}'):
            data = sock.recv(65536)
            assert data, got
            got += data
        sock.sendall(b"x")
        t0 = time.monotonic()
        answer(sock, dribble=False)  # closed: by the idle timer (1 s)
        assert time.monotonic() - t0 < WAIT


def test_a_431_never_comes_before_an_earlier_answer(slow_server: Server) -> None:
    # A 70 KB head pipelined behind a request still being answered: its refusal cannot
    # be written before that answer (without it: the client got only the 431).
    big = b"GET /health HTTP/1.1\r\nhost: test\r\nx-pad: " + b"a" * (70 << 10) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=WAIT) as sock:
        sock.sendall(raw_post("/v1/completions", {"model": "tiny", "prompt": "x",
                                                  "max_tokens": 2}) + big)
        raw = answer(sock, dribble=False)
    assert not raw.startswith(b"HTTP/1.1 431"), raw[:300]
