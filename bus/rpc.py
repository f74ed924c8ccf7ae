"""The rpc channel's ends.

* :class:`RpcServer`: the scheduler's end, an inbox that replies to the
  peer that asked (ROUTER) — never to one named in the payload;
* :class:`RpcClient`: call a method and wait for the reply (a frontend);
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
from typing import Literal, TypeVar

import zmq

from bus.channels import ZmqInbox, _ZmqEnd
from bus.envelope import Origin
from bus.errors import ChannelClosed, PeerGone, RpcTimeout
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

__all__ = ["RpcCaller", "RpcClient", "RpcServer"]

log = logging.getLogger("bus.rpc")

M = TypeVar("M", bound=Message)

_DEFAULT_OPTIONS = SocketOptions()
#: Seconds between two warnings about undecodable replies (a flood logs a count).
_LOG_EVERY = 1.0


class RpcClient(_ZmqEnd):
    """The caller's end of an rpc channel (a DEALER that connects).

    Replies are matched to calls by request id. After a timeout the client
    stays usable: a late reply to the abandoned call is discarded (and
    counted in ``discarded``), never returned to a later call. An undecodable
    reply is never dropped silently: if it names the waiting call's rid the
    call raises :class:`~messages.DecodeError` at once; otherwise it is
    counted in ``discarded`` and logged (at most one warning a second, with
    a count). Calls from several threads are serialized.
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
        self._lock = threading.Lock()
        self._prefix = f"rpc-{os.getpid()}-{next(self._ids)}-"
        self._seq = itertools.count()
        self.discarded = 0
        self._undecodable_unlogged = 0
        self._undecodable_logged_at = float("-inf")

    def call(self, method: str, *, timeout: float = 30.0,
             alive: Callable[[], bool] | None = None, **params: Scalar) -> RpcReqOutput:
        """Call ``method(**params)`` and return its reply.

        ``alive``, when given, is checked a few times a second while waiting:
        once it says the server is gone, the call fails at once instead of
        waiting out ``timeout``.

        Raises:
            RpcTimeout: no reply within ``timeout`` seconds (names endpoint,
                method and rid).
            PeerGone: ``alive()`` turned false while waiting.
            ChannelClosed: the client is closed.
            EncodeError: a parameter is not a plain scalar.
            DecodeError: the reply to this call arrived but cannot be decoded
                (``.rid`` is this call's rid); raised as soon as it arrives.
        """
        with self._lock:
            if self._closed:
                raise ChannelClosed(self._name, "call on a closed rpc client")
            rid = f"{self._prefix}{next(self._seq)}"
            frames = self._send_codec.encode(
                RpcReqInput(rid=rid, method=method, parameters=dict(params)))
            deadline = time.monotonic() + timeout
            # The whole call, sending included, keeps to ``timeout``: a DEALER
            # with no usable peer (not connected yet, or refused by CURVE)
            # would otherwise block for the socket's send timeout.
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self.socket.poll(max(1, int(left * 1000)), zmq.POLLOUT):
                    raise RpcTimeout(f"{self._name} ({self.endpoint})", method, rid, timeout)
                try:  # the peer can vanish between poll and send: never block here
                    self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    continue
                except zmq.ZMQError as exc:
                    raise PeerGone(f"{self._name} ({self.endpoint})", str(exc)) from exc
            slice_ms = 100 if alive is not None else None
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RpcTimeout(f"{self._name} ({self.endpoint})", method, rid, timeout)
                ms = max(1, int(left * 1000))
                if not self.socket.poll(ms if slice_ms is None else min(ms, slice_ms),
                                        zmq.POLLIN):
                    if alive is not None and not alive():
                        raise PeerGone(f"{self._name} ({self.endpoint})",
                                       f"the server is gone; rpc {method!r} (rid={rid!r}) "
                                       "will not be answered")
                    continue
                received = self.socket.recv_multipart()
                try:
                    reply = self._reply_codec.decode(received)
                except DecodeError as exc:
                    if exc.rid == rid:  # our answer, unreadable: waiting longer cannot help
                        raise
                    self._discard_undecodable(exc)
                    continue
                if isinstance(reply, RpcReqOutput) and reply.rid == rid:
                    return reply
                self.discarded += 1  # a late reply to an abandoned call

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
