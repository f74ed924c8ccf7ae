"""The dispatcher's side of prefill and decode apart, stepped by hand over replicas the
test plays (their work, rpc and out sockets, as in ``test_dp_liveness``), so the
order in which a hand-off and an abort reach it is the test's, not the machine's:

* an abort that reaches the dispatcher while the hand-off is between the prefill
  replica and the dispatcher (the prefill replica sent it before it read the abort)
  ends the request at the decode replica the hand-off goes to;
* a hand-off that no decode replica reads (one stopped, or alive but not reading its
  work socket) is freed after the dispatcher's ``handoff_deadline``: its slab is
  unlinked from ``/dev/shm``, and the client told so (``replica_lost``, naming the rid
  and the deadline).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bus import Envelope, PullInbox, PushOutbox, RpcServer
from bus.shm.segment import SHM_DIR
from messages import (
    AbortReq,
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    KVHandoff,
    Output,
    Request,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler.dp import Dispatcher, ReplicaSpec
from scheduler.launch.wiring import Endpoints
from tests.scheduler.test_dp_liveness import FakeClock, FakeReplica

SP = SamplingParams(max_new_tokens=100, temperature=0.0)
DEADLINE = 0.5  #: the dispatcher's handoff_deadline under test (real seconds)


@dataclass
class PdRig:
    clock: FakeClock
    dispatcher: Dispatcher
    prefill: FakeReplica
    decode: FakeReplica
    client_work: PushOutbox[Request]
    client_out: PullInbox[Output]
    got: dict[int, list[Request]] = field(default_factory=lambda: {0: [], 1: []})

    def step(self, read_decode: bool = True) -> None:
        """Let the dispatcher take what waits; each replica reads its work socket (the
        decode one only if ``read_decode``: else its requests stay in its socket)."""
        self.clock.t += 0.05
        self.dispatcher.receiver.wait(0.01)
        self.dispatcher.step()
        for i, rep in ((0, self.prefill), (1, self.decode)):
            rep.answer(i, 0, wait_ms=0)  # the decode one busy: never lost as idle
            if i == 1 and not read_decode:
                continue
            for env in rep.work.drain(64):
                assert isinstance(env, Envelope)
                self.got[i].append(env.message)

    def until(self, what: str, cond: Callable[[], object], read_decode: bool = True) -> None:
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, f"the dispatcher did not get there: {what}"
            self.step(read_decode)


def _replica(ep: Endpoints) -> FakeReplica:
    return FakeReplica(PullInbox(Codec(Request), ep.work), RpcServer(Codec(Request), ep.rpc),
                       PushOutbox(Codec(Output), ep.out))


@pytest.fixture
def pd_rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PdRig]:
    """The rig; ``request.param`` (indirect parametrization): more ``Dispatcher`` args."""
    dirs = [tmp_path / n for n in ("p", "d", "f")]
    for path in dirs:
        path.mkdir()
    eps = [Endpoints.in_dir(str(path)) for path in dirs]
    prefill, decode = _replica(eps[0]), _replica(eps[1])
    front = eps[2]
    client_out: PullInbox[Output] = PullInbox(Codec(Output), front.out)
    work: PullInbox[Request] = PullInbox(Codec(Request), front.work)
    rpc: RpcServer[Request] = RpcServer(Codec(Request), front.rpc)
    out: PushOutbox[Output] = PushOutbox(Codec(Output), front.out)
    client_work: PushOutbox[Request] = PushOutbox(Codec(Request), front.work)
    clock = FakeClock()
    d = Dispatcher(work, rpc, out, [ReplicaSpec(eps[0]), ReplicaSpec(eps[1])],
                   heartbeat_interval=0.2, heartbeat_timeout=60.0, clock=clock, pd=(1, 1),
                   **{"handoff_deadline": DEADLINE, **getattr(request, "param", {})})
    r = PdRig(clock, d, prefill, decode, client_work, client_out)
    try:
        r.until("both replicas joined", lambda: all(rep.live for rep in d.replicas))
        d.serve_upstream()
        yield r
    finally:
        d.close()
        for c in (prefill.work, prefill.rpc, prefill.out, decode.work, decode.rpc, decode.out,
                  client_out, work, rpc, out, client_work):
            c.close()


def _handoff(rid: str, positions: int = 3) -> KVHandoff:
    return KVHandoff(rid=rid, input_ids=token_ids([5, 9, 2]), output_ids=token_ids([7]), sent=1,
                     sampling=SP, kv=torch.zeros(1, 2, 1, positions, 4),
                     fingerprint="fake:0:float32", stream=True)


def test_an_abort_while_the_hand_off_is_on_its_way_to_the_dispatcher_ends_it_at_decode(
        pd_rig: PdRig) -> None:
    r = pd_rig
    r.client_work.send(TokenizedGenerateReqInput(rid="x", input_ids=token_ids([5, 9, 2]),
                                                 sampling=SP, stream=True))
    r.until("x read by the prefill replica", lambda: r.got[0])
    first = r.got[0][0]
    assert isinstance(first, TokenizedGenerateReqInput) and first.prefill_only
    # The prefill replica streams the first token; the client aborts, and the abort
    # reaches the prefill replica after it sent its hand-off (which the dispatcher has
    # not taken yet): the replica no longer holds the request and ignores the abort.
    r.prefill.out.send(BatchTokenIDOut.from_lists(["x"], [[7]], [None]))
    r.client_work.send(AbortReq(rid="x"))
    r.until("the abort forwarded to the prefill replica",
            lambda: any(isinstance(m, AbortReq) for m in r.got[0]))
    r.prefill.out.send(_handoff("x"))
    r.until("the hand-off at the decode replica",
            lambda: any(isinstance(m, KVHandoff) for m in r.got[1]))
    for _ in range(5):  # what follows it in the same step, or a later one
        r.step()
    kinds = [type(m).__name__ for m in r.got[1]]
    assert kinds == ["KVHandoff", "AbortReq"], kinds
    assert all(m.rid == "x" for m in r.got[1])


def test_a_hand_off_nobody_reads_is_freed_after_the_deadline(pd_rig: PdRig) -> None:
    r = pd_rig
    pool = r.dispatcher.replicas[1].work.shm_frames
    assert pool is not None
    r.client_work.send(TokenizedGenerateReqInput(rid="y", input_ids=token_ids([5, 9, 2]),
                                                 sampling=SP, stream=True))
    r.until("y read by the prefill replica", lambda: r.got[0])
    r.prefill.out.send(_handoff("y", positions=1 << 15))  # 1 MiB: through shared memory
    # The decode replica answers heartbeats but does not read its work socket (as a
    # stopped one, or one whose socket the hand-off waits in): nobody claims the slab.
    r.until("the hand-off sent on to the decode replica",
            lambda: r.dispatcher.stats["handed_off"] == 1, read_decode=False)
    slabs = [os.path.join(SHM_DIR, s.seg.name) for c in pool._classes.values() for s in c]
    assert pool.bytes_held >= 1 << 20 and slabs and all(map(os.path.exists, slabs))
    assert pool.bytes_unreleased >= 1 << 20  # what a sender's max_handoff_bytes counts
    sent = time.monotonic()
    r.until("the hand-off's slab freed", lambda: not pool.bytes_held, read_decode=False)
    assert r.dispatcher.stats["lost"] == 0  # freed by its deadline, the replica still live
    assert time.monotonic() - sent >= DEADLINE * 0.9  # not before its deadline
    assert not any(map(os.path.exists, slabs)), slabs  # nothing left in /dev/shm
    assert pool.bytes_unreleased == 0
    # The client hears why, once: the rid, that nobody adopted it, and the deadline.
    errors: list[ErrorOut] = []

    def answered() -> bool:
        errors.extend(e.message for e in r.client_out.drain(8)
                      if isinstance(e, Envelope) and isinstance(e.message, ErrorOut))
        return bool(errors)

    r.until("the client answered", answered, read_decode=False)
    (err,) = errors
    assert err.rid == "y" and err.code == "replica_lost", err
    assert f"request 'y': its hand-off to replica1 expired unadopted after {DEADLINE:g} s" \
        in err.message, err.message
    assert r.dispatcher.ledger.get("y") is None
    # Read now, it is refused as reclaimed (rejected: never adopted from freed memory).
    deadline = time.monotonic() + 10
    while not r.decode.work.socket.poll(50):
        assert time.monotonic() < deadline
    got = r.decode.work.drain(8)
    assert got and not any(isinstance(e, Envelope) for e in got), got


def _client_errors(r: PdRig, into: list[ErrorOut]) -> bool:
    """Read the client's socket into ``into``; whether any error came."""
    into.extend(e.message for e in r.client_out.drain(8)
                if isinstance(e, Envelope) and isinstance(e.message, ErrorOut))
    return bool(into)


