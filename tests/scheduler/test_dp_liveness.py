"""Liveness of data-parallel replicas: lost only on evidence about the replica itself.

A :class:`~scheduler.dp.Dispatcher` is stepped by hand on a controlled
clock over one replica played by the test (its work, rpc and out sockets),
so what is in transit and when is decided here, not by the machine's load:

* a busy replica that has not read most of our requests yet (they wait in
  its inbound socket), reporting fewer than we sent, is never lost;
* outputs still on their way back (sent late, a trickle) cost nothing;
* a dispatcher that itself stalled for seconds (a jump of the clock) does
  not blame the replica;
* a replica truly silent while we run, or one that says it is idle while
  our requests get no answer and none of its outputs arrive, is lost.

The same under load, end to end (a flood beside CPU hogs, counting the
replicas declared lost), is ``dp_flood_false_losses`` in ``python -m
benchmarks.soak``: on a machine's own timing the replicas catch up within
a fraction of the heartbeat timeout, so only the controlled clock here can
hold requests in a replica's socket for longer than the rules look.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bus import Envelope, PullInbox, PushOutbox, RpcCaller, RpcServer, SocketOptions, WouldBlock
from messages import (
    AbortReq,
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler import Engine, ModelConfig, SchedulerGone
from scheduler.dp import Dispatcher, ReplicaSpec
from scheduler.dp.liveness import AwakeClock, Health
from scheduler.launch.wiring import Endpoints

TIMEOUT = 1.0  # the heartbeat timeout under test (fake seconds)


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeReplica:
    """The replica's side of its three sockets, driven by the test."""

    work: PullInbox[Request]
    rpc: RpcServer[Request]
    out: PushOutbox[Output]
    taken: list[str] = field(default_factory=list)  # rids it has read
    calls: int = 0  # rpc calls other than heartbeats it answered
    reply_codec: Codec[Message] = field(default_factory=lambda: Codec(Message,
                                                                      types=[RpcReqOutput]))
    #: Whether a heartbeat is owed (one went out unanswered): only then does
    #: :meth:`answer` wait for one to arrive; else it answers what is there already.
    owed: Callable[[], bool] = lambda: True

    def answer(self, running: int, queued: int, wait_ms: int | None = None) -> int:
        """Answer every waiting heartbeat with this load; how many were answered.

        Waits up to ``wait_ms`` for one to arrive (``None``: 20 ms while one is
        :attr:`owed`, else none)."""
        n = 0
        if wait_ms is None:
            wait_ms = 20 if self.owed() else 0
        if self.rpc.socket.poll(wait_ms):
            for env in self.rpc.drain(256):
                assert isinstance(env, Envelope)
                assert isinstance(env.message, RpcReqInput)
                self.calls += not env.message.rid.startswith("hb")
                self.rpc.reply(self.reply_codec.encode(RpcReqOutput(
                    rid=env.message.rid, success=True,
                    result={"running": running, "queued": queued, "pid": 1})), env.origin)
                n += 1
        return n

    def take(self, n: int, wait_ms: int = 20) -> None:
        """Read up to ``n`` requests from its work socket (the rest stay in transit)."""
        deadline = time.monotonic() + wait_ms / 1000
        while n > 0 and time.monotonic() < deadline:
            if not self.work.socket.poll(5):
                continue
            for env in self.work.drain(n):
                assert isinstance(env, Envelope)
                self.taken.append(env.message.rid)
                n -= 1

    def finish(self, rid: str) -> None:
        self.out.send(BatchTokenIDOut.from_lists([rid], [[1]], ["length"]))


