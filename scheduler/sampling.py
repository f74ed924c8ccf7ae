"""Choosing next tokens: greedy, or temperature / top-k / top-p with a per-request seed."""

from __future__ import annotations

import torch

from messages import SamplingParams

__all__ = ["sample_next"]


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens ``(B,)``, their logprobs ``(B,)``).

    Logprobs are of the model's distribution (before temperature and
    filters), as serving engines report them. Each sampled row draws from its
    own generator, so a seeded request gets the same tokens whatever else
    shares the batch.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    tokens = logp.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature == 0.0 or p.top_k == 1:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k:
            k = min(p.top_k, row.shape[0])
            kth = torch.topk(row, k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set reaching top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens, logp.gather(1, tokens.unsqueeze(1))[:, 0]
