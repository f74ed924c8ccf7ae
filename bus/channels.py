"""The channel ends a scheduler and its clients hold.

Inboxes (drained by a :class:`~bus.receiver.Receiver`): :class:`RingInbox`,
:class:`PullInbox`, and the rpc ends in :mod:`bus.rpc` (built on
:class:`ZmqInbox`). Outboxes: :class:`PushOutbox`. Each zmq end takes
a :class:`~messages.Codec` and is a context manager; one left open warns.

Between processes on one node (``ipc://``), a tensor frame of at least
``shm_threshold`` bytes travels through shared memory and only a handle
crosses the socket (:mod:`bus.shm.frames`); ``tcp://`` and ``inproc://``
peers keep the socket path. ``shm=False`` on either end opts out.

Sends use ``copy=False``: a tensor frame is handed to zmq as a view and zmq
keeps a reference until its I/O thread has sent it, so the memory stays
alive. The *contents* must not change meanwhile: do not write to a tensor
you sent (the codec's ownership rules; cf. vLLM issue 50053).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, Self, TypeVar

import torch
import zmq

from bus.envelope import Envelope, Origin, Rejected, envelopes
from bus.errors import ChannelClosed, EndOfChannel, PeerGone, WouldBlock
from bus.peers import PeerWatch
from bus.ring import Ring
from bus.shm.frames import DEFAULT_SHM_THRESHOLD, MAGIC, FrameMapper, FramePool, empty_tensor
from bus.sockets import SocketOptions, close_socket, make_socket
from messages import Codec, DecodeError, EncodeError, Frame, Message
from messages.burst import BURST_TAG, SEND_BURST, is_burst

__all__ = ["Inbox", "PullInbox", "PushOutbox", "RingInbox", "ZmqInbox"]

M = TypeVar("M", bound=Message)
M_co = TypeVar("M_co", bound=Message, covariant=True)
_DEFAULT_OPTIONS = SocketOptions()
_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: an enum member costs a conversion per call
_SNDMORE = int(zmq.SNDMORE)
#: Tracked large frames a tcp:// outbox keeps before it drops those zmq has written out.
_PRUNE_UNSENT = 64
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_MAGIC_LEN = len(MAGIC)
#: Seconds :meth:`PushOutbox.wait_written` gives zmq's I/O thread once the last tracked
#: message is done: zmq reports a message done once its I/O thread has encoded it into
#: its batch buffer (8 KiB), which it writes to the connection just after; a process
#: that exits at once can cut that batch (measured: 2 of 6 runs lost the last message
#: to a reader with a full queue; with 50 ms, none of 6).
WRITE_SETTLE = 0.1


def _local(endpoint: str, shm: bool | None) -> bool:
    """Whether an end uses shared-memory frames: ``ipc://`` unless told (``tcp://``: never)."""
    if shm is None:
        return endpoint.startswith("ipc://")
    return shm and not endpoint.startswith("tcp://")


class Inbox(Protocol[M_co]):
    """What a :class:`~bus.receiver.Receiver` drains."""

    @property
    def name(self) -> str:
        """The channel's name, stamped on every origin."""
        ...

    def drain(self, max_n: int) -> Sequence[Envelope[M_co] | Rejected]:
        """Take up to ``max_n`` waiting messages without blocking.

        Raises:
            EndOfChannel: the inbox ended cleanly and is empty.
        """
        ...

    def pollable(self) -> zmq.Socket[bytes] | int:
        """The socket or fd that becomes readable when messages wait."""
        ...

    @property
    def rejected(self) -> int:
        """How many received messages failed to decode."""
        ...

    def close(self) -> None:
        """Stop receiving. Idempotent."""
        ...


