"""``Codec[M]``: messages to zmq-ready frames and back, tensors zero-copy, no pickle.

A message becomes one msgpack *header* frame plus one frame per large array:

* frame 0: the message as a tagged msgpack array (msgspec);
* frames 1..n: the raw bytes of each numpy array / torch tensor larger than
  ``inline_threshold``, sent as a view of the array's memory (no copy).
  Smaller arrays ride inline in frame 0 (see :mod:`messages._tensors`).

Packed columns (token ids, lengths: :data:`~messages.PackedU32`) are
memoryviews, which msgspec writes and reads natively as a msgpack ``bin``
in frame 0: no Python call, and decoded as a read-only view of the frame.

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
when it could be read and naming the offending field.
"""

from __future__ import annotations

import functools
import operator
import re
import threading
import typing
from collections.abc import Iterable, Iterator, Sequence
from typing import Final, Generic, TypeVar

import msgspec
import numpy as np
import torch

from messages import _tensors as tz
from messages.base import ABSTRACT_MESSAGE_TYPES, Message
from messages.errors import DecodeError, EncodeError

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


class _Bad:
    """Returned by the ext hook for a bad array, so msgspec reports its path.

    The ext hook cannot raise usefully (msgspec would lose the path); the
    dec hook that follows raises ``reason`` with the path attached.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

_PATH_TOKENS: Final = re.compile(r"\[(\d+|\"(?:[^\"\\]|\\.)*\"|\.\.\.)\]|\.(\w+)")


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
        self._by_tag: dict[str, type[M]] = {
            str(msgspec.inspect.type_info(t).tag): t  # type: ignore[attr-defined]
            for t in self.types
        }
        union = self.types[0] if len(self.types) == 1 else _union(self.types)
        self._decode_type = union
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
        self._state = threading.local()  # per thread: the frames an encode sets aside
        # A multi-frame decode's state, guarded by the lock.
        self._lock = threading.Lock()
        self._in: Sequence[Frame] = ()
        self._used = 0

    # -- encoding -----------------------------------------------------------

    def encode(self, msg: M, /) -> list[Frame]:
        """Return the frames of ``msg``: the header, then one per large array.

        Raises:
            EncodeError: an unsupported or CUDA tensor (naming the field), or
                the message exceeds ``max_frames`` / ``max_message_bytes``.
        """
        state = self._state.__dict__  # per thread: codecs are shared across threads
        try:
            header = self._encoder.encode(msg)
        except (tz.TensorFormatError, TypeError, ValueError, OverflowError) as exc:
            state.pop("frames", None)
            failed = state.pop("failed", None)
            field = _find_field(msg, failed) if failed is not None else ""
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

    def _too_big(self, msg: M, size: int) -> EncodeError:
        return EncodeError(type(msg).__name__, "", f"{size} bytes, more than "
                           f"max_message_bytes={self.max_message_bytes}")

    def _enc_hook(self, obj: object) -> msgspec.msgpack.Ext | bytes:
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
        """
        n = len(frames)
        if n == 1:
            head = frames[0]
            if len(head) > self.max_message_bytes:
                raise self._fail(frames, f"{len(head)} bytes, more than "
                                 f"max_message_bytes={self.max_message_bytes}")
            try:
                return self._single.decode(head)
            except _DECODE_FAILURES as exc:
                raise self._fail(frames, _reason(self._decode_type, frames, exc)) from exc
        if n == 0:
            raise DecodeError("no frames")
        if n > self.max_frames:
            raise self._fail(frames, f"{n} frames, more than max_frames={self.max_frames}")
        size = sum(memoryview(f).nbytes for f in frames)
        if size > self.max_message_bytes:
            raise self._fail(frames, f"{size} bytes, more than "
                             f"max_message_bytes={self.max_message_bytes}")
        with self._lock:
            self._in = frames
            self._used = 0
            try:
                msg = self._decoder.decode(frames[0])
                used = self._used
            except _DECODE_FAILURES as exc:
                raise self._fail(frames, _reason(self._decode_type, frames, exc)) from exc
            finally:
                self._in = ()
        if used != n - 1:
            raise self._fail(frames, f"{n - 1} tensor frames sent but {used} referenced")
        return msg

    def _dec_hook(self, tp: object, obj: object) -> object:
        """Check (or, for a compact array, build) the value of an array field."""
        # Keyed by id: hashing a generic alias costs ~1 us. The value holds
        # tp, so the id cannot be reused while cached.
        field = self._fields.get(id(tp))
        if field is None:
            field = self._fields[id(tp)] = (*_array_field(tp), tp)
        cls, dtype, _ = field
        if type(obj) is bytes and cls is np.ndarray:
            return tz.from_compact(obj, dtype)
        if type(obj) is _Bad:
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
            return _Bad(str(exc))  # the dec hook raises it where msgspec knows the path

    def _ext_hook_single(self, code: int, data: memoryview) -> object:
        try:
            return self._unpack(code, data, ())
        except (tz.TensorFormatError, ValueError, TypeError, RuntimeError) as exc:
            return _Bad(str(exc))

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

    # -- failure reporting (cold path) --------------------------------------

    def _fail(self, frames: Sequence[Frame], reason: str) -> DecodeError:
        tag, rid = self._peek(frames)
        return DecodeError(reason, rid=rid, message_type=tag)

    def _peek(self, frames: Sequence[Frame]) -> tuple[str | None, str | None]:
        """Best effort: read the tag and rid of an undecodable message."""
        try:
            raw = _RAW.decode(frames[0])
        except Exception:  # anything: the frame is garbage
            return None, None
        if not (isinstance(raw, list) and raw and isinstance(raw[0], str)):
            return None, None
        tag = raw[0][:128]
        cls = self._by_tag.get(tag)
        if cls is None:
            return tag, None
        fields = cls.__struct_fields__
        if "rid" in fields:
            i = fields.index("rid") + 1
            if i < len(raw) and isinstance(raw[i], str) and 0 < len(raw[i]) <= 256:
                return tag, raw[i]
        return tag, None


