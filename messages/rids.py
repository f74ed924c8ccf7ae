"""``RidColumn``: the request ids of a batched output, packed into one string.

A batch of 64 outputs used to carry its rids as a msgpack array of 64
strings, and decoding built 64 ``str`` objects before anyone asked for one:
that was most of a ``BatchTokenIDOut`` decode. A column travels as *one*
msgpack ``str`` instead::

    SEP rid_0 SEP rid_1 ... SEP rid_{n-1}

Its first character is the separator, and each rid follows one separator;
the empty string is the empty column. The encoder uses ``"\\x00"``
unless some rid contains it, and then the first character no rid holds (so
any rid can travel). msgspec reads the string in C; the column splits it
into ``str`` objects the first time one is read (one ``str.split``, in C),
so a decode that nobody reads the rids of costs no per-rid object, and one
that reads them all costs about what building the list did.

Checked at decode, in C: the count, which
:class:`~messages.BatchTokenIDOut` checks against its other columns (so
``len`` and ``zip(..., strict=True)`` hold without a split), and the whole
column's size (``257 * len`` characters at most). Each rid's own bounds (1
to 256 characters) are checked where a column is built from a list, on the
sending side, and where a rid is born (a request's ``rid`` is a
:data:`~messages.Rid`). A received rid outside them is not refused: it
names no request, so no reader can act on it; checking it on receipt would
cost a scan per batch that only a broken sender could fail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Final, overload

__all__ = ["MAX_RID", "RidColumn"]

#: Longest rid, in characters (the bound of :data:`~messages.Rid`).
MAX_RID: Final = 256
_SEP: Final = "\x00"


def _free_separator(rids: Sequence[str]) -> str:
    """The first character (not a surrogate) that no rid holds: the rare path."""
    used = set().union(*map(set, rids))
    for cp in range(0x110000):
        if not 0xD800 <= cp <= 0xDFFF and chr(cp) not in used:
            return chr(cp)
    raise ValueError("rids use every character: no separator is left")  # pragma: no cover


class RidColumn(Sequence[str]):
    """An immutable sequence of request ids, stored as one separated string.

    Reads like a ``list[str]`` (``len``, index, slice, iterate, ``in``,
    ``==`` against a list or another column); the ``str`` objects are made
    on the first read and kept. Build one with ``RidColumn(rids)``; a
    decoder builds one with :meth:`from_wire`.

    Raises:
        ValueError: (constructor) a rid is not a ``str``, is empty, or is
            longer than :data:`MAX_RID` characters.
    """

    __slots__ = ("_len", "_parts", "_wire")

    def __init__(self, rids: Iterable[str] = (), /) -> None:
        parts = list(rids)
        for i, rid in enumerate(parts):
            if type(rid) is not str:
                raise ValueError(f"rids[{i}] must be a str, got {type(rid).__name__}")
            if not 0 < len(rid) <= MAX_RID:
                raise ValueError(f"rids[{i}] has {len(rid)} characters; a rid has 1 to "
                                 f"{MAX_RID}")
        n = len(parts)
        wire = _SEP + _SEP.join(parts) if n else ""
        if wire.count(_SEP) != n:  # a rid holds the usual separator: pick another
            sep = _free_separator(parts)
            wire = sep + sep.join(parts)
        self._wire = wire
        self._len = n
        self._parts: list[str] | None = parts

    @classmethod
    def from_wire(cls, wire: str, /) -> RidColumn:
        """The column a received string holds (see the module docstring).

        Raises:
            ValueError: the string is longer than ``257 * len`` characters.
        """
        if not wire:
            return _EMPTY
        n = wire.count(wire[0])
        if len(wire) > (MAX_RID + 1) * n:
            raise ValueError(f"{len(wire)} characters for {n} rids: some rid is longer "
                             f"than {MAX_RID}")
        self = cls.__new__(cls)
        self._wire = wire
        self._len = n
        self._parts = None
        return self

    @property
    def wire(self) -> str:
        """The column as it travels: the separator, then each rid after one."""
        return self._wire

    def _list(self) -> list[str]:
        parts = self._parts
        if parts is None:
            parts = self._parts = self._wire.split(self._wire[0])
            del parts[0]  # what precedes the first separator: always ""
        return parts

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._list()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __contains__(self, rid: object) -> bool:
        return rid in self._list()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RidColumn):
            return self._len == other._len and self._list() == other._list()
        if isinstance(other, list | tuple):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def tolist(self) -> list[str]:
        """The rids as a new ``list[str]``."""
        return list(self._list())

    def __repr__(self) -> str:
        return f"RidColumn({self._list()!r})"


_EMPTY: Final = RidColumn()
