from __future__ import annotations

import math
import os

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    DecodeError,
    EncodeError,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqInput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from messages._tensors import DTYPE_CODES
from tests.messages.strategies import messages

CODEC = Codec(Message, types=[t for t in Codec(Message).types
                              if not t.__module__.startswith("tests")])


def _bytes(frames: list[object]) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]  # type: ignore[arg-type]


@given(messages)
@settings(max_examples=300, deadline=None)
def test_round_trip_every_message_type(msg: Message) -> None:
    frames = CODEC.encode(msg)
    back = CODEC.decode([bytes(memoryview(f)) for f in frames])
    assert type(back) is type(msg)
    # Double hop: decode then re-encode gives the same bytes.
    assert _bytes(CODEC.encode(back)) == _bytes(frames)  # type: ignore[arg-type]
    for name in msg.__struct_fields__:
        a, b = getattr(msg, name), getattr(back, name)
        if isinstance(a, np.ndarray | torch.Tensor):
            assert _raw(a) == _raw(b) and tuple(a.shape) == tuple(b.shape)
        elif not isinstance(a, msgspec.Struct):
            assert a == b or (a != a and b != b)


def _raw(x: np.ndarray | torch.Tensor) -> bytes:
    if isinstance(x, torch.Tensor):
        return bytes(x.contiguous().reshape(-1).view(torch.uint8).numpy())
    return np.ascontiguousarray(x).tobytes()


class Holder(Output, tag="tests.Holder"):
    """An output with an untyped array field."""

    arr: np.ndarray


def _embed(t: torch.Tensor) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid="t", input_ids=token_ids([1]), input_embeds=t)


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    raw = torch.from_numpy(np.frombuffer(os.urandom(n * dtype.itemsize) or b"", np.uint8).copy())
    if dtype == torch.bool:
        raw = raw % 2
    t = raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    if dtype.is_floating_point and n >= 3 and dtype.itemsize >= 2:
        t.view(-1)[0], t.view(-1)[1], t.view(-1)[2] = math.inf, -math.inf, math.nan
    return t


SHAPES = [(), (0,), (3, 0, 2), (5,), (4, 7), (2, 3, 4), (300, 70)]


@pytest.mark.parametrize("dtype", sorted(DTYPE_CODES, key=str), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_tensor_matrix_bit_exact(dtype: torch.dtype, shape: tuple[int, ...], layout: str) -> None:
    t = _sample(dtype, shape)
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif layout == "sliced" and t.dim() >= 1 and t.shape[-1] > 1:
        t = t[..., ::2]
    back = CODEC.decode(CODEC.encode(_embed(t)))
    assert isinstance(back, TokenizedGenerateReqInput) and back.input_embeds is not None
    assert back.input_embeds.dtype == t.dtype
    assert tuple(back.input_embeds.shape) == tuple(t.shape)
    assert _raw(back.input_embeds) == _raw(t)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16",
                                   "uint32", "uint64", "float16", "float32", "float64",
                                   "complex64", "complex128"])
@pytest.mark.parametrize("shape", [(), (0,), (6,), (2, 3), (40, 40)], ids=str)
def test_numpy_arrays_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    codec = Codec(Holder)
    a = np.frombuffer(os.urandom(math.prod(shape) * np.dtype(dtype).itemsize),
                      dtype=np.uint8).view(dtype).reshape(shape)
    if dtype == "bool":
        a = np.asarray(a.view(np.uint8) % 2 == 1)
    back = codec.decode(codec.encode(Holder(arr=a.T)))
    assert back.arr.dtype == a.dtype and back.arr.shape == a.T.shape
    assert back.arr.tobytes() == a.T.tobytes()


def test_large_tensor_is_zero_copy_both_ways() -> None:
    t = torch.randn(256, 1024)
    frames = CODEC.encode(BatchEmbeddingOut(rids=["r"] * 256, embeddings=t))
    assert len(frames) == 2
    sent = np.frombuffer(frames[1], np.uint8)
    assert sent.__array_interface__["data"][0] == t.data_ptr()  # a view, not a copy
    received = bytearray(memoryview(frames[1]))  # the receive buffer
    back = CODEC.decode([frames[0], received])
    assert isinstance(back, BatchEmbeddingOut)
    base = np.frombuffer(received, np.uint8).__array_interface__["data"][0]
    assert back.embeddings.data_ptr() == base  # lies inside the received buffer
    assert torch.equal(back.embeddings, t)


