"""The little of ASGI the app needs: typed messages, bodies, answers, disconnects.

No web framework: ``benchmarks/http.py`` measured a raw ASGI app with
``msgspec`` bodies against the constant-body floor (see the commit that
chose it); a framework's routing and request objects cost more per request
than the whole of our handler.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Awaitable, Callable, MutableMapping, Sequence

from frontend.errors import ApiError

__all__ = ["Conn", "Receive", "Scope", "Send", "read_body", "request_id", "send_bytes",
           "with_request_id", "without_body"]

Scope = MutableMapping[str, object]
Event = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

JSON = [(b"content-type", b"application/json")]
TEXT = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
#: The content type of a stream of Server-Sent Events.
SSE_TYPE = b"text/event-stream"
SSE = [(b"content-type", SSE_TYPE), (b"cache-control", b"no-cache")]


class Disconnected(Exception):
    """The client went away before its request was read whole."""


async def read_body(scope: Scope, receive: Receive, limit: int, timeout: float) -> bytes:
    """The whole request body, at most ``limit`` bytes, read within ``timeout`` seconds.

    The deadline covers the whole body, not each piece: a client that sends
    its headers and then dribbles the body (or never sends it) would
    otherwise hold a handler for ever (slowloris).

    Raises:
        ApiError: 413 past ``limit`` (told by ``content-length`` before
            anything is read, or counted as it arrives); 415 for a body in a
            ``content-encoding`` (gzip: nothing here inflates it); 408 when the
            body is not whole ``timeout`` seconds after its read began.
        Disconnected: the client left first.
    """
    headers = scope.get("headers")
    if isinstance(headers, list):
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise too_large(limit)
            if name == b"content-encoding" and value.strip().lower() != b"identity":
                # (refused by name: a gzip body would otherwise be "invalid JSON")
                raise ApiError(415, f"content-encoding {value.decode('latin-1')!r} is not "
                                    "supported: send the body as it is",
                               code="unsupported_encoding")
    # asyncio.timeout()'s mechanics at a third of its cost (measured under uvloop: +1.7 us
    # a request, not +5.3): a timer that cancels this task, told apart from any other
    # cancellation by ``late`` and the task's cancel count.
    task = asyncio.current_task()
    assert task is not None
    late = False

    def expire() -> None:
        nonlocal late
        late = True
        task.cancel()

    cancelling = task.cancelling()
    timer = asyncio.get_running_loop().call_later(timeout, expire)
    parts: list[bytes] = []
    size = 0
    try:
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                raise Disconnected
            body = event.get("body", b"")
            assert isinstance(body, bytes)
            size += len(body)
            if size > limit:
                raise too_large(limit)
            parts.append(body)
            if not event.get("more_body"):
                return parts[0] if len(parts) == 1 else b"".join(parts)
    except asyncio.CancelledError:
        if not late or task.uncancel() > cancelling:
            raise  # not (only) ours: a shutdown
        raise too_slow(timeout) from None
    finally:
        timer.cancel()


def too_large(limit: int) -> ApiError:
    """The 413 for a body past ``limit`` bytes."""
    return ApiError(413, f"the request body is larger than this server's limit of {limit} "
                         f"bytes (--max-body-bytes)", code="body_too_large")


def too_slow(timeout: float) -> ApiError:
    """The 408 for a body not read whole within ``timeout`` seconds."""
    return ApiError(408, f"the request body did not arrive whole within {timeout:g} s "
                         f"(--body-timeout)", code="body_timeout")


async def send_bytes(send: Send, status: int, body: bytes,
                     headers: Headers = JSON) -> None:
    """A whole response in two ASGI events, its length told (so it is not chunked)."""
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ApiError) -> None:
    """``error`` in OpenAI's shape, with ``Retry-After`` and ``Allow`` when it has them.

    A 408 closes the connection (as RFC 9110 advises): the rest of that
    body may still be on its way, and nothing more on it will be read.
    """
    headers = JSON if error.retry_after is None else \
        [*JSON, (b"retry-after", str(error.retry_after).encode())]
    if error.allow is not None:  # RFC 9110: a 405 names the methods the path has
        headers = [*headers, (b"allow", error.allow.encode())]
    if error.status == 408:
        headers = [*headers, (b"connection", b"close")]
    await send_bytes(send, error.status, error.body(), headers)


#: ``x-request-id`` values echoed: printable ASCII, no space at either end, bounded.
MAX_REQUEST_ID = 256
_REQUEST_ID = re.compile(rb"[!-~](?:[ -~]*[!-~])?")


def request_id(scope: Scope) -> bytes:
    """The request's ``x-request-id``: the client's own when it sent one that is
    printable ASCII of at most :data:`MAX_REQUEST_ID` characters, else a new one
    (32 hex digits, as vLLM makes them). One is never refused: a header that
    cannot be echoed safely is ignored."""
    headers = scope.get("headers")
    if isinstance(headers, list):
        for name, value in headers:
            if name == b"x-request-id" and len(value) <= MAX_REQUEST_ID \
                    and _REQUEST_ID.fullmatch(value):
                return bytes(value)
    return secrets.token_hex(16).encode()


def with_request_id(send: Send, rid: bytes) -> Send:
    """``send`` whose response start carries ``x-request-id: rid``: every answer,
    whole, streamed or an error, goes out through it."""
    async def sending(event: Event) -> None:
        if event["type"] == "http.response.start":
            headers = event.get("headers", ())
            assert isinstance(headers, list | tuple)
            event = {**event, "headers": [*headers, (b"x-request-id", rid)]}
        await send(event)
    return sending


def without_body(send: Send) -> Send:
    """``send`` for a HEAD request: the status and headers a GET gets, no body.

    uvicorn drops a HEAD response's body itself; the app does not count on
    its server for that.
    """
    async def head(event: Event) -> None:
        if event["type"] == "http.response.body" and event.get("body"):
            event = {**event, "body": b""}
        await send(event)
    return head


class Conn:
    """Watches one request's connection: a client that leaves cancels its handler.

    ``uvicorn`` drops what is sent to a closed connection without a word, so
    leaving is seen on ``receive()`` (``http.disconnect``): a task waits on it
    and cancels the handler's task, whose ``await`` on the engine then aborts
    the request (the scheduler frees the slot). :attr:`gone` tells the
    handler that the cancellation was this, not a shutdown.

    Once the answer's last message is sent, the watcher is not cancelled:
    uvicorn's ``receive()`` then returns, and it ends by itself. A cancelled
    watcher kept its ``CancelledError``, whose traceback held its frames, the
    request's task and its connection in a reference cycle: 35 objects of
    cyclic garbage per request, and full collections of them held the event
    loop 30-45 ms under 256 streams. An answer that was never finished
    (its writes failed, or it was abandoned) still cancels it: uvicorn may
    never end that ``receive()`` (a request pipelined behind it took the
    connection's disconnect, and its watcher would be left behind).
    """

    __slots__ = ("_done", "_events", "_sent", "_started", "_task", "_watch", "gone")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._done = False
        self._sent = False  # the answer's last message was sent
        self._started = False  # its status and headers were sent
        self._events = False  # ... as a stream of Server-Sent Events
        self.gone = False
        self._watch = asyncio.get_running_loop().create_task(self._wait(receive))

    async def _wait(self, receive: Receive) -> None:
        event = await receive()
        if event["type"] == "http.disconnect" and not self._done:
            self.gone = True
            self._task.cancel()

    def watch(self, send: Send) -> Send:
        """``send``, noting the answer's last message: the ``http.disconnect`` that
        uvicorn's ``receive()`` returns after it is not the client leaving."""
        async def sending(event: Event) -> None:
            last = event["type"] == "http.response.body" and not event.get("more_body")
            if event["type"] == "http.response.start":
                self._started = True
                headers = event.get("headers", ())
                self._events = isinstance(headers, list | tuple) and \
                    (b"content-type", SSE_TYPE) in headers
            if last:
                self._done = True
            await send(event)
            if last:
                self._sent = True
        return sending

    async def cut_short(self, send: Send, error: bytes) -> bool:
        """The answer was cancelled from outside (the server shutting down): end a
        stream of events with ``error`` (an event's data) and ``[DONE]`` rather than
        cut it. Returns whether an answer had begun (else the caller answers)."""
        if not self._started:
            return False
        if self._events and not self._done:
            self._done = True
            await send({"type": "http.response.body",
                        "body": b"data: " + error + b"\n\ndata: [DONE]\n\n"})
            self._sent = True
        return True

    def close(self) -> None:
        """The answer is sent (or abandoned): stop watching. After a sent answer the
        watcher ends by itself; otherwise it is cancelled."""
        self._done = True
        if not self._sent:
            self._watch.cancel()
