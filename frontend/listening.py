"""How ``python -m frontend`` accepts connections: within its open-file limit, never in silence.

Every connection is a file descriptor. Past the process's limit on open
files the kernel refuses ``accept()`` (``EMFILE``), and what a server does
then decides what the client sees: uvloop (libuv) accepts each waiting
connection and closes it at once, without a word; asyncio stops accepting
for a second. With 1,200 concurrent streams under the usual soft limit of
1,024, some 200 connections would be closed with no HTTP answer and no log
line.

``python -m frontend`` raises its soft limit to the hard one at start-up
(:func:`bus.fdlimit.raise_open_files_limit`), and accepts connections
itself (:class:`Acceptor`: a reader on each listening socket; each
connection is handed to uvicorn's protocol with
``loop.connect_accepted_socket``), counting them against a
:class:`ConnectionBudget` computed from that limit once the engine runs:

* below ``budget.serve`` open connections, a new one is served;
* from there up to ``budget.accept``, a new one is accepted and each
  request on it is answered ``503`` in OpenAI's shape
  (``too_many_connections``, ``Retry-After``, ``connection: close``);
* at ``budget.accept``, accepting pauses: new connections wait in the
  listen backlog until open ones close (checked every 20 ms meanwhile);
* an ``accept()`` refused for lack of descriptors all the same (the
  process opened more elsewhere) closes a descriptor held in reserve,
  accepts, answers ``503`` and closes, then takes the reserve back.

Refusals are counted (:attr:`Acceptor.refused`) and logged as periodic
summaries (:class:`bus.LogSummary`), never a line per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Sequence, Sized
from typing import Any

import uvicorn

from bus import LogSummary
from bus.fdlimit import (
    ACCEPT_GONE,
    NO_FILES,
    ConnectionBudget,
    files_in_use,
    open_files_limit,
)
from frontend.asgi import JSON, Receive, Scope, Send, send_bytes
from frontend.errors import ApiError

__all__ = ["Acceptor", "ConnectionBudget", "DoorServer", "files_in_use", "open_listeners"]

log = logging.getLogger("frontend")

#: Connections accepted per readiness of a listening socket: the loop turns between batches.
_BATCH = 64
#: Seconds between checks for room while accepting is paused.
_PAUSE_S = 0.02


def open_listeners(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` names (as ``loop.create_server``
    binds them: ``SO_REUSEADDR``, IPv6 sockets IPv6-only), non-blocking.

    Raises:
        socket.gaierror: ``host`` does not resolve.
        OSError: an address cannot be bound (its ``filename`` is that address).
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:  # which of the host's addresses, for the message
                raise OSError(exc.errno, exc.strerror, address[0]) from exc
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def _refusal(budget: ConnectionBudget) -> ApiError:
    return ApiError(503, f"the server holds as many connections as its open-file limit "
                         f"({budget.files}) allows ({budget.serve} served at once); retry "
                         "later", type="server_overloaded", code="too_many_connections",
                    retry_after=1)


def _answer_now(conn: socket.socket, answer: bytes) -> None:
    """Send ``answer`` on a connection whose request was not read, and close it: what
    the client sent is read first (a close with unread bytes is a reset, which may
    reach the client before the answer does)."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        for _ in range(16):
            if not conn.recv(65536):
                break
    with contextlib.suppress(OSError):
        conn.send(answer)
        conn.shutdown(socket.SHUT_WR)
    conn.close()


