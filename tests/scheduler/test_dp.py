"""Data parallel: the dispatch table, the ledger, the merged rpc, and replicas that die.

Unit properties first (no processes), then ``Engine("zmq", dp_size=2)``
end to end: where each request type goes. Replicas that die, are restarted
or go silent, and the operator's ``serve --dp`` and ``dispatch``, are in
``test_dp_processes.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from messages import (
    AbortReq,
    Request,
    RpcReqInput,
    RpcReqOutput,
    SamplingParams,
    concrete_types,
)
from router import NoRouteError
from scheduler import Engine, InvalidRequest
from scheduler.dp import (
    Balanced,
    Broadcast,
    Ledger,
    NoLiveReplica,
    Owner,
    Refused,
    ReplicaReply,
    dispatch_table,
    merge_replies,
)

# -- the dispatch table ---------------------------------------------------------


def test_every_request_type_has_a_route() -> None:
    table = dispatch_table(merge_replies)
    kinds = {t.__name__: type(table.lookup(t)) for t in concrete_types(Request)}
    assert kinds == {"TokenizedGenerateReqInput": Balanced, "TokenizedEmbeddingReqInput": Balanced,
                     "AbortReq": Owner, "RpcReqInput": Broadcast, "KVHandoff": Refused}


def test_a_request_type_without_a_route_fails_start_up() -> None:
    class ProfileReq(Request, tag="ProfileReq"):  # a new control request nobody routed
        pass

    try:
        with pytest.raises(NoRouteError, match=r"no dispatch route for request type .*ProfileReq"):
            dispatch_table(merge_replies)
    finally:
        del ProfileReq
        gc.collect()  # so no other test's table sees the throw-away class
    dispatch_table(merge_replies)


# -- the ledger -----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 10)), max_size=40),
       st.sampled_from(["least_loaded", "round_robin"]))
def test_a_dead_replica_is_never_picked(live: list[bool], costs: list[tuple[int, int]],
                                        policy: str) -> None:
    ledger = Ledger(len(live), policy)  # type: ignore[arg-type]
    ledger.live = list(live)
    for n, (cost, reported) in enumerate(costs):
        if not any(live):
            with pytest.raises(NoLiveReplica):
                ledger.pick()
            return
        scores = [ledger.score(j) for j in range(len(live))]
        i = ledger.pick()
        assert live[i]
        if policy == "least_loaded":  # the winner was the least loaded of the live ones
            assert scores[i] == min(s for s, up in zip(scores, live, strict=True) if up)
        ledger.add(f"r{n}", i, 0, cost, None)
        ledger.reported[(i + n) % len(live)] = reported


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8))
def test_equal_replicas_take_turns(n: int) -> None:
    ledger = Ledger(n)
    picks = [ledger.pick() for _ in range(3 * n)]  # nothing added: all stay equal
    assert sorted(picks) == sorted(list(range(n)) * 3)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 100)), max_size=50),
       st.integers(0, 3))
def test_finish_and_lose_release_exactly_what_was_added(
        adds: list[tuple[int, int]], lost: int) -> None:
    ledger = Ledger(4)
    for n, (i, cost) in enumerate(adds):
        ledger.add(f"r{n}", i, 0, cost, None)
    for n in range(0, len(adds), 2):
        ledger.finish(f"r{n}")
    gone = ledger.lose(lost)
    assert {e.rid for e in gone} == {f"r{n}" for n, (i, _) in enumerate(adds)
                                     if i == lost and n % 2}
    for j in range(4):
        left = [c for n, (i, c) in enumerate(adds) if i == j and n % 2 and j != lost]
        assert (ledger.requests[j], ledger.tokens[j]) == (len(left), sum(left))
    assert not ledger.live[lost]
    assert ledger.finish("r1") is None or adds[1][0] != lost


def test_skewed_prompts_balance_by_tokens_not_by_count() -> None:
    # Every other prompt is 100x longer: round-robin puts all long ones on one replica.
    prompts = [4000 if n % 2 == 0 else 40 for n in range(100)]
    for policy, worst in (("round_robin", 10.0), ("least_loaded", 1.1)):
        ledger = Ledger(2, policy)  # type: ignore[arg-type]
        for n, cost in enumerate(prompts):
            ledger.add(f"r{n}", ledger.pick(), 0, cost, None)
        ratio = max(ledger.tokens) / min(ledger.tokens)
        assert (ratio > worst) if policy == "round_robin" else (ratio <= worst), ledger.tokens


def test_a_pin_is_honoured_or_refused_never_rerouted() -> None:
    ledger = Ledger(3)
    ledger.live[1] = False
    assert ledger.pick(2) == 2
    with pytest.raises(NoLiveReplica, match="replica 1, which is not live"):
        ledger.pick(1)
    with pytest.raises(NoLiveReplica, match="out of range"):
        ledger.pick(3)


# -- the merged rpc reply -------------------------------------------------------


def _reply(ok: bool, **result: int) -> RpcReqOutput:
    return RpcReqOutput(rid="x", success=ok, message="" if ok else "disk full",
                        result=dict(result.items()))


def test_a_broadcast_succeeds_only_if_every_replica_did_and_names_the_rest() -> None:
    call = RpcReqInput(rid="c1", method="save_checkpoint")
    merged = merge_replies(call, [ReplicaReply("replica0", _reply(True, n=1)),
                                  ReplicaReply("replica1", _reply(False)),
                                  ReplicaReply("replica2", None, "timed out")])
    assert merged.rid == "c1" and not merged.success
    assert "replica1: disk full" in merged.message and "replica2: timed out" in merged.message
    assert "replica0" not in merged.message
    assert merged.result is not None
    assert merged.result["failed"] == ["replica1", "replica2"]
    assert merged.result["replica0.n"] == 1
    assert "n" not in merged.result  # replica1 did not say the same


def test_one_replicas_answer_is_never_passed_off_as_everyones() -> None:
    call = RpcReqInput(rid="c2", method="token_digest")
    merged = merge_replies(call, [ReplicaReply("replica0", _reply(True, d=1)),
                                  ReplicaReply("replica1", _reply(True, d=2))])
    assert merged.success and merged.result is not None
    assert "d" not in merged.result
    assert (merged.result["replica0.d"], merged.result["replica1.d"]) == (1, 2)
    load = merge_replies(RpcReqInput(rid="c3", method="get_load"),
                         [ReplicaReply("replica0", _reply(True, queued=2)),
                          ReplicaReply("replica1", _reply(True, queued=5))])
    assert load.result is not None and load.result["queued"] == 7


def test_flush_cache_says_what_every_replica_freed_together() -> None:
    call = RpcReqInput(rid="c5", method="flush_cache")
    for a, b in ((3, 4), (4, 4)):  # different figures, and equal ones (not one replica's)
        merged = merge_replies(call, [ReplicaReply("replica0", _reply(True, freed_bytes=a)),
                                      ReplicaReply("replica1", _reply(True, freed_bytes=b))])
        assert merged.result is not None and merged.result["freed_bytes"] == a + b
        assert (merged.result["replica0.freed_bytes"], merged.result["replica1.freed_bytes"]) \
            == (a, b)


# -- end to end: Engine("zmq", dp_size=2) ---------------------------------------

@pytest.fixture(scope="module")
def dp_engine() -> Iterator[Engine]:
    """The module's dp engine: its tests only send requests, none kills a replica."""
    with Engine("zmq", dp_size=2) as engine:
        yield engine


