"""Base classes of every message, and the constrained field types they share."""

from __future__ import annotations

import array
from collections.abc import Iterable
from typing import Annotated, Any, Final

import msgspec
import numpy as np

__all__ = [
    "ABSTRACT_MESSAGE_TYPES",
    "MAX_BATCH",
    "MAX_TEXT",
    "MAX_TOKENS",
    "Message",
    "Output",
    "PackingMeta",
    "Request",
    "Rid",
    "Scalar",
    "PackedU32",
    "TokenIds",
    "fit_text",
    "packed_u32",
    "token_ids",
    "unpack_received",
]

#: Longest token-id sequence a message may carry (prompt, stop ids, batch).
MAX_TOKENS: Final = 1 << 20
#: Most requests one batched output may describe.
MAX_BATCH: Final = 1 << 16
#: Longest free text (an error or rpc message) a message may carry, in characters.
MAX_TEXT: Final = 1 << 16

#: A request id: non-empty, bounded.
Rid = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
#: A plain scalar, as rpc parameters and results carry.
Scalar = None | bool | int | float | Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
#: A packed 1-D array of unsigned 32-bit integers: a ``memoryview`` of
#: format ``"I"``. msgspec encodes and decodes it natively (a msgpack ``bin``,
#: no Python call either way), and a decoded one is a read-only view of the
#: received frame (no copy). ``np.asarray(ids)`` or ``ids.tolist()`` read it.
#: At most :data:`MAX_TOKENS` values: the decoder refuses more, in C.
PackedU32 = Annotated[memoryview, msgspec.Meta(max_length=4 * MAX_TOKENS)]
#: Token ids, packed. Unsigned, so "ids are >= 0" is a property of the type,
#: free at decode, unlike a scan for negatives.
TokenIds = PackedU32
_U32: Final = np.dtype(np.uint32)
_ID_MAX: Final = (1 << 32) - 1


class Message(msgspec.Struct, tag=True, kw_only=True, array_like=True, gc=False):
    """Base of every request and output.

    Messages are tagged (the class name travels on the wire, so one decoder
    serves a union), keyword-only, and encoded as arrays (no field names on
    the wire). Concrete messages live in :mod:`messages.catalogue`.

    ``gc=False``: a message holds scalars, strings, arrays and flat
    containers of them, so it cannot be part of a reference cycle; leaving it
    untracked spares the cycle collector a scan per received message
    (measured: ~5% off the PULL drain of small requests).
    """