def test_small_tensor_rides_inline_as_an_owned_copy() -> None:
    t = torch.arange(8, dtype=torch.float32)
    frames = CODEC.encode(_embed(t))
    assert len(frames) == 1
    back = CODEC.decode(frames)
    assert isinstance(back, TokenizedGenerateReqInput) and back.input_embeds is not None
    back.input_embeds += 1  # writable, and does not touch the frame
    again = CODEC.decode(frames)
    assert isinstance(again, TokenizedGenerateReqInput) and again.input_embeds is not None
    assert again.input_embeds.tolist() == t.tolist()


def test_decoded_arrays_are_read_only_views() -> None:
    frames = CODEC.encode(TokenizedGenerateReqInput(rid="a", input_ids=token_ids([1, 2])))
    back = CODEC.decode(frames)
    assert isinstance(back, TokenizedGenerateReqInput)
    assert back.input_ids.format == "I" and back.input_ids.tolist() == [1, 2]
    assert back.input_ids.obj is frames[0]  # a view of the received frame, no copy
    with pytest.raises(TypeError):
        back.input_ids[0] = 3
    out = CODEC.decode(CODEC.encode(BatchTokenIDOut.from_lists(["a"], [[1]], [None],
                                                               logprobs=[[-1.0]])))
    assert isinstance(out, BatchTokenIDOut) and out.logprobs is not None
    with pytest.raises(ValueError):
        out.logprobs[0] = 0.0


def test_inline_threshold_is_configurable() -> None:
    t = torch.zeros(64)
    assert len(Codec(Message, inline_threshold=0).encode(_embed(t))) == 2  # ids: header
    assert len(Codec(Message, inline_threshold=1 << 20).encode(_embed(torch.zeros(1 << 16)))) == 1


def test_non_cpu_tensor_is_refused_naming_the_field() -> None:
    t = torch.empty(4, device="meta")
    with pytest.raises(EncodeError) as info:
        CODEC.encode(_embed(t))
    assert info.value.field == "input_embeds" and "move_to_cpu" in info.value.reason
    assert "TokenizedGenerateReqInput.input_embeds" in str(info.value)


def test_unsupported_value_is_an_encode_error() -> None:
    msg = RpcReqInput(rid="a", method="m", parameters={"x": object()})  # type: ignore[dict-item]
    with pytest.raises(EncodeError, match="no pickle"):
        CODEC.encode(msg)


def test_typed_codec_decodes_only_its_family() -> None:
    requests = Codec(Request)
    frames = CODEC.encode(ErrorOut(rid="a", code="internal"))
    with pytest.raises(DecodeError):
        requests.decode(frames)


# -- golden bytes: the wire format is pinned; change it deliberately -----------

GOLDEN = {
    "generate": (  # 9 items (99), the last prefill_only=false (c2); sampling: 15
        # items (9f): ignore_eos=false (c2), guide=null (c0), then
        # the penalties, min_tokens, logit_bias, top_logprobs and prompt_logprobs at their
        # defaults (0.0, 0.0, 1.0, 0, nil, 0, nil)
        TokenizedGenerateReqInput(rid="r1", input_ids=token_ids([1, 2, 300]),
                                  sampling=SamplingParams(max_new_tokens=8, temperature=0.0)),
        "99b9546f6b656e697a656447656e6572617465526571496e707574a27231c40c0100000002000000"
        "2c0100009f08cb0000000000000000cb3ff000000000000000c0c0c2c0cb0000000000000000cb00"
        "00000000000000cb3ff000000000000000c000c0c2c2c0c0c2",
    ),
    "generate_ignore_eos": (
        TokenizedGenerateReqInput(rid="r1", input_ids=token_ids([1, 2, 300]),
                                  sampling=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                          ignore_eos=True)),
        "99b9546f6b656e697a656447656e6572617465526571496e707574a27231c40c0100000002000000"
        "2c0100009f08cb0000000000000000cb3ff000000000000000c0c0c3c0cb0000000000000000cb00"
        "00000000000000cb3ff000000000000000c000c0c2c2c0c0c2",
    ),
    "rpc": (
        RpcReqInput(rid="c-1", method="save_checkpoint", parameters={"path": "/tmp/ck"}),
        "94ab527063526571496e707574a3632d31af736176655f636865636b706f696e7481a470617468a7"
        "2f746d702f636b",
    ),
    "batch": (
        BatchTokenIDOut.from_lists(["a", "b"], [[7], [9, 10]], [None, "stop"]),
        # rids: one str, "\0a\0b" (messages.rids), since the rid column
        "9eaf4261746368546f6b656e49444f7574a400610062c40c07000000090000000a000000c4080100"
        "00000200000092c0a473746f70c0c0c0c0c0c0c0c0c0",
    ),
}


