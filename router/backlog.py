"""``Backlog``: outputs a sink could not take yet, waiting in order, bounded.

Policy (the loop never blocks on an output socket, and nothing is lost
silently):

* Sinks send without blocking. One that raises :class:`~bus.WouldBlock`
  (a consumer that stopped reading: a full PUSH pipe, a full egress ring, an
  rpc client not reading its replies) has the output queued here instead.
* Queues are kept per (sink, origin): outputs to one requester stay in
  order, and a stuck rpc client cannot hold up the replies to another.
  Once a queue exists, new outputs for it join its tail rather than
  overtaking it.
* :meth:`Router.flush <router.Router.flush>` retries every queue from its
  head, each scheduler step.
* A queue longer than ``max_items`` *overflows*: its items are handed to the
  ``on_overflow`` callback, which returns what to keep instead (the
  scheduler replaces the stuck streams by one terminal error per request and
  aborts those requests, freeing their slots). Without a callback, the
  oldest items past the bound are reported as sink failures and dropped.
  What a callback keeps (terminal answers that must be delivered) may exceed
  the bound; the next overflow of that queue then waits until it has
  doubled (or grown by ``max_items``), so each push costs O(1) amortized. The scheduler also
  stops taking new requests from the inbox concerned
  (:class:`~scheduler.core.backpressure.InboxThrottle`), which bounds the
  number of such answers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from bus import Origin
from messages import Output

__all__ = ["Backlog", "Overflow"]

O = TypeVar("O", bound=Output)  # noqa: E741
O_contra = TypeVar("O_contra", bound=Output, contravariant=True)

#: Given the items of an overflowing queue, oldest first, return what to keep.
Overflow = Callable[[list[tuple[O, Origin]]], list[tuple[O, Origin]]]


class _AnySink(Protocol[O_contra]):
    def send(self, output: O_contra, origin: Origin, /) -> None: ...


@dataclass(slots=True)
class _Queue(Generic[O]):
    sink: _AnySink[O]
    limit: int  # overflow when longer than this
    items: deque[tuple[O, Origin]] = field(default_factory=deque)


class Backlog(Generic[O]):
    """FIFO queues of outputs per (sink, origin), each bounded by ``max_items``.

    Used by :class:`~router.Router`; see the module docstring for the policy.
    """

    def __init__(self, max_items: int = 1024) -> None:
        if max_items < 1:
            raise ValueError("max_items must be >= 1")
        self.max_items = max_items
        self.on_overflow: Overflow[O] | None = None
        self.overflows = 0
        self._queues: dict[tuple[int, Origin], _Queue[O]] = {}
        self._size = 0

    def __len__(self) -> int:
        """Outputs waiting, all queues together."""
        return self._size

    def __bool__(self) -> bool:
        return bool(self._queues)

    def holds(self, sink: _AnySink[O], origin: Origin) -> bool:
        """Whether outputs for ``(sink, origin)`` already wait (a new one must queue too)."""
        return (id(sink), origin) in self._queues

    def push(self, sink: _AnySink[O], output: O, origin: Origin
             ) -> list[tuple[O, Origin]]:
        """Queue ``output``; returns the items dropped by an overflow (usually none)."""
        return self.push_many(sink, (output,), origin)

    def push_many(self, sink: _AnySink[O], outputs: Iterable[O], origin: Origin
                  ) -> list[tuple[O, Origin]]:
        """Queue ``outputs``, in order, then check the bound once: an overflow policy
        sees all of them together (a step's outputs), never half of a step."""
        key = (id(sink), origin)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue(sink, self.max_items)
        before = len(q.items)
        q.items.extend((output, origin) for output in outputs)
        self._size += len(q.items) - before
        if len(q.items) <= q.limit:
            return []
        self.overflows += 1
        items = list(q.items)
        if self.on_overflow is not None:
            kept = self.on_overflow(items)
            dropped: list[tuple[O, Origin]] = []
        else:
            cut = len(items) - self.max_items
            kept, dropped = items[cut:], items[:cut]
        self._size += len(kept) - len(items)
        q.items = deque(kept)
        # What an overflow keeps (terminal answers) may itself pass the bound:
        # the next overflow then waits until the queue has grown by as much
        # again (at least max_items), so pushing stays O(1) amortized instead
        # of a pass over the whole queue per push.
        q.limit = max(2 * len(q.items), len(q.items) + self.max_items)
        if not q.items:
            del self._queues[key]
        return dropped

    def by_origin(self) -> dict[Origin, int]:
        """Outputs waiting per origin (all sinks together)."""
        out: dict[Origin, int] = {}
        for (_, origin), q in self._queues.items():
            out[origin] = out.get(origin, 0) + len(q.items)
        return out

    def discard(self, inbox: str) -> int:
        """Drop every output whose origin is ``inbox`` (all sinks); returns how many."""
        n = 0
        for key, q in list(self._queues.items()):
            if key[1].inbox == inbox:
                n += len(q.items)
                del self._queues[key]
        self._size -= n
        return n

    def queues(self) -> Iterator[tuple[_AnySink[O], deque[tuple[O, Origin]]]]:
        """Each non-empty queue's sink and items (for flushing; safe to pop from)."""
        for key, q in list(self._queues.items()):
            yield q.sink, q.items
            if not q.items:
                del self._queues[key]

    def taken(self, n: int) -> None:
        """Record that ``n`` items were popped from the queues."""
        self._size -= n
