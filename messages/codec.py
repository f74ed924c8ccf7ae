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
import re
import threading
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, Generic, TypeVar

import msgspec
import numpy as np
import torch

from messages import _tensors as tz
from messages.base import ABSTRACT_MESSAGE_TYPES, Message, Rid
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


class _Refused(Exception):
    """A check of our own failed (a bound, the frame count); the boundary converts it."""


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
        # Where a rejected message's rid sits in its array (the tag is item 0).
        self._rid_at: dict[str, int] = {
            tag: t.__struct_fields__.index("rid") + 1
            for tag, t in self._by_tag.items() if "rid" in t.__struct_fields__
        }
        # Failure naming (cold path): the type tree, inspected on the first
        # failure rather than per failure, and (tag, msgspec path) -> name.
        self._infos: dict[str, msgspec.inspect.StructType] | None = None
        self._names: dict[tuple[str | None, str], str] = {}
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
            if failed is not None:  # the enc hook refused this object
                field = _find_field(msg, lambda value: value is failed)
            else:  # msgpack itself refused a scalar (an int past 64 bits, a lone surrogate)
                field = _find_field(msg, _unencodable)
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
                Nothing else leaves this method, whatever the bytes.
        """
        # The one boundary: whatever fails below (msgspec, a hook, a bound, a
        # bug in a helper), it leaves as a DecodeError. A try costs nothing
        # on the way through, so the one-frame fast path stays as it was.
        try:
            if len(frames) == 1:
                head = frames[0]
                if len(head) <= self.max_message_bytes:
                    return self._single.decode(head)
            return self._decode_frames(frames)
        except Exception as exc:
            raise self._failure(frames, exc) from exc

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
                ``.reason`` names the field.
        """
        try:
            return self.decode(self.encode(msg))
        except Exception as exc:
            raise _invalid(msg, exc) from exc

    def _decode_frames(self, frames: Sequence[Frame]) -> M:
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
                msg = self._decoder.decode(frames[0])
                used = self._used
            finally:
                self._in = ()
        if used != n - 1:
            raise _Refused(f"{n - 1} tensor frames sent but {used} referenced")
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

    def _failure(self, frames: Sequence[Frame], exc: Exception) -> DecodeError:
        """The DecodeError for ``exc``, naming what it can. Never raises.

        Frame 0 is parsed once here, shallowly (its items as raw views), for
        the tag and the rid; the field is named from the tag and msgspec's
        path alone, so no value steers the walk and its result can be cached.
        """
        tag: str | None = None
        rid: str | None = None
        try:
            reason = str(exc) or type(exc).__name__
        except Exception:  # a str() that fails: still a DecodeError
            reason = type(exc).__name__
        try:
            tag, rid, known = self._peek(frames)
            if isinstance(exc, msgspec.ValidationError):
                reason = self._name_field(tag if known else None, reason)
        except Exception:  # naming is best effort: msgspec's text still says what is wrong
            pass
        return DecodeError(reason, rid=rid, message_type=tag)

    def _peek(self, frames: Sequence[Frame]) -> tuple[str | None, str | None, bool]:
        """(tag, rid, whether the tag is one of ours) of an undecodable message."""
        try:
            items = _PEEK.decode(frames[0])
            tag = _TAG.decode(items[0])[:128]
        except Exception:  # not a tagged array: nothing to read
            return None, None, False
        if tag not in self._by_tag:
            return tag, None, False
        i = self._rid_at.get(tag)
        if i is None or i >= len(items):
            return tag, None, True
        try:
            return tag, _RID.decode(items[i]), True
        except Exception:  # a rid that is not a valid one is not an address
            return tag, None, True

    def _name_field(self, tag: str | None, reason: str) -> str:
        """``Expected ... - at `$[3][2]``` -> ``sampling.top_p: Expected ...``."""
        message, sep, where = reason.rpartition(" - at `")
        if not sep:
            return reason
        key = (tag, where)
        names = self._names
        name = names.get(key)
        if name is None:
            if len(names) >= _MAX_NAMES:  # paths carry indices: bound what a sender can grow
                names.clear()
            name = names[key] = self._walk(tag, where.rstrip("`"))
        return f"{name}: {message}" if name else reason

    def _walk(self, tag: str | None, where: str) -> str:
        """Name the field a msgspec path points at, from the types alone ("" if unsure)."""
        if where.startswith("key` in `"):  # a dict key: name the dict
            where = where[len("key` in `"):]
        if not where.startswith("$"):
            return ""
        tokens = _PATH_TOKENS.findall(where, 1)
        infos = self._infos
        if infos is None:
            infos = self._infos = {
                str(info.tag): info
                for info in msgspec.inspect.multi_type_info(self.types)
                if isinstance(info, msgspec.inspect.StructType)
            }
        node: object = infos.get(tag) if tag is not None else None
        if node is None:
            return "message type" if tokens[:1] == [("0", "")] else ""
        parts: list[str] = []
        for index, attr in tokens:
            node = _member(node, index)
            if isinstance(node, msgspec.inspect.StructType):
                name, node = _struct_step(node, index, attr)
                if name is None:
                    break
                parts.append(("." if parts else "") + name)
                continue
            parts.append(f"[{index}]" if index else f".{attr}")
            if isinstance(node, msgspec.inspect.DictType):
                node = node.value_type
            elif isinstance(node, msgspec.inspect.ListType | msgspec.inspect.VarTupleType
                            | msgspec.inspect.SetType | msgspec.inspect.FrozenSetType):
                node = node.item_type
            elif isinstance(node, msgspec.inspect.TupleType) and index.isdigit():
                i = int(index)
                node = node.item_types[i] if i < len(node.item_types) else None
            else:
                node = None
        return "".join(parts)


