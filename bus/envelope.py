"""What the receiver hands the scheduler: a message and where it came from."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Generic, NamedTuple, TypeVar

import msgspec

from messages import DecodeError, Message

__all__ = ["Envelope", "Origin", "Rejected"]

M = TypeVar("M", bound=Message, covariant=True)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a message came from, stamped by the receiving inbox (never read from the wire).

    Attributes:
        inbox: the name of the inbox that received it (``"work"``, ``"rpc"``, ...).
        identity: the zmq peer identity for a ROUTER inbox, else ``None``.
    """

    inbox: str
    identity: bytes | None = None


class Envelope(msgspec.Struct, Generic[M], frozen=True, gc=False):
    """A decoded message and its origin: ``Envelope(message, origin)``.

    A frozen ``msgspec`` struct that the cycle collector never tracks (a
    message and an origin cannot form a cycle): one is built per received
    message, and a named tuple cost three times as much to build and was
    scanned by every young-generation collection (measured with
    ``benchmarks.bus``'s bursts: most of the envelope's cost was the
    collections its allocations set off).
    """

    message: M
    origin: Origin


class Rejected(NamedTuple):
    """Frames that failed to decode: the error (with ``.rid`` when readable) and origin."""

    error: DecodeError
    origin: Origin


def envelopes(msgs: Iterable[M], origin: Origin) -> list[Envelope[M] | Rejected]:
    """One :class:`Envelope` per message, all from ``origin``: the burst path.

    Typed as an inbox's drain (envelopes or rejections), so that it is one.
    Built in C (``map`` over the struct's constructor), with no Python frame
    per message.
    """
    return list(map(Envelope, msgs, repeat(origin)))
