"""The reading end of a shared-memory ring (see :mod:`bus.shm.ring` for the layout,
parking and death rules)."""

from __future__ import annotations

import logging
import os
import select
import struct
import time

from bus.errors import ChannelClosed, EndOfChannel, PeerGone, WouldBlock
from bus.fdwait import wait_readable
from bus.shm.layout import (
    _ATTACHED,
    _CAP_W,
    _CLOSED_W,
    _CURSOR,
    _DETACHED,
    _FREE,
    _HEADER,
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
    _data_offset,
    _drain_fd,
    _pad8,
    _pidfd,
    _ring,
    _Words,
)
from bus.shm.ring import ShmRingStats
from bus.shm.segment import Segment, fence, open_fifo, pid_alive

__all__ = ["ShmReader"]

log = logging.getLogger("bus.shm.ring")


class ShmReader:
    """A reading end of a shared-memory ring, attached as reader ``index``.

    :meth:`fileno` is an epoll fd that is readable while records wait, when
    the writer closed, or when it died: park on it in any poll (a
    :class:`~bus.receiver.Receiver`'s included). Records are copied out of
    the ring (one copy) so the writer can reuse the space at once; the frames
    returned are views of that copy.
    """

    def __init__(self, seg: Segment, index: int, *, name: str) -> None:
        self.name = name
        self._seg = seg
        w = seg.buf[:_HEADER].cast("Q")
        if w[_MAGIC_W] != _MAGIC:
            raise ValueError(f"segment {seg.name!r} is not a shared-memory ring")
        readers, self.capacity = w[_NREADERS_W], w[_CAP_W]
        w.release()
        if not 0 <= index < readers:
            raise ValueError(f"reader index {index} not in [0, {readers})")
        base = _data_offset(readers)
        if seg.size < base + self.capacity:
            raise ValueError(f"segment {seg.name!r} is shorter than its header says")
        self.index = index
        self._w = _Words(seg, readers).w
        self._data = seg.buf[base : base + self.capacity]
        s = 8 + index * 8
        self._state_w, self._cursor_w, self._parked_w = s + _STATE, s + _CURSOR, s + _PARKED
        if self._w[self._state_w] != _FREE:
            raise ValueError(f"reader slot {index} of ring {seg.name!r} is taken")
        self.writer_pid = self._w[_WPID_W]
        wfd = _pidfd(self.writer_pid)
        if wfd is None:
            raise PeerGone(name, f"the writer (pid {self.writer_pid}) is gone")
        self._writer_fd = wfd
        self._bell = open_fifo(f"{seg.name}.r{index}")
        self._writer_bell = open_fifo(f"{seg.name}.w")
        self._epoll = select.epoll()
        self._epoll.register(self._bell, select.EPOLLIN)
        if wfd >= 0:
            self._epoll.register(wfd, select.EPOLLIN)
        self._w[s + _PID] = os.getpid()
        # Attach parked: a poll on fileno() may come before any drain, and
        # records written before we attached must make the fd readable.
        self._w[self._parked_w] = 1
        self._w[self._state_w] = _ATTACHED
        self._armed = True  # the doorbell may hold bytes: read it on the first drain
        fence()
        if self._w[self._cursor_w] != self._w[_WRITE_W]:
            _ring(self._bell)
        self._closed = False
        self._gone: PeerGone | None = None
        self._records = self._bytes = self._signals = 0

    @classmethod
    def attach(cls, handle: str, index: int, *, name: str = "shm") -> ShmReader:
        """Attach to the ring ``handle`` (a writer's :attr:`ShmWriter.handle`) as reader ``index``.

        Raises:
            ValueError: not a ring of ours, or the slot is taken.
            FileNotFoundError: the ring is gone.
            PeerGone: its writer is dead.
        """
        return cls(Segment.attach(handle, populate=True), index, name=name)

    def fileno(self) -> int:
        """The fd to park on (readable while records wait, or at the end)."""
        return self._epoll.fileno()

    def _take(self) -> list[memoryview] | None:
        w = self._w
        cur = w[self._cursor_w]
        if cur == w[_WRITE_W]:
            return None
        cap = self.capacity
        data = self._data
        pos = cur % cap
        length = _U64.unpack_from(data, pos)[0]
        if length == _WRAP:
            cur += cap - pos
            pos = 0
            length = _U64.unpack_from(data, 0)[0]
        raw = bytes(data[pos + 8 : pos + 8 + length])  # the one copy
        w[self._cursor_w] = cur + 8 + _pad8(length)
        self._records += 1
        self._bytes += length
        view = memoryview(raw)
        count = int.from_bytes(raw[:4], "little")
        sizes = struct.unpack_from(f"<{count}I", raw, 4)
        at = 4 + 4 * count
        frames = []
        for n in sizes:
            frames.append(view[at : at + n])
            at += n
        return frames

    def _after_take(self) -> None:
        w = self._w
        if w[_WPARKED_W]:
            w[_WPARKED_W] = 0
            self._signals += 1
            try:
                _ring(self._writer_bell)
            except OSError:  # pragma: no cover - the writer is gone
                pass

    def drain(self, max_n: int) -> list[list[memoryview]]:
        """Take up to ``max_n`` records without blocking (possibly none).

        Raises:
            EndOfChannel: the writer closed and every record was taken.
            PeerGone: the writer died and every record it published was taken.
            ChannelClosed: this reader is closed.
        """
        if self._closed:
            raise ChannelClosed(self.name, "drain on a closed shared-memory reader")
        if self._armed:  # we were parked: clear the doorbell, then look
            self._armed = False
            self._w[self._parked_w] = 0
            _drain_fd(self._bell)
        out = []
        take = self._take
        for _ in range(max_n):
            rec = take()
            if rec is None:
                break
            out.append(rec)
        if out:
            self._after_take()
        w = self._w
        if w[self._cursor_w] != w[_WRITE_W]:
            _ring(self._bell)  # records are left: keep the fd readable
            self._armed = True
            return out
        # Empty: park, then look once more (the writer may have published
        # just before it could see us parked).
        w[self._parked_w] = 1
        self._armed = True
        fence()
        if w[self._cursor_w] != w[_WRITE_W]:
            _ring(self._bell)
        elif not out:
            self._check_end()
        return out

    def _check_end(self) -> None:
        if self._w[_CLOSED_W]:
            raise EndOfChannel(self.name, "the writer closed and every record was taken")
        if self._gone is None and self._writer_fd >= 0:
            if wait_readable([self._writer_fd], 0):
                self._gone = PeerGone(self.name, f"the writer (pid {self.writer_pid}) died")
        elif self._gone is None and not pid_alive(self.writer_pid):  # pragma: no cover
            self._gone = PeerGone(self.name, f"the writer (pid {self.writer_pid}) died")
        if self._gone is not None:
            raise self._gone

    def recv(self, timeout: float | None = None) -> list[memoryview]:
        """Take the next record, parked (no CPU) up to ``timeout`` seconds (None: forever).

        Raises:
            WouldBlock: nothing arrived in time.
            EndOfChannel: the writer closed and every record was taken.
            PeerGone: the writer died and every record it published was taken.
            ChannelClosed: this reader is closed.
        """
        got = self.drain(1)
        if got:
            return got[0]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WouldBlock(self.name, f"nothing arrived within {timeout:g} s")
            try:
                self._epoll.poll(-1 if left is None else left, 1)
            except InterruptedError:  # pragma: no cover
                continue
            got = self.drain(1)
            if got:
                return got[0]

    def statistics(self) -> ShmRingStats:
        """A snapshot of the reader's counters (``signals``: times it woke the writer)."""
        return ShmRingStats(self._records, self._bytes, self._signals, 0)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Detach: the writer stops waiting for this reader. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._w[self._state_w] = _DETACHED
            fence()
            self._after_take()  # a writer waiting on us may go on
        except (ValueError, OSError):  # pragma: no cover
            pass
        self._epoll.close()
        for fd in (self._bell, self._writer_bell, self._writer_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:  # pragma: no cover
                    pass
        self._w.release()
        self._data.release()
        self._seg.close()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
