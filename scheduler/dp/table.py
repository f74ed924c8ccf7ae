"""The request dispatch table: every request type to one route kind, checked total.

The mirror of the reply router (:func:`router.scheduler_router`): where that
table says which *sink* an output type goes to, this one says which
*replicas* a request type goes to. Same :class:`~router.TypeTable`, same
rule: the most specific registration wins, the table is checked at
start-up to cover every concrete :class:`~messages.Request` (a class
without a route fails start-up, not the first unlucky request), and there
is no catch-all. A new control request that someone forgets to route cannot
fall through to one replica while its caller waits for N replies (SGLang PR
22083's hang).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from messages import (
    AbortReq,
    KVHandoff,
    Request,
    RpcReqInput,
    RpcReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    concrete_types,
)
from router import NoRouteError, NoSinkError, TypeTable

__all__ = ["Balanced", "Broadcast", "Owner", "Reducer", "Refused", "ReplicaReply", "Route",
           "dispatch_table"]


@dataclass(frozen=True, slots=True)
class ReplicaReply:
    """What one replica answered to a broadcast: its reply, or why there is none."""

    replica: str
    reply: RpcReqOutput | None
    failure: str | None = None  # "timed out", "lost", "not live"


#: Turns every replica's answer to one broadcast call into the caller's single reply.
Reducer = Callable[[RpcReqInput, Sequence[ReplicaReply]], RpcReqOutput]


@dataclass(frozen=True, slots=True)
class Balanced:
    """To one live replica, the least loaded (or the one the request pins)."""


@dataclass(frozen=True, slots=True)
class Owner:
    """To the replica that holds the request's rid (an abort), and to no other."""


@dataclass(frozen=True, slots=True)
class Broadcast:
    """To every live replica once; the replies are merged by ``reduce``."""

    reduce: Reducer


@dataclass(frozen=True, slots=True)
class Refused:
    """Never taken from upstream: answered ``invalid_request`` saying ``why``."""

    why: str


Route = Balanced | Owner | Broadcast | Refused


def dispatch_table(reduce: Reducer, types: Iterable[type[Request]] | None = None
                   ) -> TypeTable[Request, Route]:
    """The frozen dispatch table: generate and embed balanced, abort to its owner,
    rpc broadcast and merged by ``reduce``.

    Args:
        reduce: how a broadcast rpc's replies become one.
        types: the request types it must cover (default: every concrete
            :class:`~messages.Request` defined now).

    Raises:
        NoRouteError: a request type has no route (each one is named).
    """
    table: TypeTable[Request, Route] = TypeTable(
        Request, concrete_types(Request) if types is None else types)
    table.register(TokenizedGenerateReqInput, Balanced())
    table.register(TokenizedEmbeddingReqInput, Balanced())
    table.register(AbortReq, Owner())
    table.register(RpcReqInput, Broadcast(reduce))
    # A hand-off comes from a prefill replica's outputs, and goes on by the reply
    # router's KVHandoff row; a client has no state of ours to hand over.
    table.register(KVHandoff, Refused("a KVHandoff is accepted from a prefill replica only, "
                                      "not from upstream"))
    try:
        table.freeze()
    except NoSinkError as exc:
        raise NoRouteError(exc.output_types, "checked at start-up: give every request type a "
                           "route (Balanced, Owner, Broadcast or Refused) in scheduler.dp.table") \
            from None
    return table
