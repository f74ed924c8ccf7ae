"""The little of ASGI the app needs: typed messages, bodies, answers, disconnects.

No web framework: ``benchmarks/http.py`` measured a raw ASGI app with
``msgspec`` bodies against the constant-body floor (see the commit that
chose it); a framework's routing and request objects cost more per request
than the whole of our handler.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Protocol

from frontend.errors import ApiError, clip
from frontend.schemas import sse_safe

__all__ = ["PIECE", "WATCH_AFTER_S", "WHOLE", "Answer", "Conn", "Piece", "Receive", "Reply",
           "Scope", "Send", "Whole", "read_body", "request_id", "send_bytes", "send_failure"]

Scope = MutableMapping[str, object]
Event = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Event]]
Send = Callable[[Event], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]
#: A server's way to send a whole answer at once: ``await whole(status, headers, body)``
#: is ``http.response.start`` then one ``http.response.body`` (``headers`` name its
#: ``content-length``), in one write, with no ASGI messages built.
Whole = Callable[[int, Headers, bytes], Awaitable[None]]
#: The scope extension under which a server offers a :data:`Whole`
#: (``scope["extensions"][WHOLE]``; :mod:`frontend.serving` does).
WHOLE = "tsb.http.response.whole"
#: A server's way to send a piece of a chunked answer begun: ``await piece(body, more)``
#: is one ``http.response.body`` (``more`` False: the last), written as one chunk with
#: no ASGI message built (a stream sends one a step: the door's per-token path).
Piece = Callable[[bytes, bool], Awaitable[None]]
#: The scope extension under which a server offers a :data:`Piece`.
PIECE = "tsb.http.response.piece"

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
                raise ApiError(415, f"content-encoding {clip(value.decode('latin-1'))!r} is not "
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
    timer = task.get_loop().call_later(timeout, expire)  # (a running-loop lookup is a getpid)
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
    """A whole response, its length told (so it is not chunked): through a
    :class:`Reply`, at once (:meth:`Reply.whole`), else in two ASGI events."""
    if isinstance(send, Reply):
        await send.whole(status, headers, body)
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: ApiError) -> None:
    """``error`` in OpenAI's shape, with ``Retry-After`` and ``Allow`` when it has them.

    A 408 closes the connection (as RFC 9110 advises): the rest of that
    body may still be on its way, and nothing more on it will be read.
    """
    headers = JSON
    if error.retry_after is not None:
        headers = [*JSON, (b"retry-after", str(error.retry_after).encode())]
    if error.allow is not None:  # RFC 9110: a 405 names the methods the path has
        headers = [*headers, (b"allow", error.allow.encode())]
    if error.status == 408:
        headers = [*headers, (b"connection", b"close")]
    await send_bytes(send, error.status, error.body(), headers)


async def send_failure(reply: Reply, error: ApiError) -> None:
    """``error`` as the answer (:func:`send_error`), or as the end of the answer that
    has begun (:meth:`Reply.fail`: a stream's last event)."""
    if not await reply.fail(error):
        await send_error(reply, error)


#: ``x-request-id`` values echoed: printable ASCII, no space at either end, bounded.
MAX_REQUEST_ID = 256
_REQUEST_ID = re.compile(rb"[!-~](?:[ -~]*[!-~])?")
#: The ids this process makes: 16 random hex digits drawn once, then a count in 16 more
#: (unique without a system call per request; a restart draws another prefix).
_MADE_IDS = map(f"{secrets.token_hex(8)}{{:016x}}".format, itertools.count())


def request_id(scope: Scope) -> bytes:
    """The request's ``x-request-id``: the client's own when it sent one that is
    printable ASCII of at most :data:`MAX_REQUEST_ID` characters, else a new one
    (32 hex digits, as vLLM makes them). One is never refused: a header that
    cannot be echoed safely is ignored."""
    headers = scope.get("headers")
    if isinstance(headers, list):
        for name, value in headers:
            if (name == b"x-request-id" and len(value) <= MAX_REQUEST_ID
                    and _REQUEST_ID.fullmatch(value)):
                return bytes(value)
    return next(_MADE_IDS).encode()


class Answer(Protocol):
    """Where one answer of the request path goes: whole (:meth:`whole`), or as a stream
    begun (:meth:`begin`) and sent a piece at a time (:meth:`piece`). A
    :class:`Reply` sends it on its connection; a fan-out of several answers
    (:mod:`frontend.fanout`) keeps each one, or merges them into one stream."""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        """Send a whole answer (its ``content-length`` is added here)."""

    async def begin(self, status: int, headers: Headers) -> None:
        """Begin an answer sent in pieces."""

    async def piece(self, body: bytes, more: bool) -> None:
        """Send a piece of the answer begun (``more`` False: its last)."""


class Reply:
    """The one ``send`` a request's answer goes out through (whole, streamed or an error).

    Its response start carries ``x-request-id``; a HEAD request's answer has the
    status and headers a GET gets and no body (uvicorn drops a HEAD answer's body
    itself; the app does not count on its server for that). It notes how far the
    answer got, for :class:`Conn`: its start sent (:attr:`started`, as a stream of
    Server-Sent Events: :attr:`events`), its last message handed over
    (:attr:`done`) and sent (:attr:`sent`).

    A whole answer goes through the server's :data:`Whole` where it offers one
    (``whole``, from the scope's :data:`WHOLE` extension): one write, no ASGI
    messages built on either side; so does each piece of a stream, through its
    :data:`Piece` (``piece``, from :data:`PIECE`).
    """

    __slots__ = ("_head", "_piece", "_rid", "_send", "_whole", "done", "events", "sent",
                 "started")

    def __init__(self, send: Send, rid: bytes, *, head: bool = False,
                 whole: Whole | None = None, piece: Piece | None = None) -> None:
        self._send = send
        self._rid = (b"x-request-id", rid)
        self._head = head
        self._whole = whole
        self._piece = None if head else piece  # (a HEAD answer's body goes unsent)
        self.started = self.events = self.done = self.sent = False

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        """Send a whole answer (its ``content-length`` is added here)."""
        headers = [*headers, (b"content-length", b"%d" % len(body))]
        whole = self._whole
        if whole is None:
            await self({"type": "http.response.start", "status": status, "headers": headers})
            await self({"type": "http.response.body", "body": body})
            return
        self.started = self.done = True  # (a whole answer is no stream of events)
        await whole(status, [*headers, self._rid], b"" if self._head else body)
        self.sent = True

    async def begin(self, status: int, headers: Headers) -> None:
        """Begin an answer sent in pieces (:meth:`piece`)."""
        await self({"type": "http.response.start", "status": status, "headers": headers})

    async def piece(self, body: bytes, more: bool) -> None:
        """Send a piece of the answer begun (``more`` False: its last): through the
        server's :data:`Piece` where it offers one, else as an ASGI body message."""
        send = self._piece or self._body
        if more:
            await send(body, True)
            return
        self.done = True  # the last message: uvicorn's disconnect after it is no leaving
        await send(body, False)
        self.sent = True

    async def _body(self, body: bytes, more: bool) -> None:
        if self._head:
            body = b""
        await self._send({"type": "http.response.body", "body": body, "more_body": more})

    async def fail(self, error: ApiError) -> bool:
        """End the answer with ``error`` where one has begun: a stream of events gets it
        as its last event, then ``[DONE]`` (not cut mid-answer). Returns whether an
        answer had begun; if not, nothing was sent (answer with :func:`send_error`)."""
        if not self.started:
            return False
        if self.events and not self.done:
            await self.piece(b"data: " + sse_safe(error.body()) + b"\n\ndata: [DONE]\n\n",
                             False)
        return True

    async def __call__(self, event: Event) -> None:
        if event["type"] == "http.response.start":
            headers = event.get("headers", ())
            assert isinstance(headers, list | tuple)
            self.started = True
            self.events = (b"content-type", SSE_TYPE) in headers
            await self._send({**event, "headers": [*headers, self._rid]})
        elif event["type"] == "http.response.body":
            body = event.get("body", b"")
            assert isinstance(body, bytes)
            await self.piece(body, bool(event.get("more_body")))
        else:
            await self._send(event)


#: Seconds a whole (non-streamed) answer may take before its connection is watched
#: for a client that leaves (:class:`Conn`).
WATCH_AFTER_S = 0.05


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

    A whole (non-streamed) answer's connection is watched only once it has
    taken :data:`WATCH_AFTER_S` (``watch_after``): most are sent sooner, and
    cost a timer rather than a task that waits on ``receive()`` (its creation,
    two steps and uvicorn's event; 8 us of the door's ~100 a 1-token request). A
    client that leaves before then is seen then, since uvicorn's ``receive()``
    tells a disconnect that came before it is called; its request is aborted
    as before. A stream is watched at once (``watch_after=0``).
    """

    __slots__ = ("_closed", "_receive", "_reply", "_task", "_timer", "_watch", "gone")

    def __init__(self, receive: Receive, reply: Reply, watch_after: float = 0.0) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._reply = reply  # how far the answer got
        self._receive = receive
        self._closed = False
        self.gone = False
        self._watch: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        if watch_after > 0:
            self._timer = task.get_loop().call_later(watch_after, self._start)
        else:
            self._start()

    def _start(self) -> None:
        self._timer = None
        self._watch = self._task.get_loop().create_task(self._wait(self._receive))

    async def _wait(self, receive: Receive) -> None:
        event = await receive()
        # After the answer's last message, uvicorn's ``http.disconnect`` is not the
        # client leaving.
        if event["type"] == "http.disconnect" and not (self._reply.done or self._closed):
            self.gone = True
            self._task.cancel()

    def close(self) -> None:
        """The answer is sent (or abandoned): stop watching. After a sent answer the
        watcher ends by itself; otherwise it is cancelled."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        elif self._watch is not None and not self._reply.sent:
            self._watch.cancel()
