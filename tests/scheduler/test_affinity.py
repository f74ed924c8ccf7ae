"""The ``cache_aware`` policy's trees: bounded, and sending shared prefixes to one replica."""

from __future__ import annotations

import numpy as np

from messages import RpcReqInput, RpcReqOutput, token_ids
from scheduler.dp.affinity import BALANCE_ABS, BALANCE_FREE, PrefixAffinity
from scheduler.dp.fanout import merge_replies
from scheduler.dp.ledger import Cost, Ledger
from scheduler.dp.table import ReplicaReply


def test_the_trees_stay_within_their_bound_over_100k_distinct_prompts() -> None:
    bound = 20_000
    affinity = PrefixAffinity(2, tree_tokens=bound)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 50_000, size=(100_000, 24), dtype=np.uint32)
    for i, row in enumerate(prompts):
        affinity.record(i % 2, token_ids(row))
        if i % 1000 == 999:
            for tree in affinity.trees:
                assert tree.size <= bound
                assert len(tree._heap) <= 4 * tree.nodes + 1025  # its heap stays proportional
    for tree in affinity.trees:
        stats = tree.stats()
        assert bound - 24 <= stats.size <= bound and stats.nodes == tree.nodes > 0, stats
        assert stats.evictions >= 50_000 - bound // 24
    # The most recent prompts are still there, the first ones long gone.
    assert affinity.trees[1].match(prompts[-1], lock=False).length == 24
    assert affinity.trees[0].match(prompts[0], lock=False).length < 24


def test_prompts_differing_in_their_last_token_stay_within_the_node_bound() -> None:
    nodes = 500
    affinity = PrefixAffinity(2, tree_nodes=nodes)  # the token bound is far off
    base = np.arange(200, dtype=np.uint32)
    for i in range(20_000):  # each prompt splits off a one-token leaf
        affinity.record(i % 2, token_ids(_ending(base, 1000 + i)))
        if i % 500 == 499:
            for tree in affinity.trees:
                assert tree.nodes <= nodes and len(tree._heap) <= 4 * tree.nodes + 1025
    for tree in affinity.trees:
        assert tree.nodes == nodes and tree.size < 200 + nodes, tree.stats()
    assert affinity.trees[1].match(_ending(base, 1000 + 19_999), lock=False).length == 200
    assert affinity.trees[0].match(_ending(base, 1000), lock=False).length == 199


def _ending(base: np.ndarray, last: int) -> np.ndarray:
    """``base`` with its last token replaced by ``last``."""
    prompt = base.copy()
    prompt[-1] = last
    return prompt


def test_looking_for_a_prefix_refreshes_only_the_chosen_replicas_tree() -> None:
    affinity = PrefixAffinity(2, tree_tokens=30)
    old, new = list(range(10)), list(range(100, 110))
    for i in range(2):
        affinity.record(i, token_ids(old))
        affinity.record(i, token_ids(new))
    # Both trees hold it; load picks replica 1, whose tree alone sees it used.
    assert affinity.prefer(token_ids(old), [1, 0], [True, True]) == 1
    affinity.record(1, token_ids(old))
    for i in range(2):
        affinity.record(i, token_ids(list(range(200, 215))))  # over the bound: one goes
    assert affinity.trees[0].match(np.array(old, np.uint32), lock=False).length == 0
    assert affinity.trees[1].match(np.array(old, np.uint32), lock=False).length == 10
    assert affinity.trees[1].match(np.array(new, np.uint32), lock=False).length == 0


def _route(affinity: PrefixAffinity, ledger: Ledger, rid: str, prompt: list[int]) -> int:
    ids = token_ids(prompt)
    i = ledger.pick(None, (), affinity.prefer(ids, ledger.requests, ledger.live))
    ledger.add(rid, i, 0, Cost(len(prompt), 8), None)
    affinity.record(i, ids)
    return i


