"""Channels: the in-process ``Ring``, zmq inboxes/outboxes, the fair ``Receiver``, rpc.

Knows no concrete message type beyond ``messages``' base classes (the rpc
client speaks ``RpcReqInput``/``RpcReqOutput``, the rpc protocol itself).
"""

from bus.channels import Inbox, PullInbox, PushOutbox, RingInbox, ZmqInbox
from bus.curve import CurveAuthenticator, CurveKeys
from bus.envelope import Envelope, Origin, Rejected
from bus.errors import (
    ChannelClosed,
    ChannelError,
    EndOfChannel,
    EndpointInUse,
    PeerGone,
    RpcTimeout,
    WouldBlock,
)
from bus.logsummary import LogSummary
from bus.peers import PeerWatch
from bus.receiver import Receiver, ReceiverStats
from bus.ring import Ring, RingStats, open_ring
from bus.rpc import RpcCall, RpcCaller, RpcClient, RpcServer
from bus.shm.frames import DEFAULT_SHM_THRESHOLD
from bus.shm.inbox import ShmInbox, ShmOutbox
from bus.shm.reader import ShmReader
from bus.shm.ring import ShmRingStats, ShmWriter, open_shm_ring
from bus.shm.segment import ShmSpaceError
from bus.shm.segment import sweep_stale as sweep_shm
from bus.sockets import SocketOptions, check_endpoint

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "ChannelClosed",
    "ChannelError",
    "CurveAuthenticator",
    "CurveKeys",
    "EndOfChannel",
    "EndpointInUse",
    "Envelope",
    "Inbox",
    "LogSummary",
    "Origin",
    "PeerGone",
    "PeerWatch",
    "PullInbox",
    "PushOutbox",
    "Receiver",
    "ReceiverStats",
    "Rejected",
    "Ring",
    "RingInbox",
    "RingStats",
    "RpcCall",
    "RpcCaller",
    "RpcClient",
    "RpcServer",
    "RpcTimeout",
    "ShmInbox",
    "ShmOutbox",
    "ShmReader",
    "ShmRingStats",
    "ShmSpaceError",
    "ShmWriter",
    "SocketOptions",
    "WouldBlock",
    "ZmqInbox",
    "check_endpoint",
    "open_ring",
    "open_shm_ring",
    "sweep_shm",
]
