"""``PeerWatch`` under a burst of connections its owner has not read yet."""

from __future__ import annotations

import socket
import time

import zmq

from bus import PushOutbox
from messages import Codec, Output

#: Connect/close pairs made before the watch is read: each is two monitor events,
#: past the 1000 a default-bounded monitor queue holds.
BURST = 1500


def test_a_burst_of_connections_never_stalls_a_live_reader(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    out = PushOutbox(Codec(Output), "tcp://127.0.0.1:0", bind=True, ctx=ctx,
                     watch_peers=True)
    reader = ctx.socket(zmq.PULL)
    watch = out.peers
    assert watch is not None
    try:
        endpoint = out.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        reader.connect(endpoint)
        out.socket.send(b"before")
        assert reader.poll(10_000), "the reader got nothing before the burst"
        reader.recv()
        # Connections from anyone who can reach the port (a scanner, a refused
        # CURVE client), none read by the watch meanwhile.
        made = 0
        deadline = time.monotonic() + 20.0
        while made < BURST and time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=2.0).close()
            except OSError:  # the port stopped accepting: zmq's I/O thread is stuck
                break
            made += 1
        out.socket.send(b"after")
        assert reader.poll(5_000), (
            f"the live reader got nothing for 5 s after {made} connections to "
            f"{endpoint} (zmq's I/O thread blocked on the watch's full event queue)")
        assert reader.recv() == b"after"
        assert made == BURST
        # Every event was kept: the reader is still counted, nothing reported gone.
        deadline = time.monotonic() + 10.0
        fell = False
        while time.monotonic() < deadline:
            fell = watch.last_left() or fell
            if watch.emptied == 0 and watch.peers == 1 and not fell:
                break
        assert (fell, watch.peers) == (False, 1)
    finally:
        # Read what waits (for a while), so a stuck I/O thread can move and close.
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle:
            watch.last_left()
        reader.close(linger=0)
        out.close()
