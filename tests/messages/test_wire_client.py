"""The wire as a client in another language sees it: raw sockets and the independent
``msgpack`` package, following ``docs/PROTOCOL.md`` alone (issue 22's findings).

One ``python -m scheduler serve`` serves the module. Every frame here is built
by ``msgpack.packb`` and every answer read by ``msgpack.unpackb``; nothing of
our codec is used on the client side.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import msgspec
import pytest
import zmq

from messages.rpc_api import RPC_METHODS, ModelInfoResult
from tests.scheduler.served import Served

_ids = itertools.count()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = Served(tmp_path_factory.mktemp("wire"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def schema() -> dict[str, object]:
    """The published schema, as a client gets it: ``python -m messages schema``."""
    out = subprocess.run([sys.executable, "-m", "messages", "schema"], check=True,
                         capture_output=True, timeout=120).stdout
    doc: dict[str, object] = json.loads(out)
    return doc


def _u32(values: list[int]) -> bytes:
    return b"".join(v.to_bytes(4, "little") for v in values)  # packed_u32: a bin of u32 LE


def _generate(rid: str, *, max_new: int = 4, stream: bool = False, logprob: bool = False,
              dp_rank: int | None = None) -> list[object]:
    # tag, rid, input_ids, sampling [max_new_tokens, temperature], stream, return_logprob,
    # input_embeds, dp_rank
    return ["TokenizedGenerateReqInput", rid, _u32([1, 2, 3]), [max_new, 0.0], stream, logprob,
            None, dp_rank]


def _pack(items: object) -> bytes:
    frame: bytes = msgpack.packb(items, use_bin_type=True)
    return frame


class Answers:
    """What ``out`` said about some rids: their batches (with or without logprobs) and ends."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.batches: dict[str, list[tuple[int, str | None]]] = {}  # (tokens, finish) per batch
        self.with_logprobs: dict[str, list[bool]] = {}  # one flag per batch naming the rid
        self.logprobs: dict[str, int] = {}  # how many logprobs each rid got
        self.ended: dict[str, tuple[str, str]] = {}  # rid -> (finish reason | code, message)


def _read(served: Served, rids: set[str], timeout: float = 60.0) -> Answers:
    """Read ``out`` until every rid in ``rids`` has its terminal answer."""
    got = Answers()
    deadline = time.monotonic() + timeout
    while not rids <= got.ended.keys():
        assert time.monotonic() < deadline, f"no terminal answer for {rids - got.ended.keys()}"
        if not served.out.poll(100):
            continue
        frame = served.out.recv_multipart()[0]
        msg = msgpack.unpackb(frame, raw=False)
        members = msg[1] if msg[0] == "Burst" else [msg]
        for m in members:
            if m[0] == "ErrorOut":
                got.ended[m[1]] = (m[2], m[3])
            elif m[0] == "BatchTokenIDOut":
                column, ids, lens, fins, lps = m[1], m[2], m[3], m[4], m[5]
                names = column[1:].split(column[0]) if column else []
                counts = [int.from_bytes(lens[i:i + 4], "little")
                          for i in range(0, len(lens), 4)]
                values = [int.from_bytes(ids[i:i + 4], "little") for i in range(0, len(ids), 4)]
                start = 0
                for rid, n, fin in zip(names, counts, fins, strict=True):
                    got.tokens.setdefault(rid, []).extend(values[start:start + n])
                    got.batches.setdefault(rid, []).append((n, fin))
                    start += n
                    got.with_logprobs.setdefault(rid, []).append(lps is not None)
                    if lps is not None:
                        got.logprobs[rid] = got.logprobs.get(rid, 0) + n
                    if fin is not None:
                        got.ended[rid] = (fin, "")
    return got


def _rpc(served: Served, method: str, params: dict[str, object],
         timeout: float = 60.0) -> list[object]:
    """One rpc over a raw DEALER: ``[tag, rid, success, message, result]``."""
    sock = served.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{served.dir}/rpc")
        rid = f"raw-rpc-{next(_ids)}"
        sock.send(_pack(["RpcReqInput", rid, method, params]))
        assert sock.poll(int(timeout * 1000)), f"no reply to {method}"
        reply: list[object] = msgpack.unpackb(sock.recv(), raw=False)
        assert reply[:2] == ["RpcReqOutput", rid], reply
        return reply
    finally:
        sock.close()


