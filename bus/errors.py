"""Channel errors (the ``bus`` branch of the tree drawn in :mod:`messages.errors`)."""

from __future__ import annotations

from messages.errors import BusError

__all__ = [
    "ChannelClosed",
    "ChannelError",
    "EndOfChannel",
    "EndpointInUse",
    "PeerGone",
    "RpcTimeout",
    "WouldBlock",
]


class ChannelError(BusError):
    """Something went wrong on a channel. ``.channel`` names it."""

    def __init__(self, channel: str, detail: str) -> None:
        self.channel = channel
        self.detail = detail
        super().__init__(f"channel {channel!r}: {detail}")


class WouldBlock(ChannelError):
    """A ``_nowait`` call (or a send past its timeout) found the channel full or empty.

    Not a failure of the channel: retry later. Overload shows up here rather
    than as silently dropped messages.
    """


class ChannelClosed(ChannelError):
    """*You* closed this end (or its owner did); it accepts nothing more.

    Differs from :class:`PeerGone` (the other side went away) and from
    :class:`EndOfChannel` (a clean, expected end of the stream).
    """


class PeerGone(ChannelError):
    """The other end is gone: a dead process, a closed ring consumer."""


class EndpointInUse(ChannelError):
    """A live process already listens on this endpoint.

    On ``ipc://`` zmq would silently take the path over, and the other
    listener would stop receiving without a word (two schedulers in one
    directory, two dispatchers over one replica): refused instead. On
    ``tcp://`` it is the address in use.
    """


class EndOfChannel(ChannelError):
    """Clean end of stream: the producer closed and every item was delivered.

    Not a failure; it ends iteration.
    """


class RpcTimeout(ChannelError):
    """No reply to an rpc call in time. Names the endpoint, method and rid."""

    def __init__(self, channel: str, method: str, rid: str, timeout: float) -> None:
        self.method = method
        self.rid = rid
        self.timeout = timeout
        super().__init__(channel, f"no reply to rpc {method!r} (rid={rid!r}) within {timeout:g} s")
