"""The little of ASGI the app needs: typed messages, bodies, answers, disconnects.

No web framework: ``benchmarks/http.py`` measured a raw ASGI app with
``msgspec`` bodies against the constant-body floor (see the commit that
chose it); a framework's routing and request objects cost more per request
than the whole of our handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping, Sequence

from frontend.errors import ApiError

__all__ = ["Conn", "Receive", "Scope", "Send", "read_body", "send_bytes", "without_body"]

Scope = MutableMapping[str, object]
Event = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]

JSON = [(b"content-type", b"application/json")]
TEXT = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class Disconnected(Exception):
    """The client went away before its request was read whole."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, at most ``limit`` bytes.

    Raises:
        ApiError: 413 past ``limit`` (told by ``content-length`` before
            anything is read, or counted as it arrives).
        Disconnected: the client left first.
    """
    headers = scope.get("headers")
    if isinstance(headers, list):
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise too_large(limit)
    parts: list[bytes] = []
    size = 0
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


def too_large(limit: int) -> ApiError:
    """The 413 for a body past ``limit`` bytes."""
    return ApiError(413, f"the request body is larger than this server's limit of {limit} "
                         f"bytes (--max-body-bytes)", code="body_too_large")


async def send_bytes(send: Send, status: int, body: bytes,
                     headers: Headers = JSON) -> None:
    """A whole response in two ASGI events."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ApiError) -> None:
    """``error`` in OpenAI's shape, with ``Retry-After`` when it has one."""
    headers = JSON if error.retry_after is None else \
        [*JSON, (b"retry-after", str(error.retry_after).encode())]
    await send_bytes(send, error.status, error.body(), headers)


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
    """

    __slots__ = ("_done", "_task", "_watch", "gone")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._done = False
        self.gone = False
        self._watch = asyncio.get_running_loop().create_task(self._wait(receive))

    async def _wait(self, receive: Receive) -> None:
        event = await receive()
        if event["type"] == "http.disconnect" and not self._done:
            self.gone = True
            self._task.cancel()

    def close(self) -> None:
        """The answer is sent (or abandoned): stop watching."""
        self._done = True
        self._watch.cancel()
