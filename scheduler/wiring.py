"""How each mode is put together: which inboxes, which sinks. The scheduler never knows.

``ring`` (embedded): work arrives on an in-process ring, outputs leave on an
egress ring; rpc still comes over a zmq DEALER pair (the seed's setup).
``zmq`` (own process): work over PULL, outputs over PUSH, rpc over DEALER.
Both build a :class:`~bus.Receiver` over *all* their inboxes and the same
:func:`~router.scheduler_router` table: adding a mode swaps an inbox and a
sink, it cannot skip the rpc channel or misroute its replies.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Literal

from bus import PullInbox, PushOutbox, Receiver, Ring, RingInbox, RpcServer, SocketOptions
from bus.channels import Inbox
from messages import Codec, Output, Request
from router import RingSink, RpcReplySink, TransportSink, scheduler_router
from scheduler.loop import Scheduler
from scheduler.model import ModelConfig, build_model

__all__ = ["Endpoints", "serve_ring", "serve_zmq"]

log = logging.getLogger("scheduler")
_OPTIONS = SocketOptions()


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a scheduler listens (work, rpc) and where its outputs go (out)."""

    work: str
    rpc: str
    out: str

    @classmethod
    def in_dir(cls, directory: str) -> Endpoints:
        """``ipc://`` endpoints inside ``directory``."""
        return cls(f"ipc://{directory}/work", f"ipc://{directory}/rpc", f"ipc://{directory}/out")


def serve_ring(ingress: Ring[Request], egress: Ring[Output], rpc_endpoint: str,
               model: ModelConfig, *, max_batch: int = 64,
               rpc_kind: Literal["dealer", "router"] = "dealer",
               options: SocketOptions = _OPTIONS,
               ready: threading.Event | None = None) -> Scheduler:
    """Run an embedded scheduler until shut down (call in its own thread)."""
    codec: Codec[Request] = Codec(Request)
    with RpcServer(codec, rpc_endpoint, kind=rpc_kind, options=options) as rpc:
        inboxes: list[Inbox[Request]] = [RingInbox(ingress, name="work"), rpc]
        router = scheduler_router(RingSink(egress), RpcReplySink(rpc))
        sched = Scheduler(Receiver(inboxes), router, build_model(model), max_batch=max_batch)
        if ready is not None:
            ready.set()
        sched.run()
        return sched


def serve_zmq(endpoints: Endpoints, model: ModelConfig, *, max_batch: int = 64,
              rpc_kind: Literal["dealer", "router"] = "dealer",
              options: SocketOptions = _OPTIONS) -> None:
    """Run a scheduler over zmq until shut down (the body of the scheduler process)."""
    codec: Codec[Request] = Codec(Request)
    out_codec: Codec[Output] = Codec(Output)
    with PullInbox(codec, endpoints.work, options=options) as work, \
            RpcServer(codec, endpoints.rpc, kind=rpc_kind, options=options) as rpc, \
            PushOutbox(out_codec, endpoints.out, options=options) as out:
        router = scheduler_router(TransportSink(out), RpcReplySink(rpc))
        inboxes: list[Inbox[Request]] = [work, rpc]
        Scheduler(Receiver(inboxes), router, build_model(model), max_batch=max_batch).run()
