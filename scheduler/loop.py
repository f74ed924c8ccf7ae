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
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from bus import Envelope, Origin, Rejected
from messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    ErrorCode,
    ErrorOut,
    FinishReason,
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
    packed_u32,
    token_ids,
)
from router import Router, TypeTable
from scheduler.admission import Admission, Limits
from scheduler.backpressure import collapse
from scheduler.control import ControlMethods
from scheduler.logsummary import LogSummary
from scheduler.model import TinyLM
from scheduler.rpc_methods import RpcMethods
from scheduler.sampling import sample_next

__all__ = ["RequestSource", "Scheduler", "SchedulerStats"]

log = logging.getLogger("scheduler")

Handler = Callable[[Request, Origin], None]
_MIN_PREFILL_COST = 32


def _as_tensor(ids: TokenIds) -> torch.Tensor:
    """Token ids as the int64 tensor an embedding lookup wants (one copy)."""
    return torch.from_numpy(np.frombuffer(ids, np.uint32).astype(np.int64))


class RequestSource(Protocol):
    """Where requests come from: a :class:`~bus.Receiver`, or a tensor-parallel wrapper."""

    def poll(self) -> Sequence[Envelope[Request] | Rejected]:
        """Take what waits, never blocking."""
        ...

    def wait(self, timeout: float | None) -> bool:
        """Park until something waits or ``timeout`` passes."""
        ...


