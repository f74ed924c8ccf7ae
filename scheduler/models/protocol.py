"""``Model``: what the scheduler asks of a model, and nothing more.

The scheduler's batch (:mod:`scheduler.core.batch`) decides *which* prompt
tokens are read and *which* requests decode each step; a model decides how.
Per-request state (a GRU's hidden state, a transformer's KV cache) lives in
the model, under an integer key the batch gives each request; the batch
frees it when the request ends, however it ends (finished, aborted, failed,
shut down), so :attr:`Model.live_states` returns to 0 when nothing runs.

Prefix caching is the model's too (the batch only asks): a model may keep
the state of prompts it read in a :class:`~scheduler.models.radix.RadixTree`
bounded in bytes; :meth:`Model.reuse_prefix` gives a new request its
longest cached prefix (the batch then reads only the rest, chunked as
always), and the prefix stays held until :meth:`Model.free`.

Prefill and decode apart (``--pd P:D``): :meth:`Model.export_state` gives a
request's state once its prompt is read (a :class:`RequestState`: its keys
and values as one tensor, and the fingerprint of the model that made them),
and :meth:`Model.adopt_state` makes it the state of a request on another
replica, which decodes from there; a state from a different model, dtype or
shape is refused (:class:`StateMismatch`, naming both).

Implementations: :class:`~scheduler.models.tiny.TinyLM` (and its stub) and
:class:`~scheduler.models.hf.HFCausalLM` (any Hugging Face causal LM from a
local directory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from scheduler.models.radix import TreeStats

__all__ = ["Empty", "Model", "PromptChunk", "RequestState", "StateMismatch", "check_state"]

#: Makes an uninitialized tensor (shape, dtype) for a state to be written into: a
#: sender's shared-memory slab (``PushOutbox.empty``), so the state crosses to the
#: next process with no copy on the way.
Empty = Callable[[Sequence[int], torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True)
class RequestState:
    """What a request's model state is once its prompt is read, to hand to another replica.

    Attributes:
        kv: the state as one tensor: a transformer's keys and values over the
            prompt, ``(layers, 2, kv_heads, positions, head_dim)``; the tiny
            GRU's hidden state, ``(layers, hidden)``.
        fingerprint: the model that made it (:attr:`Model.fingerprint`).
    """

    kv: torch.Tensor
    fingerprint: str


class StateMismatch(ValueError):
    """A handed-off state does not fit this model (another model, dtype or shape).

    Attributes:
        theirs: what the state says (its fingerprint, dtype and shape).
        ours: what this model expects.
    """

    def __init__(self, what: str, theirs: str, ours: str) -> None:
        self.theirs = theirs
        self.ours = ours
        super().__init__(f"the handed-off state's {what} is {theirs}, this replica's model "
                         f"expects {ours}")


def check_state(state: RequestState, fingerprint: str, dtype: torch.dtype,
                shape: Sequence[int | None]) -> None:
    """Refuse ``state`` unless it was made by ``fingerprint`` with ``dtype`` and ``shape``
    (``None`` in ``shape``: any size there, such as the number of positions).

    Raises:
        StateMismatch: naming what the state says and what this model expects.
    """
    if state.fingerprint != fingerprint:
        raise StateMismatch("model", repr(state.fingerprint), repr(fingerprint))
    if state.kv.dtype != dtype:
        raise StateMismatch("dtype", str(state.kv.dtype), str(dtype))
    got = tuple(state.kv.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape,
                                                                           strict=False)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise StateMismatch("shape", str(got), want)


@dataclass(frozen=True, slots=True)
class PromptChunk:
    """A piece of one request's prompt to read this step.

    Attributes:
        key: the request's state key (unique among live requests).
        token_ids: the chunk's tokens, int64 ``(T,)``, ``T >= 1``.
        start: prompt tokens of this request read before (0: a new request).
        last: the prompt ends with this chunk (a generate request samples next).
        embed: an embedding request: its state feeds :meth:`Model.embedding`.
        scores: keep the logits of every position of the chunk, for
            :meth:`Model.prompt_scores` (a request asking for its prompt's logprobs).
    """

    key: int
    token_ids: torch.Tensor
    start: int
    last: bool
    embed: bool = False
    scores: bool = False


@runtime_checkable
class Model(Protocol):
    """A model the scheduler can run with continuous batching and chunked prefill."""

    @property
    def name(self) -> str:
        """What the model is called (a directory's name, or the built-in's kind)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Width of the logits; every input token id must be below it."""
        ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's own end-of-sequence ids: a request ends ``stop`` at any of them."""
        ...

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest context the model was built for, where known."""
        ...

    @property
    def live_states(self) -> int:
        """How many requests hold per-request state now (0 when none is in flight)."""
        ...

    def prefill_chunks(self, chunks: Sequence[PromptChunk]) -> torch.Tensor:
        """Read one chunk of each request's prompt, continuing its state.

        Returns:
            Next-token logits ``(len(chunks), vocab_size)``, row ``i`` for
            ``chunks[i]``; only rows of chunks that end a generate prompt
            (``last and not embed``) are meaningful.
        """
        ...

    def decode_step(self, keys: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per request (``tokens (B,)``) and return logits ``(B, vocab)``.

        Rows never mix: a request's answer does not depend on the others.
        """
        ...

    def prompt_scores(self, key: int) -> torch.Tensor:
        """The logits kept for ``key``'s chunks read with ``scores``, in order, and
        forgotten: ``(T, vocab)`` on the CPU, row ``i`` the next-token logits after
        position ``i`` of what was read (``(0, vocab)`` when none were kept). They cost
        ``T * vocab`` numbers until taken (or :meth:`free`).
        """
        ...

    def embedding(self, key: int) -> torch.Tensor:
        """The unit-norm embedding of an embedding request whose whole prompt was read.

        Raises:
            KeyError: ``key`` holds no embedding state.
        """
        ...

    def free(self, key: int) -> None:
        """Drop ``key``'s state (idempotent: an unknown key is ignored)."""
        ...

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The weights a checkpoint saves, by name."""
        ...

    def set_prefix_cache(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of prompts' state for reuse (0: cache nothing)."""
        ...

    def reuse_prefix(self, key: int, token_ids: torch.Tensor) -> int:
        """Start generate request ``key`` from the longest cached prefix of its prompt.

        Returns how many leading tokens of ``token_ids`` (int64 ``(T,)``) its
        state already holds, at most ``T - 1`` (the last token is read, for
        its logits): its first chunk starts there. The prefix is held (never
        evicted) until :meth:`free` of ``key``. 0: nothing cached, nothing held.
        """
        ...

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix no request holds; returns the bytes freed."""
        ...

    def prefix_cache_stats(self) -> TreeStats | None:
        """The prefix cache's sizes and counters (``None``: this model caches nothing)."""
        ...

    def prefix_cache_tokens(self) -> int:
        """How many tokens' state the prefix cache can hold: its byte bound over the
        bytes one cached token costs (0: this model caches nothing). A dispatcher
        bounds its guess of what the replica holds by it."""
        ...

    @property
    def fingerprint(self) -> str:
        """The model's identity in a hand-off: its name, a digest of its configuration,
        its dtype. Two replicas adopt each other's states only when these agree. Read on
        every hand-off and every ``get_load`` (a dispatcher's heartbeat): keep it cheap
        (computed once)."""
        ...

    def export_state(self, key: int, empty: Empty | None = None) -> RequestState:
        """``key``'s state once its prompt is read (the request itself is not freed),
        written into a tensor ``empty`` makes (default: ``torch.empty``).

        Raises:
            KeyError: ``key`` holds no generate state.
        """
        ...

    def adopt_state(self, key: int, state: RequestState, positions: int) -> None:
        """Make ``state`` (another replica's :meth:`export_state`, over ``positions``
        prompt tokens) the state of request ``key``, which decodes from there.

        Raises:
            StateMismatch: the state's fingerprint, dtype or shape is not this model's.
        """
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Replace the weights with ``weights`` (same names and shapes).

        Raises:
            RuntimeError: a name or a shape does not match.
        """
        ...
