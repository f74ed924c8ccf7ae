"""Who is connected to a socket: its peers counted from zmq's socket monitor.

A :class:`PeerWatch` counts the live connections of one socket (accepted by
a bound socket, made by a connecting one) from the events zmq's I/O thread
publishes, and says when the last one went away. A peer goes away when its
connection closes: its process exited or was killed (the kernel closes its
sockets), or its host answered with a reset. A peer that is merely stalled
(stopped, swapping, busy in a long step) keeps its connection, so it is
never counted gone: this is evidence about the peer, never about our own
timing.

Connections are counted by file descriptor, as zmq reports them (accepted
or connected, then disconnected), so the count never goes below zero. A
connection the watch has no event of (one made before the monitor started)
may still leave: a connection that leaves
uncounted while none is counted is taken for the last one: one that leaves
while others are counted is not. A peer refused during its handshake (a
CURVE client without an admitted key) is accepted, then dropped: if it was
the only one, the count falls to zero, but then no reader was connected and
nothing in flight could be read anyway.
Reading never blocks and, when no event waits, costs one
zero-timeout poll of the monitor socket, so a loop may ask every step.

The events wait for the reader in a queue with no bound (the receiving end's
``RCVHWM`` is 0). zmq's I/O thread sends each event with a blocking send: at
a bounded queue's end (1000 by default, some 500 connect/close pairs) it
would wait for the watcher to read, and with it every socket of the context
(outputs, the work inbox, rpc) until then, so a burst of connections to a
bound port from anyone (a refused CURVE handshake is accepted first) stalled
a replica between two reads. Unbounded, a burst costs memory in proportion
to the connections made (about a hundred bytes each) until the next read.
"""

from __future__ import annotations

import itertools
import os
from typing import Final

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["PeerWatch"]

_UP: Final = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED
_EVENTS: Final = _UP | zmq.EVENT_DISCONNECTED
_WATCHES: Final = itertools.count()


class PeerWatch:
    """Counts ``sock``'s connected peers; :meth:`last_left` says when none is left.

    Close it before ``sock`` (idempotent; a context manager).
    """

    def __init__(self, sock: zmq.Socket[bytes], name: str) -> None:
        self.name = name
        self._sock = sock
        self._monitor = _monitor_socket(sock)
        self._fds: set[int] = set()
        self._closed = False
        #: How many times the last peer went away.
        self.emptied = 0

    @property
    def peers(self) -> int:
        """Connections counted now (as of the last :meth:`last_left`)."""
        return len(self._fds)

    def last_left(self) -> bool:
        """Read the waiting events (never blocks); whether the count fell to zero among
        them, from at least one (a socket that never had a peer has lost none)."""
        mon = self._monitor
        if self._closed or not mon.poll(0, zmq.POLLIN):
            return False
        fell = False
        while True:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            kind, fd = event["event"], int(event["value"])
            if kind & _UP:
                self._fds.add(fd)
            elif kind == zmq.EVENT_DISCONNECTED and (fd in self._fds or not self._fds):
                self._fds.discard(fd)  # (uncounted, while none is: see the module docstring)
                if not self._fds:
                    fell = True
                    self.emptied += 1
        # A peer that left and a new one that came in the same read: someone
        # reads now, yet what was sent to the one that left is still lost.
        return fell

    def close(self) -> None:
        """Stop watching (before the socket closes). Idempotent."""
        if not self._closed:
            self._closed = True
            if not self._sock.closed:
                self._sock.disable_monitor()
            self._monitor.close(linger=0)

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _monitor_socket(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    """``sock``'s monitor events, read from a PAIR whose queue has no bound (the
    module docstring says why: a bounded one blocks zmq's I/O thread when full)."""
    addr = f"inproc://peer-watch-{os.getpid()}-{next(_WATCHES)}"
    sock.monitor(addr, _EVENTS)
    mon: zmq.Socket[bytes] = sock.context.socket(zmq.PAIR)
    try:
        mon.setsockopt(zmq.RCVHWM, 0)  # set before connect: the pipe takes it then
        mon.connect(addr)
    except BaseException:
        mon.close(linger=0)
        sock.disable_monitor()
        raise
    return mon
