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


def test_prompt_and_decode_tokens_weigh_what_each_costs() -> None:
    # Equal token counts, one replica reading them, the other sampling them:
    # the next request goes where the measured cost is lower, not to either in turn.
    for _ in range(2):
        ledger = Ledger(2)
        ledger.add("read", 0, 0, Cost(1000, 0), None)
        ledger.add("sample", 1, 0, Cost(0, 1000), None)
        cheaper = 0 if PREFILL_US_PER_TOKEN < DECODE_US_PER_TOKEN else 1
        assert ledger.tokens[0] == ledger.tokens[1]
        assert [ledger.pick() for _ in range(2)] == [cheaper, cheaper]


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