@pytest.mark.parametrize("pd_rig", [{"max_handoff_bytes": 3 << 19, "handoff_deadline": 60.0}],
                         indirect=True)
def test_the_hop_to_a_decode_replica_keeps_the_hand_off_byte_bound(pd_rig: PdRig) -> None:
    """Past ``max_handoff_bytes`` unreleased by the decode replica, a hand-off waits at
    the dispatcher (in order, never dropped) until the replica releases one; one larger
    than the bound alone is answered with the rid, its size and the bound."""
    r = pd_rig
    pool = r.dispatcher.replicas[1].work.shm_frames
    assert pool is not None
    for rid in ("a", "b", "c"):
        r.client_work.send(TokenizedGenerateReqInput(rid=rid, input_ids=token_ids([5, 9, 2]),
                                                     sampling=SP, stream=True))
    r.until("a, b and c read by the prefill replica", lambda: len(r.got[0]) == 3)
    r.prefill.out.send(BatchTokenIDOut.from_lists(["a", "b", "c"], [[7], [7], [7]],
                                                  [None, None, None]))  # first tokens
    for rid in ("a", "b"):
        r.prefill.out.send(_handoff(rid, positions=1 << 15))  # 1 MiB each: 2 > 1.5 MiB
    r.until("a sent on to the decode replica",
            lambda: r.dispatcher.stats["handed_off"] >= 1, read_decode=False)
    for _ in range(10):
        r.step(read_decode=False)
    assert r.dispatcher.stats["handed_off"] == 1  # b waits: a is not released yet
    assert pool.bytes_unreleased == 1 << 20
    r.prefill.out.send(_handoff("c", positions=1 << 16))  # 2 MiB: never fits
    errors: list[ErrorOut] = []
    r.until("c answered", lambda: _client_errors(r, errors), read_decode=False)
    (err,) = errors
    assert err.rid == "c" and err.code == "invalid_request", err
    assert err.message == (f"request 'c', prefilled by replica0: its hand-off of {2 << 20} "
                           f"bytes exceeds max_handoff_bytes={3 << 19}"), err.message
    # The decode replica reads a and lets it go: b follows, nothing dropped.
    r.until("a read", lambda: r.got[1], read_decode=True)
    assert [m.rid for m in r.got[1] if isinstance(m, KVHandoff)] == ["a"]
    r.got[1].clear()  # (its views of a's slab: released as they go)
    r.until("b sent on", lambda: r.dispatcher.stats["handed_off"] == 2)
    r.until("b read", lambda: r.got[1])
    assert [m.rid for m in r.got[1] if isinstance(m, KVHandoff)] == ["b"]
    assert not _client_errors(r, errors[:0]) and r.dispatcher.stats["lost"] == 0


