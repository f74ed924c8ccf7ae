"""``PrefixAffinity``: the ``cache_aware`` policy's guess of which replica holds a prompt's prefix.

SGLang's router does this; so do we, without asking the replicas: per
replica, a :class:`~scheduler.models.radix.RadixTree` of the prompts we sent
there (tokens only, no state), bounded in tokens (:data:`TREE_TOKENS`, so
it approximates what the replica's own prefix cache holds) and in nodes
(:data:`TREE_NODES`, so its own memory stays bounded when prompts differ in
a token or two), evicted least recently used first. Only the chosen
replica's tree counts as used: looking into the others does not refresh them.

Each replica reports its prefix cache's capacity in tokens (``get_load``'s
``prefix_cache_tokens``, read from every heartbeat); its tree is then bounded
by that too (:meth:`PrefixAffinity.set_cache_tokens`), so it approximates
what that cache can hold, and its room left is what the replica can still
cache without evicting another prefix.

A request goes to the replica whose tree matches the longest part of its
prompt (of equal matches, the one with fewer requests in flight) when

* that match is at least :data:`MATCH_SHARE` of the prompt (else the
  ledger's least loaded takes it), and
* that replica is not overloaded: it has at most :data:`BALANCE_ABS`
  requests in flight more than the least loaded live replica, or at most
  :data:`BALANCE_REL` times as many. An overloaded holder *spills*: the least
  loaded replica takes the request (of several, the one matching most) and
  records the prompt, so it holds the prefix too and from then on the two
  share that prefix's requests by load;
* and it is not ahead for nothing: with at least :data:`BALANCE_FREE`
  requests in flight more than the least loaded live replica, it spills
  there *for free* when that replica reported its cache and its tree takes
  the prompt's unmatched tokens without evicting (``size + unmatched <=
  bound``). The cost is one read of the prefix there, and no miss later:
  nothing it held is pushed out. A replica whose cache is full (or that
  caches nothing, or has not reported) gets no free spill: there, moving a
  prefix evicts another, and keeping the prefixes apart is what a small
  cache needs.

Load is requests in flight as the dispatcher counts them (the ledger's): it
knows them at once, where a replica's own report is a heartbeat old. Either
way, the prompt joins the chosen replica's tree. Embedding requests are not
recorded (a replica caches no prefix for them). A replica that is lost, or
that joins again (a respawn starts with an empty cache), has its tree
dropped; so does each replica whose ``flush_cache`` succeeded (one that
refused, with requests running, keeps its cache and its tree). The counters
(:meth:`PrefixAffinity.counters`) are in the dispatcher's ``get_load`` as
``dispatcher.affinity_<name>``, and each tree's tokens and bound as
``<replica>.affinity_tokens`` and ``<replica>.affinity_bound``.

The thresholds, as measured (``docs/ARCHITECTURE.md``, "Choosing the
thresholds", has the runs) on ``benchmarks.prefix`` (8 system prompts of
1,024 tokens, 2 replicas, concurrency 16): with the default 1 GiB cache
(every prompt fits everywhere) the replicas' in-flight counts differ by
about 10 under ``cache_aware`` without spilling, and a tight balance (2)
took its time to first token from 0.86 to 0.51 of ``round_robin``'s with the
cache; with a 6 MiB cache (5 of the 8 prompts) the same tight balance
collapsed it to ``least_loaded`` (0.85), where the loose one gave 0.16:
balancing pays exactly when the replica it spills to has room. Hence two
thresholds: the free one, 2, only where there is room; the loose one,
SGLang router's (32 requests and 1.0001), everywhere, bounding the pile-up
on a replica far slower than the others. The match share stays 0.5: that
workload cannot tell its values apart (a prompt matches 97% or nothing),
and below half a replica would read more of the prompt than it reuses.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np

from messages import RpcReqInput, RpcReqOutput, TokenIds
from scheduler.dp.table import Reducer, ReplicaReply
from scheduler.models.radix import RadixTree

__all__ = ["BALANCE_ABS", "BALANCE_FREE", "BALANCE_REL", "MATCH_SHARE", "TREE_NODES",
           "TREE_TOKENS", "PrefixAffinity"]

#: Least share of a prompt a replica's tree must match to win the request.
MATCH_SHARE = 0.5
#: The replica holding a prefix is overloaded (the least loaded takes the
#: request) when it has more than this many requests in flight beyond the least
#: loaded live replica ...
BALANCE_ABS = 32
#: ... and more than this many times the least loaded's.
BALANCE_REL = 1.0001
#: The holder spills *for free* to the least loaded live replica when it has at
#: least this many requests in flight more than that one and that replica's tree
#: (bounded by its reported cache) takes the prompt without evicting anything.
BALANCE_FREE = 2
#: Tokens each replica's tree keeps (4 bytes each: 4 MiB).
TREE_TOKENS = 1 << 20
#: Nodes each replica's tree keeps. A node costs ~1 KB (measured 700-950 bytes:
#: the node, its dict, token array and span, and its share of the eviction heap,
#: up to 4 entries a node), and a node may stand for a single token, so this
#: bound, not the tokens', caps the worst case: ~32 MiB per replica.
TREE_NODES = 1 << 15


class _Run:
    """A node's span: nothing but how many tokens it stands for."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def split(self, at: int) -> tuple[_Run, _Run]:
        return _Run(at), _Run(self.size - at)