def _received(engine: Engine, kind: str) -> list[float]:
    """Per replica: how many ``kind`` requests it received (its own metrics)."""
    reply = engine.collective_rpc("metrics")
    assert reply.success and reply.result is not None
    counts = []
    for i in range(engine.dp_size):
        pieces = reply.result[f"replica{i}.text"]
        assert isinstance(pieces, list)
        text = "".join(str(p) for p in pieces)
        counts.append(sum(s.value for fam in text_string_to_metric_families(text)
                          for s in fam.samples
                          if s.name == "tsb_received_total" and s.labels["type"] == kind))
    return counts


def test_requests_spread_over_both_replicas(dp_engine: Engine) -> None:
    handles = [dp_engine.submit([1 + n % 7] * 20, SamplingParams(max_new_tokens=4))
               for n in range(40)]
    assert all(len(h.result(30).token_ids) == 4 for h in handles)
    reply = dp_engine.collective_rpc("get_load")
    assert reply.success and reply.result is not None
    assert reply.result["replicas"] == ["replica0", "replica1"]
    assert reply.result["failed"] == []
    for i in range(2):  # get_load per replica, in the one reply
        assert f"replica{i}.queued" in reply.result
    assert all(n > 0 for n in _received(dp_engine, "TokenizedGenerateReqInput"))


