"""What penalties and biases cost a sampling step (:func:`scheduler.models.logits.penalize`).

Run: ``python -m benchmarks.penalties [batch] [vocab]``. A batch of ``batch``
requests (64), each with a 512-token prompt and 256 answer tokens, logits of
``vocab`` (32000) columns. The last line is one JSON object:

* ``penalize_none_ms``: no request asks (the common case: returned as is);
* ``penalize_all_ms``: every request asks for all of them (repetition,
  frequency, presence, a logit_bias of 8 ids, min_tokens not reached);
* ``penalize_all_dense_ms``: the same batch through the dense way (vLLM's
  ``apply_penalties``): each step the answers and prompts padded into id tensors,
  counted into ``(batch, vocab)`` tables by ``scatter_add_``, and every penalty
  applied over the whole table; its logits are checked equal to
  ``penalize``'s first;
* ``sample_greedy_ms``: :func:`~scheduler.models.sampling.sample_next` of the
  same batch, greedy, for scale.

Medians over 30 steps, on this machine's CPU.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from messages import SamplingParams, TokenizedGenerateReqInput, packed_u32
from scheduler.models.logits import penalize
from scheduler.models.sampling import sample_next


@dataclass
class _Seq:
    req: TokenizedGenerateReqInput
    sampling: SamplingParams
    out: list[int]
    stop: frozenset[int]


def _median_ms(fn: Callable[[], object], n: int = 30) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _dense(logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
    """Every penalty over whole ``(batch, vocab)`` tables (vLLM's ``apply_penalties``):
    ids padded with ``vocab`` into tensors, counted by ``scatter_add_``, the pad
    column dropped. Built from the requests' lists each step, as a step must."""
    b, vocab = logits.shape
    out = logits.clone()
    # logit_bias and min_tokens: a few ids a row, gathered, then one index_put_ each
    bias = [(i, t, v) for i, s in enumerate(seqs) for t, v in (s.sampling.logit_bias or {}).items()]
    if bias:
        rows, cols, vals = zip(*bias, strict=True)
        out.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals),
                       accumulate=True)
    stops = [(i, t) for i, s in enumerate(seqs) if len(s.out) < s.sampling.min_tokens
             for t in s.stop]
    if stops:
        rows, cols = zip(*stops, strict=True)
        out.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(float("-inf")))
    width = max(len(s.out) for s in seqs)
    answers = torch.tensor([s.out + [vocab] * (width - len(s.out)) for s in seqs])
    prompts = [np.frombuffer(s.req.input_ids, np.uint32).astype(np.int64) for s in seqs]
    pwidth = max(len(p) for p in prompts)
    prompt = torch.from_numpy(np.stack([np.pad(p, (0, pwidth - len(p)),
                                               constant_values=vocab) for p in prompts]))
    counts = torch.zeros(b, vocab + 1).scatter_add_(1, answers, torch.ones(answers.shape))
    counts = counts[:, :vocab]
    seen = torch.zeros(b, vocab + 1, dtype=torch.bool).scatter_(1, prompt, True)[:, :vocab]
    seen |= counts > 0
    rep = torch.tensor([s.sampling.repetition_penalty for s in seqs]).view(-1, 1)
    by = torch.where(seen, rep, 1.0)
    out = torch.where(out > 0, out / by, out * by)
    freq = torch.tensor([s.sampling.frequency_penalty for s in seqs]).view(-1, 1)
    pres = torch.tensor([s.sampling.presence_penalty for s in seqs]).view(-1, 1)
    return out - freq * counts - pres * (counts > 0)


def main(batch: int = 64, vocab: int = 32000) -> dict[str, float]:
    torch.manual_seed(0)
    logits = torch.randn(batch, vocab)
    prompt = packed_u32([(7 * k) % vocab for k in range(512)], field="input_ids")

    def seqs(sp: SamplingParams) -> list[_Seq]:
        return [_Seq(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=prompt), sp,
                     [(i + 13 * k) % vocab for k in range(256)], frozenset({2}))
                for i in range(batch)]

    plain = seqs(SamplingParams(temperature=0.0))
    asking = seqs(SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                 frequency_penalty=0.5, presence_penalty=0.5,
                                 logit_bias={t: 1.0 for t in range(8)}, min_tokens=1000))
    params = [s.sampling for s in plain]
    gens: list[torch.Generator | None] = [None] * batch
    torch.testing.assert_close(_dense(logits, asking), penalize(logits, asking))
    return {
        "penalize_none_ms": round(_median_ms(lambda: penalize(logits, plain)), 4),
        "penalize_all_ms": round(_median_ms(lambda: penalize(logits, asking)), 3),
        "penalize_all_dense_ms": round(_median_ms(lambda: _dense(logits, asking)), 3),
        "sample_greedy_ms": round(_median_ms(lambda: sample_next(logits, params, gens)), 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:3]))))
