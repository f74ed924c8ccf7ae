from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from messages import (
    MAX_TOKENS,
    BatchTokenIDOut,
    Codec,
    DecodeError,
    Message,
    RidColumn,
    RpcReqInput,
    SamplingParams,
    TokenizedGenerateReqInput,
    packed_u32,
    token_ids,
)


def test_token_ids_normalizes_and_validates() -> None:
    ids = token_ids([1, 2, 3])
    assert ids.format == "I" and ids.tolist() == [1, 2, 3]
    assert token_ids(ids) is ids  # the decode path: no copy, no scan
    a = np.arange(4, dtype=np.uint32)
    assert np.frombuffer(token_ids(a), np.uint32).tolist() == [0, 1, 2, 3]
    assert token_ids(memoryview(a.tobytes())).tolist() == [0, 1, 2, 3]  # bytes as decoded
    with pytest.raises(ValueError, match="whole number"):
        token_ids(memoryview(b"abc"))
    with pytest.raises(ValueError, match="negative"):
        token_ids([1, -2])
    with pytest.raises(ValueError, match="1-D"):
        token_ids(np.zeros((2, 2), np.uint32))
    with pytest.raises(ValueError, match="integers"):
        token_ids([1.5])
    with pytest.raises(ValueError, match="outside uint32"):
        token_ids([1 << 33])
    with pytest.raises(ValueError, match="past uint32"):
        token_ids(np.array([1 << 33]))
    with pytest.raises(ValueError, match="negative"):
        token_ids(np.array([3, -1]))
    assert token_ids([]).shape == (0,)


def test_request_accepts_lists_at_runtime() -> None:
    req = TokenizedGenerateReqInput(rid="a", input_ids=[5, 6])  # type: ignore[arg-type]
    assert req.input_ids.format == "I" and req.input_ids.tolist() == [5, 6]
    packed = token_ids([7, 8])
    assert TokenizedGenerateReqInput(rid="b", input_ids=packed).input_ids is packed
    as_bytes = TokenizedGenerateReqInput(rid="c", input_ids=memoryview(packed.tobytes()))
    assert as_bytes.input_ids.format == "I" and as_bytes.input_ids.tolist() == [7, 8]
    with pytest.raises(ValueError, match=r"input_ids.*whole number"):
        TokenizedGenerateReqInput(rid="d", input_ids=memoryview(b"abcde"))
    # A view of signed bytes holds one id per byte, never four bytes read as one id.
    signed = memoryview(np.array([1, 2, 3, 4], np.int8).tobytes()).cast("b")
    assert TokenizedGenerateReqInput(rid="s", input_ids=signed).input_ids.tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"input_ids.*negative"):
        TokenizedGenerateReqInput(rid="e", input_ids=np.array([1, -1]))  # type: ignore[arg-type]


def test_received_token_ids_are_bounded_and_whole() -> None:
    # The decoder's checks, in C: at most MAX_TOKENS ids, whole uint32 values.
    codec: Codec[Message] = Codec(Message, max_message_bytes=1 << 24)
    too_many = memoryview(bytes(4 * MAX_TOKENS + 4))
    with pytest.raises(ValueError, match="input_ids holds 1048577 values"):
        TokenizedGenerateReqInput(rid="big", input_ids=too_many)  # refused where made, too
    big = msgspec.msgpack.encode(["TokenizedGenerateReqInput", "big", too_many])
    with pytest.raises(DecodeError, match="input_ids") as info:
        codec.decode([big])
    assert info.value.rid == "big"
    odd = msgspec.msgpack.encode(["TokenizedGenerateReqInput", "odd", b"abcde"])
    with pytest.raises(DecodeError, match=r"input_ids.*whole number") as info:
        codec.decode([odd])
    assert info.value.rid == "odd"
    # In a burst, the ragged member is refused alone, by its rid (the codec's
    # cold path), and the others decode with their ids as uint32.
    good = codec.encode(TokenizedGenerateReqInput(rid="good", input_ids=token_ids([5, 6])))[0]
    burst = b"\x92\xa5Burst\x93" + bytes(good) + odd + bytes(good)
    with pytest.raises(DecodeError):
        codec.decode_any([burst])
    members = codec.decode_members([burst])
    assert isinstance(members[1], DecodeError) and members[1].rid == "odd"
    assert [m.input_ids.tolist() for m in (members[0], members[2])] == [[5, 6], [5, 6]]  # type: ignore[union-attr]
    ok = codec.decode(codec.encode(TokenizedGenerateReqInput(rid="ok", input_ids=token_ids([3]))))
    assert ok.input_ids.format == "I" and ok.input_ids.tolist() == [3]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ([5, -1.0], "sampling.temperature"),
        ([5, math.inf], "sampling.temperature"),
        ([5, math.nan], "sampling.temperature"),
        ([5, 1.0, 0.0], "sampling.top_p"),
        ([5, 1.0, 1.5], "sampling.top_p"),
        ([-1], "sampling.max_new_tokens"),
        ([5, 1.0, 1.0, -3], "sampling.top_k"),
    ],
)
def test_constraints_fail_at_decode_naming_the_field(sampling: list[object], field: str) -> None:
    codec = Codec(Message)
    ids = np.arange(3, dtype=np.uint32).tobytes()
    frame = msgspec.msgpack.encode(["TokenizedGenerateReqInput", "req-7", ids, sampling])
    with pytest.raises(DecodeError) as info:
        codec.decode([frame])
    assert info.value.rid == "req-7"
    assert info.value.reason.startswith(field), info.value.reason
    assert info.value.message_type == "TokenizedGenerateReqInput"


