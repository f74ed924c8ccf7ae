"""Routing errors (the ``router`` branch of the tree drawn in :mod:`messages.errors`)."""

from __future__ import annotations

from collections.abc import Iterable

from messages.errors import BusError

__all__ = ["AmbiguousRouteError", "NoRouteError", "NoSinkError", "RouterFrozenError",
           "RoutingError"]


class RoutingError(BusError):
    """An output could not be (or would not be) routed."""


class NoSinkError(RoutingError):
    """No registered class covers these output types.

    Raised by the totality check (listing every uncovered type) and by
    ``route()`` for an unknown type: an output is never dropped silently.
    """

    def __init__(self, output_types: Iterable[type], where: str = "") -> None:
        self.output_types = tuple(output_types)
        names = ", ".join(t.__qualname__ for t in self.output_types)
        super().__init__(f"no sink for {names}{f' ({where})' if where else ''}")


class NoRouteError(NoSinkError):
    """Request types with no dispatch route (a data-parallel dispatcher's table).

    A :class:`NoSinkError` too, so a caller catching that catches this; the
    message speaks of requests and routes, not outputs and sinks.
    """

    def __init__(self, request_types: Iterable[type], where: str = "") -> None:
        super().__init__(request_types, where)
        names = ", ".join(t.__qualname__ for t in self.output_types)
        self.args = (f"no dispatch route for request type {names}"
                     f"{f' ({where})' if where else ''}",)


class AmbiguousRouteError(RoutingError):
    """Two unrelated registered bases both match a class (multiple inheritance)."""

    def __init__(self, output_type: type, first: type, second: type) -> None:
        self.output_type = output_type
        self.candidates = (first, second)
        super().__init__(
            f"ambiguous route for {output_type.__qualname__}: both {first.__qualname__} and "
            f"{second.__qualname__} are registered and neither is more specific; "
            f"register {output_type.__qualname__} itself")


class RouterFrozenError(RoutingError):
    """Registration after routing started (or after ``freeze()``)."""

    def __init__(self, output_type: type) -> None:
        self.output_type = output_type
        super().__init__(f"cannot register {output_type.__qualname__}: the table is frozen "
                         "(routing has started)")
