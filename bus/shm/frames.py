"""Large tensor frames between local processes: the bytes go through shared memory.

The sender (:class:`FramePool`, held by a ``PushOutbox``) copies each frame
of at least ``threshold`` bytes into a *slab* it owns (a ``/dev/shm``
segment, reused) and sends a small handle in its place; the receiver
(:class:`FrameMapper`, held by a ``PullInbox``) maps the slab once and hands
the codec a read-only view of it: one memcpy in all, none on receipt.

On the wire, a message that carries handles gains a first frame,
``MAGIC + msgpack [[index, slab, generation, nbytes, offset], ...]``, and
each replaced frame is empty.

*Lent slabs* (:meth:`FramePool.empty`): a producer may build a tensor
directly in a slab; when a frame of a message lies inside a slab lent this
way, the handle points at it and nothing is copied (the send is a handle
only). A lent slab is reused only once the receiver released it *and* the
producer's last reference to the tensor is gone; it is sent by handle only
while no earlier send of it is still held by a receiver (otherwise it is
copied like any frame). A codec header never starts with ``MAGIC``'s zero
byte (it is a msgpack array), so the two cannot be confused.

Lifetime (each word of a slab's header has one writer at a time, so no
compare-and-swap is needed):

* the sender bumps ``sent`` (the generation) and clears ``claim`` before it
  writes the slab; the slab is free again once ``released == sent``;
* the receiver first checks that ``sent`` is the handle's generation and
  that nobody claimed it yet (else the handle is refused, and nothing is
  written: a forged or replayed handle never touches another's claim); then
  it writes its pid to ``claim``, fences, and checks ``sent`` again (else
  the frame is refused as reclaimed, and the claim cleared only if it is
  still its own); when the last view of the frame is collected, it writes
  ``released = generation``;
* a slab whose claimer died is free (pid liveness, checked when the pool is
  short); a slab never claimed for ``unclaimed_timeout`` seconds (its
  message was lost with a dead receiver) is taken back by bumping ``sent``,
  fencing and checking ``claim``: the receiver and the sender each see the
  other's write, so at most one of them wins.

When the pool is at ``max_bytes`` and nothing can be taken back, or the
shared-memory directory is full (a slab's space is reserved when it is
made, so that is an ``OSError`` there, never a SIGBUS on a write), the frame
goes over the socket as before: the shared-memory path never blocks or
kills a send. After a failed allocation the pool makes no new slab for
:attr:`FramePool.retry_after` seconds (it reuses the slabs it has).
"""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from bus.logsummary import LogSummary
from bus.shm.segment import Segment, fence, pid_alive
from messages import DecodeError, Frame

__all__ = ["DEFAULT_SHM_THRESHOLD", "MAGIC", "FrameMapper", "FramePool", "empty_tensor"]

#: Frames at least this large go through shared memory. Measured with
#: ``python -m benchmarks.shm`` (every size on both paths, side by side) on a
#: 2-core box: the copy into a slab beats ``ipc://`` by ~1.15x at 256 KiB,
#: ~1.3x at 512 KiB-1 MiB, ~1.4x at 4 MiB and ~5x at 64 MiB; at 64 KiB the
#: two are level, and the socket needs no slab.
DEFAULT_SHM_THRESHOLD = 256 << 10
MAGIC = b"\x00tsb-shm\x01"
_HEADER = 4096
_MAGIC_W, _SIZE_W, _SENT_W, _RELEASED_W, _CLAIM_W = range(5)
_SLAB_MAGIC = 0x7473_6273_6C61_6231  # "tsbslab1"
_HANDLES_ENC = msgspec.msgpack.Encoder()
log = logging.getLogger("bus.shm")


class _Handle(msgspec.Struct, array_like=True, frozen=True):
    index: int
    slab: str
    gen: int
    nbytes: int
    offset: int = 0  # bytes into the slab's data (a lent slab's sliced view)


_HANDLES_DEC = msgspec.msgpack.Decoder(list[_Handle])


