"""``Dispatcher``: N scheduler replicas behind one endpoint that looks like one scheduler.

Upstream it has a scheduler's three channels (work PULL, rpc ROUTER,
outputs PUSH), so a frontend, ``Engine`` included, cannot tell one
scheduler from N. Downstream it holds each replica's channels
(:class:`~scheduler.dp.replica.Replica`). One :class:`~bus.Receiver` drains
all of them fairly and parks on one poll.

* A request is routed by the dispatch table (:mod:`scheduler.dp.table`):
  balanced by the ledger (:mod:`scheduler.dp.ledger`), to its owner, or
  broadcast (:mod:`scheduler.dp.fanout`).
* A replica's output is accepted only for a rid the ledger says that
  replica (in its current generation) owns; anything else is stale, dropped
  and counted. Terminal outputs release the ledger entry.
* Outputs go upstream through the same reply router as a scheduler's
  (:func:`router.scheduler_router`), with its backlog: a frontend that stops
  reading pauses the replicas' output inboxes, then collapses its streams.
* A lost replica (:mod:`scheduler.dp.replica`) fails the requests it had
  started with ``ErrorOut(replica_lost)``, sends the ones it had not
  started to a live replica, and completes pending broadcasts without it.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import time
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
    AbortReq,
    ErrorCode,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    fit_text,
)
from router import RpcReplySink, TransportSink, scheduler_router
from scheduler.core.backpressure import collapse
from scheduler.dp.fanout import Fanout, merge_replies
from scheduler.dp.ledger import Ledger, NoLiveReplica, Policy, cost_of
from scheduler.dp.outputs import OutputGate
from scheduler.dp.replica import Replica, ReplicaSpec
from scheduler.dp.table import (
    Balanced,
    Broadcast,
    Owner,
    Reducer,
    ReplicaReply,
    dispatch_table,
)

__all__ = ["Dispatcher", "DispatcherStats"]

log = logging.getLogger("scheduler.dp")

#: The origin of every output the dispatcher sends upstream on the transport.
_WORK = Origin("work")

_Handler = Callable[[Message, Origin], None]


#: Counters of a dispatcher, by name (also in ``get_load``'s reply as ``dispatcher.<name>``).
DispatcherStats = dict[str, int]


class Dispatcher:
    """Dispatches one upstream endpoint's requests over ``replicas``.

    Args:
        work, rpc, out: the upstream channels (bound like a scheduler's).
        replicas: where each replica serves.
        policy: ``"least_loaded"`` (default) or ``"round_robin"``.
        rpc_timeout: seconds a broadcast waits for every replica; those that
            have not answered by then are named in the reply as timed out.
        heartbeat_interval: seconds between two heartbeats to a replica.
        heartbeat_timeout: a replica silent this long is lost. Local
            replicas (with pids) are also lost the moment a process exits.
        join_timeout: seconds :meth:`run` waits for every replica to answer
            before it serves with those that did.
        max_backlog: outputs kept for an upstream consumer not reading.
    """

    TICK = 0.02  # seconds between liveness checks when idle

    def __init__(self, work: PullInbox[Request], rpc: RpcServer[Request],
                 out: PushOutbox[Output], replicas: Sequence[ReplicaSpec], *,
                 policy: Policy = "least_loaded", rpc_timeout: float = 30.0,
                 heartbeat_interval: float = 0.2, heartbeat_timeout: float = 2.0,
                 join_timeout: float = 60.0, max_backlog: int = 1024) -> None:
        if not replicas:
            raise ValueError("a dispatcher needs at least one replica")
        self.table = dispatch_table(merge_replies)  # the totality check: at start-up
        self.replicas = [Replica(i, spec) for i, spec in enumerate(replicas)]
        self.ledger = Ledger(len(replicas), policy)
        self.ledger.live = [False] * len(replicas)  # live once they answer
        self.fanout = Fanout([r.name for r in self.replicas])
        self.rpc_timeout = rpc_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.join_timeout = join_timeout
        self.max_backlog = max_backlog
        self.router = scheduler_router(TransportSink(out), RpcReplySink(rpc),
                                       max_backlog=max_backlog)
        self.router.on_overflow = functools.partial(
            collapse, abort=self._abort_stuck, dropped_rpc=self._dropped_rpc)
        self._upstream: list[Inbox[Request]] = [work, rpc]
        self.receiver: Receiver[Message] = Receiver([])
        for rep in self.replicas:
            self._watch(rep)
        self.stats: DispatcherStats = dict(
            dispatched=0, redispatched=0, lost=0, joined=0, stale_outputs=0,
            duplicate_rid=0, abort_unknown=0, rejected=0, replica_lost_errors=0)
        self.gate = OutputGate(self.ledger, self.stats)
        self._stopping = False
        self._stop_deadline = 0.0
        self._serving = False
        self._throttled = False
        self._next_tick = 0.0
        self._hb_seq = 0

    # -- the loop ---------------------------------------------------------------

    def run(self) -> None:
        """Serve until a ``shutdown`` rpc has been answered and the replicas are done."""
        deadline = time.monotonic() + self.join_timeout
        while not all(r.live for r in self.replicas) and time.monotonic() < deadline:
            if not self.step():
                self.receiver.wait(self.TICK)
        self.serve_upstream()
        while not self._done():
            with self.router.batching():  # what one step forwards leaves as one burst
                took = self.step()
            if not took:
                self.receiver.wait(max(0.0, self._next_tick - time.monotonic()))
        self._finish()

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
            if type(env) is Rejected:
                self._on_rejected(env)
                continue
            assert isinstance(env, Envelope)
            self._handlers[env.origin.inbox](env.message, env.origin)
        now = time.monotonic()
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
        else:
            assert isinstance(route, Broadcast) and isinstance(msg, RpcReqInput)
            self._broadcast(msg, origin, route)

    def _balanced(self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput,
                  origin: Origin) -> None:
        if msg.rid in self.ledger:  # answering would end the live one in its client's eyes
            self.stats["duplicate_rid"] += 1
            log.warning("request id %r is already in flight: the second one is dropped",
                        msg.rid)
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
        try:
            i = self.ledger.pick(pin, busy)
        except NoLiveReplica as exc:
            code: ErrorCode = "replica_lost"
            why = str(exc)
            if pin is not None and not 0 <= pin < len(self.replicas):
                code = "invalid_request"
            elif (pin in busy and self.replicas[pin].live) if pin is not None else \
                    any(r.live for r in self.replicas):  # every live one is busy with it
                code = "overloaded"  # the orphan ends soon: a retry will go through
                why = f"replica {busy[0]} is still ending an earlier request with this id"
            self._error(rid, origin, code, f"request {rid!r}: {why}{lost}")
            return
        rep = self.replicas[i]
        try:
            rep.work.send_nowait(msg)
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
                        at=time.monotonic())
        self.stats["dispatched"] += 1

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
        if call.method == "shutdown" and not self._stopping:
            self._stopping = True
            self._stop_deadline = time.monotonic() + self.rpc_timeout
        live = [i for i, r in enumerate(self.replicas) if r.live]
        reduce = route.reduce
        if call.method == "get_load":  # the dispatcher's own view of each replica, beside
            reduce = functools.partial(self._with_ledger, route.reduce)
        done = self.fanout.start(call, origin, time.monotonic() + self.rpc_timeout,
                                 reduce, live, self._send_call)
        if done is not None:
            self.router.route(done, origin)

    def _with_ledger(self, reduce: Reducer, call: RpcReqInput,
                     replies: Sequence[ReplicaReply]) -> RpcReqOutput:
        """``get_load`` merged, plus what the dispatcher knows per replica and of itself."""
        merged = reduce(call, replies)
        result = dict(merged.result or {})
        ledger = self.ledger
        for rep in self.replicas:
            i = rep.index
            result[f"{rep.name}.live"] = rep.live
            result[f"{rep.name}.generation"] = rep.generation
            result[f"{rep.name}.in_flight"] = ledger.requests[i]
            result[f"{rep.name}.in_flight_tokens"] = ledger.tokens[i]
            result[f"{rep.name}.dispatched"] = ledger.dispatched[i]
            result[f"{rep.name}.dispatched_tokens"] = ledger.dispatched_tokens[i]
        for key, n in self.stats.items():
            result[f"dispatcher.{key}"] = n
        result["dispatcher.late_rpc_replies"] = self.fanout.late
        return msgspec.structs.replace(merged, result=result)

    def _send_call(self, i: int, call: RpcReqInput) -> str | None:
        try:
            self.replicas[i].rpc.send_nowait(call)
        except ChannelError as exc:
            return f"not sent ({exc})"
        return None

    def _on_rejected(self, env: Rejected) -> None:
        err, origin = env.error, env.origin
        if origin.inbox not in {i.name for i in self._upstream}:
            self.stats["stale_outputs"] += 1
            log.error("undecodable message from %s: %s", origin.inbox, err)
            return
        self.stats["rejected"] += 1
        if err.rid is None or err.rid in self.ledger:
            log.warning("rejected on %s: %s", origin.inbox, err)
            return
        if err.message_type == RpcReqInput.__name__:
            self.router.route(RpcReqOutput(rid=err.rid, success=False,
                                           message=fit_text(str(err))), origin)
        else:
            self._error(err.rid, origin, "decode_error", str(err))

    def _error(self, rid: str, origin: Origin, code: ErrorCode, message: str) -> None:
        if code == "replica_lost":
            self.stats["replica_lost_errors"] += 1
        self.router.route(ErrorOut(rid=rid, code=code, message=fit_text(message)), origin)

    # -- replica outputs --------------------------------------------------------

    def _on_output(self, rep: Replica, out: Message, origin: Origin) -> None:
        accepted = self.gate.accept(rep, out)
        if accepted is not None:
            self.router.route(accepted, _WORK)

    def _on_replica_rpc(self, rep: Replica, reply: Message, origin: Origin) -> None:
        if not isinstance(reply, RpcReqOutput):
            return
        now = time.monotonic()
        rep.last_seen = now
        if reply.rid.startswith("hb"):
            load = reply.result or {}
            running, queued, pid = load.get("running"), load.get("queued"), load.get("pid")
            if not rep.live:
                self._join(rep, now, pid if isinstance(pid, int) else None)
            if isinstance(running, int) and isinstance(queued, int):
                self.ledger.reported[rep.index] = running + queued
                self._account(rep, running + queued, now)
            return
        done = self.fanout.reply(reply, rep.index)
        if done is not None:
            self.router.route(*done)

    def _account(self, rep: Replica, reported: int, now: float) -> None:
        """Lose a replica that answers heartbeats but whose outputs never reach us.

        It reports fewer requests than we have had in flight on it for longer
        than the heartbeat timeout (they must have arrived by now), and goes on
        doing so for another timeout: it finished them, or never saw them, and
        their outputs went elsewhere (a second consumer on its output
        endpoint) or nowhere. Not while its outputs are paused here: those it
        finished wait in its own backlog, legitimately unaccounted.
        """
        old = self.ledger.older(rep.index, now - self.heartbeat_timeout)
        if reported >= old or self._throttled:
            rep.unaccounted_since = None
        elif rep.unaccounted_since is None:
            rep.unaccounted_since = now
        elif now - rep.unaccounted_since > self.heartbeat_timeout:
            self._lose(rep, f"it reports {reported} requests, but {old} of ours have been in "
                            f"flight there for over {self.heartbeat_timeout} s: its outputs "
                            "do not reach this dispatcher (another consumer on its output "
                            "endpoint?)")

    # -- liveness ---------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self._next_tick = now + self.TICK
        for rep in self.replicas:
            if rep.live:
                why = rep.process_exit()
                if why is None and now - rep.last_seen > self.heartbeat_timeout:
                    why = f"silent for {now - rep.last_seen:.2f} s (heartbeat timeout " \
                          f"{self.heartbeat_timeout} s)"
                if why is not None:
                    self._lose(rep, why)
            if now >= rep.next_beat:
                rep.next_beat = now + self.heartbeat_interval
                self._hb_seq += 1
                try:  # a probe while not live: the first answer (re)joins it
                    rep.rpc.send_nowait(RpcReqInput(rid=f"hb{self._hb_seq}", method="get_load"))
                except ChannelError:
                    pass  # not connected yet, or not reading: its silence tells
        for done in self.fanout.expire(now):
            self.router.route(*done)
        self._throttle()

    def _join(self, rep: Replica, now: float, pid: int | None) -> None:
        if rep.orphans and pid is not None and pid != rep.pid:
            rep.orphans.clear()  # a new process: the old one's requests died with it
        for rid in sorted(rep.orphans):  # the same process, back: end what it still runs
            try:
                rep.work.send_nowait(AbortReq(rid=rid))
            except ChannelError as exc:
                log.warning("abort of orphan %r on %s not sent: %s", rid, rep.name, exc)
        rep.pid = pid
        rep.unaccounted_since = None
        rep.live = True
        rep.generation += 1
        rep.last_seen = now
        self.ledger.live[rep.index] = True
        self.stats["joined"] += 1
        log.info("%s %s (generation %d)", rep.name, "rejoined" if rep.joined else "joined",
                 rep.generation)
        rep.joined = True

    def _lose(self, rep: Replica, why: str) -> None:
        (log.info if self._stopping else log.warning)("%s lost: %s", rep.name, why)
        rep.live = False
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
            self.router.route(*done)

    def _watch(self, rep: Replica) -> None:
        self.receiver.add(rep.out)
        self.receiver.add(rep.rpc)

    def _throttle(self) -> None:
        """Pause the replicas' outputs while upstream is not reading (they back up
        into each replica's own bounded backlog)."""
        backlog = self.router.backlog
        if not self._throttled and backlog >= self.max_backlog // 2:
            self._throttled = True
            for rep in self.replicas:
                self.receiver.pause(rep.out.name)
        elif self._throttled and backlog == 0:
            self._throttled = False
            for rep in self.replicas:
                if rep.out.name in self.receiver.paused:
                    self.receiver.resume(rep.out.name)

    def _abort_stuck(self, rid: str) -> None:
        entry = self.ledger.finish(rid)
        if entry is not None:
            try:
                self.replicas[entry.replica].work.send_nowait(AbortReq(rid=rid))
            except ChannelError:
                pass  # the replica's own backlog will end it

    def _dropped_rpc(self, reply: RpcReqOutput) -> None:
        log.warning("rpc reply %r dropped: its caller is not reading", reply.rid)

    # -- stopping ---------------------------------------------------------------

    def _done(self) -> bool:
        if not self._stopping or len(self.fanout):
            return False
        return not len(self.ledger) or time.monotonic() >= self._stop_deadline

    def _finish(self) -> None:
        for rep in self.replicas:
            for entry in self.ledger.lose(rep.index):
                self._error(entry.rid, _WORK, "shutdown",
                            f"the dispatcher stopped before request {entry.rid!r} finished")
        deadline = time.monotonic() + 1.0
        while self.router.flush() and time.monotonic() < deadline:
            time.sleep(0.001)
