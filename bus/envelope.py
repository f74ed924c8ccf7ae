"""What the receiver hands the scheduler: a message and where it came from."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Generic, NamedTuple, TypeVar, cast

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


class Envelope(NamedTuple, Generic[M]):
    """A decoded message and its origin.

    A named tuple: one is built per received message, and a frozen
    dataclass costs three times as much to build.
    """

    message: M
    origin: Origin


class Rejected(NamedTuple):
    """Frames that failed to decode: the error (with ``.rid`` when readable) and origin."""

    error: DecodeError
    origin: Origin


_new_envelope = cast(Callable[[tuple[Message, Origin]], "Envelope[Message] | Rejected"],
                     functools.partial(tuple.__new__, Envelope))


def envelopes(msgs: Iterable[M], origin: Origin) -> list[Envelope[M] | Rejected]:
    """One :class:`Envelope` per message, all from ``origin``: the burst path.

    Typed as an inbox's drain (envelopes or rejections), so that it is one.

    Built in C (``tuple.__new__`` over a zip), with no Python frame per
    message: ``Envelope(m, origin)`` runs the named tuple's Python
    ``__new__``, ~0.2 us a message, a tenth of a small request's whole
    receive (measured with ``benchmarks.bus``'s bursts).
    """
    return list(map(_new_envelope, zip(msgs, repeat(origin))))  # type: ignore[arg-type]
