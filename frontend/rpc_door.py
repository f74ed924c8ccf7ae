"""The scheduler's rpc endpoint where an operator can reach it: ``--endpoint DIR``.

The engine's own endpoints live in a private temporary directory. The door
binds a ROUTER where the operator was told to look (``ipc://DIR/rpc``, as
``python -m scheduler serve --endpoint DIR`` does, or a ``tcp://`` endpoint
with CURVE) and forwards each call, as it came, to the scheduler's rpc
endpoint, many calls in flight at once; each reply goes back to the peer
that asked (by identity, never by payload). A thread of its own waits on
both sockets (one :class:`~bus.Receiver`), so a call is answered however busy
the event loop is, and the scheduler sees it on its rpc channel, as any
other caller's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

import zmq

from bus import (
    ChannelError,
    CurveAuthenticator,
    Envelope,
    LogSummary,
    Origin,
    Receiver,
    RpcCaller,
    RpcServer,
    SocketOptions,
)
from bus.channels import Inbox
from messages import Codec, Message, Request, RpcReqInput, RpcReqOutput, fit_text

__all__ = ["RpcDoor"]

log = logging.getLogger("frontend.rpc")

#: Calls forwarded and not yet answered, at most (past it a call fails at once).
MAX_IN_FLIGHT = 1024


class RpcDoor:
    """Forwards rpc calls from ``endpoint`` to the scheduler's ``upstream``; a context manager.

    Raises (at construction):
        EndpointInUse: a live listener already serves ``endpoint``.
        ValueError: ``endpoint`` is not loopback and ``options`` does not allow remote.
    """

    def __init__(self, endpoint: str, upstream: str, *,
                 options: SocketOptions | None = None,
                 curve_clients: Sequence[bytes] | None = None) -> None:
        self.endpoint = endpoint
        self._auth = CurveAuthenticator(zmq.Context.instance(), curve_clients) \
            if curve_clients is not None else None
        self._server: RpcServer[Request] = RpcServer(Codec(Request, types=[RpcReqInput]),
                                                     endpoint, name="door",
                                                     options=options or SocketOptions())
        self._caller = RpcCaller(upstream, name="upstream")
        self._codec: Codec[Message] = Codec(Message, types=[RpcReqOutput])
        self._waiting: dict[str, tuple[Origin, str]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._rejected = LogSummary(log, "rpc door: rejected frames")
        inboxes: list[Inbox[Message]] = [self._server, self._caller]
        self._receiver: Receiver[Message] = Receiver(inboxes)
        self._thread = threading.Thread(target=self._run, name="rpc-door", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._receiver.wait(0.2)
                for env in self._receiver.poll():
                    if not isinstance(env, Envelope):
                        self._rejected.add(env.origin.inbox, env.error.reason)
                        if env.error.rid is not None and env.origin.inbox == "door":
                            # answered, as the scheduler answers it (an invalid method name)
                            self._reply(RpcReqOutput(rid=env.error.rid, success=False,
                                                     message=fit_text(str(env.error))),
                                        env.origin)
                    elif isinstance(env.message, RpcReqInput):
                        self._forward(env.message, env.origin)
                    elif isinstance(env.message, RpcReqOutput):
                        self._answer(env.message)
        finally:
            self._server.close()
            self._caller.close()
            if self._auth is not None:
                self._auth.stop()

    def _forward(self, call: RpcReqInput, origin: Origin) -> None:
        if len(self._waiting) >= MAX_IN_FLIGHT:
            self._reply(RpcReqOutput(rid=call.rid, success=False,
                                     message=f"rpc door: {MAX_IN_FLIGHT} calls already wait "
                                             "for the scheduler; retry later"), origin)
            return
        rid = f"door-{next(self._ids)}"
        try:
            self._caller.send_nowait(RpcReqInput(rid=rid, method=call.method,
                                                 parameters=call.parameters))
        except ChannelError as exc:
            self._reply(RpcReqOutput(rid=call.rid, success=False,
                                     message=f"the scheduler is not reachable: {exc}"), origin)
            return
        self._waiting[rid] = (origin, call.rid)

    def _answer(self, reply: RpcReqOutput) -> None:
        waiting = self._waiting.pop(reply.rid, None)
        if waiting is None:
            return  # not ours (cannot happen: the caller's socket is private)
        origin, rid = waiting
        self._reply(RpcReqOutput(rid=rid, success=reply.success, message=reply.message,
                                 result=reply.result), origin)

    def _reply(self, reply: RpcReqOutput, origin: Origin) -> None:
        try:
            self._server.reply(self._codec.encode(reply), origin, block=False)
        except ChannelError as exc:  # the caller left or stopped reading: its loss only
            self._rejected.add("door", f"reply to a peer that is gone: {exc}")

    def close(self) -> None:
        """Stop forwarding and close both sockets (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def __enter__(self) -> RpcDoor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
