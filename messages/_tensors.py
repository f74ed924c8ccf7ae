"""Packing numpy arrays and torch tensors into msgpack extensions.

Wire layout of one array (an msgpack ext; the codes are part of the wire
format, pinned by the golden-bytes test):

* ext code ``1`` numpy inline, ``2`` numpy out-of-band,
  ``3`` torch inline, ``4`` torch out-of-band;
* payload: ``dtype`` (u8, :data:`DTYPE_CODES`), ``ndim`` (u8), ``ndim`` dims
  (little-endian i64), then the raw bytes (inline) or the index of the frame
  holding them (u32, out-of-band).

The bytes are the array's C-contiguous little-endian element bytes.

A small 1-D numpy array takes a shorter path, a plain msgpack ``bin``: its
element bytes followed by one dtype-code byte (trailing, so the elements
stay aligned in the received buffer). msgspec reads a ``bin`` in C, so this
costs one Python call per array instead of two: token ids are on every
request.
"""

from __future__ import annotations

import math
import struct
import sys
import typing
import warnings
from typing import Final

import numpy as np
import torch

__all__ = [
    "BadArray",
    "DTYPE_CODES",
    "EXT_NUMPY_INLINE",
    "EXT_NUMPY_OOB",
    "EXT_TORCH_INLINE",
    "EXT_TORCH_OOB",
    "MAX_NDIM",
    "TensorFormatError",
    "array_field",
    "parse_header",
]

EXT_NUMPY_INLINE: Final = 1
EXT_NUMPY_OOB: Final = 2
EXT_TORCH_INLINE: Final = 3
EXT_TORCH_OOB: Final = 4
MAX_NDIM: Final = 32

# Stable wire codes. Append only: a code never changes meaning.
_DTYPE_NAMES: Final = (
    (1, "bool"), (2, "uint8"), (3, "int8"), (4, "int16"), (5, "int32"), (6, "int64"),
    (7, "uint16"), (8, "uint32"), (9, "uint64"), (10, "float16"), (11, "bfloat16"),
    (12, "float32"), (13, "float64"), (14, "complex32"), (15, "complex64"),
    (16, "complex128"), (17, "float8_e4m3fn"), (18, "float8_e5m2"),
    (19, "float8_e4m3fnuz"), (20, "float8_e5m2fnuz"), (21, "float8_e8m0fnu"),
)

#: torch dtype -> wire code, for every dtype this torch build has.
DTYPE_CODES: Final[dict[torch.dtype, int]] = {
    getattr(torch, name): code for code, name in _DTYPE_NAMES if hasattr(torch, name)
}
_TORCH_BY_CODE: Final[dict[int, torch.dtype]] = {c: d for d, c in DTYPE_CODES.items()}
if sys.byteorder != "little":  # the wire is little-endian and views are zero-copy
    raise ImportError("messages supports little-endian hosts only")
_NUMPY_CODES: Final[dict[np.dtype[np.generic], int]] = {}
for _code, _name in _DTYPE_NAMES:
    if _name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128"):
        _NUMPY_CODES[np.dtype(_name)] = _code
_NUMPY_BY_CODE: Final[dict[int, np.dtype[np.generic]]] = {c: d for d, c in _NUMPY_CODES.items()}
_TRAILERS: Final[dict[int, bytes]] = {c: bytes([c]) for c in _NUMPY_BY_CODE}
_ITEMSIZE: Final[dict[int, int]] = {c: d.itemsize for d, c in DTYPE_CODES.items()}

# Decoding out-of-band tensors wraps read-only frames on purpose (documented in
# Codec); torch warns about that once per process. Silence only that warning,
# only when raised from this module.
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning, module=__name__)

_HEAD = struct.Struct("<BB")
_SHAPES: Final = [struct.Struct(f"<{n}q") for n in range(MAX_NDIM + 1)]
_INDEX = struct.Struct("<I")
_HEAD1 = struct.Struct("<BBq")  # the common 1-D case in one unpack


class TensorFormatError(ValueError):
    """An array could not be packed or unpacked; the codec adds the field."""


def _header(code: int, shape: tuple[int, ...]) -> bytes:
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise TensorFormatError(f"{ndim} dimensions, more than {MAX_NDIM}")
    return _HEAD.pack(code, ndim) + _SHAPES[ndim].pack(*shape)


def numpy_parts(arr: np.ndarray) -> tuple[bytes, memoryview]:
    """Return (header, contiguous little-endian element bytes) of ``arr``."""
    code = _NUMPY_CODES.get(arr.dtype)
    if code is None:
        if arr.dtype.byteorder == ">" and arr.dtype.newbyteorder("<") in _NUMPY_CODES:
            arr = arr.astype(arr.dtype.newbyteorder("<"))
            code = _NUMPY_CODES[arr.dtype]
        else:
            raise TensorFormatError(f"unsupported numpy dtype {arr.dtype}")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return _header(code, arr.shape), arr.data.cast("B")


