"""A small torch causal LM with a per-request state, built for continuous batching.

A recurrent LM (embedding -> a stacked GRU -> tied output head): its
whole per-request state is one ``(layers, hidden)`` tensor, so requests join
and leave the running batch by stacking and unstacking rows, with no KV-cache
bookkeeping. Weights are seeded, so two processes build the same model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from scheduler.models.protocol import Empty, PromptChunk, RequestState, check_state
from scheduler.models.radix import TreeStats

__all__ = ["ModelConfig", "StubLM", "TinyLM", "build_model"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and seed of the model. The default makes hundreds of tokens/s on 2 cores."""

    vocab_size: int = 512
    hidden: int = 128
    layers: int = 2
    seed: int = 0
    #: ``"gru"``: the real model; ``"stub"``: :class:`StubLM`, a zero-cost
    #: stand-in that exposes the bus and router's own overhead in benchmarks.
    kind: Literal["gru", "stub"] = "gru"

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.hidden, self.layers) < 1:
            raise ValueError("vocab_size, hidden and layers must be >= 1")


class TinyLM(nn.Module):
    """The model. ``prefill`` reads a prompt; ``decode`` advances a batch one token.

    It implements :class:`~scheduler.models.protocol.Model` (``prefill_chunks``,
    ``decode_step``, ...), keeping each request's state under its key.
    """

    stop_token_ids: tuple[int, ...] = ()  # a random model has no end-of-sequence token
    max_prompt_tokens: int | None = None  # a GRU reads any length

    def __init__(self, config: ModelConfig = ModelConfig()) -> None:
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.gru = nn.GRU(config.hidden, config.hidden, num_layers=config.layers,
                          batch_first=True)
        self.norm = nn.LayerNorm(config.hidden)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / p.shape[-1] ** 0.5 + 0.02))
        self.eval()
        self._states: dict[int, torch.Tensor] = {}
        self._scores: dict[int, list[torch.Tensor]] = {}  # PromptChunk.scores' logits

    # -- the Model protocol ------------------------------------------------------

    @property
    def name(self) -> str:
        """``tiny-gru`` (or ``stub``)."""
        return "stub" if self.config.kind == "stub" else "tiny-gru"

    @property
    def vocab_size(self) -> int:
        """The configured vocabulary."""
        return self.config.vocab_size

    @property
    def live_states(self) -> int:
        """Requests holding a state."""
        return len(self._states)

    def prefill_chunks(self, chunks: Sequence[PromptChunk]) -> torch.Tensor:
        """Read the chunks together (packed), each from its request's state so far."""
        starts = [self._states.get(c.key) if c.start else None for c in chunks]
        for c, st in zip(chunks, starts, strict=True):
            if c.scores:  # every position's logits, kept for prompt_scores
                self._scores.setdefault(c.key, []).append(self.all_logits(c.token_ids, st))
        logits, states = self.prefill_batch([c.token_ids for c in chunks], starts)
        for c, st in zip(chunks, states, strict=True):
            self._states[c.key] = st
        return logits

    def prompt_scores(self, key: int) -> torch.Tensor:
        """The logits of the chunks read with ``scores`` (see the protocol)."""
        kept = self._scores.pop(key, [])
        return torch.cat(kept) if kept else torch.zeros(0, self.config.vocab_size)

    def decode_step(self, keys: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
        """One token for each request: its states stacked, one GRU step, unstacked."""
        logits, states = self.decode(tokens, torch.stack([self._states[k] for k in keys]))
        for k, st in zip(keys, states, strict=True):
            self._states[k] = st
        return logits

    def embedding(self, key: int) -> torch.Tensor:
        """The embedding of the text read under ``key`` (:meth:`embed_state`)."""
        return self.embed_state(self._states[key])

    def free(self, key: int) -> None:
        """Forget ``key``'s state."""
        self._states.pop(key, None)
        self._scores.pop(key, None)

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The module's ``state_dict``."""
        return self.state_dict()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """``load_state_dict`` (strict)."""
        self.load_state_dict(weights)

    @property
    def fingerprint(self) -> str:
        """Its kind, shape and seed (the seed makes the weights), and ``float32``."""
        c = self.config
        return f"{self.name}:v{c.vocab_size}h{c.hidden}l{c.layers}s{c.seed}:float32"

    def export_state(self, key: int, empty: Empty | None = None) -> RequestState:
        """The GRU's hidden state after the prompt, ``(layers, hidden)``."""
        state = self._states[key]
        out = empty(state.shape, state.dtype) if empty is not None else torch.empty_like(state)
        return RequestState(out.copy_(state), self.fingerprint)

    def adopt_state(self, key: int, state: RequestState, positions: int) -> None:
        """Continue from another replica's hidden state (the same model's)."""
        check_state(state, self.fingerprint, torch.float32,
                    (self.config.layers, self.config.hidden))
        self._states[key] = state.kv.clone()

    # A GRU caches no prefix: its state exists only where it stopped reading, and
    # a radix tree cuts spans at any token, where a GRU has no state to resume
    # from without keeping one ``(layers, hidden)`` tensor per token (the size of
    # a transformer's KV, for a model whose prefill is already cheap).

    def set_prefix_cache(self, max_bytes: int) -> None:
        """Ignored: this model caches no prefix (see the comment above)."""

    def reuse_prefix(self, key: int, token_ids: torch.Tensor) -> int:
        """0: nothing cached."""
        return 0

    def flush_prefix_cache(self) -> int:
        """0: nothing cached."""
        return 0

    def prefix_cache_stats(self) -> TreeStats | None:
        """``None``: this model caches no prefix."""
        return None

    def prefix_cache_tokens(self) -> int:
        """0: this model caches no prefix."""
        return 0

    # -- the network ------------------------------------------------------------

    def initial_state(self) -> torch.Tensor:
        """The state of a request before its prompt: ``(layers, hidden)`` zeros."""
        return torch.zeros(self.config.layers, self.config.hidden)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a prompt; return (logits of the next token ``(vocab,)``, state)."""
        x = self.embed(input_ids.long()).unsqueeze(0)  # (1, T, hidden)
        out, h = self.gru(x)  # h: (layers, 1, hidden)
        return self._logits(out[0, -1:])[0], h[:, 0]

    @torch.inference_mode()
    def prefill_batch(self, prompts: list[torch.Tensor],
                      states: Sequence[torch.Tensor | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run several prompts at once: (logits ``(B, vocab)``, states ``(B, layers, hidden)``).

        Prompts of different lengths are packed, so each row's state is taken
        at its own last token. ``states[i]``, when given, is where prompt
        ``i`` starts from (the state after the earlier chunks of a long
        prompt); ``None`` starts from scratch.
        """
        packed = nn.utils.rnn.pack_sequence([self.embed(p.long()) for p in prompts],
                                            enforce_sorted=False)
        h0 = None
        if states is not None and any(s is not None for s in states):
            zero = self.initial_state()
            h0 = torch.stack([zero if s is None else s for s in states], dim=1).contiguous()
        _, h = self.gru(packed, h0)  # h: (layers, B, hidden), each row at its own end
        return self._logits(h[-1]), h.transpose(0, 1)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        """One step for a batch: ``tokens (B,)``, ``states (B, layers, hidden)``.

        Returns (logits ``(B, vocab)``, new states). Rows never mix.
        """
        x = self.embed(tokens.long()).unsqueeze(1)  # (B, 1, hidden)
        out, h = self.gru(x, states.transpose(0, 1).contiguous())
        return self._logits(out[:, 0]), h.transpose(0, 1)

    @torch.inference_mode()
    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A unit-norm embedding of a text: the final top-layer state."""
        _, state = self.prefill(input_ids)
        return self.embed_state(state)

    @torch.inference_mode()
    def embed_state(self, state: torch.Tensor) -> torch.Tensor:
        """The unit-norm embedding of a text read up to ``state`` ``(layers, hidden)``."""
        v: torch.Tensor = self.norm(state[-1])
        unit: torch.Tensor = v / v.norm().clamp_min(1e-6)
        return unit

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        normed: torch.Tensor = self.norm(h)
        return normed @ self.embed.weight.T

    @torch.inference_mode()
    def all_logits(self, ids: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Next-token logits after every token of ``ids`` ``(T, vocab)``, read from
        ``state`` ``(layers, hidden)`` (None: from scratch)."""
        h0 = None if state is None else state.unsqueeze(1).contiguous()
        out, _ = self.gru(self.embed(ids.long()).unsqueeze(0), h0)
        return self._logits(out[0])


class StubLM(TinyLM):
    """A stand-in with the model's interface and (almost) none of its cost.

    Returns fixed logits and states, so a benchmark of the whole loop measures
    the bus, the router and the scheduler's bookkeeping, not the matmuls.
    """

    def __init__(self, config: ModelConfig = ModelConfig(kind="stub")) -> None:
        super().__init__(config)
        self._row = torch.zeros(config.vocab_size)
        self._state = self.initial_state()
        # Real rows, not ``_row.expand(n, -1)``: torch's intra-op threads turn
        # a softmax over a stride-0 batch into ~8 ms on the main thread (2
        # cores), which made the stub cost more than the bus it stands beside.
        self._rows = torch.zeros(64, config.vocab_size)

    def _zero_logits(self, n: int) -> torch.Tensor:
        if n > self._rows.shape[0]:
            self._rows = torch.zeros(max(n, 2 * self._rows.shape[0]), self.config.vocab_size)
        return self._rows[:n]

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._row, self._state

    def decode(self, tokens: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
        return self._zero_logits(tokens.shape[0]), states

    def prefill_batch(self, prompts: list[torch.Tensor],
                      states: Sequence[torch.Tensor | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(prompts)
        return self._zero_logits(n), self._state.expand(n, -1, -1)

    def all_logits(self, ids: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros(len(ids), self.config.vocab_size)


def build_model(config: ModelConfig) -> TinyLM:
    """The model ``config`` describes."""
    return StubLM(config) if config.kind == "stub" else TinyLM(config)
