"""The ``hello`` handshake: both sides' answers, in process and against a real ``serve``.

Also the wire as an outside client sees it: a generate request encoded with
the independent ``msgpack`` package, following docs/PROTOCOL.md, is served
end to end and its outputs are read back with ``msgpack`` too.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from messages import (
    PROTOCOL_VERSION,
    ProtocolMismatch,
    RpcReqInput,
    compare_layouts,
    layout_from_json,
    layout_to_json,
    wire_layout,
)
from scheduler import RpcMethods, hello
from scheduler import handshake as hs
from tests.scheduler.served import Served as ServedBase


def _layout_with(edit: str) -> str:
    """Our layout JSON, edited as an older or newer client would have it."""
    layout = json.loads(layout_to_json(wire_layout()))
    fields = layout["TokenizedGenerateReqInput"]["fields"]
    if edit == "extra_optional_at_end":  # the client is one optional field ahead
        fields.append({"name": "priority", "type": "int|null", "required": False})
    elif edit == "field_removed_in_middle":  # the client lacks `stream`
        del fields[3]
    return json.dumps(layout)


def _ask(params: dict[str, object]) -> dict[str, object]:
    reply = RpcMethods().answer(RpcReqInput(rid="h1", method="hello", parameters=params))  # type: ignore[arg-type]
    assert reply.success, reply.message
    assert reply.result is not None
    return dict(reply.result)


def test_same_fingerprint_is_accepted_without_a_layout() -> None:
    fp, _ = hs.local_protocol()
    result = _ask({"protocol_version": PROTOCOL_VERSION, "fingerprint": fp})
    assert result == {"protocol_version": PROTOCOL_VERSION, "fingerprint": fp, "accepted": True}


def test_compatible_difference_is_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="scheduler.handshake"):
        result = _ask({"protocol_version": PROTOCOL_VERSION, "fingerprint": "0" * 16,
                       "layout": _layout_with("extra_optional_at_end")})
    assert result["accepted"] is True
    # The client is ahead by an optional trailing field: we ignore the item it sends.
    assert result["differences"] == [
        "compatible: TokenizedGenerateReqInput.priority: optional field appended (int|null) "
        "on the peer's side only"]
    assert "compatible differences" in caplog.text and "priority" in caplog.text


def test_breaking_difference_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="scheduler.handshake"):
        result = _ask({"protocol_version": PROTOCOL_VERSION, "fingerprint": "0" * 16,
                       "layout": _layout_with("field_removed_in_middle")})
    assert result["accepted"] is False
    differences = result["differences"]
    assert isinstance(differences, list)
    assert any("TokenizedGenerateReqInput.stream" in str(d) and str(d).startswith("breaking")
               for d in differences)
    assert "hello refused" in caplog.text and "TokenizedGenerateReqInput.stream" in caplog.text
    assert isinstance(result["layout"], str)
    assert layout_from_json(result["layout"]) == wire_layout()  # the client can compare too


def test_other_protocol_version_is_refused() -> None:
    fp, _ = hs.local_protocol()
    result = _ask({"protocol_version": PROTOCOL_VERSION + 1, "fingerprint": fp})
    assert result["accepted"] is False
    assert "protocol version" in str(result["differences"])


def test_bad_hello_parameters_answer_failure() -> None:
    reply = RpcMethods().answer(RpcReqInput(rid="h2", method="hello",
                                            parameters={"protocol_version": 1,
                                                        "fingerprint": "x"}))
    assert not reply.success and "no layout" in reply.message
    reply = RpcMethods().answer(RpcReqInput(rid="h3", method="hello",
                                            parameters={"protocol_version": 1,
                                                        "fingerprint": "x", "layout": "[]"}))
    assert not reply.success
    fp, _ = hs.local_protocol()
    for version in (True, float(PROTOCOL_VERSION), str(PROTOCOL_VERSION)):  # not an int
        reply = RpcMethods().answer(RpcReqInput(rid="h4", method="hello", parameters={
            "protocol_version": version, "fingerprint": fp}))
        assert not reply.success and "protocol_version (int)" in reply.message


def test_compare_direction_client_is_old_scheduler_is_new() -> None:
    diffs = compare_layouts(layout_from_json(_layout_with("field_removed_in_middle")),
                            wire_layout())
    assert [(d.type, d.field, d.breaking) for d in diffs] == [
        ("TokenizedGenerateReqInput", "stream", True)]


# -- against a real `serve` -----------------------------------------------------------


class Served(ServedBase):
    """A plain ``serve``, answering rpc already."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        assert self.rpc.call("get_load", timeout=120).success  # serving


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("handshake"))
    try:
        yield s
    finally:
        s.close()


