"""Channels: the in-process ``Ring``, zmq inboxes/outboxes, the fair ``Receiver``, rpc.

Knows no concrete message type beyond ``messages``' base classes (the rpc
client speaks ``RpcReqInput``/``RpcReqOutput``, the rpc protocol itself).
"""

from bus.channels import Inbox, PullInbox, PushOutbox, RingInbox, RpcServer, ZmqInbox
from bus.curve import CurveAuthenticator, CurveKeys
from bus.envelope import Envelope, Origin, Rejected
from bus.errors import ChannelClosed, ChannelError, EndOfChannel, PeerGone, RpcTimeout, WouldBlock
from bus.logsummary import LogSummary
from bus.receiver import Receiver, ReceiverStats
from bus.ring import Ring, RingStats, open_ring
from bus.rpc import RpcClient
from bus.sockets import SocketOptions, check_endpoint

__all__ = [
    "ChannelClosed",
    "ChannelError",
    "CurveAuthenticator",
    "CurveKeys",
    "EndOfChannel",
    "Envelope",
    "Inbox",
    "LogSummary",
    "Origin",
    "PeerGone",
    "PullInbox",
    "PushOutbox",
    "Receiver",
    "ReceiverStats",
    "Rejected",
    "Ring",
    "RingInbox",
    "RingStats",
    "RpcClient",
    "RpcServer",
    "RpcTimeout",
    "SocketOptions",
    "WouldBlock",
    "ZmqInbox",
    "check_endpoint",
    "open_ring",
]
