"""Replicas an operator runs (``serve``) behind a ``dispatch`` that is SIGKILLed:
they drop what they were decoding for it within a bound and serve the next one.

One replica on an ``ipc://`` directory (it connects its output socket to the
dispatcher, which binds it) and one on ``tcp://`` (it binds its output port,
the dispatcher connects): both sides of the output socket are covered.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from bus import Envelope, PullInbox, PushOutbox, RpcClient
from messages import (
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Output,
    Request,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from tests import procs

#: How soon a replica drops the requests of a dispatcher that died (README,
#: docs/ARCHITECTURE.md): its output socket's last peer disconnects when the
#: dispatcher's process dies, and the replica's next step (milliseconds) sees it.
UPSTREAM_BOUND = 1.0
#: Slack for a shared, busy CI host (a step, an rpc round trip, scheduling).
SLACK = 2.0
PER_REPLICA = 4


#: The dispatchers' heartbeat timeout: far above a busy host's pauses. The tcp replica has
#: no pid for its dispatcher to watch, so it is judged by its heartbeats alone; one
#: taken for lost on a starved 2-core host was reopened and rejoined, and its requests
#: ended by the rejoin's aborts, not by this test's dispatcher death.
HEARTBEAT_TIMEOUT = 60.0


def _dispatch(front: Path, replicas: list[str]) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(front),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)]
    for r in replicas:
        args += ["--replica", r]
    return subprocess.Popen(args, stderr=subprocess.DEVNULL, text=True)


def _load(rpc: RpcClient) -> dict[str, object]:
    reply = rpc.call("get_load", timeout=60)
    assert reply.success and reply.result is not None, reply.message
    return dict(reply.result)


def _until_served(rpc: RpcClient, deadline: float) -> None:
    """The dispatcher answers once every replica is live."""
    while not (reply := rpc.call("get_load", timeout=60)).success:
        assert time.monotonic() < deadline, reply.message


def _client(front: Path) -> tuple[PullInbox[Output], PushOutbox[Request], RpcClient]:
    return (PullInbox(Codec(Output), f"ipc://{front}/out"),
            PushOutbox(Codec(Request), f"ipc://{front}/work"),
            RpcClient(f"ipc://{front}/rpc"))


def _stream(rid: str, rank: int, n: int) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=token_ids([1, 2, 3]), dp_rank=rank, stream=True,
        sampling=SamplingParams(max_new_tokens=n, ignore_eos=True))


def _read_until_done(out: PullInbox[Output], rids: set[str], timeout: float) -> set[str]:
    """Read outputs until every rid in ``rids`` has finished; returns every rid seen."""
    seen: set[str] = set()
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while not rids <= done:
        assert time.monotonic() < deadline, f"unfinished: {sorted(rids - done)}"
        if out.socket.poll(100):
            for env in out.drain(256):
                assert isinstance(env, Envelope), env
                msg = env.message
                assert not isinstance(msg, ErrorOut), msg
                if isinstance(msg, BatchTokenIDOut):
                    for rid, _, fin in msg.items():
                        seen.add(rid)
                        if fin is not None:
                            done.add(rid)
    return seen


def test_a_killed_dispatchers_requests_stop_on_its_replicas_and_a_new_one_is_served(
        tmp_path: Path) -> None:
    local, front = tmp_path / "a", tmp_path / "front"
    for d in (local, front):
        d.mkdir(mode=0o700)
    base = procs.free_tcp_base()
    remote = f"tcp://127.0.0.1:{base}"
    # An output backlog with room for seconds of the stub's steps: on a starved host, a
    # replica may stream for a second before its outputs are first taken (the
    # dispatcher's connection, or its reading, not up yet), and the default bound (1,024
    # outputs) then ended its requests as overloaded before the dispatcher died.
    replicas = [subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint", ep,
                                  "--max-backlog", str(1 << 20)],
                                 stderr=subprocess.DEVNULL, text=True)
                for ep in (str(local), remote)]
    rpcs = [RpcClient(f"ipc://{local}/rpc"), RpcClient(f"tcp://127.0.0.1:{base + 1}")]
    dispatcher = _dispatch(front, [str(local), remote])
    new: subprocess.Popen[str] | None = None
    try:
        out, work, rpc = _client(front)
        with out, work, rpc:
            _until_served(rpc, time.monotonic() + 120)
            for rank in range(2):
                for i in range(PER_REPLICA):
                    work.send(_stream(f"old{rank}.{i}", rank, 100_000))
            # Read what they stream until every request's outputs have reached us
            # through the dispatcher (a reader that lags makes the dispatcher hold
            # the replicas' outputs back).
            rids = {f"old{rank}.{i}" for rank in range(2) for i in range(PER_REPLICA)}
            seen: set[str] = set()
            deadline = time.monotonic() + 60
            while not (rids <= seen
                       and [_load(r)["running"] for r in rpcs] == [PER_REPLICA] * 2):
                assert time.monotonic() < deadline, (sorted(rids - seen),
                                                     [_load(r) for r in rpcs])
                out.socket.poll(100)
                for env in out.drain(1 << 16):
                    assert isinstance(env, Envelope), env
                    assert not isinstance(env.message, ErrorOut), env.message
                    if isinstance(env.message, BatchTokenIDOut):
                        seen.update(env.message.rids)
        dispatcher.send_signal(signal.SIGKILL)
        dispatcher.wait(30)
        killed = time.monotonic()
        # Every replica drops them (the tcp one's rpc is answered between steps).
        while [_load(r)["running"] for r in rpcs] != [0, 0]:
            assert time.monotonic() - killed < UPSTREAM_BOUND + SLACK, \
                f"still running {time.monotonic() - killed:.2f} s after the dispatcher died: " \
                f"{[_load(r)['running'] for r in rpcs]}"
        loads = [_load(r) for r in rpcs]
        assert [x["upstream_aborts"] for x in loads] == [PER_REPLICA] * 2, loads
        assert [x["queued"] for x in loads] == [0, 0], loads
        assert all(p.poll() is None for p in replicas), "a replica exited"
        # A new dispatcher over the same replicas is served, and none of the old
        # requests' outputs reaches it.
        new = _dispatch(front, [str(local), remote])
        out, work, rpc = _client(front)
        with out, work, rpc:
            _until_served(rpc, time.monotonic() + 120)
            rids = {f"new{rank}.{i}" for rank in range(2) for i in range(2)}
            for rid in sorted(rids):
                work.send(_stream(rid, int(rid[3]), 8))
            # (what zmq still held for the dead connection reaches the new dispatcher,
            # which drops it as stale: its client sees only its own requests)
            assert _read_until_done(out, rids, 60) == rids
    finally:
        for r in rpcs:
            r.close()
        for p in (*replicas, dispatcher, *([new] if new is not None else [])):
            procs.stop(p)
