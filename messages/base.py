"""Base classes of every message, and the constrained field types they share."""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "ABSTRACT_MESSAGE_TYPES",
    "MAX_BATCH",
    "MAX_TOKENS",
    "Message",
    "Output",
    "Request",
    "Rid",
    "Scalar",
    "TokenIds",
    "token_ids",
]

#: Longest token-id sequence a message may carry (prompt, stop ids, batch).
MAX_TOKENS: Final = 1 << 20
#: Most requests one batched output may describe.
MAX_BATCH: Final = 1 << 16

#: A request id: non-empty, bounded.
Rid = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
#: A plain scalar, as rpc parameters and results carry.
Scalar = None | bool | int | float | Annotated[str, msgspec.Meta(max_length=1 << 16)]
#: A packed 1-D array of token ids. uint32 makes "ids are >= 0" a property of
#: the type: checking it costs nothing at decode, unlike a scan for negatives.
TokenIds = npt.NDArray[np.uint32]
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


class Request(Message):
    """Base of everything a scheduler receives. ``rid`` names the request."""

    rid: Rid


class Output(Message):
    """Base of everything a scheduler sends back."""


#: The marker bases; a codec built from a base decodes its *other* subclasses.
ABSTRACT_MESSAGE_TYPES: Final[frozenset[type[Message]]] = frozenset({Message, Request, Output})


def token_ids(values: npt.ArrayLike, *, field: str = "token_ids") -> TokenIds:
    """Return ``values`` as a 1-D uint32 array of token ids, validating it.

    Accepts a list, tuple, numpy array or anything ``numpy.asarray`` takes
    (a CPU torch tensor included). A uint32 1-D array passes through
    unchanged (no copy, no scan): this is the decode path.

    Raises:
        ValueError: not 1-D, not integers, a negative id, an id past uint32,
            or longer than :data:`MAX_TOKENS`.
    """
    arr = values if type(values) is np.ndarray else np.asarray(values)
    if arr.dtype is not _U32 and arr.dtype != _U32:
        if arr.size == 0 and arr.ndim == 1:
            return np.empty(0, _U32)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{field} must hold integers, got dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0:
                raise ValueError(f"{field} holds a negative id: {lo}")
            if hi > _ID_MAX:
                raise ValueError(f"{field} holds an id past uint32: {hi}")
        arr = arr.astype(_U32)
    if arr.ndim != 1:
        raise ValueError(f"{field} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.shape[0] > MAX_TOKENS:
        raise ValueError(f"{field} holds {arr.shape[0]} ids, more than {MAX_TOKENS}")
    return arr