class PackingMeta(msgspec.StructMeta):
    """Metaclass of messages whose packed fields are checked where they are made.

    msgspec runs ``__post_init__`` after every decode as well as after every
    construction: for a request, a call from C into Python per message
    received (cachegrind, a burst of 256-id requests: 8,080 instructions a
    request with the old ``__post_init__``, 6,498 with this metaclass,
    5,085 with no hook). A type with this metaclass splits that work:

    * ``_pack()`` runs after the type is *called*: it checks and packs what
      the caller passed (a list, an array, any view), as :func:`packed_u32`
      does, raising ``ValueError`` naming the field.
    * ``_unpack()`` runs after a *decode*, called by :class:`~messages.Codec`
      through :func:`unpack_received` (over a burst in one loop): msgspec
      has already checked every field and bounded every byte view, so it
      only casts those views to uint32, raising ``ValueError`` naming the
      field for one that is not whole uint32 values.

    Decoding such a type with ``msgspec`` directly, not through a ``Codec``,
    leaves its packed fields as byte views until ``_unpack()`` is called.
    ``msgspec.structs.replace`` and attribute assignment run neither hook:
    give them packed values (:func:`token_ids`), as msgspec encodes any
    memoryview as its raw bytes. A subclass has no ``__post_init__`` to
    extend: override ``_pack`` / ``_unpack`` and call ``super()``'s.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        msg = super().__call__(*args, **kwargs)
        msg._pack()
        return msg

    @staticmethod
    def types_in(types: Iterable[type]) -> frozenset[type]:
        """Those of ``types`` whose decoded messages need :func:`unpack_received`."""
        return frozenset(t for t in types if isinstance(t, PackingMeta))


def unpack_received(got: object, unpacking: frozenset[type]) -> None:
    """Finish what a decoder returned (a message, or a burst's list of them):
    ``_unpack()`` each message whose type is in ``unpacking``
    (:meth:`PackingMeta.types_in`). Raises what ``_unpack`` raises."""
    if type(got) is list:
        for msg in got:
            if type(msg) in unpacking:
                msg._unpack()
    elif type(got) in unpacking:
        got._unpack()  # type: ignore[attr-defined]


class Request(Message):
    """Base of everything a scheduler receives. ``rid`` names the request."""

    rid: Rid


class Output(Message):
    """Base of everything a scheduler sends back."""


#: The marker bases; a codec built from a base decodes its *other* subclasses.
ABSTRACT_MESSAGE_TYPES: Final[frozenset[type[Message]]] = frozenset({Message, Request, Output})


def fit_text(text: str, limit: int = MAX_TEXT) -> str:
    """Return ``text`` so that it can always cross the wire as a ``max_length=limit`` string.

    Text that fits is returned unchanged. Longer text is cut and ends with a
    marker saying how long it was (``" ... [truncated, 70001 chars in all]"``),
    the whole staying within ``limit`` characters: msgspec's ``max_length``
    counts code points, and so does ``len``. Lone surrogates (UTF-8 cannot
    encode them, so msgspec refuses the whole message) are written as
    backslash escapes first. Use it for every message that embeds user input
    or exception text, so a long path cannot make a reply undecodable.

    Raises:
        ValueError: ``limit`` is negative.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    total = len(text)
    if not text.isascii():  # ASCII always encodes: spare the common case the encode
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    marker = f" ... [truncated, {total} chars in all]"
    if len(marker) >= limit:  # no room for any of the text: the marker's start says most
        return marker[:limit]
    return text[: limit - len(marker)] + marker


def packed_u32(values: object, *, field: str = "values") -> PackedU32:
    """Return ``values`` as a 1-D uint32 memoryview (format ``"I"``), validating it.

    Accepts a list, tuple, range, numpy array, CPU torch tensor, or a
    memoryview. A byte view whose length is a multiple of 4 is read as
    uint32: that is what the decoder hands over, so it is checked first and
    costs a cast. A uint32 memoryview passes through unchanged.

    Raises:
        ValueError: not 1-D, not integers, a negative value, one past uint32,
            or longer than :data:`MAX_TOKENS`.
    """
    if type(values) is memoryview:
        mv = values
        if mv.format == "B" and mv.ndim == 1:  # the decode path: bytes of uint32s
            mv = cast_u32(mv, field)
        elif mv.format != "I" or mv.ndim != 1:
            mv = _from_array(np.asarray(mv), field)
    elif type(values) in (list, tuple, range):
        mv = _from_sequence(values, field)  # type: ignore[arg-type]
    else:
        mv = _from_array(values if type(values) is np.ndarray else np.asarray(values), field)
    if len(mv) > MAX_TOKENS:
        raise ValueError(f"{field} holds {len(mv)} values, more than {MAX_TOKENS}")
    return mv


def cast_u32(view: memoryview, field: str) -> memoryview:
    """A 1-D byte view read as uint32 values, or ValueError naming ``field`` when its
    length is not whole uint32 values (what a received packed field needs)."""
    if view.nbytes & 3:
        raise ValueError(f"{field}: {view.nbytes} bytes is not a whole number of uint32 values")
    return view.cast("I")


def _from_sequence(values: list[int] | tuple[int, ...] | range, field: str) -> memoryview:
    # array("I") packs in C and refuses what uint32 cannot hold.
    try:
        return memoryview(array.array("I", values))
    except OverflowError as exc:
        raise ValueError(f"{field} holds a value outside uint32, negative or past "
                         f"{_ID_MAX} ({exc})") from None
    except TypeError as exc:
        raise ValueError(f"{field} must hold integers ({exc})") from None


def token_ids(values: object, *, field: str = "token_ids") -> TokenIds:
    """Return ``values`` as packed token ids (see :func:`packed_u32`)."""
    return packed_u32(values, field=field)


def _from_array(arr: np.ndarray, field: str) -> memoryview:
    if arr.ndim != 1:
        raise ValueError(f"{field} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype != _U32:
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"{field} must hold integers, got dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0:
                raise ValueError(f"{field} holds a negative value: {lo}")
            if hi > _ID_MAX:
                raise ValueError(f"{field} holds a value past uint32: {hi}")
        arr = arr.astype(_U32)
    return np.ascontiguousarray(arr).data.cast("B").cast("I")


if array.array("I").itemsize != 4:  # pragma: no cover - every platform we run on
    raise ImportError("messages needs a 4-byte C unsigned int")
