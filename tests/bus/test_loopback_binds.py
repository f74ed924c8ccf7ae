"""A tcp bind without ``allow_remote`` is allowed on every loopback spelling, and on
nothing else."""

from __future__ import annotations

import pytest
import zmq

from bus import SocketOptions, check_endpoint
from bus.sockets import close_socket, make_socket

LOOPBACK = ["tcp://127.0.0.2:*", "tcp://127.1.2.3:*", "tcp://[0:0:0:0:0:0:0:1]:*",
            "tcp://LOCALHOST:*", "tcp://[::ffff:127.0.0.1]:*"]
REMOTE = ["tcp://128.0.0.1:5999", "tcp://10.0.0.1:5999", "tcp://[::2]:5999",
          "tcp://127.0.0.1.nip.io:5999", "tcp://localhost.example:5999",
          "tcp://0.0.0.0:5999", "tcp://*:5999", "tcp://[::]:5999", "tcp://[::ffff:10.0.0.1]:5999"]


@pytest.mark.parametrize("endpoint", LOOPBACK)
def test_a_loopback_address_binds_without_allow_remote(
        endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # Without this: 127.0.0.2 (all of 127/8 is loopback), ::1 spelled out and
    # LOCALHOST were refused 'beyond loopback' at start-up.
    pull = make_socket(ctx, zmq.PULL, endpoint, bind=True, options=SocketOptions(),
                       sending=False)
    push: zmq.Socket[bytes] | None = None
    try:
        bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.IPV6, 1)
        push.connect(bound)
        push.send(b"hello")
        assert pull.poll(10_000) and pull.recv() == b"hello"
    finally:
        if push is not None:
            push.close()
        close_socket(pull)


@pytest.mark.parametrize("endpoint", REMOTE)
def test_anything_else_is_refused_without_allow_remote(endpoint: str) -> None:
    with pytest.raises(ValueError, match="beyond loopback"):
        check_endpoint(endpoint, bind=True, allow_remote=False)
    check_endpoint(endpoint, bind=True, allow_remote=True)