class RingInbox(Generic[M]):
    """An inbox over an in-process :class:`~bus.ring.Ring` (no serialization).

    Objects pass by reference, so nothing decodes them and the type
    constraints a decoder enforces would never run. With ``validate`` (a
    codec's :meth:`~messages.Codec.validate`), every message is checked as
    if it had been decoded: one that fails becomes a
    :class:`~bus.envelope.Rejected` carrying its rid, exactly like a bad
    frame on a socket. Leave it ``None`` only where the producer validated
    already (``Engine`` does, at submit).
    """

    def __init__(self, ring: Ring[M], *, name: str = "work",
                 validate: Callable[[M], object] | None = None) -> None:
        self.ring = ring
        self._name = name
        self._origin = Origin(name)
        self._validate = validate
        self._rejected = 0

    @property
    def name(self) -> str:
        return self._name

    def drain(self, max_n: int) -> list[Envelope[M] | Rejected]:
        origin = self._origin
        validate = self._validate
        if validate is None:
            return envelopes(self.ring.drain(max_n), origin)
        out: list[Envelope[M] | Rejected] = []
        for m in self.ring.drain(max_n):
            try:
                validate(m)
            except DecodeError as exc:
                self._rejected += 1
                out.append(Rejected(exc, origin))
                continue
            out.append(Envelope(m, origin))
        return out

    def pollable(self) -> int:
        return self.ring.fileno()

    @property
    def rejected(self) -> int:
        return self._rejected

    def close(self) -> None:
        self.ring.close()


