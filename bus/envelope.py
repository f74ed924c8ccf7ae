"""What the receiver hands the scheduler: a message and where it came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

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
