"""The standard sinks: rpc reply, zmq transport, ring egress, callback.

Every standard sink sends without blocking: a consumer that is not reading
raises :class:`~bus.WouldBlock`, and the router keeps the output in its
backlog (:mod:`router.backlog`) instead of stalling the scheduler loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from bus import Origin, PushOutbox, Ring, RpcServer
from messages import Codec, Message, Output, Request, RpcReqOutput
from router.errors import RoutingError

__all__ = ["CallbackSink", "RingSink", "RpcReplySink", "TransportSink"]

O = TypeVar("O", bound=Output)  # noqa: E741


class RpcReplySink:
    """Sends an :class:`~messages.RpcReqOutput` back down the rpc channel it came from.

    The origin names the rpc server (and, for ROUTER, the peer identity); an
    origin from any other inbox is an error, never a guess.
    """

    def __init__(self, servers: Iterable[RpcServer[Request]] | RpcServer[Request]) -> None:
        group = [servers] if isinstance(servers, RpcServer) else list(servers)
        self._servers = {s.name: s for s in group}
        self._codec: Codec[Message] = Codec(Message, types=[RpcReqOutput])

    def send(self, output: RpcReqOutput, origin: Origin, /) -> None:
        server = self._servers.get(origin.inbox)
        if server is None:
            raise RoutingError(
                f"RpcReqOutput rid={output.rid!r} answers a request from inbox "
                f"{origin.inbox!r}, which is not an rpc channel "
                f"(rpc channels: {sorted(self._servers)})")
        server.reply(self._codec.encode(output), origin, block=False)


class TransportSink(Generic[O]):
    """Sends outputs over a bus outbox (zmq PUSH to the detokenizer, typically)."""

    def __init__(self, outbox: PushOutbox[O]) -> None:
        self.outbox = outbox

    def send(self, output: O, origin: Origin, /) -> None:
        self.outbox.send_nowait(output)

    def send_many(self, outputs: Sequence[O], origin: Origin, /) -> int:
        """Send ``outputs`` as bursts; returns how many the consumer took now."""
        return self.outbox.send_many_nowait(outputs)


class RingSink(Generic[O]):
    """Puts outputs on the egress ring of an embedded frontend (by reference)."""

    def __init__(self, ring: Ring[O]) -> None:
        self.ring = ring

    def send(self, output: O, origin: Origin, /) -> None:
        self.ring.put_nowait(output)


class CallbackSink(Generic[O]):
    """Calls ``fn(output, origin)``: for tests, metrics, or a custom transport."""

    def __init__(self, fn: Callable[[O, Origin], None]) -> None:
        self.fn = fn

    def send(self, output: O, origin: Origin, /) -> None:
        self.fn(output, origin)
