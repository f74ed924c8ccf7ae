"""Checkpoints without pickle: a msgpack index followed by the raw tensor bytes.

Layout: 8-byte little-endian length ``n``, ``n`` bytes of msgpack
``{name: [dtype, shape, offset, nbytes]}``, then the bytes. Saving writes a
temp file in the same directory and renames it, so a reader never sees a
half-written checkpoint. Loading reads regular files only, of a bounded
size: it runs on the scheduler loop, which a FIFO (blocks until a writer
comes) or ``/dev/zero`` (never ends) would stall.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
from pathlib import Path

import msgspec
import torch

__all__ = ["MAX_INDEX_BYTES", "load_state", "save_state"]

_MAX_INDEX = 1 << 24
#: Most bytes a checkpoint spends on anything but weights (length and index).
MAX_INDEX_BYTES = 8 + _MAX_INDEX
_CHUNK = 1 << 24  # read at most this much per syscall (a huge read() may be refused)


class _Entry(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


def save_state(state: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> int:
    """Write ``state`` atomically to ``path``; returns the bytes written.

    Only a new file or an existing regular file is replaced: the rename would
    otherwise swap a FIFO, a device node (``/dev/null`` for a server running
    as root) or a directory for a checkpoint.

    Raises:
        ValueError: ``path`` is empty, or names something other than a
            regular file.
        OSError: the directory cannot be written.
    """
    if not os.fspath(path):
        raise ValueError("save_checkpoint needs a file path, got an empty one")
    target = Path(path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        pass
    else:
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise ValueError(f"{target}: exists and is {_kind(st.st_mode)}, not a regular "
                             "file: refusing to replace it")
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


def load_state(path: str | os.PathLike[str], *,
               max_bytes: int = 1 << 32) -> dict[str, torch.Tensor]:
    """Read a checkpoint written by :func:`save_state`.

    Only a regular file of at most ``max_bytes`` is read; anything else is
    refused at once rather than read (see the module docstring).

    Raises:
        ValueError: ``path`` is not a regular file (a FIFO, a device, a
            directory), is larger than ``max_bytes``, changed size while being
            read, or is not a well-formed checkpoint.
        OSError: ``path`` cannot be opened or read (missing, no permission).
    """
    data = _read_regular(path, max_bytes)
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
        if (e.offset < 0 or e.offset + e.nbytes > len(body) or
                math.prod(e.shape) * dtype.itemsize != e.nbytes):
            raise ValueError(f"{path}: entry {name!r} does not match its bytes")
        raw = bytearray(body[e.offset : e.offset + e.nbytes])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dtype).reshape(e.shape)
    return out


def _read_regular(path: str | os.PathLike[str], max_bytes: int) -> bytearray:
    """Return the bytes of the regular file ``path``, refusing anything else.

    Raises:
        ValueError: not a regular file, over ``max_bytes``, or its size changed.
        OSError: it cannot be opened or read.
    """
    # O_NONBLOCK: opening a FIFO for reading otherwise blocks until a writer
    # appears; the fstat below then refuses it. It does not affect reads of
    # a regular file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)  # of what was opened: no race with a swapped path
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file (it is {_kind(st.st_mode)}); "
                             "refusing to read it as a checkpoint")
        size = st.st_size
        if size > max_bytes:
            raise ValueError(f"{path}: {size} bytes, more than max_bytes={max_bytes}")
        buf = bytearray(size + 1)  # one spare byte shows a file that grew
        view = memoryview(buf)
        got = 0
        while got < size + 1:
            n = os.readv(fd, [view[got : got + _CHUNK]])
            if n == 0:
                break
            got += n
        view.release()
    finally:
        os.close(fd)
    if got != size:
        raise ValueError(f"{path}: changed size while being read (expected {size} bytes, "
                         f"read {'more' if got > size else got})")
    del buf[size:]  # the spare byte; no copy of the (possibly huge) rest
    return buf


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"of mode {stat.filemode(mode)}"
