"""The in-flight ledger: who owns each rid, and how loaded each replica is.

Pure bookkeeping, no sockets, so its rules are tested as properties:

* **Ownership.** Every dispatched rid maps to one replica (and that
  replica's generation, so a reply from an earlier incarnation is told
  apart). An abort goes to the owner only; an output from anyone else is
  stale.
* **Load.** Per replica: requests and tokens outstanding (prompt +
  ``max_new_tokens``), added at dispatch, removed at the terminal output;
  plus what the replica last *reported* (its ``get_load``: requests from
  other clients, or queued behind ours). The least-loaded live replica wins,
  ties broken by rotation, so equal replicas take turns.
* **Liveness.** A replica that is not live is never picked, whatever the
  policy or pin. Losing one hands back its entries: started ones must fail,
  unstarted ones may run elsewhere.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import Literal

from messages import Request

__all__ = ["Entry", "Ledger", "NoLiveReplica", "Policy"]

#: How a balanced request picks its replica.
Policy = Literal["least_loaded", "round_robin"]

#: Tokens one reported request counts as, beside the tokens we know of: a
#: request queued on a replica by someone else is worth about a short prompt.
REPORTED_REQUEST_TOKENS = 256


class NoLiveReplica(Exception):
    """No replica can take the request (none live, or the pinned one is not)."""


@dataclass(slots=True)
class Entry:
    """One dispatched request."""

    rid: str
    replica: int
    generation: int
    cost: int
    #: Kept until the first output arrives, so a lost replica's unstarted
    #: requests can run elsewhere; dropped then (it may hold tensors).
    request: Request | None
    pinned: bool = False
    started: bool = False
    aborted: bool = False
    at: float = 0.0  # when it was dispatched (monotonic)


class Ledger:
    """Ownership and load of ``n`` replicas (all live at first)."""

    def __init__(self, n: int, policy: Policy = "least_loaded") -> None:
        if n < 1:
            raise ValueError("a ledger needs at least one replica")
        if policy not in ("least_loaded", "round_robin"):
            raise ValueError(f"unknown policy {policy!r} (least_loaded or round_robin)")
        self.n = n
        self.policy: Policy = policy
        self.live = [True] * n
        self.requests = [0] * n
        self.tokens = [0] * n
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
        """Its load in tokens: ours outstanding, plus what it reports beyond ours."""
        extra = max(0, self.reported[replica] - self.requests[replica])
        return self.tokens[replica] + extra * REPORTED_REQUEST_TOKENS

    def pick(self, pin: int | None = None, exclude: Container[int] = ()) -> int:
        """The replica for a new request, never one in ``exclude``.

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

    def add(self, rid: str, replica: int, generation: int, cost: int,
            request: Request | None, *, pinned: bool = False, at: float = 0.0) -> Entry:
        """Record ``rid`` as dispatched to ``replica`` (at monotonic time ``at``).

        Raises:
            KeyError: ``rid`` is already in flight.
        """
        if rid in self._entries:
            raise KeyError(rid)
        entry = Entry(rid, replica, generation, cost, request, pinned, at=at)
        self._entries[rid] = entry
        self.requests[replica] += 1
        self.tokens[replica] += cost
        self.dispatched[replica] += 1
        self.dispatched_tokens[replica] += cost
        return entry

    def finish(self, rid: str) -> Entry | None:
        """``rid`` got its terminal output: forget it and release its load."""
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.requests[entry.replica] -= 1
            self.tokens[entry.replica] -= entry.cost
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
        self.requests[replica] = self.tokens[replica] = 0
        return lost