def test_requests_sharing_a_prefix_go_to_one_replica_and_prefixes_spread() -> None:
    rng = np.random.default_rng(1)
    systems = [rng.integers(3, 384, size=256).tolist() for _ in range(6)]
    ledger = Ledger(2, "cache_aware")
    affinity = PrefixAffinity(2)
    where: dict[int, set[int]] = {k: set() for k in range(len(systems))}
    in_flight: list[str] = []
    for n in range(300):
        k = int(rng.integers(len(systems)))
        prompt = systems[k] + rng.integers(3, 384, size=16).tolist()
        where[k].add(_route(affinity, ledger, f"r{n}", prompt))
        in_flight.append(f"r{n}")
        if len(in_flight) > 8:  # at most 8 in flight: finish the oldest
            ledger.finish(in_flight.pop(0))
    assert all(len(replicas) == 1 for replicas in where.values()), where
    assert {r for replicas in where.values() for r in replicas} == {0, 1}
    assert affinity.routed_by_prefix >= 300 - len(systems)


def test_uneven_load_sends_to_the_least_loaded_and_a_dropped_tree_forgets() -> None:
    affinity = PrefixAffinity(2)
    prompt = token_ids(list(range(100)))
    affinity.record(0, prompt)
    assert affinity.prefer(prompt, [0, 0], [True, True]) == 0
    assert affinity.prefer(prompt, [BALANCE_ABS, 0], [True, True]) == 0
    assert affinity.prefer(prompt, [BALANCE_ABS + 1, 0], [True, True]) == 1  # spilled
    assert affinity.prefer(prompt, [0, 0], [False, True]) is None  # 0 is not live
    assert affinity.prefer(token_ids(list(range(40)) + [999] * 60), [0, 0],
                           [True, True]) is None  # a 40% match is not enough
    affinity.drop(0)
    assert affinity.prefer(prompt, [0, 0], [True, True]) is None


def test_an_overloaded_holder_spills_to_the_least_loaded_which_then_shares_the_prefix(
        ) -> None:
    affinity = PrefixAffinity(3)
    prompt = token_ids(list(range(100)))
    affinity.record(0, prompt)
    affinity.record(2, token_ids(list(range(60)) + [999] * 40))  # 60%: less than 0's
    # 0 holds it all but is overloaded: 1 and 2 are least loaded, 2 holds more.
    assert affinity.prefer(prompt, [BALANCE_ABS + 1, 0, 0], [True] * 3) == 2
    assert affinity.spilled == 1
    affinity.record(2, prompt)
    # Both hold it now: the less loaded of the two takes it, without a spill.
    assert affinity.prefer(prompt, [1, 0, 2], [True] * 3) == 0
    assert affinity.prefer(prompt, [3, 0, 2], [True] * 3) == 2
    assert affinity.spilled == 1


def test_a_slow_replica_never_holds_more_than_the_threshold_beyond_the_least_loaded(
        ) -> None:
    """Closed loop, 3 * BALANCE_ABS in flight, 8 system prompts; replica 0 ends one
    request a tick, replicas 1 and 2 three: the gap in flight stays within the
    threshold, where routing by prefix alone piles the requests onto the slow one."""
    rng = np.random.default_rng(2)
    systems = [rng.integers(3, 384, size=128).tolist() for _ in range(8)]
    ledger = Ledger(3, "cache_aware")
    affinity = PrefixAffinity(3)
    queues: list[list[str]] = [[], [], []]
    worst, n = 0, 0
    for _ in range(400):
        while len(ledger) < 3 * BALANCE_ABS:
            prompt = systems[int(rng.integers(8))] + rng.integers(3, 384, size=8).tolist()
            i = _route(affinity, ledger, f"r{n}", prompt)
            queues[i].append(f"r{n}")
            n += 1
            worst = max(worst, ledger.requests[i] - min(ledger.requests))
        for i, rate in ((0, 1), (1, 3), (2, 3)):
            for rid in queues[i][:rate]:
                ledger.finish(rid)
            del queues[i][:rate]
    assert worst <= BALANCE_ABS + 1, worst
    assert affinity.spilled and affinity.routed_by_prefix > n // 2  # mostly by prefix still