#: Most cached (tag, path) -> name entries before the cache starts over.
_MAX_NAMES: Final = 4096
# The top-level items of frame 0 as raw views: enough for the tag and the rid,
# without building (or copying) the rest of a message that failed.
_PEEK: Final = msgspec.msgpack.Decoder(list[msgspec.Raw])
_TAG: Final = msgspec.msgpack.Decoder(str)
_RID: Final = msgspec.msgpack.Decoder(Rid)
_ARRAY_LIKE: Final = (
    msgspec.inspect.ListType, msgspec.inspect.VarTupleType, msgspec.inspect.TupleType,
    msgspec.inspect.SetType, msgspec.inspect.FrozenSetType,
)


def _member(node: object, index: str) -> object:
    """The member of a union that a path step can enter, or None if not exactly one.

    Chosen by the step alone (``[3]`` enters an array, ``[...]`` a dict), not
    by the value: two members of one kind (two tagged structs) are not
    guessed between.
    """
    if not isinstance(node, msgspec.inspect.UnionType):
        return node
    fits: list[msgspec.inspect.Type]
    if index.isdigit():
        fits = [t for t in node.types if isinstance(t, _ARRAY_LIKE)
                or (isinstance(t, msgspec.inspect.StructType) and t.array_like)]
    elif index:
        fits = [t for t in node.types if isinstance(t, msgspec.inspect.DictType)]
    else:
        fits = [t for t in node.types
                if isinstance(t, msgspec.inspect.StructType) and not t.array_like]
    return fits[0] if len(fits) == 1 else None


def _struct_step(
    info: msgspec.inspect.StructType, index: str, attr: str
) -> tuple[str | None, object]:
    """(field name, field type) of a path step into a struct; (None, None) if none."""
    if attr:
        field = next((f for f in info.fields if f.encode_name == attr), None)
    elif index.isdigit():
        pos = int(index) - (1 if info.tag is not None else 0)
        if pos == -1:
            return "message type", None
        field = info.fields[pos] if pos < len(info.fields) else None
    else:
        field = None
    return (field.name, field.type) if field is not None else (None, None)


def _invalid(msg: object, exc: Exception) -> DecodeError:
    """The DecodeError :meth:`Codec.validate` raises for ``msg``. Never raises."""
    try:
        if isinstance(exc, EncodeError):
            reason = f"{exc.field}: {exc.reason}" if exc.field else exc.reason
        elif isinstance(exc, DecodeError):
            reason = exc.reason
        else:
            reason = str(exc) or type(exc).__name__
    except Exception:  # a str() that fails: still a DecodeError
        reason = type(exc).__name__
    try:
        rid = getattr(msg, "rid", None)
    except Exception:  # a property that raises: no address
        rid = None
    return DecodeError(reason, rid=rid if isinstance(rid, str) else None,
                       message_type=type(msg).__name__)


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


def _children(value: object, prefix: str) -> Iterator[tuple[str, object]]:
    """(dotted path, child) of each field / item / entry (key, then value) of ``value``."""
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            yield (f"{prefix}.{name}" if prefix else name), getattr(value, name)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield f"{prefix}[{i}]", item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{prefix}[{key!r}]", key
            yield f"{prefix}[{key!r}]", item


def _find_field(
    msg: object, match: Callable[[object], bool], prefix: str = "", depth: int = 0
) -> str:
    """Dotted path of the first field of ``msg`` whose value ``match``es, or ``""``."""
    if depth > 8:
        return ""
    for path, value in _children(msg, prefix):
        if match(value):
            return path
        found = _find_field(value, match, path, depth + 1)
        if found:
            return found
    return ""


def _unencodable(value: object) -> bool:
    """Whether msgpack cannot carry ``value``: an int past 64 bits or a non-UTF-8 str."""
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(1 << 63) <= value < (1 << 64)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
    return False