class Acceptor:
    """Accepts connections on ``listeners`` within ``budget`` (see the module docstring).

    Args:
        listeners: bound, listening, non-blocking sockets; closed by :meth:`close`.
        make_protocol: a new connection's protocol (uvicorn's, served by the app).
        connections: the connections open now (uvicorn's ``server_state.connections``).
        budget: how many to serve and to accept.
    """

    def __init__(self, listeners: Sequence[socket.socket],
                 make_protocol: Callable[[], asyncio.Protocol], connections: Sized,
                 budget: ConnectionBudget) -> None:
        self.budget = budget
        self.refused = 0  # 503s sent: on a connection past budget.serve, or out of descriptors
        self._listeners = list(listeners)
        self._make = make_protocol
        self._connections = connections
        self._loop = asyncio.get_running_loop()
        self._handing: set[asyncio.Task[None]] = set()  # accepted, not yet made
        self._paused = False
        self._closed = False
        self._reserve: int | None = _reserve()
        self._log = LogSummary(log, "connections answered 503 for lack of file descriptors")
        error = _refusal(budget)
        head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n")
        self._refused_now = head % len(error.body()) + error.body()
        refusal_headers = [*JSON, (b"retry-after", b"1"), (b"connection", b"close")]
        body = error.body()

        async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("type") == "http":
                await send_bytes(send, 503, body, refusal_headers)
                self._refused_past_budget()

        self._refuse_app = refuse
        self._listening()

    def open_connections(self) -> int:
        """Connections open now, those being handed to their protocol included."""
        return len(self._connections) + len(self._handing)

    def close(self) -> None:
        """Stop accepting and close the listening sockets; connections being handed over
        are closed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._paused:
            for sock in self._listeners:
                self._loop.remove_reader(sock.fileno())
        for sock in self._listeners:
            sock.close()
        for task in self._handing:
            task.cancel()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        self._log.flush()

    def _listening(self) -> None:
        self._paused = False
        for sock in self._listeners:
            self._loop.add_reader(sock.fileno(), self._ready, sock)

    def _pause(self, seconds: float) -> None:
        if not self._paused:
            self._paused = True
            for sock in self._listeners:
                self._loop.remove_reader(sock.fileno())
        self._loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        if self._closed:
            return
        if self.open_connections() >= self.budget.accept:
            self._loop.call_later(_PAUSE_S, self._resume)
            return
        if self._reserve is None:
            self._reserve = _reserve()
        self._listening()

    def _ready(self, listener: socket.socket) -> None:
        for _ in range(_BATCH):
            if self.open_connections() >= self.budget.accept:
                self._pause(_PAUSE_S)
                return
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in ACCEPT_GONE:
                    continue
                if exc.errno in NO_FILES and self._answer_on_reserve(listener, exc):
                    continue
                # No reserve to answer with, or an error of the listening socket itself:
                # retried shortly, not in a loop spinning on a readable socket.
                self._pause(0.1)
                return
            self._hand_over(conn)

    def _answer_on_reserve(self, listener: socket.socket, exc: OSError) -> bool:
        """Out of descriptors: answer one waiting connection 503 on the reserve's."""
        if self._reserve is None:
            return False
        os.close(self._reserve)
        self._reserve = None
        try:
            conn, _ = listener.accept()
        except OSError:
            self._reserve = _reserve()
            return False
        _answer_now(conn, self._refused_now)
        self._reserve = _reserve()  # (the descriptor the answered connection gave back)
        self.refused += 1
        self._log.add("out of file descriptors", f"accept() failed ({exc.strerror}) with "
                      f"{self.open_connections()} connections open; limit {self.budget.files}")
        return self._reserve is not None

    def _hand_over(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        make = self._make
        if self.open_connections() >= self.budget.serve:
            make = self._refusing  # (counted when it answers a request: one may never come)
        task = self._loop.create_task(self._connect(conn, make))
        self._handing.add(task)
        task.add_done_callback(self._handing.discard)

    def _refused_past_budget(self) -> None:
        """Count a 503 sent on a connection accepted past ``budget.serve``."""
        self.refused += 1
        self._log.add("past the connection budget", f"{self.open_connections()} "
                      f"connections open, {self.budget.serve} served under the open-file "
                      f"limit of {self.budget.files}")

    def _refusing(self) -> asyncio.Protocol:
        protocol: Any = self._make()
        protocol.app = self._refuse_app  # every request on it (uvicorn's protocols read .app)
        return protocol  # type: ignore[no-any-return]

    async def _connect(self, conn: socket.socket, make: Callable[[], asyncio.Protocol]) -> None:
        try:
            await self._loop.connect_accepted_socket(make, conn)
        except Exception as exc:  # (its transport not made: the socket is still ours)
            _answer_now(conn, self._refused_now)
            self.refused += 1
            self._log.add("not handed over", f"{type(exc).__name__}: {exc}")
        except BaseException:
            conn.close()
            raise


def _reserve() -> int | None:
    """A descriptor held so that one more connection can be answered when none is left."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class DoorServer(uvicorn.Server):
    """uvicorn's server, accepting through an :class:`Acceptor` on ``host:port``.

    The listening sockets are bound once the app's lifespan has started (as
    uvicorn binds them), the budget computed then from the open-file limit
    and the descriptors the started engine holds.
    """

    def __init__(self, config: uvicorn.Config, host: str, port: int) -> None:
        super().__init__(config)
        self.acceptor: Acceptor | None = None
        self._where = (host, port)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # (the app's lifespan; no listener of uvicorn's)
        if not self.started or self.should_exit:
            return
        host, port = self._where
        try:
            listeners = open_listeners(host, port, self.config.backlog)
        except OSError as exc:
            logging.getLogger("uvicorn.error").error(exc)
            await self.lifespan.shutdown()
            raise SystemExit(3) from exc  # (uvicorn's STARTUP_FAILURE)
        config = self.config

        def make() -> asyncio.Protocol:
            protocol: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state)
            return protocol

        budget = ConnectionBudget.for_limit(open_files_limit(), files_in_use())
        self.acceptor = Acceptor(listeners, make, self.server_state.connections, budget)
        bound = listeners[0].getsockname()
        where = f"[{host}]" if ":" in host else host
        logging.getLogger("uvicorn.error").info(
            "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", where, bound[1])
        log.info("serving up to %d connections at once (open-file limit %d; up to %d more "
                 "are answered 503)", budget.serve, budget.files, budget.accept - budget.serve)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
        await super().shutdown(sockets=sockets)