def test_rpc_method_must_be_an_identifier() -> None:
    codec = Codec(Message)
    frame = msgspec.msgpack.encode(["RpcReqInput", "r1", "os.system('x')", {}])
    with pytest.raises(DecodeError, match="method"):
        codec.decode([frame])
    ok = codec.decode(codec.encode(RpcReqInput(rid="r1", method="save_checkpoint",
                                                parameters={"path": "/tmp/x"})))
    assert isinstance(ok, RpcReqInput) and ok.parameters == {"path": "/tmp/x"}


def test_batch_columns_are_checked() -> None:
    with pytest.raises(ValueError, match="add up"):
        BatchTokenIDOut(rids=["a"], output_ids=token_ids([1, 2]),
                        output_lens=token_ids([1]), finished_reasons=[None])
    with pytest.raises(ValueError, match="finished_reasons"):
        BatchTokenIDOut(rids=["a"], output_ids=token_ids([1]),
                        output_lens=token_ids([1]), finished_reasons=[])
    out = BatchTokenIDOut.from_lists(["a", "b"], [[1, 2], [3]], [None, "stop"],
                                     logprobs=[[-0.1, -0.2], [-0.3]])
    items = [(rid, ids.tolist(), fin) for rid, ids, fin in out.items()]
    assert items == [("a", [1, 2], None), ("b", [3], "stop")]
    lps = [lp.tolist() for _, lp in out.logprobs_items()]
    assert lps[0] == pytest.approx([-0.1, -0.2]) and lps[1] == pytest.approx([-0.3])


def test_sampling_defaults() -> None:
    sp = SamplingParams()
    assert sp.stop_token_ids is None and sp.top_k == 0 and sp.top_p == 1.0


# -- the rid column: one string on the wire, str objects on first read ---------

def test_rid_column_round_trips_and_reads_like_a_list() -> None:
    codec = Codec(BatchTokenIDOut)
    out = BatchTokenIDOut.from_lists(["a", "bb", "c"], [[1], [2, 3], []], [None, "stop", None])
    back = codec.decode(codec.encode(out))
    assert isinstance(back.rids, RidColumn)
    assert len(back.rids) == 3 and back.rids == ["a", "bb", "c"] and back.rids == out.rids
    assert list(back.rids) == ["a", "bb", "c"] and back.rids[1] == "bb" and "c" in back.rids
    assert back.rids[1:] == ["bb", "c"] and back.rids.tolist() == ["a", "bb", "c"]
    assert [rid for rid, _, _ in back.items()] == ["a", "bb", "c"]


def test_rid_column_picks_another_separator_when_a_rid_holds_nul() -> None:
    codec = Codec(BatchTokenIDOut)
    rids = ["a\x00b", "\x01", "c"]
    out = BatchTokenIDOut.from_lists(rids, [[1], [2], [3]], [None, None, None])
    assert out.rids.wire[0] not in "".join(rids)  # type: ignore[attr-defined]
    assert codec.decode(codec.encode(out)).rids == rids


