"""``/metrics`` over HTTP where an idle or slow connection costs nothing but its socket.

``prometheus_client.start_http_server`` starts a thread per connection with
no idle timeout and listens with a backlog of 5: fifty clients that connect
and say nothing hold fifty threads for ever, and back-to-back connects past
the backlog wait for SYN retries (seconds). A fixed pool of workers that
read a request with a deadline is no better against slow clients: 300
connections that trickle their request a byte at a time hold every worker,
and a Prometheus scrape waits minutes behind them. Here one
thread does everything, over a selector and non-blocking sockets:

* it accepts and reads every connection as bytes arrive, so a slow client
  holds nothing but its socket and a few bytes of buffer;
* a connection that has sent nothing within ``idle_timeout`` is closed,
  and one whose request head is not whole within ``deadline`` seconds of
  its accept (a client that trickles bytes) is cut off; at most
  ``max_connections`` are open at once, fewer where the open-file limit
  leaves fewer (:class:`bus.fdlimit.ConnectionBudget`); past them the
  oldest that has sent nothing is closed (else the oldest);
* an ``accept()`` refused for lack of descriptors all the same (the
  process opened more elsewhere) closes a connection in the same way to
  make room, or, with none open, stops reading the listening socket for a
  moment (a readable listener would spin the thread, a warning per turn);
  such failures are logged as periodic summaries (:class:`bus.LogSummary`);
* a whole request head is answered at once (the registry's text, made on
  this thread) and written as the client takes it; one that takes nothing
  for ``deadline`` seconds is cut off;
* the listen backlog is ``backlog`` (128): a burst of connects is accepted
  at once, not after SYN retries.

It serves ``GET /metrics`` (and ``/``) in the Prometheus text format, one
request per connection (HTTP/1.0 style: ``Connection: close``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from bus import LogSummary
from bus.fdlimit import ACCEPT_GONE, NO_FILES, ConnectionBudget, files_in_use, open_files_limit

__all__ = ["MetricsServer"]

log = logging.getLogger("scheduler.metrics")

_MAX_HEAD = 8192
#: Seconds the listening socket is not read after an ``accept()`` that failed.
_PAUSE_S = 0.1

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


class _Conn:
    """One client connection: what it sent of its request, what is left to write to it,
    and when it is cut off."""

    __slots__ = ("expires", "head", "out", "sock", "spoke")

    def __init__(self, sock: socket.socket, expires: float) -> None:
        self.sock = sock
        self.head = bytearray()
        self.out: memoryview | None = None  # the answer, once there is one
        self.expires = expires
        self.spoke = False  # it has sent a byte


class MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` until :meth:`close`.

    Args:
        registry: what to expose.
        host, port: where to listen (``port=0``: any free port, see :attr:`port`).
        idle_timeout: seconds a connection may stay silent before it is closed.
        deadline: seconds to read one request head, in all, from the accept; and
            seconds a client may take nothing of its answer.
        max_connections: most connections open at once (past them, the oldest is closed);
            lowered to what the open-file limit leaves
            (:attr:`ConnectionBudget.accept`, computed when the server starts).
        backlog: the listen backlog.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 idle_timeout: float = 5.0, deadline: float = 10.0,
                 max_connections: int = 1024, backlog: int = 128) -> None:
        self.registry = registry
        self.idle_timeout = idle_timeout
        self.deadline = deadline
        budget = ConnectionBudget.for_limit(open_files_limit(), files_in_use())
        self.max_connections = max(1, min(max_connections, budget.accept))
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self._listener = socket.create_server((host, port), family=family, backlog=backlog)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # insertion order = age
        self._expiries: list[tuple[float, int, _Conn]] = []  # a heap; stale entries skipped
        self._seq = itertools.count()
        self._stop = threading.Event()
        self.closed_idle = 0  # closed before sending a byte
        self.cut_off = 0  # closed past a deadline once it had sent something
        self.answered = 0
        self.accept_failures = 0  # accept() calls that failed (out of descriptors, say)
        self._listening_at: float | None = None  # paused: the listener is read again then
        self._accept_log = LogSummary(log, "metrics: accept() failed")
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving; close every connection and join the thread. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()
        self._accept_log.flush()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, events in self._sel.select(timeout=self._next_expiry()):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is not self._wake_r:
                        assert isinstance(sock, socket.socket)
                        conn = self._conns.get(sock)
                        if conn is None:
                            continue  # closed earlier in this pass
                        try:
                            if events & selectors.EVENT_READ:
                                self._read(conn)
                            else:
                                self._write(conn)
                        except Exception as exc:  # one bad client costs its own connection
                            log.debug("metrics: a connection failed: %s", exc)
                            self._close(conn)
                self._expire()
                if self._listening_at is not None and time.monotonic() >= self._listening_at:
                    self._listening_at = None
                    self._sel.register(self._listener, selectors.EVENT_READ)
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)

    def _next_expiry(self) -> float:
        wait = 1.0
        if self._listening_at is not None:
            wait = min(wait, max(0.0, self._listening_at - time.monotonic()))
        while self._expiries:
            at, _, conn = self._expiries[0]
            if conn.sock in self._conns and conn.expires == at:
                return min(wait, max(0.0, at - time.monotonic()))
            heapq.heappop(self._expiries)  # closed, or given a later deadline
        return wait

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiries and self._expiries[0][0] <= now:
            at, _, conn = heapq.heappop(self._expiries)
            if conn.sock not in self._conns or conn.expires != at:
                continue
            if conn.spoke:
                self.cut_off += 1
            else:
                self.closed_idle += 1  # counted first: the peer sees the close at once
            self._close(conn)

    def _expires(self, conn: _Conn, at: float) -> None:
        conn.expires = at
        heapq.heappush(self._expiries, (at, next(self._seq), conn))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in ACCEPT_GONE:
                    continue  # (that client left before it was taken)
                self.accept_failures += 1
                out_of_files = exc.errno in NO_FILES
                self._accept_log.add(
                    "out of file descriptors" if out_of_files else "listening socket",
                    f"{exc} with {len(self._conns)} connections open; open-file limit "
                    f"{open_files_limit()}")
                if out_of_files and self._conns:
                    self._make_room()
                    continue
                # Nothing of ours to close, or an error of the listener itself: it stays
                # readable, so it is not read for a moment rather than retried in a spin.
                self._sel.unregister(self._listener)
                self._listening_at = time.monotonic() + _PAUSE_S
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                self._make_room()
            conn = _Conn(sock, 0.0)
            self._conns[sock] = conn
            self._expires(conn, time.monotonic() + self.idle_timeout)
            self._sel.register(sock, selectors.EVENT_READ)

    def _make_room(self) -> None:
        """Close the oldest connection that has sent nothing, else the oldest one."""
        oldest = next(iter(self._conns.values()))
        self._close(next((c for c in self._conns.values() if not c.spoke), oldest))

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            got = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = b""
        if not got:
            self._close(conn)  # (gone before its answer)
            return
        if not conn.spoke:
            conn.spoke = True
            self._expires(conn, conn.expires - self.idle_timeout + self.deadline)
        conn.head += got
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            end = conn.head.find(b"\n\n")
        if end < 0:
            if len(conn.head) > _MAX_HEAD:
                self._answer(conn, 431, b"request head too large\n", "text/plain")
            return
        self._respond(conn, bytes(conn.head[:end]))

    def _respond(self, conn: _Conn, head: bytes) -> None:
        parts = head.split(b"\n", 1)[0].strip().split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self._answer(conn, 400, b"bad request\n", "text/plain")
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            self._answer(conn, 405, b"GET only\n", "text/plain")
        elif target not in (b"/metrics", b"/"):
            self._answer(conn, 404, b"not found: try /metrics\n", "text/plain")
        else:
            self._answer(conn, 200, generate_latest(self.registry), CONTENT_TYPE_LATEST,
                         head_only=method == b"HEAD")

    def _answer(self, conn: _Conn, status: int, body: bytes, content_type: str, *,
                head_only: bool = False) -> None:
        """Write the answer as the client takes it (the rest of its request is not read)."""
        head = (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        conn.out = memoryview(head if head_only else head + body)
        self.answered += 1
        self._expires(conn, time.monotonic() + self.deadline)
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)  # the client left
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)
        elif sent:
            self._expires(conn, time.monotonic() + self.deadline)  # it takes: more time
