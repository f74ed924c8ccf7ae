"""Hardening, each case through the public API: one bad actor costs itself alone.

Numbers in the test names refer to the hardening issue's list.
"""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from bus import (
    Origin,
    PullInbox,
    Receiver,
    Ring,
    RingInbox,
    RpcClient,
    WouldBlock,
)
from messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Output,
    Request,
    RpcReqInput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from router import CallbackSink, scheduler_router
from scheduler import (
    Engine,
    InvalidRequest,
    Limits,
    Overloaded,
    Scheduler,
    TinyLM,
)
from scheduler.__main__ import main, private_dir
from tests.scheduler.rig import CODEC, SMALL, Loop, gen

# -- 1. malformed frames fail only themselves -------------------------------------


def _mutations(n: int, seed: int) -> Iterator[list[bytes]]:
    rnd = random.Random(seed)
    valid = [bytes(CODEC.encode(gen(f"m{i}", [1, 2, 3], temperature=0.5, top_p=0.9,
                                     stop_token_ids=[4], seed=3))[0]) for i in range(4)]
    valid.append(bytes(CODEC.encode(RpcReqInput(rid="r", method="get_load"))[0]))
    for _ in range(n):
        b = bytearray(rnd.choice(valid))
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randrange(len(b))
            b[i] = rnd.choice([0xc1, 0xdc, 0xdd, 0xde, 0xdf, 0x90, 0xa0, 0xff, 0x00,
                               rnd.randrange(256)])
        if rnd.random() < 0.2:
            b = b[: rnd.randrange(len(b) + 1)]
        yield [bytes(b)] if rnd.random() < 0.9 else [bytes(b), os.urandom(rnd.randrange(64))]


@pytest.mark.parametrize("kind", ["zmq"])
def test_1_mutated_frames_never_stop_the_loop(make_loop: Callable[..., Loop], kind: str) -> None:
    loop = make_loop(kind)
    assert loop.push is not None
    for frames in _mutations(3000, seed=1):
        loop.push.send_multipart(frames)
    loop.send(gen("legit", [1, 2, 3], max_new_tokens=2))
    loop.run_until(lambda: "legit" in loop.finished())
    assert loop.call("get_load").success


# -- 2. a reply goes to whoever asked -------------------------------------------------


def _serve(endpoint: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint", endpoint,
                             *extra], stderr=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(30)
    assert proc.stderr is not None
    proc.stderr.close()


def test_2_and_7_serve_replies_to_each_client_and_owns_its_directory(tmp_path: Path) -> None:
    sock_dir = tmp_path / "sched"
    old = os.umask(0)
    try:
        proc = _serve(str(sock_dir))
    finally:
        os.umask(old)
    try:
        with RpcClient(f"ipc://{sock_dir}/rpc") as first:
            assert first.call("get_load", timeout=60).success  # started
        assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
        clients = [RpcClient(f"ipc://{sock_dir}/rpc") for _ in range(2)]
        errors: list[BaseException] = []

        def hammer(c: RpcClient) -> None:
            try:
                for _ in range(40):
                    assert c.call("get_load", timeout=10).success
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert [c.discarded for c in clients] == [0, 0]  # nobody got another's reply
        for c in clients:
            c.close()
    finally:
        _stop(proc)


def test_7_serve_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="world-writable"):
        private_dir(str(shared))
    with pytest.raises(SystemExit):
        main(["serve", "--endpoint", str(shared)])
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PermissionError, match="belongs to uid 65534"):
            private_dir(str(theirs))
    mine = private_dir(str(tmp_path / "new"))
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700


# -- 3. a message of a million parts --------------------------------------------------


def test_3_surplus_parts_are_discarded_unread_and_the_sender_is_answered(
        make_loop: Callable[..., Loop]) -> None:
    loop = make_loop("zmq")
    assert loop.push is not None and isinstance(loop.work, PullInbox)
    head = CODEC.encode(gen("huge", [1, 2], max_new_tokens=1))[0]
    parts = 200_000
    loop.push.send_multipart([head, *([b""] * parts)])
    loop.send(gen("after", [1, 2], max_new_tokens=1))
    loop.run_until(lambda: "after" in loop.finished())
    err = loop.errors()["huge"]
    assert err.code == "decode_error" and "max_frames" in err.message
    assert loop.work.discarded_parts == parts + 1 - (Codec(Request).max_frames)