def test_batch_from_an_older_sender_decodes_without_cached_tokens() -> None:
    # A sender that predates cached_tokens writes 7 items; the field takes its default.
    old = bytes.fromhex(
        "97af4261746368546f6b656e49444f7574a400610062c40c07000000090000000a000000c4080100"
        "00000200000092c0a473746f70c0c0")
    msg = CODEC.decode([old])
    assert isinstance(msg, BatchTokenIDOut)
    assert list(msg.rids) == ["a", "b"] and msg.cached_tokens is None


def test_batch_cached_tokens_round_trip_and_follow_select() -> None:
    msg = BatchTokenIDOut.from_lists(["a", "b", "c"], [[7], [9], []], [None, "stop", "length"],
                                     cached_tokens=[0, 32, 5])
    back = CODEC.decode(CODEC.encode(msg))
    assert isinstance(back, BatchTokenIDOut)
    assert back.cached_tokens is not None and list(back.cached_tokens) == [0, 32, 5]
    kept = back.select([False, True, True]).cached_tokens
    assert kept is not None and list(kept) == [32, 5]
    with pytest.raises(ValueError, match="cached_tokens has 1 entries for 2 rids"):
        BatchTokenIDOut.from_lists(["a", "b"], [[1], [2]], [None, None], cached_tokens=[3])


def test_generate_from_before_prefill_only_decodes_as_not_prefill_only() -> None:
    # A sender that predates prefill_only writes 8 items (98); the field takes its default.
    old = bytes.fromhex(
        "98b9546f6b656e697a656447656e6572617465526571496e707574a27231c40c0100000002000000"
        "2c0100009708cb0000000000000000cb3ff000000000000000c0c0c2c2c2c0c0")
    msg = CODEC.decode([old])
    assert isinstance(msg, TokenizedGenerateReqInput) and msg.prefill_only is False
    assert list(msg.input_ids) == [1, 2, 300]


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_bytes(name: str) -> None:
    msg, hexed = GOLDEN[name]
    frames = CODEC.encode(msg)
    assert len(frames) == 1
    assert bytes(memoryview(frames[0])).hex() == hexed
    assert isinstance(CODEC.decode([bytes.fromhex(hexed)]), type(msg))


# -- SamplingParams.ignore_eos, appended: both directions stay readable --------

#: "generate" as written before ignore_eos was appended: sampling has 6 items (96).
BEFORE_IGNORE_EOS = (
    "98b9546f6b656e697a656447656e6572617465526571496e707574a27231c40c0100000002000000"
    "2c0100009608cb0000000000000000cb3ff000000000000000c0c0c2c2c0c0")


