"""Chunked prefill interleaves: a short request never waits for another's whole prompt."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from messages import BatchTokenIDOut, SamplingParams, TokenizedGenerateReqInput, token_ids
from scheduler import ModelConfig, TinyLM
from tests.scheduler.rig import SMALL, Loop

BUDGET = 64


def _gen(rid: str, ids: list[int], n: int = 3) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=token_ids(ids), stream=True,
                                     sampling=SamplingParams(max_new_tokens=n, temperature=0.0))


@pytest.fixture
def loop(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> Iterator[Loop]:
    lp = Loop("ring", ctx, ipc, max_prefill_tokens=BUDGET)
    yield lp
    lp.close()


def _first_token_step(loop: Loop, rid: str) -> int:
    """Steps the scheduler took until ``rid`` got its first token."""
    def got() -> bool:
        return any(isinstance(o, BatchTokenIDOut) and rid in list(o.rids) for o, _ in loop.got)
    loop.run_until(got)
    return loop.sched.statistics().steps


def test_shorts_behind_a_long_prompt_get_their_first_token_within_a_few_steps(
        loop: Loop) -> None:
    long = [(i * 7) % 64 for i in range(BUDGET * 40)]  # 40 steps of prefill on its own
    loop.send(_gen("long", long))
    for i in range(6):
        loop.send(_gen(f"short{i}", [1 + i, 2, 3]))
    steps = [_first_token_step(loop, f"short{i}") for i in range(6)]
    # With a FIFO the shorts waited for all 40 chunks of the long prompt.
    assert max(steps) <= 3, steps
    loop.run_until(lambda: "long" in loop.finished())
    assert loop.sched.batch.model.live_states == 0


def test_several_long_prompts_take_turns_and_answer_as_if_alone(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    prompts = {f"p{i}": [(i + j * 3) % 64 for j in range(150 + 37 * i)] for i in range(4)}
    alone: dict[str, list[int]] = {}
    for rid, ids in prompts.items():
        solo = Loop("ring", ctx, ipc, max_prefill_tokens=4096)
        solo.send(_gen(rid, ids, 5))
        solo.run_until(lambda solo=solo, rid=rid: rid in solo.finished())  # type: ignore[misc]
        alone[rid] = solo.finished()[rid][0]
        solo.close()
    # 4 long prompts ahead: the first two get a half-budget chunk each, then the
    # other two, then the short is at the head of the queue (step 3).
    mixed = Loop("ring", ctx, ipc, max_prefill_tokens=BUDGET, model=TinyLM(SMALL))
    for rid, ids in prompts.items():
        mixed.send(_gen(rid, ids, 5))
    mixed.send(_gen("short", [5, 6], 5))
    first = _first_token_step(mixed, "short")
    mixed.run_until(lambda: len(mixed.finished()) == 5)
    assert first <= 3
    assert {rid: mixed.finished()[rid][0] for rid in prompts} == alone
    assert isinstance(mixed.sched.batch.model, TinyLM)
    assert mixed.sched.batch.model.live_states == 0
    mixed.close()


def test_prompts_part_way_read_are_reached_however_many_wait_to_start(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each prompt is a step and one token: read in two chunks, holding a slot
    # between them. With every slot held by prompts part-way read and more
    # not-started requests ahead of them than a step looks at, the scheduler
    # spun for ever (without it: 330 embeddings of 513 tokens, _SCAN 256).
    monkeypatch.setattr("scheduler.core.batch._SCAN", 4)
    lp = Loop("ring", ctx, ipc, max_prefill_tokens=BUDGET, max_batch=2)
    try:
        rids = [f"r{i}" for i in range(12)]
        for i, rid in enumerate(rids):
            lp.send(_gen(rid, [(i + j) % 64 for j in range(BUDGET + 1)], 2))
        lp.run_until(lambda: len(lp.finished()) == len(rids))
        assert all(fin == "length" for _, fin in lp.finished().values())
        assert lp.sched.batch.queued == 0 and lp.sched.batch.model.live_states == 0
    finally:
        lp.close()


def test_an_abort_frees_the_state_of_a_prompt_read_part_way(loop: Loop) -> None:
    from messages import AbortReq
    loop.send(_gen("long", [1] * (BUDGET * 10)))
    loop.run_until(lambda: loop.sched.statistics().steps >= 3)
    model = loop.sched.batch.model
    assert isinstance(model, TinyLM) and model.live_states == 1
    loop.send(AbortReq(rid="long"))
    loop.run_until(lambda: "long" in loop.finished())
    assert model.live_states == 0 and not loop.sched.batch.waiting


def test_tiny_model_states_are_keyed_per_request() -> None:
    model = TinyLM(ModelConfig(vocab_size=64, hidden=16, layers=1))
    from scheduler.models.protocol import Model, PromptChunk
    assert isinstance(model, Model)
    logits = model.prefill_chunks([PromptChunk(7, torch.tensor([1, 2, 3]), 0, True)])
    assert logits.shape == (1, 64) and model.live_states == 1
    model.free(7)
    model.free(7)  # idempotent
    assert model.live_states == 0
