"""A tensor-parallel poll on the wire: outline plus bursts, rebuilt in order on another rank."""

from __future__ import annotations

import torch

from bus import Envelope, Origin, Rejected
from messages import (
    MAX_BURST,
    AbortReq,
    Codec,
    DecodeError,
    Request,
    RpcReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler.launch.tp import BroadcastReceiver, _pack_poll, _unpack_poll

CODEC: Codec[Request] = Codec(Request)
WORK, RPC_A, RPC_B = Origin("work"), Origin("rpc", b"\x00a"), Origin("rpc", b"\x00b")


def _poll(n: int) -> list[Envelope[Request] | Rejected]:
    out: list[Envelope[Request] | Rejected] = []
    for i in range(n):
        if i % 7 == 3:
            out.append(Rejected(DecodeError("bad field", rid=f"x{i}", message_type="AbortReq"),
                                RPC_B))
        elif i % 5 == 1:
            out.append(Envelope(RpcReqInput(rid=f"r{i}", method="get_load"),
                                Origin("rpc", RPC_A.identity)))  # equal, not the same object
        elif i == 2:  # a tensor that travels out of band
            out.append(Envelope(TokenizedGenerateReqInput(
                rid="emb", input_ids=token_ids([1, 2]),
                input_embeds=torch.arange(4096, dtype=torch.float32).reshape(2, 2048)), WORK))
        else:
            out.append(Envelope(TokenizedGenerateReqInput(rid=f"g{i}",
                                                          input_ids=token_ids(range(i % 50))),
                                WORK))
    return out


def _same(got: list[Envelope[Request] | Rejected],
          sent: list[Envelope[Request] | Rejected]) -> None:
    assert len(got) == len(sent)
    for g, s in zip(got, sent, strict=True):
        assert type(g) is type(s) and g.origin == s.origin
        if isinstance(s, Rejected):
            assert isinstance(g, Rejected)
            assert (g.error.reason, g.error.rid, g.error.message_type) == \
                (s.error.reason, s.error.rid, s.error.message_type)
            continue
        assert isinstance(g, Envelope)
        assert CODEC.encode(g.message)[0] == CODEC.encode(s.message)[0]
        if isinstance(s.message, TokenizedGenerateReqInput) and s.message.input_embeds is not None:
            assert isinstance(g.message, TokenizedGenerateReqInput)
            assert g.message.input_embeds is not None
            assert g.message.input_embeds.equal(s.message.input_embeds)


def test_a_poll_round_trips_as_frames_in_order_with_its_origins_and_rejections() -> None:
    sent = _poll(40)
    frames = _pack_poll(CODEC, sent)
    assert len(frames) == 3  # outline, one burst's head, the out-of-band tensor
    _same(_unpack_poll(CODEC, frames[0], frames[1:]), sent)


def test_a_poll_longer_than_a_burst_takes_several() -> None:
    sent = _poll(MAX_BURST + 300)
    frames = _pack_poll(CODEC, sent)
    _same(_unpack_poll(CODEC, frames[0], [memoryview(bytes(f)) for f in frames[1:]]), sent)


def test_a_poll_round_trips_in_one_buffer_as_the_collective_sends_it() -> None:
    recv = BroadcastReceiver(1, None, CODEC, transport="collective")
    lone: list[Envelope[Request] | Rejected] = [Envelope(AbortReq(rid="a"), WORK)]
    for sent in (_poll(1), _poll(3), _poll(300), lone):
        buf = recv._pack(sent)
        n = int.from_bytes(buf[:8], "little")
        _same(recv._unpack(memoryview(buf)[8 : 8 + n]), sent)
    assert recv.transport == "collective"
    recv.close()


def test_a_burst_that_fails_here_becomes_rejections_in_place() -> None:
    sent: list[Envelope[Request] | Rejected] = [
        Envelope(AbortReq(rid=f"a{i}"), WORK) for i in range(5)]
    sent.insert(2, Rejected(DecodeError("bad", rid="z"), RPC_B))
    frames = _pack_poll(CODEC, sent)
    head = bytearray(frames[1])
    at = head.index(b"a3")
    head[at : at + 2] = b"\xc1\xc1"  # never-used msgpack bytes in one member
    got = _unpack_poll(CODEC, frames[0], [bytes(head)])
    assert len(got) == 6
    kinds = [type(g).__name__ for g in got]
    assert kinds[2] == "Rejected" and kinds.count("Rejected") >= 2
    assert all(g.origin == s.origin for g, s in zip(got, sent, strict=True))


def test_an_empty_poll_round_trips() -> None:
    frames = _pack_poll(CODEC, [])
    assert _unpack_poll(CODEC, frames[0], frames[1:]) == []
