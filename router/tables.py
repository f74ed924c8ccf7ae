"""The ready-made routing table of a scheduler: rpc replies to rpc, hand-offs to their
sink (a dispatcher's: on to a decode replica; a scheduler's: out), everything else out."""

from __future__ import annotations

from collections.abc import Callable

from messages import KVHandoff, Output, RpcReqOutput
from router.router import Router, Sink, SinkFailure

__all__ = ["scheduler_router"]


def scheduler_router(
    transport: Sink[Output],
    rpc: Sink[RpcReqOutput],
    *,
    on_failure: Callable[[SinkFailure], None] | None = None,
    max_backlog: int = 1024,
    handoff: Sink[KVHandoff] | None = None,
) -> Router[Output]:
    """A frozen router for either mode: ``RpcReqOutput -> rpc``, ``KVHandoff -> handoff``
    (default: the transport), any other ``Output -> transport``.

    The transport is the mode's (zmq PUSH, or the embedded frontend's egress
    ring); the rpc sink is the same in both modes. Specificity, not order,
    decides: an rpc reply can never reach the transport.
    """
    router: Router[Output] = Router(Output, on_failure=on_failure, max_backlog=max_backlog)
    router.register(Output, transport)
    router.register(RpcReqOutput, rpc)
    router.register(KVHandoff, handoff if handoff is not None else transport)
    router.freeze()
    return router