def test_an_rpc_reaches_every_replica_exactly_once(dp_engine: Engine) -> None:
    def flushes() -> list[float]:  # per replica: flush_cache calls it answered (its metrics)
        reply = dp_engine.collective_rpc("metrics")
        assert reply.success and reply.result is not None
        texts = ["".join(str(p) for p in reply.result[f"replica{i}.text"])  # type: ignore[union-attr]
                 for i in range(dp_engine.dp_size)]
        return [sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                    if s.name == "tsb_rpc_seconds_count" and s.labels["method"] == "flush_cache")
                for text in texts]

    before = flushes()
    reply = dp_engine.collective_rpc("flush_cache")
    assert reply.success, reply.message
    # Heartbeats (get_load) also arrive as rpc: count flush_cache by its own method.
    assert flushes() == [n + 1 for n in before]
    assert reply.result is not None and reply.result["replicas"] == ["replica0", "replica1"]


def test_an_abort_reaches_only_its_owner(dp_engine: Engine) -> None:
    before = _received(dp_engine, "AbortReq")
    for owner in (0, 1):
        handle = dp_engine.submit([3, 4, 5], SamplingParams(max_new_tokens=100_000),
                                  stream=True, dp_rank=owner)
        next(iter(handle))  # it runs on its owner now
        dp_engine.abort(handle.rid)
        assert handle.result(30).finish_reason == "abort"
        after = _received(dp_engine, "AbortReq")
        assert after[owner] == before[owner] + 1
        assert after[1 - owner] == before[1 - owner]
        before = after
    dp_engine.abort("no-such-request")  # unknown: counted by the dispatcher, harmless
    assert dp_engine.generate([1, 2], SamplingParams(max_new_tokens=2)).finish_reason == "length"


def test_a_pin_out_of_range_is_refused_at_submit(dp_engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="dp_rank=2 is out of range"):
        dp_engine.submit([1, 2], dp_rank=2)
    assert len(dp_engine.embed([1, 2, 3], dp_rank=1)) > 0


def test_abort_of_unknown_rid_is_harmless_over_the_wire(dp_engine: Engine) -> None:
    async def send() -> None:  # on the engine's loop, as any of its sends
        dp_engine._core._send(AbortReq(rid="never-was"))

    dp_engine._run(send())
    assert dp_engine.generate([7], SamplingParams(max_new_tokens=1)).token_ids


def test_metrics_label_each_replica(dp_engine: Engine) -> None:
    text = dp_engine.metrics()
    steps = {s.labels["replica"]: s.value for fam in text_string_to_metric_families(text)
             for s in fam.samples if s.name == "tsb_steps_total"}
    assert set(steps) == {"replica0", "replica1"} and all(v > 0 for v in steps.values())


def test_the_dispatchers_own_keys_and_partial_answers_are_never_overwritten() -> None:
    call = RpcReqInput(rid="c4", method="token_digest")
    merged = merge_replies(call, [
        ReplicaReply("replica0", RpcReqOutput(rid="x", success=True,
                                              result={"failed": [], "d": 1})),
        ReplicaReply("replica1", None, "timed out")])
    assert merged.result is not None and merged.result["failed"] == ["replica1"]
    assert "d" not in merged.result  # replica0's answer is not everyone's
    assert merged.result["replica0.d"] == 1


def test_a_reply_in_another_replicas_name_is_dropped() -> None:
    from bus import Origin
    from scheduler.dp.fanout import Fanout

    fanout = Fanout(["replica0", "replica1"])
    sent: list[tuple[int, str]] = []

    def send(i: int, call: RpcReqInput) -> None:
        sent.append((i, call.rid))

    assert fanout.start(RpcReqInput(rid="c", method="get_load"), Origin("rpc"), 1e18,
                        merge_replies, [0, 1], send) is None
    rid1 = dict(sent)[1]
    forged = RpcReqOutput(rid=rid1, success=True, result={"forged": 1})
    assert fanout.reply(forged, sender=0) is None and fanout.late == 1
    done = fanout.reply(RpcReqOutput(rid=rid1, success=True), sender=1)
    assert done is None  # replica0 has not answered its own call yet
    merged = fanout.reply(RpcReqOutput(rid=dict(sent)[0], success=True), sender=0)
    assert merged is not None and merged[0].result is not None
    assert "replica1.forged" not in merged[0].result


def test_cache_aware_sends_embeddings_by_load_not_by_prefix() -> None:
    # A replica caches no prefix for an embedding: the same prompt, embedded
    # again and again one at a time, still spreads over both replicas.
    with Engine("zmq", dp_size=2, dp_policy="cache_aware") as engine:
        for _ in range(4):
            assert len(engine.embed(list(range(1, 40)))) > 0
        load = engine.collective_rpc("get_load")
    assert load.result is not None
    assert [load.result[f"replica{i}.dispatched"] for i in range(2)] == [2, 2], load.result
