"""The rpc door against an upstream the test plays: what it does with a reply it cannot read."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from bus import Envelope, RpcClient, RpcServer
from frontend import RpcDoor
from messages import RPC, Request, RpcReqInput, RpcReqOutput


def test_a_reply_the_door_cannot_decode_fails_its_call_at_once(tmp_path: Path) -> None:
    """The upstream answers the forwarded call with a reply that names its rid but does
    not decode (a message past its bound): the caller is answered at once with a failure
    that says why (without it: the caller waited out its whole timeout)."""
    upstream: RpcServer[Request] = RpcServer(RPC.inbound_codec(), f"ipc://{tmp_path}/up",
                                             name="up")
    door = RpcDoor(f"ipc://{tmp_path}/door", f"ipc://{tmp_path}/up", gone=lambda: None)
    caller = RpcClient(f"ipc://{tmp_path}/door")
    try:
        with ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            waiting = pool.submit(caller.call, "get_load", timeout=30.0)
            deadline = time.monotonic() + 30.0
            forwarded: list[Envelope[Request]] = []
            while not forwarded and time.monotonic() < deadline:
                upstream.pollable().poll(100)
                forwarded = [e for e in upstream.drain(1) if isinstance(e, Envelope)]
            assert forwarded, "the call was not forwarded"
            call = forwarded[0].message
            assert isinstance(call, RpcReqInput) and call.method == "get_load"
            too_long = RpcReqOutput(rid=call.rid, success=True, message="x" * (1 << 17))
            upstream.reply(RPC.outbound_codec().encode(too_long), forwarded[0].origin)
            reply = waiting.result(timeout=60.0)
        assert not reply.success and "cannot decode RpcReqOutput" in reply.message, reply
        assert time.monotonic() - t0 < 10.0  # not the call's 30 s
        assert door.in_flight == 0
    finally:
        caller.close()
        door.close()
        upstream.close()


def test_a_reply_to_a_caller_that_left_is_logged_as_undelivered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A caller that leaves before its reply: the door logs the reply as not delivered
    (without it: it was counted among "rejected frames", as if the caller had sent
    bad frames, an operator's summary of a flood naming the wrong fault).

    zmq tells the door's ROUTER that a peer left asynchronously: a reply sent before
    it knows is dropped by zmq unseen, with nothing to log. So callers leave one
    after another, until the door has seen one gone (within the deadline)."""
    upstream: RpcServer[Request] = RpcServer(RPC.inbound_codec(), f"ipc://{tmp_path}/up",
                                             name="up")
    door = RpcDoor(f"ipc://{tmp_path}/door", f"ipc://{tmp_path}/up", gone=lambda: None)
    codec = RPC.inbound_codec()
    deadline = time.monotonic() + 30.0
    logged = ""
    try:
        with caplog.at_level(logging.WARNING, logger="frontend.rpc"):
            for attempt in range(1000):
                caller: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
                caller.setsockopt(zmq.LINGER, 1000)
                caller.connect(f"ipc://{tmp_path}/door")
                caller.send_multipart(codec.encode(RpcReqInput(
                    rid=f"left-early-{attempt}", method="get_load", parameters={})))
                forwarded: list[Envelope[Request]] = []
                while not forwarded and time.monotonic() < deadline:
                    upstream.pollable().poll(100)
                    forwarded = [e for e in upstream.drain(1) if isinstance(e, Envelope)]
                caller.close()  # gone before its reply
                assert forwarded, "the call was not forwarded"
                upstream.reply(RPC.outbound_codec().encode(RpcReqOutput(
                    rid=forwarded[0].message.rid, success=True, message="")),
                    forwarded[0].origin)
                while door.in_flight and time.monotonic() < deadline:
                    time.sleep(0.01)  # sleep-ok: pacing of a deadline poll
                assert door.in_flight == 0, "the reply never reached the door"
                door._undelivered.flush()
                logged = "\n".join(r.getMessage() for r in caplog.records)
                if "replies not delivered" in logged or time.monotonic() > deadline:
                    break
        assert "replies not delivered" in logged and "left-early" in logged, logged
        assert "rejected frames" not in logged, logged
    finally:
        door.close()
        upstream.close()
