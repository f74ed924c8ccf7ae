"""More hardening cases, each through the public API (beside those in
test_hardening.py).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from messages import (
    AbortReq,
    Codec,
    Request,
    RpcReqInput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler import (
    Engine,
    InvalidRequest,
)
from tests.scheduler.rig import CODEC, SMALL, Loop, gen

# -- one bad actor costs itself alone ------------------------------------------------


@pytest.mark.parametrize("kind", ["ring", "zmq"])
def test_a_request_reusing_a_live_rid_never_ends_the_live_one(
        make_loop: Callable[..., Loop], kind: str) -> None:
    loop = make_loop(kind)
    loop.send(gen("victim", [1, 2, 3], max_new_tokens=30, temperature=0.0))
    loop.run_until(lambda: loop.sched.statistics().running == 1)
    loop.send(gen("victim", [1, 2, 999]))  # same rid, out of vocabulary
    loop.send(gen("victim", [1, 2]))  # same rid, valid
    if loop.push is not None:  # a frame that fails to decode but names the live rid
        frames = CODEC.encode(gen("victim", [1], top_p=0.5))
        loop.push.send_multipart([bytes(frames[0]).replace(b"\xcb?\xe0", b"\xcb@\x00")])
    loop.run_until(lambda: "victim" in loop.finished())
    assert loop.finished()["victim"] == (loop.finished()["victim"][0], "length")
    assert len(loop.finished()["victim"][0]) == 30
    assert "victim" not in loop.errors()  # exactly one terminal answer, the real one


def test_checkpoints_never_replace_what_is_not_a_file_nor_read_past_the_model(
        tmp_path: Path, make_loop: Callable[..., Loop]) -> None:
    loop = make_loop("ring")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    for target in (fifo, tmp_path / "dir", ""):
        reply = loop.sched.rpc.answer(RpcReqInput(rid="s", method="save_checkpoint",
                                                  parameters={"path": str(target)}))
        assert not reply.success, target
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still a FIFO
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: far past this model's weights
    t0 = time.monotonic()
    reply = loop.sched.rpc.answer(RpcReqInput(rid="l", method="load_checkpoint",
                                              parameters={"path": str(big)}))
    assert not reply.success and "max_bytes" in reply.message
    assert time.monotonic() - t0 < 1.0  # refused from its size, not read
    ok = loop.sched.rpc.answer(RpcReqInput(rid="s2", method="save_checkpoint",
                                           parameters={"path": str(tmp_path / "ck")}))
    assert ok.success
    back = loop.sched.rpc.answer(RpcReqInput(rid="l2", method="load_checkpoint",
                                             parameters={"path": str(tmp_path / "ck")}))
    assert back.success, back.message


def test_engine_ring_owns_the_prompt_once_submitted() -> None:
    import numpy as np

    with Engine("ring", SMALL, max_batch=1) as engine:
        blocker = engine.submit([1, 2], SamplingParams(max_new_tokens=10_000))
        buf = np.array([1, 2, 3], np.uint32)
        queued = engine.submit(buf, SamplingParams(max_new_tokens=3, temperature=0.0))
        buf[:] = 100_000  # the caller reuses its buffer while the request waits
        engine.abort(blocker.rid)
        assert queued.result(timeout=30).finish_reason == "length"
        assert blocker.result(timeout=30).finish_reason == "abort"


@pytest.mark.parametrize("mode", ["ring", "zmq"])
def test_engine_says_closed_and_refuses_an_empty_rid(mode: str) -> None:
    from scheduler import EngineClosed

    engine = Engine(mode, SMALL)  # type: ignore[arg-type]
    try:
        with pytest.raises(InvalidRequest):
            engine.submit([1], rid="")
        text = engine.metrics()
        assert "tsb_received_total" in text and "tsb_step_seconds_bucket" in text
    finally:
        engine.close()
    with pytest.raises(EngineClosed):
        engine.abort("anything")
    with pytest.raises(EngineClosed):
        engine.collective_rpc("get_load")
    with pytest.raises(EngineClosed):
        engine.submit([1])


def test_the_rpc_channel_takes_rpc_calls_only() -> None:
    from messages import (
        DecodeError,
        RpcReqInput,
    )
    from scheduler.launch.wiring import rpc_codec

    codec = rpc_codec()
    assert isinstance(codec.decode(codec.encode(RpcReqInput(rid="c", method="get_load"))),
                      RpcReqInput)
    # A peer that may call rpc cannot abort, or claim the rid of, someone's request
    # (sent by a codec that is no rpc door: the rpc door would not even encode them).
    for req in (AbortReq(rid="victim"),
                TokenizedGenerateReqInput(rid="victim", input_ids=token_ids([1]))):
        with pytest.raises(DecodeError):
            codec.decode(Codec(Request).encode(req))
