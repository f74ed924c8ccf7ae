"""A Hugging Face model through the scheduler against ``transformers``' own ``generate``.

Run: ``python -m benchmarks.hf`` (needs the ``[hf]`` extra). It builds the
tiny random Llama the tests use (hidden 64, 2 layers, float64, see
:mod:`scheduler.models.tiny_hf`) in a temp dir, and then, in alternating
rounds of one run, greedy, ``MAX_NEW`` new tokens each:

* **ours, batch 16**: ``Engine("ring", model=DIR).submit_many`` of 16
  prompts of different lengths, continuously batched (all of them decode as
  one batch);
* **ours, batch 1**: the same 16 prompts one after another;
* **transformers**: ``model.generate`` of the same 16 prompts as one
  left-padded batch (``do_sample=False``, same ``max_new_tokens``).

Tokens/s counts the answer tokens (up to the model's EOS) over the round's
wall time; each figure is the median round. Both sides run with one torch
intra-op thread (``OMP_NUM_THREADS=1``): on a shared 2-core box torch's
spinning threads made a step of this model up to 70x slower, for both.

The last line is one JSON object: ``tokens_per_s_batch16_vs_hf_generate``,
``tokens_per_s_batch16_vs_batch1``, ``match_ratio_vs_hf_greedy`` (the share
of the 16 answers identical to ``transformers``' greedy), and the absolute
figures beside them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from messages import SamplingParams
from scheduler import Engine
from scheduler.models.tiny_hf import build_tiny_hf

MAX_NEW = 32
ROUNDS = 7
EOS = 2
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 384, size=int(k)).tolist() for k in rng.integers(4, 96, size=n)]


def _cut(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS)] if EOS in tokens else tokens


def hf_round(model: torch.nn.Module, batch: list[list[int]]) -> tuple[float, list[list[int]]]:
    """``generate`` on one left-padded batch: (seconds, answers up to EOS)."""
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask,  # type: ignore[operator]
                             do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    return time.perf_counter() - t0, [_cut(row[width:].tolist()) for row in out]


def ours_batch(engine: Engine, batch: list[list[int]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    results = [h.result(120) for h in engine.submit_many(batch, GREEDY)]
    return time.perf_counter() - t0, [r.token_ids for r in results]


def ours_one_by_one(engine: Engine, batch: list[list[int]]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    results = [engine.generate(p, GREEDY, timeout=120) for p in batch]
    return time.perf_counter() - t0, [r.token_ids for r in results]


def main() -> None:
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    batch = prompts()
    with tempfile.TemporaryDirectory(prefix="tsb-hf-") as tmp:
        directory = build_tiny_hf(Path(tmp) / "tiny-llama")
        reference = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
        times: dict[str, list[float]] = {"hf": [], "ours16": [], "ours1": []}
        tokens: dict[str, int] = {}
        answers: dict[str, list[list[int]]] = {}
        with Engine("ring", directory) as engine:
            ours_batch(engine, batch[:4])  # warm both up
            hf_round(reference, batch[:4])
            runs: list[tuple[str, Callable[[], tuple[float, list[list[int]]]]]] = [
                ("hf", lambda: hf_round(reference, batch)),
                ("ours16", lambda: ours_batch(engine, batch)),
                ("ours1", lambda: ours_one_by_one(engine, batch))]
            for _ in range(ROUNDS):
                for name, run in runs:
                    seconds, got = run()
                    times[name].append(seconds)
                    answers[name] = got
                    tokens[name] = sum(map(len, got))
    rate = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
    matches = sum(a == b for a, b in zip(answers["ours16"], answers["hf"], strict=True))
    result = {
        "tokens_per_s_batch16_vs_hf_generate": round(rate["ours16"] / rate["hf"], 3),
        "tokens_per_s_batch16_vs_batch1": round(rate["ours16"] / rate["ours1"], 3),
        "match_ratio_vs_hf_greedy": matches / len(batch),
        "tokens_per_s_ours_batch16": round(rate["ours16"], 1),
        "tokens_per_s_ours_batch1": round(rate["ours1"], 1),
        "tokens_per_s_hf_generate_batch16": round(rate["hf"], 1),
        "answer_tokens": tokens["ours16"],
        "max_new_tokens": MAX_NEW,
        "rounds": ROUNDS,
        "torch_threads": torch.get_num_threads(),
    }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