def test_only_a_replica_whose_flush_succeeded_forgets_its_tree() -> None:
    affinity = PrefixAffinity(3)
    prompt = token_ids(list(range(50)))
    for i in range(3):
        affinity.record(i, prompt)
    call = RpcReqInput(rid="f", method="flush_cache")
    refused = RpcReqOutput(rid="x", success=False, message="requests are running")
    flushed = RpcReqOutput(rid="x", success=True, result={"freed_bytes": 1})
    merged = affinity.forget_flushed(
        ["replica0", "replica1", "replica2"], merge_replies, call,
        [ReplicaReply("replica0", refused), ReplicaReply("replica1", flushed),
         ReplicaReply("replica2", None, "timed out")])
    assert not merged.success and merged.result is not None
    assert merged.result["failed"] == ["replica0", "replica2"]
    assert [t.nodes for t in affinity.trees] == [1, 0, 1]  # replica0 and 2 still hold it
    assert affinity.prefer(prompt, [0, 0, 0], [True, True, True]) in (0, 2)


def test_a_holder_ahead_by_balance_free_spills_where_the_prompt_fits_without_evicting(
        ) -> None:
    affinity = PrefixAffinity(2)
    prompt = token_ids(list(range(100)))
    affinity.record(0, prompt)
    ahead = [BALANCE_FREE, 0]
    # No cache reported by replica 1: its room is unknown, the prefix stays.
    assert affinity.prefer(prompt, ahead, [True, True]) == 0
    affinity.set_cache_tokens(0, 1000)
    affinity.set_cache_tokens(1, 1000)
    assert affinity.prefer(prompt, [BALANCE_FREE - 1, 0], [True, True]) == 0  # even enough
    assert affinity.prefer(prompt, ahead, [True, True]) == 1  # room: spilled for free
    assert (affinity.spilled_free, affinity.spilled) == (1, 0)
    affinity.record(1, prompt)
    # Both hold it now: the less loaded takes it, by prefix.
    assert affinity.prefer(prompt, [3, 1], [True, True]) == 1
    assert affinity.spilled_free == 1


def test_no_free_spill_to_a_replica_whose_cache_would_evict_but_overload_still_spills(
        ) -> None:
    affinity = PrefixAffinity(2)
    prompt = token_ids(list(range(100)))
    affinity.record(0, prompt)
    affinity.set_cache_tokens(0, 1000)
    affinity.set_cache_tokens(1, 150)
    affinity.record(1, token_ids(list(range(500, 560))))  # 60 held: 100 more do not fit
    assert affinity.trees[1].size == 60
    assert affinity.prefer(prompt, [BALANCE_FREE + 5, 0], [True, True]) == 0  # no room
    assert affinity.spilled_free == 0
    assert affinity.prefer(prompt, [BALANCE_ABS + 1, 0], [True, True]) == 1  # overloaded
    assert affinity.spilled == 1
    # A replica that caches nothing has no room, whatever its tree's default bound.
    affinity.set_cache_tokens(1, 0)
    assert affinity.trees[1].size == 0 and affinity.trees[1].capacity == 0
    assert affinity.prefer(prompt, [BALANCE_FREE + 5, 0], [True, True]) == 0


def test_a_reported_cache_bounds_the_tree_evicting_the_oldest_and_a_drop_keeps_the_bound(
        ) -> None:
    affinity = PrefixAffinity(2, tree_tokens=1000)
    for k in range(5):
        affinity.record(0, token_ids(list(range(k * 100, k * 100 + 100))))
    assert affinity.trees[0].size == 500
    affinity.set_cache_tokens(0, 250)  # lowered: the three oldest prompts go
    assert affinity.trees[0].size == 200 and affinity.trees[0].capacity == 250
    assert affinity.trees[0].match(np.arange(400, 500, dtype=np.uint32),
                                   lock=False).length == 100
    assert affinity.trees[0].match(np.arange(0, 100, dtype=np.uint32), lock=False).length == 0
    affinity.set_cache_tokens(0, 1 << 30)  # raised: never past the tree's own bound
    assert affinity.trees[0].capacity == 1000
    affinity.set_cache_tokens(0, 250)
    affinity.drop(0)
    assert affinity.trees[0].size == 0 and affinity.trees[0].capacity == 250
