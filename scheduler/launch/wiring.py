"""How each mode is put together: which inboxes, which sinks. The scheduler never knows.

``ring`` (embedded): work arrives on an in-process ring, outputs leave on an
egress ring; rpc still comes over zmq (the seed's setup).
``zmq`` (own process): work over PULL, outputs over PUSH, rpc over ROUTER.
Rpc replies go by peer identity (ROUTER) in both, so a second client on the
rpc endpoint can never receive the first one's replies.
Both build a :class:`~bus.Receiver` over *all* their inboxes and the same
:func:`~router.scheduler_router` table: adding a mode swaps an inbox and a
sink, it cannot skip the rpc channel or misroute its replies.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch.distributed as dist
import zmq

from bus import (
    CurveAuthenticator,
    Origin,
    PullInbox,
    PushOutbox,
    Receiver,
    Ring,
    RingInbox,
    RpcServer,
    SocketOptions,
)
from bus.channels import Inbox
from messages import OUT, RPC, WORK, Codec, Output, Request
from router import RingSink, Router, RpcReplySink, TransportSink, scheduler_router
from scheduler.core.admission import Limits
from scheduler.core.backpressure import FINISH_FLUSH, flush_last
from scheduler.core.loop import RequestSource, Scheduler, Upstream
from scheduler.core.metrics_http import MetricsServer
from scheduler.launch.tp import BroadcastReceiver, TPConfig, init_ranks, null_router, rpc_reducer
from scheduler.models.loading import ModelSpec, load_model, own_process_threads
from scheduler.models.protocol import Model

__all__ = ["Endpoints", "rpc_codec", "serve_follower", "serve_ring", "serve_zmq"]

_OPTIONS = SocketOptions()

log = logging.getLogger("scheduler")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where a scheduler listens (work, rpc) and where its outputs go (out).

    ``server_binds_out``: the scheduler binds ``out`` and its one consumer
    connects (``tcp://``: a server owns its ports, so a client on another
    host can reach all three); otherwise the consumer binds ``out`` and the
    scheduler connects (``ipc://`` in a directory both share).
    """

    work: str
    rpc: str
    out: str
    server_binds_out: bool = False

    #: The sockets' names in a directory (:meth:`in_dir`).
    SOCKETS: ClassVar[tuple[str, str, str]] = ("work", "rpc", "out")

    @classmethod
    def in_dir(cls, directory: str) -> Endpoints:
        """``ipc://`` endpoints inside ``directory``."""
        work, rpc, out = (f"ipc://{directory}/{name}" for name in cls.SOCKETS)
        return cls(work, rpc, out)

    @classmethod
    def tcp(cls, host: str, port: int) -> Endpoints:
        """``tcp://host:port`` (work), ``port + 1`` (rpc), ``port + 2`` (out), all bound
        by the scheduler."""
        return cls(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}",
                   f"tcp://{host}:{port + 2}", server_binds_out=True)

    @classmethod
    def parse(cls, spec: str) -> Endpoints:
        """A directory of ``ipc://`` endpoints, or a ``tcp://host:port`` base."""
        if spec.startswith("tcp://"):
            host, port = spec[6:].rsplit(":", 1)
            return cls.tcp(host, int(port))
        return cls.in_dir(spec)


def rpc_codec() -> Codec[Request]:
    """The rpc channel carries rpc calls only: work (and its aborts) goes on the work
    channel, whose one consumer gets the outputs. A peer that may call rpc cannot
    abort, or claim the rid of, a request it did not send. Anything else is refused
    at the door (:data:`messages.RPC`), answered by rid with a ``decode_error``."""
    return RPC.inbound_codec()


@contextlib.contextmanager
def _metrics_http(sched: Scheduler, host: str, port: int | None,
                  bound: Callable[[int], None] | None = None) -> Iterator[None]:
    """Serve ``sched``'s metrics over HTTP while the block runs (nothing if ``port`` is None);
    ``bound`` is told the port listened on (the one picked, for ``port=0``)."""
    if port is None or sched.registry is None:
        yield
        return
    # Bounded threads, idle connections timed out, a real listen backlog
    # (prometheus_client's server has none of the three).
    with MetricsServer(sched.registry, host, port) as server:
        if bound is not None:
            bound(server.port)
        yield


