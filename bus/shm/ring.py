"""A byte ring in shared memory: one writer, N readers, each with its own cursor.

Layout (every word a little-endian u64; a reader's slot is 64 bytes, so two
readers never share a cache line)::

    header   magic | capacity | readers | writer pid | write cursor | closed | writer parked | -
    slot r   state | pid | cursor | parked | -
    data     capacity bytes: records [length u64][payload, padded to 8]

Cursors count bytes since creation (never wrap); the physical offset is
``cursor % capacity``. A record that would straddle the end is preceded by a
wrap marker. A payload is a list of frames: ``u32 count, u32 sizes..., bytes``.

Parking, as in :class:`~bus.ring.Ring`: a reader that finds the ring empty
sets its ``parked`` word, fences, looks once more, and then sleeps on its
doorbell (a FIFO). The writer, after publishing, reads each ``parked`` word
and rings only the doorbells of readers that sleep: a busy ring costs no
syscall per record. The writer parks the same way when the ring is full (its
own doorbell, rung by a reader that frees space while it sleeps).

Death: each side holds a ``pidfd`` of the other(s). A reader's poll fd is an
epoll set over its doorbell *and* the writer's pidfd, so a writer that dies
wakes every parked reader at once; a writer blocked on a full ring polls the
readers' pidfds, so a dead reader is named (:class:`~bus.errors.PeerGone`)
and dropped instead of wedging the others. A reader that never attached
pins the ring until the writer's timeout, which names it.

Why FIFOs (named, in ``/dev/shm`` beside the segment) rather than a
socketpair or eventfd passed at spawn: a tensor-parallel rank learns the
ring's name over the process group after it started; it has no fd to inherit.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from bus.errors import ChannelClosed, PeerGone, WouldBlock
from bus.fdwait import wait_readable
from bus.shm.layout import (
    _ATTACHED,
    _CAP_W,
    _CLOSED_W,
    _CURSOR,
    _DEAD,
    _FREE,
    _MAGIC,
    _MAGIC_W,
    _NREADERS_W,
    _PARKED,
    _PID,
    _STATE,
    _U64,
    _WPARKED_W,
    _WPID_W,
    _WRAP,
    _WRITE_W,
    Buffer,
    _data_offset,
    _drain_fd,
    _pad8,
    _pidfd,
    _ring,
    _unlink_all,
    _Words,
)
from bus.shm.segment import SHM_DIR, Segment, fence, make_fifo, open_fifo, pid_alive

__all__ = ["ShmRingStats", "ShmWriter", "open_shm_ring"]

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class ShmRingStats:
    """Counters of a ring end since it was opened."""

    records: int
    bytes: int
    signals: int
    full_waits: int


class ShmWriter:
    """The writing end of a shared-memory ring (see the module docstring).

    Args:
        readers: how many readers (each attaches with its index, 0-based).
        capacity: bytes of the data area (a multiple of 8; one record may
            take at most half).
        name: the channel name used in errors.

    :attr:`handle` is what a reader needs to attach (:meth:`ShmReader.attach`).
    Both ends fault the whole segment in when they map it (``capacity``
    bytes of ``/dev/shm`` are committed at once, ~25 ms for 64 MiB): else
    the first lap through the ring pays a page fault per 4 KiB written and
    read, which more than doubled a 280 KiB record's cost.
    """

    def __init__(self, readers: int, capacity: int = 16 << 20, *, name: str = "shm") -> None:
        if readers < 1:
            raise ValueError("readers must be >= 1")
        if capacity < 4096 or capacity % 8:
            raise ValueError("capacity must be a multiple of 8, >= 4096")
        self.name = name
        self.readers = readers
        self.capacity = capacity
        self._base = _data_offset(readers)
        self._seg = Segment.create("ring", self._base + capacity, populate=True,
                                   what=f"the {name!r} ring")
        self.handle = self._seg.name
        self._data = self._seg.buf[self._base :]
        self._w = _Words(self._seg, readers).w
        w = self._w
        w[_CAP_W], w[_NREADERS_W], w[_WPID_W] = capacity, readers, os.getpid()
        self._bells: list[int] = []
        names = [make_fifo(self.handle, f"r{r}") for r in range(readers)]
        names.append(make_fifo(self.handle, "w"))
        self._unlink_fifos = weakref.finalize(
            self, _unlink_all, [os.path.join(SHM_DIR, n) for n in names])
        self._bells = [open_fifo(n) for n in names[:-1]]
        self._own_bell = open_fifo(names[-1])
        self._pidfds: dict[int, int] = {}  # reader index -> pidfd
        self._parked_words = [8 + r * 8 + _PARKED for r in range(readers)]
        self._max_record = capacity // 2
        self._closed = False
        self._records = self._bytes = self._signals = self._full = 0
        self.dead_readers: dict[int, int] = {}  # index -> pid, readers found dead
        w[_MAGIC_W] = _MAGIC  # last: a reader that sees the magic sees the rest

    # -- writing ------------------------------------------------------------

    def send(self, frames: Sequence[Buffer], *, timeout: float | None = None) -> None:
        """Append one record made of ``frames`` for every live reader.

        Waits up to ``timeout`` seconds (None: forever) for the slowest
        reader to make room.

        Raises:
            ValueError: the record is larger than half the capacity.
            WouldBlock: no room before the timeout; names the slowest reader.
            PeerGone: a reader died (it is dropped: retrying sends to the others).
            ChannelClosed: this writer is closed.
        """
        if self._closed:
            raise ChannelClosed(self.name, "send on a closed shared-memory ring")
        views = [memoryview(f).cast("B") if not isinstance(f, bytes) else f for f in frames]
        sizes = [len(v) for v in views]
        length = 4 + 4 * len(sizes) + sum(sizes)
        need = 8 + _pad8(length)
        if need > self._max_record:
            raise ValueError(f"a {length}-byte record does not fit ring {self.name!r} "
                             f"(at most {self._max_record - 8} bytes)")
        w = self._w
        cap = self.capacity
        write = w[_WRITE_W]
        pos = write % cap
        skip = cap - pos if cap - pos < need else 0
        end = write + skip + need
        if end - self._min_cursor() > cap:
            self._wait_room(end, timeout)
        data = self._data
        if skip:
            _U64.pack_into(data, pos, _WRAP)
            pos = 0
        _U64.pack_into(data, pos, length)
        at = pos + 8
        struct.pack_into(f"<{len(sizes) + 1}I", data, at, len(sizes), *sizes)
        at += 4 + 4 * len(sizes)
        for v, n in zip(views, sizes, strict=True):
            data[at : at + n] = v
            at += n
        w[_WRITE_W] = end  # publish
        self._records += 1
        self._bytes += length
        fence()  # the cursor is visible before the parked words are read
        for r, word in enumerate(self._parked_words):
            if w[word]:
                w[word] = 0
                self._signals += 1
                _ring(self._bells[r])

    def _live(self, r: int) -> bool:
        return self._w[8 + r * 8 + _STATE] in (_FREE, _ATTACHED)

    def _min_cursor(self) -> int:
        w = self._w
        low = w[_WRITE_W]
        for r in range(self.readers):
            if w[8 + r * 8 + _STATE] in (_FREE, _ATTACHED):
                c = w[8 + r * 8 + _CURSOR]
                if c < low:
                    low = c
        return low

    def _slowest(self) -> str:
        w = self._w
        best, cur = -1, w[_WRITE_W] + 1
        for r in range(self.readers):
            if self._live(r) and w[8 + r * 8 + _CURSOR] < cur:
                best, cur = r, w[8 + r * 8 + _CURSOR]
        if best < 0:  # pragma: no cover
            return "no reader"
        if w[8 + best * 8 + _STATE] == _FREE:
            return f"reader {best} (never attached)"
        return (f"reader {best} (pid {w[8 + best * 8 + _PID]}, "
                f"{w[_WRITE_W] - cur} bytes behind)")

    def _wait_room(self, end: int, timeout: float | None) -> None:
        self._full += 1
        w = self._w
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self._own_bell, select.POLLIN)
        while True:
            self._watch_readers(poller)
            w[_WPARKED_W] = 1
            fence()
            if end - self._min_cursor() <= self.capacity:
                w[_WPARKED_W] = 0
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                w[_WPARKED_W] = 0
                raise WouldBlock(self.name, f"ring full ({self.capacity} bytes) after "
                                            f"{timeout:g} s: {self._slowest()} is not reading")
            # Bounded slices: a reader that attaches while we sleep gets a pidfd.
            ms = 100 if left is None else max(1, min(100, int(left * 1000) + 1))
            for fd, _ in poller.poll(ms):
                if fd == self._own_bell:
                    _drain_fd(fd)

    def _watch_readers(self, poller: select.poll) -> None:
        """Open a pidfd per attached reader; drop (and name) the dead ones."""
        w = self._w
        for r in range(self.readers):
            state = w[8 + r * 8 + _STATE]
            if state == _ATTACHED and r not in self._pidfds:
                pid = w[8 + r * 8 + _PID]
                fd = _pidfd(pid)
                if fd is None:
                    self._reader_died(r, pid)
                elif fd >= 0:
                    self._pidfds[r] = fd
                    poller.register(fd, select.POLLIN)
        for r, fd in list(self._pidfds.items()):
            if wait_readable([fd], 0) or w[8 + r * 8 + _STATE] != _ATTACHED:
                del self._pidfds[r]
                poller.unregister(fd)
                os.close(fd)
                if w[8 + r * 8 + _STATE] == _ATTACHED:
                    self._reader_died(r, w[8 + r * 8 + _PID])
        for r in range(self.readers):  # no pidfd (another namespace): ask the kernel
            if (w[8 + r * 8 + _STATE] == _ATTACHED and r not in self._pidfds
                    and not pid_alive(w[8 + r * 8 + _PID])):
                self._reader_died(r, w[8 + r * 8 + _PID])

    def _reader_died(self, r: int, pid: int) -> None:
        self._w[8 + r * 8 + _STATE] = _DEAD
        self.dead_readers[r] = pid
        log.warning("shared-memory ring %r: reader %d (pid %d) died; dropped", self.name, r, pid)
        raise PeerGone(self.name, f"reader {r} (pid {pid}) died; it is dropped, "
                                  "the other readers go on")

    def statistics(self) -> ShmRingStats:
        """A snapshot of the writer's counters."""
        return ShmRingStats(self._records, self._bytes, self._signals, self._full)

    # -- closing ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """End the stream: readers drain what was sent, then see the end. Idempotent.

        The segment's name is unlinked at once; readers keep their mapping.
        """
        if self._closed:
            return
        self._closed = True
        self._w[_CLOSED_W] = 1
        fence()
        for fd in self._bells:
            _ring(fd)
            os.close(fd)
        os.close(self._own_bell)
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._unlink_fifos()
        self._w.release()
        self._data.release()
        self._seg.close()

    def __enter__(self) -> ShmWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_shm_ring(readers: int, capacity: int = 16 << 20, *, name: str = "shm") -> ShmWriter:
    """Create a shared-memory ring for ``readers`` readers; attach them with its ``handle``."""
    return ShmWriter(readers, capacity, name=name)

