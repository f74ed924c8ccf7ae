"""Choosing next tokens: greedy, or temperature / top-k / top-p with a per-request seed."""

from __future__ import annotations

import torch

from messages import SamplingParams

__all__ = ["GREEDY_BELOW", "sample_next"]

#: A temperature below this samples greedily (as vLLM's): dividing float32 logits by
#: a smaller one overflows them to inf, and the softmax of that is NaN (temperature
#: 1e-300 rounds to 0.0 in float32 and would sample non-argmax tokens).
GREEDY_BELOW = 1e-5


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    *,
    raw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens ``(B,)``, their logprobs ``(B,)``).

    Logprobs are of the model's distribution (before temperature and
    filters), as serving engines report them: of ``raw`` when given (the
    model's logits, where ``logits`` are them after penalties and biases:
    vLLM's default ``raw_logprobs``). Sampled rows are processed
    together (one sort, one softmax, one search for the whole batch); each
    draws its uniform from its own generator, and every operation is
    row-wise, so a seeded request gets the same tokens whatever else shares
    the batch.
    """
    model = raw if raw is not None and raw is not logits else None
    logits = logits.float()
    logp = torch.log_softmax(logits if model is None else model.float(), dim=-1)
    # Greedy picks the argmax of the float32 logits, as ``transformers``'
    # ``generate`` does: subtracting the log-sum-exp first can round two
    # near-equal logits together and flip the choice.
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW and p.top_k != 1]
    if rows:
        vocab = logits.shape[-1]
        idx = torch.tensor(rows)
        chosen = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in chosen]).unsqueeze(1)
        sorted_logits, order = torch.sort(logits[idx] / temps, dim=-1, descending=True)
        ks = torch.tensor([p.top_k if p.top_k else vocab for p in chosen]).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([p.top_p for p in chosen]).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p, 0.0)
        cdf = probs.cumsum(-1)
        u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).unsqueeze(1)
        pick = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=vocab - 1)
        tokens[idx] = order.gather(1, pick)[:, 0]
    return tokens, logp.gather(1, tokens.unsqueeze(1))[:, 0]
