"""A client that sends headers and then dribbles its body, or never sends it, is answered
408 at the body-read deadline (outside probe: it held a handler for ever)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from frontend import ByteTokenizer, Settings
from frontend.asgi import Event, read_body
from frontend.errors import ApiError
from scheduler import ModelConfig
from tests.conftest import eventually
from tests.frontend.server import Server

TOK = ByteTokenizer()
#: The server's deadline; each test waits far longer for it (a busy box).
BODY_TIMEOUT = 1.0
WAIT = 30.0
HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server(Settings(model=ModelConfig(vocab_size=TOK.vocab_size, kind="stub"),
                        body_timeout=BODY_TIMEOUT), TOK, timeout_keep_alive=1)
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