def serve_ring(ingress: Ring[Request], egress: Ring[Output], rpc_endpoint: str,
               model: ModelSpec | Model, *, max_batch: int = 64,
               rpc_kind: Literal["dealer", "router"] = "router",
               options: SocketOptions = _OPTIONS, limits: Limits | None = None,
               validate: bool = True, metrics: bool = True,
               started: Callable[[Scheduler], None] | None = None) -> Scheduler:
    """Run an embedded scheduler until shut down (call in its own thread).

    ``validate``: check every request taken from ``ingress`` as a decoder
    would (types and constraints); pass ``False`` only when the producer
    validated them already, as ``Engine`` does at submit. ``started`` is
    called with the scheduler before it runs (an engine keeps it to read its
    metrics). ``model``: a spec (loaded here) or a model already loaded.
    """
    codec: Codec[Request] = WORK.inbound_codec()  # the work channel's door
    limits = limits or Limits()
    with RpcServer(rpc_codec(), rpc_endpoint, kind=rpc_kind, options=options) as rpc:
        work = RingInbox(ingress, name="work",
                         validate=codec.validate if validate else codec.check_type)
        inboxes: list[Inbox[Request]] = [work, rpc]
        router = scheduler_router(RingSink(egress), RpcReplySink(rpc),
                                  max_backlog=limits.max_backlog)
        sched = Scheduler(Receiver(inboxes), router, load_model(model), max_batch=max_batch,
                          limits=limits, metrics=metrics)
        if started is not None:
            started(sched)
        sched.run()
        return sched


def serve_zmq(endpoints: Endpoints, model: ModelSpec | Model, *, max_batch: int = 64,
              rpc_kind: Literal["dealer", "router"] = "router",
              options: SocketOptions = _OPTIONS, tp: TPConfig | None = None,
              curve_clients: Sequence[bytes] | None = None,
              limits: Limits | None = None, metrics: bool = True,
              metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
              metrics_bound: Callable[[int], None] | None = None,
              loaded: Callable[[], None] | None = None,
              stop_requested: Callable[[], bool] | None = None) -> None:
    """Run a scheduler over zmq until shut down (the body of the scheduler process).

    With ``tp``, this is rank 0 of ``tp.world_size`` ranks: it owns the
    sockets and broadcasts each poll to the others (:func:`serve_follower`).
    With ``curve_clients`` (and server keys in ``options``), only clients
    holding one of those public keys are served. With ``metrics_port``,
    ``http://metrics_host:metrics_port/metrics`` serves the Prometheus
    metrics (loopback unless told otherwise; under tensor parallelism rank 0
    serves them: the other ranks run the very batches it broadcasts), and
    ``metrics_bound`` is called with the port once it listens. The
    model is loaded here, in the scheduler's process, from its spec, or comes
    loaded (``serve`` loads it before anything is bound or printed);
    ``loaded`` is called once it is, before the first request is served.
    ``stop_requested`` (a command's stop signal) is asked every step
    (:meth:`Scheduler.run <scheduler.core.loop.Scheduler.run>`).
    """
    codec: Codec[Request] = WORK.inbound_codec()  # each channel's door (messages.channels)
    out_codec: Codec[Output] = OUT.outbound_codec()
    limits = limits or Limits()
    own_process_threads(model)
    if tp is not None:
        init_ranks(0, tp)
    auth = CurveAuthenticator(zmq.Context.instance(), curve_clients) \
        if curve_clients is not None else None
    broadcast: BroadcastReceiver | None = None
    try:
        with PullInbox(codec, endpoints.work, options=options) as work, \
                RpcServer(rpc_codec(), endpoints.rpc, kind=rpc_kind, options=options) as rpc, \
                PushOutbox(out_codec, endpoints.out, options=options,
                           bind=endpoints.server_binds_out, watch_peers=True) as out:
            router = scheduler_router(TransportSink(out), RpcReplySink(rpc),
                                      max_backlog=limits.max_backlog)
            inboxes: list[Inbox[Request]] = [work, rpc]
            receiver: RequestSource = Receiver(inboxes)
            world = 1 if tp is None else tp.world_size
            tell = None
            if tp is not None:
                # The step broadcast carries what both doors let in.
                receiver = broadcast = BroadcastReceiver(0, Receiver(inboxes), Codec(Request))
                tell = broadcast.inject
            sched = Scheduler(receiver, router, load_model(model), max_batch=max_batch,
                              world_size=world, limits=limits, tell_ranks=tell,
                              empty=lambda shape, dtype: out.empty(shape, dtype=dtype),
                              handoff_bytes=_unreleased(out),
                              metrics=metrics or metrics_port is not None,
                              rpc_reduce=rpc_reducer(0, world) if tp is not None else None,
                              upstream=_readers_of(work.name, out))
            _settled()
            if loaded is not None:
                loaded()
            with _metrics_http(sched, metrics_host, metrics_port, metrics_bound):
                try:
                    sched.run(stop_requested, finishing=out.track_writes)
                finally:  # the last answers leave before the process exits
                    _last_answers(router, out, work.name)
    finally:
        if broadcast is not None:
            broadcast.close()  # rank 0 unlinks the shared-memory ring
        if auth is not None:
            auth.stop()
        if tp is not None:
            dist.destroy_process_group()