class SamplingBefore(msgspec.Struct, kw_only=True, array_like=True):
    """SamplingParams as a reader written before ``ignore_eos`` has it: six fields."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: bytes | None = None
    seed: int | None = None


def test_an_encoding_from_before_ignore_eos_decodes_with_it_false() -> None:
    back = CODEC.decode([bytes.fromhex(BEFORE_IGNORE_EOS)])
    assert isinstance(back, TokenizedGenerateReqInput)
    assert back.sampling == SamplingParams(max_new_tokens=8, temperature=0.0)
    assert back.sampling.ignore_eos is False


_OLD_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed")
#: The items appended after ignore_eos, at their defaults (guide, the penalties,
#: min_tokens, logit_bias, top_logprobs, prompt_logprobs).
_LATER = [None, 0.0, 0.0, 1.0, 0, None, 0, None]


@given(sampling=st.builds(
    SamplingParams, max_new_tokens=st.integers(0, 1 << 20), temperature=st.floats(0.0, 1e4),
    top_p=st.floats(1e-6, 1.0), top_k=st.integers(0, 1 << 20),
    stop_token_ids=st.none() | st.lists(st.integers(0, 2**32 - 1), max_size=8).map(token_ids),
    seed=st.none() | st.integers(0, 2**63 - 1), ignore_eos=st.booleans()))
@settings(max_examples=200, deadline=None)
def test_ignore_eos_is_one_item_appended_and_both_sides_read_each_other(
        sampling: SamplingParams) -> None:
    before = [getattr(sampling, name) for name in _OLD_FIELDS]
    before[4] = None if before[4] is None else bytes(before[4])
    msg = TokenizedGenerateReqInput(rid="r", input_ids=token_ids([1]), sampling=sampling)
    frame = bytes(memoryview(CODEC.encode(msg)[0]))
    # What we write is the old encoding with one more item (a bool) in sampling
    # (then the items appended after it, at their defaults: _LATER; and the
    # request's prefill_only, false).
    head = ["TokenizedGenerateReqInput", "r", token_ids([1]).tobytes()]
    assert frame == msgspec.msgpack.encode([*head, [*before, sampling.ignore_eos, *_LATER],
                                            False, False, None, None, False])
    # A reader from before ignore_eos reads everything else (the extra item ignored).
    sampling_item = msgspec.msgpack.encode([*before, sampling.ignore_eos])
    assert msgspec.msgpack.decode(sampling_item, type=SamplingBefore) == SamplingBefore(
        **dict(zip(_OLD_FIELDS, before, strict=True)))
    # A writer from before ignore_eos is read with it false.
    old = CODEC.decode([msgspec.msgpack.encode([*head, before, False, False, None, None])])
    assert isinstance(old, TokenizedGenerateReqInput)
    assert old.sampling == msgspec.structs.replace(sampling, ignore_eos=False)


# -- malformed input: a DecodeError, never anything else -----------------------

@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
@settings(max_examples=500, deadline=None)
def test_random_bytes_only_raise_decode_error(frames: list[bytes]) -> None:
    try:
        CODEC.decode(frames)
    except DecodeError:
        pass


@given(messages, st.data())
@settings(max_examples=200, deadline=None)
def test_truncated_or_flipped_frames_only_raise_decode_error(msg: Message, data: st.DataObject
                                                            ) -> None:
    frames = _bytes(CODEC.encode(msg))  # type: ignore[arg-type]
    i = data.draw(st.integers(0, len(frames) - 1))
    f = frames[i]
    if f:
        cut = data.draw(st.integers(0, len(f) - 1))
        flip = data.draw(st.booleans())
        frames[i] = (f[:cut] + bytes([f[cut] ^ 0xFF]) + f[cut + 1:]) if flip else f[:cut]
    try:
        CODEC.decode(frames)
    except DecodeError:
        pass


def _ext(code: int, dtype: int, shape: tuple[int, ...], tail: bytes) -> msgspec.msgpack.Ext:
    head = bytes([dtype, len(shape)]) + b"".join(d.to_bytes(8, "little", signed=True)
                                                 for d in shape)
    return msgspec.msgpack.Ext(code, head + tail)


def _embed_frame(ext: object) -> bytes:
    return msgspec.msgpack.encode(
        ["TokenizedGenerateReqInput", "bad-1", token_ids([1]).tobytes(), [], False,
         False, ext])


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ([], "no frames"),
        ([b"\xc1"], ""),
        ([msgspec.msgpack.encode(["NoSuchType", "x"])], "NoSuchType"),
        ([_embed_frame(_ext(3, 12, (1 << 40,), b""))], "needs"),  # 2^40 elements, no data
        ([_embed_frame(_ext(3, 12, (2, 2), b"\0" * 12))], "needs 16 bytes"),  # lying shape
        ([_embed_frame(_ext(3, 99, (2,), b"\0" * 8))], "dtype code 99"),  # unknown dtype
        ([_embed_frame(_ext(3, 12, (-2,), b""))], "negative"),
        ([_embed_frame(_ext(4, 12, (2,), (1).to_bytes(4, "little")))], "no tensor frames"),
        ([_embed_frame(_ext(4, 12, (2,), (5).to_bytes(4, "little"))), b"\0" * 8], "frame 5"),
        ([_embed_frame(_ext(4, 12, (4,), (1).to_bytes(4, "little"))), b"\0" * 8], "needs 16"),
        ([_embed_frame(None), b"\0" * 8], "1 tensor frames sent but 0 referenced"),
        ([_embed_frame(_ext(9, 12, (2,), b"\0" * 8))], "extension code 9"),
        ([_embed_frame(_ext(3, 12, (1,) * 40, b""))], "dimensions"),
    ],
)
def test_malformed_frames_are_decode_errors(frames: list[bytes], needle: str) -> None:
    with pytest.raises(DecodeError) as info:
        CODEC.decode(frames)
    assert needle in str(info.value)
    if frames and frames[0].startswith(b"\x97\xb9"):
        assert info.value.rid == "bad-1"
        if "frames sent" not in needle:
            assert "input_embeds" in info.value.reason


def test_bounds_are_enforced_both_ways() -> None:
    small = Codec(Message, max_frames=2, max_message_bytes=10_000)
    two = BatchEmbeddingOut(rids=["a", "b"], embeddings=torch.zeros(2, 4096))
    with pytest.raises(EncodeError, match="max_message_bytes"):
        small.encode(two)
    frames = CODEC.encode(two)
    with pytest.raises(DecodeError, match="max_message_bytes"):
        small.decode(frames)
    with pytest.raises(DecodeError, match="max_frames"):
        small.decode([frames[0], b"", b""])
