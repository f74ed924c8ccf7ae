"""The scheduler's rpc endpoint where an operator can reach it: ``--endpoint DIR``.

The engine's own endpoints live in a private temporary directory. The door
binds a ROUTER where the operator was told to look (``ipc://DIR/rpc``, as
``python -m scheduler serve --endpoint DIR`` does, or a ``tcp://`` endpoint
with CURVE) and forwards each call, as it came, to the scheduler's rpc
endpoint, many calls in flight at once (calls of a :class:`~bus.RpcClient`,
under its rids); each reply goes back to the peer that asked (by identity,
never by payload) under the rid it gave. A thread of its own waits on both
sockets, so a call is answered however busy the event loop is, and the
scheduler sees it on its rpc channel, as any other caller's. A reply that
cannot be decoded fails its call at once.

Once the engine reports the scheduler gone (``gone``, asked before each
call is forwarded and every 0.2 s while calls wait), each call after it is
answered at once, and each call still waiting within half a second (a reply
the scheduler sent before it died gets 0.1 s to arrive), with ``success=False``
and a message that says the scheduler is gone and why: none waits out its
caller's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from bus import (
    ChannelError,
    CurveAuthenticator,
    Envelope,
    LogSummary,
    Origin,
    PeerGone,
    RpcClient,
    RpcServer,
    SocketOptions,
)
from messages import RPC, Request, RpcReqInput, RpcReqOutput, fit_text

__all__ = ["RpcDoor"]

log = logging.getLogger("frontend.rpc")

#: Calls forwarded and not yet answered, at most (past it a call fails at once).
MAX_IN_FLIGHT = 1024
#: Seconds between two looks at whether the scheduler is gone, while calls wait for it.
GONE_CHECK_S = 0.2
#: Seconds a reply the scheduler sent before it died gets to arrive, before the calls
#: still waiting are answered with a failure.
REPLY_GRACE_S = 0.1


class RpcDoor:
    """Forwards rpc calls from ``endpoint`` to the scheduler's ``upstream``; a context manager.

    ``gone`` tells why the scheduler is gone, or None while it runs (the
    engine's :attr:`~scheduler.AsyncEngine.gone`).

    Raises (at construction):
        EndpointInUse: a live listener already serves ``endpoint``.
        ValueError: ``endpoint`` is not loopback and ``options`` does not allow remote.
    """

    def __init__(self, endpoint: str, upstream: str, *, gone: Callable[[], str | None],
                 options: SocketOptions | None = None,
                 curve_clients: Sequence[bytes] | None = None) -> None:
        self.endpoint = endpoint
        self._gone = gone
        self._why_gone: str | None = None  # once seen, for good: a scheduler does not return
        self._gone_since = 0.0
        self._auth: CurveAuthenticator | None = None
        if curve_clients is not None:
            self._auth = CurveAuthenticator(zmq.Context.instance(), curve_clients)
        self._server: RpcServer[Request] = RpcServer(RPC.inbound_codec(), endpoint,
                                                     name="door",
                                                     options=options or SocketOptions())
        # (Calls not sent when it closes are dropped: a dead scheduler would hold them.)
        self._client = RpcClient(upstream, name="upstream", options=SocketOptions(linger_ms=0))
        self._codec = RPC.outbound_codec()
        self._stop = threading.Event()
        self._rejected = LogSummary(log, "rpc door: rejected frames")
        # (Counted apart: a caller that stops reading is not a sender of bad frames.)
        self._undelivered = LogSummary(log, "rpc door: replies not delivered (the caller "
                                            "left or stopped reading)")
        self._thread = threading.Thread(target=self._run, name="rpc-door", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._server.pollable(), zmq.POLLIN)
        poller.register(self._client.fileno(), zmq.POLLIN)
        try:
            while not self._stop.is_set():
                poller.poll(int(GONE_CHECK_S * 1000))
                for env in self._server.drain(MAX_IN_FLIGHT):
                    if isinstance(env, Envelope):
                        assert isinstance(env.message, RpcReqInput)  # (all the codec reads)
                        self._forward(env.message, env.origin)
                        continue
                    self._rejected.add("door", env.error.reason)
                    if env.error.rid is not None:
                        # answered, as the scheduler answers it (an invalid method name)
                        self._fail(env.error.rid, env.origin, str(env.error))
                self._client.read_replies()
                self._fail_waiting()
        finally:
            self._client.close()  # (a call still waiting is answered that the door closed)
            self._server.close()  # (its socket file too: bus.sockets.close_socket)
            if self._auth is not None:
                self._auth.stop()
            self._rejected.flush()  # a burst's tail, logged as the door closes (else at exit)
            self._undelivered.flush()

    def _scheduler_gone(self) -> str | None:
        """Why the scheduler is gone (asked of the engine until it is), or None."""
        if self._why_gone is None:
            self._why_gone = self._gone()
            self._gone_since = time.monotonic()  # (the look that first saw it gone stays)
        return self._why_gone

    def _fail_waiting(self) -> None:
        """Answer every call still waiting, once the scheduler is gone and a reply it sent
        before it died had ``REPLY_GRACE_S`` to arrive."""
        if not self._client.in_flight or self._scheduler_gone() is None:
            return
        if time.monotonic() - self._gone_since < REPLY_GRACE_S:
            return
        self._client.fail_all(PeerGone("upstream", f"the scheduler is gone, so this call "
                                                   f"will not be answered: {self._why_gone}"))

    def _forward(self, call: RpcReqInput, origin: Origin) -> None:
        why = self._scheduler_gone()
        if why is not None:
            self._fail(call.rid, origin, f"the scheduler is gone, so rpc {call.method!r} was "
                                         f"not forwarded: {why}")
            return
        if self._client.in_flight >= MAX_IN_FLIGHT:
            self._fail(call.rid, origin, f"rpc door: {MAX_IN_FLIGHT} calls already wait for "
                                         "the scheduler; retry later")
            return

        def answer(reply: RpcReqOutput | Exception) -> None:
            if isinstance(reply, Exception):  # (its reply undecodable, or no reply will come)
                self._fail(call.rid, origin, str(reply))
                return
            self._reply(RpcReqOutput(rid=call.rid, success=reply.success,
                                     message=reply.message, result=reply.result), origin)

        forwarded = self._client.start(call.method, answer, **call.parameters)
        try:
            if self._client.try_send(forwarded):
                return
            why = "it takes no call now (not connected, or its queue is full)"
        except ChannelError as exc:
            why = str(exc)
        self._client.forget(forwarded)
        self._fail(call.rid, origin, f"the scheduler is not reachable: {why}")

    def _fail(self, rid: str, origin: Origin, why: str) -> None:
        """Answer call ``rid`` of ``origin`` with a failure saying ``why`` (bounded as a
        message field must be)."""
        self._reply(RpcReqOutput(rid=rid, success=False, message=fit_text(why)), origin)

    def _reply(self, reply: RpcReqOutput, origin: Origin) -> None:
        try:
            self._server.reply(self._codec.encode(reply), origin, block=False)
        except ChannelError as exc:  # the caller left or stopped reading: its loss only
            self._undelivered.add("door", f"reply {reply.rid!r}: {exc}")

    @property
    def in_flight(self) -> int:
        """Calls forwarded to the scheduler and not yet answered."""
        return self._client.in_flight

    def close(self) -> None:
        """Stop forwarding and close both sockets (idempotent); an ipc endpoint's socket
        file is removed."""
        self._stop.set()
        self._thread.join(5.0)

    def __enter__(self) -> RpcDoor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
