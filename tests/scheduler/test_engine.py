"""The Engine facade, end to end, in both modes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from bus import RpcTimeout
from messages import SamplingParams
from scheduler import (
    Engine,
    EngineClosed,
    InvalidRequest,
    ModelConfig,
    Overloaded,
    RequestFailed,
    SchedulerGone,
)
from scheduler.engine import async_engine
from tests import procs

SMALL = ModelConfig(vocab_size=128, hidden=32, layers=1, seed=3)
MODES: list[Literal["ring", "zmq"]] = ["ring", "zmq"]


@pytest.fixture(scope="module", params=MODES)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    with Engine(request.param, SMALL, max_batch=32) as e:
        yield e


def _idle(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    while True:
        load = engine.collective_rpc("get_load").result
        assert load is not None
        if load["running"] == 0 and load["queued"] == 0:
            return
        assert time.monotonic() < deadline


def test_generate_stream_embed(engine: Engine) -> None:
    r = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=6, temperature=0.0),
                        return_logprob=True, timeout=30)
    assert len(r.token_ids) == 6 and r.finish_reason == "length"
    assert r.logprobs is not None and len(r.logprobs) == 6
    chunks = list(engine.stream([1, 2, 3], SamplingParams(max_new_tokens=6, temperature=0.0)))
    assert len(chunks) == 6 and [c.token_ids[0] for c in chunks] == r.token_ids
    assert chunks[-1].finish_reason == "length"
    vec = engine.embed([4, 5, 6], timeout=30)
    assert vec.shape == (32,)


def test_both_modes_give_the_same_tokens(engine: Engine) -> None:
    sp = SamplingParams(max_new_tokens=10, temperature=0.8, seed=7)
    got = engine.generate([9, 8, 7], sp, timeout=30).token_ids
    with Engine("ring", SMALL) as other:
        assert other.generate([9, 8, 7], sp, timeout=30).token_ids == got


def test_seed_idle_rpc_is_answered_promptly(engine: Engine) -> None:
    _idle(engine)
    worst = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        assert engine.collective_rpc("get_load").success
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.2  # the seed's ring mode waited out a 1 s park


def test_seed_rpc_answered_while_1000_generates_flood(engine: Engine, tmp_path: Path) -> None:
    started = time.perf_counter()
    # One burst: submitted one by one, on a busy host the scheduler answered each as fast
    # as it came and the flood never queued (30 s of polling, then a failure).
    handles = engine.submit_many([[1, 2]] * 1000, SamplingParams(max_new_tokens=16))
    deadline = time.monotonic() + 30
    while True:  # until the scheduler holds the flood: an rpc before it proves nothing
        load = engine.collective_rpc("get_load").result
        assert load is not None
        if isinstance(load["queued"], int) and load["queued"] > 0:  # the batch (32) is full
            break
        assert time.monotonic() < deadline, f"the flood never queued: {load}"
    t0 = time.perf_counter()
    out = engine.collective_rpc("save_checkpoint", path=str(tmp_path / "busy.ckpt"), timeout=30)
    rpc_s = time.perf_counter() - t0
    unfinished = engine.pending  # of the flood, still unanswered when the rpc was
    assert out.success, out.message
    results = [h.result(timeout=60) for h in handles]
    flood_s = time.perf_counter() - started
    assert all(r.finish_reason == "length" for r in results)
    assert unfinished > 0, "answered only once the flood was gone"
    assert rpc_s < flood_s / 2, f"the rpc took {rpc_s:.3f} s of a {flood_s:.3f} s flood"


def test_abort_and_errors(engine: Engine) -> None:
    h = engine.submit([1], SamplingParams(max_new_tokens=100_000), stream=True)
    first = next(iter(h))
    assert first.finish_reason is None
    engine.abort(h.rid)
    assert h.result(timeout=30).finish_reason == "abort"
    with pytest.raises(RequestFailed) as info:
        engine.generate([1, 10_000], timeout=30)
    assert info.value.code == "invalid_request"
    reply = engine.collective_rpc("explode_please")
    assert not reply.success and "unknown rpc method" in reply.message


# close(None), close(inf) and close(0) each answer every accepted request and stop
# everything: none may raise once the engine is marked closed (every request would hang,
# its processes stay), and close(0) in ring mode must send its shutdown before it
# releases the rings under the scheduler's thread.
@pytest.mark.parametrize(("mode", "timeout"), [("ring", 30.0), ("zmq", 30.0), ("ring", 0.0),
                                               ("ring", float("inf")), ("zmq", None)])
def test_close_answers_every_accepted_request(mode: Literal["ring", "zmq"],
                                              timeout: float | None) -> None:
    engine = Engine(mode, SMALL, max_batch=2)
    handles = [engine.submit([1], SamplingParams(max_new_tokens=100_000)) for _ in range(5)]
    with pytest.raises(TypeError):  # no number: refused before anything is closed
        engine.close("5")  # type: ignore[arg-type]
    assert not engine.closed
    pids = [p.pid for p in engine._core._scheduler.essential]  # (close() forgets its processes)
    engine.close(timeout)
    engine.close()  # idempotent
    for h in handles:
        with pytest.raises((RequestFailed, EngineClosed)) as info:
            h.result(timeout=10)
        if isinstance(info.value, RequestFailed):
            assert info.value.code == "shutdown"
    with pytest.raises(EngineClosed):
        engine.submit([1])
    assert not engine._loop_thread.is_alive()
    assert engine._core._scheduler.thread is None or not engine._core._scheduler.thread.is_alive()
    assert not any(procs.alive(pid) for pid in pids if pid is not None)
    assert (mode == "zmq") == bool(pids)


def test_dead_scheduler_process_fails_pending_calls_promptly() -> None:
    engine = Engine("zmq", SMALL)
    try:
        h = engine.submit([1], SamplingParams(max_new_tokens=1_000_000))
        pid = engine._core._scheduler.essential[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(SchedulerGone, match="exit"):
            h.result(timeout=30)
        with pytest.raises(SchedulerGone):
            engine.collective_rpc("get_load", timeout=30)
        assert time.perf_counter() - t0 < 5
        with pytest.raises(SchedulerGone):
            engine.submit([1])
    finally:
        engine.close()


def test_rpc_calls_from_several_threads_wait_together() -> None:
    # 8 threads call a stopped scheduler with a 1 s timeout: in flight together, they
    # all time out about 1 s later; served one after another, the last waited 8 s.
    engine = Engine("zmq", ModelConfig(kind="stub"))
    pid = engine._core._scheduler.essential[0].pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        errors: list[BaseException] = []

        def call() -> None:
            try:
                engine.collective_rpc("get_load", timeout=1.0)
            except RpcTimeout as exc:
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(8)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 8
        assert time.monotonic() - t0 < 4, "the calls waited one after another"
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close()


@pytest.mark.parametrize("mode", ["ring", "zmq"])
def test_submit_many_sends_bursts_and_answers_each(mode: Literal["ring", "zmq"]) -> None:
    with Engine(mode, ModelConfig(kind="stub")) as engine:
        handles = engine.submit_many([[1 + n % 7, 2] for n in range(600)],
                                     SamplingParams(max_new_tokens=2))
        assert [len(h.result(60).token_ids) for h in handles] == [2] * 600
        assert len({h.rid for h in handles}) == 600
        with pytest.raises(InvalidRequest):  # refused before any is sent
            engine.submit_many([[1], [2]], SamplingParams(temperature=-1.0))
        assert engine.pending == 0


_FORK = """
import os, sys
from scheduler import Engine, ModelConfig
def main():
    engine = Engine("zmq", ModelConfig(kind="stub"))
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit: multiprocessing's exit handler runs in the child
    os.waitpid(pid, 0)
    print(len(engine.generate([1, 2]).token_ids))
    engine.close()
