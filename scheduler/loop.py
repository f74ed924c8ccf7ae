"""``Scheduler``: turn requests into outputs and hand them to the router.

It touches no socket, no ring and no mode flag: requests arrive through a
:class:`~bus.Receiver` (whatever its inboxes are), handlers are chosen by
request type with the router's own specificity dispatch (:class:`~router.TypeTable`),
and every output leaves through a :class:`~router.Router`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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
    packed_u32,
    token_ids,
)
from router import Router, TypeTable
from scheduler.checkpoint import load_state, save_state
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
    """A generate request in flight."""

    req: TokenizedGenerateReqInput
    origin: Origin
    stop: frozenset[int]
    generator: torch.Generator | None
    state: torch.Tensor | None = None
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


class Scheduler:
    """The loop: ``step()`` = poll, handle by type, one batch step, route outputs.

    Args:
        receiver: every inbox the scheduler serves (work and rpc).
        router: where outputs go (see :func:`router.scheduler_router`).
        model: the model to run.
        max_batch: most requests decoding at once; the rest queue.
        max_prefill_tokens: most prompt tokens read in one step, a prompt
            counting at least 32 (at least one request is always admitted),
            so a burst of new requests cannot make one step long enough to
            delay an rpc or the running streams.
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
                 rpc_reduce: Callable[[RpcReqOutput], RpcReqOutput | None] | None = None
                 ) -> None:
        self.receiver = receiver
        self.router = router
        self.model = model
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
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
                    self.receiver.wait(self.idle_timeout)
        except BaseException as exc:
            # Still answer everyone, saying why, before the error propagates.
            self.finish_all("internal", f"the scheduler failed: {type(exc).__name__}: {exc}")
            raise
        self.finish_all("shutdown")

    def step(self) -> int:
        """One iteration: poll, handle, one model step, route. Returns how many were polled."""
        self._steps += 1
        envelopes = self.receiver.poll()
        self._received += len(envelopes)
        for env in envelopes:
            if type(env) is Rejected:
                self._on_rejected(env)
            else:
                assert isinstance(env, Envelope)
                self._handlers.lookup(type(env.message))(env.message, env.origin)
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
        seqs = [*self._running, *self._waiting]
        self._running.clear()
        self._waiting.clear()
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
            log.warning("rejected a message on %r with no readable rid: %s", env.origin.inbox,
                        err.reason)
            return
        if err.message_type == RpcReqInput.__name__:
            self._route(RpcReqOutput(rid=err.rid, success=False, message=str(err)), env.origin)
        else:
            self._error(err.rid, env.origin, "decode_error", str(err))

    def _on_generate(self, req: TokenizedGenerateReqInput, origin: Origin) -> None:
        problem = self._check_ids(req.input_ids, req.rid)
        if problem:
            self._error(req.rid, origin, "invalid_request", problem)
            return
        sp = req.sampling
        stop = frozenset(sp.stop_token_ids.tolist()) if sp.stop_token_ids is not None else \
            frozenset[int]()
        gen = None
        if sp.temperature > 0 and sp.top_k != 1:
            # No seed: derive one from the rid, so every tensor-parallel rank
            # samples the same tokens for the same request.
            seed = sp.seed if sp.seed is not None else int.from_bytes(
                hashlib.blake2b(req.rid.encode(), digest_size=8).digest(), "little") >> 1
            gen = torch.Generator().manual_seed(seed)
        seq = _Seq(req, origin, stop, gen)
        self._live[req.rid] = seq
        if sp.max_new_tokens == 0:
            seq.finished = "length"
            self._emit([seq])
            return
        self._waiting.append(seq)

    def _on_embed(self, req: TokenizedEmbeddingReqInput, origin: Origin) -> None:
        problem = self._check_ids(req.input_ids, req.rid)
        if problem:
            self._error(req.rid, origin, "invalid_request", problem)
            return
        self._embeds.append((req, origin))

    def _on_abort(self, req: AbortReq, origin: Origin) -> None:
        seq = self._live.get(req.rid)
        if seq is None:
            return  # unknown or already finished: nothing to answer
        if seq in self._waiting:
            self._waiting.remove(seq)
        else:
            self._running.remove(seq)
        seq.finished = "abort"
        self._aborted.append(seq)

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
        new: list[_Seq] = []
        budget = self.max_prefill_tokens
        while self._waiting and len(self._running) + len(new) < self.max_batch:
            # A prompt costs at least _MIN_PREFILL_COST: admitting a request
            # has a fixed price however short its prompt.
            cost = max(_MIN_PREFILL_COST, len(self._waiting[0].req.input_ids))
            if new and cost > budget:
                break
            budget -= cost
            new.append(self._waiting.popleft())
        rows: list[torch.Tensor] = []
        if self._running:
            tokens = torch.tensor([s.last for s in self._running])
            states = torch.stack([s.state for s in self._running])  # type: ignore[misc]
            logits, states = self.model.decode(tokens, states)
            rows.extend(logits)
            for s, st in zip(self._running, states, strict=True):
                s.state = st
        if new:
            logits_new, states_new = self.model.prefill_batch(
                [_as_tensor(s.req.input_ids) for s in new])
            rows.extend(logits_new)
            for s, st in zip(new, states_new, strict=True):
                s.state = st
        active = self._running + new
        if not active:
            return
        toks, lps = sample_next(torch.stack(rows), [s.req.sampling for s in active],
                                [s.generator for s in active])
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

    # -- outputs --------------------------------------------------------------

    def _emit_aborted(self) -> None:
        if self._aborted:
            seqs, self._aborted = self._aborted, []
            self._emit(seqs)

    def _emit(self, seqs: list[_Seq]) -> None:
        """One BatchTokenIDOut per origin: streamed news, and every finished request."""
        groups: dict[Origin, list[_Seq]] = {}
        for s in seqs:
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
        self._route(ErrorOut(rid=rid, code=code, message=message), origin)

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

    # -- rpc methods ------------------------------------------------------------

    def _shard(self, path: str) -> Path:
        p = Path(path)
        return p if self.world_size == 1 else p.with_name(
            f"{p.name}.rank{self.rank}-of-{self.world_size}")

    def save_checkpoint(self, path: str) -> RpcResult:
        """Write the model weights atomically to ``path`` (temp file, then rename).

        With several ranks, each writes its own shard ``path.rank<r>-of-<n>``.
        """
        target = self._shard(path)
        size = save_state(self.model.state_dict(), target)
        return {"path": str(target), "bytes": size}

    def load_checkpoint(self, path: str) -> RpcResult:
        """Load model weights written by :meth:`save_checkpoint` (this rank's shard)."""
        target = self._shard(path)
        self.model.load_state_dict(load_state(target))
        return {"path": str(target)}

    def token_digest(self) -> RpcResult:
        """A digest of every token this scheduler sampled, in order (ranks must agree)."""
        return {"digest": self._digest.hexdigest(), "tokens": self._tokens, "rank": self.rank}

    def flush_cache(self) -> RpcResult:
        """Drop cached state; refused while requests are in flight."""
        if self._running or self._waiting:
            raise RuntimeError(f"cannot flush while {len(self._running)} requests run and "
                               f"{len(self._waiting)} wait")
        return {"flushed": True}

    def get_load(self) -> RpcResult:
        """Running and queued requests, and the recent token rate."""
        now = time.monotonic()
        if now - self._rate_t0 >= 1.0:
            self._rate = self._rate_tokens / (now - self._rate_t0)
            self._rate_t0, self._rate_tokens = now, 0
        return {"running": len(self._running), "queued": len(self._waiting),
                "tokens_per_s": round(self._rate, 1), "steps": self._steps}

    def statistics(self) -> SchedulerStats:
        """A snapshot of the counters."""
        return SchedulerStats(self._steps, self._received, self._rejected, self._finished,
                              self._tokens, len(self._running), len(self._waiting))
