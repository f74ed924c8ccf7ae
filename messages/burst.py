"""Bursts: several messages in one zmq message, encoded and decoded in one msgspec call.

Per-message Python work (a send, a receive, a decoder call) is what limits
small-message throughput, not bytes; a burst pays it once for many. On the
wire a burst is one more tagged array (see ``docs/PROTOCOL.md``)::

    ["Burst", [<message>, <message>, ...]]

frame 0 holding every member; a member's large arrays are out-of-band frames
numbered across the whole burst, in order, exactly as within one message.
A peer that never sends bursts needs nothing new; one that receives must
accept both shapes (the tag tells them apart).

A burst that fails to decode is split (:func:`split`): each member decodes
alone, so a malformed member rejects only itself, and a member whose rid
can be read is answered by it. Members of a burst with tensor frames cannot
be decoded apart (the frame numbering is the burst's), so there a failure
rejects every member, each answered by its rid where readable.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

__all__ = ["BURST_TAG", "MAX_BURST", "SEND_BURST", "burst_type", "is_burst", "split"]

#: The tag of a burst on the wire.
BURST_TAG: Final = "Burst"
#: Most messages in one burst (a receiver refuses more).
MAX_BURST: Final = 1024
#: Messages a sender puts in one burst: large enough to amortize the
#: per-message work, small enough that the receiver decodes one burst while
#: the next is encoded (measured: ``BENCH_BURST`` in ``python -m benchmarks.bus``).
SEND_BURST: Final = 256
#: The first bytes of every burst's frame 0: a 2-array, then the tag "Burst".
_PREFIX: Final = b"\x92\xa5Burst"

#: A frame as the codec takes it.
Frame = bytes | bytearray | memoryview


def burst_type(union: object) -> type[msgspec.Struct]:
    """The burst struct whose members are ``union`` (one per codec)."""
    return msgspec.defstruct(
        BURST_TAG, [("items", Annotated[list[union], msgspec.Meta(min_length=1,  # type: ignore[valid-type]
                                                                  max_length=MAX_BURST)])],
        tag=BURST_TAG, array_like=True, gc=False)


#: Most members the cold path splits a failed burst into, to answer each by
#: rid (a burst past MAX_BURST is refused, but its members are still told).
_MAX_SPLIT: Final = 1 << 16

_Raw = msgspec.defstruct(
    BURST_TAG, [("items", Annotated[list[msgspec.Raw], msgspec.Meta(max_length=_MAX_SPLIT)])],
    tag=BURST_TAG, array_like=True)
_RAW = msgspec.msgpack.Decoder(_Raw)


def is_burst(head: Frame) -> bool:
    """Whether frame 0 ``head`` holds a burst (its first bytes say so)."""
    return bytes(memoryview(head)[:len(_PREFIX)]) == _PREFIX


def split(head: Frame) -> list[msgspec.Raw]:
    """Each member of a burst's frame 0, undecoded.

    Raises:
        msgspec.DecodeError / ValidationError: not even the burst's outline reads.
    """
    return list(_RAW.decode(head).items)  # type: ignore[attr-defined]