def serve_follower(rank: int, tp: TPConfig, model: ModelSpec, *, max_batch: int = 64,
                   limits: Limits | None = None) -> None:
    """Run tensor-parallel rank ``rank`` (> 0): same requests as rank 0, no sockets."""
    own_process_threads(model)
    init_ranks(rank, tp)
    broadcast: BroadcastReceiver | None = None
    try:
        broadcast = BroadcastReceiver(rank, None, Codec(Request))
        follower = Scheduler(broadcast, null_router(), load_model(model),
                             max_batch=max_batch, rank=rank, world_size=tp.world_size,
                             limits=limits, metrics=False,
                             rpc_reduce=rpc_reducer(rank, tp.world_size))
        _settled()
        follower.run()
    finally:
        if broadcast is not None:
            broadcast.close()
        dist.destroy_process_group()


def _readers_of(inbox: str, out: PushOutbox[Output]) -> Upstream:
    """The reader of ``inbox``'s outputs is ``out``'s peer: when the last one is gone
    (its process died), the scheduler abandons that inbox's requests."""
    peers = out.peers
    if peers is None:
        raise ValueError(f"output channel {out.name!r} was opened without watch_peers")
    return Upstream(inbox, peers.last_left)


def _last_answers(router: Router[Output], out: PushOutbox[Output], inbox: str) -> None:
    """Wait (at most :data:`~scheduler.core.backpressure.FINISH_FLUSH`) for ``out``'s
    consumer to take the last outputs; a warning counts those it did not take."""
    left = flush_last(router, out, Origin(inbox))
    if left and out.peers is not None and out.peers.peers:  # (none: nobody could read)
        log.warning("%d outputs for the %s channel's consumer, the last requests' terminal "
                    "answers among them, were not read within %g s of the stop and are "
                    "dropped", left, inbox, FINISH_FLUSH)


def _unreleased(out: PushOutbox[Output]) -> Callable[[], int]:
    """The bytes ``out``'s sends hold now: in shared memory, unreleased by their
    receiver, and on the socket itself (``tcp://``), not yet written out by zmq."""
    pool = out.shm_frames
    if pool is None:
        return lambda: out.bytes_unsent
    return lambda: pool.bytes_unreleased + out.bytes_unsent


def _settled() -> None:
    """Hide what start-up built (torch, the model) from the garbage collector.

    A scheduler process holds some 200k objects once torch is imported; a
    full collection walks them all (about 100 ms here), and the loop's own
    allocations trigger one every so often: a stall of every request in
    flight. ``gc.freeze()`` moves them to a generation no collection scans
    (SGLang and vLLM do the same after start-up); what the loop allocates
    later is collected as usual.
    """
    gc.freeze()