class _ZmqEnd:
    """A socket with a name, closing rules and error conversion."""

    def __init__(self, sock: zmq.Socket[bytes], name: str) -> None:
        self.socket = sock
        self._name = name
        self._closed = False
        #: Large frames handed to zmq without a copy, each with its tracker and size,
        #: where the end counts what zmq has not written out yet (``None``: not counted).
        self._unsent: list[tuple[zmq.MessageTracker, int]] | None = None
        self._prune_at = _PRUNE_UNSENT  # prune _unsent when it is this long
        #: Each message sent since writes are tracked (``None``: not tracked), with its
        #: tracker and how many messages of ours it carries (a burst: many).
        self._written: list[tuple[zmq.MessageTracker, int]] | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the socket (an ipc socket file it bound is removed). Idempotent."""
        if not self._closed:
            self._closed = True
            close_socket(self.socket)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"channel {self._name!r} was never closed", ResourceWarning,
                          stacklevel=2)
            self.close()

    def _prune_unsent(self) -> list[tuple[zmq.MessageTracker, int]]:
        """The tracked frames zmq has not written out yet (those done are dropped); it
        next prunes at twice what is left (amortized: once per that many sends)."""
        unsent = self._unsent
        if not unsent:
            return []
        unsent[:] = [(t, n) for t, n in unsent if not t.done]
        self._prune_at = max(_PRUNE_UNSENT, 2 * len(unsent))
        return unsent

    def _send(self, frames: Sequence[Frame], *, block: bool = True, count: int = 1) -> None:
        """Send one zmq message of ``frames`` (carrying ``count`` of our messages)."""
        if self._closed:
            raise ChannelClosed(self._name, "send on a closed channel")
        send, last = self.socket.send, len(frames) - 1
        flags = 0 if block else _NOBLOCK
        written = self._written
        if written is not None:  # the last frame, tracked: it leaves after all the others
            frames, tail = frames[:-1], frames[-1]
        try:
            # Copy small frames (the header: cheaper than wrapping it in a
            # zmq Frame); hand large ones (tensor bytes) to zmq as views.
            # Only the first part can meet the high-water mark: once it is
            # queued, zmq takes the rest of the message whatever the flags.
            unsent = self._unsent
            for i, f in enumerate(frames):
                small = len(f) < zmq.COPY_THRESHOLD
                if small or unsent is None:
                    send(f, (_SNDMORE if i < last else 0) | flags, copy=small)
                else:  # tracked: zmq says when it has written the view out
                    tracker = send(f, (_SNDMORE if i < last else 0) | flags, copy=False,
                                   track=True)
                    unsent.append((tracker, memoryview(f).nbytes))
                    if len(unsent) >= self._prune_at:  # (a sender nobody asks stays bounded)
                        self._prune_unsent()
            if written is not None:
                if last:  # zmq takes the rest of a message once its first part is queued
                    flags = 0
                # A Frame of our own: pyzmq copies a small buffer given as is, and
                # its tracker is then done at once, whatever zmq still queues.
                tracker = send(zmq.Frame(tail, track=True, copy=False, copy_threshold=0),
                               flags, copy=False, track=True)
                written.append((tracker, count))
                if unsent is not None and len(tail) >= zmq.COPY_THRESHOLD:
                    unsent.append((tracker, memoryview(tail).nbytes))
        except zmq.Again as exc:
            raise WouldBlock(self._name, "the peer is not reading (high-water mark reached)"
                             if not block else "send timed out: the peer is not reading "
                             "(high-water mark reached)") from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGone(self._name, "the peer that asked is gone") from exc
            if exc.errno == zmq.ENOTSOCK:
                raise ChannelClosed(self._name, "send on a closed channel") from exc
            raise PeerGone(self._name, str(exc)) from exc


class ZmqInbox(_ZmqEnd, Generic[M]):
    """An inbox over a zmq socket that decodes with ``codec``.

    A message that fails to decode becomes a :class:`~bus.envelope.Rejected`
    (never an exception out of :meth:`drain`), and is counted in ``rejected``.
    """

    #: Most surplus parts of an oversized message discarded per drain: the
    #: rest waits for the next poll, so one message of a million empty parts
    #: costs a few milliseconds per step instead of stalling every inbox.
    DISCARD_PER_DRAIN = 16384

    def __init__(self, sock: zmq.Socket[bytes], codec: Codec[M], name: str, *,
                 routed: bool) -> None:
        super().__init__(sock, name)
        self.codec = codec
        self.rejected = 0
        self.discarded_parts = 0
        self._routed = routed
        self._origin = Origin(name)
        # Parts one message may have on the wire: the codec's bound, plus the
        # identity a ROUTER prepends. Checked while receiving, so surplus
        # parts are never gathered into a list.
        self._max_parts = codec.max_frames + (1 if routed else 0)
        self._skipping = False  # inside an oversized message: discard to its end
        #: Resolves shared-memory frame handles (``PullInbox`` on ``ipc://``); None: refused.
        self.shm_frames: FrameMapper | None = None

    def pollable(self) -> zmq.Socket[bytes]:
        return self.socket

    def drain(self, max_n: int) -> list[Envelope[M] | Rejected]:
        if self._closed:
            raise EndOfChannel(self._name, "closed")
        recv, decode = self.socket.recv, self.codec.decode_any
        origin, routed, name = self._origin, self._routed, self._name
        out: list[Envelope[M] | Rejected] = []
        if self._skipping and not self._discard():
            return out  # still inside an oversized message: go on next poll
        if not self.socket.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]
            # Nothing waits: one getsockopt, where a failed recv raises and
            # builds zmq.Again (3x dearer). A loop drains every inbox every
            # step, and most of them (rpc above all) are empty most steps.
            return out
        append = out.append
        max_parts = self._max_parts
        mapper = self.shm_frames
        while len(out) < max_n:  # a burst counts as the messages it holds
            try:
                # copy=False: a Frame says `.more` for free, where the socket's
                # RCVMORE option costs a getsockopt per message.
                part = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                break
            too_many = False
            if part.more:  # tensor frames follow: keep them as views (zero-copy)
                frames: list[Frame] = [part.buffer]
                while part.more:
                    if len(frames) == max_parts:
                        too_many = True
                        break
                    part = recv(0, copy=False)
                    frames.append(part.buffer)
            else:  # one frame: small ones read faster as bytes; a burst is not worth a copy
                frames = [part.bytes if len(part) < 65536 else part.buffer]
            if routed:  # ROUTER: the identity zmq prepended, never the payload's
                origin = Origin(name, bytes(frames[0]))
                frames = frames[1:] if len(frames) > 1 else [b""]
            if too_many:
                # Answer from the header, then drop the surplus parts unseen;
                # what is left waits for the next poll.
                too_many_parts = f"more than max_frames={self.codec.max_frames} frames"
                self._from_header(frames, too_many_parts + " (the rest were discarded "
                                  "unread)", origin, out)
                self._skipping = True
                if not self._discard():
                    break
                continue
            try:
                if (mapper is not None and len(frames) > 2 and
                        frames[0][:_MAGIC_LEN] == MAGIC):  # tensor frames in shared memory
                    frames = mapper.resolve(frames)
                got = decode(frames)
            except DecodeError as exc:
                if frames[0][:_MAGIC_LEN] == MAGIC:  # unresolved handles: by the header's rid
                    self._from_header(frames[1:], exc.reason, origin, out)
                elif exc.message_type == BURST_TAG or is_burst(frames[0]):
                    self._burst_members(frames, origin, out)
                else:
                    self.rejected += 1
                    append(Rejected(exc, origin))
                continue
            if type(got) is list:  # a burst: its members, in order
                out.extend(envelopes(got, origin))
            else:
                append(Envelope(got, origin))  # type: ignore[arg-type]
        return out

    def _burst_members(self, frames: Sequence[Frame], origin: Origin,
                       out: list[Envelope[M] | Rejected]) -> None:
        """A burst that failed to decode: each member alone, where its layout allows."""
        for member in self.codec.decode_members(frames):
            if isinstance(member, DecodeError):
                self.rejected += 1
                out.append(Rejected(member, origin))
            else:
                out.append(Envelope(member, origin))

    def _from_header(self, frames: Sequence[Frame], reason: str, origin: Origin,
                     out: list[Envelope[M] | Rejected]) -> None:
        """Refuse a message before its body is read (too many parts, shared-memory handles
        that do not resolve): by the header's rid (``frames[0]``), or each burst member's."""
        rid: str | None = None
        tag: str | None = None
        try:
            head = self.codec.decode(frames[:1])
        except DecodeError as exc:  # the usual case: the header refers to frames
            rid, tag = exc.rid, exc.message_type
        else:
            found = getattr(head, "rid", None)
            rid, tag = (found if isinstance(found, str) else None), type(head).__name__
        errors = (self.codec.reject_members(frames[:1], reason) if tag == BURST_TAG
                  else [DecodeError(reason, rid=rid, message_type=tag)])
        self.rejected += len(errors)
        out.extend(Rejected(e, origin) for e in errors)

    def _discard(self) -> bool:
        """Drop parts of the oversized message being skipped; True once it has ended."""
        recv = self.socket.recv
        for _ in range(self.DISCARD_PER_DRAIN):
            part = recv(0, copy=False)  # the message's parts are all here: never blocks
            self.discarded_parts += 1
            if not part.more:
                self._skipping = False
                return True
        return False


def _context(ctx: zmq.Context[zmq.Socket[bytes]] | None) -> zmq.Context[zmq.Socket[bytes]]:
    return ctx if ctx is not None else zmq.Context.instance()


class PullInbox(ZmqInbox[M]):
    """The work channel over PULL (binds by default: producers connect).

    ``shm`` (default: on for ``ipc://``, never for ``tcp://``): accept tensor
    frames sent through shared memory by a local :class:`PushOutbox`; they
    decode as read-only views of the sender's slab, released when the last
    array or tensor made from them is collected. Off, such a message is
    rejected like any undecodable one.
    """

    def __init__(self, codec: Codec[M], endpoint: str, *, name: str = "work", bind: bool = True,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: SocketOptions = _DEFAULT_OPTIONS, shm: bool | None = None) -> None:
        sock = make_socket(_context(ctx), zmq.PULL, endpoint, bind=bind, options=options,
                           sending=False)
        super().__init__(sock, codec, name, routed=False)
        self.endpoint = endpoint
        if _local(endpoint, shm):
            self.shm_frames = FrameMapper()


class PushOutbox(_ZmqEnd, Generic[M]):
    """A sending end over PUSH (connects by default).

    ``shm`` (default: on for ``ipc://``, never for ``tcp://``): each tensor
    frame of at least ``shm_threshold`` bytes is copied once into a
    shared-memory slab this outbox owns, and only a handle crosses the
    socket (the tensor may be reused as soon as ``send`` returns). The
    receiving :class:`PullInbox` must accept them (its default on ``ipc://``).
    ``shm=False`` keeps every byte on the socket. Slabs are unlinked at
    :meth:`close`: close after the peer has read what matters.
    ``watch_peers``: count the readers connected (:attr:`peers`, a
    :class:`~bus.PeerWatch` attached before the socket binds or connects, so
    it sees every one of them).
    """

    def __init__(self, codec: Codec[M], endpoint: str, *, name: str = "out", bind: bool = False,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: SocketOptions = _DEFAULT_OPTIONS, shm: bool | None = None,
                 shm_threshold: int = DEFAULT_SHM_THRESHOLD, watch_peers: bool = False) -> None:
        #: The readers connected (``None`` unless ``watch_peers``).
        self.peers: PeerWatch | None = None

        def watch(sock: zmq.Socket[bytes]) -> None:
            self.peers = PeerWatch(sock, name)

        try:
            sock = make_socket(_context(ctx), zmq.PUSH, endpoint, bind=bind, options=options,
                               sending=True, prepare=watch if watch_peers else None)
        except BaseException:
            if self.peers is not None:
                self.peers.close()
            raise
        super().__init__(sock, name)
        self.codec = codec
        self.endpoint = endpoint
        #: The shared-memory slabs of large frames (None: every byte on the socket).
        self.shm_frames = FramePool(threshold=shm_threshold) if _local(endpoint, shm) else None

    @property
    def bytes_unsent(self) -> int:
        """Bytes of large frames (``zmq.COPY_THRESHOLD`` and up) sent on the socket itself
        (``tcp://``, or past a full shared-memory pool) that zmq has not written out to
        the peer's connection yet: what this outbox's sends hold in its own memory
        beyond :attr:`shm_frames` (bytes already in the kernel's or the peer's buffers
        are not seen).

        Counted from the first time it is read on (0 then): an outbox nobody asks
        tracks nothing, and pays no tracker per large frame."""
        if self._unsent is None:
            self._unsent = []
            return 0
        return sum(n for _, n in self._prune_unsent())

    def track_writes(self) -> None:
        """Note, from now on, when zmq has written out each message sent (for a stop whose
        last answers must leave before the process ends: :meth:`wait_written`).

        zmq drops what it still queues when a process exits (pyzmq does not terminate
        its context at exit, the only step that honours ``LINGER``), so a process
        must not end before its last answers are out of zmq's hands. Each send then
        costs a tracker and a frame zmq does not copy: turn it on for the last ones.
        Idempotent (what was tracked stays tracked).
        """
        if self._written is None:
            self._written = []

    def wait_written(self, timeout: float) -> int:
        """Wait at most ``timeout`` seconds for zmq to write out to the peer's connection
        every message sent since :meth:`track_writes`; returns how many of them (a burst
        counts as the messages it holds) it has not written out by then (0: all).

        Messages sent before tracking began are queued ahead of the tracked ones, so
        they are out too once these are (one peer; a PUSH to several deals them out).
        Once all are done, it pauses :data:`WRITE_SETTLE` (within ``timeout``) for zmq
        to write its last batch to the connection.

        Raises:
            RuntimeError: :meth:`track_writes` was not called.
        """
        written = self._written
        if written is None:
            raise RuntimeError(f"channel {self._name!r}: wait_written without track_writes")
        deadline = time.monotonic() + timeout
        while written:
            tracker, _ = written[0]
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                break
            written.pop(0)
        if not written:  # (a deliberate pause: see WRITE_SETTLE; zmq reports no later step)
            time.sleep(min(WRITE_SETTLE, max(0.0, deadline - time.monotonic())))
        return sum(n for t, n in written if not t.done)

    def close(self) -> None:
        """Close the socket (its peer watch first) and unlink the shared-memory slabs.
        Idempotent."""
        peers = getattr(self, "peers", None)
        if peers is not None:
            peers.close()
        super().close()
        pool = getattr(self, "shm_frames", None)
        if pool is not None:
            pool.close()

    def empty(self, shape: Sequence[int], /, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized tensor to fill and then send with no copy (shared memory).

        On the shared-memory path, the tensor is built in one of this
        outbox's slabs, so a message carrying it crosses as a handle only:
        no memcpy at all. Do not write to it once sent: the receiver views
        the same memory. Reading it stays safe, since the slab is reused
        only after the receiver released it *and* your last reference is
        gone; a second send while the first is still held is copied.
        Elsewhere (``shm`` off, ``tcp://``, a full pool, below
        ``shm_threshold``) it is an ordinary ``torch.empty``.

        Raises:
            ValueError: a negative dimension.
        """
        return empty_tensor(self.shm_frames, shape, dtype)

    def _send_message(self, msg: M, block: bool) -> None:
        self._send_frames(self.codec.encode(msg), block)

    def _send_frames(self, frames: list[Frame], block: bool, count: int = 1) -> None:
        pool = self.shm_frames
        if pool is None or len(frames) < 2:
            self._send(frames, block=block, count=count)
            return
        wire, used = pool.wrap(frames)
        try:
            self._send(wire, block=block, count=count)
        except BaseException:
            pool.cancel(used)  # nothing was queued: the slabs are free again
            raise

    def send(self, msg: M, /) -> None:
        """Encode and send ``msg``; blocks at most the send timeout at the high-water mark.

        Raises:
            EncodeError: ``msg`` cannot be encoded (nothing was sent).
            WouldBlock: the peer is not reading.
            ChannelClosed: this outbox is closed.
        """
        self._send_message(msg, True)

    def send_many(self, msgs: Sequence[M], /) -> int:
        """Send ``msgs``, in order, as bursts: one zmq message and one msgspec call
        per up to ``SEND_BURST`` of them (one message travels as itself; a
        burst too big for the bounds is split).

        Blocks at most the send timeout per burst at the high-water mark.
        Returns how many were sent: all of them, or fewer when one cannot be
        encoded or the peer stopped reading after some had left (call again
        with the rest: the failure is then raised).

        Raises (only when nothing was sent):
            EncodeError: the first message cannot be encoded.
            WouldBlock: the peer is not reading.
            ChannelClosed: this outbox is closed.
        """
        return self._send_bursts(msgs, block=True)

    def send_many_nowait(self, msgs: Sequence[M], /) -> int:
        """Send as many of ``msgs`` as the peer takes now, in order, as bursts; never blocks.

        Returns how many were sent: fewer than ``len(msgs)`` when the peer
        stopped taking them (send the rest later) or the next one cannot be
        encoded (calling again with the rest raises it).

        Raises (only when nothing was sent):
            EncodeError: the first message cannot be encoded.
            ChannelClosed: this outbox is closed.
        """
        return self._send_bursts(msgs, block=False)

    def _send_bursts(self, msgs: Sequence[M], *, block: bool) -> int:
        """Send bursts of up to SEND_BURST; returns how many were sent.

        A burst too big for the bounds is halved until it fits. A message
        that cannot be encoded at all ends the call there: it raises only
        when it is the first unsent one (``sent == 0``), so a caller never
        loses track of what left and calls again from where it stopped.
        """
        encode_many, sent, size = self.codec.encode_many, 0, SEND_BURST
        while sent < len(msgs):
            chunk = msgs[sent:sent + size]
            try:
                frames = encode_many(chunk)
            except EncodeError:
                if len(chunk) > 1:
                    size = max(1, len(chunk) // 2)
                    continue
                if sent == 0:
                    raise
                return sent
            try:
                self._send_frames(frames, block, len(chunk))
            except WouldBlock:
                if block and sent == 0:
                    raise
                return sent
            sent += len(chunk)
            size = SEND_BURST
        return sent

    def send_nowait(self, msg: M, /) -> None:
        """Encode and send ``msg`` if the peer can take it now; never blocks.

        Raises:
            EncodeError: ``msg`` cannot be encoded (nothing was sent).
            WouldBlock: the peer is not reading (nothing was sent: retry later).
            ChannelClosed: this outbox is closed.
        """
        self._send_message(msg, False)