class _Slab:
    def __init__(self, size: int) -> None:
        self.seg = Segment.create("f", _HEADER + size, what="a tensor frame's slab")
        self.size = size
        self.words = self.seg.buf[:64].cast("Q")
        self.data = self.seg.buf[_HEADER:]
        self.sent_at = 0.0
        self.lent = False  # a producer holds a tensor in it (FramePool.empty)
        probe = np.frombuffer(self.seg.mmap, np.uint8, count=1, offset=_HEADER)
        self.address: int = probe.ctypes.data  # where the data starts in this process
        del probe
        self.words[_SIZE_W] = size
        self.words[_MAGIC_W] = _SLAB_MAGIC

    def free(self) -> bool:
        """No receiver holds it (every send released). A lent slab may still be free."""
        w = self.words
        return w[_SENT_W] == w[_RELEASED_W]

    def take_back(self, unclaimed_timeout: float, now: float) -> bool:
        """Free a slab pinned by a dead claimer, or never claimed for too long."""
        if self.lent:  # the producer still writes or reads it: never reused under it
            return False
        w = self.words
        pid = w[_CLAIM_W]
        if pid:
            if pid_alive(pid):
                return False
            w[_RELEASED_W] = w[_SENT_W]
            return True
        if now - self.sent_at < unclaimed_timeout:
            return False
        w[_SENT_W] += 1
        fence()
        if w[_CLAIM_W]:  # claimed meanwhile: the receiver won
            w[_SENT_W] -= 1
            return False
        w[_RELEASED_W] = w[_SENT_W]
        return True

    def close(self) -> None:
        self.words.release()
        self.data.release()
        self.seg.close()


def _size_class(n: int, floor: int) -> int:
    size = floor
    while size < n:
        size <<= 1
    return size


