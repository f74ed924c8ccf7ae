"""Broadcast rpc: one call to every live replica, one merged reply to the caller.

Each replica gets the call under its own rid (``dp<seq>.<replica>``), so
replies are matched per (call, replica) and a reply from a replica that was
not asked, or came after the deadline, matches nothing: it is dropped and
counted, never taken as someone's answer. The merged reply
(:func:`merge_replies`) succeeds only if every replica succeeded, and names
each one that failed, timed out or was lost; it never passes one replica's
answer off as everyone's (vLLM's data-parallel utility calls return
``[0]``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bus import Origin
from messages import RpcReqInput, RpcReqOutput, RpcResult, Scalar, fit_text
from scheduler.dp.table import Reducer, ReplicaReply

__all__ = ["CallerQueue", "Fanout", "PendingCall", "merge_replies"]

#: Per method, the keys whose values add up across replicas (the whole's load, what
#: the whole's prefix caches freed).
SUMMED: dict[str, frozenset[str]] = {
    "get_load": frozenset({"running", "queued", "tokens_per_s", "steps"}),
    "flush_cache": frozenset({"freed_bytes"}),
}


@dataclass(slots=True)
class PendingCall:
    """A broadcast waiting for its replicas."""

    call: RpcReqInput
    origin: Origin
    deadline: float
    reduce: Reducer
    waiting: dict[int, str] = field(default_factory=dict)  # replica -> its rid
    replies: dict[int, ReplicaReply] = field(default_factory=dict)


class Fanout:
    """The broadcasts in flight; ``names[i]`` names replica ``i`` in replies."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._seq = itertools.count()
        self._calls: dict[int, PendingCall] = {}
        self._by_rid: dict[str, tuple[int, int]] = {}  # replica rid -> (call, replica)
        self.late = 0  # replies matching no call still waiting

    def __len__(self) -> int:
        return len(self._calls)

    def start(self, call: RpcReqInput, origin: Origin, deadline: float, reduce: Reducer,
              live: Sequence[int], send: Callable[[int, RpcReqInput], str | None]
              ) -> RpcReqOutput | None:
        """Send ``call`` to each replica in ``live``; the merged reply if none is waited for.

        ``send(replica, call)`` sends one copy and returns why it could not
        (``None`` once sent).
        """
        key = next(self._seq)
        pending = PendingCall(call, origin, deadline, reduce)
        for i in range(len(self.names)):
            if i not in live:
                pending.replies[i] = ReplicaReply(self.names[i], None, "not live")
                continue
            rid = f"dp{key}.{i}"
            why = send(i, RpcReqInput(rid=rid, method=call.method, parameters=call.parameters))
            if why is not None:
                pending.replies[i] = ReplicaReply(self.names[i], None, why)
                continue
            pending.waiting[i] = rid
            self._by_rid[rid] = (key, i)
        self._calls[key] = pending
        return self._complete(key)

    def reply(self, reply: RpcReqOutput, sender: int) -> tuple[RpcReqOutput, Origin] | None:
        """Take replica ``sender``'s reply; the merged one and its origin if it was the last.

        A reply matches only the call sent to ``sender`` under that rid: one
        that answers another replica's rid (a confused or hostile replica)
        is dropped and counted with the late ones, never taken as that
        replica's answer.
        """
        hit = self._by_rid.get(reply.rid)
        if hit is None or hit[1] != sender:
            self.late += 1
            return None
        del self._by_rid[reply.rid]
        key, i = hit
        pending = self._calls[key]
        del pending.waiting[i]
        pending.replies[i] = ReplicaReply(self.names[i], reply)
        done = self._complete(key)
        return None if done is None else (done, pending.origin)

    def lose(self, replica: int, why: str) -> list[tuple[RpcReqOutput, Origin]]:
        """``replica`` is gone: every call waiting on it completes without it."""
        return self._give_up(lambda p: replica in p.waiting, why, only=replica)

    def expire(self, now: float) -> list[tuple[RpcReqOutput, Origin]]:
        """Complete every call past its deadline, naming the replicas that did not answer."""
        return self._give_up(lambda p: p.deadline <= now, "timed out", only=None)

    def owes(self, replica: int) -> bool:
        """Whether a call waits on ``replica``."""
        return any(replica in p.waiting for p in self._calls.values())

    def _give_up(self, which: Callable[[PendingCall], bool], why: str,
                 only: int | None) -> list[tuple[RpcReqOutput, Origin]]:
        done: list[tuple[RpcReqOutput, Origin]] = []
        for key, pending in list(self._calls.items()):
            if not which(pending):
                continue
            for i in [only] if only is not None else list(pending.waiting):
                rid = pending.waiting.pop(i)
                del self._by_rid[rid]
                pending.replies[i] = ReplicaReply(self.names[i], None, why)
            merged = self._complete(key)
            if merged is not None:
                done.append((merged, pending.origin))
        return done

    def _complete(self, key: int) -> RpcReqOutput | None:
        pending = self._calls[key]
        if pending.waiting:
            return None
        del self._calls[key]
        replies = [pending.replies[i] for i in range(len(self.names))]
        return pending.reduce(pending.call, replies)