# -- 4. aborts are idempotent -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["ring", "zmq"])
def test_4_two_aborts_of_one_rid_in_one_poll(make_loop: Callable[..., Loop], kind: str) -> None:
    loop = make_loop(kind)
    loop.send(gen("a", [1, 2, 3], max_new_tokens=10_000))
    loop.run_until(lambda: loop.sched.statistics().running == 1)
    loop.send(AbortReq(rid="a"))
    loop.send(AbortReq(rid="a"))
    loop.send(AbortReq(rid="never-was"))
    loop.run_until(lambda: "a" in loop.finished())
    assert loop.finished()["a"][1] == "abort"
    loop.send(gen("b", [1], max_new_tokens=1))
    loop.run_until(lambda: "b" in loop.finished())


@pytest.fixture(scope="module")
def engines() -> Iterator[Callable[[str], Engine]]:
    """The engine of a mode (``engines("zmq")``), started at its first use and shared by
    the module's engine tests (a zmq start is a scheduler process): each sends requests
    of its own and ends them, none closes it. All are closed at the module's end."""
    started: dict[str, Engine] = {}

    def get(mode: str) -> Engine:
        if mode not in started:
            started[mode] = Engine(mode, SMALL)  # type: ignore[arg-type]
        return started[mode]

    yield get
    for engine in started.values():
        engine.close()


def test_4_engine_abort_twice_is_harmless(engines: Callable[[str], Engine]) -> None:
    engine = engines("zmq")
    h = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=100_000))
    engine.abort(h.rid)
    engine.abort(h.rid)
    assert h.result(timeout=30).finish_reason == "abort"
    assert engine.generate([1], SamplingParams(max_new_tokens=2), timeout=30).token_ids


# -- 5. ring mode validates; a failing handler fails its request alone ------------------


def test_5_ring_requests_are_validated_like_decoded_ones(make_loop: Callable[..., Loop]) -> None:
    loop = make_loop("ring", validate=True)
    bad = [gen("big-seed", [1], seed=2**64), gen("\ud800", [1]), gen("x" * 300, [1]),
           gen("top-p", [1], top_p=2.0)]
    for req in bad:
        loop.send(req)
    loop.send(gen("fine", [1, 2], max_new_tokens=2))
    loop.run_until(lambda: "fine" in loop.finished() and len(loop.errors()) == len(bad))
    assert {e.code for e in loop.errors().values()} == {"decode_error"}
    assert "sampling.top_p" in loop.errors()["top-p"].message


@pytest.mark.parametrize("kind", ["ring", "zmq"])
def test_5_a_raising_handler_fails_only_its_request(make_loop: Callable[..., Loop],
                                                    kind: str) -> None:
    # Unvalidated ring: a seed torch refuses reaches the scheduler and raises there.
    loop = make_loop(kind)
    if kind == "ring":
        loop.send(gen("poison", [1, 2], seed=2**64, temperature=1.0))
    else:
        original = loop.sched._check_ids

        def explode(ids: memoryview, rid: str) -> str:
            if rid == "poison":
                raise RuntimeError("boom")
            return original(ids, rid)

        loop.sched._check_ids = explode  # type: ignore[method-assign]
        loop.send(gen("poison", [1, 2]))
    loop.send(gen("innocent", [1, 2], max_new_tokens=3))
    loop.run_until(lambda: "innocent" in loop.finished() and "poison" in loop.errors())
    assert loop.errors()["poison"].code == "internal"
    assert loop.finished()["innocent"][1] == "length"
    assert loop.call("get_load").success


def test_5_a_failing_model_step_fails_its_batch_and_the_loop_goes_on(
        make_loop: Callable[..., Loop]) -> None:
    class Flaky(TinyLM):
        fail = True

        def prefill_batch(self, prompts: list[torch.Tensor],
                          states: object = None) -> tuple[torch.Tensor, torch.Tensor]:
            if self.fail:
                self.fail = False
                raise RuntimeError("device lost")
            return super().prefill_batch(prompts, states)  # type: ignore[arg-type]

    loop = make_loop("ring", model=Flaky(SMALL))
    loop.send(gen("first", [1, 2]))
    loop.run_until(lambda: "first" in loop.errors())
    assert "device lost" in loop.errors()["first"].message
    loop.send(gen("second", [1, 2], max_new_tokens=2))
    loop.run_until(lambda: "second" in loop.finished())


# -- 6. Engine refuses at submit what the wire cannot carry -----------------------------


@pytest.mark.parametrize("mode", ["ring", "zmq"])
def test_6_engine_refuses_bad_requests_at_submit(engines: Callable[[str], Engine],
                                                 mode: str) -> None:
    engine = engines(mode)
    for rid in ("x" * 300, "\ud800", ""):
        with pytest.raises(InvalidRequest) as info:
            engine.submit([1, 2], rid=rid) if rid else engine.abort(rid)
        assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidRequest, match="seed"):
        engine.submit([1], SamplingParams(seed=2**64))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.submit([1], SamplingParams(top_p=1.5))
    ok = engine.generate([1, 2], SamplingParams(max_new_tokens=2), timeout=30)
    assert len(ok.token_ids) == 2


