"""``Dispatcher``: N scheduler replicas behind one endpoint that looks like one scheduler.

Upstream it has a scheduler's three channels (work PULL, rpc ROUTER,
outputs PUSH), so a frontend, ``Engine`` included, cannot tell one
scheduler from N. Downstream it holds each replica's channels
(:class:`~scheduler.dp.replica.Replica`). One :class:`~bus.Receiver` drains
all of them fairly and parks on one poll.

* A request is routed by the dispatch table (:mod:`scheduler.dp.table`): balanced
  by the ledger (:mod:`~scheduler.dp.ledger`), to its owner, or broadcast.
* A replica's output is accepted only for a rid the ledger says that
  replica (in its current generation) owns; anything else is stale, dropped
  and counted. Terminal outputs release the ledger entry.
* Outputs go upstream through the same reply router as a scheduler's
  (:func:`router.scheduler_router`), with its backlog: a frontend that stops
  reading pauses the replicas' output inboxes, then collapses its streams.
* A replica is lost only on evidence about it (:mod:`scheduler.dp.liveness`):
  its process exited, it was silent while this dispatcher ran, or it says
  it is idle while our requests there get no answer. A lost replica
  (:mod:`scheduler.dp.replica`) fails the requests it had started with
  ``ErrorOut(replica_lost)``, sends the ones it had not started to a live
  replica, and completes pending broadcasts without it.
* Broadcasts run at most 4 at a time per caller (:class:`CallerQueue`).
* Prefill and decode apart (``pd=(P, D)``): replicas ``0..P-1`` read prompts,
  ``P..P+D-1`` decode. A generate request goes to a prefill replica marked
  ``prefill_only``; it streams the first token and sends a
  :class:`~messages.KVHandoff` on its output channel, which the reply
  router's ``KVHandoff`` row hands to :meth:`Dispatcher._hand_over`: the
  least loaded live decode replica gets it on its work channel, and the
  ledger moves the request there (its outputs are accepted from there on; if
  it is lost, the request ends ``replica_lost`` as any started one).
  Embeddings go to prefill replicas, which answer them whole.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec

from bus import (
    ChannelError,
    Envelope,
    Origin,
    PullInbox,
    PushOutbox,
    Receiver,
    Rejected,
    RpcServer,
    WouldBlock,
)
from bus.channels import Inbox
from messages import (
    ErrorCode,
    ErrorOut,
    KVHandoff,
    Message,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    fit_text,
)
from router import CallbackSink, RpcReplySink, TransportSink, scheduler_router
from scheduler.core.backpressure import FINISH_FLUSH, collapse, flush_last
from scheduler.core.outputs import stopped_by
from scheduler.dp.affinity import PrefixAffinity
from scheduler.dp.fanout import CallerQueue, Fanout, merge_replies
from scheduler.dp.ledger import Ledger, NoLiveReplica, Policy, cost_of
from scheduler.dp.liveness import AwakeClock
from scheduler.dp.outputs import OutputGate, OutputThrottle
from scheduler.dp.replica import Replica, ReplicaSpec, check_distinct
from scheduler.dp.table import (
    Balanced,
    Broadcast,
    Owner,
    Reducer,
    Refused,
    ReplicaReply,
    dispatch_table,
)
from scheduler.dp.upstream import DispatcherLogs, answer_hello_here, answer_rejected, with_ledger
from scheduler.handshake import HELLO_METHOD

__all__ = ["Dispatcher", "DispatcherStats"]

log = logging.getLogger("scheduler.dp")

#: The origin of every output the dispatcher sends upstream on the transport.
_WORK = Origin("work")

_Handler = Callable[[Message, Origin], None]

UNREAD_REPLIES = 8  #: replies of one caller in our backlog past which its calls are not run


#: Counters of a dispatcher, by name (also in ``get_load``'s reply as ``dispatcher.<name>``).
DispatcherStats = dict[str, int]


class Dispatcher:
    """Dispatches one upstream endpoint's requests over ``replicas``.

    Args:
        work, rpc, out: the upstream channels (bound like a scheduler's).
        replicas: where each replica serves.
        policy: ``"least_loaded"`` (default), ``"round_robin"`` or ``"cache_aware"``
            (:mod:`scheduler.dp.affinity`).
        rpc_timeout: seconds a broadcast waits for every replica; those that
            have not answered by then are named in the reply as timed out.
        heartbeat_interval: seconds between two heartbeats to a replica.
        heartbeat_timeout: a replica silent this long *while the dispatcher
            runs* is lost (see :mod:`scheduler.dp.liveness`). Local replicas
            (with pids) are also lost the moment a process exits.
        join_timeout: seconds :meth:`run` waits for local replicas still starting
            once one replica is live (it serves then; others join when they answer).
        max_backlog: outputs kept for an upstream consumer not reading.
        clock: the real clock (a test passes a controlled one).
        pd: ``(P, D)``: prefill and decode apart, the first ``P`` replicas reading
            prompts and the other ``D`` decoding (see the module docstring);
            ``None``: every replica does both.
        handoff_deadline: seconds a hand-off's shared-memory slab (this dispatcher's,
            on its way to a decode replica) may stay unread; past it, the slab is
            taken back and unlinked, and the request answered ``replica_lost``,
            naming it and the deadline (the replica reading it later has it refused).
        max_handoff_bytes: the hop to a decode replica keeps the prefill side's bound
            (``Limits.max_handoff_bytes``): a hand-off goes to a decode replica only
            while its bytes and those of the hand-offs it has not released yet fit
            under it; else it waits here, in order (holding the prefill replica's
            memory, so that replica waits too: nothing is dropped). One larger than
            the bound alone is answered ``invalid_request`` naming the rid, its size
            and the bound. Over ``tcp://`` what counts is what zmq has not written
            out to the replica's connection yet (``PushOutbox.bytes_unsent``).
        stop_requested: asked at every step, however busy (a command's stop signal,
            :class:`~scheduler.cli.signals.StopSignals`): once true, :meth:`run` stops
            as on a ``KeyboardInterrupt`` (each request in flight answered
            ``shutdown`` and aborted at its replica), even where the signal's own
            exception was discarded.
    """

    TICK = 0.02  # seconds between liveness checks when idle

    def __init__(self, work: PullInbox[Request], rpc: RpcServer[Request],
                 out: PushOutbox[Output], replicas: Sequence[ReplicaSpec], *,
                 policy: Policy = "least_loaded", rpc_timeout: float = 30.0,
                 heartbeat_interval: float = 0.2, heartbeat_timeout: float = 2.0,
                 join_timeout: float = 60.0, max_backlog: int = 1024,
                 clock: Callable[[], float] = time.monotonic,
                 pd: tuple[int, int] | None = None, handoff_deadline: float = 60.0,
                 max_handoff_bytes: int = 512 << 20,
                 stop_requested: Callable[[], bool] | None = None) -> None:
        if not replicas:
            raise ValueError("a dispatcher needs at least one replica")
        check_distinct(replicas)
        if pd is not None and (min(pd) < 1 or sum(pd) != len(replicas)):
            raise ValueError(f"pd={pd}: needs P >= 1 prefill and D >= 1 decode replicas, "
                             f"P + D = {len(replicas)} (the replicas given)")
        #: Replicas that take no new request (they decode hand-offs), and those that
        #: take no hand-off; both empty without ``pd``.
        self.decode_only = frozenset(range(pd[0], sum(pd))) if pd is not None else frozenset()
        self.prefill_only = frozenset(range(pd[0])) if pd is not None else frozenset()
        self.table = dispatch_table(merge_replies)  # the totality check: at start-up
        self.replicas = [Replica(i, spec, unclaimed_timeout=handoff_deadline
                                 if i in self.decode_only else None)
                         for i, spec in enumerate(replicas)]
        self.ledger = Ledger(len(replicas), policy)
        #: Where prompts went, for the ``cache_aware`` policy (None under the others).
        self.affinity = PrefixAffinity(len(replicas)) if policy == "cache_aware" else None
        self.ledger.live = [False] * len(replicas)  # live once they answer
        self.fanout = Fanout([r.name for r in self.replicas])
        self.callers = CallerQueue()  # at most 4 broadcasts in flight per caller
        self.rpc_timeout = rpc_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.join_timeout = join_timeout
        self.handoff_deadline = handoff_deadline
        if max_handoff_bytes < 1:
            raise ValueError("max_handoff_bytes must be >= 1")
        self.max_handoff_bytes = max_handoff_bytes
        #: What ``get_load`` reports of the settings this dispatcher runs under.
        self.bounds: dict[str, int | float] = {} if pd is None else {
            "handoff_deadline": handoff_deadline, "max_handoff_bytes": max_handoff_bytes}
        #: Hand-offs waiting for a decode replica with room, in arrival order.
        self._handoffs_waiting: deque[KVHandoff] = deque()
        self.max_backlog = max_backlog
        self.out = out
        #: Seconds a stop waits for the last answers to leave
        #: (:data:`~scheduler.core.backpressure.FINISH_FLUSH`).
        self.finish_flush = FINISH_FLUSH
        self.logs = DispatcherLogs()
        self.router = scheduler_router(TransportSink(out), RpcReplySink(rpc),
                                       max_backlog=max_backlog,
                                       handoff=CallbackSink(self._hand_over))
        self.router.on_overflow = functools.partial(collapse, abort=self._abort_stuck,
                                                    dropped_rpc=self.logs.dropped_reply)
        self.clock = clock
        self.awake = AwakeClock(clock, max_gap=max(0.25, heartbeat_interval))
        #: Whether the last ``shutdown`` reached every replica (``None``: none yet).
        self.shutdown_ok: bool | None = None
        self._upstream: list[Inbox[Request]] = [work, rpc]
        self.receiver: Receiver[Message] = Receiver([])
        for rep in self.replicas:
            self._watch(rep)
        self.stats: DispatcherStats = dict(
            dispatched=0, handed_off=0, redispatched=0, lost=0, joined=0, stale_outputs=0,
            duplicate_rid=0, abort_unknown=0, rejected=0, replica_lost_errors=0,
            rpc_calls_not_run=0)
        self.gate = OutputGate(self.ledger, self.stats)
        self.throttle = OutputThrottle(self.receiver, self.replicas, max_backlog // 2)
        self.stop_requested = stop_requested or (lambda: False)
        self._stopping = False
        self._stop_deadline = 0.0
        self._serving = False
        self._next_tick = 0.0
        self._hb_seq = 0

    # -- the loop ---------------------------------------------------------------

    def run(self) -> bool:
        """Serve until a ``shutdown`` rpc has been answered and the replicas are done.

        Returns whether that shutdown reached every replica (a lost one
        makes it ``False``: the caller should exit non-zero).
        """
        deadline = self.clock() + self.join_timeout
        while not self._ready(self.clock() >= deadline):
            self._stop_if_requested()
            if not self.step():
                self.receiver.wait(self.TICK)
        self.serve_upstream()
        try:
            while not self._done():
                self._stop_if_requested()  # every step: a flood never makes us idle
                with self.router.batching():  # what one step forwards leaves as one burst
                    took = self.step()
                if not took:
                    self.receiver.wait(max(0.0, self._next_tick - self.clock()))
        except BaseException as exc:  # answered, and aborted at the replicas (else a
            self._finish(*stopped_by(exc, "dispatcher"), abort=True)  # SIGTERMed dispatch's
            raise  # clients get no answer, and its replicas go on generating for them)
        self._finish("shutdown", "the dispatcher shut down before the request finished")
        return bool(self.shutdown_ok)

    def _stop_if_requested(self) -> None:
        """Raise ``KeyboardInterrupt`` once a stop was requested: a signal's own may have
        been discarded where it landed (see :class:`~scheduler.cli.signals.StopSignals`)."""
        if self.stop_requested():
            raise KeyboardInterrupt("stop requested")

    def _ready(self, late: bool) -> bool:
        """Serve once one replica is live, and no other is a local one still starting
        (its process runs, it has not answered yet) unless that took too long."""
        if not any(r.live for r in self.replicas):
            return False
        return late or all(r.live or not r.local or r.process_exit() is not None
                           for r in self.replicas)

    def serve_upstream(self) -> None:
        """Start taking requests from upstream (after the replicas joined). Idempotent."""
        if self._serving:
            return
        self._serving = True
        missing = [r.name for r in self.replicas if not r.live]
        if missing:
            log.warning("serving without %s: not answering yet (they join when they do)",
                        ", ".join(missing))
        for inbox in self._upstream:
            self.receiver.add(inbox)

    def step(self) -> int:
        """Handle what waits now, then the timers; returns how many messages were taken."""
        if self.router.backlog:
            self.router.flush()
        envelopes = self.receiver.poll()
        for env in envelopes:
            if type(env) is Rejected:  # answered if it can be, else counted and summarized
                upstream = env.origin.inbox in (i.name for i in self._upstream)
                if (answer := answer_rejected(env, upstream, self.ledger, self.stats,
                                              self.logs)) is not None:
                    self.router.route(answer, env.origin)
                continue
            assert isinstance(env, Envelope)
            self._handlers[env.origin.inbox](env.message, env.origin)
        now = self.clock()
        if now >= self._next_tick:
            self._tick(now)
        return len(envelopes)

    def close(self) -> None:
        """Close every replica's channels (not the upstream ones: their owner does)."""
        for rep in self.replicas:
            rep.close()

    # -- upstream requests ------------------------------------------------------

    @functools.cached_property
    def _handlers(self) -> dict[str, _Handler]:
        table: dict[str, _Handler] = {i.name: self._on_request for i in self._upstream}
        for rep in self.replicas:
            table[rep.out.name] = functools.partial(self._on_output, rep)
            table[rep.rpc.name] = functools.partial(self._on_replica_rpc, rep)
        return table

    def _on_request(self, msg: Message, origin: Origin) -> None:
        assert isinstance(msg, Request)
        route = self.table.lookup(type(msg))
        if type(route) is Balanced:
            assert isinstance(msg, TokenizedGenerateReqInput | TokenizedEmbeddingReqInput)
            self._balanced(msg, origin)
        elif type(route) is Owner:
            self._to_owner(msg)
        elif type(route) is Refused:
            self._error(msg.rid, origin, "invalid_request", f"request {msg.rid!r}: {route.why}")
        else:
            assert isinstance(route, Broadcast) and isinstance(msg, RpcReqInput)
            turn = self.callers.admit(msg, origin)
            if turn:
                self._broadcast(msg, origin, route)
            elif turn is None:
                self.router.route(RpcReqOutput(rid=msg.rid, success=False, message=(
                    f"{self.callers.hold} calls of this caller wait already: wait for their "
                    "replies before sending more")), origin)

    def _balanced(self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput,
                  origin: Origin) -> None:
        if msg.rid in self.ledger:  # answering would end the live one in its client's eyes
            self.stats["duplicate_rid"] += 1
            self.logs.duplicate.add(origin.inbox, f"request id {msg.rid!r}")
            return
        if self._stopping:
            self._error(msg.rid, origin, "shutdown", "the dispatcher is shutting down")
            return
        self._dispatch(msg, origin, msg.dp_rank)

    def _dispatch(self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput,
                  origin: Origin, pin: int | None, lost: str = "") -> None:
        """Send ``msg`` to a replica (``lost``: why it is being sent again, for errors)."""
        rid = msg.rid
        # A replica still running an orphan of this rid would drop it as a duplicate.
        busy = [r.index for r in self.replicas if r.orphans and rid in r.orphans]
        # Prefill and decode apart: new requests go to the replicas that read prompts.
        closed = [*busy, *self.decode_only] if pin is None else busy
        # Only generation leaves a prefix in a replica's cache: embeddings go by load.
        affinity = self.affinity if isinstance(msg, TokenizedGenerateReqInput) else None
        try:
            prefer = None
            if pin is None and affinity is not None:
                prefer = affinity.prefer(msg.input_ids, self.ledger.requests,
                                              self.ledger.live, busy)
            i = self.ledger.pick(pin, closed, prefer)
        except NoLiveReplica as exc:
            code: ErrorCode = "replica_lost"
            why = str(exc)
            if pin is not None:
                held_by_orphans = pin in busy and self.replicas[pin].live
            else:
                # A live replica that takes new requests was not picked: each such one
                # is busy ending an earlier request with this id.
                held_by_orphans = any(r.live and r.index not in self.decode_only
                                      for r in self.replicas)
            if pin is not None and not 0 <= pin < len(self.replicas):
                code = "invalid_request"
            elif held_by_orphans:
                code = "overloaded"  # the orphan ends soon: a retry will go through
                why = f"replica {busy[0]} is still ending an earlier request with this id"
            elif pin is None and self.decode_only:  # live decode replicas take no prompt
                why = "no prefill replica is live (the decode replicas read no prompt)"
            self._error(rid, origin, code, f"request {rid!r}: {why}{lost}")
            return
        rep = self.replicas[i]
        sent: Request = msg
        if pin is not None:  # consumed here: a replica is a lone scheduler, where only
            sent = msgspec.structs.replace(msg, dp_rank=None)  # 0 or null is valid
        if i in self.prefill_only and isinstance(msg, TokenizedGenerateReqInput):
            sent = msgspec.structs.replace(sent, prefill_only=True)
        try:
            rep.work.send_nowait(sent)
        except WouldBlock:
            self._error(msg.rid, origin, "overloaded",
                        f"request {msg.rid!r}: {rep.name} is not taking requests "
                        "(its work queue is full)")
            return
        except ChannelError as exc:
            self._error(msg.rid, origin, "replica_lost", f"request {msg.rid!r}: {rep.name}: "
                        f"{exc}")
            return
        self.ledger.add(msg.rid, i, rep.generation, cost_of(msg), msg, pinned=pin is not None,
                        at=self.awake.now)
        if affinity is not None:
            affinity.record(i, msg.input_ids)
        self.stats["dispatched"] += 1

    def _hand_over(self, h: KVHandoff, origin: Origin) -> None:
        """A prefill replica's hand-off (the router's ``KVHandoff`` row): on to the least
        loaded live decode replica with room (``max_handoff_bytes``), which owns the
        request from now on; with none, it waits, behind those already waiting."""
        if h.kv.nbytes > self.max_handoff_bytes:  # it could never fit: answered now
            entry = self.ledger.finish(h.rid)
            if entry is not None:
                self._error(h.rid, _WORK, "invalid_request", f"request {h.rid!r}, prefilled "
                            f"by {self.replicas[entry.replica].name}: its hand-off of "
                            f"{h.kv.nbytes} bytes exceeds max_handoff_bytes="
                            f"{self.max_handoff_bytes}")
            return
        if self._handoffs_waiting or not self._try_hand_over(h):
            self._handoffs_waiting.append(h)

    def _hand_over_waiting(self) -> None:
        """The waiting hand-offs, oldest first, while decode replicas have room."""
        waiting = self._handoffs_waiting
        while waiting and self._try_hand_over(waiting[0]):
            waiting.popleft()

    def _room(self, i: int, nbytes: int) -> bool:
        """Whether decode replica ``i`` may take a hand-off of ``nbytes`` now: nothing
        of what was sent to it is held (unreleased in shared memory, or not yet
        written out to its ``tcp://`` connection), or that and this one fit
        ``max_handoff_bytes``."""
        work = self.replicas[i].work
        pool = work.shm_frames
        held = work.bytes_unsent + (pool.bytes_unreleased if pool is not None else 0)
        return not held or held + nbytes <= self.max_handoff_bytes

    def _try_hand_over(self, h: KVHandoff) -> bool:
        """Send ``h`` on, or answer its request; ``False``: every live decode replica is
        short of room (it must wait; nothing was done)."""
        entry = self.ledger.get(h.rid)
        if entry is None:  # ended meanwhile (the gate let it through while it was ours)
            return True
        prefilled_by = self.replicas[entry.replica].name
        nbytes = h.kv.nbytes
        busy = [r.index for r in self.replicas if r.orphans and h.rid in r.orphans]
        excluded = [*busy, *self.prefill_only]
        full = [i for i in self.decode_only if i not in excluded and not self._room(i, nbytes)]
        try:
            i = self.ledger.pick(None, [*excluded, *full])
        except NoLiveReplica as exc:
            if any(self.replicas[j].live for j in full):
                return False
            self.ledger.finish(h.rid)
            self._error(h.rid, _WORK, "replica_lost", f"request {h.rid!r}, prefilled by "
                        f"{prefilled_by}: no decode replica to hand it to ({exc})")
            return True
        rep = self.replicas[i]
        try:
            rep.work.send_nowait(h)
        except (WouldBlock, ChannelError) as exc:
            self.ledger.finish(h.rid)
            self._error(h.rid, _WORK, "overloaded" if isinstance(exc, WouldBlock) else
                        "replica_lost", f"request {h.rid!r}, prefilled by {prefilled_by}: "
                        f"its hand-off to {rep.name} failed: {exc}")
            return True
        self.ledger.move(entry, i, rep.generation)
        pool = rep.work.shm_frames
        entry.handoff = pool.last_sent if pool is not None else ()
        self.stats["handed_off"] += 1
        if entry.aborted:  # aborted while in hand-off: end it where it is now
            rep.abort(h.rid)
        return True

    def _to_owner(self, msg: Request) -> None:
        entry = self.ledger.get(msg.rid)
        if entry is None:  # finished, unknown or never ours: harmless, counted
            self.stats["abort_unknown"] += 1
            return
        entry.aborted = True
        try:
            self.replicas[entry.replica].work.send_nowait(msg)
        except ChannelError as exc:
            log.warning("abort of %r could not reach %s: %s", msg.rid,
                        self.replicas[entry.replica].name, exc)

    def _broadcast(self, call: RpcReqInput, origin: Origin, route: Broadcast) -> None:
        caller_behind = (self.router.backlog and call.method != "shutdown"
                         and self.router.backlog_by_origin().get(origin, 0) >= UNREAD_REPLIES)
        if caller_behind:
            self.stats["rpc_calls_not_run"] += 1  # unread calls would cost every stream CPU
            self.logs.dropped_rpc.add(origin.inbox, f"call {call.rid!r} ({call.method}) not "
                                      "run: its caller sends faster than it reads replies")
            self._reply(None, origin)
        elif call.method == HELLO_METHOD:  # ours to answer: we decode the client's frames
            self._reply(answer_hello_here(call, self.logs), origin)
        else:
            self._fan_out(call, origin, route)

    def _fan_out(self, call: RpcReqInput, origin: Origin, route: Broadcast) -> None:
        reduce = route.reduce
        if call.method == "shutdown" and not self._stopping:
            self._stopping = True
            self._stop_deadline = self.clock() + self.rpc_timeout
            reduce = functools.partial(self._stopped, reduce)
        live = [i for i, r in enumerate(self.replicas) if r.live]
        if call.method == "get_load":  # the dispatcher's own view of each replica, beside
            reduce = functools.partial(with_ledger, reduce, self.replicas, self.ledger,
                                       self.stats, self.fanout, self.bounds, self.affinity)
        elif call.method == "flush_cache" and self.affinity is not None:
            reduce = functools.partial(self.affinity.forget_flushed,
                                       [r.name for r in self.replicas], reduce)
        done = self.fanout.start(call, origin, self.clock() + self.rpc_timeout,
                                 reduce, live, self._send_call)
        if done is not None:
            self._reply(done, origin)

    def _reply(self, reply: RpcReqOutput | None, origin: Origin) -> None:
        """A broadcast of ``origin`` ended (``reply``: its answer): start its next one."""
        if reply is not None:
            self.router.route(reply, origin)
        nxt = self.callers.done(origin)
        if nxt is not None:
            route = self.table.lookup(RpcReqInput)
            assert isinstance(route, Broadcast)
            self._broadcast(nxt, origin, route)

    def _stopped(self, reduce: Reducer, call: RpcReqInput,
                 replies: Sequence[ReplicaReply]) -> RpcReqOutput:  # remembers the outcome
        merged = reduce(call, replies)
        self.shutdown_ok = merged.success
        return merged

    def _send_call(self, i: int, call: RpcReqInput) -> str | None:
        try:
            self.replicas[i].rpc.send_nowait(call)
        except ChannelError as exc:
            return f"not sent ({exc})"
        return None

    def _error(self, rid: str, origin: Origin, code: ErrorCode, message: str) -> None:
        if code == "replica_lost":
            self.stats["replica_lost_errors"] += 1
        self.router.route(ErrorOut(rid=rid, code=code, message=fit_text(message)), origin)

    # -- replica outputs --------------------------------------------------------

    def _on_output(self, rep: Replica, out: Message, origin: Origin) -> None:
        rep.health.output()
        accepted = self.gate.accept(rep, out)
        if accepted is not None:
            self.router.route(accepted, _WORK)

    def _on_replica_rpc(self, rep: Replica, reply: Message, origin: Origin) -> None:
        if not isinstance(reply, RpcReqOutput):
            return
        rep.health.answered()
        if reply.rid.startswith("hb"):
            load = reply.result or {}
            running, queued, pid = load.get("running"), load.get("queued"), load.get("pid")
            if not rep.live:
                model = load.get("model")
                if not self._same_model(rep, model if isinstance(model, str) else None):
                    return
                self._join(rep, pid if isinstance(pid, int) else None)
            cached = load.get("prefix_cache_tokens")
            if (self.affinity is not None and isinstance(cached, int)
                    and not isinstance(cached, bool)):
                self.affinity.set_cache_tokens(rep.index, cached)  # bounds its tree
            if isinstance(running, int) and isinstance(queued, int):
                self.ledger.reported[rep.index] = running + queued
                idle = running + queued == 0  # then: ours sent before now, unanswered
                now = self.awake.now
                rep.health.reported(now, idle, idle and self.ledger.older(rep.index, now))
            return
        done = self.fanout.reply(reply, rep.index)
        if done is not None:
            self._reply(*done)

    # -- liveness ---------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self._next_tick = now + self.TICK
        awake = self.awake.tick()
        backlog = self.router.backlog
        self.throttle.update(self.router.backlog_by_origin().get(_WORK, 0) if backlog else 0)
        for rep in self.replicas:
            if rep.live:
                why = rep.process_exit() or self._verdict(rep, awake)
                if why is not None:
                    self._lose(rep, why)
            if now >= rep.next_beat:
                rep.next_beat = now + self.heartbeat_interval
                self._hb_seq += 1
                rep.health.probed(awake, rep.cpu_wait)
                try:  # a probe while not live: the first answer (re)joins it
                    rep.rpc.send_nowait(RpcReqInput(rid=f"hb{self._hb_seq}", method="get_load"))
                except ChannelError:
                    pass  # not connected yet, or not reading: its silence tells
        for done in self.fanout.expire(now):
            self._reply(*done)
        if self._handoffs_waiting:
            self._hand_over_waiting()
        self._reclaim_handoffs()

    def _reclaim_handoffs(self) -> None:
        """Unlink the slabs of hand-offs no decode replica read within ``handoff_deadline``
        (decode replicas only: a large request to any other keeps the pool's own rule)."""
        for i in self.decode_only:
            rep = self.replicas[i]
            pool = rep.work.shm_frames
            if pool is None or not pool.bytes_held:
                continue
            freed = pool.reclaim()
            if freed:
                log.warning("%s did not read a hand-off within %g s: its %d bytes of "
                            "shared memory are freed", rep.name, self.handoff_deadline, freed)
                self._expired(rep, pool.taken_back)

    def _expired(self, rep: Replica, taken_back: frozenset[tuple[str, int]]) -> None:
        """Answer the requests whose hand-off to ``rep`` was taken back unread: it can
        never be adopted now (``rep`` reading it later has it refused, unanswered here)."""
        for entry in list(self.ledger.entries(rep.index)):
            if entry.handoff and not taken_back.isdisjoint(entry.handoff):
                self.ledger.finish(entry.rid)
                self._error(entry.rid, _WORK, "replica_lost",
                            f"request {entry.rid!r}: its hand-off to {rep.name} expired "
                            f"unadopted after {self.handoff_deadline:g} s (the replica did "
                            "not read it; its shared memory is freed)")

    def _verdict(self, rep: Replica, awake: float) -> str | None:
        """Why ``rep`` is lost now, judged on what it showed us while we ran; a silence
        verdict is checked against its replies waiting right now (probe before judging)."""
        sent_before = functools.partial(self.ledger.older, rep.index)
        why = rep.health.verdict(awake, self.heartbeat_timeout, sent_before, rep.cpu_wait)
        if why is None or rep.health.probe_since is None:
            return why
        for env in rep.rpc.drain(64):  # what it already answered, unread by us
            if isinstance(env, Envelope):
                self._on_replica_rpc(rep, env.message, env.origin)
        return rep.health.verdict(awake, self.heartbeat_timeout, sent_before, rep.cpu_wait)

    def _same_model(self, rep: Replica, model: str | None) -> bool:
        """Whether ``rep`` may join: with prefill and decode apart, only a replica of the
        live ones' model (a hand-off between two models is refused, request by request,
        after its first token). Logged once per model it is refused for, naming both."""
        if not self.prefill_only or model is None:
            return True  # (every model serves alone; a scheduler that does not say)
        other = next((r for r in self.replicas
                      if r.live and r.model is not None and r.model != model), None)
        if other is not None:
            if rep.refused_model != model:
                rep.refused_model = model
                log.error("%s (%s) serves model %r, %s (%s) serves %r: it is not joined "
                          "(prefill and decode replicas hand requests to each other: one "
                          "model for all)", rep.name, rep.spec.endpoints.work, model,
                          other.name, other.spec.endpoints.work, other.model)
            return False
        rep.model, rep.refused_model = model, None
        return True

    def _join(self, rep: Replica, pid: int | None) -> None:
        if pid is not None and pid != rep.pid:
            rep.orphans.clear()  # a new process: the old one's requests died with it
            rep.watch(pid)  # a local replica restarted: its exit is seen at once again
        rep.abort_orphans()  # the same process, back: end what it still runs
        rep.pid = pid
        rep.health.reset()
        rep.live = True
        rep.generation += 1
        self.ledger.live[rep.index] = True
        if self.affinity is not None:
            self.affinity.drop(rep.index)  # a respawn starts with an empty prefix cache
        self.stats["joined"] += 1
        log.info("%s %s (generation %d)", rep.name, "rejoined" if rep.joined else "joined",
                 rep.generation)
        rep.joined = True

    def _lose(self, rep: Replica, why: str) -> None:
        (log.info if self._stopping else log.warning)("%s lost: %s", rep.name, why)
        rep.live = False
        rep.health.reset()
        if self.affinity is not None:
            self.affinity.drop(rep.index)
        self.stats["lost"] += 1
        dead = rep.process_exit() is not None
        if dead:
            rep.bury()
            multiprocessing.active_children()  # reap it, if it is our child (serve --dp)
        for inbox in (rep.out, rep.rpc):
            self.receiver.remove(inbox)
        rep.reopen()  # this incarnation's connections, and all they hold, are gone
        self._watch(rep)
        for entry in self.ledger.lose(rep.index):
            if not dead:  # silent, maybe alive: it may still run this one
                rep.orphans.add(entry.rid)
            req = entry.request
            if self._stopping:
                self._error(entry.rid, _WORK, "shutdown",
                            f"{rep.name} stopped before request {entry.rid!r} finished")
            elif entry.started or entry.aborted or entry.pinned or req is None:
                self._error(entry.rid, _WORK, "replica_lost",
                            f"{rep.name} was lost ({why}) while serving request "
                            f"{entry.rid!r}")
            else:  # it never began there: run it elsewhere
                self.stats["redispatched"] += 1
                assert isinstance(req, TokenizedGenerateReqInput | TokenizedEmbeddingReqInput)
                self._dispatch(req, _WORK, None,
                               f" ({rep.name}, which had it, was lost: {why})")
        for done in self.fanout.lose(rep.index, f"lost ({why})"):
            self._reply(*done)

    def _watch(self, rep: Replica) -> None:
        self.receiver.add(rep.out)
        self.receiver.add(rep.rpc)

    def _abort_stuck(self, rid: str) -> None:
        if (entry := self.ledger.finish(rid)) is not None:
            self.replicas[entry.replica].abort(rid)

    # -- stopping ---------------------------------------------------------------

    def _done(self) -> bool:
        if not self._stopping or len(self.fanout):
            return False
        return not len(self.ledger) or self.clock() >= self._stop_deadline

    def _finish(self, code: ErrorCode, msg: str, abort: bool = False) -> None:
        """Answer what is still in flight; ``abort``: stop it at its replica too.

        A consumer not reading gets :attr:`finish_flush` seconds to take what waits for
        it, here and in zmq's queue (zmq's is dropped when the process exits: so the
        stop waits until zmq has written the answers out, not just accepted them);
        what it has not taken then is dropped, and the terminal answers among it are
        named in a warning (never dropped silently)."""
        self.out.track_writes()  # before the answers: they are the tail to wait for
        ended: list[str] = []
        for rep in self.replicas:
            for entry in self.ledger.lose(rep.index):
                if abort:
                    rep.abort(entry.rid)
                self._error(entry.rid, _WORK, code, msg)
                ended.append(entry.rid)
        left = flush_last(self.router, self.out, _WORK, self.finish_flush)
        if left and ended:
            unsent = ended[-left:]  # routed last, so the tail of the work queue (FIFO)
            named = ", ".join(repr(rid) for rid in unsent[:5])
            more = f" and {len(unsent) - 5} more" if len(unsent) > 5 else ""
            log.warning("%d outputs for the work channel's consumer were not read within "
                        "%g s of the stop and are dropped, among them the %s answers of "
                        "%d requests: %s%s", left, self.finish_flush, code, len(unsent), named,
                        more)
        self.logs.flush()
