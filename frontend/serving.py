"""uvicorn's HTTP protocol, with a deadline on a new connection's first byte, paced.

uvicorn closes a keep-alive connection that stays silent for
``timeout_keep_alive`` seconds after a response, but arms that timer only
after a response: a connection that never sends a byte stays open for ever,
and some 20,000 of them take every file descriptor (every client,
``/health`` included, is then turned away). :func:`http_protocol`
arms the same timer when a connection is made, so a silent new connection
is closed as a silent idle one is (and so is one whose bytes begin nothing,
below); ``--body-timeout`` covers a request's body.

Its received bytes also take their turn on the loop (:mod:`frontend.turns`):
past the iteration's slice, a connection's bytes wait, unread, for a later
iteration, so a burst of arriving requests is parsed a share at a time. And
a client that leaves is seen by every request of its connection, not only
the last one it pipelined (uvicorn tells that one alone).

A request's head (its request line and headers) is bounded too, in size
and in time: uvicorn's httptools protocol reads headers without limit (a
client may send 64 MB of them and the server keeps every byte) and
without a deadline (a client that sends half its headers and stops holds
its connection for ever, the idle timer being cancelled by its first
byte). Past ``max_head_bytes`` the answer is a 431 (what a request sends
that is not its body counts: its head, and a chunked body's framing beyond
64 bytes a chunk and its trailers), past ``head_timeout`` seconds a 408,
each in OpenAI's error shape and closing the connection.
Under ``h11`` the size bound is the same (h11's own check, of a head still
incomplete, held to ``max_head_bytes``, and a whole head measured as
httptools' is, :class:`_BoundedH11`); the deadline is httptools' alone (under
h11, a head that stalls is closed, unanswered, at the idle timeout).

A request whose body the server has not received whole when its answer is
complete (a 413 told by its ``content-length``, a 404, an answer that did not
read it) closes its connection after the answer, which says so
(``connection: close``, under h11 too): the rest of that body is never read
(uvicorn read and dropped it, a 1 GB body sent by a client that kept the
connection busy included). A client that half-closes its
connection (``SHUT_WR``) after its requests gets their answers, then the
connection closes (uvicorn closed it at the end of file, unanswered), if
they begin within ``_EOF_GRACE_S`` (a client that closed its connection
sends the same end of file, and its requests are aborted); one whose request
is not whole at its end of file is closed at once.

A client that stops reading its answer is gone after ``send_timeout``
seconds: once the transport's write buffer is full, the writer waits for
the client; a client that drains nothing for that long has its connection
aborted, so its request is aborted too (else a stream nobody reads holds
its tokens, ~45 bytes each, for as long as the connection stays open,
while the scheduler generates them at full speed).

An HTTP/1.0 request's answer is never chunked (:func:`_close_delimited`).

What the parser refuses is answered in OpenAI's error shape, naming the
parser's reason: 400, or 501 for a transfer coding before a final ``chunked``
(``gzip, chunked``: RFC 9112's answer to a coding the server lacks). A
request framed by both a length and chunks is refused by httptools; h11
answers it by its chunks, so its connection is closed after the answer (RFC
9112), else bytes a length-trusting proxy sent as its body would be read as a
request of their own.

A whole answer (the app's :meth:`frontend.asgi.Reply.whole`) is sent by
:func:`_send_whole`, offered in each request's scope as the
:data:`frontend.asgi.WHOLE` extension (httptools): its head and body in one
write, with none of the two ASGI messages built, copied and read back that
uvicorn's ``send`` takes, nor its second write (each a system call that, on
loopback, runs the reader's side of TCP too).
Each piece of a stream (the events of a step) is sent by :func:`_send_piece`,
offered as :data:`frontend.asgi.PIECE`: one chunk written, no ASGI message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import logging
import socket
import struct
import sys
import weakref
from itertools import chain
from typing import Any

from frontend.asgi import PIECE, WHOLE, Headers
from frontend.errors import ApiError, clip
from frontend.turns import loop_turns

__all__ = ["HEAD_TIMEOUT_S", "MAX_HEAD_BYTES", "SEND_TIMEOUT_S", "http_protocol"]

log = logging.getLogger("frontend")

try:  # the kernel's unsent bytes of a socket (Linux: SIOCOUTQ is TIOCOUTQ)
    import fcntl
    import termios
    _SIOCOUTQ: int | None = termios.TIOCOUTQ if sys.platform == "linux" else None
except ImportError:  # (not POSIX)
    _SIOCOUTQ = None

#: Most bytes of one request's head (request line and headers): nginx allows 32 KiB by
#: default, Node 16 KiB; room here for long bearer tokens and cookies.
MAX_HEAD_BYTES = 64 << 10
#: Seconds a request's head may take to arrive whole once its first byte has.
HEAD_TIMEOUT_S = 30.0
#: Seconds a client may read nothing of its answer once the server's buffer for it is full.
SEND_TIMEOUT_S = 30.0

#: Seconds a half-closed connection's answers may take to begin. A client's end of
#: file is the same on the wire whether it half-closed (it still reads) or closed (it
#: left): a closed one is told from a half-closed one by the reset its kernel answers
#: a write with, and an answer not begun writes nothing. Past this, the client is
#: taken for one that left and its requests are aborted (a whole answer to a client
#: that closed would otherwise be computed to its end); what begins sooner (a stream,
#: a short answer) is answered.
_EOF_GRACE_S = 1.0

#: Bytes a chunk of a chunked body may spend on its framing (size line, extensions,
#: CRLFs) beyond the head's bound.
_CHUNK_FRAMING = 64


_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}
#: Each status's HTTP/1.1 status line, with its reason phrase where HTTP names one.
_STATUS_LINES = {status: b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES.get(status, b""))
                 for status in range(100, 600)}


def _refusal(status: int, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 error answer in OpenAI's shape that closes the connection."""
    body = ApiError(status, message, code=code).body()
    return _STATUS_LINES[status] + (b"content-type: application/json\r\ncontent-length: %d\r\n"
                                    b"connection: close\r\n\r\n" % len(body)) + body