# -- 10. admission control --------------------------------------------------------------


def test_10_past_the_limits_requests_are_refused_at_once(make_loop: Callable[..., Loop]) -> None:
    loop = make_loop("zmq", max_batch=1, limits=Limits(max_queued_requests=3,
                                                       max_queued_tokens=10_000))
    loop.send(gen("costly", [1], max_new_tokens=20_000))
    for i in range(10):
        loop.send(gen(f"q{i}", [1, 2], max_new_tokens=1000))
    loop.run_until(lambda: len(loop.errors()) >= 7)
    errors = loop.errors()
    assert all(e.code == "overloaded" for e in errors.values())
    assert "costly" in errors and "max_queued_tokens" in errors["costly"].message
    assert loop.sched.admission.refused == len(errors)
    assert loop.call("get_load").success  # rpc is never refused
    for s in loop.sched.batch.waiting:
        assert s.generator is None  # per-request state is made at admission


def test_10_engine_raises_overloaded() -> None:
    with Engine("ring", SMALL, max_batch=1, limits=Limits(max_queued_requests=1)) as engine:
        handles = [engine.submit([1], SamplingParams(max_new_tokens=100_000, temperature=0.0))
                   for _ in range(4)]
        with pytest.raises(Overloaded) as info:
            handles[-1].result(timeout=30)
        assert info.value.code == "overloaded"
        for h in handles[:2]:
            engine.abort(h.rid)


# -- 11. chunked prefill ----------------------------------------------------------------


def test_11_a_long_prompt_is_read_in_bounded_chunks_with_the_same_result(
        make_loop: Callable[..., Loop]) -> None:
    prompt = [(i * 7) % 64 for i in range(1000)]
    whole = make_loop("ring", max_prefill_tokens=4096)
    whole.send(gen("p", prompt, max_new_tokens=5, temperature=0.0))
    whole.run_until(lambda: "p" in whole.finished())
    chunked = make_loop("ring", max_prefill_tokens=64)

    def tokens(rid: str) -> int:
        return sum(len(ids) for o, _ in chunked.got if isinstance(o, BatchTokenIDOut)
                   for r, ids, _ in o.items() if r == rid)

    # A stream already running keeps its pace while the long prompt is read:
    # a token every step, ~16 chunks of 64.
    chunked.send(TokenizedGenerateReqInput(rid="short", input_ids=token_ids([1, 2]), stream=True,
                                           sampling=SamplingParams(max_new_tokens=200)))
    chunked.run_until(lambda: tokens("short") >= 1)
    before = tokens("short")
    chunked.send(gen("p", prompt, max_new_tokens=5, temperature=0.0))
    chunked.run_until(lambda: tokens("p") >= 1)  # its prompt is read
    during = tokens("short") - before
    chunked.run_until(lambda: "p" in chunked.finished())
    assert chunked.finished()["p"] == whole.finished()["p"]
    assert chunked.sched.statistics().steps >= 1000 // 64
    assert during >= 1000 // 64 - 2, f"the running stream got {during} tokens meanwhile"


