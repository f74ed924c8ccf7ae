"""Codec ends over a shared-memory ring: :class:`ShmOutbox` writes, :class:`ShmInbox` is drained."""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

from bus.envelope import Envelope, Origin, Rejected
from bus.errors import EndOfChannel, PeerGone
from bus.shm.reader import ShmReader
from bus.shm.ring import ShmWriter
from messages import Codec, DecodeError, Message

__all__ = ["ShmInbox", "ShmOutbox"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)


class ShmOutbox(Generic[M]):
    """Encodes messages into a :class:`~bus.shm.ring.ShmWriter` (every reader gets each one)."""

    def __init__(self, writer: ShmWriter, codec: Codec[M]) -> None:
        self.writer = writer
        self.codec = codec

    @property
    def name(self) -> str:
        """The ring's channel name."""
        return self.writer.name

    def send(self, msg: M, /, *, timeout: float | None = 10.0) -> None:
        """Encode and append ``msg``, waiting up to ``timeout`` seconds for room.

        Raises:
            EncodeError: ``msg`` cannot be encoded (nothing was sent).
            WouldBlock: no room in time; names the slowest reader.
            PeerGone: a reader died (dropped; a retry reaches the others).
            ChannelClosed: the writer is closed.
        """
        self.writer.send(self.codec.encode(msg), timeout=timeout)

    def send_nowait(self, msg: M, /) -> None:
        """Encode and append ``msg`` only if there is room now.

        Raises:
            EncodeError: ``msg`` cannot be encoded (nothing was sent).
            WouldBlock: the ring is full.
            PeerGone: a reader died (dropped; a retry reaches the others).
            ChannelClosed: the writer is closed.
        """
        self.writer.send(self.codec.encode(msg), timeout=0)

    def close(self) -> None:
        """Close the ring: readers drain it, then end. Idempotent."""
        self.writer.close()

    def __enter__(self) -> ShmOutbox[M]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmInbox(Generic[M]):
    """An inbox over a :class:`~bus.shm.ring.ShmReader`, for a :class:`~bus.receiver.Receiver`.

    Its pollable fd is readable while records wait, so it parks in the
    receiver's one poll. A record that fails to decode becomes a
    :class:`~bus.envelope.Rejected`. When the writer closes, the inbox ends
    cleanly; when the writer *dies*, it ends too, after every published
    record was delivered, and :attr:`writer_gone` holds the
    :class:`~bus.errors.PeerGone` naming it (logged once).
    """

    def __init__(self, reader: ShmReader, codec: Codec[M], *, name: str = "shm") -> None:
        self.reader = reader
        self.codec = codec
        self._name = name
        self._origin = Origin(name)
        self._rejected = 0
        self.writer_gone: PeerGone | None = None

    @property
    def name(self) -> str:
        return self._name

    def drain(self, max_n: int) -> list[Envelope[M] | Rejected]:
        """Take up to ``max_n`` messages without blocking.

        Raises:
            EndOfChannel: the writer closed (or died) and every message was taken.
        """
        try:
            records = self.reader.drain(max_n)
        except PeerGone as exc:
            if self.writer_gone is None:
                self.writer_gone = exc
                log.warning("inbox %r: %s", self._name, exc.detail)
            raise EndOfChannel(self._name, exc.detail) from exc
        decode, origin = self.codec.decode, self._origin
        out: list[Envelope[M] | Rejected] = []
        for frames in records:
            try:
                out.append(Envelope(decode(frames), origin))
            except DecodeError as exc:
                self._rejected += 1
                out.append(Rejected(exc, origin))
        return out

    def pollable(self) -> int:
        return self.reader.fileno()

    @property
    def rejected(self) -> int:
        return self._rejected

    def close(self) -> None:
        """Detach from the ring. Idempotent."""
        self.reader.close()
