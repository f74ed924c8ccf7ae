"""One contract every inbox kind passes: Ring, PULL, DEALER, ROUTER."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import msgspec
import pytest
import zmq

from bus import (
    EndOfChannel,
    Envelope,
    Inbox,
    PullInbox,
    Receiver,
    Rejected,
    Ring,
    RingInbox,
    RpcServer,
)
from messages import AbortReq, Codec, Message, Request, RpcReqInput

CODEC: Codec[Message] = Codec(Message)


@dataclass
class Rig:
    inbox: Inbox[Message]
    send: Callable[[Message], None]
    send_raw: Callable[[list[bytes]], None] | None
    end: Callable[[], None]  # the producer side ends cleanly / goes away


def _zmq_rig(ctx: zmq.Context[zmq.Socket[bytes]], inbox: Inbox[Message], peer_type: int,
             endpoint: str) -> tuple[Rig, zmq.Socket[bytes]]:
    peer = ctx.socket(peer_type)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(endpoint)

    def send(m: Message) -> None:
        peer.send_multipart(CODEC.encode(m))

    def raw(frames: list[bytes]) -> None:
        peer.send_multipart(frames)

    # A clean end: close, letting what was sent go out (the rig's LINGER is 0).
    return Rig(inbox, send, raw, lambda: peer.close(linger=10_000)), peer


@pytest.fixture(params=["ring", "pull", "dealer", "router"])
def rig(request: pytest.FixtureRequest, ctx: zmq.Context[zmq.Socket[bytes]],
        ipc: Callable[[str], str]) -> Iterator[Rig]:
    kind = request.param
    if kind == "ring":
        ring: Ring[Message] = Ring(1 << 17, name="work")
        yield Rig(RingInbox(ring, name="work"), ring.put, None, ring.close)
        ring.release()
        return
    ep = ipc(kind)
    inbox: PullInbox[Message] | RpcServer[Message]
    if kind == "pull":
        inbox = PullInbox(CODEC, ep, ctx=ctx)
        r, peer = _zmq_rig(ctx, inbox, zmq.PUSH, ep)
    else:
        inbox = RpcServer(CODEC, ep, kind="dealer" if kind == "dealer" else "router", ctx=ctx)
        r, peer = _zmq_rig(ctx, inbox, zmq.DEALER, ep)
    yield r
    peer.close(0)
    inbox.close()


def _take(receiver: Receiver[Message], n: int) -> list[Envelope[Message] | Rejected]:
    got: list[Envelope[Message] | Rejected] = []
    for _ in range(1000):
        if len(got) >= n:
            break
        receiver.wait(1.0)
        got.extend(receiver.poll())
    return got


def test_per_producer_order(rig: Rig) -> None:
    receiver = Receiver([rig.inbox], budget=64)
    for i in range(300):
        rig.send(AbortReq(rid=f"r{i}"))
    got = _take(receiver, 300)
    assert [cast(AbortReq, e.message).rid for e in got if isinstance(e, Envelope)
            ] == [f"r{i}" for i in range(300)]


def test_wait_is_woken_by_a_message(rig: Rig) -> None:
    receiver = Receiver([rig.inbox])
    assert not receiver.wait(0.01)
    t = threading.Timer(0.05, rig.send, args=(AbortReq(rid="wake"),))
    t.start()
    try:
        assert receiver.wait(10.0)
        got = _take(receiver, 1)
        assert isinstance(got[0], Envelope) and got[0].origin.inbox == rig.inbox.name
    finally:
        t.join()


def test_malformed_frames_become_rejected(rig: Rig) -> None:
    if rig.send_raw is None:
        pytest.skip("a ring carries objects, not frames")
    receiver = Receiver([rig.inbox])
    rig.send_raw([msgspec.msgpack.encode(["RpcReqInput", "r-42", "not a method!", {}])])
    rig.send_raw([b"garbage"])
    rig.send(AbortReq(rid="fine"))
    got = _take(receiver, 3)
    assert [type(e) for e in got] == [Rejected, Rejected, Envelope]
    assert isinstance(got[0], Rejected) and got[0].error.rid == "r-42"
    assert got[0].origin.inbox == rig.inbox.name
    assert receiver.statistics().rejected == 2


def test_nothing_lost_across_a_clean_end(rig: Rig) -> None:
    receiver = Receiver([rig.inbox])
    for i in range(50):
        rig.send(AbortReq(rid=f"r{i}"))
    rig.end()  # at once: the 50 are still on their way, none read yet
    got = _take(receiver, 50)
    assert [cast(AbortReq, e.message).rid for e in got if isinstance(e, Envelope)] == \
        [f"r{i}" for i in range(50)]
    if isinstance(rig.inbox, RingInbox):  # a ring's end is observable: clean end of stream
        receiver.wait(1.0)
        assert receiver.poll() == []
        assert receiver.statistics().ended == ("work",)
        with pytest.raises(EndOfChannel):
            rig.inbox.drain(1)


def test_closed_inbox_ends_iteration(rig: Rig) -> None:
    rig.inbox.close()
    rig.inbox.close()  # idempotent
    with pytest.raises(EndOfChannel):
        rig.inbox.drain(1)


def test_flooded_inbox_cannot_starve_rpc(ctx: zmq.Context[zmq.Socket[bytes]],
                                         ipc: Callable[[str], str]) -> None:
    ring: Ring[Request] = Ring(200_000)
    for i in range(100_000):
        ring.put_nowait(AbortReq(rid=f"w{i}"))
    ep = ipc("rpc")
    codec: Codec[Request] = Codec(Request)
    with RpcServer(codec, ep, ctx=ctx) as rpc:
        peer = ctx.socket(zmq.DEALER)
        peer.connect(ep)
        peer.send_multipart(CODEC.encode(RpcReqInput(rid="c1", method="get_load")))
        inboxes: list[Inbox[Request]] = [RingInbox(ring), rpc]
        receiver = Receiver(inboxes, budget=128)
        assert receiver.wait(10.0)
        assert rpc.socket.poll(10_000)  # the rpc frame has landed (poll with a deadline)
        first = receiver.poll()
        assert any(isinstance(e, Envelope) and isinstance(e.message, RpcReqInput)
                   for e in first)
        assert len(first) <= 128
        peer.close(0)
    ring.release()
