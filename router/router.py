"""``Router[O]``: output type -> sink, the most specific registered class winning.

Where does an rpc reply go? To the sink registered for ``RpcReqOutput``,
whatever else is registered and in whatever order: ``RpcReqOutput`` is more
specific than ``Output``. That is the whole fix for the seed's misrouted reply.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from bus import LogSummary, Origin, WouldBlock
from messages import Output, concrete_types
from router.backlog import Backlog, Overflow
from router.dispatch import TypeTable

__all__ = ["Router", "RouterStats", "Sink", "SinkFailure"]

O = TypeVar("O", bound=Output)  # noqa: E741
T = TypeVar("T", bound=Output)
O_contra = TypeVar("O_contra", bound=Output, contravariant=True)

log = logging.getLogger("router")


class Sink(Protocol[O_contra]):
    """Where routed outputs go. ``send`` may raise; the router isolates the failure.

    A sink may also offer ``send_many(outputs, origin) -> int``: deliver
    several at once, in order, returning how many it took (0: it would
    block); it raises only for the first, having sent nothing (see
    :meth:`Router.batching`).
    """

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
    """Counters of a router since it was built.

    ``routed``: outputs a sink took; ``failed``: outputs a sink refused with
    an error (each reported); ``backlog``: outputs waiting now for a consumer
    that is not reading; ``overflows``: times a waiting queue hit its bound.
    """

    routed: int
    failed: int
    backlog: int = 0
    overflows: int = 0


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
        max_backlog: most outputs waiting per (sink, origin) for a consumer
            that is not reading (see :mod:`router.backlog`).

    A sink that raises :class:`~bus.WouldBlock` is not a failure: the output
    waits in the backlog, in order, and :meth:`flush` retries it.
    """

    def __init__(self, base: type[O], *, types: Iterable[type[O]] | None = None,
                 on_failure: Callable[[SinkFailure], None] | None = None,
                 max_backlog: int = 1024) -> None:
        self._table: TypeTable[O, Sink[O]] = TypeTable(
            base, concrete_types(base) if types is None else types)
        self.on_failure = on_failure
        self._backlog: Backlog[O] = Backlog(max_backlog)
        # route()'s fast path reads the table's cache directly (a method call
        # is a third of the dispatch cost); the table only clears it in place.
        self._hits = self._table._cache
        self._routed = 0
        self._failed = 0
        # One log line per interval, not per failure: a client that left can
        # make every reply to it fail.
        self._failures_log = LogSummary(log, "sink failures", level=logging.ERROR)
        self._ok: dict[type, int] = {}  # per output type, for metrics
        self._bad: dict[type, int] = {}
        self._held: list[tuple[Sink[O], O, Origin]] | None = None  # see batching()

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

    @property
    def on_overflow(self) -> Overflow[O] | None:
        """Called with the items of a backlog queue past its bound; returns what to keep."""
        return self._backlog.on_overflow

    @on_overflow.setter
    def on_overflow(self, fn: Overflow[O] | None) -> None:
        self._backlog.on_overflow = fn

    @property
    def backlog(self) -> int:
        """Outputs waiting for a consumer that is not reading."""
        return len(self._backlog)

    def backlog_by_origin(self) -> dict[Origin, int]:
        """Outputs waiting per origin: which requesters' consumers are not reading."""
        return self._backlog.by_origin()

    def discard(self, inbox: str) -> int:
        """Drop the outputs waiting for the requesters of ``inbox`` (their consumer is
        gone: sent later, they would reach whoever reads next); returns how many."""
        return self._backlog.discard(inbox)

    def route(self, output: O, origin: Origin) -> bool:
        """Deliver ``output`` now, or queue it behind a consumer that is not reading.

        Returns ``False`` when its sink failed. A failing sink is isolated:
        counted, logged with the output type and origin, reported to
        ``on_failure``; the caller goes on. A sink that would block is not a
        failure: the output waits in the backlog (see :meth:`flush`).

        Raises:
            NoSinkError: no registration covers the output's type (never a
                silent drop).
        """
        sink = self._hits.get(type(output))
        if sink is None:
            sink = self._table.lookup(type(output))
        if self._held is not None and hasattr(sink, "send_many"):
            self._held.append((sink, output, origin))
            return True
        # A sink that takes one at a time (rpc replies) gains nothing by waiting
        # for the step's end, and its caller would wait out the model step.
        return self._deliver(sink, output, origin)

    @contextlib.contextmanager
    def batching(self) -> Iterator[None]:
        """Hold what is routed inside the block to sinks with ``send_many``; at its
        end, send each (sink, origin)'s outputs in one ``send_many``: a scheduler
        step's outputs leave as one burst, one zmq message. Outputs to other
        sinks (rpc replies) are sent at once, as outside a block.

        Order per (sink, origin) is kept, and so are the backlog rules: what
        a sink does not take waits in its backlog. Nested blocks send at the
        outermost one's end. A failure is reported per output, as in
        :meth:`route` (which returns ``True`` inside a block: its outcome is
        not known yet).
        """
        if self._held is not None:
            yield
            return
        held: list[tuple[Sink[O], O, Origin]] = []
        self._held = held
        try:
            yield
        finally:
            self._held = None
            # Per (sink, origin), in order: order only matters within one
            # destination, and a step's outputs for one stay one run.
            runs: dict[tuple[int, Origin], tuple[Sink[O], list[O]]] = {}
            for sink, output, origin in held:
                run = runs.get((id(sink), origin))
                if run is None:
                    runs[(id(sink), origin)] = (sink, [output])
                else:
                    run[1].append(output)
            for (_, origin), (sink, outputs) in runs.items():
                self._deliver_run(sink, outputs, origin)

    def _deliver(self, sink: Sink[O], output: O, origin: Origin) -> bool:
        backlog = self._backlog
        if backlog and backlog.holds(sink, origin):  # keep order behind what waits
            self._queue(sink, output, origin)
            return True
        try:
            sink.send(output, origin)
        except WouldBlock:
            self._queue(sink, output, origin)
            return True
        except Exception as exc:
            self._fail(sink, output, origin, exc)
            return False
        self._routed += 1
        kind = type(output)
        self._ok[kind] = self._ok.get(kind, 0) + 1
        return True

    def _deliver_run(self, sink: Sink[O], run: list[O], origin: Origin) -> None:
        if self._backlog and self._backlog.holds(sink, origin):  # behind what waits
            self._queue_many(sink, run, origin)
            return
        many: Callable[[Sequence[O], Origin], int] | None = getattr(sink, "send_many", None)
        if many is None or len(run) == 1:
            for output in run:
                self._deliver(sink, output, origin)
            return
        rest = run
        while rest:
            try:
                n = many(rest, origin)  # raises only for rest[0], having sent nothing
            except WouldBlock:
                n = 0
            except Exception as exc:  # rest[0] cannot be sent: it fails alone
                self._fail(sink, rest[0], origin, exc)
                rest = rest[1:]
                continue
            if n == 0:  # the consumer stopped taking them: they wait, in order, together
                self._queue_many(sink, rest, origin)
                return
            self._routed += n
            for output in rest[:n]:
                kind = type(output)
                self._ok[kind] = self._ok.get(kind, 0) + 1
            rest = rest[n:]

    def flush(self) -> int:
        """Retry every waiting output, oldest first per queue; returns how many still wait.

        Stops on a queue at its first output that would still block; a sink
        error fails that output alone (reported as in :meth:`route`).
        """
        backlog = self._backlog
        if not backlog:
            return 0
        for sink, items in backlog.queues():
            taken = 0
            while items:
                output, origin = items[0]
                try:
                    sink.send(output, origin)
                except WouldBlock:
                    break
                except Exception as exc:
                    self._fail(sink, output, origin, exc)
                else:
                    self._routed += 1
                    kind = type(output)
                    self._ok[kind] = self._ok.get(kind, 0) + 1
                items.popleft()
                taken += 1
            backlog.taken(taken)
        return len(backlog)

    def _queue(self, sink: Sink[O], output: O, origin: Origin) -> None:
        self._queue_many(sink, (output,), origin)

    def _queue_many(self, sink: Sink[O], outputs: Sequence[O], origin: Origin) -> None:
        for old, old_origin in self._backlog.push_many(sink, outputs, origin):
            self._fail(sink, old, old_origin,
                       WouldBlock(type(sink).__qualname__, "dropped: the backlog of a "
                                  f"consumer that is not reading passed {self._backlog.max_items}"
                                  " outputs and no overflow policy is set"))

    def _fail(self, sink: Sink[O], output: O, origin: Origin, exc: BaseException) -> None:
        self._failed += 1
        kind = type(output)
        self._bad[kind] = self._bad.get(kind, 0) + 1
        failure = SinkFailure(type(output).__qualname__, origin, type(sink).__qualname__, exc)
        self._failures_log.add(f"{failure.sink}/{failure.output_type}", f"from {origin}: {exc}")
        if self.on_failure is not None:
            self.on_failure(failure)

    def counts(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``(routed, failed)`` per (output type name, sink type name) seen so far."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for kind in {*self._ok, *self._bad}:
            sink = type(self._table.lookup(kind)).__qualname__
            out[(kind.__qualname__, sink)] = (self._ok.get(kind, 0), self._bad.get(kind, 0))
        return out

    def statistics(self) -> RouterStats:
        """A snapshot of the counters."""
        return RouterStats(self._routed, self._failed, len(self._backlog),
                           self._backlog.overflows)
