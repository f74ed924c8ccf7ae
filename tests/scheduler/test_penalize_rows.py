"""penalize() applies each request's penalties to its own row of the batch, whatever
its place: a batch of several, some asking and some not, gives each row what it gives
that request alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from messages import SamplingParams, TokenIds, token_ids
from scheduler.models.logits import penalize


@dataclass
class _Req:
    input_ids: TokenIds


@dataclass
class _Seq:
    req: _Req
    sampling: SamplingParams
    out: list[int]
    stop: frozenset[int] = field(default_factory=lambda: frozenset({0}))


def test_each_row_gets_its_own_requests_penalties() -> None:
    vocab = 40
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen, dtype=torch.float64)
    seqs = [
        _Seq(_Req(token_ids([1, 2, 3])), SamplingParams(), [4, 4]),
        _Seq(_Req(token_ids([5, 6])), SamplingParams(repetition_penalty=1.5,
                                                     frequency_penalty=0.5), [7, 7, 8]),
        _Seq(_Req(token_ids([9])), SamplingParams(), [10]),
        _Seq(_Req(token_ids([11, 12])), SamplingParams(presence_penalty=1.0, min_tokens=5,
                                                       logit_bias={13: 3.0}), [14]),
    ]
    together = penalize(logits, seqs)
    for i, s in enumerate(seqs):
        alone = penalize(logits[i:i + 1].clone(), [s])
        assert torch.equal(together[i], alone[0]), i
    assert torch.equal(together[0], logits[0]) and torch.equal(together[2], logits[2])
    assert not torch.equal(together[1], logits[1])
    assert together[3, 0] == float("-inf")  # min_tokens holds its stop token back
