"""The library's error tree.

Every error the four packages raise derives from :class:`BusError`, so a
serving engine can catch the library's failures in one place::

    BusError
    ├── CodecError                 a message could not cross the wire
    │   ├── EncodeError            .message_type, .field, .reason
    │   └── DecodeError            .reason, .rid (when readable), .message_type
    │       └── NotCarried         .channel, .carried: a type that channel does not carry
    ├── ProtocolMismatch           .peer, .differences: the peers' layouts break
    ├── ChannelError               (bus)      .channel
    │   ├── WouldBlock             a _nowait call found the channel full/empty
    │   ├── ChannelClosed          *you* closed this end
    │   ├── PeerGone               the other end is gone (broken)
    │   ├── EndOfChannel           clean end of stream: not a failure
    │   └── RpcTimeout             .method, .timeout: no reply in time
    ├── RoutingError               (router)   .output_type
    │   ├── NoSinkError            no registered sink covers a type
    │   ├── AmbiguousRouteError    two unrelated registered bases tie
    │   └── RouterFrozenError      registration after routing started
    └── EngineError                (scheduler) .rid / the scheduler died

Each error builds its message in ``__init__`` from its attributes, so the
text always names the channel, type or request id it concerns.
"""

from __future__ import annotations

__all__ = [
    "BusError", "CodecError", "DecodeError", "EncodeError", "NotCarried", "ProtocolMismatch",
]


class BusError(Exception):
    """Root of every error raised by ``bus``, ``messages``, ``router`` and ``scheduler``."""


class CodecError(BusError):
    """A message could not be turned into frames, or frames into a message."""


class EncodeError(CodecError):
    """A message could not be encoded.

    Differs from :class:`DecodeError` in that it is raised on the *sending*
    side, before anything reaches a socket: nothing was sent.

    Attributes:
        message_type: name of the message class being encoded.
        field: dotted path of the offending field, or ``""`` if unknown.
        reason: what is wrong.
    """

    def __init__(self, message_type: str, field: str, reason: str) -> None:
        self.message_type = message_type
        self.field = field
        self.reason = reason
        where = f".{field}" if field else ""
        super().__init__(f"cannot encode {message_type}{where}: {reason}")


class DecodeError(CodecError):
    """Received frames are not a valid message.

    Raised for anything the wire can throw at a decoder: random bytes,
    truncated or missing frames, an unknown tag, a field that breaks its
    constraint, a tensor whose shape or dtype lies about its buffer.

    Attributes:
        reason: what is wrong, naming the offending field (``sampling.top_p``)
            rather than a raw position.
        rid: the request id, when the bytes held a readable one, so the
            receiver can answer the caller; ``None`` otherwise.
        message_type: the tag read from the wire, or ``None``.
    """

    def __init__(
        self, reason: str, *, rid: str | None = None, message_type: str | None = None
    ) -> None:
        self.reason = reason
        self.rid = rid
        self.message_type = message_type
        parts = [f"cannot decode {message_type or 'message'}"]
        if rid is not None:
            parts.append(f"(rid={rid!r})")
        super().__init__(" ".join(parts) + f": {reason}")


class NotCarried(DecodeError):
    """A message of a type the channel does not carry, refused at the channel's door.

    Differs from its parent in that the message itself may be valid: it was
    sent on the wrong channel (an ``RpcReqInput`` on the work channel, a
    generate request on the rpc channel). It is answered like any undecodable
    request, by rid where readable, with ``ErrorOut(code="decode_error")``,
    never executed: the reply that a right-channel message would get (an rpc
    reply) has no way back to the sender on this channel.

    Attributes:
        channel: the channel that refused it (``"work"``, ``"rpc"``, ...).
        carried: the tags that channel carries, sorted.
        reason, rid, message_type: as :class:`DecodeError`.
    """

    def __init__(self, reason: str, *, channel: str, carried: tuple[str, ...],
                 rid: str | None = None, message_type: str | None = None) -> None:
        self.channel = channel
        self.carried = carried
        super().__init__(reason, rid=rid, message_type=message_type)


class ProtocolMismatch(BusError):
    """Two peers' wire layouts differ in a breaking way: refused before any request.

    Raised by the ``hello`` handshake (:func:`scheduler.handshake.hello`),
    unlike :class:`DecodeError`, which concerns one message: here *no*
    message is sent, because the peers would mis-read each other's fields.
    A compatible difference is logged, never raised.

    Attributes:
        peer: who the other side is (an endpoint, or ``"client"``).
        differences: one line per breaking difference, each naming the type
            and field (``"TokenizedGenerateReqInput.stream: field removed"``).
        protocol_versions: (ours, theirs).
    """

    def __init__(self, peer: str, differences: list[str],
                 protocol_versions: tuple[int, int] | None = None) -> None:
        self.peer = peer
        self.differences = list(differences)
        self.protocol_versions = protocol_versions
        head = f"wire protocol mismatch with {peer}"
        if protocol_versions is not None and protocol_versions[0] != protocol_versions[1]:
            head += f" (protocol version {protocol_versions[0]} here, {protocol_versions[1]} there)"
        listed = "; ".join(self.differences[:20])
        more = f"; and {len(self.differences) - 20} more" if len(self.differences) > 20 else ""
        super().__init__(f"{head}: {listed}{more}" if listed else head)