def torch_parts(t: torch.Tensor, *, move_to_cpu: bool) -> tuple[bytes, memoryview]:
    """Return (header, contiguous element bytes) of ``t``."""
    if not t.is_cpu:
        if not move_to_cpu:
            raise TensorFormatError(
                f"tensor is on {t.device}; move it to the CPU first or build the "
                "codec with move_to_cpu=True"
            )
        t = t.detach().to("cpu")
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TensorFormatError(f"unsupported torch dtype {t.dtype}")
    if t.layout is not torch.strided:
        raise TensorFormatError(f"unsupported tensor layout {t.layout}")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    # As uint8 bytes: the one view every dtype has (bfloat16 and float8 have no numpy type).
    return _header(code, tuple(t.shape)), t.reshape(-1).view(torch.uint8).numpy().data


def parse_header(data: memoryview) -> tuple[int, tuple[int, ...], int, int]:
    """Return (dtype code, shape, byte size, offset of what follows the header).

    Raises:
        TensorFormatError: truncated header, unknown dtype, too many or
            negative dimensions.
    """
    if len(data) >= 10 and data[1] == 1:
        code, _, dim = _HEAD1.unpack_from(data)
        itemsize = _ITEMSIZE.get(code)
        if itemsize is None:
            raise TensorFormatError(f"unknown dtype code {code}")
        if dim < 0:
            raise TensorFormatError(f"negative dimension in shape ({dim},)")
        return code, (dim,), dim * itemsize, 10
    if len(data) < 2:
        raise TensorFormatError("truncated tensor header")
    code, ndim = _HEAD.unpack_from(data)
    itemsize = _ITEMSIZE.get(code)
    if itemsize is None:
        raise TensorFormatError(f"unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise TensorFormatError(f"{ndim} dimensions, more than {MAX_NDIM}")
    end = 2 + 8 * ndim
    if len(data) < end:
        raise TensorFormatError("truncated tensor shape")
    shape: tuple[int, ...] = _SHAPES[ndim].unpack_from(data, 2)
    if ndim and min(shape) < 0:
        raise TensorFormatError(f"negative dimension in shape {shape}")
    return code, shape, math.prod(shape) * itemsize, end


def frame_index(data: memoryview, offset: int) -> int:
    """Read the out-of-band frame index that follows a header."""
    if len(data) != offset + 4:
        raise TensorFormatError("malformed out-of-band tensor reference")
    index: int = _INDEX.unpack_from(data, offset)[0]
    return index


def pack_index(index: int) -> bytes:
    return _INDEX.pack(index)


def compact_numpy(arr: np.ndarray) -> bytes | None:
    """The compact ``bin`` form of a 1-D array, or ``None`` if it has none."""
    code = _NUMPY_CODES.get(arr.dtype)
    if code is None or arr.ndim != 1:
        return None
    return arr.tobytes() + _TRAILERS[code]


def from_compact(data: bytes, expected: np.dtype[np.generic] | None) -> np.ndarray:
    """Rebuild a 1-D array from its compact form (read-only view, no copy).

    Raises:
        TensorFormatError: empty, unknown dtype, not the field's dtype, or a
            length that is not a whole number of elements.
    """
    if not data:
        raise TensorFormatError("empty compact array")
    dtype = _NUMPY_BY_CODE.get(data[-1])
    if dtype is None:
        raise TensorFormatError(f"unknown numpy dtype code {data[-1]}")
    if expected is not None and dtype is not expected and dtype != expected:
        raise TensorFormatError(f"expected dtype {expected}, got {dtype}")
    n, rem = divmod(len(data) - 1, dtype.itemsize)
    if rem:
        raise TensorFormatError(f"{len(data) - 1} bytes is not a whole number of {dtype}")
    return np.frombuffer(data, dtype=dtype, count=n)


def to_numpy(
    code: int, shape: tuple[int, ...], buf: memoryview, offset: int
) -> np.ndarray:
    """A read-only numpy view of ``shape`` over ``buf[offset:]`` (length already checked)."""
    dtype = _NUMPY_BY_CODE.get(code)
    if dtype is None:
        raise TensorFormatError(f"dtype code {code} has no numpy equivalent")
    arr = np.frombuffer(buf, dtype=dtype, offset=offset)
    if arr.flags.writeable:
        arr.flags.writeable = False  # a view of a received frame, never to be written
    return arr if len(shape) == 1 else arr.reshape(shape)


def to_torch(
    code: int, shape: tuple[int, ...], buf: memoryview, offset: int, *, copy: bool
) -> torch.Tensor:
    """A torch tensor of ``shape`` over ``buf[offset:]`` (length already checked).

    ``copy=True`` gives an owned, aligned, writable tensor; otherwise a view.
    """
    dtype = _TORCH_BY_CODE[code]
    if len(buf) == offset:
        return torch.empty(shape, dtype=dtype)
    if copy:
        flat = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, offset=offset).copy())
        return flat.view(dtype).reshape(shape)
    return torch.frombuffer(buf, dtype=dtype, offset=offset).reshape(shape)


class BadArray:
    """Returned by the codec's ext hook for a bad array, so msgspec reports its path.

    The ext hook cannot raise usefully (msgspec would lose the path); the
    dec hook that follows raises ``reason`` with the path attached.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def array_field(tp: object) -> tuple[type, np.dtype[np.generic] | None]:
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