@dataclass
class Rig:
    clock: FakeClock
    dispatcher: Dispatcher
    replica: FakeReplica
    client_work: PushOutbox[Request]
    client_out: PullInbox[Output]
    answers: dict[str, Output] = field(default_factory=dict)

    def step(self, dt: float = 0.05) -> None:
        """Advance the fake clock by ``dt``, let the dispatcher take what waits, read answers."""
        self.clock.t += dt
        self.dispatcher.receiver.wait(0.01)
        self.dispatcher.step()
        for env in self.client_out.drain(1024):
            assert isinstance(env, Envelope)
            msg = env.message
            if isinstance(msg, ErrorOut):
                self.answers[msg.rid] = msg
            elif isinstance(msg, BatchTokenIDOut):
                for rid, _, fin in msg.items():
                    if fin is not None:
                        self.answers[rid] = msg

    def send(self, n: int) -> list[str]:
        rids = [f"q{len(self.answers)}-{i}-{time.monotonic_ns()}" for i in range(n)]
        for rid in rids:
            self.client_work.send(TokenizedGenerateReqInput(
                rid=rid, input_ids=token_ids([1, 2]), sampling=SamplingParams(max_new_tokens=2)))
        while self.dispatcher.stats["dispatched"] < n:  # the dispatcher took them all
            self.step(0.0)
        return rids

    @property
    def lost(self) -> int:
        return self.dispatcher.stats["lost"]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    rdir, fdir = tmp_path / "r", tmp_path / "f"
    rdir.mkdir()
    fdir.mkdir()
    rep_ep, front = Endpoints.in_dir(str(rdir)), Endpoints.in_dir(str(fdir))
    replica = FakeReplica(PullInbox(Codec(Request), rep_ep.work),
                          RpcServer(Codec(Request), rep_ep.rpc),
                          PushOutbox(Codec(Output), rep_ep.out))
    client_out: PullInbox[Output] = PullInbox(Codec(Output), front.out)
    work: PullInbox[Request] = PullInbox(Codec(Request), front.work)
    rpc: RpcServer[Request] = RpcServer(Codec(Request), front.rpc, options=SocketOptions(hwm=4))
    out: PushOutbox[Output] = PushOutbox(Codec(Output), front.out)
    client_work: PushOutbox[Request] = PushOutbox(Codec(Request), front.work)
    clock = FakeClock()
    d = Dispatcher(work, rpc, out, [ReplicaSpec(rep_ep)], heartbeat_interval=0.2,
                   heartbeat_timeout=TIMEOUT, clock=clock)
    r = Rig(clock, d, replica, client_work, client_out)
    # A probe sent and not yet answered: the dispatcher sends one every 4 steps (0.2 s of
    # 0.05), so the 3 steps between wait for none (20 ms each of real time, seconds a test).
    replica.owed = lambda: d.replicas[0].health.probe_since is not None
    try:
        while not d.replicas[0].live:  # joins at its first answer
            r.step()
            replica.answer(0, 0)
        d.serve_upstream()
        yield r
    finally:
        d.close()
        for c in (replica.work, replica.rpc, replica.out, client_out, work, rpc, out,
                  client_work):
            c.close()


def test_a_busy_replica_with_requests_still_in_its_socket_is_not_lost(rig: Rig) -> None:
    rids = rig.send(50)
    rig.replica.take(2)  # it read two; 48 wait in its inbound socket, no output yet
    for _ in range(int(10 * TIMEOUT / 0.05)):  # ten timeouts of reports below ours
        rig.step()
        rig.replica.answer(running=2, queued=0)
    assert rig.lost == 0
    rig.replica.take(48, wait_ms=2000)
    for rid in rids:
        rig.replica.finish(rid)
    deadline = time.monotonic() + 30
    while len(rig.answers) < len(rids):
        assert time.monotonic() < deadline
        rig.step()
        rig.replica.answer(0, 0)
    assert all(isinstance(rig.answers[r], BatchTokenIDOut) for r in rids)
    assert rig.lost == 0


def test_outputs_on_their_way_back_cost_nothing(rig: Rig) -> None:
    rids = rig.send(20)
    rig.replica.take(20, wait_ms=2000)
    for n, rid in enumerate(rids):  # it is done with all (reports idle), outputs trickle
        for _ in range(10):  # one output every half timeout
            rig.step()
            rig.replica.answer(0, 0)
        rig.replica.finish(rid)
        assert rig.lost == 0, n
    deadline = time.monotonic() + 30
    while len(rig.answers) < len(rids):
        assert time.monotonic() < deadline
        rig.step()
    assert rig.lost == 0 and all(isinstance(rig.answers[r], BatchTokenIDOut) for r in rids)


def test_the_dispatchers_own_stall_is_not_the_replicas_silence(rig: Rig) -> None:
    for _ in range(3):
        rig.step()
        rig.replica.answer(0, 0)
    rig.step(10 * TIMEOUT)  # we were stopped (SIGSTOP, a long GC) for ten timeouts
    for _ in range(10):
        rig.replica.answer(0, 0)
        rig.step()
    assert rig.lost == 0 and rig.dispatcher.awake.stalls >= 1


def test_a_replica_silent_while_we_run_is_lost(rig: Rig) -> None:
    rids = rig.send(3)
    steps = 0
    while not rig.lost:  # it never answers again
        rig.step()
        steps += 1
        assert steps * 0.05 < 3 * TIMEOUT
    assert steps * 0.05 > TIMEOUT  # not before the timeout
    while len(rig.answers) < 3:
        rig.step()
    for rid in rids:  # not started there, but no other replica: they fail, named
        end = rig.answers[rid]
        assert isinstance(end, ErrorOut) and end.code == "replica_lost"
        assert "silent for" in end.message


