"""Data parallel: N scheduler replicas behind one typed request dispatcher.

:class:`Dispatcher` looks like one scheduler to its clients and spreads
their requests over replicas by a dispatch table checked total at start-up
(:func:`dispatch_table`): generate and embed are balanced by an in-flight
ledger, an abort goes to the replica that owns its rid, an rpc is broadcast
and its replies merged, a hand-off from a client refused. With ``pd=(P, D)``
prefill and decode run apart (a prefill replica's ``KVHandoff`` goes on to a
decode replica). See ``docs/ARCHITECTURE.md`` ("Data parallel").
"""

from scheduler.dp.dispatcher import Dispatcher, DispatcherStats
from scheduler.dp.fanout import merge_replies
from scheduler.dp.ledger import Ledger, NoLiveReplica, Policy
from scheduler.dp.replica import ReplicaSpec
from scheduler.dp.serve import serve_dispatch
from scheduler.dp.table import (
    Balanced,
    Broadcast,
    Owner,
    Refused,
    ReplicaReply,
    Route,
    dispatch_table,
)

__all__ = [
    "Balanced",
    "Broadcast",
    "Dispatcher",
    "DispatcherStats",
    "Ledger",
    "NoLiveReplica",
    "Owner",
    "Policy",
    "Refused",
    "ReplicaReply",
    "ReplicaSpec",
    "Route",
    "dispatch_table",
    "merge_replies",
    "serve_dispatch",
]