class PrefixAffinity:
    """Per replica, a bounded tree of the prompts sent there (see the module docstring).

    Args:
        n: replicas.
        tree_tokens: tokens each replica's tree keeps.
        tree_nodes: nodes each replica's tree keeps.
    """

    def __init__(self, n: int, tree_tokens: int = TREE_TOKENS,
                 tree_nodes: int = TREE_NODES) -> None:
        self.tree_tokens = tree_tokens
        self.tree_nodes = tree_nodes
        self.trees: list[RadixTree[_Run]] = [RadixTree(tree_tokens, tree_nodes)
                                             for _ in range(n)]
        #: Per replica, the tokens its prefix cache holds at most, as it reported
        #: (``None``: not reported; its tree's room is then unknown, and no free
        #: spill goes there).
        self.cache_tokens: list[int | None] = [None] * n
        self.routed_by_prefix = 0  # requests sent where their prefix was
        self.routed_by_load = 0  # requests no tree matched enough: the ledger picks
        self.spilled = 0  # requests whose prefix's replica was overloaded: the least loaded
        self.spilled_free = 0  # spilled to a less loaded replica with room for the prompt

    def prefer(self, prompt: TokenIds, load: Sequence[int], live: Sequence[bool],
               exclude: Container[int] = ()) -> int | None:
        """The replica holding the longest share of ``prompt``, or ``None``: pick by load.

        ``load``: requests in flight per replica; ``live``: which can be picked.
        """
        ids = np.frombuffer(prompt, np.uint32)
        candidates = [i for i, ok in enumerate(live) if ok and i not in exclude]
        if not candidates or not len(ids):
            return None
        # Untouched: only the chosen tree's path turns recent, by record().
        held = {i: self.trees[i].match(ids, lock=False, count=False, touch=False).length
                for i in candidates}
        # The longest match; among equal ones, the least loaded.
        best = min(candidates, key=lambda i: (-held[i], load[i]))
        if not held[best] or held[best] < MATCH_SHARE * len(ids):
            self.routed_by_load += 1
            return None
        least = min(load[i] for i in candidates)
        lightest = [i for i in candidates if load[i] == least]
        if load[best] - least > BALANCE_ABS and load[best] > BALANCE_REL * least:
            # The holder is overloaded: spill to the least loaded (in flight, the
            # measure just compared; the longest match among them), which records
            # the prompt and so holds the prefix too: from then on the less
            # loaded of the two wins the tie.
            self.spilled += 1
            return min(lightest, key=lambda i: -held[i])
        if load[best] - least >= BALANCE_FREE:
            # Less uneven, but the least loaded has room for the prompt: its
            # replica caches it without evicting another prefix, so balancing
            # costs one read of the prefix there and no miss later.
            roomy = [i for i in lightest if self._room(i, len(ids) - held[i])]
            if roomy:
                self.spilled_free += 1
                return min(roomy, key=lambda i: -held[i])
        self.routed_by_prefix += 1
        return best

    def counters(self) -> dict[str, int]:
        """How requests were routed, by name (``get_load`` reports them)."""
        return {"routed_by_prefix": self.routed_by_prefix,
                "routed_by_load": self.routed_by_load, "spilled": self.spilled,
                "spilled_free": self.spilled_free}

    def _room(self, replica: int, tokens: int) -> bool:
        """Whether ``replica``'s tree, bounded by the cache it reported, takes ``tokens``
        more without evicting (``False`` while it has reported no cache)."""
        tree = self.trees[replica]
        return self.cache_tokens[replica] is not None and tree.size + tokens <= tree.capacity

    def set_cache_tokens(self, replica: int, tokens: int) -> None:
        """``replica`` reported that its prefix cache holds at most ``tokens`` tokens:
        its tree keeps at most that many (and :data:`TREE_TOKENS`), evicting the least
        recently used past it."""
        if tokens == self.cache_tokens[replica]:
            return
        self.cache_tokens[replica] = tokens
        self.trees[replica].set_capacity(min(self.tree_tokens, max(0, tokens)))

    def record(self, replica: int, prompt: TokenIds) -> None:
        """``prompt`` went to ``replica``: its prefix is likely cached there now."""
        ids = np.frombuffer(prompt, np.uint32)
        if len(ids):
            self.trees[replica].insert(ids, lambda a, b: _Run(b - a))

    def drop(self, replica: int) -> None:
        """Forget what ``replica`` holds (lost, respawned or flushed); the bound its
        cache reported stays (its next report replaces it)."""
        self.trees[replica] = RadixTree(self.trees[replica].capacity, self.tree_nodes)

    def forget_flushed(self, names: Sequence[str], reduce: Reducer, call: RpcReqInput,
                       replies: Sequence[ReplicaReply]) -> RpcReqOutput:
        """``flush_cache`` merged by ``reduce``; each replica that flushed has its tree dropped.

        ``names``: the replicas' names, by index (what :class:`ReplicaReply` says).
        """
        for r in replies:
            if r.reply is not None and r.reply.success and r.replica in names:
                self.drop(names.index(r.replica))
        return reduce(call, replies)