def test_a_replica_idle_while_our_requests_get_no_answer_is_lost(rig: Rig) -> None:
    rids = rig.send(3)
    rig.replica.take(3, wait_ms=2000)  # it swallowed them, says it is idle, outputs nothing
    steps = 0
    while not rig.lost:
        rig.step()
        rig.replica.answer(0, 0)
        steps += 1
        assert steps * 0.05 < 4 * TIMEOUT
    while len(rig.answers) < 3:
        rig.step()
    for rid in rids:
        end = rig.answers[rid]
        assert isinstance(end, ErrorOut) and "do not reach this dispatcher" in end.message


def test_awake_clock_counts_a_long_gap_as_one_short_one() -> None:
    clock = FakeClock()
    awake = AwakeClock(clock, max_gap=0.25)
    for _ in range(4):
        clock.t += 0.1
        awake.tick()
    clock.t += 30.0
    assert awake.tick() == pytest.approx(0.65) and awake.stalls == 1


def test_health_silence_leaves_out_the_time_it_waited_for_a_cpu() -> None:
    h = Health()
    h.probed(0.0, lambda: 5.0)  # it had waited 5 s for a CPU in its life so far
    assert h.verdict(4.0, 3.0, lambda t: 0, lambda: 7.5) is None  # 2.5 of the 4 starved
    assert h.verdict(4.0, 3.0, lambda t: 0, lambda: 5.5) is not None  # hardly: silent
    assert h.verdict(4.0, 3.0, lambda t: 0) is not None  # not known: the awake time


def test_health_silence_counts_from_the_oldest_unanswered_probe() -> None:
    h = Health()
    h.probed(1.0)
    h.probed(1.2)  # the older one still counts
    assert h.verdict(2.1, 1.0, lambda t: 0) is not None
    h.answered()
    assert h.verdict(2.1, 1.0, lambda t: 0) is None


# -- a send blocked on a full work channel is a pending call --------------------