_DECODE_FAILURES: Final = (
    msgspec.ValidationError, msgspec.DecodeError, tz.TensorFormatError, ValueError, TypeError,
    OverflowError, RecursionError, IndexError,
)
_RAW: Final = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)


def _reason(decode_type: object, frames: Sequence[Frame], exc: Exception) -> str:
    """Turn msgspec's ``... - at `$[3][2]``` into ``sampling.top_p: ...``."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return text
    message, sep, path = text.rpartition(" - at `")
    if not sep:
        return text
    try:
        raw = _RAW.decode(frames[0])
    except Exception:
        raw = None
    field = _field_path(decode_type, raw, path.rstrip("`"))
    return f"{field}: {message}" if field else message


def _array_field(tp: object) -> tuple[type, np.dtype[np.generic] | None]:
    """(class, numpy dtype or None) of an array field's annotation."""
    origin = typing.get_origin(tp) or tp
    if origin is np.ndarray:
        args = typing.get_args(tp)
        scalar = typing.get_args(args[1]) if len(args) == 2 else ()
        if scalar and isinstance(scalar[0], type) and issubclass(scalar[0], np.generic):
            return np.ndarray, np.dtype(scalar[0])
        return np.ndarray, None
    if isinstance(origin, type):
        return origin, None
    raise TypeError(f"unsupported field type {tp!r}")


def _union(types: Sequence[type[M]]) -> object:
    return functools.reduce(operator.or_, types)


def _field_path(decode_type: object, raw: object, path: str) -> str:
    """Name the field a msgspec path points at, walking the types alongside the raw value."""
    info: object = msgspec.inspect.type_info(decode_type)
    parts: list[str] = []
    value = raw
    ins = msgspec.inspect
    for m in _PATH_TOKENS.finditer(path):
        index, attr = m.group(1), m.group(2)
        while isinstance(info, ins.UnionType):
            info = _pick_member(info, value)
        if isinstance(info, ins.StructType):
            if attr is not None:
                name = attr
                field = next((f for f in info.fields if f.encode_name == attr), None)
            else:
                pos = int(index) - (1 if info.tag is not None else 0)
                field = info.fields[pos] if 0 <= pos < len(info.fields) else None
                name = field.name if field is not None else "message type"
            parts.append(("." if parts else "") + name)
            info = field.type if field is not None else None
        elif isinstance(info, ins.DictType):
            parts.append(f"[{index}]")
            info = info.value_type
        elif isinstance(info, ins.ListType | ins.TupleType | ins.VarTupleType | ins.SetType):
            parts.append(f"[{index}]")
            info = getattr(info, "item_type", None)
        else:
            parts.append(f"[{index}]" if index is not None else f".{attr}")
            info = None
        if isinstance(value, list) and index is not None and index.isdigit():
            i = int(index)
            value = value[i] if i < len(value) else None
        else:
            value = None
    return "".join(parts)


def _pick_member(info: msgspec.inspect.UnionType, value: object) -> object:
    ins = msgspec.inspect
    if isinstance(value, list) and value and isinstance(value[0], str):
        for t in info.types:
            if isinstance(t, ins.StructType) and t.tag == value[0]:
                return t
    for t in info.types:
        if not isinstance(t, ins.NoneType):
            return t
    return None


def _children(value: object, prefix: str) -> Iterator[tuple[str, object]]:
    """(dotted path, child) of each field / item / entry of ``value``."""
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            yield (f"{prefix}.{name}" if prefix else name), getattr(value, name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield f"{prefix}[{i}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{prefix}[{key!r}]", item


def _find_field(msg: object, target: object, prefix: str = "", depth: int = 0) -> str:
    """Dotted path of the field of ``msg`` holding ``target`` (identity), or ``""``."""
    if depth > 8:
        return ""
    for path, value in _children(msg, prefix):
        if value is target:
            return path
        found = _find_field(value, target, path, depth + 1)
        if found:
            return found
    return ""