def test_rid_column_empty_batch() -> None:
    codec = Codec(BatchTokenIDOut)
    out = BatchTokenIDOut.from_lists([], [], [])
    back = codec.decode(codec.encode(out))
    assert len(back.rids) == 0 and back.rids == [] and list(back.rids) == []


@pytest.mark.parametrize("rids", [[""], ["x" * 257], [3]])
def test_rid_column_refuses_a_bad_rid_at_build(rids: list[str]) -> None:
    with pytest.raises(ValueError, match=r"rids\[0\]"):
        RidColumn(rids)


def test_rid_column_count_must_match_the_batch() -> None:
    codec = Codec(BatchTokenIDOut)
    good = codec.encode(BatchTokenIDOut.from_lists(["a", "b"], [[1], [2]], [None, None]))
    bad = bytes(good[0]).replace(b"\xa4\x00a\x00b", b"\xa2\x00a", 1)
    with pytest.raises(DecodeError, match="output_lens has 2 entries for 1 rids"):
        codec.decode([bad])


def test_rid_column_refuses_an_oversized_column() -> None:
    with pytest.raises(ValueError, match="longer than 256"):
        RidColumn.from_wire("\x00" + "x" * 300)


@given(st.lists(st.text(min_size=1, max_size=20), max_size=40))
def test_rid_column_round_trips_any_rids(rids: list[str]) -> None:
    column = RidColumn(rids)
    back = RidColumn.from_wire(column.wire)
    assert back == rids and len(back) == len(rids) and list(back) == rids


@given(st.lists(st.tuples(st.lists(st.integers(0, 1000), max_size=4), st.booleans()),
                max_size=20))
def test_select_keeps_the_marked_requests_whole(rows: list[tuple[list[int], bool]]) -> None:
    batch = BatchTokenIDOut.from_lists([f"r{i}" for i in range(len(rows))],
                                       [ids for ids, _ in rows], [None] * len(rows),
                                       [[float(t) for t in ids] for ids, _ in rows])
    kept = batch.select([k for _, k in rows])
    expected = [(f"r{i}", ids) for i, (ids, k) in enumerate(rows) if k]
    assert [(rid, list(ids)) for rid, ids, _ in kept.items()] == expected
    assert kept.logprobs is not None
    assert [list(lp) for _, lp in kept.logprobs_items()] == [
        [float(t) for t in ids] for _, ids in expected]


def test_select_carries_each_requests_top_and_prompt_logprobs() -> None:
    """A replica's batch split by rid (dp, backpressure) keeps each request's
    alternatives and prompt logprobs with it."""
    batch = BatchTokenIDOut(
        rids=["a", "b"], output_ids=packed_u32([1, 2, 3]), output_lens=packed_u32([1, 2]),
        finished_reasons=[None, "stop"], logprobs=np.asarray([-1, -2, -3], np.float32),
        top_ids=packed_u32([10, 11, 20, 21, 30, 31]),
        top_logprobs=np.arange(6, dtype=np.float64),
        prompt_lens=packed_u32([2, 1]), prompt_logprobs=np.asarray([-4, -5, -6], np.float64),
        prompt_top_ids=packed_u32([7, 8, 9]),
        prompt_top_logprobs=np.asarray([-0.5, -0.25, -0.125], np.float64))
    b = batch.select([False, True])
    assert b.top_ids is not None and list(b.top_ids) == [20, 21, 30, 31] and b.top_k() == 2
    assert b.top_logprobs is not None and b.top_logprobs.tolist() == [2, 3, 4, 5]
    assert b.prompt_lens is not None and list(b.prompt_lens) == [1]
    assert b.prompt_logprobs is not None and b.prompt_logprobs.tolist() == [-6]
    assert b.prompt_top_ids is not None and list(b.prompt_top_ids) == [9]
    with pytest.raises(ValueError, match="k entries"):
        BatchTokenIDOut(rids=["a"], output_ids=packed_u32([1, 2]), output_lens=packed_u32([2]),
                        finished_reasons=[None], logprobs=np.zeros(2, np.float32),
                        top_ids=packed_u32([1, 2, 3]), top_logprobs=np.zeros(3, np.float64))
