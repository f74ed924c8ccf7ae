"""The shared-memory ring's layout and its doorbells (see :mod:`bus.shm.ring`).

Word offsets of the header and the reader slots, record framing, and the
few fd operations both ends share: a pidfd of a peer, ringing and draining a
FIFO doorbell, unlinking what a ring left.
"""

from __future__ import annotations

import os
import struct

from bus.shm.segment import Segment

__all__: list[str] = []  # private to bus.shm: the ring's two ends use it

_MAGIC = 0x7473_6272_696E_6731  # "tsbring1"
_MAGIC_W, _CAP_W, _NREADERS_W, _WPID_W, _WRITE_W, _CLOSED_W, _WPARKED_W = range(7)
_HEADER = 64
_SLOT = 64
_STATE, _PID, _CURSOR, _PARKED = range(4)
_FREE, _ATTACHED, _DETACHED, _DEAD = range(4)
_WRAP = (1 << 64) - 1
_ONE = b"\x01"
_U64 = struct.Struct("<Q")

Buffer = bytes | bytearray | memoryview


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _data_offset(readers: int) -> int:
    return (_HEADER + _SLOT * readers + 4095) & ~4095


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError:  # pragma: no cover - another pid namespace, or an old kernel
        return -1


def _drain_fd(fd: int) -> bool:
    """Read every byte waiting on a doorbell; whether there were any."""
    got = False
    while True:
        try:
            if not os.read(fd, 4096):
                return got
            got = True
        except BlockingIOError:
            return got


def _ring(fd: int) -> None:
    try:
        os.write(fd, _ONE)
    except BlockingIOError:  # the FIFO is full: it is rung already
        pass


class _Words:
    """Typed access to the u64 words of a segment's header and slots."""

    def __init__(self, seg: Segment, readers: int) -> None:
        self.w = seg.buf[: _HEADER + _SLOT * readers].cast("Q")

    def slot(self, r: int, field: int) -> int:
        return 8 + r * 8 + field


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