def test_over_tcp_a_senders_hand_off_bytes_are_those_zmq_has_not_written_out() -> None:
    """With no shared memory (``tcp://``), what a prefill replica's bound (and the
    dispatcher's hop) counts is what zmq still holds of its sends: all of it while the
    peer is away, nothing once the peer has taken it."""
    import socket

    from scheduler.launch.wiring import _unreleased
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = f"tcp://127.0.0.1:{port}"
    out: PushOutbox[Output] = PushOutbox(Codec(Output), ep)  # no peer yet: zmq keeps them
    inbox: PullInbox[Output] | None = None
    try:
        assert out.shm_frames is None
        held = _unreleased(out)
        assert held() == 0  # (read before the first hand-off, as a scheduler's loop does)
        for rid in ("t0", "t1"):
            out.send_nowait(_handoff(rid, positions=1 << 15))  # 1 MiB each
        assert held() == out.bytes_unsent == 2 << 20
        inbox = PullInbox(Codec(Output), ep)
        got: list[object] = []
        deadline = time.monotonic() + 20
        while len(got) < 2 or held():
            assert time.monotonic() < deadline, (len(got), held())
            inbox.socket.poll(20)  # (returns as soon as a message waits)
            got.extend(e.message for e in inbox.drain(8) if isinstance(e, Envelope))
        assert [h.rid for h in got if isinstance(h, KVHandoff)] == ["t0", "t1"]
    finally:
        out.close()
        if inbox is not None:
            inbox.close()