class FramePool:
    """The sending side: slabs this process owns, reused once receivers release them.

    Args:
        threshold: frames this large or larger travel through shared memory.
        max_bytes: most slab bytes held at once; past it, frames use the socket.
        unclaimed_timeout: seconds after which a slab never claimed by a
            receiver is taken back (its message was lost).
    """

    #: Seconds without trying a new slab after the shared-memory directory was full.
    retry_after = 1.0

    def __init__(self, *, threshold: int = DEFAULT_SHM_THRESHOLD, max_bytes: int = 1 << 30,
                 unclaimed_timeout: float = 60.0) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold
        self.max_bytes = max_bytes
        self.unclaimed_timeout = unclaimed_timeout
        self._floor = _size_class(threshold, 1 << 16)
        self._classes: dict[int, list[_Slab]] = {}
        self._bytes = 0
        self.fallbacks = 0  # frames sent over the socket because the pool was full
        self.alloc_failures = 0  # slabs that could not be made (the directory full)
        self._no_room_until = 0.0
        self._alloc_log = LogSummary(log, "shared memory full, tensor frames sent over "
                                          "the socket")
        self.lent_sends = 0  # frames sent by handle from a lent slab (no copy)
        self._lent: dict[int, _Slab] = {}  # data address -> slab lent by empty()
        self._closed = False
        #: The sends the last :meth:`wrap` made through shared memory, each as
        #: ``(slab name, generation)``: a sender that must know later whether a
        #: message's bytes were taken back keeps these (see :attr:`taken_back`).
        self.last_sent: tuple[tuple[str, int], ...] = ()
        #: The sends the last :meth:`reclaim` took back, as ``(slab name, generation)``.
        self.taken_back: frozenset[tuple[str, int]] = frozenset()

    @property
    def bytes_held(self) -> int:
        """Bytes of shared memory held in slabs."""
        return self._bytes

    @property
    def bytes_unreleased(self) -> int:
        """Bytes of slabs sent and not yet released by their receiver (lent slabs
        included): what this pool's sends hold of shared memory right now."""
        return sum(slab.size for slabs in self._classes.values() for slab in slabs
                   if not slab.free())

    def _slab(self, n: int) -> _Slab | None:
        size = _size_class(n, self._floor)
        slabs = self._classes.setdefault(size, [])
        for slab in slabs:
            if not slab.lent and slab.free():
                return slab
        now = time.monotonic()
        if self._bytes + size <= self.max_bytes and now >= self._no_room_until:
            try:
                slab = _Slab(size)
            except OSError as exc:  # no room in /dev/shm: the socket, and retry later
                self.alloc_failures += 1
                self._no_room_until = now + self.retry_after
                self._alloc_log.add("shm", str(exc))
            else:
                slabs.append(slab)
                self._bytes += size
                return slab
        for slab in slabs:
            if slab.take_back(self.unclaimed_timeout, now):
                return slab
        return None

    def wrap(self, frames: Sequence[Frame]) -> tuple[Sequence[Frame], list[_Slab]]:
        """Move each large frame (not the header) into a slab; returns the frames to send.

        A frame that lies in a slab lent by :meth:`empty` is not copied: its
        handle points into that slab.

        When nothing is large, or the pool is full, ``frames`` come back as they were.
        """
        self.last_sent = ()
        if self._closed:
            return frames, []
        handles: list[_Handle] = []
        used: list[_Slab] = []
        out: list[Frame] | None = None
        threshold = self.threshold
        lent = self._lent
        for i in range(1, len(frames)):
            f = frames[i]
            n = memoryview(f).nbytes
            if n < threshold:
                continue
            found = self._lent_slab(f, n) if lent else None
            if found is not None:  # built in a lent slab: a handle, no copy
                slab, offset = found
                self.lent_sends += 1
            else:
                got = self._slab(n)
                if got is None:
                    self.fallbacks += 1
                    continue
                slab, offset = got, 0
            w = slab.words
            w[_CLAIM_W] = 0
            gen = w[_SENT_W] + 1
            w[_SENT_W] = gen
            if found is None:
                slab.data[:n] = memoryview(f).cast("B")  # the one copy
            slab.sent_at = time.monotonic()
            handles.append(_Handle(i, slab.seg.name, gen, n, offset))
            used.append(slab)
            if out is None:
                out = list(frames)
            out[i] = b""
        if out is None:
            return frames, used
        self.last_sent = tuple((h.slab, h.gen) for h in handles)
        return [MAGIC + _HANDLES_ENC.encode(handles), *out], used

    def empty(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        """A writable, page-aligned ``uint8`` array of ``nbytes`` in a slab lent to the caller.

        A frame that lies inside it is later sent by handle, with no copy
        (:meth:`wrap`). The slab comes back to the pool once the array and
        every view of it (a tensor made from it included) are collected and
        the receiver released what was sent. ``None`` when the pool is
        closed or full, or ``nbytes`` is below the threshold: the caller
        then allocates ordinary memory (which the send copies as usual).
        """
        if self._closed or nbytes < self.threshold:
            return None
        slab = self._slab(nbytes)
        if slab is None:
            return None
        slab.lent = True
        self._lent[slab.address] = slab
        arr = np.frombuffer(slab.seg.mmap, np.uint8, count=nbytes, offset=_HEADER)
        weakref.finalize(arr, _give_back, self._lent, slab)
        return arr

    def _lent_slab(self, f: Frame, n: int) -> tuple[_Slab, int] | None:
        """The lent slab frame ``f`` lies in, free to send by handle, and its offset there."""
        try:
            addr = np.frombuffer(f, np.uint8).ctypes.data
        except (TypeError, ValueError):  # pragma: no cover - not a plain buffer
            return None
        for base, slab in tuple(self._lent.items()):  # a finalizer may shrink it
            if base <= addr and addr + n <= base + slab.size:
                # An earlier send still held by a receiver: copy this one instead
                # (one claimer per generation).
                return (slab, addr - base) if slab.free() else None
        return None

    def reclaim(self, now: float | None = None) -> int:
        """Take back and unlink every slab (not lent) whose send nobody claimed for
        ``unclaimed_timeout`` seconds (its message lies in a peer's socket that is not
        read, or was lost with it): nothing of it stays in ``/dev/shm``. A receiver that
        reads the handle later has it refused as reclaimed. Returns the bytes freed;
        :attr:`taken_back` names the sends freed.
        """
        now = time.monotonic() if now is None else now
        freed = 0
        taken: list[tuple[str, int]] = []
        for slabs in self._classes.values():
            for slab in list(slabs):
                gen = slab.words[_SENT_W]
                if (slab.free() or slab.words[_CLAIM_W] or
                        not slab.take_back(self.unclaimed_timeout, now)):
                    continue
                taken.append((slab.seg.name, gen))
                slabs.remove(slab)
                self._bytes -= slab.size
                freed += slab.size
                slab.close()
        self.taken_back = frozenset(taken)
        return freed

    def cancel(self, used: Sequence[_Slab]) -> None:
        """Free the slabs of a message that was not sent after all."""
        for slab in used:
            slab.words[_RELEASED_W] = slab.words[_SENT_W]

    def close(self) -> None:
        """Unlink every slab (receivers keep the views they hold). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for slabs in self._classes.values():
            for slab in slabs:
                slab.close()
        self._classes.clear()
        self._lent.clear()
        self._bytes = 0


def empty_tensor(pool: FramePool | None, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized, writable CPU tensor, in a slab of ``pool`` when it can be.

    In a slab (``pool`` open, not full, the tensor at least its threshold),
    sending the tensor through the pool's outbox carries a handle only; else
    an ordinary ``torch.empty`` (the send copies it, as any tensor).

    Raises:
        ValueError: a negative dimension.
    """
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    nbytes = math.prod(dims) * dtype.itemsize
    arr = pool.empty(nbytes) if pool is not None else None
    if arr is None:
        return torch.empty(dims, dtype=dtype)
    # uint8 first: every dtype (bfloat16, float8) views it; the tensor keeps arr alive.
    return torch.from_numpy(arr).view(dtype).reshape(dims)


def _give_back(lent: dict[int, _Slab], slab: _Slab) -> None:
    """The producer's last view of a lent slab is gone: the pool may reuse it."""
    slab.lent = False
    lent.pop(slab.address, None)


def _release(words: memoryview, gen: int) -> None:
    try:
        words[_RELEASED_W] = gen
    except (ValueError, IndexError):  # pragma: no cover - mapping already gone
        pass


class FrameMapper:
    """The receiving side: turns handles back into read-only views of the senders' slabs.

    Each slab is mapped once (an LRU of ``max_slabs`` mappings; a mapping
    dropped from it lives on while views of it do). A view releases its
    slab when the last array or tensor made from it is collected.
    """

    def __init__(self, *, max_slabs: int = 256) -> None:
        self.max_slabs = max_slabs
        self._maps: OrderedDict[str, tuple[Segment, memoryview]] = OrderedDict()
        self._pid = os.getpid()

    def resolve(self, frames: Sequence[Frame]) -> list[Frame]:
        """The codec's frames for a message whose first frame starts with :data:`MAGIC`.

        Raises:
            DecodeError: a malformed handle, a slab that is gone, not ours, or reclaimed.
        """
        try:
            handles = _HANDLES_DEC.decode(memoryview(frames[0])[len(MAGIC):])
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed shared-memory handle frame: {exc}") from None
        out = list(frames[1:])
        for h in handles:
            if not 1 <= h.index < len(out) or memoryview(out[h.index]).nbytes:
                raise DecodeError(f"shared-memory handle for frame {h.index}, which is not "
                                  "an empty placeholder")
            out[h.index] = self._view(h)
        return out

    def _mapping(self, name: str) -> tuple[Segment, memoryview]:
        got = self._maps.get(name)
        if got is not None:
            self._maps.move_to_end(name)
            return got
        try:
            seg = Segment.attach(name, min_size=_HEADER)
        except (OSError, ValueError) as exc:
            raise DecodeError(f"shared-memory slab {name!r}: {exc}") from None
        words = seg.buf[:64].cast("Q")
        if words[_MAGIC_W] != _SLAB_MAGIC or words[_SIZE_W] + _HEADER > seg.size:
            raise DecodeError(f"shared-memory slab {name!r} is not a slab")
        self._maps[name] = (seg, words)
        if len(self._maps) > self.max_slabs:
            self._maps.popitem(last=False)
        return seg, words

    def _view(self, h: _Handle) -> memoryview:
        seg, words = self._mapping(h.slab)
        if not (0 <= h.nbytes and 0 <= h.offset and h.offset + h.nbytes <= words[_SIZE_W]):
            raise DecodeError(f"shared-memory handle of {h.nbytes} bytes at {h.offset} for a "
                              f"{words[_SIZE_W]}-byte slab")
        # Check before claiming, and never overwrite a claim: a forged, stale or
        # replayed handle is refused having written nothing.
        if words[_SENT_W] != h.gen:
            raise DecodeError(f"shared-memory slab {h.slab!r} was reclaimed before this "
                              "frame was read (or the handle is not current)")
        if words[_CLAIM_W]:
            raise DecodeError(f"shared-memory slab {h.slab!r}: this frame was already "
                              "claimed (a replayed handle)")
        words[_CLAIM_W] = self._pid
        fence()
        if words[_SENT_W] != h.gen:  # the sender took it back meanwhile
            if words[_CLAIM_W] == self._pid:
                words[_CLAIM_W] = 0
            raise DecodeError(f"shared-memory slab {h.slab!r} was reclaimed before this "
                              "frame was read")
        arr = np.frombuffer(seg.mmap, np.uint8, count=h.nbytes, offset=_HEADER + h.offset)
        arr.flags.writeable = False
        weakref.finalize(arr, _release, words, h.gen)
        return arr.data  # a memoryview whose .obj is arr: the finalizer fires when all die

    def close(self) -> None:
        """Forget every mapping (views still held stay valid)."""
        self._maps.clear()