@dataclass(slots=True)
class _Seq:
    """A generate request in flight (its sampler state is made at admission)."""

    req: TokenizedGenerateReqInput
    origin: Origin
    cost: int  # what it counts against the queue's token bound
    stop: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    state: torch.Tensor | None = None
    prefilled: int = 0  # prompt tokens read so far (a long prompt takes several steps)
    silenced: bool = False  # aborted by backpressure: its terminal error is already queued
    last: int = -1
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    sent: int = 0  # tokens already streamed
    finished: FinishReason | None = None


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
            counting at least 32, so a burst of new requests cannot make one
            step long enough to delay an rpc or the running streams. A prompt
            longer than this is read over several steps (chunked prefill).
        limits: admission and output-backlog bounds (:class:`Limits`).
        idle_timeout: longest single park in :meth:`run` (any inbox wakes it
            sooner).
        rank, world_size: this scheduler's tensor-parallel rank (checkpoints
            are written one shard per rank).
        rpc_reduce: combines this rank's rpc reply with the other ranks'
            (see :func:`scheduler.tp.rpc_reducer`); ``None`` answers nothing.
    """

    def __init__(self, receiver: RequestSource, router: Router[Output], model: TinyLM, *,
                 max_batch: int = 64, max_prefill_tokens: int = 2048,
                 idle_timeout: float = 1.0, rank: int = 0, world_size: int = 1,
                 rpc_reduce: Callable[[RpcReqOutput], RpcReqOutput | None] | None = None,
                 limits: Limits | None = None) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be >= 1")
        self.receiver = receiver
        self.router = router
        self.model = model
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.admission = Admission(limits or Limits())
        router.on_overflow = functools.partial(collapse, abort=self._silence,
                                               dropped_rpc=self._dropped_rpc)
        self._rejects = LogSummary(log, "rejected messages with no readable rid")
        self.idle_timeout = idle_timeout
        self.rpc = RpcMethods()
        self.rank = rank
        self.world_size = world_size
        self._rpc_reduce = rpc_reduce
        self._digest = hashlib.blake2b(digest_size=16)
        self._handlers: TypeTable[Request, Handler] = TypeTable(
            Request, concrete_types(Request))
        self._handlers.register(TokenizedGenerateReqInput, self._on_generate)  # type: ignore[arg-type]
        self._handlers.register(TokenizedEmbeddingReqInput, self._on_embed)  # type: ignore[arg-type]
        self._handlers.register(AbortReq, self._on_abort)  # type: ignore[arg-type]
        self._handlers.register(RpcReqInput, self._on_rpc)  # type: ignore[arg-type]
        self._handlers.freeze()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._embeds: list[tuple[TokenizedEmbeddingReqInput, Origin]] = []
        self._live: dict[str, _Seq] = {}
        self._aborted: list[_Seq] = []
        self._stopping = False
        self._steps = self._received = self._rejected = self._finished = self._tokens = 0
        self._rate_t0 = time.monotonic()
        self._rate_tokens = 0
        self._rate = 0.0
        for name, fn in (("save_checkpoint", self.save_checkpoint),
                         ("load_checkpoint", self.load_checkpoint),
                         ("flush_cache", self.flush_cache), ("get_load", self.get_load),
                         ("token_digest", self.token_digest),
                         ("shutdown", self.request_shutdown)):
            self.rpc.register(name, fn)

    # -- the loop -------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """Whether a shutdown was requested."""
        return self._stopping

    @property
    def busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._running or self._waiting or self._embeds or self._aborted)

    def run(self) -> None:
        """Serve until :meth:`request_shutdown`; then answer everything left and return."""
        try:
            while not self._stopping:
                received = self.step()
                if not received and not self.busy and not self._stopping:
                    # Outputs waiting for a consumer are retried every few ms;
                    # otherwise park until any inbox wakes us.
                    self.receiver.wait(0.005 if self.router.backlog else self.idle_timeout)
        except BaseException as exc:
            # Still answer everyone, saying why, before the error propagates.
            self.finish_all("internal", f"the scheduler failed: {type(exc).__name__}: {exc}")
            raise
        self.finish_all("shutdown")

    def step(self) -> int:
        """One iteration: poll, handle, one model step, route. Returns how many were polled."""
        self._steps += 1
        if self.router.backlog:
            self.router.flush()
        envelopes = self.receiver.poll()
        self._received += len(envelopes)
        lookup = self._handlers.lookup
        for env in envelopes:
            if type(env) is Rejected:
                self._on_rejected(env)
                continue
            assert isinstance(env, Envelope)
            msg = env.message
            try:
                lookup(type(msg))(msg, env.origin)
            except Exception as exc:  # costs this request alone
                self._handler_failed(msg, env.origin, exc)
        self._emit_aborted()
        self._run_embeddings()
        self._run_batch()
        return len(envelopes)

    def request_shutdown(self) -> RpcResult:
        """Stop after the current step (the ``shutdown`` rpc method)."""
        self._stopping = True
        return {"running": len(self._running), "queued": len(self._waiting)}

    def finish_all(self, code: ErrorCode = "shutdown",
                   message: str = "the scheduler shut down before the request finished") -> int:
        """Answer every queued and running request with a terminal :class:`ErrorOut`."""
        seqs = [s for s in (*self._running, *self._waiting) if not s.silenced]
        self._running.clear()
        self._waiting.clear()
        self.admission.clear()
        for seq in seqs:
            self._live.pop(seq.req.rid, None)
            self._error(seq.req.rid, seq.origin, code, message)
        for req, origin in self._embeds:
            self._error(req.rid, origin, code, message)
        self._embeds.clear()
        self._emit_aborted()
        return len(seqs)

    # -- handlers -------------------------------------------------------------

    def _on_rejected(self, env: Rejected) -> None:
        self._rejected += 1
        err = env.error
        if err.rid is None:
            # Nobody to answer: counted, and summarized in the log now and then.
            self._rejects.add(env.origin.inbox, err.reason)
            return
        if err.message_type == RpcReqInput.__name__:
            self._route(RpcReqOutput(rid=err.rid, success=False, message=fit_text(str(err))),
                        env.origin)
        else:
            self._error(err.rid, env.origin, "decode_error", str(err))

    def _handler_failed(self, msg: Request, origin: Origin, exc: Exception) -> None:
        log.exception("handling %s rid=%r failed", type(msg).__name__, msg.rid)
        text = f"{type(msg).__name__} rid={msg.rid!r} failed: {type(exc).__name__}: {exc}"
        if isinstance(msg, RpcReqInput):
            self._route(RpcReqOutput(rid=msg.rid, success=False, message=fit_text(text)), origin)
        else:
            self._error(msg.rid, origin, "internal", text)

    def _on_generate(self, req: TokenizedGenerateReqInput, origin: Origin) -> None:
        problem = self._check_ids(req.input_ids, req.rid)
        if problem:
            self._error(req.rid, origin, "invalid_request", problem)
            return
        sp = req.sampling
        cost = len(req.input_ids) + sp.max_new_tokens
        refused = self.admission.refuse(cost)
        if refused:
            self._error(req.rid, origin, "overloaded", refused)
            return
        seq = _Seq(req, origin, cost)
        if sp.max_new_tokens == 0:
            seq.finished = "length"
            self._live[req.rid] = seq
            self._emit([seq])
            return
        self._waiting.append(seq)
        self.admission.enter(cost)
        self._live[req.rid] = seq

    def _admit(self, seq: _Seq) -> None:
        """Make a request's per-request state as it leaves the queue for the batch."""
        self.admission.leave(seq.cost)
        sp = seq.req.sampling
        if sp.stop_token_ids is not None:
            seq.stop = frozenset(sp.stop_token_ids.tolist())
        if sp.temperature > 0 and sp.top_k != 1:
            # No seed: derive one from the rid, so every tensor-parallel rank
            # samples the same tokens for the same request.
            seed = sp.seed if sp.seed is not None else int.from_bytes(
                hashlib.blake2b(seq.req.rid.encode(), digest_size=8).digest(), "little") >> 1
            seq.generator = torch.Generator().manual_seed(seed)

    def _on_embed(self, req: TokenizedEmbeddingReqInput, origin: Origin) -> None:
        problem = self._check_ids(req.input_ids, req.rid)
        if problem:
            self._error(req.rid, origin, "invalid_request", problem)
            return
        self._embeds.append((req, origin))

    def _on_abort(self, req: AbortReq, origin: Origin) -> None:
        # Idempotent: the first abort takes the request out of _live, so a
        # second one (in the same poll or later) finds nothing to do.
        seq = self._unlink(req.rid)
        if seq is None:
            return  # unknown or already finished: nothing to answer
        seq.finished = "abort"
        self._aborted.append(seq)

    def _unlink(self, rid: str) -> _Seq | None:
        """Take a live request out of every queue; ``None`` if it is not live."""
        seq = self._live.pop(rid, None)
        if seq is None:
            return None
        if seq in self._waiting:
            self._waiting.remove(seq)
            self.admission.leave(seq.cost)
        elif seq in self._running:
            self._running.remove(seq)
        return seq

    def _silence(self, rid: str) -> None:
        """Abort a request whose terminal error the backlog already holds (see backpressure)."""
        seq = self._unlink(rid)
        if seq is not None:
            seq.silenced = True
            seq.finished = "abort"
            self._finished += 1

    def _dropped_rpc(self, reply: RpcReqOutput) -> None:
        log.warning("dropped the rpc reply rid=%r: its client is not reading its replies",
                    reply.rid)

    def _on_rpc(self, req: RpcReqInput, origin: Origin) -> None:
        reply: RpcReqOutput | None = self.rpc.answer(req)
        if self._rpc_reduce is not None and reply is not None:
            reply = self._rpc_reduce(reply)
        if reply is not None:
            self._route(reply, origin)

    # -- model work -----------------------------------------------------------

    def _run_embeddings(self) -> None:
        if not self._embeds:
            return
        by_origin: dict[Origin, list[tuple[str, torch.Tensor]]] = {}
        for req, origin in self._embeds:
            vec = self.model.embed_text(_as_tensor(req.input_ids))
            by_origin.setdefault(origin, []).append((req.rid, vec))
        self._embeds.clear()
        for origin, rows in by_origin.items():
            self._finished += len(rows)
            self._route(BatchEmbeddingOut(rids=[r for r, _ in rows],
                                          embeddings=torch.stack([v for _, v in rows])), origin)

    def _run_batch(self) -> None:
        new, chunk = self._take_prefill()
        active = self._running + new
        if not active and chunk is None:
            return
        try:
            rows = self._forward(new, chunk)
            if not active:
                return
            toks, lps = sample_next(torch.stack(rows), [s.req.sampling for s in active],
                                    [s.generator for s in active])
        except Exception as exc:  # the model failed: these requests fail, the loop goes on
            log.exception("model step failed")
            failed = active + ([chunk] if chunk is not None else [])
            self._running = []
            for s in failed:
                if self._unlink(s.req.rid) is not None:
                    self._error(s.req.rid, s.origin, "internal",
                                f"the model step failed: {type(exc).__name__}: {exc}")
            return
        for s, t, lp in zip(active, toks.tolist(), lps.tolist(), strict=True):
            s.last = t
            if t in s.stop:
                s.finished = "stop"
            else:
                s.out.append(t)
                s.lps.append(lp)
                if len(s.out) >= s.req.sampling.max_new_tokens:
                    s.finished = "length"
        n = len(active)
        self._digest.update(toks.numpy().tobytes())
        self._tokens += n
        self._rate_tokens += n
        self._running = [s for s in active if s.finished is None]
        self._emit(active)

    def _take_prefill(self) -> tuple[list[_Seq], _Seq | None]:
        """Requests whose prompt ends this step, and one whose long prompt goes on after it.

        At most ``max_prefill_tokens`` prompt tokens are read per step (a
        request counts at least 32): a prompt longer than what is left of
        the budget is read in chunks, one per step, at the head of the queue.
        """
        new: list[_Seq] = []
        budget = self.max_prefill_tokens
        while self._waiting and len(self._running) + len(new) < self.max_batch:
            seq = self._waiting[0]
            left = len(seq.req.input_ids) - seq.prefilled
            cost = max(_MIN_PREFILL_COST, left)
            if cost <= budget or left <= budget:
                budget -= cost
                self._waiting.popleft()
                try:
                    self._admit(seq)
                except Exception as exc:  # e.g. a seed torch refuses: this request alone
                    self._live.pop(seq.req.rid, None)
                    self._handler_failed(seq.req, seq.origin, exc)
                    continue
                new.append(seq)
                continue
            if budget >= _MIN_PREFILL_COST or not new:
                return new, seq  # read ``budget`` tokens of it now, the rest later
            break
        return new, None

    def _forward(self, new: list[_Seq], chunk: _Seq | None) -> list[torch.Tensor]:
        """Decode the running batch, read the new prompts (and a chunk); next-token logits."""
        rows: list[torch.Tensor] = []
        if self._running:
            tokens = torch.tensor([s.last for s in self._running])
            states = torch.stack([s.state for s in self._running])  # type: ignore[misc]
            logits, states = self.model.decode(tokens, states)
            rows.extend(logits)
            for s, st in zip(self._running, states, strict=True):
                s.state = st
        prompts = [_as_tensor(s.req.input_ids[s.prefilled :]) for s in new]
        starts = [s.state for s in new]
        if chunk is not None:
            used = sum(max(_MIN_PREFILL_COST, len(p)) for p in prompts)
            size = max(1, self.max_prefill_tokens - used)
            prompts.append(_as_tensor(chunk.req.input_ids[chunk.prefilled : chunk.prefilled
                                                           + size]))
            starts.append(chunk.state)
        if prompts:
            logits_new, states_new = self.model.prefill_batch(prompts, starts)
            for s, st in zip([*new, *([chunk] if chunk is not None else [])], states_new,
                             strict=True):
                s.state = st
            if chunk is not None:
                chunk.prefilled += len(prompts[-1])
                logits_new = logits_new[:-1]  # mid-prompt: nothing to sample yet
            rows.extend(logits_new)
        return rows

    # -- outputs --------------------------------------------------------------

    def _emit_aborted(self) -> None:
        if self._aborted:
            seqs, self._aborted = self._aborted, []
            self._emit(seqs)

    def _emit(self, seqs: list[_Seq]) -> None:
        """One BatchTokenIDOut per origin: streamed news, and every finished request."""
        groups: dict[Origin, list[_Seq]] = {}
        for s in seqs:
            if s.silenced:
                continue  # its terminal error already waits in the backlog
            if s.req.stream or s.finished is not None:
                groups.setdefault(s.origin, []).append(s)
        for origin, group in groups.items():
            rids: list[str] = []
            ids: list[int] = []
            lens: list[int] = []
            lps: list[float] = []
            fins: list[FinishReason | None] = []
            any_lp = False
            for s in group:
                new = s.out[s.sent :]
                rids.append(s.req.rid)
                ids.extend(new)
                lens.append(len(new))
                lps.extend(s.lps[s.sent :])
                any_lp |= s.req.return_logprob
                fins.append(s.finished)
                s.sent = len(s.out)
                if s.finished is not None:
                    self._finished += 1
                    self._live.pop(s.req.rid, None)
            self._route(BatchTokenIDOut(
                rids=rids, output_ids=token_ids(ids), output_lens=packed_u32(lens),
                finished_reasons=fins,
                logprobs=np.asarray(lps, np.float32) if any_lp else None), origin)

    def _error(self, rid: str, origin: Origin, code: ErrorCode, message: str) -> None:
        self._finished += 1
        self._route(ErrorOut(rid=rid, code=code, message=fit_text(message)), origin)

    def _route(self, output: Output, origin: Origin) -> None:
        self.router.route(output, origin)  # a failing sink is isolated by the router

    def _check_ids(self, ids: TokenIds, rid: str) -> str:
        if len(ids) == 0:
            return f"request {rid!r} has no input tokens"
        if rid in self._live:
            return f"request id {rid!r} is already in flight"
        vocab = self.model.config.vocab_size
        top = int(np.frombuffer(ids, np.uint32).max())
        if top >= vocab:
            return f"request {rid!r}: token id {top} is outside the vocabulary (size {vocab})"
        return ""

    def _queue_sizes(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    def statistics(self) -> SchedulerStats:
        """A snapshot of the counters."""
        return SchedulerStats(self._steps, self._received, self._rejected, self._finished,
                              self._tokens, len(self._running), len(self._waiting))
