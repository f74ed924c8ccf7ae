"""``Scheduler``: turn requests into outputs and hand them to the router.

It touches no socket, no ring and no mode flag: requests arrive through a
:class:`~bus.Receiver` (whatever its inboxes are), handlers are chosen by
request type with the router's own specificity dispatch (:class:`~router.TypeTable`),
and every output leaves through a :class:`~router.Router`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bus import Envelope, LogSummary, Origin, Rejected
from messages import (
    AbortReq,
    ErrorCode,
    ErrorOut,
    KVHandoff,
    NotCarried,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
    RpcResult,
    TokenIds,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    concrete_types,
    fit_text,
)
from messages.checks import dp_rank_problem, input_ids_problem
from router import Router, TypeTable
from scheduler.core.admission import Admission, Limits
from scheduler.core.backpressure import InboxThrottle, collapse
from scheduler.core.batch import Batch, Seq, StepFailed
from scheduler.core.control import ControlMethods
from scheduler.core.handoff import handoff_of, resume_guide, seq_of, state_of
from scheduler.core.metrics import SchedulerMetrics, registry_for
from scheduler.core.outputs import embedding_outputs, stopped_by, token_outputs
from scheduler.core.rpc_methods import RpcMethods
from scheduler.models.guided import GuideError
from scheduler.models.protocol import Empty, Model, StateMismatch

__all__ = ["RequestSource", "Scheduler", "SchedulerStats", "Upstream"]

log = logging.getLogger("scheduler")
_one_replica = functools.partial(dp_rank_problem, replicas=1)  # a dispatcher consumes pins

Handler = Callable[[Request, Origin], None]


def _handoff_problem(h: KVHandoff) -> str:
    """What makes hand-off ``h`` impossible to continue, or ``""``."""
    n = len(h.output_ids)
    if not n:
        return f"hand-off of request {h.rid!r} carries no sampled token"
    if h.sent > n:
        return f"hand-off of request {h.rid!r} says {h.sent} tokens were sent of {n}"
    if h.logprobs is not None and h.logprobs.shape != (n,):
        return (f"hand-off of request {h.rid!r} has {h.logprobs.shape} logprobs for {n} "
                f"tokens")
    sp = h.sampling
    if h.sent < n and ((h.return_logprob and sp.top_logprobs) or sp.prompt_logprobs is not None):
        # A prefill scheduler sends a leaving request's tokens, their alternatives and
        # its prompt's logprobs before the hand-off; those never travel in it.
        return (f"hand-off of request {h.rid!r} asks for top or prompt logprobs but "
                f"{n - h.sent} of its {n} tokens were not sent before it")
    return ""


class RequestSource(Protocol):
    """Where requests come from: a :class:`~bus.Receiver`, or a tensor-parallel wrapper."""

    def pause(self, name: str) -> None:
        """Stop taking requests from inbox ``name`` (its outputs are not being read)."""
        ...

    def resume(self, name: str) -> None:
        """Take requests from inbox ``name`` again."""
        ...

    def poll(self) -> Sequence[Envelope[Request] | Rejected]:
        """Take what waits, never blocking."""
        ...

    def wait(self, timeout: float | None) -> bool:
        """Park until something waits or ``timeout`` passes."""
        ...


@dataclass(frozen=True, slots=True)
class Upstream:
    """Who reads the outputs of the requests taken from ``inbox``.

    ``gone()`` (asked at the start of every step, so it must be cheap and never
    block) says whether that reader went away since it was last asked: every
    request from ``inbox`` is then abandoned (:meth:`Scheduler.abandon`), since
    no answer of it can reach whoever asked. The wiring passes a
    :class:`bus.PeerWatch` on the output socket (its last peer disconnected).
    """

    inbox: str
    gone: Callable[[], bool]


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counters since start."""

    steps: int
    received: int
    rejected: int
    finished: int
    tokens: int
    running: int
    queued: int


