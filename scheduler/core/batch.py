"""``Batch``: the request queue, the running batch, and one model step over them.

Generate and embedding requests wait in one bounded queue
(:class:`~scheduler.core.admission.Admission`); each step admits what fits into
the running batch, reads new prompts (at most ``max_prefill_tokens`` of
them, a long prompt in chunks over several steps), decodes the running
requests one token, and samples. An embedding request ends when its prompt
has been read: its embedding is the state it reached. The scheduler loop
decides what to do with tokens and embeddings; this module knows no channel
and no output, and of the model only the :class:`~scheduler.models.protocol.Model`
protocol: each request's model state lives in the model under ``Seq.key``, and
is freed here whenever a request leaves, however it leaves.

A generate request starts from the longest prefix of its prompt the model
has cached (:meth:`~scheduler.models.protocol.Model.reuse_prefix`, asked
once, when it is first looked at with a batch slot free): only the rest is
read, by the same rules as any prompt.

Chunked prefill interleaves: a prompt longer than a step's budget gets one
chunk a step (at most half the budget while others wait) and goes to the back
of the queue after each, so requests behind it are read in between: a short
request's first token waits for a chunk or two, never for another request's
whole prompt. Requests not started wait apart from prompts part-way read
(the queue's order kept by tickets): with every batch slot held, a step
goes straight to the prompts part-way read, however many wait to start.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Callable, Sized
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
from scheduler.models import guided
from scheduler.models.logits import note_top_logprobs, penalize, score_prompt
from scheduler.models.protocol import Model, PromptChunk, RequestState
from scheduler.models.sampling import sample_next

__all__ = ["Batch", "Seq", "StepFailed"]

#: What admitting a request costs the prefill budget at least, however short its prompt.
MIN_PREFILL_COST = 16

#: Most waiting requests looked at per step for prompts to read (bounds a step's
#: bookkeeping however deep the queue).
_SCAN = 256

#: Leading tokens two prompts must share for one to wait for the other's prefill
#: (:meth:`Batch._waits_for_prefix`).
_SHARED_PREFIX = 32


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
    stop: frozenset[int] = frozenset()  # the model's stop ids (unless ignore_eos) and its own
    generator: torch.Generator | None = None
    key: int = -1  # its model state's key, given when it is queued
    prefilled: int = 0  # prompt tokens read so far (a long prompt takes several steps)
    ticket: int = 0  # its place in the queue's order (renewed after each chunk)
    silenced: bool = False  # aborted by backpressure: its terminal error is already queued
    last: int = -1
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    # ``sampling.top_logprobs`` alternatives per sampled position (a stop token's too)
    top_ids: list[int] = field(default_factory=list)
    top_lps: list[float] = field(default_factory=list)
    # ``sampling.prompt_logprobs``: its prompt's, until sent (the ``top_*`` as above)
    prompt_lps: list[float] | None = None
    prompt_top_ids: list[int] = field(default_factory=list)
    prompt_top_lps: list[float] = field(default_factory=list)
    sent: int = 0  # tokens already streamed
    cached: int = -1  # prompt tokens its state started with (the prefix cache); -1: not asked
    finished: FinishReason | None = None
    matcher: guided.Matcher | None = None  # its guide's parser state (structured output)
    guide_error: str | None = None  # its guide failed: it ends with this error (not output)
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
        max_batch: most requests decoding (or part-way through their prompt, or read and
            waiting for their hand-off to leave: :attr:`held`) at once.
        max_prefill_tokens: most prompt tokens read per step (see the module docstring).
    """

    def __init__(self, model: Model, admission: Admission, *, max_batch: int,
                 max_prefill_tokens: int) -> None:
        if max_batch < 1 or max_prefill_tokens < 1:
            raise ValueError("max_batch and max_prefill_tokens must be >= 1")
        self.model = model
        self.admission = admission
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Seq] = deque()  # not started: no prompt token read yet
        #: Part-way through their prompt; each holds a batch slot. Kept apart from
        #: ``waiting`` so a step always reaches them: behind more not-started
        #: requests than one step looks at, with every slot held by them, nothing
        #: could move (330 embeddings of 513 tokens spun for ever). One order
        #: over both: ``Seq.ticket``.
        self.partial: deque[Seq] = deque()
        self.running: list[Seq] = []
        #: Adopted from another replica (prefill and decode apart), their model state
        #: held, waiting in arrival order for a batch slot (see :meth:`adopt`).
        self.adopted: deque[Seq] = deque()
        #: Read here for another replica to decode and waiting for their hand-off to
        #: leave (the scheduler's queue, out of the running batch): each keeps its slot,
        #: since its state stays in the model until it leaves, so a prefill replica
        #: whose hand-offs are not taken holds at most ``max_batch`` states, not more.
        self.held: Sized = ()
        self._keys = itertools.count()
        self._tickets = itertools.count()
        self._model_stops = frozenset(model.stop_token_ids)
        #: The model's context (prompt + generated tokens), where it has one: a request
        #: ends ``length`` when it is full, so no step ever reads a position past it
        #: (with learned positions, as GPT-2's, one such request failed its whole batch).
        self._context = model.max_prompt_tokens
        #: Structured output: each distinct guide compiled once (scheduler.models.guided).
        self.guides = guided.Guides(model, model.vocab_size, model.stop_token_ids)
        model.set_prefix_cache(admission.limits.prefix_cache_bytes)
        #: Whether a prompt read is kept for the next ones that begin as it does.
        self._caches_prefixes = model.prefix_cache_stats() is not None

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting or self.partial or self.adopted)

    @property
    def queued(self) -> int:
        """Requests waiting: prompt not read whole yet, or adopted and waiting for a slot."""
        return len(self.waiting) + len(self.partial) + len(self.adopted)

    def queue(self, seq: Seq) -> str:
        """Queue ``seq``; returns why it was refused (``""``: queued)."""
        refused = self.admission.refuse(seq.cost)
        if not refused:
            seq.key = next(self._keys)
            seq.ticket = next(self._tickets)
            self.waiting.append(seq)
            self.admission.enter(seq.cost)
        return refused

    def adopt(self, seq: Seq, state: RequestState, rng_state: torch.Tensor | None) -> str:
        """Queue ``seq``, whose prompt another replica read (prefill and decode apart),
        under the same bounds as a new request; returns why it was refused (``""``:
        queued). Its model state ``state`` is adopted now (so a mismatch is refused at
        once), its sampler's generator set from ``rng_state``; it joins the running
        batch when a slot is free (``max_batch``), adopted requests in arrival order,
        and decodes from that step.

        Raises:
            StateMismatch: ``state`` is not this model's (nothing is kept).
        """
        refused = self.admission.refuse(seq.cost)
        if refused:
            return refused
        seq.key = next(self._keys)
        self._admit(seq)
        if rng_state is not None and seq.generator is not None:
            seq.generator.set_state(rng_state.clone())
        self.model.adopt_state(seq.key, state, len(seq.req.input_ids))
        self.adopted.append(seq)
        self.admission.enter(seq.cost)
        return ""

    def _run_adopted(self) -> None:
        """Adopted requests join the running batch, in arrival order, while slots are free."""
        while (self.adopted and len(self.running) + len(self.partial) + len(self.held)
                < self.max_batch):
            seq = self.adopted.popleft()
            self.admission.leave(seq.cost)
            self.running.append(seq)

    def remove(self, seq: Seq) -> None:
        """Take ``seq`` out of the queue or the batch, wherever it is, and free its state."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.admission.leave(seq.cost)
        elif seq in self.partial:
            self.partial.remove(seq)
            self.admission.leave(seq.cost)
        elif seq in self.running:
            self.running.remove(seq)
        elif seq in self.adopted:
            self.adopted.remove(seq)
            self.admission.leave(seq.cost)
        self.model.free(seq.key)

    def clear(self) -> list[Seq]:
        """Empty the batch and the queue; returns what they held (their states freed)."""
        seqs = [*self.running, *self.adopted, *self.partial, *self.waiting]
        self.running.clear()
        self.adopted.clear()
        self.partial.clear()
        self.waiting.clear()
        self.admission.clear()
        for s in seqs:
            self.model.free(s.key)
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
        self._run_adopted()
        new, parts = self._take_prefill(admit_failed)
        for s in new:
            s.t_admit = now
        gen = [s for s in new if s.sampling is not _EMBED]
        embedded = [s for s in new if s.sampling is _EMBED] if len(gen) != len(new) else []
        active = self.running + gen
        if not active and not embedded and not parts:
            return [], []
        try:
            rows = self._forward(new, parts)
            for s in new:  # (the prompts that asked to be scored were read with scores)
                if s.sampling.prompt_logprobs is not None and s.sampling is not _EMBED:
                    s.prompt_lps, s.prompt_top_ids, s.prompt_top_lps = score_prompt(
                        self.model.prompt_scores(s.key), s.req.input_ids,
                        s.sampling.prompt_logprobs)
            for s in embedded:
                s.embedding = self.model.embedding(s.key)
                self.model.free(s.key)
            if not active:
                return [], embedded
            raw = torch.stack(rows)
            # A guided request's mask first, in place: its logprobs and top
            # alternatives are of the distribution its grammar allows (as vLLM's,
            # whose bitmask is applied before the sampler). Penalties and biases
            # then only add to, scale or fill -inf entries, each of which stays
            # -inf: a token the grammar forbids stays forbidden whatever its bias.
            guided.mask_logits(active, raw)
            note_top_logprobs(raw, active)
            toks, lps = sample_next(penalize(raw, active), [s.sampling for s in active],
                                    [s.generator for s in active], raw=raw)
            guided.advance(active, toks)
        except Exception as exc:
            failed = active + embedded
            self.running = []
            for s in failed:
                self.model.free(s.key)
            for s, _ in parts:
                if s in self.partial:
                    self.remove(s)
                    failed.append(s)
            raise StepFailed(failed, exc) from exc
        context = self._context
        for s, t, lp in zip(active, toks.tolist(), lps.tolist(), strict=True):
            s.last = t
            if not s.sampling.max_new_tokens:  # a prompt only scored (prompt_logprobs)
                s.finished = "length"
            elif t in s.stop:
                s.finished = "stop"
            else:
                s.out.append(t)
                s.lps.append(lp)
                if len(s.out) >= s.sampling.max_new_tokens or (
                        context is not None and len(s.req.input_ids) + len(s.out) >= context):
                    s.finished = "length"
            if s.finished is not None:
                self.model.free(s.key)
        self.running = [s for s in active if s.finished is None]
        return active, embedded

    def _admit(self, seq: Seq) -> None:
        """Make a request's per-request state as its prompt starts being read."""
        sp = seq.sampling
        if sp is _EMBED:
            return
        # The stop set is resolved here, once: a step only asks ``t in seq.stop``.
        seq.stop = frozenset() if sp.ignore_eos else self._model_stops
        if sp.stop_token_ids is not None:
            seq.stop = seq.stop | frozenset(sp.stop_token_ids.tolist())
        if sp.temperature > 0 and sp.top_k != 1:
            # No seed: derive one from the rid, so every tensor-parallel rank
            # samples the same tokens for the same request.
            seed = sp.seed if sp.seed is not None else int.from_bytes(
                hashlib.blake2b(seq.req.rid.encode(), digest_size=8).digest(), "little") >> 1
            seq.generator = torch.Generator().manual_seed(seed)

    def _take_prefill(self, admit_failed: Callable[[Seq, Exception], None]
                      ) -> tuple[list[Seq], list[tuple[Seq, int]]]:
        """Requests whose prompt ends this step, and (request, tokens) chunks of longer ones.

        At most ``max_prefill_tokens`` prompt tokens are read per step (a
        request counts at least :data:`MIN_PREFILL_COST`). The queue (two
        deques, requests not started and prompts part-way read, walked as one
        in ticket order) is walked in order: a prompt whose rest fits what is
        left is read whole; one that fits a whole step waits for the next
        (ahead of the rest); one longer than a step gets a chunk (at most half
        the budget while others wait, so they are read in the same step) and
        goes to the back. A request starts only with a free batch slot (one
        part-way through its prompt holds one); with none free, only the
        prompts part-way read are walked.
        """
        new: list[Seq] = []
        parts: list[tuple[Seq, int]] = []
        budget = self.max_prefill_tokens
        slots = self.max_batch - len(self.running) - len(self.partial) - len(self.held)
        waiting, partial = self.waiting, self.partial
        kept_new: list[Seq] = []  # looked at, left in place
        kept_partial: list[Seq] = []
        # The heads of the prompts being read that did not start from the cache (the
        # part-way ones, then each taken this step): built at the first fresh request
        # that asks, so each asks in one set lookup (see _waits_for_prefix).
        reading: set[bytes] | None = None
        for _ in range(_SCAN):
            if budget < MIN_PREFILL_COST and (new or parts):
                break
            # One queue's order (the tickets'), walked over both deques; a
            # request not started is looked at only while a slot is free, so
            # with none free the step goes straight to the prompts part-way read.
            fresh = bool(waiting) and slots > 0 and (
                not partial or waiting[0].ticket < partial[0].ticket)
            if fresh:
                seq, kept = waiting.popleft(), kept_new
            elif partial:
                seq, kept = partial.popleft(), kept_partial
            else:
                break
            if fresh and seq.cached < 0 and self._caches_prefixes:
                if reading is None:
                    reading = {h for s in itertools.chain(partial, kept_partial, new,
                                                          (s for s, _ in parts))
                               if (h := _reading_head(s)) is not None}
                if _waits_for_prefix(seq, reading):
                    kept.append(seq)
                    continue
            if fresh and seq.cached < 0:
                # A prompt to score is read whole: a cached prefix has no logits to give.
                if seq.sampling is _EMBED or seq.sampling.prompt_logprobs is not None:
                    seq.cached = 0
                else:
                    seq.cached = self.model.reuse_prefix(seq.key, as_tensor(seq.req.input_ids))
                seq.prefilled = seq.cached
            left = len(seq.req.input_ids) - seq.prefilled
            whole = max(MIN_PREFILL_COST, left) <= budget or left <= budget
            if not whole and left <= self.max_prefill_tokens:
                kept.append(seq)  # it fits a whole step: read it whole next step
                continue
            others = bool(waiting or partial or kept_new or kept_partial)
            size = left if whole else min(budget, max(1, self.max_prefill_tokens // 2)
                                          if others else budget)
            if not whole and size < MIN_PREFILL_COST and (new or parts):
                kept.append(seq)
                continue
            if fresh:
                try:
                    self._admit(seq)
                except Exception as exc:  # e.g. a seed torch refuses: this request alone
                    self.admission.leave(seq.cost)
                    self.model.free(seq.key)  # its hold on a cached prefix
                    admit_failed(seq, exc)
                    continue
                slots -= 1
            if whole:
                budget -= max(MIN_PREFILL_COST, left)
                self.admission.leave(seq.cost)
                new.append(seq)
            else:
                budget -= size
                parts.append((seq, size))
            if fresh and reading is not None and (h := _reading_head(seq)) is not None:
                reading.add(h)
        waiting.extendleft(reversed(kept_new))
        partial.extendleft(reversed(kept_partial))
        for seq, _ in parts:  # to the back: the others are read before its next chunk
            seq.ticket = next(self._tickets)
            partial.append(seq)
        return new, parts

    def _forward(self, new: list[Seq], parts: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Decode the running batch, read the new prompts and chunks; next-token logits."""
        rows: list[torch.Tensor] = []
        if self.running:
            tokens = torch.tensor([s.last for s in self.running])
            rows.extend(self.model.decode_step([s.key for s in self.running], tokens))
        chunks = [PromptChunk(s.key, as_tensor(s.req.input_ids[s.prefilled:]), s.prefilled,
                              True, s.sampling is _EMBED, s.sampling.prompt_logprobs is not None)
                  for s in new]
        chunks += [PromptChunk(s.key, as_tensor(s.req.input_ids[s.prefilled:s.prefilled + n]),
                               s.prefilled, False, s.sampling is _EMBED,
                               s.sampling.prompt_logprobs is not None) for s, n in parts]
        if chunks:
            logits = self.model.prefill_chunks(chunks)
            for s in new:
                s.prefilled = len(s.req.input_ids)
            for s, n in parts:
                s.prefilled += n
            # Sample only for generate requests whose prompt ended (not a
            # mid-prompt chunk, not an embedding).
            rows.extend(row for s, row in zip(new, logits, strict=False)
                        if s.sampling is not _EMBED)
        return rows


def _reading_head(s: Seq) -> bytes | None:
    """The first :data:`_SHARED_PREFIX` tokens of ``s``'s prompt while it is read and
    did not start from the cache (what a later prompt that begins so waits for);
    ``None`` otherwise."""
    if s.cached >= _SHARED_PREFIX or s.sampling is _EMBED:
        return None
    return bytes(s.req.input_ids[:_SHARED_PREFIX])


def _waits_for_prefix(seq: Seq, reading: set[bytes]) -> bool:
    """Whether fresh ``seq`` (the model caching prefixes) waits a step: another prompt
    that begins with the same :data:`_SHARED_PREFIX` tokens, not found in the cache,
    is being read (this step, or part-way): ``reading`` holds their heads.

    Once that prompt is read it is in the prefix cache, and ``seq`` starts from it
    (the ``n`` answers of one prompt, fanned out as ``n`` requests that arrive
    together, read the prompt once). Bounded: only while the other is being read (it
    is ahead in the queue, so a later arrival never holds ``seq`` back); one that
    started from the cache holds no one back; ``seq`` keeps its place in the queue.
    """
    ids = seq.req.input_ids
    if (len(ids) <= _SHARED_PREFIX or seq.sampling is _EMBED or
            seq.sampling.prompt_logprobs is not None):
        return False
    return bytes(ids[:_SHARED_PREFIX]) in reading