def test_a_submit_blocked_on_a_full_channel_fails_promptly_when_the_scheduler_dies() -> None:
    with Engine("zmq", ModelConfig(kind="stub")) as engine:
        pid = engine._core._scheduler.essential[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # it reads nothing more: the channel fills
        sent = [0]
        error: list[BaseException] = []

        def flood() -> None:
            try:
                while True:
                    engine.submit([1, 2], SamplingParams(max_new_tokens=1))
                    sent[0] += 1
            except BaseException as exc:  # the test reads it
                error.append(exc)

        t = threading.Thread(target=flood)
        t.start()
        try:
            last, still = -1, time.monotonic()
            while time.monotonic() - still < 0.5:  # blocked: no progress for half a second
                if sent[0] != last:
                    last, still = sent[0], time.monotonic()
                assert not error, error
                t.join(0.05)
        finally:
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            t.join(30)
        assert time.monotonic() - killed < 3.0  # not the 10 s send timeout
        assert len(error) == 1 and isinstance(error[0], SchedulerGone), error


def test_hello_through_a_dispatcher_with_its_replica_lost_is_accepted(
        rig: Rig, tmp_path: Path) -> None:
    from bus import RpcCaller
    from messages import PROTOCOL_VERSION
    from scheduler.handshake import local_protocol

    while not rig.lost:  # the replica falls silent and is lost
        rig.step()
    fp, layout = local_protocol()
    with RpcCaller(f"ipc://{tmp_path}/f/rpc") as caller:
        for rid, params in (("h1", {"fingerprint": fp}),
                            ("h2", {"fingerprint": "0" * len(fp), "layout": layout})):
            caller.send_nowait(RpcReqInput(rid=rid, method="hello", parameters={
                "protocol_version": PROTOCOL_VERSION, **params}))
            reply = None
            deadline = time.monotonic() + 30
            while reply is None:
                assert time.monotonic() < deadline
                rig.step(0.0)
                if caller.socket.poll(10):
                    env = caller.drain(1)[0]
                    assert isinstance(env, Envelope)
                    reply = env.message
            assert isinstance(reply, RpcReqOutput) and reply.rid == rid
            assert reply.success and reply.result is not None, reply.message
            assert reply.result["accepted"] is True
    assert rig.dispatcher.logs.hello.total == 0  # an equal layout is nothing to log


def test_a_caller_that_never_reads_its_replies_gets_no_more_calls_run(
        rig: Rig, tmp_path: Path) -> None:
    with RpcCaller(f"ipc://{tmp_path}/f/rpc", options=SocketOptions(hwm=4)) as caller:
        sent = 0
        deadline = time.monotonic() + 60
        while sent < 600:  # it never reads
            assert time.monotonic() < deadline
            try:
                caller.send_nowait(RpcReqInput(rid=f"c{sent}", method="get_load"))
                sent += 1
            except WouldBlock:
                pass
            rig.step(0.0)
            rig.replica.answer(0, 0, wait_ms=1)
        while rig.dispatcher.stats["rpc_calls_not_run"] + rig.replica.calls < 600:
            assert time.monotonic() < deadline
            rig.step(0.0)
            rig.replica.answer(0, 0, wait_ms=1)
    # Only its first ones ran: those whose replies filled its sockets and the kernel's
    # buffers (about 200 small ones here).
    assert rig.dispatcher.stats["rpc_calls_not_run"] >= 300
    assert rig.lost == 0


def test_garbage_and_reused_rids_are_summarized_not_logged_each(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    import zmq

    rig.send(1)  # in flight: a second request under its rid is dropped
    rid = next(iter(rig.dispatcher.ledger._entries))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw = ctx.socket(zmq.PUSH)
    raw.connect(rig.client_work.socket.getsockopt_string(zmq.LAST_ENDPOINT))
    with caplog.at_level("INFO", logger="scheduler.dp"):
        for n in range(200):
            raw.send(b"\xc1garbage" + bytes([n]))
            rig.client_work.send(TokenizedGenerateReqInput(
                rid=rid, input_ids=token_ids([1]), sampling=SamplingParams(max_new_tokens=1)))
        deadline = time.monotonic() + 30
        while rig.dispatcher.stats["rejected"] < 200 or \
                rig.dispatcher.stats["duplicate_rid"] < 200:
            assert time.monotonic() < deadline, rig.dispatcher.stats
            rig.step(0.0)
        rig.dispatcher.logs.flush()
    raw.close(0)
    lines = [r for r in caplog.records if r.name == "scheduler.dp"]
    assert len(lines) <= 4, [r.getMessage()[:80] for r in lines]  # first + summary, per kind


def test_a_dispatcher_that_fails_answers_and_aborts_what_it_had(rig: Rig) -> None:
    # A dispatcher whose loop ends (an exception, as a SIGTERM's) answers what it had in
    # flight and aborts it on its replicas, which would otherwise go on generating.
    rids = rig.send(2)
    rig.replica.take(2, wait_ms=5_000)

    def fails() -> int:
        raise RuntimeError("a bug")

    rig.dispatcher.step = fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        rig.dispatcher.run()
    answers: dict[str, ErrorOut] = {}
    aborted: list[str] = []
    deadline = time.monotonic() + 10
    while (len(answers) < 2 or len(aborted) < 2) and time.monotonic() < deadline:
        for env in rig.client_out.drain(64):
            assert isinstance(env, Envelope) and isinstance(env.message, ErrorOut)
            answers[env.message.rid] = env.message
        if rig.replica.work.socket.poll(10):
            for req in rig.replica.work.drain(64):
                assert isinstance(req, Envelope) and isinstance(req.message, AbortReq)
                aborted.append(req.message.rid)
    assert sorted(answers) == sorted(aborted) == sorted(rids)
    assert all(a.code == "internal" and "RuntimeError: a bug" in a.message
               for a in answers.values())


def test_a_stop_whose_answers_its_consumer_does_not_read_says_which_are_lost(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # A stop gives a consumer that is not reading a bounded wait (the last flush), not
    # forever; the terminal answers it never took are named in the log, not dropped
    # silently with the backlog.
    rids = rig.send(1)
    rig.replica.take(1, wait_ms=5_000)
    tokens = BatchTokenIDOut.from_lists(rids, [[7]], [None])
    deadline = time.monotonic() + 30
    while not rig.dispatcher.router.backlog:  # every buffer on the way to the client is full
        assert time.monotonic() < deadline, "the client's buffers never filled"
        for _ in range(256):
            try:
                rig.replica.out.send_nowait(tokens)
            except WouldBlock:
                break
        rig.dispatcher.receiver.wait(0.01)
        rig.dispatcher.step()  # (not Rig.step: the client reads nothing)
    rig.dispatcher.stop_requested = lambda: True  # as a stop signal would
    rig.dispatcher.finish_flush = 1.0  # (the client never reads: no need to wait 5 s)
    with caplog.at_level("WARNING", logger="scheduler.dp"), pytest.raises(KeyboardInterrupt):
        rig.dispatcher.run()
    lost = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(lost) == 1 and repr(rids[0]) in lost[0] and "shutdown" in lost[0], lost