def test_logprobs_go_only_to_the_request_that_asked(served: Served) -> None:
    # One burst: both requests arrive in one poll, so they share every step.
    served.work.send(_pack(["Burst", [_generate("lp-yes", stream=True, logprob=True),
                                      _generate("lp-no", stream=True)]]))
    got = _read(served, {"lp-yes", "lp-no"})
    assert got.ended["lp-yes"][0] == got.ended["lp-no"][0] == "length"
    assert not any(got.with_logprobs["lp-no"]), "logprobs leaked to a request that never asked"
    assert all(got.with_logprobs["lp-yes"])
    assert got.logprobs["lp-yes"] == len(got.tokens["lp-yes"]) == 4


def test_an_unknown_tag_with_a_readable_rid_is_answered(served: Served) -> None:
    served.work.send(_pack(["NoSuchType", "p-tag", 1]))
    got = _read(served, {"p-tag"})
    code, message = got.ended["p-tag"]
    assert code == "decode_error" and "NoSuchType" in message


def test_an_rpc_call_on_the_work_channel_is_refused_not_run(served: Served,
                                                          tmp_path: Path) -> None:
    target = tmp_path / "never.ckpt"
    served.work.send(_pack(["RpcReqInput", "rpc-on-work", "save_checkpoint",
                            {"path": str(target)}]))
    got = _read(served, {"rpc-on-work"})
    code, message = got.ended["rpc-on-work"]
    assert code == "decode_error"
    assert "not carried on the 'work' channel" in message and "'rpc'" in message
    assert not target.exists(), "the call was executed"


def test_a_generate_request_on_the_rpc_channel_is_refused_and_answered(
        served: Served) -> None:
    sock = served.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{served.dir}/rpc")
        sock.send(_pack(_generate("gen-on-rpc")))
        got = _read(served, {"gen-on-rpc"})  # ErrorOut travels on `out`, as every ErrorOut
    finally:
        sock.close()
    code, message = got.ended["gen-on-rpc"]
    assert code == "decode_error"
    assert "not carried on the 'rpc' channel" in message and "'work'" in message
    text = "".join(_rpc(served, "metrics", {})[4]["text"])  # type: ignore[index]
    assert 'inbox="rpc",reason="wrong_channel"' in text, "the refusal was not counted"


def test_a_dp_rank_the_server_does_not_have_is_invalid(served: Served) -> None:
    served.work.send(_pack(_generate("dp-5", dp_rank=5)))
    served.work.send(_pack(_generate("dp-0", dp_rank=0, max_new=1)))
    got = _read(served, {"dp-5", "dp-0"})
    code, message = got.ended["dp-5"]
    assert code == "invalid_request" and "dp_rank=5" in message and "0..0" in message
    assert got.ended["dp-0"][0] == "length"


def test_model_info_says_what_a_client_may_send(served: Served) -> None:
    _tag, _rid, ok, message, result = _rpc(served, "model_info", {})
    assert ok, message
    info = msgspec.convert(result, ModelInfoResult)
    assert info.vocab_size == 512 and info.max_prompt_tokens > 0
    served.work.send(_pack(["TokenizedGenerateReqInput", "past-vocab",
                            _u32([info.vocab_size]), [1, 0.0]]))
    code, message = _read(served, {"past-vocab"}).ended["past-vocab"]
    assert code == "invalid_request" and str(info.vocab_size) in message


def test_an_unexpected_parameter_fails_the_call(served: Served) -> None:
    _tag, _rid, ok, message, _result = _rpc(served, "get_load", {"verbose": True})
    assert ok is False and "verbose" in str(message)


def test_every_rpc_result_matches_its_published_schema(served: Served, tmp_path: Path,
                                                       schema: dict[str, object]) -> None:
    """Each method's reply, read raw, against the result schema ``x-rpc`` publishes."""
    rpc = schema["x-rpc"]
    assert isinstance(rpc, dict)
    assert set(rpc) == {spec.name for spec in RPC_METHODS}
    layout = json.dumps(schema["x-layout"])
    params: dict[str, dict[str, object]] = {
        "hello": {"protocol_version": schema["x-protocol-version"],
                  "fingerprint": schema["x-fingerprint"], "layout": layout},
        "save_checkpoint": {"path": str(tmp_path / "w.ckpt")},
        "load_checkpoint": {"path": str(tmp_path / "w.ckpt")},
    }
    for spec in RPC_METHODS:
        if spec.name == "shutdown":
            continue  # it would end the module's server: tests/messages/test_rpc_api.py
        _tag, _rid, ok, message, result = _rpc(served, spec.name, params.get(spec.name, {}))
        assert ok, f"{spec.name}: {message}"
        assert rpc[spec.name]["result"] == {"$ref": f"#/$defs/{spec.result.__name__}"}
        msgspec.convert(result, spec.result)  # unknown keys and wrong types raise


