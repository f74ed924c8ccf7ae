"""Checkpoints without pickle: a msgpack index followed by the raw tensor bytes.

Layout: 8-byte little-endian length ``n``, ``n`` bytes of msgpack
``{name: [dtype, shape, offset, nbytes]}``, then the bytes. Saving writes a
temp file in the same directory and renames it, so a reader never sees a
half-written checkpoint.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import msgspec
import torch

__all__ = ["load_state", "save_state"]

_MAX_INDEX = 1 << 24


class _Entry(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


def save_state(state: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> int:
    """Write ``state`` atomically to ``path``; returns the bytes written."""
    target = Path(path)
    index: dict[str, _Entry] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, t in state.items():
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        index[name] = _Entry(str(t.dtype).removeprefix("torch."), list(t.shape), offset,
                             len(raw))
        blobs.append(raw)
        offset += len(raw)
    head = msgspec.msgpack.encode(index)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for raw in blobs:
                f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return 8 + len(head) + offset


def load_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a checkpoint written by :func:`save_state`.

    Raises:
        ValueError: the file is not a well-formed checkpoint.
    """
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 or n > min(_MAX_INDEX, len(data) - 8):
        raise ValueError(f"{path}: not a checkpoint (bad index length)")
    try:
        index = msgspec.msgpack.decode(data[8 : 8 + n], type=dict[str, _Entry])
    except msgspec.MsgspecError as exc:
        raise ValueError(f"{path}: not a checkpoint ({exc})") from exc
    body = memoryview(data)[8 + n :]
    out: dict[str, torch.Tensor] = {}
    for name, e in index.items():
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype) or any(d < 0 for d in e.shape):
            raise ValueError(f"{path}: bad entry {name!r}")
        if e.offset < 0 or e.offset + e.nbytes > len(body) or \
                math.prod(e.shape) * dtype.itemsize != e.nbytes:
            raise ValueError(f"{path}: entry {name!r} does not match its bytes")
        raw = bytearray(body[e.offset : e.offset + e.nbytes])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(e.shape)
    return out
