"""``Router[O]``: output type -> sink, the most specific registered class winning.

Where does an rpc reply go? To the sink registered for ``RpcReqOutput``,
whatever else is registered and in whatever order: ``RpcReqOutput`` is more
specific than ``Output``. That is the whole fix for the seed's misrouted reply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from bus import Origin
from messages import Output, concrete_types
from router.dispatch import TypeTable

__all__ = ["Router", "RouterStats", "Sink", "SinkFailure"]

O = TypeVar("O", bound=Output)  # noqa: E741
T = TypeVar("T", bound=Output)
O_contra = TypeVar("O_contra", bound=Output, contravariant=True)

log = logging.getLogger("router")


class Sink(Protocol[O_contra]):
    """Where routed outputs go. ``send`` may raise; the router isolates the failure."""

    def send(self, output: O_contra, origin: Origin, /) -> None:
        """Deliver ``output``, which answers a request that came from ``origin``."""
        ...


@dataclass(frozen=True, slots=True)
class SinkFailure:
    """A sink raised while delivering an output: what, where from, and why."""

    output_type: str
    origin: Origin
    sink: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class RouterStats:
    """Counters of a router since it was built."""

    routed: int
    failed: int


class Router(Generic[O]):
    """Routes each output to the sink registered for its most specific class.

    Args:
        base: the output family (``Output``); registrations must lie under it.
        types: the concrete output types that must all have a sink; defaults
            to every concrete subclass of ``base``. Checked when routing
            starts (or at :meth:`freeze`): a missing sink fails start-up, not
            the first unlucky request.
        on_failure: called with a :class:`SinkFailure` whenever a sink raises
            (after logging); routing of other outputs goes on.
    """

    def __init__(self, base: type[O], *, types: Iterable[type[O]] | None = None,
                 on_failure: Callable[[SinkFailure], None] | None = None) -> None:
        self._table: TypeTable[O, Sink[O]] = TypeTable(
            base, concrete_types(base) if types is None else types)
        self.on_failure = on_failure
        # route()'s fast path reads the table's cache directly (a method call
        # is a third of the dispatch cost); the table only clears it in place.
        self._hits = self._table._cache
        self._routed = 0
        self._failed = 0

    def register(self, output_type: type[T], sink: Sink[T]) -> None:
        """Send outputs of ``output_type`` (and its subclasses) to ``sink``.

        Raises:
            TypeError: ``output_type`` is not a class under the router's base.
            RouterFrozenError: routing has started.
        """
        self._table.register(output_type, sink)  # type: ignore[arg-type]

    @property
    def registry(self) -> Mapping[type, Sink[O]]:
        """The registrations, read-only."""
        return self._table.registry

    def freeze(self) -> None:
        """Close registration after the totality check.

        Raises:
            NoSinkError: listing every output type with no sink.
            AmbiguousRouteError: a type matches two unrelated registrations.
        """
        self._table.freeze()

    def sink_for(self, output_type: type[O]) -> Sink[O]:
        """The sink ``output_type`` resolves to (freezes the table).

        Raises:
            NoSinkError: no registration covers it.
        """
        return self._table.lookup(output_type)

    def route(self, output: O, origin: Origin) -> bool:
        """Deliver ``output``; returns whether its sink succeeded.

        A failing sink is isolated: counted, logged with the output type and
        origin, reported to ``on_failure``; the caller goes on.

        Raises:
            NoSinkError: no registration covers the output's type (never a
                silent drop).
        """
        sink = self._hits.get(type(output))
        if sink is None:
            sink = self._table.lookup(type(output))
        try:
            sink.send(output, origin)
        except Exception as exc:
            self._failed += 1
            failure = SinkFailure(type(output).__qualname__, origin, type(sink).__qualname__,
                                  exc)
            log.error("sink %s failed for %s from %s: %s", failure.sink, failure.output_type,
                      origin, exc)
            if self.on_failure is not None:
                self.on_failure(failure)
            return False
        self._routed += 1
        return True

    def statistics(self) -> RouterStats:
        """A snapshot of the counters."""
        return RouterStats(self._routed, self._failed)
