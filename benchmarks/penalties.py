"""What penalties and biases cost a sampling step (:func:`scheduler.models.logits.penalize`).

Run: ``python -m benchmarks.penalties [batch] [vocab]``. A batch of ``batch``
requests (64), each with a 512-token prompt and 256 answer tokens, logits of
``vocab`` (32000) columns. The last line is one JSON object:

* ``penalize_none_ms``: no request asks (the common case: returned as is);
* ``penalize_all_ms``: every request asks for all of them (repetition,
  frequency, presence, a logit_bias of 8 ids, min_tokens not reached);
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
    return {
        "penalize_none_ms": round(_median_ms(lambda: penalize(logits, plain)), 4),
        "penalize_all_ms": round(_median_ms(lambda: penalize(logits, asking)), 3),
        "sample_greedy_ms": round(_median_ms(lambda: sample_next(logits, params, gens)), 3),
    }


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:3]))))