def test_hello_fingerprint_computed_from_the_documented_recipe(
        served: Served, schema: dict[str, object]) -> None:
    """docs/PROTOCOL.md section 8: the exact bytes hashed, computed here without our code."""
    layout = schema["x-layout"]
    assert isinstance(layout, dict)
    text = json.dumps({"protocol_version": schema["x-protocol-version"],
                       "layout": {name: layout[name] for name in sorted(layout)}},
                      separators=(",", ":"), ensure_ascii=False)
    ours = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    assert ours == schema["x-fingerprint"]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()
    block = doc.split("### The fingerprint, byte for byte", 1)[1].split("```python\n", 1)[1]
    scope: dict[str, object] = {}
    exec(block.split("```", 1)[0], scope)  # the document's recipe, as written
    assert scope["fingerprint"](schema) == ours  # type: ignore[operator]
    _tag, _rid, ok, message, result = _rpc(served, "hello", {
        "protocol_version": schema["x-protocol-version"], "fingerprint": ours})
    assert ok, message
    assert isinstance(result, dict)
    assert result["fingerprint"] == ours and result["accepted"] is True


def test_hello_without_a_fingerprint_but_with_a_layout_is_answered(
        served: Served, schema: dict[str, object]) -> None:
    """A client that cannot hash sends the schema's layout instead (docs, section 8)."""
    _tag, _rid, ok, message, result = _rpc(served, "hello", {
        "protocol_version": schema["x-protocol-version"], "fingerprint": "",
        "layout": json.dumps(schema["x-layout"])})
    assert ok, message
    assert isinstance(result, dict) and result["accepted"] is True
    assert result["differences"] == []


def test_stream_semantics_as_documented(served: Served) -> None:
    """Not streamed: one batch at the end, every token. Streamed: one batch per step,
    the last token riding with the finish reason."""
    served.work.send(_pack(["Burst", [_generate("whole", max_new=3),
                                      _generate("steps", max_new=3, stream=True)]]))
    got = _read(served, {"whole", "steps"})
    assert got.batches["whole"] == [(3, "length")]
    assert got.batches["steps"] == [(1, None), (1, None), (1, "length")]
    assert got.tokens["whole"] == got.tokens["steps"]  # greedy: the same tokens


def test_a_stop_token_ends_the_request_and_is_not_in_output_ids(served: Served) -> None:
    served.work.send(_pack(_generate("free", max_new=4)))
    free = _read(served, {"free"}).tokens["free"]
    stop = free[2]
    cut = free[:free.index(stop)]
    served.work.send(_pack(["TokenizedGenerateReqInput", "stopped", _u32([1, 2, 3]),
                            [4, 0.0, 1.0, 0, _u32([stop])]]))
    got = _read(served, {"stopped"})
    assert got.ended["stopped"][0] == "stop"
    assert got.tokens["stopped"] == cut and stop not in got.tokens["stopped"]


def test_an_abort_ends_with_abort_and_one_of_an_unknown_rid_gets_nothing(
        served: Served) -> None:
    served.work.send(_pack(_generate("long", max_new=100000, stream=True)))
    deadline = time.monotonic() + 60
    got = Answers()
    while "long" not in got.tokens:  # running: it has streamed a token
        assert time.monotonic() < deadline
        if served.out.poll(100):
            msg = msgpack.unpackb(served.out.recv_multipart()[0], raw=False)
            for m in (msg[1] if msg[0] == "Burst" else [msg]):
                if m[0] == "BatchTokenIDOut" and "long" in m[1]:
                    got.tokens["long"] = []
    served.work.send(_pack(["AbortReq", "no-such-rid"]))
    served.work.send(_pack(["AbortReq", "long"]))
    served.work.send(_pack(_generate("after", max_new=1)))
    got = _read(served, {"long", "after"})
    assert got.ended["long"][0] == "abort"
    assert "no-such-rid" not in got.ended and "no-such-rid" not in got.tokens


def test_the_dispatcher_keeps_the_same_doors(tmp_path: Path) -> None:
    # Its work inbox decoded every request type: an rpc sent there was broadcast
    # to the replicas, and its reply could go nowhere.
    target = tmp_path / "never.ckpt"
    served = Served(tmp_path, "--dp", "2")
    try:
        served.work.send(_pack(["RpcReqInput", "dp-rpc-on-work", "save_checkpoint",
                                {"path": str(target)}]))
        code, message = _read(served, {"dp-rpc-on-work"}).ended["dp-rpc-on-work"]
        assert code == "decode_error" and "not carried on the 'work' channel" in message
        assert not target.exists(), "the call was executed"
    finally:
        served.close()
