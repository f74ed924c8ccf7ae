"""What the dispatcher answers and logs by itself, not by asking its replicas.

* ``hello`` (:func:`answer_hello_here`): the dispatcher is the peer that
  decodes a client's frames, so it compares the client's layout with its
  own. A lost replica cannot make a compatible client look incompatible
  (broadcast, the merge failed the whole reply when any replica was down),
  and a refused client costs one summarized log line, not one per replica.
* ``get_load``'s dispatcher view (:func:`with_ledger`): per replica, what
  the dispatcher knows beside what the replica says of itself.
* :class:`DispatcherLogs`: every per-event log of the dispatcher goes
  through a :class:`~bus.LogSummary`, so a flood of garbage frames, reused
  rids or unread rpc replies is a few lines, not one line per event.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import msgspec

from bus import LogSummary, Rejected
from messages import ErrorOut, NotCarried, Output, RpcReqInput, RpcReqOutput, fit_text
from scheduler.dp.affinity import PrefixAffinity
from scheduler.dp.fanout import Fanout
from scheduler.dp.ledger import Ledger
from scheduler.dp.replica import Replica
from scheduler.dp.table import Reducer, ReplicaReply
from scheduler.handshake import answer_hello

__all__ = ["DispatcherLogs", "answer_hello_here", "answer_rejected", "with_ledger"]

log = logging.getLogger("scheduler.dp")


class DispatcherLogs:
    """The dispatcher's summarized logs (one line per kind per ``interval`` at most;
    ``None``: :class:`bus.LogSummary`'s, 10 s unless ``TSB_LOG_SUMMARY_INTERVAL`` says)."""

    def __init__(self, interval: float | None = None) -> None:
        self.rejected = LogSummary(log, "rejected messages", interval=interval)
        self.duplicate = LogSummary(log, "requests dropped: their id is already in flight "
                                         "(answering would end the live one)",
                                    interval=interval)
        self.hello = LogSummary(log, "hello from a client with another wire layout",
                                interval=interval)
        self.dropped_rpc = LogSummary(log, "rpc replies dropped: their caller is not reading",
                                      interval=interval)

    def dropped_reply(self, reply: RpcReqOutput) -> None:
        """Count ``reply``, dropped: its caller does not read."""
        self.dropped_rpc.add("rpc", f"rid {reply.rid!r}")

    def flush(self) -> None:
        """Log whatever was counted since the last summaries."""
        for s in (self.rejected, self.duplicate, self.hello, self.dropped_rpc):
            s.flush()


def answer_hello_here(call: RpcReqInput, logs: DispatcherLogs) -> RpcReqOutput:
    """The dispatcher's own answer to ``hello`` (see the module docstring)."""
    p = call.parameters or {}
    version, fp, layout = p.get("protocol_version"), p.get("fingerprint"), p.get("layout", "")
    if type(version) is not int or not isinstance(fp, str) or not isinstance(layout, str):
        return RpcReqOutput(rid=call.rid, success=False, message="hello takes protocol_version "
                            "(int), fingerprint (str) and layout (str)")
    # answer_hello logs each refusal itself; here that goes through the summary
    # instead (a client saying hello in a loop must not write a line per call).
    hs = logging.getLogger("scheduler.handshake")
    was, hs.disabled = hs.disabled, True
    try:
        result = answer_hello(version, fp, layout)
    except ValueError as exc:
        return RpcReqOutput(rid=call.rid, success=False, message=fit_text(f"hello: {exc}"))
    finally:
        hs.disabled = was
    if result.get("accepted") is not True or result.get("differences"):
        diffs = result.get("differences")
        first = diffs[0] if isinstance(diffs, list) and diffs else "protocol version"
        logs.hello.add("refused" if result.get("accepted") is not True else "compatible",
                       str(first))
    return RpcReqOutput(rid=call.rid, success=True, result=result)


def answer_rejected(env: Rejected, upstream: bool, ledger: Ledger, stats: dict[str, int],
                    logs: DispatcherLogs) -> Output | None:
    """What answers a frame that could not be decoded (``upstream``: from a client,
    not a replica), or ``None``; counted in ``stats``, summarized in ``logs``."""
    err = env.error
    if not upstream:
        stats["stale_outputs"] += 1
        logs.rejected.add(env.origin.inbox, f"undecodable: {err}")
        return None
    stats["rejected"] += 1
    if err.rid is None or err.rid in ledger:  # no one to answer (or not that one)
        logs.rejected.add(env.origin.inbox, str(err))
        return None
    if err.message_type == RpcReqInput.__name__ and not isinstance(err, NotCarried):
        # an rpc call's own failure; one sent on the work channel is answered there
        return RpcReqOutput(rid=err.rid, success=False, message=fit_text(str(err)))
    return ErrorOut(rid=err.rid, code="decode_error", message=fit_text(str(err)))


def with_ledger(reduce: Reducer, replicas: Sequence[Replica], ledger: Ledger,
                stats: dict[str, int], fanout: Fanout, bounds: Mapping[str, int | float],
                affinity: PrefixAffinity | None, call: RpcReqInput,
                replies: Sequence[ReplicaReply]) -> RpcReqOutput:
    """``get_load`` merged, plus what the dispatcher knows per replica and of itself
    (its counters, and ``bounds``: the settings it runs under, as ``dispatcher.<name>``);
    under ``cache_aware`` (``affinity``), per replica its tree's tokens and bound
    (``<replica>.affinity_tokens``, ``.affinity_bound``) and how the policy routed
    (``dispatcher.affinity_<counter>``)."""
    merged = reduce(call, replies)
    result = dict(merged.result or {})
    for rep in replicas:
        i = rep.index
        result[f"{rep.name}.live"] = rep.live
        result[f"{rep.name}.generation"] = rep.generation
        result[f"{rep.name}.in_flight"] = ledger.requests[i]
        result[f"{rep.name}.in_flight_tokens"] = ledger.tokens[i]
        result[f"{rep.name}.dispatched"] = ledger.dispatched[i]
        result[f"{rep.name}.dispatched_tokens"] = ledger.dispatched_tokens[i]
        if affinity is not None:
            result[f"{rep.name}.affinity_tokens"] = affinity.trees[i].size
            result[f"{rep.name}.affinity_bound"] = affinity.trees[i].capacity
    if affinity is not None:
        for key, n in affinity.counters().items():
            result[f"dispatcher.affinity_{key}"] = n
    for key, n in stats.items():
        result[f"dispatcher.{key}"] = n
    result["dispatcher.late_rpc_replies"] = fanout.late
    for key, value in bounds.items():
        result[f"dispatcher.{key}"] = value
    return msgspec.structs.replace(merged, result=result)
