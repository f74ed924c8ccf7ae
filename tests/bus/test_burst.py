"""Bursts: many messages in one zmq message, encoded and decoded in one msgspec call."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import Envelope, PullInbox, PushOutbox, Receiver, Rejected, SocketOptions
from messages import (
    AbortReq,
    Codec,
    DecodeError,
    EncodeError,
    Message,
    Request,
    TokenizedGenerateReqInput,
    token_ids,
)
from messages.burst import MAX_BURST, SEND_BURST, is_burst
from tests.messages.strategies import messages

CODEC: Codec[Message] = Codec(Message)


def _wire(frames: list[bytes | bytearray | memoryview]) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, min_size=1, max_size=12))
def test_a_burst_round_trips_in_order(msgs: list[Message]) -> None:
    frames = CODEC.encode_many(msgs)
    assert is_burst(frames[0]) == (len(msgs) > 1)  # one message travels as itself
    got = CODEC.decode_any(_wire(frames))
    back = got if isinstance(got, list) else [got]
    assert [type(m) for m in back] == [type(m) for m in msgs]
    # Each member re-encodes to the bytes it would have had alone.
    for a, b in zip(msgs, back, strict=True):
        assert _wire(CODEC.encode(a)) == _wire(CODEC.encode(b))


def _req(n: int, embeds: bool = False) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=f"r{n}", input_ids=token_ids([1, 2, n]),
                                     input_embeds=torch.ones(2048) if embeds else None)


def _bad_burst() -> bytes:
    """A burst whose middle member has a readable rid and a field of the wrong type."""
    codec: Codec[Request] = Codec(Request)
    good = [msgspec.Raw(codec.encode(_req(n))[0]) for n in (1, 3)]
    bad = msgspec.Raw(msgspec.msgpack.encode(["TokenizedGenerateReqInput", "r2", "not ids"]))
    return msgspec.msgpack.encode(["Burst", [good[0], bad, good[1]]])


def test_a_bad_member_rejects_only_itself_and_keeps_its_rid() -> None:
    codec: Codec[Request] = Codec(Request)
    head = _bad_burst()
    with pytest.raises(DecodeError):
        codec.decode_any([head])
    members = codec.decode_members([head])
    assert [type(m).__name__ for m in members] == [
        "TokenizedGenerateReqInput", "DecodeError", "TokenizedGenerateReqInput"]
    bad = members[1]
    assert isinstance(bad, DecodeError) and bad.rid == "r2" and "input_ids" in str(bad)
    outline = codec.decode_members([b"\x92\xa5Burst\xc1"])  # not even its outline reads
    assert len(outline) == 1 and isinstance(outline[0], DecodeError)


def test_a_burst_with_tensor_frames_fails_whole_but_names_each_rid() -> None:
    codec: Codec[Request] = Codec(Request)
    frames = _wire(codec.encode_many([_req(1, embeds=True), _req(2)]))
    assert len(frames) == 2
    members = codec.decode_members([frames[0], frames[1][:-4]])  # a truncated tensor frame
    assert all(isinstance(m, DecodeError) for m in members)
    assert [m.rid for m in members if isinstance(m, DecodeError)] == ["r1", "r2"]


def test_a_bad_member_cannot_be_sent() -> None:
    with pytest.raises(EncodeError, match="input_embeds"):
        CODEC.encode_many([_req(1), TokenizedGenerateReqInput(
            rid="x", input_ids=token_ids([1]), input_embeds=torch.ones(2, device="meta"))])
    with pytest.raises(ValueError, match="1 to"):
        CODEC.encode_many([])


def test_send_many_arrives_in_order_and_a_lone_message_travels_as_itself(
        tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/w"
    with PullInbox(Codec(Request), ep) as inbox, PushOutbox(Codec(Request), ep) as out:
        msgs: list[Request] = [_req(n) for n in range(MAX_BURST + 5)]
        msgs.append(AbortReq(rid="r3"))
        out.send_many(msgs)  # two bursts: MAX_BURST, then the rest
        out.send_many([_req(9999)])
        receiver: Receiver[Request] = Receiver([inbox], budget=64)
        got: list[str] = []
        deadline = time.monotonic() + 30
        while len(got) < len(msgs) + 1:
            assert time.monotonic() < deadline
            receiver.wait(1.0)
            batch = receiver.poll()
            got.extend(e.message.rid for e in batch if isinstance(e, Envelope))
        assert got == [m.rid for m in msgs] + ["r9999"]
        assert inbox.rejected == 0


def test_send_many_nowait_stops_where_the_peer_stops_taking(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/w"
    opts = SocketOptions(hwm=2)
    with PushOutbox(Codec(Request), ep, options=opts) as out, \
            PullInbox(Codec(Request), ep, options=opts) as inbox:
        msgs: list[Request] = [_req(n) for n in range(MAX_BURST * 20)]
        sent = out.send_many_nowait(msgs)
        assert 0 < sent < len(msgs) and sent % SEND_BURST == 0  # whole bursts only
        inbox.drain(10)  # (the reader exists; what it takes is beside the point)


def test_a_malformed_member_on_the_wire_is_answered_by_rid(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/w"
    codec: Codec[Request] = Codec(Request)
    with PullInbox(codec, ep) as inbox, PushOutbox(codec, ep) as out:
        out.socket.send(_bad_burst())
        assert inbox.socket.poll(10_000)
        got = inbox.drain(16)
    assert isinstance(got[0], Envelope) and got[0].message.rid == "r1"
    assert isinstance(got[1], Rejected) and got[1].error.rid == "r2"
    assert isinstance(got[2], Envelope) and got[2].message.rid == "r3"
    assert inbox.rejected == 1


def test_a_burst_is_a_plain_tagged_array_on_the_wire() -> None:
    frames = CODEC.encode_many([AbortReq(rid="a"), AbortReq(rid="b")])
    expected = ["Burst", [["AbortReq", "a"], ["AbortReq", "b"]]]
    assert msgpack.unpackb(bytes(frames[0])) == expected  # an independent reader (PROTOCOL.md)
    assert bytes(frames[0]).startswith(bytes.fromhex("92a54275727374"))  # PROTOCOL.md


def test_every_member_of_a_burst_past_the_bound_is_told() -> None:
    codec: Codec[Request] = Codec(Request)
    members = [msgspec.Raw(codec.encode(_req(n))[0]) for n in range(MAX_BURST + 1)]
    head = msgspec.msgpack.encode(["Burst", members])
    with pytest.raises(DecodeError):
        codec.decode_any([head])
    errors = codec.decode_members([head])
    assert len(errors) == MAX_BURST + 1
    assert all(isinstance(e, DecodeError) and e.rid == f"r{n}" and "more than 1024" in str(e)
               for n, e in enumerate(errors))
    empty = codec.decode_members([msgspec.msgpack.encode(["Burst", []])])
    assert len(empty) == 1 and isinstance(empty[0], DecodeError)  # counted, not silent


def test_a_burst_in_another_msgpack_spelling_is_still_split(tmp_path: Path) -> None:
    codec: Codec[Request] = Codec(Request)
    good = msgspec.Raw(codec.encode(_req(1))[0])
    bad = msgspec.Raw(msgspec.msgpack.encode(["TokenizedGenerateReqInput", "r2", "not ids"]))
    body = msgspec.msgpack.encode([good, bad])
    head = b"\xdc\x00\x02" + b"\xd9\x05Burst" + body  # array16, str8: valid, not ours
    ep = f"ipc://{tmp_path}/w"
    with PullInbox(codec, ep) as inbox, PushOutbox(codec, ep) as out:
        out.socket.send(head)
        assert inbox.socket.poll(10_000)
        got = inbox.drain(16)
    assert isinstance(got[0], Envelope) and got[0].message.rid == "r1"
    assert isinstance(got[1], Rejected) and got[1].error.rid == "r2"


def test_a_burst_with_too_many_frames_answers_each_member(tmp_path: Path) -> None:
    wide: Codec[Request] = Codec(Request, max_frames=200)
    frames = wide.encode_many([_req(n, embeds=True) for n in range(70)])  # 71 frames
    assert len(frames) == 71
    ep = f"ipc://{tmp_path}/w"
    with PullInbox(Codec(Request), ep) as inbox, PushOutbox(wide, ep) as out:
        out.socket.send_multipart(frames)
        assert inbox.socket.poll(10_000)
        got = inbox.drain(256)
    assert [g.error.rid for g in got if isinstance(g, Rejected)] == [f"r{n}" for n in range(70)]


def test_a_burst_too_big_for_the_bounds_is_split_not_refused(tmp_path: Path) -> None:
    small: Codec[Request] = Codec(Request, max_message_bytes=20_000)
    msgs: list[Request] = [_req(n, embeds=True) for n in range(6)]  # 8 KiB of tensor each
    ep = f"ipc://{tmp_path}/w"
    with PullInbox(Codec(Request), ep) as inbox, PushOutbox(small, ep) as out:
        assert out.send_many_nowait(msgs) == 6
        got: list[str] = []
        deadline = time.monotonic() + 10
        while len(got) < 6:
            assert time.monotonic() < deadline
            inbox.socket.poll(1000)
            got += [e.message.rid for e in inbox.drain(16) if isinstance(e, Envelope)]
    assert got == [f"r{n}" for n in range(6)]


def test_a_received_request_and_its_envelope_are_not_tracked_by_the_collector() -> None:
    """Per-message allocations the cycle collector never scans: a burst of 256 requests
    used to set off a young-generation collection every few polls, each one scanning
    every envelope and sampling struct (most of an envelope's cost in benchmarks.bus).
    """
    import gc

    from bus.envelope import Origin, envelopes

    msgs = CODEC.decode_any(_wire(CODEC.encode_many([_req(n) for n in range(4)])))
    assert isinstance(msgs, list)
    envs = envelopes(msgs, Origin("work"))
    for env, msg in zip(envs, msgs, strict=True):
        assert isinstance(env, Envelope) and env.message is msg
        assert not gc.is_tracked(env)
        assert not gc.is_tracked(env.message)
        assert not gc.is_tracked(env.message.sampling)  # type: ignore[attr-defined]
