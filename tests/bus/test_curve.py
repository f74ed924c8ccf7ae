"""CURVE over tcp: an admitted client is served, any other gets nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from bus import (
    CurveAuthenticator,
    CurveKeys,
    Envelope,
    Receiver,
    RpcClient,
    RpcServer,
    RpcTimeout,
    SocketOptions,
)
from messages import Codec, Output, Request, RpcReqInput, RpcReqOutput
from tests.conftest import eventually


@pytest.fixture
def server_keys() -> CurveKeys:
    return CurveKeys.generate()


@pytest.fixture
def good_client() -> CurveKeys:
    return CurveKeys.generate()


@pytest.fixture
def served(ctx: zmq.Context[zmq.Socket[bytes]], server_keys: CurveKeys,
           good_client: CurveKeys) -> Iterator[tuple[str, CurveAuthenticator]]:
    auth = CurveAuthenticator(ctx, [good_client.public])
    server = RpcServer(Codec(Request), "tcp://127.0.0.1:0", kind="router", ctx=ctx,
                       options=SocketOptions(curve_keys=server_keys))
    endpoint = server.socket.getsockopt_string(zmq.LAST_ENDPOINT)
    stop = threading.Event()
    out: Codec[Output] = Codec(Output)

    def loop() -> None:
        receiver = Receiver([server])
        while not stop.is_set():
            if receiver.wait(0.05):
                for env in receiver.poll():
                    assert isinstance(env, Envelope) and isinstance(env.message, RpcReqInput)
                    server.reply(out.encode(RpcReqOutput(rid=env.message.rid, success=True)),
                                 env.origin)

    t = threading.Thread(target=loop)
    t.start()
    yield endpoint, auth
    stop.set()
    t.join()
    server.close()
    auth.stop()


def test_admitted_client_is_served_and_others_get_nothing(
        ctx: zmq.Context[zmq.Socket[bytes]], served: tuple[str, CurveAuthenticator],
        server_keys: CurveKeys, good_client: CurveKeys) -> None:
    endpoint, auth = served
    good = SocketOptions(curve_keys=good_client, curve_server_public=server_keys.public)
    with RpcClient(endpoint, ctx=ctx, options=good) as client:
        assert client.call("ping", timeout=10).success
    stranger = SocketOptions(curve_keys=CurveKeys.generate(),
                             curve_server_public=server_keys.public)
    with RpcClient(endpoint, ctx=ctx, options=stranger) as bad:
        with pytest.raises(RpcTimeout):
            bad.call("ping", timeout=0.5)
    with RpcClient(endpoint, ctx=ctx) as plaintext:
        with pytest.raises(RpcTimeout):
            plaintext.call("ping", timeout=0.5)
    eventually(lambda: auth.refused >= 1, what="the stranger's handshake to be refused")
    with RpcClient(endpoint, ctx=ctx, options=good) as again:  # still serving
        assert again.call("ping", timeout=10).success


def test_keys_from_files(tmp_path: Path) -> None:
    public, secret = CurveKeys.create_files(tmp_path, "server")
    keys = CurveKeys.load(secret)
    assert len(keys.public) == 40 and "secret=..." in repr(keys)
    with pytest.raises(ValueError, match="secret"):
        CurveKeys.load(public)


def test_a_curve_client_needs_keys(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(ValueError, match="curve_keys"):
        RpcClient("tcp://127.0.0.1:1", ctx=ctx,
                  options=SocketOptions(curve_server_public=CurveKeys.generate().public))
