"""``RpcMethods.answer``: every reply fits the wire, whatever the method says or returns."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from messages import MAX_TEXT, Codec, Message, RpcReqInput, RpcReqOutput, RpcResult
from scheduler import Engine, ModelConfig, RpcMethods

WIRE: Codec[Message] = Codec(Message, types=[RpcReqOutput])
MARKER = " chars in all]"


def _round_trip(reply: RpcReqOutput) -> RpcReqOutput:
    got = WIRE.decode(WIRE.encode(reply))
    assert isinstance(got, RpcReqOutput)
    return got


def _raise_long() -> RpcResult:
    raise RuntimeError("x" * 100_000)


def _raise_surrogate() -> RpcResult:
    raise RuntimeError("bad byte \udc80 in a path")


def _long_string() -> RpcResult:
    return {"s": "y" * 70_000}


def _long_list() -> RpcResult:
    return {"a": list(range(70_000))}


def _long_key() -> RpcResult:
    return {"k" * 300: 1}


def _nested() -> RpcResult:
    return {"a": {"b": 1}}  # type: ignore[dict-item]


def _fine(x: int = 0) -> RpcResult:
    return {"x": x, "names": ["a", "b"]}


@pytest.fixture
def methods() -> RpcMethods:
    m = RpcMethods()
    for fn in (_raise_long, _raise_surrogate, _long_string, _long_list, _long_key, _nested,
               _fine):
        m.register(fn.__name__.lstrip("_"), fn)
    return m


def _ask(methods: RpcMethods, method: str, **params: int) -> RpcReqOutput:
    return methods.answer(RpcReqInput(rid="r-1", method=method, parameters=dict(params)))


def test_a_fitting_result_is_sent_as_is(methods: RpcMethods) -> None:
    reply = _ask(methods, "fine", x=3)
    assert reply == RpcReqOutput(rid="r-1", success=True, message="ok",
                                 result={"x": 3, "names": ["a", "b"]})
    assert _round_trip(reply) == reply


def test_long_exception_message_is_truncated_to_fit(methods: RpcMethods) -> None:
    reply = _ask(methods, "raise_long")
    assert not reply.success
    assert reply.message.startswith("raise_long failed: RuntimeError: xxx")
    assert len(reply.message) <= MAX_TEXT == 1 << 16
    assert reply.message.endswith(MARKER) and "truncated" in reply.message
    assert _round_trip(reply) == reply


@pytest.mark.parametrize("method", ["long_string", "long_list", "long_key", "nested"])
def test_a_result_that_cannot_cross_the_wire_answers_failure(methods: RpcMethods,
                                                             method: str) -> None:
    reply = _ask(methods, method)
    assert not reply.success and reply.result is None
    assert "does not fit" in reply.message and method in reply.message
    assert _round_trip(reply) == reply


def test_unknown_method_with_a_huge_name_still_fits(methods: RpcMethods) -> None:
    # The codec refuses such a name at decode; answer() must cope all the same.
    reply = methods.answer(RpcReqInput(rid="r-1", method="m" * 70_000, parameters={}))
    assert not reply.success and reply.message.startswith("unknown rpc method 'mmm")
    assert len(reply.message) <= MAX_TEXT and reply.message.endswith(MARKER)
    assert _round_trip(reply) == reply


def test_bad_parameters_echo_fits(methods: RpcMethods) -> None:
    reply = methods.answer(RpcReqInput(rid="r-1", method="fine",
                                       parameters={"z" * 70_000: 1}))
    assert not reply.success and reply.message.startswith("bad parameters for 'fine'")
    assert len(reply.message) <= MAX_TEXT
    assert _round_trip(reply) == reply


def test_lone_surrogate_in_exception_still_encodes(methods: RpcMethods) -> None:
    reply = _ask(methods, "raise_surrogate")
    assert not reply.success
    assert reply.message == "raise_surrogate failed: RuntimeError: bad byte \\udc80 in a path"
    assert _round_trip(reply) == reply


def test_exception_whose_str_raises_does_not_escape() -> None:
    class Nasty(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    def boom() -> RpcResult:
        raise Nasty

    m = RpcMethods()
    m.register("boom", boom)
    reply = m.answer(RpcReqInput(rid="r-1", method="boom", parameters={}))
    assert not reply.success and "Nasty" in reply.message
    assert _round_trip(reply) == reply


# -- end to end, through a real engine ----------------------------------------

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine("ring", SMALL, max_batch=8) as e:
        yield e


def test_engine_long_path_fails_promptly_with_a_fitting_message(engine: Engine) -> None:
    # A path that fits the request but whose error (quoting it) does not fit the reply:
    # the reply must still come, promptly, with the message cut to fit.
    path = "/nonexistent/" + "x" * (MAX_TEXT - len("/nonexistent/"))
    t0 = time.monotonic()
    out = engine.collective_rpc("save_checkpoint", path=path, timeout=30)
    assert time.monotonic() - t0 < 10
    assert not out.success
    assert len(out.message) <= MAX_TEXT and out.message.endswith(MARKER)
    assert out.message.startswith("save_checkpoint failed:")


def test_engine_path_longer_than_a_request_allows_fails_promptly(engine: Engine) -> None:
    t0 = time.monotonic()
    out = engine.collective_rpc("save_checkpoint", path="/nonexistent/" + "x" * 70_000,
                                timeout=30)
    assert time.monotonic() - t0 < 10
    assert not out.success and len(out.message) <= MAX_TEXT


def test_engine_load_from_a_fifo_fails_and_the_loop_goes_on(engine: Engine,
                                                            tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    out = engine.collective_rpc("load_checkpoint", path=str(fifo), timeout=30)
    assert time.monotonic() - t0 < 10
    assert not out.success and "FIFO" in out.message and str(fifo) in out.message
    load = engine.collective_rpc("get_load", timeout=10)
    assert load.success and load.result is not None


def test_engine_checkpoint_round_trip_still_works(engine: Engine, tmp_path: Path) -> None:
    path = str(tmp_path / "m.ckpt")
    saved = engine.collective_rpc("save_checkpoint", path=path, timeout=30)
    assert saved.success, saved.message
    loaded = engine.collective_rpc("load_checkpoint", path=path, timeout=30)
    assert loaded.success, loaded.message
