"""``Batch``: the request queue, the running batch, and one model step over them.

Generate and embedding requests wait in one bounded queue
(:class:`~scheduler.core.admission.Admission`); each step admits what fits into
the running batch, reads new prompts (at most ``max_prefill_tokens`` of
them, a long prompt in chunks over several steps), decodes the running
requests one token, and samples. An embedding request ends when its prompt
has been read: its embedding is the state it reached. The scheduler loop
decides what to do with tokens and embeddings; this module knows no channel
and no output.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from bus import Origin
from messages import (
    FinishReason,
    SamplingParams,
    TokenIds,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from scheduler.core.admission import Admission
from scheduler.models.sampling import sample_next
from scheduler.models.tiny import TinyLM

__all__ = ["Batch", "Seq", "StepFailed"]

#: What admitting a request costs the prefill budget at least, however short its prompt.
MIN_PREFILL_COST = 16


def as_tensor(ids: TokenIds) -> torch.Tensor:
    """Token ids as the int64 tensor an embedding lookup wants (one copy)."""
    return torch.from_numpy(np.frombuffer(ids, np.uint32).astype(np.int64))


_EMBED = SamplingParams(max_new_tokens=0)


@dataclass(slots=True)
class Seq:
    """A request in flight (its sampler state is made at admission)."""

    req: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
    origin: Origin
    cost: int  # what it counts against the queue's token bound
    sampling: SamplingParams = _EMBED
    stream: bool = False
    logprobs: bool = False
    embedding: torch.Tensor | None = None  # an embedding request's answer, once read
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
    # On the scheduler's monotonic clock (seconds), for the latency metrics.
    t_arrival: float = 0.0
    t_admit: float = 0.0
    t_last: float = 0.0  # the last token's time; 0 before the first


class StepFailed(Exception):
    """The model step raised; ``seqs`` were in it (and are out of the batch now)."""

    def __init__(self, seqs: list[Seq], error: Exception) -> None:
        self.seqs = seqs
        self.error = error
        super().__init__(f"the model step failed: {type(error).__name__}: {error}")


class Batch:
    """The queue and the running batch of one scheduler.

    Args:
        model: the model to run.
        admission: the queue's bounds and totals.
        max_batch: most requests decoding at once.
        max_prefill_tokens: most prompt tokens read per step (see the module docstring).
    """

    def __init__(self, model: TinyLM, admission: Admission, *, max_batch: int,
                 max_prefill_tokens: int) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be >= 1")
        self.model = model
        self.admission = admission
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)

    def queue(self, seq: Seq) -> str:
        """Queue ``seq``; returns why it was refused (``""``: queued)."""
        refused = self.admission.refuse(seq.cost)
        if not refused:
            self.waiting.append(seq)
            self.admission.enter(seq.cost)
        return refused

    def remove(self, seq: Seq) -> None:
        """Take ``seq`` out of the queue or the batch, wherever it is."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.admission.leave(seq.cost)
        elif seq in self.running:
            self.running.remove(seq)

    def clear(self) -> list[Seq]:
        """Empty the batch and the queue; returns what they held."""
        seqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        self.admission.clear()
        return seqs

    def step(self, admit_failed: Callable[[Seq, Exception], None], now: float = 0.0
             ) -> tuple[list[Seq], list[Seq]]:
        """Admit, prefill, decode and sample once.

        Returns the generate requests that got a token, and the embedding
        requests whose prompt was read (``.embedding`` set). A request whose
        per-request state cannot be made fails alone (``admit_failed``); a
        failing model step raises :class:`StepFailed` with every request it
        held, all of them out of the batch.
        """
        new, chunk = self._take_prefill(admit_failed)
        for s in new:
            s.t_admit = now
        gen = [s for s in new if s.sampling is not _EMBED]
        embedded = [s for s in new if s.sampling is _EMBED] if len(gen) != len(new) else []
        active = self.running + gen
        if not active and not embedded and chunk is None:
            return [], []
        try:
            rows = self._forward(new, chunk)
            for s in embedded:
                assert s.state is not None
                s.embedding = self.model.embed_state(s.state)
            if not active:
                return [], embedded
            toks, lps = sample_next(torch.stack(rows), [s.sampling for s in active],
                                    [s.generator for s in active])
        except Exception as exc:
            failed = active + embedded
            self.running = []
            if chunk is not None:
                self.remove(chunk)
                failed.append(chunk)
            raise StepFailed(failed, exc) from exc
        for s, t, lp in zip(active, toks.tolist(), lps.tolist(), strict=True):
            s.last = t
            if t in s.stop:
                s.finished = "stop"
            else:
                s.out.append(t)
                s.lps.append(lp)
                if len(s.out) >= s.sampling.max_new_tokens:
                    s.finished = "length"
        self.running = [s for s in active if s.finished is None]
        return active, embedded

    def _admit(self, seq: Seq) -> None:
        """Make a request's per-request state as it leaves the queue for the batch."""
        sp = seq.sampling
        if sp is _EMBED:
            return
        if sp.stop_token_ids is not None:
            seq.stop = frozenset(sp.stop_token_ids.tolist())
        if sp.temperature > 0 and sp.top_k != 1:
            # No seed: derive one from the rid, so every tensor-parallel rank
            # samples the same tokens for the same request.
            seed = sp.seed if sp.seed is not None else int.from_bytes(
                hashlib.blake2b(seq.req.rid.encode(), digest_size=8).digest(), "little") >> 1
            seq.generator = torch.Generator().manual_seed(seed)

    def _take_prefill(self, admit_failed: Callable[[Seq, Exception], None]
                      ) -> tuple[list[Seq], Seq | None]:
        """Requests whose prompt ends this step, and one whose long prompt goes on after it.

        At most ``max_prefill_tokens`` prompt tokens are read per step (a
        request counts at least :data:`MIN_PREFILL_COST`): a prompt longer
        than what is left of the budget is read in chunks, one per step, at
        the head of the queue.
        """
        new: list[Seq] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(new) < self.max_batch:
            seq = self.waiting[0]
            left = len(seq.req.input_ids) - seq.prefilled
            cost = max(MIN_PREFILL_COST, left)
            if cost <= budget or left <= budget:
                budget -= cost
                self.waiting.popleft()
                self.admission.leave(seq.cost)
                try:
                    self._admit(seq)
                except Exception as exc:  # e.g. a seed torch refuses: this request alone
                    admit_failed(seq, exc)
                    continue
                new.append(seq)
                continue
            if budget >= MIN_PREFILL_COST or not new:
                return new, seq  # read ``budget`` tokens of it now, the rest later
            break
        return new, None

    def _forward(self, new: list[Seq], chunk: Seq | None) -> list[torch.Tensor]:
        """Decode the running batch, read the new prompts (and a chunk); next-token logits."""
        rows: list[torch.Tensor] = []
        if self.running:
            tokens = torch.tensor([s.last for s in self.running])
            states = torch.stack([s.state for s in self.running])  # type: ignore[misc]
            logits, states = self.model.decode(tokens, states)
            rows.extend(logits)
            for s, st in zip(self.running, states, strict=True):
                s.state = st
        prompts = [as_tensor(s.req.input_ids[s.prefilled :]) for s in new]
        starts = [s.state for s in new]
        if chunk is not None:
            used = sum(max(MIN_PREFILL_COST, len(p)) for p in prompts)
            size = max(1, self.max_prefill_tokens - used)
            prompts.append(as_tensor(chunk.req.input_ids[chunk.prefilled : chunk.prefilled
                                                          + size]))
            starts.append(chunk.state)
        if prompts:
            logits_new, states_new = self.model.prefill_batch(prompts, starts)
            for s, st in zip([*new, *([chunk] if chunk is not None else [])], states_new,
                             strict=True):
                s.state = st
            if chunk is not None:
                chunk.prefilled += len(prompts[-1])
            # Sample only for generate requests whose prompt ended (not a
            # mid-prompt chunk, not an embedding).
            rows.extend(row for s, row in zip(new, logits_new, strict=False)
                        if s.sampling is not _EMBED)
        return rows
