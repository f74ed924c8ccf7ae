"""``/metrics`` over HTTP with bounded cost: a fixed pool of threads, idle connections timed out.

``prometheus_client.start_http_server`` starts a thread per connection with
no idle timeout and listens with a backlog of 5: fifty clients that connect
and say nothing hold fifty threads for ever, and back-to-back connects past
the backlog wait for SYN retries (seconds). Here:

* one thread accepts and watches connections (a selector): a connection
  that has not sent a request within ``idle_timeout`` is closed, and at most
  ``max_connections`` wait at once (the oldest is closed first);
* a connection with bytes to read goes to one of ``workers`` threads, which
  reads the request head within ``deadline`` seconds in all (a client that
  trickles bytes is cut off), answers and closes; when every worker is busy
  and ``workers`` more wait, a new one is answered ``503`` at once;
* the listen backlog is ``backlog`` (128): a burst of connects is accepted
  at once, not after SYN retries.

It serves ``GET /metrics`` (and ``/``) in the Prometheus text format, one
request per connection (HTTP/1.0 style: ``Connection: close``).
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = ["MetricsServer"]

log = logging.getLogger("scheduler.metrics")

_MAX_HEAD = 8192


class MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` until :meth:`close`.

    Args:
        registry: what to expose.
        host, port: where to listen (``port=0``: any free port, see :attr:`port`).
        workers: threads that answer requests (the only ones besides the acceptor).
        idle_timeout: seconds a connection may stay silent before it is closed.
        deadline: seconds to read one request head, in all.
        max_connections: most connections waiting for their request at once.
        backlog: the listen backlog.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 workers: int = 4, idle_timeout: float = 5.0, deadline: float = 10.0,
                 max_connections: int = 256, backlog: int = 128) -> None:
        self.registry = registry
        self.idle_timeout = idle_timeout
        self.deadline = deadline
        self.max_connections = max_connections
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
        self._waiting: dict[socket.socket, float] = {}  # insertion order = age
        self._jobs: queue.Queue[socket.socket | None] = queue.Queue(maxsize=workers)
        self._stop = threading.Event()
        self.refused_busy = 0  # answered 503: every worker busy
        self.closed_idle = 0  # closed before sending a request
        self._threads = [threading.Thread(target=self._accept_loop, name="metrics-http",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"metrics-http-{i}",
                                           daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop serving; close every connection and join every thread. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(b"x")
        self._threads[0].join()
        for _ in self._threads[1:]:
            self._jobs.put(None)
        for t in self._threads[1:]:
            t.join()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the acceptor -----------------------------------------------------------

    def _accept_loop(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(timeout=self._next_expiry()):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is not self._wake_r:
                        assert isinstance(sock, socket.socket)
                        self._sel.unregister(sock)
                        del self._waiting[sock]
                        self._dispatch(sock)
                self._expire()
        finally:
            for sock in list(self._waiting):
                self._sel.unregister(sock)
                sock.close()
            self._waiting.clear()

    def _next_expiry(self) -> float:
        if not self._waiting:
            return 1.0
        oldest = next(iter(self._waiting.values()))
        return max(0.0, oldest + self.idle_timeout - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: drop this round, keep serving
                log.warning("metrics: accept failed: %s", exc)
                return
            conn.setblocking(False)
            if len(self._waiting) >= self.max_connections:
                oldest = next(iter(self._waiting))
                self._drop(oldest)
            self._waiting[conn] = time.monotonic()
            self._sel.register(conn, selectors.EVENT_READ)

    def _expire(self) -> None:
        limit = time.monotonic() - self.idle_timeout
        for sock, since in list(self._waiting.items()):
            if since > limit:
                break  # in order of age
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._sel.unregister(sock)
        del self._waiting[sock]
        self.closed_idle += 1  # counted first: the peer sees the close at once
        sock.close()

    def _dispatch(self, sock: socket.socket) -> None:
        try:
            self._jobs.put_nowait(sock)
        except queue.Full:
            self.refused_busy += 1
            _reply(sock, 503, b"busy: try again\n", "text/plain", time.monotonic() + 1.0)
            sock.close()

    # -- the workers ------------------------------------------------------------

    def _work(self) -> None:
        while (sock := self._jobs.get()) is not None:
            try:
                self._answer(sock)
            except Exception as exc:  # one bad client costs its own connection only
                log.debug("metrics: request failed: %s", exc)
            finally:
                sock.close()

    def _answer(self, sock: socket.socket) -> None:
        until = time.monotonic() + self.deadline
        head = _read_head(sock, until)
        if head is None:
            return
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            _reply(sock, 400, b"bad request\n", "text/plain", until)
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            _reply(sock, 405, b"GET only\n", "text/plain", until)
        elif target not in (b"/metrics", b"/"):
            _reply(sock, 404, b"not found: try /metrics\n", "text/plain", until)
        else:
            body = generate_latest(self.registry)
            _reply(sock, 200, body, CONTENT_TYPE_LATEST, until, head_only=method == b"HEAD")


def _read_head(sock: socket.socket, until: float) -> bytes | None:
    """The request head (up to the blank line), or None past the deadline or the size bound."""
    buf = b""
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        left = until - time.monotonic()
        if left <= 0 or len(buf) > _MAX_HEAD:
            return None
        sock.settimeout(left)
        try:
            got = sock.recv(4096)
        except (TimeoutError, OSError):
            return None
        if not got:
            return buf or None
        buf += got
    return buf


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            503: "Service Unavailable"}


def _reply(sock: socket.socket, status: int, body: bytes, content_type: str, until: float,
           *, head_only: bool = False) -> None:
    head = (f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock.settimeout(max(0.01, until - time.monotonic()))
    try:
        sock.sendall(head if head_only else head + body)
    except OSError:
        pass  # the client left, or stopped reading past the deadline
