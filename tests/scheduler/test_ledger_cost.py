"""The ledger weighs what a request will cost its replica: reading a prompt, then decoding."""

from __future__ import annotations

from messages import (
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler.dp.ledger import (
    DECODE_US_PER_TOKEN,
    PREFILL_US_PER_TOKEN,
    Cost,
    Ledger,
    cost_of,
)


def test_shorts_do_not_queue_behind_a_replica_reading_a_long_prompt() -> None:
    ledger = Ledger(2)
    long = ledger.add("long", ledger.pick(), 0, Cost(32_000, 16), None)
    # Each short asks for many tokens: counted like prompt tokens, 17 of them
    # would outweigh the 32k prompt and the next would join its replica.
    picks = []
    for n in range(20):
        i = ledger.pick()
        picks.append(i)
        ledger.add(f"s{n}", i, 0, Cost(16, 2048), None)
    assert picks == [1 - long.replica] * 20


def test_a_started_request_owes_only_its_decode() -> None:
    ledger = Ledger(2)
    entry = ledger.add("r", 0, 0, Cost(1000, 16), None)
    assert ledger.score(0) == 1000 * PREFILL_US_PER_TOKEN + 16 * DECODE_US_PER_TOKEN
    ledger.start(entry)
    ledger.start(entry)  # once only
    assert entry.started and entry.request is None
    assert ledger.score(0) == 16 * DECODE_US_PER_TOKEN
    ledger.finish("r")
    assert ledger.score(0) == 0 and ledger.tokens[0] == 0
    lost = ledger.add("q", 1, 0, Cost(10, 10), None)
    ledger.lose(1)
    ledger.start(lost)  # a late first output of a lost entry changes nothing
    assert ledger.work == [0, 0]


def test_cost_of_each_balanced_request() -> None:
    gen = TokenizedGenerateReqInput(rid="g", input_ids=token_ids([1, 2, 3]),
                                    sampling=SamplingParams(max_new_tokens=7))
    assert cost_of(gen) == Cost(3, 7)
    assert cost_of(TokenizedEmbeddingReqInput(rid="e", input_ids=token_ids([1, 2]))) == Cost(2, 0)
