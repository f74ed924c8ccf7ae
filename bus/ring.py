"""``Ring[T]``: a bounded in-process queue whose readiness is a file descriptor.

Many producers, one consumer; objects pass by reference (no serialization).
``fileno()`` is an eventfd (a pipe where eventfd is missing) that is readable
exactly while items wait, so the consumer can park on one poll together with
zmq sockets. A producer touches the fd only when the ring goes from empty to
non-empty: on a busy ring, puts cost no syscall.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from bus.errors import ChannelClosed, EndOfChannel, WouldBlock

__all__ = ["Ring", "RingStats", "open_ring"]

T = TypeVar("T")
_ONE = (1).to_bytes(8, "little")


@dataclass(frozen=True, slots=True)
class RingStats:
    """Counters of a ring since it was opened."""

    puts: int
    gets: int
    full_events: int
    high_water: int
    signals: int


class Ring(Generic[T]):
    """A bounded many-producer, one-consumer queue with a pollable fd.

    Args:
        capacity: most items waiting at once; ``put`` blocks (or times out,
            or raises :class:`~bus.errors.WouldBlock` with ``put_nowait``)
            when full.
        name: the channel name used in errors.

    Closing: :meth:`close` is idempotent; afterwards ``put`` raises
    :class:`~bus.errors.ChannelClosed`, items already queued are still
    delivered, and then ``get_nowait`` raises :class:`~bus.errors.EndOfChannel`.
    It wakes blocked producers and the parked consumer.
    """

    def __init__(self, capacity: int = 65536, *, name: str = "ring") -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.name = name
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._closed = False
        self._signalled = False
        if hasattr(os, "eventfd"):
            self._rfd = self._wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - non-Linux
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
        self._fd_open = True
        self._puts = self._gets = self._full = self._high = self._signals = 0

    # -- producer side ------------------------------------------------------

    def put(self, item: T, timeout: float | None = None) -> None:
        """Add ``item``, waiting up to ``timeout`` seconds (None: forever) for room.

        Raises:
            ChannelClosed: the ring is closed.
            WouldBlock: still full when the timeout ran out.
        """
        with self._lock:
            if len(self._items) >= self.capacity and not self._closed:
                self._full += 1
                deadline = None if timeout is None else time.monotonic() + timeout
                while len(self._items) >= self.capacity and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise WouldBlock(self.name, f"full ({self.capacity} items) after "
                                                    f"{timeout:g} s")
                    self._not_full.wait(left)
            self._append(item)

    def put_nowait(self, item: T) -> None:
        """Add ``item`` now.

        Raises:
            ChannelClosed: the ring is closed.
            WouldBlock: the ring is full.
        """
        with self._lock:
            if len(self._items) >= self.capacity and not self._closed:
                self._full += 1
                raise WouldBlock(self.name, f"full ({self.capacity} items)")
            self._append(item)

    def put_many_nowait(self, items: Sequence[T]) -> int:
        """Add as many of ``items`` as fit now, in order; returns how many.

        One lock and at most one wake-up for all of them, where a
        ``put_nowait`` each would take the lock per item.

        Raises:
            ChannelClosed: the ring is closed.
        """
        with self._lock:
            if self._closed:
                raise ChannelClosed(self.name, "put on a closed ring")
            n = min(len(items), self.capacity - len(self._items))
            if n < len(items):
                self._full += 1
            for item in items[:max(0, n)]:
                self._append(item)
            return max(0, n)

    def _append(self, item: T) -> None:  # lock held
        if self._closed:
            raise ChannelClosed(self.name, "put on a closed ring")
        items = self._items
        items.append(item)
        self._puts += 1
        if len(items) > self._high:
            self._high = len(items)
        if not self._signalled:  # empty -> non-empty: the only syscall
            self._signalled = True
            self._signals += 1
            os.write(self._wfd, _ONE)

    # -- consumer side ------------------------------------------------------

    def get_nowait(self) -> T:
        """Take the oldest item.

        Raises:
            WouldBlock: nothing waits (the ring is open).
            EndOfChannel: the ring is closed and drained.
        """
        with self._lock:
            if not self._items:
                if self._closed:
                    raise EndOfChannel(self.name, "closed and drained")
                raise WouldBlock(self.name, "empty")
            item = self._items.popleft()
            self._after_take(1)
            return item

    def drain(self, max_n: int) -> list[T]:
        """Take up to ``max_n`` items, oldest first (possibly none).

        Raises:
            EndOfChannel: the ring is closed and drained.
        """
        with self._lock:
            items = self._items
            n = min(max_n, len(items))
            if n == 0:
                if self._closed:
                    raise EndOfChannel(self.name, "closed and drained")
                return []
            if n == len(items):
                out = list(items)
                items.clear()
            else:
                pop = items.popleft
                out = [pop() for _ in range(n)]
            self._after_take(n)
            return out

    def _after_take(self, n: int) -> None:  # lock held
        self._gets += n
        if not self._items and self._signalled and not self._closed:
            self._signalled = False
            try:
                os.read(self._rfd, 8)
            except BlockingIOError:  # pragma: no cover - nothing was pending
                pass
        if self._full and len(self._items) < self.capacity:
            self._not_full.notify_all()

    def fileno(self) -> int:
        """The fd that is readable while items wait (or once the ring closed)."""
        return self._rfd

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def statistics(self) -> RingStats:
        """A snapshot of the ring's counters."""
        with self._lock:
            return RingStats(self._puts, self._gets, self._full, self._high, self._signals)

    # -- closing ------------------------------------------------------------

    def close(self) -> None:
        """No more puts; queued items are still delivered. Idempotent; wakes everyone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._not_full.notify_all()
            if not self._signalled:  # wake the parked consumer to see the end
                self._signalled = True
                os.write(self._wfd, _ONE)

    def release(self) -> None:
        """Close the ring and its file descriptor (after the consumer is done)."""
        self.close()
        with self._lock:
            if self._fd_open:
                self._fd_open = False
                os.close(self._rfd)
                if self._wfd != self._rfd:
                    os.close(self._wfd)

    def __enter__(self) -> Ring[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_fd_open", False):
            try:
                os.close(self._rfd)
                if self._wfd != self._rfd:
                    os.close(self._wfd)
            except OSError:
                pass


def open_ring(item_type: type[T], capacity: int = 65536, *, name: str = "ring") -> Ring[T]:
    """Open a :class:`Ring` carrying ``item_type`` (the type only informs the checker)."""
    del item_type
    return Ring(capacity, name=name)