class Scheduler(ControlMethods):
    """The loop: ``step()`` = poll, handle by type, one batch step, route outputs.

    Failure model: whatever one request does costs at most that request. A
    handler that raises answers its request with ``ErrorOut(code="internal")``
    (an rpc with ``success=False``) naming the error; a model step that raises
    fails the requests in that batch; the loop goes on either way.

    Args:
        receiver: every inbox the scheduler serves (work and rpc).
        router: where outputs go (see :func:`router.scheduler_router`).
        model: the model to run.
        max_batch: most requests decoding at once; the rest queue.
        max_prefill_tokens: most prompt tokens read in one step, a prompt
            counting at least 16, so a burst of new requests cannot make one
            step long enough to delay an rpc or the running streams. A prompt
            longer than this is read over several steps (chunked prefill).
            The default keeps a long prompt's step near 20 ms with the default
            model on two CPU cores (a 2048-token chunk took 75 ms, a 1024 one
            let an rpc wait 126 ms).
        limits: admission and output-backlog bounds (:class:`Limits`).
        idle_timeout: longest single park in :meth:`run` (any inbox wakes it
            sooner).
        rank, world_size: this scheduler's tensor-parallel rank (checkpoints
            are written one shard per rank).
        rpc_reduce: combines this rank's rpc reply with the other ranks'
            (see :func:`scheduler.launch.tp.rpc_reducer`); ``None`` answers nothing.
        metrics: record Prometheus metrics (:mod:`scheduler.core.metrics`);
            :attr:`registry` exposes them.
        tell_ranks: rank 0 of several: hands the other ranks a request
            this rank decided on alone (an abort of a request whose outputs
            are stuck), so every rank keeps the same batch.
        empty: makes the tensor a hand-off's state is written into (the output
            outbox's ``PushOutbox.empty``: a slab, so it crosses with no copy).
        handoff_bytes: the bytes this scheduler's sends hold now (the output pool's
            ``FramePool.bytes_unreleased``, unreleased by their receivers, plus the
            outbox's ``PushOutbox.bytes_unsent``, not yet written to a ``tcp://``
            connection); a read prompt is handed off only while they and this step's
            hand-offs are under ``limits.max_handoff_bytes``, else it waits here, in
            order (``None``: not bounded). A hand-off larger than the bound alone is
            answered ``invalid_request`` (rid, size, bound), whatever the transport.
        upstream: who reads the outputs of one inbox's requests (:class:`Upstream`);
            when it goes, those requests are abandoned (``None``: never).
    """

    def __init__(self, receiver: RequestSource, router: Router[Output], model: Model, *,
                 max_batch: int = 64, max_prefill_tokens: int = 512,
                 idle_timeout: float = 1.0, rank: int = 0, world_size: int = 1,
                 rpc_reduce: Callable[[RpcReqOutput], RpcReqOutput | None] | None = None,
                 limits: Limits | None = None, metrics: bool = True,
                 tell_ranks: Callable[[Request], None] | None = None,
                 empty: Empty | None = None,
                 handoff_bytes: Callable[[], int] | None = None,
                 upstream: Upstream | None = None) -> None:
        self.receiver = receiver
        self._upstream = upstream
        #: Requests abandoned, and queued outputs dropped, because their reader went.
        self.upstream_aborts = self.upstream_dropped = 0
        self._empty = empty
        self._handoff_bytes = handoff_bytes
        #: Read for another scheduler to decode, waiting for hand-off room (their
        #: state held in the model, out of the running batch), in order. Each keeps
        #: its batch slot (``Batch.held``): new prompts wait for room, never pile up.
        self._held: deque[Seq] = deque()
        self.router = router
        self.model = model
        self.admission = Admission(limits or Limits())
        self.batch = Batch(model, self.admission, max_batch=max_batch,
                           max_prefill_tokens=max_prefill_tokens)
        self.batch.held = self._held
        self._worked = False  # whether the last step ran the model
        router.on_overflow = functools.partial(collapse, abort=self._silence,
                                               dropped_rpc=self._dropped_rpc)
        self._rejects = LogSummary(log, "rejected messages with no readable rid")
        self._misaddressed = LogSummary(log, "unanswered requests reusing a live rid")
        self._not_carried = LogSummary(log, "messages refused by a channel not carrying them")
        self.idle_timeout = idle_timeout
        self.rpc = RpcMethods()
        self.rank = rank
        self.world_size = world_size
        self._rpc_reduce = rpc_reduce
        self._tell_ranks = tell_ranks
        self._throttle = InboxThrottle(receiver, self.admission.limits.max_backlog // 2)
        self._now = time.monotonic()  # the current step's start: one clock read per step
        self.backlog_aborts = 0
        self.metrics = SchedulerMetrics() if metrics else None
        self.registry = registry_for(self, self.metrics) if self.metrics is not None else None
        self._digest = hashlib.blake2b(digest_size=16)
        self._handlers: TypeTable[Request, Handler] = TypeTable(
            Request, concrete_types(Request))
        self._handlers.register(TokenizedGenerateReqInput, self._on_generate)  # type: ignore[arg-type]
        self._handlers.register(TokenizedEmbeddingReqInput, self._on_embed)  # type: ignore[arg-type]
        self._handlers.register(AbortReq, self._on_abort)  # type: ignore[arg-type]
        self._handlers.register(RpcReqInput, self._on_rpc)  # type: ignore[arg-type]
        self._handlers.register(KVHandoff, self._on_handoff)  # type: ignore[arg-type]
        self._handlers.freeze()
        self._live: dict[str, Seq] = {}
        self._aborted: list[Seq] = []
        self._stopping = False
        self._steps = self._received = self._rejected = self._finished = self._tokens = 0
        self._rate_t0 = time.monotonic()
        self._rate_tokens = 0
        self._rate = 0.0
        for name, fn in (("save_checkpoint", self.save_checkpoint),
                         ("load_checkpoint", self.load_checkpoint),
                         ("flush_cache", self.flush_cache), ("get_load", self.get_load),
                         ("token_digest", self.token_digest), ("metrics", self.metrics_text),
                         ("model_info", self.model_info), ("shutdown", self.request_shutdown)):
            self.rpc.register(name, fn)

    # -- the loop -------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Whether a shutdown was requested."""
        return self._stopping

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.batch or self._aborted or self._held)

    def run(self, stop_requested: Callable[[], bool] | None = None, *,
            finishing: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`request_shutdown`; then answer everything left and return.

        ``stop_requested`` (a command's stop signal,
        :class:`~scheduler.cli.signals.StopSignals`) is asked every step, however busy:
        once true, the loop ends as on a ``KeyboardInterrupt`` (everything answered
        ``shutdown``), even where the signal's own exception was discarded.
        ``finishing`` is called once the loop ends, before those answers are routed
        (the wiring tracks its output socket's writes from there: they must leave
        before the process exits).
        """
        try:
            while not self._stopping:
                if stop_requested is not None and stop_requested():
                    raise KeyboardInterrupt("stop requested")
                with self.router.batching():  # a step's outputs leave as one burst
                    received = self.step()
                if not received and not self.busy and not self._stopping:
                    # Outputs waiting for a consumer are retried every few ms;
                    # otherwise park until any inbox wakes us.
                    self.receiver.wait(0.005 if self.router.backlog else self.idle_timeout)
                elif not received and self._held and not self._worked and not self._aborted:
                    # Nothing moved but hand-offs waiting for room (and the prompts
                    # waiting for the slots they keep): look again soon, not at once.
                    self.receiver.wait(0.005)
        except BaseException as exc:
            # Still answer everyone, saying why, before the error propagates.
            if finishing is not None:
                finishing()
            self.finish_all(*stopped_by(exc, "scheduler"))
            raise
        else:
            if finishing is not None:
                finishing()
            self.finish_all("shutdown")
        finally:  # a burst's tail, logged as the loop ends (else at the exit)
            for summary in (self._rejects, self._misaddressed, self._not_carried):
                summary.flush()

    def step(self) -> int:
        """One iteration: poll, handle, one model step, route. Returns how many were polled."""
        self._steps += 1
        self._now = t0 = time.monotonic()
        if self._upstream is not None and self._upstream.gone():
            self.abandon(self._upstream.inbox)
        if self.router.backlog:
            self.router.flush()
        envelopes = self.receiver.poll()
        self._received += len(envelopes)
        lookup = self._handlers.lookup
        counts = self.metrics.received if self.metrics is not None else None
        for env in envelopes:
            if type(env) is Rejected:
                self._on_rejected(env)
                continue
            assert isinstance(env, Envelope)
            msg = env.message
            if counts is not None:
                key = (env.origin.inbox, type(msg))
                counts[key] = counts.get(key, 0) + 1
            try:
                lookup(type(msg))(msg, env.origin)
            except Exception as exc:  # costs this request alone
                self._handler_failed(msg, env.origin, exc)
        self._emit_aborted()
        if self._held:
            self._send_held()
        self._worked = worked = self._run_batch()
        if self._throttle.paused or self.router.backlog:
            self._throttle.update(self.router.backlog_by_origin())
        if self.metrics is not None and (envelopes or worked):
            self.metrics.step.observe(time.monotonic() - t0)
        return len(envelopes)

    def request_shutdown(self) -> RpcResult:
        """Stop after the current step (the ``shutdown`` rpc method)."""
        self._stopping = True
        running, queued = self._queue_sizes()
        return {"running": running, "queued": queued}

    def finish_all(self, code: ErrorCode = "shutdown",
                   message: str = "the scheduler shut down before the request finished") -> int:
        """Answer every queued and running request with a terminal :class:`ErrorOut`."""
        held = list(self._held)
        self._held.clear()  # (the deque Batch.held counts: cleared, not replaced)
        for s in held:
            self.batch.model.free(s.key)
        seqs = [s for s in [*self.batch.clear(), *held] if not s.silenced]
        for seq in seqs:
            self._live.pop(seq.req.rid, None)
            self._error(seq.req.rid, seq.origin, code, message)
        self._emit_aborted()
        return len(seqs)

    def abandon(self, inbox: str) -> int:
        """Drop every request taken from ``inbox``, answering none: their reader is gone.

        Each is dropped as the output backlog's overflow drops one
        (:meth:`_drop_unanswered`); their outputs still waiting here are dropped,
        so none reaches whoever reads next. Counted in ``upstream_aborts`` and
        ``upstream_dropped``; returns how many requests were dropped.
        """
        seqs = [s for s in self._live.values() if s.origin.inbox == inbox]
        for seq in seqs:
            self._drop_unanswered(seq.req.rid)
        # Aborts not yet answered: their answer has no reader either.
        kept = [s for s in self._aborted if s.origin.inbox != inbox]
        dropped = len(self._aborted) - len(kept) + self.router.discard(inbox)
        self._aborted = kept
        self.upstream_aborts += len(seqs)
        self.upstream_dropped += dropped
        if seqs or dropped:
            log.warning("the reader of the outputs of inbox %r went away: dropped its %d "
                        "requests in flight and %d outputs waiting for it",
                        inbox, len(seqs), dropped)
        return len(seqs)

    # -- handlers -------------------------------------------------------------

    def _on_rejected(self, env: Rejected) -> None:
        self._rejected += 1
        err = env.error
        if self.metrics is not None:
            self.metrics.reject(env.origin.inbox, err)
        wrong_channel = isinstance(err, NotCarried)  # a misconfigured peer: always logged
        if wrong_channel or err.rid is None:  # summarized in the log now and then
            (self._not_carried if wrong_channel else self._rejects).add(env.origin.inbox,
                                                                        str(err))
        if err.rid is None:
            return  # nobody to answer: counted
        if err.message_type == RpcReqInput.__name__ and not wrong_channel:  # only rpc's own
            self._route(RpcReqOutput(rid=err.rid, success=False, message=fit_text(str(err))),
                        env.origin)
        else:
            self._refuse(err.rid, env.origin, "decode_error", str(err))

    def _handler_failed(self, msg: Request, origin: Origin, exc: Exception) -> None:
        log.exception("handling %s rid=%r failed", type(msg).__name__, msg.rid)
        text = f"{type(msg).__name__} rid={msg.rid!r} failed: {type(exc).__name__}: {exc}"
        if isinstance(msg, RpcReqInput):
            self._route(RpcReqOutput(rid=msg.rid, success=False, message=fit_text(text)), origin)
        else:
            self._refuse(msg.rid, origin, "internal", text)

    def _on_generate(self, req: TokenizedGenerateReqInput, origin: Origin) -> None:
        problem = self._check_ids(req.input_ids, req.rid) or _one_replica(req.rid, req.dp_rank)
        if problem:
            self._refuse(req.rid, origin, "invalid_request", problem)
            return
        sp = req.sampling
        seq = Seq(req, origin, len(req.input_ids) + sp.max_new_tokens, sp, req.stream,
                  req.return_logprob, t_arrival=self._now)
        if sp.guide is not None:
            try:
                seq.matcher = self.batch.guides.start(req.rid, sp.guide)
            except GuideError as exc:
                self._refuse(req.rid, origin, "invalid_request", str(exc))
                return
        if sp.max_new_tokens == 0 and sp.prompt_logprobs is None:  # (else: scored first)
            seq.finished = "length"
            self._live[req.rid] = seq
            self._emit([seq])
            return
        refused = self.batch.queue(seq)
        if refused:
            self._refuse(req.rid, origin, "overloaded", refused)
            return
        self._live[req.rid] = seq

    def _on_embed(self, req: TokenizedEmbeddingReqInput, origin: Origin) -> None:
        problem = self._check_ids(req.input_ids, req.rid) or _one_replica(req.rid, req.dp_rank)
        if problem:
            self._refuse(req.rid, origin, "invalid_request", problem)
            return
        seq = Seq(req, origin, len(req.input_ids), t_arrival=self._now)  # read like a prompt
        refused = self.batch.queue(seq)
        if refused:
            self._refuse(req.rid, origin, "overloaded", refused)
            return
        self._live[req.rid] = seq

    def _on_handoff(self, h: KVHandoff, origin: Origin) -> None:
        """Adopt a request another scheduler prefilled: it decodes here from the next step."""
        problem = self._check_ids(h.input_ids, h.rid) or _handoff_problem(h)
        if problem:
            self._refuse(h.rid, origin, "invalid_request", problem)
            return
        seq = seq_of(h, origin, self._now)
        try:
            resume_guide(seq, self.batch.guides)
        except GuideError as exc:
            self._refuse(h.rid, origin, "invalid_request",
                         f"hand-off of request {h.rid!r} refused: {exc.reason}")
            return
        try:
            refused = self.batch.adopt(seq, state_of(h), h.rng_state)
        except StateMismatch as exc:  # another model, dtype or shape
            self._refuse(h.rid, origin, "invalid_request",
                         f"hand-off of request {h.rid!r} refused: {exc}")
            return
        if refused:
            self._refuse(h.rid, origin, "overloaded", f"hand-off of request {h.rid!r} "
                         f"refused: {refused}")
            return
        self._live[h.rid] = seq

    def _hand_off(self, seqs: list[Seq]) -> None:
        """Requests read here for another scheduler to decode leave, as hand-offs, in
        order, while the bytes in flight allow (:meth:`_send_held`); the rest wait."""
        for s in seqs:
            req = s.req
            if (s.finished is not None or not isinstance(req, TokenizedGenerateReqInput)
                    or not req.prefill_only or self._live.get(req.rid) is not s):
                continue
            self.batch.running.remove(s)  # decodes no further here; its state kept
            self._held.append(s)
        if self._held:
            self._send_held()

    def _send_held(self) -> None:
        """Hand off the waiting requests, oldest first, while the bytes of hand-offs
        not yet released (and of those sent this step) are under the bound."""
        bound = self.admission.limits.max_handoff_bytes
        in_flight = self._handoff_bytes() if self._handoff_bytes is not None else 0
        while self._held and (in_flight < bound or self._handoff_bytes is None):
            s = self._held.popleft()
            req = s.req
            assert isinstance(req, TokenizedGenerateReqInput)
            try:
                h = handoff_of(s, self.model, self._empty)
            except (KeyError, NotImplementedError) as exc:
                self._live.pop(req.rid, None)
                self.batch.remove(s)
                self._error(req.rid, s.origin, "internal",
                            f"request {req.rid!r} could not be handed off: {exc}")
                continue
            self._live.pop(req.rid, None)
            self.batch.remove(s)  # its state here is freed: the hand-off holds a copy
            if h.kv.nbytes > bound:  # it could never fit: the request ends here
                self._error(req.rid, s.origin, "invalid_request",
                            f"request {req.rid!r}: its hand-off of {h.kv.nbytes} bytes "
                            f"exceeds max_handoff_bytes={bound}")
                continue
            self._route(h, s.origin)
            in_flight += h.kv.nbytes  # (sent with the step's burst: not counted yet)

    def _on_abort(self, req: AbortReq, origin: Origin) -> None:
        # Idempotent: the first abort takes the request out of _live, so a
        # second one (in the same poll or later) finds nothing to do.
        seq = self._unlink(req.rid)
        if seq is None:
            return  # unknown or already finished: nothing to answer
        seq.finished = "abort"
        self._aborted.append(seq)

    def _unlink(self, rid: str) -> Seq | None:
        """Take a live request out of every queue; ``None`` if it is not live."""
        seq = self._live.pop(rid, None)
        if seq is not None:
            self.batch.remove(seq)
            if seq in self._held:
                self._held.remove(seq)
        return seq

    def _silence(self, rid: str) -> None:
        """Abort a request whose terminal error the backlog already holds (see backpressure)."""
        if self._drop_unanswered(rid):
            self.backlog_aborts += 1

    def _drop_unanswered(self, rid: str) -> bool:
        """End request ``rid`` with no output of its own from now on: its slot, model state,
        cache pins and hand-off room freed at the next step, the other tensor-parallel
        ranks told by an ``AbortReq`` in the step broadcast. False: it was not live."""
        seq = self._unlink(rid)
        if seq is None:
            return False
        seq.silenced = True
        seq.finished = "abort"
        self._finished += 1
        if self._tell_ranks is not None:
            self._tell_ranks(AbortReq(rid=rid))
        return True

    def _dropped_rpc(self, reply: RpcReqOutput) -> None:
        log.warning("dropped the rpc reply rid=%r: its client is not reading its replies",
                    reply.rid)

    def _on_rpc(self, req: RpcReqInput, origin: Origin) -> None:
        reply: RpcReqOutput | None = self.rpc.answer(req)
        if self._rpc_reduce is not None and reply is not None:
            reply = self._rpc_reduce(reply)
        if reply is not None:
            self._route(reply, origin)
        if self.metrics is not None:  # bounded label: registered names, else "unknown"
            method = req.method if req.method in self.rpc.methods else "unknown"
            self.metrics.rpc_latency(method, time.monotonic() - self._now)

    # -- model work -----------------------------------------------------------

    def _run_batch(self) -> bool:
        """One model step; returns whether it ran anything."""
        try:
            active, embeddings = self.batch.step(self._admit_failed, self._now)
        except StepFailed as exc:  # these requests fail, the loop goes on
            log.error("%s", exc, exc_info=exc.error)
            for s in exc.seqs:
                if self._live.pop(s.req.rid, None) is s:
                    self._error(s.req.rid, s.origin, "internal", str(exc))
            return True
        m = self.metrics
        if m is not None and (active or embeddings):
            now = time.monotonic()
            m.on_tokens(active, now)
            m.on_embedded(embeddings, now)
        if embeddings:
            self._emit_embeddings(embeddings)
        if not active:
            return bool(embeddings)
        n = len(active)
        self._digest.update(np.asarray([s.last for s in active], np.int64).tobytes())
        self._tokens += n
        self._rate_tokens += n
        self._emit(active)
        self._hand_off(active)
        return True

    def _emit_embeddings(self, seqs: list[Seq]) -> None:
        done = [s for s in seqs if self._live.pop(s.req.rid, None) is s]
        self._finished += len(done)
        for output, origin in embedding_outputs(done):
            self._route(output, origin)

    def _admit_failed(self, seq: Seq, exc: Exception) -> None:
        self._live.pop(seq.req.rid, None)
        self._handler_failed(seq.req, seq.origin, exc)

    # -- outputs --------------------------------------------------------------

    def _emit_aborted(self) -> None:
        if self._aborted:
            seqs, self._aborted = self._aborted, []
            self._emit(seqs)

    def _emit(self, seqs: list[Seq]) -> None:
        """Route this step's token outputs; finished requests leave the live table."""
        failed = [s for s in seqs if s.guide_error is not None and not s.silenced]
        if failed:  # a guide failed while decoding: an error, never a finish_reason
            for s in failed:
                if self._live.pop(s.req.rid, None) is s:
                    self._error(s.req.rid, s.origin, "invalid_request",
                                f"request {s.req.rid!r}: {s.guide_error}")
            seqs = [s for s in seqs if s.guide_error is None]
        for s in seqs:
            if s.finished is not None and not s.silenced:
                self._finished += 1
                self._live.pop(s.req.rid, None)
        for output, origin in token_outputs(seqs):
            self._route(output, origin)

    def _refuse(self, rid: str, origin: Origin, code: ErrorCode, message: str) -> None:
        """Answer a request that was *not* accepted, unless its rid names one in flight.

        An answer carries nothing but the rid to tell requests apart, so an
        error for a second request reusing a live rid would end the first
        one in its client's eyes. Such a request is counted and logged
        instead: a reply goes only to whoever asked.
        """
        if rid in self._live:
            self._misaddressed.add(origin.inbox, f"rid {rid!r} is in flight: {message}")
            if self.metrics is not None:
                key = (origin.inbox, "duplicate_rid")
                self.metrics.rejected[key] = self.metrics.rejected.get(key, 0) + 1
            return
        self._error(rid, origin, code, message)

    def _error(self, rid: str, origin: Origin, code: ErrorCode, message: str) -> None:
        self._finished += 1
        self._route(ErrorOut(rid=rid, code=code, message=fit_text(message)), origin)

    def _route(self, output: Output, origin: Origin) -> None:
        self.router.route(output, origin)  # a failing sink is isolated by the router

    def _check_ids(self, ids: TokenIds, rid: str) -> str:
        if rid in self._live:
            return f"request id {rid!r} is already in flight"
        return input_ids_problem(rid, ids, self.model_facts().vocab_size,
                                 self.batch.model.max_prompt_tokens)

    def _queue_sizes(self) -> tuple[int, int]:
        return len(self.batch.running) + len(self._held), self.batch.queued

    def statistics(self) -> SchedulerStats:
        """A snapshot of the counters."""
        return SchedulerStats(self._steps, self._received, self._rejected, self._finished,
                              self._tokens, *self._queue_sizes())
