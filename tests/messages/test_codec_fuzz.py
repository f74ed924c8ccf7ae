"""Only ``DecodeError`` leaves ``Codec.decode``; ``Codec.validate`` checks by-reference messages.

A fast, deterministic slice of ``benchmarks/_fuzz.py`` (which runs 200,000
cases), plus the concrete frames that once escaped as something else.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from messages import (
    AbortReq,
    Codec,
    DecodeError,
    Message,
    Request,
    RpcReqInput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from tests.messages.strategies import messages

CODEC: Codec[Message] = Codec(
    Message, types=[t for t in Codec(Message).types if not t.__module__.startswith("tests")])
REQUESTS: Codec[Request] = Codec(Request)

#: Bytes a msgpack parser reads as structure (see ``benchmarks/_fuzz.py``).
INTERESTING = [0xC1, 0xDC, 0xDD, 0xDE, 0xDF, *range(0x90, 0xA0), *range(0xA0, 0xC0),
               *range(0xCC, 0xD4)]


def _only_decode_error(codec: Codec[Message] | Codec[Request], frames: list[bytes]) -> None:
    try:
        codec.decode(frames)
    except DecodeError as exc:
        assert isinstance(exc.reason, str)
        assert exc.rid is None or isinstance(exc.rid, str)


@st.composite
def mutated_frames(draw: st.DrawFn) -> list[bytes]:
    """A valid message's frames with one to three byte- or frame-level edits."""
    frames = [bytes(memoryview(f)) for f in CODEC.encode(draw(messages))]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "byte", "cut", "insert", "splice", "drop", "dup",
                                   "add"]))
        if op in ("drop", "dup") and frames:
            k = draw(st.integers(0, len(frames) - 1))
            frames[k:k + 1] = [] if op == "drop" else [frames[k], frames[k]]
            continue
        if op == "add" or not frames:
            frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=64)))
            continue
        k = 0 if len(frames) == 1 else draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[k])
        i = draw(st.integers(0, max(len(f) - 1, 0)))
        if op == "flip" and f:
            f[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and f:
            f[i] = draw(st.sampled_from(INTERESTING) | st.integers(0, 255))
        elif op == "cut":
            del f[i:]
        elif op == "insert":
            f[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "splice":
            other = frames[draw(st.integers(0, len(frames) - 1))]
            f = f[:i] + other[draw(st.integers(0, len(other))):]
        frames[k] = bytes(f)
    return frames


@given(mutated_frames())
@settings(derandomize=True, max_examples=300, deadline=None)
def test_mutated_frames_only_raise_decode_error(frames: list[bytes]) -> None:
    _only_decode_error(CODEC, frames)
    _only_decode_error(REQUESTS, frames)


@given(st.lists(st.binary(max_size=300), min_size=0, max_size=5))
@settings(derandomize=True, max_examples=300, deadline=None)
def test_random_frame_lists_only_raise_decode_error(frames: list[bytes]) -> None:
    _only_decode_error(CODEC, frames)
    _only_decode_error(REQUESTS, frames)


@given(st.lists(st.sampled_from(INTERESTING) | st.integers(0, 255), max_size=64).map(bytes))
@settings(derandomize=True, max_examples=200, deadline=None)
def test_structure_bytes_only_raise_decode_error(frame: bytes) -> None:
    _only_decode_error(REQUESTS, [b"\x94\xabRpcReqInput\xa2r1" + frame])


BAD_ITEMS: list[list[object]] = [
    ["RpcReqInput", "q-1", "m", {"k": [1]}],
    ["RpcReqInput", "q-1", "m", {"k": {}}],
    ["TokenizedGenerateReqInput", "q-1", b"", [5, 1.0, 2.0]],
    ["AbortReq", 5],
]


@given(st.sampled_from(BAD_ITEMS), st.binary(min_size=1, max_size=16))
@settings(derandomize=True, max_examples=50, deadline=None)
def test_constraint_breaking_frame_with_trailing_bytes_only_raises_decode_error(
    items: list[object], tail: bytes
) -> None:
    # msgspec reports the broken field before it sees the trailing bytes, so
    # naming runs on a frame that cannot be parsed whole: where the walk once
    # guessed a type and crashed.
    _only_decode_error(REQUESTS, [msgspec.msgpack.encode(items) + tail])


# -- regressions: frames that once escaped as something else -------------------

#: A 35-byte mutation of a valid RpcReqInput that made decode raise a plain
#: ValueError: with trailing bytes, the field-naming walk could not read the
#: value, fell back to the first union member and ran ``int("...")``.
ESCAPED_VALUE_ERROR = (b"\x94\xabRpcReqInput\xa2r1\xa3get\x82\xa1n\x03\xa1f\x91?\xe0"
                       b"\x00\x00\x00\x00\x00\x00")


@pytest.mark.parametrize("codec", [CODEC, REQUESTS], ids=["message", "request"])
def test_frame_that_escaped_as_value_error_is_a_decode_error(
    codec: Codec[Message] | Codec[Request],
) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode([ESCAPED_VALUE_ERROR])
    assert "Expected" in info.value.reason


class _Exploding:
    """Stands in for msgspec's decoder, failing with what no helper expects."""

    def decode(self, buf: object) -> object:
        raise KeyError("boom")


def test_any_failure_inside_decode_leaves_as_decode_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec: Codec[Request] = Codec(Request)
    monkeypatch.setattr(codec, "_single", _Exploding())
    frame = bytes(memoryview(codec.encode(AbortReq(rid="r-9"))[0]))
    with pytest.raises(DecodeError) as info:
        codec.decode([frame])
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.rid == "r-9" and info.value.message_type == "AbortReq"


def test_naming_that_fails_falls_back_to_msgspec_text(monkeypatch: pytest.MonkeyPatch) -> None:
    codec: Codec[Request] = Codec(Request)

    def broken(tag: str | None, reason: str) -> str:
        raise IndexError("naming bug")

    monkeypatch.setattr(codec._namer, "name_field", broken)
    frame = msgspec.msgpack.encode(["RpcReqInput", "r1", "1bad", {}])
    with pytest.raises(DecodeError) as info:
        codec.decode([frame])
    assert info.value.reason.endswith("- at `$[2]`") and info.value.rid == "r1"


IDS = np.arange(4, dtype=np.uint32).tobytes()


@pytest.mark.parametrize(
    ("items", "field"),
    [
        (["TokenizedGenerateReqInput", "q-1", IDS, [5, 1.0, 2.0]], "sampling.top_p"),
        (["TokenizedGenerateReqInput", "q-1", IDS, [5, -1.0]], "sampling.temperature"),
        (["TokenizedGenerateReqInput", "q-1", IDS, [-5]], "sampling.max_new_tokens"),
        (["RpcReqInput", "q-1", "1bad", {}], "method"),
        (["RpcReqInput", "q-1", "m", {"k" * 200: 1}], "parameters"),
        (["RpcReqInput", "q-1", "m", {"k": [1]}], "parameters[...]"),
        (["TokenizedEmbeddingReqInput", "q-1", 7], "input_ids"),
    ],
)
def test_constraint_breaking_frame_names_its_field(items: list[object], field: str) -> None:
    frame = msgspec.msgpack.encode(items)
    for _ in range(2):  # the second time the name comes from the cache
        with pytest.raises(DecodeError) as info:
            REQUESTS.decode([frame])
        assert info.value.reason.startswith(f"{field}: "), info.value.reason
        assert info.value.rid == "q-1" and info.value.message_type == items[0]


def test_unknown_tag_names_the_message_type() -> None:
    with pytest.raises(DecodeError) as info:
        REQUESTS.decode([msgspec.msgpack.encode(["NoSuchType", "q-1"])])
    assert info.value.reason.startswith("message type: ")
    # Item 1 is where every request keeps its rid: an unknown type's is read
    # there, so its sender can be answered (docs/PROTOCOL.md, section 7).
    assert info.value.message_type == "NoSuchType" and info.value.rid == "q-1"
    with pytest.raises(DecodeError) as info:  # item 1 not a rid: nobody to answer
        REQUESTS.decode([msgspec.msgpack.encode(["NoSuchType", 7])])
    assert info.value.rid is None


def test_field_name_cache_is_bounded() -> None:
    codec: Codec[Request] = Codec(Request)
    for i in range(10_000):  # a sender choosing a new path each time
        codec._namer.name_field("RpcReqInput", f"Expected `str` - at `$[3][{i}]`")
    assert 0 < len(codec._namer.names) <= 4096


# -- validate(): the checks a decoded message gets, for messages by reference ---

def _generate(rid: str = "v-1", **sampling: object) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=token_ids(range(16)),
                                     sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (_generate(rid="\ud800"), "rid"),  # a lone surrogate: not UTF-8, cannot be encoded
        (_generate(rid="r" * 300), "rid"),  # past max_length=256
        (_generate(seed=2**64), "sampling.seed"),  # past what msgpack can carry
        (_generate(seed=2**63), "sampling.seed"),  # encodable, past the constraint
        (_generate(top_p=2.0), "sampling.top_p"),
        (RpcReqInput(rid="v-2", method="1bad"), "method"),
    ],
    ids=["surrogate-rid", "long-rid", "seed-2**64", "seed-2**63", "top_p", "method"],
)
def test_validate_raises_decode_error_with_the_callers_rid(msg: Request, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        REQUESTS.validate(msg)
    assert info.value.rid == msg.rid
    assert info.value.message_type == type(msg).__name__
    assert info.value.reason.startswith(f"{field}: "), info.value.reason


@pytest.mark.parametrize(
    "msg",
    [
        _generate(max_new_tokens=64, temperature=0.5, top_p=0.9, top_k=5,
                  stop_token_ids=token_ids([2]), seed=7),
        TokenizedEmbeddingReqInput(rid="e", input_ids=token_ids([1, 2])),
        AbortReq(rid="a"),
        RpcReqInput(rid="c", method="get_load", parameters={"x": 1.5}),
    ],
    ids=lambda m: type(m).__name__,
)
def test_valid_message_validates_to_an_equal_message(msg: Request) -> None:
    back = REQUESTS.validate(msg)
    assert type(back) is type(msg) and back == msg


def test_validate_does_not_copy_a_large_tensor() -> None:
    embeds = torch.randn(64, 64)  # 16 KiB: out of band
    msg = TokenizedGenerateReqInput(rid="big", input_ids=token_ids([1]), input_embeds=embeds)
    back = REQUESTS.validate(msg)
    assert isinstance(back, TokenizedGenerateReqInput) and back.input_embeds is not None
    assert back.input_embeds.data_ptr() == embeds.data_ptr()