def merge_replies(call: RpcReqInput, replies: Sequence[ReplicaReply]) -> RpcReqOutput:
    """The one reply to a broadcast ``call``.

    * ``success`` only if every replica answered with success (a replica that
      was not live counts as a failure: the call did not reach it);
    * ``message`` names each replica that failed, timed out or was lost, and why;
    * ``result`` holds each replica's result under ``"<replica>.<key>"``, and
      the dispatcher's ``replicas`` and ``failed`` lists (never overwritten
      by a replica's keys). Only when *every* replica succeeded does it also
      hold, at the top level, each key on which all of them agree (so a
      method whose answer is the same everywhere reads as from one
      scheduler), or for a key of :data:`SUMMED` (``get_load``'s counts,
      ``flush_cache``'s ``freed_bytes``) their sum: never
      the answer of the replicas that happened to answer as everyone's.
    """
    result: RpcResult = {}
    failed: list[str] = []
    reasons: list[str] = []
    answers: list[RpcResult] = []
    for r in replies:
        if r.reply is None or not r.reply.success:
            failed.append(r.replica)
            why = r.failure if r.reply is None else (r.reply.message or "failed")
            reasons.append(f"{r.replica}: {why}")
        else:
            answers.append(r.reply.result or {})
        if r.reply is not None and r.reply.result is not None:
            for k, v in r.reply.result.items():
                result[fit_text(f"{r.replica}.{k}", 256)] = v
    if answers and not failed:
        summed = SUMMED.get(call.method, frozenset())
        for k in answers[0]:
            values = [a.get(k) for a in answers]
            if k in summed and all(isinstance(v, int | float) and not isinstance(v, bool)
                                   for v in values):
                result[k] = sum(v for v in values if isinstance(v, int | float))
            elif all(v == values[0] for v in values) and values[0] is not None:
                result[k] = values[0]
    result["replicas"] = [r.replica for r in replies]
    result["failed"] = list[Scalar](failed)
    message = "" if not failed else fit_text(
        f"rpc {call.method!r} failed on {len(failed)} of {len(replies)} replicas: "
        + "; ".join(reasons))
    return RpcReqOutput(rid=call.rid, success=not failed, message=message, result=result)


class CallerQueue:
    """At most ``limit`` broadcasts in flight per caller; its next ones wait here.

    A caller that pipelines thousands of calls (or never reads its replies)
    would otherwise have every replica answer them all between two model
    steps, and every client's streams would wait. Taken in turn, each
    caller's calls reach a replica ``limit`` at a time. At most ``hold`` wait
    per caller; past that a call is refused at once (answered, not run).
    """

    def __init__(self, limit: int = 4, hold: int = 64) -> None:
        self.limit, self.hold = limit, hold
        self._running: dict[Origin, int] = {}
        self._waiting: dict[Origin, deque[RpcReqInput]] = {}

    def admit(self, call: RpcReqInput, origin: Origin) -> bool | None:
        """``True``: run it now; ``False``: it waits its turn; ``None``: refused (too many)."""
        n = self._running.get(origin, 0)
        if n < self.limit:
            self._running[origin] = n + 1
            return True
        waiting = self._waiting.setdefault(origin, deque())
        if len(waiting) >= self.hold:
            return None
        waiting.append(call)
        return False

    def done(self, origin: Origin) -> RpcReqInput | None:
        """One of ``origin``'s calls was answered: its next waiting call to run, if any."""
        waiting = self._waiting.get(origin)
        if waiting:
            call = waiting.popleft()
            if not waiting:
                del self._waiting[origin]
            return call  # it takes the finished one's place
        n = self._running.get(origin, 0) - 1
        if n > 0:
            self._running[origin] = n
        else:
            self._running.pop(origin, None)
        return None
