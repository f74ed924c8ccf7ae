"""``Router[O]``: each output type to a sink, most specific class first, total over the types."""

from router.backlog import Backlog, Overflow
from router.dispatch import TypeTable
from router.errors import (
    AmbiguousRouteError,
    NoRouteError,
    NoSinkError,
    RouterFrozenError,
    RoutingError,
)
from router.router import Router, RouterStats, Sink, SinkFailure
from router.sinks import CallbackSink, RingSink, RpcReplySink, TransportSink
from router.tables import scheduler_router

__all__ = [
    "AmbiguousRouteError",
    "Backlog",
    "CallbackSink",
    "NoRouteError",
    "NoSinkError",
    "Overflow",
    "RingSink",
    "Router",
    "RouterFrozenError",
    "RouterStats",
    "RoutingError",
    "RpcReplySink",
    "Sink",
    "SinkFailure",
    "TransportSink",
    "TypeTable",
    "scheduler_router",
]
