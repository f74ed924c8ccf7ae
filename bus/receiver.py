"""``Receiver``: one fair drain over every inbox, and one wait over all of them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import zmq

from bus.channels import Inbox
from bus.envelope import Envelope, Rejected
from bus.errors import EndOfChannel
from messages import Message

__all__ = ["Receiver", "ReceiverStats"]

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    """Counters of a receiver since it was built."""

    polls: int
    received: int
    rejected: int
    waits: int
    ended: tuple[str, ...]


class Receiver(Generic[M]):
    """Drains all inboxes fairly; parks on one poll over all of them.

    ``poll()`` takes at most ``budget`` messages in all, round-robin: each
    inbox gets an equal share, and what one does not use passes to the
    others, so a flooded work channel cannot starve rpc. ``wait()`` blocks on
    one :class:`zmq.Poller` holding every socket and every ring fd, so any
    channel wakes an idle loop at once.

    An inbox that ends cleanly (a closed ring, drained) is dropped from the
    set and named in :meth:`statistics`.
    """

    def __init__(self, inboxes: Iterable[Inbox[M]], *, budget: int = 256) -> None:
        if budget < 1:
            raise ValueError("budget must be >= 1")
        self.budget = budget
        self._inboxes: list[Inbox[M]] = []
        self._poller = zmq.Poller()
        self._start = 0
        self._polls = self._received = self._waits = 0
        self._rejected = 0  # of inboxes no longer here
        self._ended: list[str] = []
        self._paused: set[str] = set()
        for inbox in inboxes:
            self.add(inbox)

    @property
    def inboxes(self) -> tuple[Inbox[M], ...]:
        """The inboxes being drained, in registration order."""
        return tuple(self._inboxes)

    def add(self, inbox: Inbox[M]) -> None:
        """Start draining ``inbox``.

        Raises:
            ValueError: an inbox of that name is already here.
        """
        if any(i.name == inbox.name for i in self._inboxes):
            raise ValueError(f"an inbox named {inbox.name!r} is already registered")
        self._inboxes.append(inbox)
        self._poller.register(inbox.pollable(), zmq.POLLIN)

    def remove(self, inbox: Inbox[M]) -> None:
        """Stop draining ``inbox`` (it is not closed)."""
        self._inboxes.remove(inbox)
        if inbox.name not in self._paused:
            self._poller.unregister(inbox.pollable())
        self._paused.discard(inbox.name)
        self._rejected += inbox.rejected  # keep its count in the statistics

    @property
    def paused(self) -> frozenset[str]:
        """Names of the inboxes neither drained nor waited on (see :meth:`pause`)."""
        return frozenset(self._paused)

    def pause(self, name: str) -> None:
        """Stop draining the inbox ``name`` until :meth:`resume`; what arrives waits in it.

        Backpressure: when the consumer of an inbox's outputs stops reading,
        taking more requests from that inbox would only pile up answers no one
        reads. Left in the inbox, they are bounded by its high-water mark (or
        ring capacity), and the sender sees it. Idempotent.

        Raises:
            KeyError: no inbox of that name.
        """
        inbox = self._named(name)
        if name not in self._paused:
            self._paused.add(name)
            self._poller.unregister(inbox.pollable())

    def resume(self, name: str) -> None:
        """Drain the inbox ``name`` again. Idempotent.

        Raises:
            KeyError: no inbox of that name.
        """
        inbox = self._named(name)
        if name in self._paused:
            self._paused.discard(name)
            self._poller.register(inbox.pollable(), zmq.POLLIN)

    def _named(self, name: str) -> Inbox[M]:
        for inbox in self._inboxes:
            if inbox.name == name:
                return inbox
        raise KeyError(f"no inbox named {name!r}")

    def poll(self) -> list[Envelope[M] | Rejected]:
        """Take up to ``budget`` waiting messages from all inboxes, fairly. Never blocks."""
        self._polls += 1
        out: list[Envelope[M] | Rejected] = []
        n = len(self._inboxes)
        if n == 0:
            return out
        start = self._start % n
        self._start = start + 1  # rotate who goes first
        pending = self._inboxes[start:] + self._inboxes[:start]
        if self._paused:
            pending = [i for i in pending if i.name not in self._paused]
        remaining = self.budget
        ended: list[Inbox[M]] = []
        while remaining and pending:
            share = max(1, remaining // len(pending))
            more: list[Inbox[M]] = []
            for inbox in pending:
                take = min(share, remaining)
                try:
                    got = inbox.drain(take)
                except EndOfChannel:
                    ended.append(inbox)
                    continue
                out.extend(got)
                # A burst can hand over more than was asked: that is fine, the
                # budget just runs out sooner.
                remaining = max(0, remaining - len(got))
                if len(got) >= take:
                    more.append(inbox)  # it may hold more
                if not remaining:
                    break
            pending = more
        for inbox in ended:
            self.remove(inbox)
            self._ended.append(inbox.name)
        self._received += len(out)
        return out

    def wait(self, timeout: float | None) -> bool:
        """Park until any inbox has data or ``timeout`` seconds pass (None: forever).

        Returns whether something is ready. Burns no CPU while parked.
        """
        self._waits += 1
        if not self._inboxes or (timeout is None and len(self._inboxes) == len(self._paused)):
            return False  # nothing could ever wake it
        ms = None if timeout is None else max(0, int(timeout * 1000))
        return bool(self._poller.poll(ms))

    def statistics(self) -> ReceiverStats:
        """A snapshot of the counters."""
        rejected = self._rejected + sum(i.rejected for i in self._inboxes)
        return ReceiverStats(self._polls, self._received, rejected, self._waits,
                             tuple(self._ended))

    def close(self) -> None:
        """Close every inbox. Idempotent."""
        for inbox in list(self._inboxes):
            inbox.close()
            self.remove(inbox)
