"""The rpc channel's ends.

* :class:`RpcServer`: the scheduler's end, an inbox that replies to the
  peer that asked (ROUTER) — never to one named in the payload;
* :class:`RpcClient`: calls matched to replies by rid, as many in flight at
  once as callers make (threads blocking in ``call``, or an event loop);
* :class:`RpcCaller`: many calls in flight at once, replies drained like any
  inbox, matched to calls by rid by the caller (a dispatcher asking every
  replica at once, with heartbeats beside). Sending never blocks.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar, cast

import zmq

from bus.channels import ZmqInbox, _ZmqEnd
from bus.envelope import Origin
from bus.errors import ChannelClosed, PeerGone, RpcTimeout
from bus.fdwait import wait_readable
from bus.sockets import SocketOptions, make_socket
from messages import (
    RPC,
    Codec,
    DecodeError,
    Frame,
    Message,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
    Scalar,
    fit_text,
)

__all__ = ["RpcCall", "RpcCaller", "RpcClient", "RpcServer"]

log = logging.getLogger("bus.rpc")

M = TypeVar("M", bound=Message)

_DEFAULT_OPTIONS = SocketOptions()
#: Seconds between two warnings about undecodable replies (a flood logs a count).
_LOG_EVERY = 1.0
#: Seconds between two tries to send a call no server takes yet (not connected).
_SEND_RETRY_S = 0.005
#: Longest park of a blocking call between two looks at ``alive()``.
_ALIVE_CHECK_S = 0.1
#: Longest wait of a blocking call that does not hold the reading role before it
#: looks whether the role is free (the reader that held it may have been answered).
_FOLLOWER_S = 0.005


class RpcCall:
    """One call in flight on an :class:`RpcClient`: its rid, its encoded request, and
    what its reply (or the error that ends it) is handed to."""

    __slots__ = ("frames", "method", "on_reply", "rid", "sent")

    def __init__(self, rid: str, method: str, frames: list[Frame],
                 on_reply: Callable[[RpcReqOutput | Exception], None]) -> None:
        self.rid = rid
        self.method = method
        self.frames = frames
        self.on_reply = on_reply
        self.sent = False


class RpcClient(_ZmqEnd):
    """The caller's end of an rpc channel (a DEALER that connects); many calls at once.

    Calls in flight are a map of rid to :class:`RpcCall`; whoever drains the
    socket (:meth:`read_replies`) hands each reply to the call with its rid.
    :meth:`call` blocks one thread; :meth:`start`, :meth:`try_send` and
    :meth:`read_replies` are the non-blocking pieces an event loop uses,
    reading when :meth:`fileno` is readable. No lock is held for a call,
    only for each socket operation: calls from several threads and from an
    event loop are in flight together, and a slow one delays none of the
    others.

    After a timeout the client stays usable: a late reply to the abandoned
    call is discarded (and counted in ``discarded``), never returned to a
    later call. An undecodable reply is never dropped silently: if it names
    a waiting call's rid that call fails with :class:`~messages.DecodeError`
    at once; otherwise it is counted in ``discarded`` and logged (at most one
    warning a second, with a count).
    """

    _ids = itertools.count()

    def __init__(self, endpoint: str, *, name: str = "rpc",
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: SocketOptions = _DEFAULT_OPTIONS) -> None:
        sock = make_socket(ctx if ctx is not None else zmq.Context.instance(), zmq.DEALER,
                           endpoint, bind=False, options=options, sending=True)
        super().__init__(sock, name)
        self.endpoint = endpoint
        # The rpc channel's doors (messages.channels), both directions.
        self._send_codec: Codec[Request] = RPC.inbound_codec()
        self._reply_codec: Codec[Output] = RPC.outbound_codec()
        self._lock = threading.Lock()  # one socket operation at a time (never a whole call)
        self._reading = threading.Lock()  # the blocking caller that waits on the socket
        self._calls: dict[str, RpcCall] = {}
        self._fd = int(sock.get(zmq.FD))
        self._prefix = f"rpc-{os.getpid()}-{next(self._ids)}-"
        self._seq = itertools.count()
        self.discarded = 0
        self._undecodable_unlogged = 0
        self._undecodable_logged_at = float("-inf")

    @property
    def in_flight(self) -> int:
        """Calls started and not yet answered, failed or forgotten."""
        return len(self._calls)

    def fileno(self) -> int:
        """An fd readable when replies may wait (zmq's, edge-triggered: a reader drains
        with :meth:`read_replies`, which reads until none is left)."""
        return self._fd

    def start(self, method: str, on_reply: Callable[[RpcReqOutput | Exception], None],
              /, **params: Scalar) -> RpcCall:
        """Register a call of ``method(**params)``; send it with :meth:`try_send`.

        ``on_reply`` gets the reply, or the error that ends the call
        (:class:`~messages.DecodeError`, or what :meth:`fail_all` is given),
        once, on the thread that read it.

        Raises:
            ChannelClosed: the client is closed.
            EncodeError: a parameter is not a plain scalar.
        """
        if self._closed:
            raise ChannelClosed(self._name, "call on a closed rpc client")
        rid = f"{self._prefix}{next(self._seq)}"
        frames = self._send_codec.encode(
            RpcReqInput(rid=rid, method=method, parameters=dict(params)))
        call = RpcCall(rid, method, frames, on_reply)
        with self._lock:
            self._calls[rid] = call
        return call

    def try_send(self, call: RpcCall) -> bool:
        """Send ``call`` if the socket takes it now (False: no server connected yet,
        or its queue is full; try again later). Never blocks.

        Raises:
            PeerGone: the socket failed.
            ChannelClosed: the client is closed.
        """
        done: list[tuple[RpcCall, RpcReqOutput | Exception]] = []
        with self._lock:
            if self._closed:
                raise ChannelClosed(self._name, "call on a closed rpc client")
            try:
                self.socket.send_multipart(call.frames, flags=zmq.NOBLOCK, copy=False)
                call.sent = True
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                raise PeerGone(f"{self._name} ({self.endpoint})", str(exc)) from exc
            # Any socket operation can take the fd's edge: read what it announced.
            self._drain(done)
        _hand_over(done)
        return call.sent

    def forget(self, call: RpcCall) -> None:
        """Stop waiting for ``call`` (answered, timed out, or its caller left): a reply
        that comes later is discarded."""
        self._calls.pop(call.rid, None)

    def fail_all(self, error: Exception) -> None:
        """End every call in flight with ``error`` (the server is gone: none will be
        answered)."""
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
        _hand_over([(c, error) for c in calls])

    def read_replies(self) -> int:
        """Hand every reply waiting now to its call; returns how many were read. Never
        blocks."""
        done: list[tuple[RpcCall, RpcReqOutput | Exception]] = []
        with self._lock:
            if self._closed:
                return 0
            n = self._drain(done)
        _hand_over(done)
        return n

    def _drain(self, done: list[tuple[RpcCall, RpcReqOutput | Exception]]) -> int:
        """Read replies until zmq says none is left (under ``_lock``); each answered
        call goes into ``done``, to be handed its reply once the lock is released."""
        sock, n = self.socket, 0
        while cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            received = sock.recv_multipart(copy=True)
            n += 1
            try:
                reply = self._reply_codec.decode(received)
            except DecodeError as exc:
                owner = self._calls.pop(exc.rid, None) if exc.rid is not None else None
                if owner is not None:  # its answer, unreadable: waiting longer cannot help
                    done.append((owner, exc))
                else:
                    self._discard_undecodable(exc)
                continue
            call = None
            if isinstance(reply, RpcReqOutput):
                call = self._calls.pop(reply.rid, None)
            if call is None:
                self.discarded += 1  # a late reply to an abandoned call
                continue
            done.append((call, cast(RpcReqOutput, reply)))
        return n

    def call(self, method: str, *, timeout: float = 30.0,
             alive: Callable[[], bool] | None = None, **params: Scalar) -> RpcReqOutput:
        """Call ``method(**params)`` and return its reply (blocks this thread only).

        ``alive``, when given, is checked a few times a second while waiting:
        once it says the server is gone, the call fails at once instead of
        waiting out ``timeout``.

        Raises:
            RpcTimeout: no reply within ``timeout`` seconds (names endpoint,
                method and rid).
            PeerGone: ``alive()`` turned false while waiting (or :meth:`fail_all`).
            ChannelClosed: the client is closed.
            EncodeError: a parameter is not a plain scalar.
            DecodeError: the reply to this call arrived but cannot be decoded
                (``.rid`` is this call's rid); raised as soon as it arrives.
        """
        answered = threading.Event()
        got: list[RpcReqOutput | Exception] = []

        def on_reply(reply: RpcReqOutput | Exception) -> None:
            got.append(reply)
            answered.set()

        call = self.start(method, on_reply, **params)
        deadline = time.monotonic() + timeout
        where = f"{self._name} ({self.endpoint})"
        try:
            # The whole call, sending included, keeps to ``timeout``: a DEALER
            # with no usable peer (not connected yet, or refused by CURVE)
            # takes nothing until one is.
            while not got:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RpcTimeout(where, method, call.rid, timeout)
                if alive is not None and not alive():
                    raise PeerGone(where, f"the server is gone; rpc {method!r} "
                                          f"(rid={call.rid!r}) will not be answered")
                if not call.sent and not self.try_send(call):
                    answered.wait(min(left, _SEND_RETRY_S))
                    continue
                self._wait(answered, min(left, _ALIVE_CHECK_S))
        finally:
            self.forget(call)
        reply = got[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _wait(self, answered: threading.Event, seconds: float) -> None:
        """Wait up to ``seconds`` for ``answered``: the one caller holding the reading
        role parks on the socket's fd and hands out what arrives; the others wait on
        their own event (woken by it), taking the role in turn when it is free."""
        if not self._reading.acquire(blocking=False):
            answered.wait(min(seconds, _FOLLOWER_S))
            return
        try:
            if not answered.is_set():
                self.read_replies()  # what arrived before we parked (the fd's edge is gone)
                if not answered.is_set():
                    try:
                        wait_readable([self._fd], seconds)
                    except (OSError, ValueError):  # closed under us: close() failed the call
                        return
                    self.read_replies()
        finally:
            self._reading.release()

    def _discard_undecodable(self, exc: DecodeError) -> None:
        """Count an undecodable reply no call waits for; warn, at most once a second."""
        self.discarded += 1
        self._undecodable_unlogged += 1
        now = time.monotonic()
        if now - self._undecodable_logged_at < _LOG_EVERY:
            return  # a flood of bad replies must not become a flood of log lines
        log.warning("%s (%s): discarded %d undecodable rpc repl%s since the last warning; "
                    "latest: %s", self._name, self.endpoint, self._undecodable_unlogged,
                    "y" if self._undecodable_unlogged == 1 else "ies",
                    fit_text(str(exc), 1000))
        self._undecodable_logged_at = now
        self._undecodable_unlogged = 0

    def close(self) -> None:
        """Close the socket (idempotent); calls still in flight fail with ChannelClosed."""
        with self._lock:
            super().close()
        self.fail_all(ChannelClosed(self._name, "the rpc client closed before the reply"))


def _hand_over(done: list[tuple[RpcCall, RpcReqOutput | Exception]]) -> None:
    for call, reply in done:
        call.on_reply(reply)


class RpcServer(ZmqInbox[M]):
    """The scheduler's rpc end: an inbox that can also reply to an origin.

    ``kind="router"`` (the default) serves any number of clients, each reply
    going to the identity that asked (the identity zmq attached on receipt,
    never one read from the payload). ``kind="dealer"`` is only right where
    exactly one client can ever connect: a DEALER round-robins its sends over
    every connected peer, so with two clients each would get half of the
    other's replies.
    """

    def __init__(self, codec: Codec[M], endpoint: str, *, name: str = "rpc",
                 kind: Literal["dealer", "router"] = "router", bind: bool = True,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: SocketOptions = _DEFAULT_OPTIONS) -> None:
        stype = zmq.ROUTER if kind == "router" else zmq.DEALER
        sock = make_socket(ctx if ctx is not None else zmq.Context.instance(), stype, endpoint,
                           bind=bind, options=options,
                           sending=True)
        super().__init__(sock, codec, name, routed=kind == "router")
        self.kind = kind
        self.endpoint = endpoint

    def reply(self, frames: Sequence[Frame], origin: Origin, *, block: bool = True) -> None:
        """Send encoded reply ``frames`` back to ``origin``.

        With ``block=False`` a client that is not reading raises at once
        instead of after the send timeout.

        Raises:
            ValueError: ``origin`` did not come from this server.
            PeerGone: a ROUTER peer that asked is gone.
            WouldBlock: the client is not reading.
        """
        if origin.inbox != self._name:
            raise ValueError(f"origin {origin.inbox!r} is not rpc server {self._name!r}")
        if self._routed:
            if origin.identity is None:
                raise ValueError(f"rpc server {self._name!r} is a ROUTER: the origin "
                                 "carries no peer identity")
            self._send([origin.identity, *frames], block=block)
        else:
            self._send(frames, block=block)


class RpcCaller(ZmqInbox[Message]):
    """A DEALER that connects to an rpc server: send calls, drain replies.

    Replies decode as :class:`~messages.RpcReqOutput` (anything else is
    :class:`~bus.Rejected`, as on every inbox). Sending never blocks: a
    server that is gone or not reading raises :class:`~bus.WouldBlock`.
    """

    def __init__(self, endpoint: str, *, name: str = "rpc-caller",
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: SocketOptions = _DEFAULT_OPTIONS) -> None:
        sock = make_socket(ctx if ctx is not None else zmq.Context.instance(), zmq.DEALER,
                           endpoint, bind=False, options=options, sending=True)
        super().__init__(sock, RPC.outbound_codec(), name, routed=False)  # type: ignore[arg-type]
        self.endpoint = endpoint
        self._send_codec: Codec[Request] = RPC.inbound_codec()

    def send_nowait(self, call: RpcReqInput, /) -> None:
        """Send ``call`` if the server can take it now; never blocks.

        Raises:
            WouldBlock: the server is not connected or not reading.
            EncodeError: a parameter cannot be encoded.
            ChannelClosed: this caller is closed.
        """
        self._send(self._send_codec.encode(call), block=False)

    def close(self, linger_ms: int = 0) -> None:
        """Close, dropping calls not yet sent (a dead server would hold them). Idempotent."""
        if not self._closed:
            self.socket.setsockopt(zmq.LINGER, linger_ms)
        super().close()
