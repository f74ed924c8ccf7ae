"""``Codec[M]``: messages to zmq-ready frames and back, tensors zero-copy, no pickle.

A message becomes one msgpack *header* frame plus one frame per large array:

* frame 0: the message as a tagged msgpack array (msgspec);
* frames 1..n: the raw bytes of each numpy array / torch tensor larger than
  ``inline_threshold``, sent as a view of the array's memory (no copy).
  Smaller arrays ride inline in frame 0 (see :mod:`messages._tensors`).

Packed columns (token ids, lengths: :data:`~messages.PackedU32`) are
memoryviews, which msgspec writes and reads natively as a msgpack ``bin``
in frame 0: no Python call, and decoded as a read-only view of the frame.
A batch's rids (:class:`~messages.RidColumn`) travel as one msgpack ``str``
(the enc hook writes it; msgspec reads it natively; no per-rid object at decode).

Ownership rules, for callers:

* **Source arrays**: ``encode`` returns views of contiguous arrays. Do not
  write to an array until the frames have been sent (a zmq send with
  ``copy=False`` reads the memory later, from its I/O thread). The bus
  outboxes keep the frames alive until then.
* **Decoded numpy arrays** are read-only views over the received frames (no
  copy; numpy marks them read-only): ``.copy()`` one to write to it.
* **Decoded torch tensors**: one that rode inline is an owned, writable copy.
  An out-of-band one is a view over the received frame (no copy); torch
  cannot mark it read-only, so treat it as read-only and ``.clone()`` it
  before writing or before moving it to pinned memory.

Decoding is defensive: every failure is a :class:`~messages.errors.DecodeError`
(never a crash, an over-read or a huge allocation), carrying the request id
when it could be read and naming the offending field. That is structural,
not a property each helper keeps: :meth:`Codec.decode` has one ``except
Exception`` boundary, and the code naming the failure runs under its own
guard (if naming fails, msgspec's own text is the reason). Naming is cheap,
because every attacker reaches it: the type tree is inspected once per
codec and each (tag, path) is named once, in a bounded cache.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Iterable, Sequence
from typing import Final, Generic, TypeVar

import msgspec
import numpy as np
import torch

from messages import _tensors as tz
from messages._failures import FailureNamer, find_field, invalid, unencodable
from messages.base import ABSTRACT_MESSAGE_TYPES, Message, PackingMeta, unpack_received
from messages.burst import BURST_TAG, MAX_BURST, burst_type, split
from messages.errors import DecodeError, EncodeError
from messages.rids import RidColumn

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_FRAMES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Codec",
    "Frame",
    "concrete_types",
]

#: Arrays of at most this many bytes ride inline in the header frame.
#: Chosen by ``benchmarks/codec.py``: below it, a frame of its own costs more
#: (a zmq part, a Python object) than copying the bytes.
DEFAULT_INLINE_THRESHOLD: Final = 4096
#: Most frames one message may have (header included).
DEFAULT_MAX_FRAMES: Final = 64
#: Most bytes one message may have, all frames together.
DEFAULT_MAX_MESSAGE_BYTES: Final = 1 << 30

#: What a frame may be, going in or out: anything exposing bytes.
Frame = bytes | bytearray | memoryview

M = TypeVar("M", bound=Message)
T = TypeVar("T")


class _Refused(Exception):
    """A check of our own failed (a bound, the frame count); the boundary converts it."""




def concrete_types(base: type[M]) -> tuple[type[M], ...]:
    """``base`` (unless it is a marker base) and all its subclasses, in definition order."""
    out: list[type[M]] = []
    todo = [base]
    while todo:
        cls = todo.pop(0)
        if cls not in ABSTRACT_MESSAGE_TYPES and cls not in out:
            out.append(cls)
        todo.extend(cls.__subclasses__())
    return tuple(out)


class Codec(Generic[M]):
    """Encode messages of type ``M`` into frames and decode frames into ``M``.

    ``Codec(Request)`` decodes every concrete request class defined when it is
    built; ``Codec(BatchTokenIDOut)`` just that one; ``types=`` narrows the
    union explicitly. Build one per socket and reuse it. A codec is safe to
    share between threads (encoding keeps its scratch per thread; decoding a
    multi-frame message takes a lock).

    Args:
        base: the message type (or family base) this codec carries.
        types: the concrete classes to decode; defaults to every concrete
            subclass of ``base``.
        inline_threshold: arrays up to this many bytes ride inline.
        max_frames: most frames per message, header included.
        max_message_bytes: most bytes per message, all frames together.
        move_to_cpu: copy a CUDA tensor to the CPU when encoding instead of
            refusing it.
        channel: the channel this codec is the door of (see
            :mod:`messages.channels`, whose ``Channel`` builds such codecs).
            With a channel, ``types`` is what the channel carries: encoding
            any other type raises :class:`EncodeError` before anything is
            sent, and decoding one raises :class:`~messages.NotCarried`
            (its rid read when it has one) instead of executing it.
    """

    def __init__(
        self,
        base: type[M],
        *,
        types: Iterable[type[M]] | None = None,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        move_to_cpu: bool = False,
        channel: str | None = None,
    ) -> None:
        if max_frames < 1 or max_message_bytes < 1 or inline_threshold < 0:
            raise ValueError("max_frames, max_message_bytes must be >= 1, inline_threshold >= 0")
        self.base = base
        self.types: tuple[type[M], ...] = (
            tuple(types) if types is not None else concrete_types(base)
        )
        if not self.types:
            raise ValueError(f"no concrete message type under {base.__name__}")
        for t in self.types:
            if not (isinstance(t, type) and issubclass(t, base)):
                raise TypeError(f"{t!r} is not a subclass of {base.__name__}")
        self.inline_threshold = inline_threshold
        self.max_frames = max_frames
        self.max_message_bytes = max_message_bytes
        self.move_to_cpu = move_to_cpu
        self.channel = channel
        #: The types this channel lets through its door (None: no channel, no check).
        self._carried: frozenset[type] | None = (
            frozenset(self.types) if channel is not None else None)
        self._namer = FailureNamer(self.types, channel)  # the cold path: what failed, where
        self._unpacking = PackingMeta.types_in(self.types)  # finished after a decode
        union = self.types[0] if len(self.types) == 1 else _union(self.types)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(
            union, ext_hook=self._ext_hook, dec_hook=self._dec_hook
        )
        self._fields: dict[int, tuple[type, np.dtype[np.generic] | None, object]] = {}
        # One-frame messages (the common case: no out-of-band array) need no
        # per-call state, so they decode without the lock.
        self._single: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(
            union, ext_hook=self._ext_hook_single, dec_hook=self._dec_hook
        )
        # Bursts (messages.burst): the same union, or a burst of it, in one call.
        self._burst = burst_type(union)
        either = union | self._burst
        self._decoder_any: msgspec.msgpack.Decoder[object] = msgspec.msgpack.Decoder(
            either, ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._single_any: msgspec.msgpack.Decoder[object] = msgspec.msgpack.Decoder(
            either, ext_hook=self._ext_hook_single, dec_hook=self._dec_hook)
        self._state = threading.local()  # per thread: the frames an encode sets aside
        # A multi-frame decode's state, guarded by the lock.
        self._lock = threading.Lock()
        self._in: Sequence[Frame] = ()
        self._used = 0

    # -- encoding -----------------------------------------------------------

    def encode(self, msg: M, /) -> list[Frame]:
        """Return the frames of ``msg``: the header, then one per large array.

        Raises:
            EncodeError: an unsupported or CUDA tensor (naming the field), the
                message exceeds ``max_frames`` / ``max_message_bytes``, or the
                codec's channel does not carry its type.
        """
        carried = self._carried
        if carried is not None and type(msg) not in carried:
            raise self._refuse_type(msg)
        return self._encode(msg)

    def _refuse_type(self, msg: Message) -> EncodeError:
        return EncodeError(type(msg).__name__, "", self._namer.not_carried(msg).reason)

    def _encode(self, msg: M) -> list[Frame]:
        state = self._state.__dict__  # per thread: codecs are shared across threads
        try:
            header = self._encoder.encode(msg)
        except (tz.TensorFormatError, TypeError, ValueError, OverflowError) as exc:
            state.pop("frames", None)
            failed = state.pop("failed", None)
            if failed is not None:  # the enc hook refused this object
                field = find_field(msg, lambda value: value is failed)
            else:  # msgpack itself refused a scalar (an int past 64 bits, a lone surrogate)
                field = find_field(msg, unencodable)
            raise EncodeError(type(msg).__name__, field, str(exc)) from exc
        extra: list[Frame] | None = state.pop("frames", None)
        out: list[Frame] = [header] if extra is None else [header, *extra]
        if len(out) == 1:
            if len(header) > self.max_message_bytes:
                raise self._too_big(msg, len(header))
            return out
        if len(out) > self.max_frames:
            raise EncodeError(type(msg).__name__, "", f"{len(out)} frames, more than "
                              f"max_frames={self.max_frames}")
        size = sum(memoryview(f).nbytes for f in out)
        if size > self.max_message_bytes:
            raise self._too_big(msg, size)
        return out

    def encode_many(self, msgs: Sequence[M], /) -> list[Frame]:
        """Return the frames of one burst of ``msgs``, encoded in one msgspec call.

        One message encodes as itself (a peer that knows no bursts reads
        it). The frames of the members' large arrays follow frame 0 in
        order, numbered across the burst.

        Raises:
            EncodeError: a member cannot be encoded (naming it and its field),
                or the burst exceeds ``max_frames`` / ``max_message_bytes``
                (send fewer at a time).
            ValueError: no messages, or more than ``MAX_BURST``.
        """
        if len(msgs) == 1:
            return self.encode(msgs[0])
        if not msgs or len(msgs) > MAX_BURST:
            raise ValueError(f"a burst holds 1 to {MAX_BURST} messages, not {len(msgs)}")
        carried = self._carried
        if carried is not None and not carried.issuperset(map(type, msgs)):
            raise self._refuse_type(next(m for m in msgs if type(m) not in carried))
        try:
            return self._encode(self._burst(list(msgs)))  # type: ignore[arg-type]
        except EncodeError:
            for msg in msgs:  # the cold path: name the member that cannot be encoded
                self.encode(msg)
            raise

    def _too_big(self, msg: M, size: int) -> EncodeError:
        return EncodeError(type(msg).__name__, "", f"{size} bytes, more than "
                           f"max_message_bytes={self.max_message_bytes}")

    def _enc_hook(self, obj: object) -> msgspec.msgpack.Ext | bytes | str:
        if type(obj) is RidColumn:
            return obj.wire
        try:
            if isinstance(obj, np.ndarray):
                if obj.nbytes <= self.inline_threshold:
                    compact = tz.compact_numpy(obj)
                    if compact is not None:
                        return compact
                head, data = tz.numpy_parts(obj)
                inline, oob = tz.EXT_NUMPY_INLINE, tz.EXT_NUMPY_OOB
            elif isinstance(obj, torch.Tensor):
                head, data = tz.torch_parts(obj, move_to_cpu=self.move_to_cpu)
                inline, oob = tz.EXT_TORCH_INLINE, tz.EXT_TORCH_OOB
            else:
                raise TypeError(f"cannot encode a {type(obj).__qualname__} (no pickle, ever)")
        except (tz.TensorFormatError, TypeError):
            self._state.failed = obj
            raise
        if data.nbytes <= self.inline_threshold:
            return msgspec.msgpack.Ext(inline, head + data)
        frames: list[Frame] = self._state.__dict__.setdefault("frames", [])
        frames.append(data if data.format == "B" else data.cast("B"))
        return msgspec.msgpack.Ext(oob, head + tz.pack_index(len(frames)))

    # -- decoding -----------------------------------------------------------

    def decode(self, frames: Sequence[Frame], /) -> M:
        """Rebuild the message from its frames.

        Raises:
            DecodeError: the frames are not a valid ``M``; ``.rid`` is set
                when a request id could be read, ``.reason`` names the field.
                Nothing else leaves this method, whatever the bytes.
        """
        # The one boundary: whatever fails below (msgspec, a hook, a bound, a
        # bug in a helper), it leaves as a DecodeError. A try costs nothing
        # on the way through, so the one-frame fast path stays as it was.
        try:
            if len(frames) == 1 and len(frames[0]) <= self.max_message_bytes:
                msg = self._single.decode(frames[0])
            else:
                msg = self._decode_frames(frames, self._decoder)
            unpack_received(msg, self._unpacking)
            return msg
        except Exception as exc:
            raise self._namer.failure(frames, exc) from exc

    def decode_any(self, frames: Sequence[Frame], /) -> M | list[M]:
        """Decode one message, or a burst of them (as a list, in order), in one call.

        Raises:
            DecodeError: as :meth:`decode`. For a burst, :meth:`decode_members`
                then tells which members are at fault.
        """
        try:
            if len(frames) == 1:
                head = frames[0]
                if len(head) <= self.max_message_bytes:
                    got = self._single_any.decode(head)
                else:
                    got = self._decode_frames(frames, self._decoder_any)
            else:
                got = self._decode_frames(frames, self._decoder_any)
            if type(got) is self._burst:
                got = got.items  # type: ignore[attr-defined]
            unpack_received(got, self._unpacking)
        except Exception as exc:
            raise self._namer.failure(frames, exc) from exc
        return got  # type: ignore[return-value]

    def decode_members(self, frames: Sequence[Frame], /) -> list[M | DecodeError]:
        """A burst that failed to decode, member by member (the cold path).

        With no tensor frames, each member decodes alone: the good ones are
        returned, each bad one is its own :class:`DecodeError` (with its rid
        when readable). With tensor frames, or more members than
        ``MAX_BURST``, the members are rejected together, each with its own
        rid. A burst whose outline does not read (or that is empty) is one
        error.
        """
        try:
            raws = split(frames[0])
        except Exception as exc:
            return [self._namer.failure(frames, exc)]
        if not raws:
            return [DecodeError("an empty burst", message_type=BURST_TAG)]
        if len(raws) > MAX_BURST:
            return list(self.reject_members(frames, f"a burst of {len(raws)} messages, more "
                                                    f"than {MAX_BURST}"))
        if len(frames) == 1:
            out: list[M | DecodeError] = []
            for raw in raws:
                try:
                    out.append(self.decode([raw]))
                except DecodeError as exc:
                    out.append(exc)
            return out
        try:
            self.decode_any(frames)
            why = "decode failed"
        except DecodeError as exc:
            why = exc.reason
        return list(self.reject_members(frames, f"in a burst with tensor frames that failed "
                                                f"to decode ({why})"))

    def reject_members(self, frames: Sequence[Frame], reason: str, /) -> list[DecodeError]:
        """One :class:`DecodeError` per member of the burst in ``frames[0]``, each with
        the member's own rid when readable (one error if the outline does not read)."""
        try:
            raws = split(frames[0])
        except Exception as exc:
            return [self._namer.failure(frames, exc)]
        errors: list[DecodeError] = []
        for raw in raws:
            tag, rid, _ = self._namer.peek([raw])
            errors.append(DecodeError(reason, rid=rid, message_type=tag))
        return errors or [DecodeError(f"{reason} (an empty burst)", message_type=BURST_TAG)]

    def check_type(self, msg: Message, /) -> None:
        """Refuse ``msg`` if this codec's channel does not carry its type (the door
        alone, for in-process messages that skip :meth:`validate`). Costs a set lookup.

        Raises:
            NotCarried: the channel does not carry ``type(msg)`` (``.rid`` set
                when ``msg`` has a ``str`` rid).
        """
        carried = self._carried
        if carried is not None and type(msg) not in carried:
            raise self._namer.not_carried(msg)

    def validate(self, msg: M, /) -> M:
        """Check ``msg`` as if it had crossed the wire, and return the checked copy.

        For messages that travel by reference (an in-process ring) and so are
        never decoded: they get the same checks a received one gets (field
        constraints, ``__post_init__``, tensor headers), by encoding and
        decoding them. Large tensors are not copied: the frames view the
        tensor's memory and decoding views them again, so the returned
        message shares them with ``msg`` (treat them as read-only, as with
        any decoded message).

        Raises:
            DecodeError: ``msg`` breaks a constraint or cannot be encoded at
                all. ``.rid`` is ``msg.rid`` whenever that is a ``str``, even
                one the wire would refuse (the caller is in-process and can
                still be answered), ``.message_type`` is the class name and
                ``.reason`` names the field. A :class:`~messages.NotCarried`
                when the codec's channel does not carry ``msg``'s type.
        """
        carried = self._carried
        if carried is not None and type(msg) not in carried:
            raise self._namer.not_carried(msg)
        try:
            return self.decode(self.encode(msg))
        except Exception as exc:
            raise invalid(msg, exc) from exc

    def _decode_frames(self, frames: Sequence[Frame], decoder: msgspec.msgpack.Decoder[T]) -> T:
        """Decode several frames (or one past a bound); raises anything, the caller converts."""
        n = len(frames)
        if n == 0:
            raise _Refused("no frames")
        if n > self.max_frames:
            raise _Refused(f"{n} frames, more than max_frames={self.max_frames}")
        size = sum(memoryview(f).nbytes for f in frames)
        if size > self.max_message_bytes:
            raise _Refused(f"{size} bytes, more than max_message_bytes={self.max_message_bytes}")
        with self._lock:
            self._in = frames
            self._used = 0
            try:
                msg = decoder.decode(frames[0])
                used = self._used
            finally:
                self._in = ()
        if used != n - 1:
            raise _Refused(f"{n - 1} tensor frames sent but {used} referenced")
        return msg

    def _dec_hook(self, tp: object, obj: object) -> object:
        """Check (or, for a compact array, build) the value of a field."""
        # Keyed by id: hashing a generic alias costs ~1 us. The value holds
        # tp, so the id cannot be reused while cached.
        field = self._fields.get(id(tp))
        if field is None:
            field = self._fields[id(tp)] = (*tz.array_field(tp), tp)
        cls, dtype, _ = field
        if type(obj) is bytes and cls is np.ndarray:
            return tz.from_compact(obj, dtype)
        if type(obj) is tz.BadArray:
            raise tz.TensorFormatError(obj.reason)
        if isinstance(obj, cls):
            if dtype is not None and obj.dtype != dtype:  # type: ignore[attr-defined]
                raise tz.TensorFormatError(f"expected dtype {dtype}, got {obj.dtype}")  # type: ignore[attr-defined]
            return obj
        raise tz.TensorFormatError(f"expected {cls.__name__}, got {type(obj).__name__}")

    def _ext_hook(self, code: int, data: memoryview) -> object:
        try:
            return self._unpack(code, data, self._in)
        except (tz.TensorFormatError, ValueError, TypeError, RuntimeError) as exc:
            return tz.BadArray(str(exc))  # the dec hook raises it where msgspec knows the path

    def _ext_hook_single(self, code: int, data: memoryview) -> object:
        try:
            return self._unpack(code, data, ())
        except (tz.TensorFormatError, ValueError, TypeError, RuntimeError) as exc:
            return tz.BadArray(str(exc))

    def _unpack(self, code: int, data: memoryview, frames: Sequence[Frame]) -> object:
        dtype, shape, nbytes, off = tz.parse_header(data)
        if code == tz.EXT_NUMPY_INLINE or code == tz.EXT_TORCH_INLINE:
            if len(data) - off != nbytes:
                raise tz.TensorFormatError(
                    f"shape {shape} needs {nbytes} bytes, inline data has {len(data) - off}")
            buf = data
            copy = True
        elif code == tz.EXT_NUMPY_OOB or code == tz.EXT_TORCH_OOB:
            index = tz.frame_index(data, off)
            if not frames:
                raise tz.TensorFormatError(
                    f"refers to frame {index} but the message has no tensor frames")
            if index != self._used + 1 or index >= len(frames):
                raise tz.TensorFormatError(
                    f"refers to frame {index}, expected frame {self._used + 1} "
                    f"of {len(frames)}")
            self._used = index
            buf = memoryview(frames[index]).cast("B")
            if buf.nbytes != nbytes:
                raise tz.TensorFormatError(
                    f"shape {shape} needs {nbytes} bytes, frame {index} has {buf.nbytes}")
            copy, off = False, 0
        else:
            raise tz.TensorFormatError(f"unknown extension code {code}")
        if code == tz.EXT_NUMPY_INLINE or code == tz.EXT_NUMPY_OOB:
            return tz.to_numpy(dtype, shape, buf, off)
        return tz.to_torch(dtype, shape, buf, off, copy=copy)


def _union(types: Sequence[type[M]]) -> object:
    return functools.reduce(operator.or_, types)
