"""``RpcCaller``: many rpc calls in flight at once, replies drained like any inbox.

:class:`~bus.RpcClient` blocks on one call at a time, which suits a
frontend. A loop that talks to several servers (a dispatcher asking every
replica at once, with heartbeats beside) must never block: it sends with
:meth:`RpcCaller.send_nowait` and reads the replies from its
:class:`~bus.Receiver`, beside every other inbox, matching them to calls by
rid itself.
"""

from __future__ import annotations

import zmq

from bus.channels import ZmqInbox
from bus.sockets import SocketOptions, make_socket
from messages import Codec, Message, RpcReqInput, RpcReqOutput

__all__ = ["RpcCaller"]

_DEFAULT_OPTIONS = SocketOptions()


class RpcCaller(ZmqInbox[Message]):
    """A DEALER that connects to an rpc server: send calls, drain replies.

    Replies decode as :class:`~messages.RpcReqOutput` (anything else is
    :class:`~bus.Rejected`, as on every inbox). Sending never blocks: a
    server that is gone or not reading raises :class:`~bus.WouldBlock`.
    """

    def __init__(self, endpoint: str, *, name: str = "rpc-caller",
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
                 options: SocketOptions = _DEFAULT_OPTIONS) -> None:
        sock = make_socket(ctx if ctx is not None else zmq.Context.instance(), zmq.DEALER,
                           endpoint, bind=False, options=options, sending=True)
        super().__init__(sock, Codec(Message, types=[RpcReqOutput]), name, routed=False)
        self.endpoint = endpoint
        self._send_codec: Codec[Message] = Codec(Message, types=[RpcReqInput])

    def send_nowait(self, call: RpcReqInput, /) -> None:
        """Send ``call`` if the server can take it now; never blocks.

        Raises:
            WouldBlock: the server is not connected or not reading.
            EncodeError: a parameter cannot be encoded.
            ChannelClosed: this caller is closed.
        """
        self._send(self._send_codec.encode(call), block=False)

    def close(self, linger_ms: int = 0) -> None:
        """Close, dropping calls not yet sent (a dead server would hold them). Idempotent."""
        if not self._closed:
            self.socket.setsockopt(zmq.LINGER, linger_ms)
        super().close()
