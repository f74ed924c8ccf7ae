"""The in-flight ledger: who owns each rid, and how loaded each replica is.

Pure bookkeeping, no sockets, so its rules are tested as properties:

* **Ownership.** Every dispatched rid maps to one replica (and that
  replica's generation, so a reply from an earlier incarnation is told
  apart). An abort goes to the owner only; an output from anyone else is
  stale.
* **Load.** Per replica: the work it still owes us, in microseconds of its
  own time (:class:`Cost`): each request's prompt weighs what reading it
  costs (:data:`PREFILL_US_PER_TOKEN` a token) until its first output shows
  it read, and its ``max_new_tokens`` what sampling them in a running batch
  costs (:data:`DECODE_US_PER_TOKEN` a token) until it ends; plus what the
  replica last *reported* (its ``get_load``: requests from other clients,
  or queued behind ours). The least-loaded live replica wins, ties broken
  by rotation, so equal replicas take turns. Requests and tokens
  (prompt + ``max_new_tokens``) are counted too, for ``get_load``.
* **Liveness.** A replica that is not live is never picked, whatever the
  policy or pin. Losing one hands back its entries: started ones must fail,
  unstarted ones may run elsewhere.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

from messages import Request, TokenizedEmbeddingReqInput, TokenizedGenerateReqInput

__all__ = ["Cost", "Entry", "Ledger", "NoLiveReplica", "Policy", "cost_of"]

#: How a balanced request picks its replica (``cache_aware``: where its prompt's
#: prefix likely is, see :mod:`scheduler.dp.affinity`; else as ``least_loaded``).
Policy = Literal["least_loaded", "round_robin", "cache_aware"]

#: A replica's time to read one prompt token, and to sample one token in a
#: running batch of 32, in microseconds: the default model, one replica, the
#: scheduler on one torch thread, as ``python -m benchmarks.dp`` measures them
#: (``prefill_us_per_token``, ``decode_us_per_token``; the README's benchmark
#: table quotes a run). Only their ratio steers the choice: here a sampled
#: token weighs 34/41 of a prompt token (the benchmark prints the measured
#: ratio as ``sampled_token_in_prompt_tokens``), since a prompt is read in
#: chunks of 512 by one recurrent pass and a step samples 32 requests at
#: once. Measure them on a quiet box (OpenMP workers spin-waiting on a busy
#: one measure the box, not the model), and again for another model.
PREFILL_US_PER_TOKEN = 41
DECODE_US_PER_TOKEN = 34

#: Tokens one reported request counts as, beside the work we know of: a
#: request queued on a replica by someone else is worth about a short prompt.
REPORTED_REQUEST_TOKENS = 256


class NoLiveReplica(Exception):
    """No replica can take the request (none live, or the pinned one is not)."""


class Cost(NamedTuple):
    """What a request will cost its replica, in tokens of each kind."""

    prompt: int  #: tokens to read (prefill)
    decode: int  #: tokens to sample, at most (``max_new_tokens``; 0 for an embedding)


def cost_of(request: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput) -> Cost:
    """The :class:`Cost` of a balanced request."""
    if isinstance(request, TokenizedGenerateReqInput):
        return Cost(len(request.input_ids), request.sampling.max_new_tokens)
    return Cost(len(request.input_ids), 0)


@dataclass(slots=True)
class Entry:
    """One dispatched request."""

    rid: str
    replica: int
    generation: int
    cost: int  # tokens: prompt + max_new_tokens
    #: Kept until the first output arrives, so a lost replica's unstarted
    #: requests can run elsewhere; dropped then (it may hold tensors).
    request: Request | None
    pinned: bool = False
    started: bool = False
    aborted: bool = False
    at: float = 0.0  # when it was dispatched (monotonic)
    prefill_us: int = 0  # work still owed: reading the prompt (0 once started)
    decode_us: int = 0  # and sampling its tokens
    #: Its hand-off's sends through shared memory to the decode replica it went to
    #: (``FramePool.last_sent``), until the deadline tells whether it was read.
    handoff: tuple[tuple[str, int], ...] = ()


class Ledger:
    """Ownership and load of ``n`` replicas (all live at first)."""

    def __init__(self, n: int, policy: Policy = "least_loaded") -> None:
        if n < 1:
            raise ValueError("a ledger needs at least one replica")
        if policy not in ("least_loaded", "round_robin", "cache_aware"):
            raise ValueError(f"unknown policy {policy!r} (least_loaded, round_robin or "
                             f"cache_aware)")
        self.n = n
        self.policy: Policy = policy
        self.live = [True] * n
        self.requests = [0] * n
        self.tokens = [0] * n
        self.work = [0] * n  # microseconds of replica time owed (see Cost)
        self.reported = [0] * n  # running + queued, from the replica's last get_load
        self.dispatched = [0] * n  # requests ever dispatched to each
        self.dispatched_tokens = [0] * n  # and their tokens (prompt + max_new_tokens)
        self._entries: dict[str, Entry] = {}
        self._next = 0  # rotation: the round-robin cursor and the tie-break's start

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: object) -> bool:
        return rid in self._entries

    def get(self, rid: str) -> Entry | None:
        """The entry of ``rid``, if it is in flight."""
        return self._entries.get(rid)

    def entries(self, replica: int) -> Iterator[Entry]:
        """The requests in flight on ``replica``."""
        return (e for e in self._entries.values() if e.replica == replica)

    def score(self, replica: int) -> int:
        """Its load in microseconds of its time: ours owed, plus what it reports beyond ours."""
        extra = max(0, self.reported[replica] - self.requests[replica])
        return self.work[replica] + extra * REPORTED_REQUEST_TOKENS * PREFILL_US_PER_TOKEN

    def pick(self, pin: int | None = None, exclude: Container[int] = (),
             prefer: int | None = None) -> int:
        """The replica for a new request, never one in ``exclude``.

        ``prefer`` (the ``cache_aware`` policy's choice) wins when it is live
        and not excluded; otherwise the policy picks.

        Raises:
            NoLiveReplica: ``pin`` is out of range, not live or excluded, or
                no replica is live and not excluded.
        """
        if pin is not None:
            if not 0 <= pin < self.n:
                raise NoLiveReplica(f"dp_rank={pin} is out of range: there are {self.n} "
                                    "replicas")
            if not self.live[pin]:
                raise NoLiveReplica(f"dp_rank={pin} pins replica {pin}, which is not live")
            if pin in exclude:
                raise NoLiveReplica(f"dp_rank={pin} pins replica {pin}, which cannot take "
                                    "this request now")
            return pin
        if prefer is not None and self.live[prefer] and prefer not in exclude:
            return prefer
        n, start = self.n, self._next
        best, best_score = -1, 0
        for k in range(n):
            i = (start + k) % n
            if not self.live[i] or i in exclude:
                continue
            if self.policy == "round_robin":
                best = i
                break
            s = self.score(i)
            if best < 0 or s < best_score:  # strict: the first in rotation wins a tie
                best, best_score = i, s
        if best < 0:
            raise NoLiveReplica("no replica is live")
        self._next = best + 1 if self.policy == "round_robin" else (start + 1) % n
        return best

    def add(self, rid: str, replica: int, generation: int, cost: Cost | int,
            request: Request | None, *, pinned: bool = False, at: float = 0.0) -> Entry:
        """Record ``rid`` as dispatched to ``replica`` (at monotonic time ``at``).

        ``cost``: the request's :class:`Cost` (a bare int counts as prompt tokens).

        Raises:
            KeyError: ``rid`` is already in flight.
        """
        if rid in self._entries:
            raise KeyError(rid)
        if isinstance(cost, int):
            cost = Cost(cost, 0)
        tokens = cost.prompt + cost.decode
        entry = Entry(rid, replica, generation, tokens, request, pinned, at=at,
                      prefill_us=cost.prompt * PREFILL_US_PER_TOKEN,
                      decode_us=cost.decode * DECODE_US_PER_TOKEN)
        self._entries[rid] = entry
        self.requests[replica] += 1
        self.tokens[replica] += tokens
        self.work[replica] += entry.prefill_us + entry.decode_us
        self.dispatched[replica] += 1
        self.dispatched_tokens[replica] += tokens
        return entry

    def start(self, entry: Entry) -> None:
        """``entry``'s first output arrived: its prompt is read (its work is released),
        and it can no longer run elsewhere (its request is dropped)."""
        if not entry.started:
            entry.started, entry.request = True, None
            if self._entries.get(entry.rid) is entry:
                self.work[entry.replica] -= entry.prefill_us
            entry.prefill_us = 0

    def move(self, entry: Entry, replica: int, generation: int) -> None:
        """``entry`` now runs on ``replica`` (its state was handed off there): its load
        moves with it, and it counts as started (it cannot run elsewhere any more)."""
        self.start(entry)
        if self._entries.get(entry.rid) is not entry:
            return
        old = entry.replica
        self.requests[old] -= 1
        self.tokens[old] -= entry.cost
        self.work[old] -= entry.decode_us
        entry.replica, entry.generation = replica, generation
        self.requests[replica] += 1
        self.tokens[replica] += entry.cost
        self.work[replica] += entry.decode_us

    def finish(self, rid: str) -> Entry | None:
        """``rid`` got its terminal output: forget it and release its load."""
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.requests[entry.replica] -= 1
            self.tokens[entry.replica] -= entry.cost
            self.work[entry.replica] -= entry.prefill_us + entry.decode_us
        return entry

    def older(self, replica: int, before: float) -> int:
        """How many of ``replica``'s requests were dispatched before ``before``."""
        return sum(1 for e in self._entries.values() if e.replica == replica and e.at < before)

    def lose(self, replica: int) -> list[Entry]:
        """Mark ``replica`` not live and hand back every entry it held (removed)."""
        self.live[replica] = False
        self.reported[replica] = 0
        lost = [e for e in self._entries.values() if e.replica == replica]
        for e in lost:
            del self._entries[e.rid]
        self.requests[replica] = self.tokens[replica] = self.work[replica] = 0
        return lost