if __name__ == "__main__":
    main()
"""


def test_a_forked_child_leaves_the_parents_scheduler_alone(tmp_path: Path) -> None:
    script = tmp_path / "fork.py"
    script.write_text(_FORK)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "16", out.stderr[-2000:]


def test_leaving_a_stream_early_aborts_its_request(engine: Engine) -> None:
    long = SamplingParams(max_new_tokens=100_000)
    for _ in range(3):  # ``break``: the loop drops the stream, which aborts the request
        for n, chunk in enumerate(engine.stream([1, 2], long), 1):
            assert chunk.finish_reason is None
            if n == 3:
                break
    with engine.stream_steps([1, 2], long) as steps:  # the end of a with block
        assert next(steps)
    stream = engine.stream([3], long)
    next(stream)
    stream.close()
    stream.close()  # idempotent
    assert list(stream) == []  # a closed stream is over
    _idle(engine)  # every one aborted: none left running
    deadline = time.monotonic() + 10
    while engine.pending:  # each abort's terminal answer frees its rid
        assert time.monotonic() < deadline, engine.pending
    done = engine.stream([4], SamplingParams(max_new_tokens=2))
    assert [c.finish_reason for c in done] == [None, "length"]
    done.close()  # after the last chunk: nothing to abort


@pytest.mark.parametrize("size", ["tp_size", "dp_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_size_below_1_is_refused_saying_so(size: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"^{size} must be at least 1, not {value}$"):
        Engine("zmq", SMALL, **{size: value})  # type: ignore[arg-type]


def test_a_blocking_submit_waits_for_room_then_fails_with_overloaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine, "SEND_TIMEOUT", 0.5)
    with Engine("ring", SMALL) as engine:
        ring = engine._core._ingress
        assert ring is not None
        real, refused = ring.put_many_nowait, [0]

        def full_for_five_tries(items: object) -> int:
            if refused[0] < 5:
                refused[0] += 1
                return 0
            return real(items)  # type: ignore[arg-type]

        ring.put_many_nowait = full_for_five_tries  # type: ignore[method-assign]
        handle = engine.submit([1, 2], SamplingParams(max_new_tokens=2))  # waited for room
        assert refused[0] == 5 and len(handle.result(30).token_ids) == 2
        ring.put_many_nowait = lambda items: 0  # type: ignore[method-assign]
        with pytest.raises(Overloaded, match=r"stayed full for 0.5 s\): 0 of 2 were sent"):
            engine.submit_many([[1], [2]])
        assert engine.pending == 0  # those not sent are forgotten
        ring.put_many_nowait = real  # type: ignore[method-assign]
        assert len(engine.generate([3], SamplingParams(max_new_tokens=2)).token_ids) == 2


@pytest.mark.parametrize("call", ["generate", "embed"])
def test_a_timeout_that_is_no_number_is_refused_before_anything_is_sent(
        engine: Engine, call: str) -> None:
    # Without this: the request was sent, then the timeout raised TypeError, and the
    # request ran on with nobody waiting for it.
    run = getattr(engine, call)
    with pytest.raises(TypeError, match=r"^timeout must be a number of seconds or None, "
                                        r"not str$"):
        run([1, 2], timeout="x")
    assert engine.pending == 0