def _unsupported_codings(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The transfer codings ``headers`` name before a final ``chunked`` (the one coding
    this server decodes), as sent, or None. RFC 9112: such a request's length is known,
    and a coding the server does not implement is answered 501 (without a final
    ``chunked`` the length is not known: the parser's 400)."""
    codings = [coding.strip() for name, value in headers if name == b"transfer-encoding"
               for coding in value.split(b",")]
    codings = [c for c in codings if c]
    if len(codings) < 2 or codings[-1].lower() != b"chunked":
        return None
    return b", ".join(codings[:-1])


def _framed_twice(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether ``headers`` frame the body both by ``content-length`` and by
    ``transfer-encoding``."""
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def _close_delimited(cycle: Any) -> None:
    """Answer an HTTP/1.0 request without chunked transfer coding, which HTTP/1.0 does not
    have: a body with no length ends when the connection closes (uvicorn closes an
    HTTP/1.0 connection after its answer). uvicorn chunked every answer that had no
    ``content-length``, so an HTTP/1.0 client (nginx's ``proxy_pass`` by default)
    read the chunk sizes as part of a stream's events."""
    send = cycle.send

    async def send_1_0(message: Any) -> None:
        if message["type"] == "http.response.start":
            cycle.chunked_encoding = False  # (decided before uvicorn looks at the headers)
            cycle.expected_content_length = sys.maxsize  # whatever comes, until the close
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            cycle.expected_content_length = len(message.get("body", b""))  # it ends here
        await send(message)

    cycle.send = send_1_0


def _announce_close_if_unread(cycle: Any) -> None:
    """Have an answer on uvicorn's h11 request ``cycle`` say ``connection: close`` when it
    begins before its request's body was read whole (the connection closes after it:
    ``on_response_complete``), as :func:`_send_whole` does under httptools: h11 closed
    the connection after such an answer without saying so, and a client that keeps
    its connections sent its next request into the close."""
    send = cycle.send
    close = (b"connection", b"close")

    async def send_h11(message: Any) -> None:
        if message["type"] == "http.response.start" and cycle.more_body:
            cycle.keep_alive = False
            if close not in cycle.scope["headers"]:
                cycle.scope["headers"].append(close)  # (uvicorn adds it to the answer)
        await send(message)

    cycle.send = send_h11


async def _send_whole(cycle_ref: weakref.ref[Any], status: int, headers: Headers,
                      body: bytes) -> None:
    """Send a whole answer on uvicorn's (httptools) request ``cycle`` in one write, as
    its ``send`` would send ``http.response.start`` then one last
    ``http.response.body``: after a paused writer drains; nothing to a client gone;
    the server's default headers (``date``, ``server``) first; ``connection: close``
    where the connection is not kept alive; no body to a HEAD request; then the
    cycle completed as uvicorn completes it (its ``receive`` tells
    ``http.disconnect``, the connection closed or its next request begun).

    ``headers`` are the app's own (lower-case names, values it made or checked):
    they are not checked again, and must name the ``content-length`` of ``body``.

    The cycle is held weakly (its scope holds this), so that it leaves no reference
    cycle behind for the collector.

    Raises:
        RuntimeError: the answer had begun (as uvicorn raises).
    """
    cycle = cycle_ref()
    if cycle is None:  # (its request is over)
        return
    if cycle.flow.write_paused:  # (a test, not a coroutine, on the hot path)
        await _drained(cycle)
    if cycle.disconnected:
        return
    if cycle.response_started:
        raise RuntimeError("a whole answer after the answer had begun")
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    out = [_STATUS_LINES[status]]
    for name, value in (*cycle.default_headers, *headers):
        if name == b"connection" and b"close" in value.lower():
            cycle.keep_alive = False
            continue  # (written below, once)
        out += (name, b": ", value, b"\r\n")
    if cycle.more_body:  # (its body is not read whole: the connection closes after this)
        cycle.keep_alive = False
    out.append(b"\r\n" if cycle.keep_alive else b"connection: close\r\n\r\n")
    if cycle.scope["method"] != "HEAD":
        out.append(body)
    cycle.transport.write(b"".join(out))
    _complete(cycle)


async def _drained(cycle: Any) -> None:
    """Wait until uvicorn's request ``cycle`` may write again (its connection's writing
    resumed), or its client is gone. Each waiter wakes when writing resumes, and
    waits again if another one's write has paused it meanwhile: nothing is written
    while paused (the stall timer counts on it, :meth:`Guarded._stalled`)."""
    while cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()


def _complete(cycle: Any) -> None:
    """Complete uvicorn's (httptools) request ``cycle`` whose answer's last bytes are
    written, as its ``send`` does: its ``receive`` tells ``http.disconnect``, the
    connection closes where it is not kept alive, else its next request begins."""
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        cycle.transport.close()
    cycle.on_response()


async def _send_piece(cycle_ref: weakref.ref[Any], body: bytes, more: bool) -> None:
    """Send a piece of a chunked answer begun on uvicorn's (httptools) request ``cycle``
    as one chunk (``more`` False: then the last chunk, and the cycle completed as
    :func:`_send_whole` completes it), as its ``send`` would send one
    ``http.response.body``: after a paused writer drains; nothing to a client gone.
    An answer not chunked (HTTP/1.0's), not begun or complete goes through the
    cycle's own ``send``, with its rules and errors."""
    cycle = cycle_ref()
    if cycle is None:  # (its request is over)
        return
    if not cycle.chunked_encoding or not cycle.response_started or cycle.response_complete:
        await cycle.send({"type": "http.response.body", "body": body, "more_body": more})
        return
    if cycle.flow.write_paused:  # (a test, not a coroutine, on the hot path)
        await _drained(cycle)
    if cycle.disconnected:
        return
    transport = cycle.transport
    if more:
        if body:
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return
    transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n")
    _complete(cycle)


def _tell_gone(cycle: Any) -> None:
    """Tell an unanswered request's handler that its client is gone (as uvicorn tells
    the connection's last one): its ``receive()`` returns ``http.disconnect``."""
    if not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()


def _unread(transport: Any) -> int:
    """Bytes written to ``transport`` that its client has not taken: the transport's
    buffer, and (Linux) the kernel's send queue (``SIOCOUTQ``): a reader slower than
    the answer drains the kernel's megabytes long before the transport's buffer moves
    (counting the transport's buffer alone, steady readers at 6-34 KB/s would be
    cut as if gone)."""
    unread = int(transport.get_write_buffer_size())
    sock = transport.get_extra_info("socket")
    if sock is not None and _SIOCOUTQ is not None:
        with contextlib.suppress(OSError, ValueError):
            unread += struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4))[0]
    return unread


def _reset(transport: Any) -> None:
    """Abort ``transport`` with a reset: a plain close leaves what the kernel holds for
    the client (megabytes) to an orphaned socket that goes on offering it to a client
    that reads nothing, its probes backing off to minutes; lingering 0 s drops it."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _not_implemented(codings: bytes) -> bytes:
    """The 501 for a body in transfer ``codings`` this server does not decode."""
    quoted = clip(codings.decode("latin-1"))
    return _refusal(501, "unsupported_transfer_coding",
                    f"transfer-encoding {quoted!r} is not implemented: send the body "
                    "with a content-length or chunked alone")


def _parse_refusal(error: BaseException | None, fallback: str) -> bytes:
    """The answer to a request the HTTP parser refused with ``error`` (h11's carries the
    status it advises; ``fallback``: the text when there is no error)."""
    if (error is not None and error.__context__ is not None and
            type(error).__name__ == "HttpParserCallbackError"):
        error = error.__context__  # (what a parser callback raised: an invalid URL)
    status = getattr(error, "error_status_hint", 400)
    if not (isinstance(status, int) and 400 <= status < 600):
        status = 400
    reason = clip(str(error)) if error is not None and str(error) else fallback
    if status == 501:
        return _refusal(501, "unsupported_transfer_coding",
                        f"{reason}: send the body with a content-length or chunked alone")
    code = "headers_too_large" if status == 431 else "invalid_http"
    return _refusal(status, code, f"invalid HTTP request: {reason}")


def _head_size(target: bytes, headers: Any) -> int:
    """A head's size as the bound counts it: its target, and each header's name and
    value with 4 bytes of framing (``": "``, CRLF)."""
    return len(target) + sum(len(name) + len(value) + 4 for name, value in headers)


def _bounded_h11(max_head_bytes: int) -> Any:
    """An ``h11.Connection`` (server side) that refuses a head, or a chunked body's
    trailers, past ``max_head_bytes`` with h11's own 431 (its
    ``RemoteProtocolError``): h11 bounds only what is still incomplete (16 KiB by
    default), so a larger head that arrived whole in one read was taken."""
    import h11

    too_large = f"the request's headers passed {max_head_bytes} bytes"

    class _BoundedH11(h11.Connection):
        def next_event(self) -> Any:
            event = super().next_event()
            if isinstance(event, h11.Request):
                size = len(event.method) + _head_size(event.target, event.headers.raw_items())
            elif isinstance(event, h11.EndOfMessage):
                size = _head_size(b"", event.headers.raw_items())
            else:
                return event
            if size > max_head_bytes:
                raise h11.RemoteProtocolError(too_large, error_status_hint=431)
            return event

    return _BoundedH11(h11.SERVER, max_incomplete_event_size=max_head_bytes)


class _Refused(Exception):
    """Raised from a parser callback once the connection was answered and closed."""


def http_protocol(name: str = "auto", *, max_head_bytes: int = MAX_HEAD_BYTES,
                  head_timeout: float = HEAD_TIMEOUT_S,
                  send_timeout: float = SEND_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's protocol class ``name`` (``auto``, ``h11``, ``httptools``), with the
    bounds and behaviours the module docstring gives.

    Raises:
        ValueError: a bound that is not above 0.
    """
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    if not (max_head_bytes > 0 and head_timeout > 0 and send_timeout > 0):  # (NaN too)
        raise ValueError(f"max_head_bytes ({max_head_bytes}), head_timeout "
                         f"({head_timeout}) and send_timeout ({send_timeout}) must be above 0")
    base: Any = import_from_string(HTTP_PROTOCOLS[name])
    # h11 takes a request with both a length and chunked coding by its coding (llhttp
    # refuses it, 400); RFC 9112 then requires the connection closed after the answer.
    is_h11 = hasattr(base, "handle_events")
    both_lengths_close = is_h11

    too_large = _refusal(431, "headers_too_large",
                         f"the request's headers passed {max_head_bytes} bytes")
    late = _refusal(408, "header_timeout",
                    f"the request's headers did not arrive whole within {head_timeout:g} s")

    class Guarded(base):  # type: ignore[misc]
        _open = False  # a request has begun and is not read whole yet
        _in_head = False  # ... and its head is not whole yet
        _seq = 0  # requests begun on this connection
        _framing = 0  # bytes of the open request read that were not its body
        _body = 0  # body bytes read on this connection
        _chunks = 0  # chunks of the open request's body (chunked)
        _head_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        #: uvicorn's idle timer (its attribute: :meth:`_idle` arms it too).
        timeout_keep_alive_task: asyncio.TimerHandle | None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if is_h11:
                self.conn = _bounded_h11(max_head_bytes)  # (the one uvicorn made: unused yet)
            super().connection_made(transport)
            self._turns = loop_turns()  # (looked up once, not per read)
            # Requests still answering that a pipelined one replaced as ``cycle``:
            # uvicorn tells only ``cycle`` of a client gone, and these would hold their
            # slots to their ends (a non-streamed request, or any stream on the asyncio
            # loop, runs to max_tokens). httptools alone makes them: h11 reads no
            # request while one is answered.
            self._earlier: list[Any] = []
            if not transport.is_closing():
                self._idle()

        _paced = False  # reading paused until its bytes' turn
        _idle_since: float | None = None  # when the connection last had nothing to do

        def _idle(self) -> None:
            """Arm uvicorn's idle timer for what is left of the connection's idle time:
            bytes that begin nothing (blank lines) do not buy a client a new period
            (else a CRLF every 3 s holds a connection for ever)."""
            now = self.loop.time()
            if self._idle_since is None:
                self._idle_since = now
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(
                    max(0.0, self.timeout_keep_alive - (now - self._idle_since)),
                    self.timeout_keep_alive_handler)

        _eof = False  # the client half-closed: it sends nothing more
        _eof_timer: asyncio.TimerHandle | None = None  # armed at the half-close (_eof_late)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            transport = self.transport
            if transport.is_closing():
                return
            cycle = self.cycle  # (an answered request whose body is unread is the last one)
            if ((cycle is not None and cycle.more_body and cycle.response_complete) or
                    (self._eof and self._done())):
                # Its body is not read whole: its rest is never read, not even to be
                # dropped (a refused 1 GB body). Or the client sends nothing more, and
                # everything it asked is answered.
                transport.close()
                return
            # a new idle period, if uvicorn armed its timer
            self._idle_since = self.loop.time() if self.timeout_keep_alive_task else None

        def _done(self) -> bool:
            """Whether every request read on this connection is answered whole."""
            return self._answered() and not getattr(self, "pipeline", None)

        def eof_received(self) -> bool | None:
            # The client half-closed (SHUT_WR), or closed: the answers still due are
            # sent if they begin within _EOF_GRACE_S (_eof_late), then the connection
            # closes (on_response_complete). Returning None closes it now:
            # nothing is due, or the request being read can never be whole (its
            # handler is told the client is gone). (A head begun after requests still
            # due can never be whole either: it is dropped once they are answered.)
            cycle = self.cycle
            if self._done() or (cycle is not None and cycle.more_body
                                and not cycle.response_complete):
                return None
            self._eof = True
            if self._eof_timer is None:  # (told again if reading resumes)
                self._eof_timer = self.loop.call_later(_EOF_GRACE_S, self._eof_late)
            return True

        def _eof_late(self) -> None:
            """``_EOF_GRACE_S`` after a half-close with answers still due: unless the last
            request's answer has begun (its writes tell a client that closed), the client
            is taken for one that closed its connection, and the connection is closed
            (its requests are aborted)."""
            self._eof_timer = None
            cycle = self.cycle
            if not self.transport.is_closing() and not (
                    cycle is not None and cycle.response_started):
                self.transport.close()

        # -- the request a connection makes (h11) -------------------------------------

        if both_lengths_close:
            def handle_events(self) -> None:
                earlier = self.cycle
                super().handle_events()  # (makes at most one request: h11 pauses after it)
                cycle = self.cycle
                if cycle is not earlier:
                    _announce_close_if_unread(cycle)
                if cycle is not earlier and _framed_twice(cycle.scope["headers"]):
                    # (kept open, the bytes a proxy that trusted the length took for
                    # this body would be read here as the next request: smuggling)
                    cycle.keep_alive = False
                    cycle.scope["headers"].append((b"connection", b"close"))  # (told in the answer)

        # -- the head's bounds (httptools' parser callbacks) --------------------------

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._open = self._in_head = True
            self._idle_since = None
            self._seq += 1
            self._framing = self._chunks = 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            # A head in a read that was not counted (it ended the request there, or held
            # earlier requests too) is measured here, by its parsed parts.
            headers = self.headers  # (name, value) pairs: their lengths summed in C
            head = len(self.url) + 4 * len(headers) + sum(map(len, chain.from_iterable(headers)))
            if head > max_head_bytes:
                self._refuse(too_large, unbegun=True)
                raise _Refused  # stop the parser: nothing more of this connection is read
            unsupported = _unsupported_codings(headers)
            if unsupported is not None:
                # (llhttp took ``gzip, chunked`` as chunked, and the handler read the
                # gzip bytes as the body: "invalid JSON")
                self._refuse(_not_implemented(unsupported), unbegun=True)
                raise _Refused
            earlier = self.cycle
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is earlier:  # (no request made: an upgrade)
                return
            if earlier is not None and not earlier.response_complete:
                self._earlier = [c for c in self._earlier if not c.response_complete]
                self._earlier.append(earlier)
            if cycle.scope.get("http_version") == "1.0":
                _close_delimited(cycle)
            extensions = self.scope.setdefault("extensions", {})  # (uvicorn's kept)
            ref = weakref.ref(cycle)
            extensions[WHOLE] = functools.partial(_send_whole, ref)
            extensions[PIECE] = functools.partial(_send_piece, ref)

        def on_body(self, body: bytes) -> None:
            self._body += len(body)  # (the connection's, all requests')
            super().on_body(body)

        def on_chunk_header(self) -> None:  # (httptools calls it where it is defined)
            self._chunks += 1

        def on_message_complete(self) -> None:
            self._open = False
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            # uvicorn's own answer to what its parser refuses (a negative length, both
            # a length and chunked coding, a bad chunk size, an unknown method) is
            # text/plain; every answer of the door is in OpenAI's error shape. uvicorn
            # calls this while it handles the parser's error: the error's text says
            # what was wrong, and h11's hint gives the status (501 for a transfer
            # coding it does not implement, 431 for a head too large).
            if self.transport.is_closing():  # (after a refusal of ours)
                return
            self.transport.write(_parse_refusal(sys.exc_info()[1], msg))
            self.transport.close()

        def _answered(self) -> bool:
            """Whether every request begun before this one is answered whole."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete

        def _head_late(self) -> None:
            self._head_timer = None
            if not self._in_head:
                return
            if not self._answered():  # a head pipelined behind an answer: its time runs
                # once that is written (a 408 now would precede it)
                self._head_timer = self.loop.call_later(head_timeout, self._head_late)
                return
            self._refuse(late, unbegun=True)

        def _refuse(self, answer: bytes, *, unbegun: bool) -> None:
            """Answer ``answer`` and close. ``unbegun``: the refused request's head is not
            whole (it has no answer of its own yet). When an answer to an earlier request
            is still due, or the refused one's has begun, close without a word: the
            bytes would land before it or inside it (HTTP answers go in order)."""
            cycle = self.cycle
            if unbegun:  # the connection's last answer (and so every earlier one) before it
                in_order = self._answered()
            else:  # ``cycle`` is the refused request's own: the earlier ones come before it
                in_order = ((cycle is None or not cycle.response_started)
                            and all(c.response_complete for c in self._earlier))
            self._in_head = self._open = False
            transport = self.transport
            if not transport.is_closing():
                if in_order:
                    transport.write(answer)
                transport.close()
            if cycle is not None:
                _tell_gone(cycle)  # its handler hears it now, not at connection_lost

        # -- a client that stops reading ----------------------------------------------

        _unread_then = 0  # bytes the client had not taken when the stall timer was armed

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._arm_stall()

        def _arm_stall(self) -> None:
            self._unread_then = _unread(self.transport)
            self._stall_timer = self.loop.call_later(send_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            """``send_timeout`` seconds with writing paused: a client that took anything
            meanwhile gets another period; one that read nothing has its connection
            aborted (what is buffered for it is dropped), and its handlers see it gone.
            (Paused, nothing more is written: what is unread only shrinks as it reads.)
            A transport already closing is no exception: its close waits for the client
            to drain the buffer, for ever if it never reads (after ``connection:
            close``, a keep-alive expiry or a half-close)."""
            self._stall_timer = None
            transport = self.transport
            if _unread(transport) < self._unread_then:  # it read: a slow client, not a gone one
                self._arm_stall()
            else:
                log.info("client %s read nothing of its answer for %g s: its connection is "
                         "reset and its request aborted", transport.get_extra_info("peername"),
                         send_timeout)
                _reset(transport)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._eof_timer is not None:
                self._eof_timer.cancel()
                self._eof_timer = None
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)
            for c in self._earlier:
                _tell_gone(c)
            self._earlier.clear()

        def data_received(self, data: bytes) -> None:
            # Bytes take their turn on the loop (frontend.turns): 256 requests
            # arriving at once were all parsed, and their tasks made, in one
            # iteration (~50 us each: 13 ms of held loop). A connection whose
            # bytes wait is not read meanwhile (nothing piles up unparsed).
            if not self._turns.call(functools.partial(self._in_turn, data)):
                self.transport.pause_reading()
                self._paced = True

        def _in_turn(self, data: bytes) -> None:
            transport = self.transport
            if transport.is_closing():
                return
            if self._paced:  # first: parsing may pause it again (uvicorn's flow control)
                self._paced = False
                transport.resume_reading()
            seq, was_open, body = self._seq, self._open, self._body
            super().data_received(data)
            if self._open:
                # What was read and not body: the open request's head, a chunked body's
                # framing and its trailers. Counted from a read that began on this
                # request (it was open, or the connection was idle and only it began);
                # a read that also held earlier requests (pipelined) is not counted, as
                # their heads and framing are in it: the bound may then be passed by at
                # most that one read before it is refused.
                read = len(data) - (self._body - body)
                if was_open and self._seq == seq:
                    self._framing += read
                elif not was_open and self._seq == seq + 1:
                    self._framing = read
                if self._framing > max_head_bytes + _CHUNK_FRAMING * self._chunks:
                    self._refuse(too_large, unbegun=self._in_head)
            if transport.is_closing():
                return
            if self._in_head:
                # A head begun in this read and not whole at its end has
                # ``head_timeout`` from here (microseconds after its first byte): a head
                # that arrives in one read, nearly every one, costs no timer armed and
                # cancelled.
                if self._head_timer is None:
                    self._head_timer = self.loop.call_later(head_timeout, self._head_late)
            elif self._answered():
                # Nothing is being read into a request's head and nothing is being
                # answered: blank lines before a request (which the parser skips), or
                # the rest of a body the answer did not wait for (a 413, a 404).
                # uvicorn cancelled the idle timer on the first byte; arm it again, or
                # such a connection is held for ever. (Not while a request is being
                # answered, headers sent or not: the timer closes, it does not ask.)
                self._idle()

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded
