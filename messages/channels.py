"""Which message types each channel carries: one declaration, every door built from it.

A scheduler has three zmq channels (``docs/PROTOCOL.md``, section 1); each
carries a fixed set of types, in each direction::

    channel   client -> scheduler (inbound)            scheduler -> client (outbound)
    work      generate, embedding, abort               (nothing: PUSH/PULL)
    rpc       RpcReqInput                              RpcReqOutput
    out       (nothing)                                BatchTokenIDOut, BatchEmbeddingOut, ErrorOut

A codec built by :meth:`Channel.inbound_codec` or :meth:`Channel.outbound_codec`
is that channel's door, on both ends: the sending end refuses to encode a
type the channel does not carry (:class:`~messages.EncodeError`, nothing
sent), and the receiving end refuses to decode one
(:class:`~messages.NotCarried`, answered by rid with
``ErrorOut(code="decode_error")``), so an rpc call on the work channel is
never executed with its reply lost, and a generate request on the rpc
channel never vanishes unanswered. The same sets are published in the
schema (``x-channels``) and in the protocol document, both tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from messages._failures import HOMES
from messages.base import Output, Request
from messages.catalogue import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    ErrorOut,
    KVHandoff,
    RpcReqInput,
    RpcReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from messages.codec import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_MESSAGE_BYTES,
    Codec,
)

__all__ = ["CHANNELS", "OUT", "RPC", "WORK", "Channel", "inbound_channel"]


@dataclass(frozen=True, slots=True)
class Channel:
    """A channel's name and the message types it carries, per direction.

    Attributes:
        name: the channel's name, as the endpoints and the document call it.
        inbound: what a scheduler receives on it (a client sends).
        outbound: what a scheduler sends on it (a client receives).
    """

    name: str
    inbound: tuple[type[Request], ...]
    outbound: tuple[type[Output], ...]

    def inbound_codec(self, *, inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
                      max_frames: int = DEFAULT_MAX_FRAMES,
                      max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                      move_to_cpu: bool = False) -> Codec[Request]:
        """The door for client -> scheduler traffic (both ends use the same one).

        Raises:
            ValueError: the channel carries nothing inbound.
        """
        if not self.inbound:
            raise ValueError(f"the {self.name!r} channel carries nothing to a scheduler")
        return Codec(Request, types=self.inbound, inline_threshold=inline_threshold,
                     max_frames=max_frames, max_message_bytes=max_message_bytes,
                     move_to_cpu=move_to_cpu, channel=self.name)

    def outbound_codec(self, *, inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
                       max_frames: int = DEFAULT_MAX_FRAMES,
                       max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                       move_to_cpu: bool = False) -> Codec[Output]:
        """The door for scheduler -> client traffic (both ends use the same one).

        Raises:
            ValueError: the channel carries nothing outbound.
        """
        if not self.outbound:
            raise ValueError(f"the {self.name!r} channel carries nothing from a scheduler")
        return Codec(Output, types=self.outbound, inline_threshold=inline_threshold,
                     max_frames=max_frames, max_message_bytes=max_message_bytes,
                     move_to_cpu=move_to_cpu, channel=self.name)

    def carried_tags(self) -> dict[str, list[str]]:
        """``{"inbound": [tags], "outbound": [tags]}``, sorted (the published form)."""
        return {"inbound": sorted(t.__name__ for t in self.inbound),
                "outbound": sorted(t.__name__ for t in self.outbound)}


#: Tokenized work in; nothing back on it (outputs leave on ``out``).
WORK: Final = Channel("work", (TokenizedGenerateReqInput, TokenizedEmbeddingReqInput, AbortReq,
                               KVHandoff), ())
#: Control calls in, their replies back to the peer that asked.
RPC: Final = Channel("rpc", (RpcReqInput,), (RpcReqOutput,))
#: Every answer to work, to the one consumer that binds it.
OUT: Final = Channel("out", (), (BatchTokenIDOut, BatchEmbeddingOut, ErrorOut, KVHandoff))
#: Every channel, in the document's order.
CHANNELS: Final = (WORK, RPC, OUT)


HOMES.update({t.__name__: ch.name for ch in CHANNELS for t in ch.inbound})


def inbound_channel(tag: str) -> str | None:
    """The channel that carries type ``tag`` to a scheduler, if any."""
    return HOMES.get(tag)