def test_11_a_long_embedding_is_read_in_chunks_with_the_same_vector(
        make_loop: Callable[..., Loop]) -> None:
    prompt = token_ids([(i * 5) % 64 for i in range(700)])
    vectors = []
    for budget in (4096, 50):
        loop = make_loop("ring", max_prefill_tokens=budget)
        loop.send(TokenizedEmbeddingReqInput(rid="e", input_ids=prompt))
        loop.run_until(lambda loop=loop: any(isinstance(o, BatchEmbeddingOut)  # type: ignore[misc]
                                             for o, _ in loop.got))
        out = next(o for o, _ in loop.got if isinstance(o, BatchEmbeddingOut))
        vectors.append(out.embeddings[0])
        assert loop.sched.statistics().steps >= (700 // budget)
    torch.testing.assert_close(vectors[0], vectors[1])


# -- 12. a consumer that stops reading --------------------------------------------------


def test_12_slow_consumer_never_blocks_the_loop_and_every_request_is_told(
        make_loop: Callable[..., Loop]) -> None:
    egress: Ring[Output] = Ring(4, name="out")
    told: list[Request] = []  # what tensor-parallel followers would be told
    loop = make_loop("ring", egress=egress, max_batch=4,
                     limits=Limits(max_backlog=16), tell_ranks=told.append)
    rids = [f"s{i}" for i in range(12)]
    for rid in rids:
        req = gen(rid, [1, 2], max_new_tokens=50, temperature=0.0)
        req.stream = True
        loop.send(req)
    loop.run_until(lambda: loop.sched.router.statistics().overflows >= 1)
    receiver = loop.sched.receiver
    assert isinstance(receiver, Receiver)
    assert receiver.paused == {"work"}  # no new work while its outputs pile up
    t0 = time.monotonic()
    assert loop.call("get_load").success  # rpc answered while outputs are stuck
    assert time.monotonic() - t0 < 5
    # The consumer reads again: every request ends exactly once, nothing silent.
    terminal: dict[str, str] = {}

    def read() -> bool:
        for out in egress.drain(1024):
            if isinstance(out, ErrorOut):
                assert out.rid not in terminal
                terminal[out.rid] = out.code
            elif isinstance(out, BatchTokenIDOut):
                for rid, _, fin in out.items():
                    if fin is not None:
                        assert rid not in terminal
                        terminal[rid] = fin
        return len(terminal) == len(rids)

    loop.run_until(read)
    assert set(terminal) == set(rids)
    assert "overloaded" in terminal.values()
    # Every request aborted for backpressure is aborted on the other ranks too.
    assert {r.rid for r in told if isinstance(r, AbortReq)} == \
        {rid for rid, code in terminal.items() if code == "overloaded"}
    assert loop.sched.router.statistics().failed == 0
    loop.run_until(lambda: not receiver.paused)  # the consumer reads: work resumes
    assert not loop.sched.busy
    egress.release()




class _StoppedSink:
    """A transport whose consumer stops reading, then takes some of each batch."""

    def __init__(self, seed: int) -> None:
        self.stopped = True
        self.got: list[Output] = []
        self.rng = random.Random(seed)

    def send(self, output: Output, origin: Origin, /) -> None:
        if self.stopped:
            raise WouldBlock("out", "stopped")
        self.got.append(output)

    def send_many(self, outputs: Sequence[Output], origin: Origin, /) -> int:
        if self.stopped:
            return 0
        n = self.rng.randint(1, len(outputs))  # a consumer that takes some at a time
        self.got.extend(outputs[:n])
        return n


@pytest.mark.parametrize("max_backlog", [3, 8, 64])
def test_12_each_request_ends_once_when_its_consumer_stops_reading(max_backlog: int) -> None:
    rng = random.Random(max_backlog)
    ring: Ring[Request] = Ring(1 << 12, name="work")
    sink = _StoppedSink(max_backlog)
    router = scheduler_router(sink, CallbackSink(lambda o, g: None), max_backlog=max_backlog)
    sched = Scheduler(Receiver([RingInbox(ring, name="work")]), router, TinyLM(SMALL),
                      max_batch=64, limits=Limits(max_backlog=max_backlog))
    rids = []
    # Every request waits in the ring before the loop starts, so its first poll takes
    # them all. Put while it runs, the loop could take the first few alone, finish
    # them, and pause the inbox on their one unread output: the backlog would then
    # never overflow, and the test would wait for an abort that cannot come.
    for i in range(150):
        rids.append(f"s{i}")
        ring.put(TokenizedGenerateReqInput(
            rid=f"s{i}", input_ids=token_ids([i % 60 + 1]), stream=True,
            sampling=SamplingParams(max_new_tokens=rng.choice([1, 3, 50, 400]))))
        if i % 7 == 0:
            rids.append(f"e{i}")
            ring.put(TokenizedEmbeddingReqInput(rid=f"e{i}", input_ids=token_ids([1, 2])))
    thread = threading.Thread(target=sched.run)
    thread.start()
    try:
        deadline = time.monotonic() + 90  # ~2 s alone; a loaded 2-core box takes 5x
        while sched.backlog_aborts == 0:  # the backlog overflowed, and collapsed
            assert time.monotonic() < deadline
            time.sleep(0.01)  # sleep-ok: pacing of a deadline poll
        sink.stopped = False
        while sched.busy or router.backlog or len(ring):
            assert time.monotonic() < deadline
            time.sleep(0.01)  # sleep-ok: pacing of a deadline poll
    finally:
        sched.request_shutdown()
        thread.join(30)
    ends: dict[str, int] = {}
    after_end = 0
    for out in sink.got:
        pairs: list[tuple[str, bool]] = []
        if isinstance(out, BatchTokenIDOut):
            pairs = [(r, f is not None) for r, f in zip(out.rids, out.finished_reasons,
                                                        strict=True)]
        elif isinstance(out, ErrorOut):
            pairs = [(out.rid, True)]
        elif isinstance(out, BatchEmbeddingOut):
            pairs = [(r, True) for r in out.rids]
        for rid, final in pairs:
            after_end += rid in ends
            if final:
                ends[rid] = ends.get(rid, 0) + 1
    assert after_end == 0
    assert {r: ends.get(r, 0) for r in rids} == dict.fromkeys(rids, 1)