def test_hello_against_serve_is_accepted(served: Served) -> None:
    reply = hello(served.rpc, 30)
    fp, _ = hs.local_protocol()
    assert reply.protocol_version == PROTOCOL_VERSION and reply.fingerprint == fp
    assert reply.differences == ()


def test_hello_with_a_breaking_layout_raises_naming_type_and_field(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    # This process plays a client one field behind: only its side is patched.
    monkeypatch.setattr(hs, "local_protocol",
                        lambda: ("0" * 16, _layout_with("field_removed_in_middle")))
    with pytest.raises(ProtocolMismatch) as info:
        hello(served.rpc, 30)
    assert any("TokenizedGenerateReqInput.stream" in d for d in info.value.differences)
    assert "TokenizedGenerateReqInput.stream" in str(info.value)
    assert str(served.dir) in info.value.peer
    monkeypatch.undo()
    assert hello(served.rpc, 30).differences == ()  # the scheduler serves on


def test_hello_with_a_compatible_layout_is_allowed(served: Served,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fields = json.loads(_layout_with(""))
    fields["RpcReqOutput"]["fields"].pop()  # the client predates RpcReqOutput.result
    monkeypatch.setattr(hs, "local_protocol", lambda: ("1" * 16, json.dumps(fields)))
    reply = hello(served.rpc, 30)
    assert reply.differences == (
        "compatible: RpcReqOutput.result: optional field appended "
        "(map[str,null|bool|int|float|str|list[null|bool|int|float|str]]|null)",)


def test_msgpack_client_following_protocol_md_is_served(served: Served) -> None:
    """A generate request built with `msgpack` alone, as docs/PROTOCOL.md describes it."""
    ids = b"".join(i.to_bytes(4, "little") for i in (1, 2, 3))  # packed_u32: u32 LE in a bin
    sampling = [4, 0.0]  # max_new_tokens, temperature; the rest omitted (defaults)
    frame = msgpack.packb(["TokenizedGenerateReqInput", "mp-1", ids, sampling, False, False,
                           None], use_bin_type=True)
    served.work.send(frame)
    tokens: list[int] = []
    finished = None
    deadline = time.monotonic() + 60
    while finished is None:
        assert time.monotonic() < deadline, "no answer"
        if not served.out.poll(100):
            continue
        frames = served.out.recv_multipart()
        assert len(frames) == 1  # no tensor: one header frame
        msg = msgpack.unpackb(frames[0], raw=False)
        assert msg[0] != "ErrorOut", msg
        if msg[0] != "BatchTokenIDOut":
            continue
        _tag, rids_column, output_ids, output_lens, finished_reasons = msg[:5]
        sep = rids_column[0]
        rids = rids_column[1:].split(sep)
        lens = [int.from_bytes(output_lens[i:i + 4], "little")
                for i in range(0, len(output_lens), 4)]
        ids_out = [int.from_bytes(output_ids[i:i + 4], "little")
                   for i in range(0, len(output_ids), 4)]
        start = 0
        for rid, n, fin in zip(rids, lens, finished_reasons, strict=True):
            if rid == "mp-1":
                tokens.extend(ids_out[start:start + n])
                finished = fin if fin is not None else finished
            start += n
    assert finished == "length" and len(tokens) == 4
