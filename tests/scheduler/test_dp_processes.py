"""Data parallel with real processes: replicas killed, restarted, silenced, given up,
and ``serve --dp`` / ``dispatch`` as an operator runs them (split from test_dp.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bus import Envelope, PullInbox, PushOutbox, RpcClient, RpcServer, SocketOptions
from messages import (
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Message,
    Output,
    Request,
    RpcReqOutput,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler import Engine, ModelConfig, RequestFailed
from scheduler.core.backpressure import FINISH_FLUSH
from scheduler.launch.wiring import Endpoints
from tests import procs
from tests.conftest import eventually

# -- the dispatch table ---------------------------------------------------------



STUB_MODEL = ModelConfig(kind="stub")


def test_a_killed_replica_costs_only_its_started_requests() -> None:
    with Engine("zmq", dp_size=2, max_batch=256) as engine:
        slow = SamplingParams(max_new_tokens=100_000)
        streams = [engine.submit([1 + n % 5] * 8, slow, stream=True, dp_rank=n % 2)
                   for n in range(60)]
        for h in streams:  # every one has started on its replica
            next(iter(h))
        for pid in engine.replica_pids[0]:
            os.kill(pid, signal.SIGSTOP)  # it starts nothing more: what it is sent waits
        # A flood before it dies: the part dispatched to replica0 never starts there.
        flood = [engine.submit([2, 3], SamplingParams(max_new_tokens=3)) for _ in range(200)]
        deadline = time.monotonic() + 30
        while engine.pending > len(streams) + 150:  # replica1 answered 50: the flood is in
            assert time.monotonic() < deadline, f"{engine.pending} pending"
            time.sleep(0.005)  # sleep-ok: pacing of a deadline poll
        for pid in engine.replica_pids[0]:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for h in streams[0::2]:  # replica0's: every one ends, with the loss named
            with pytest.raises(RequestFailed) as info:
                h.result(10)
            assert info.value.code == "replica_lost" and "replica0" in str(info.value)
        ended_within = time.monotonic() - killed_at
        for h in flood:  # none had started on replica0: each ran on replica1 instead
            assert len(h.result(30).token_ids) == 3
        for h in streams[1::2]:  # replica1's streams never noticed
            engine.abort(h.rid)
            assert h.result(10).finish_reason == "abort"
        assert ended_within < 1.0 + 1.0  # 1 s, plus slack for this 2-core machine
        reply = engine.collective_rpc("get_load")  # unless it was restarted already
        assert reply.result is not None and reply.result["failed"] in ([], ["replica0"])
        assert reply.success or "replica0: not live" in reply.message
        redispatched = reply.result["dispatcher.redispatched"]
        assert isinstance(redispatched, int) and redispatched > 0, reply.result
        assert engine.generate([5, 6], SamplingParams(max_new_tokens=2)).token_ids
        try:
            engine.generate([5, 6], SamplingParams(max_new_tokens=2), dp_rank=0)
        except RequestFailed as exc:
            assert "replica 0, which is not live" in str(exc)
    # close() returned: nothing hung


# -- a dispatcher over replicas that already run, and a restart -----------------


def _serve(directory: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                             str(directory)], stderr=subprocess.DEVNULL, text=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(30)


def _dispatch_over_two(tmp_path: Path) -> tuple[list[Path], list[subprocess.Popen[str]],
                                                  subprocess.Popen[str]]:
    """Two ``serve`` replicas and a ``dispatch`` over them (heartbeat timeout 1 s):
    the directories (replica a, replica b, front), the replicas, the dispatcher."""
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "front"]
    for d in dirs:
        d.mkdir(mode=0o700)
    replicas = [_serve(dirs[0]), _serve(dirs[1])]
    front = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(dirs[2]),
         "--replica", str(dirs[0]), "--replica", str(dirs[1]), "--heartbeat-timeout", "1.0"],
        stderr=subprocess.DEVNULL, text=True)
    return dirs, replicas, front


def test_dispatch_over_running_replicas_a_second_dispatcher_refused_and_a_restarted_one_rejoins(
        tmp_path: Path) -> None:
    dirs, replicas, front = _dispatch_over_two(tmp_path)
    try:
        with RpcClient(f"ipc://{dirs[2]}/rpc") as rpc:
            def load(want_ok: bool, deadline: float) -> RpcReqOutput:
                while True:
                    reply = rpc.call("get_load", timeout=60)
                    if reply.success == want_ok or time.monotonic() > deadline:
                        return reply

            assert load(True, time.monotonic() + 60).success
            # A second dispatcher over a replica already dispatched to is refused,
            # and the first is untouched.
            second = subprocess.run(
                [sys.executable, "-m", "scheduler", "dispatch", "--endpoint",
                 str(tmp_path / "front2"), "--replica", str(dirs[0])],
                capture_output=True, text=True, timeout=60)
            assert second.returncode == 1 and "another live process" in second.stderr
            assert "Traceback" not in second.stderr, second.stderr
            assert rpc.call("get_load", timeout=30).success
            _stop(replicas[1])
            down = load(False, time.monotonic() + 10)
            assert not down.success and "replica1" in down.message
            replicas[1] = _serve(dirs[1])  # restarted: rejoins, no dispatcher restart
            back = load(True, time.monotonic() + 60)
            assert back.success, back.message
        # Stopped with SIGTERM mid-stream: its client gets a terminal answer, and the
        # replica stops generating (not silence while the replicas go on ~20 s).
        out, work, rpc = _raw_client(dirs[2])
        with out, work, rpc, RpcClient(f"ipc://{dirs[0]}/rpc") as rpc0:
            assert _load(rpc).success
            work.send(TokenizedGenerateReqInput(rid="t0", input_ids=token_ids([1, 2]), dp_rank=0,
                                                sampling=SamplingParams(max_new_tokens=100_000),
                                                stream=True))
            seen: dict[str, list[Output]] = {}
            _collect(out, lambda s: "t0" in s, seen)
            front.send_signal(signal.SIGTERM)
            _collect(out, lambda s: _ended_with(s, "t0") is not None, seen)
            end = _ended_with(seen, "t0")
            assert isinstance(end, ErrorOut) and end.code == "shutdown", end
            assert front.wait(30) == 0
            eventually(lambda: _running(rpc0) == 0, 10.0, "replica a to abort it")
    finally:
        for p in (*replicas, front):
            _stop(p)


def _load(rpc: RpcClient) -> RpcReqOutput:
    return rpc.call("get_load", timeout=60)


def _running(rpc: RpcClient) -> object:
    result = _load(rpc).result
    return None if result is None else result["running"]


def _raw_client(directory: Path) -> tuple[PullInbox[Output], PushOutbox[Request], RpcClient]:
    return (PullInbox(Codec(Output), f"ipc://{directory}/out"),
            PushOutbox(Codec(Request), f"ipc://{directory}/work"),
            RpcClient(f"ipc://{directory}/rpc"))


def _collect(out: PullInbox[Output], until: Callable[[dict[str, list[Output]]], bool],
             seen: dict[str, list[Output]], timeout: float = 30.0) -> None:
    """Read outputs into ``seen`` (per rid) until ``until(seen)`` or the deadline."""
    deadline = time.monotonic() + timeout
    while not until(seen):
        assert time.monotonic() < deadline, {k: len(v) for k, v in seen.items()}
        if out.socket.poll(100):
            for env in out.drain(256):
                assert isinstance(env, Envelope), env
                msg = env.message
                if isinstance(msg, BatchTokenIDOut):
                    for rid, _, fin in msg.items():
                        seen.setdefault(rid, []).append(msg)
                        if fin is not None:
                            seen.setdefault(f"{rid}/end", []).append(msg)
                elif isinstance(msg, ErrorOut):
                    seen.setdefault(msg.rid, []).append(msg)
                    seen.setdefault(f"{msg.rid}/end", []).append(msg)


def _ended_with(seen: dict[str, list[Output]], rid: str) -> Output | None:
    ends = seen.get(f"{rid}/end")
    return ends[-1] if ends else None


def _until_all_live(rpc: RpcClient) -> None:
    """The dispatcher serves once one replica is live: wait until every one is."""
    deadline = time.monotonic() + 60
    while not (reply := rpc.call("get_load", timeout=60)).success:
        assert time.monotonic() < deadline, reply.message


def test_a_silent_replica_that_returns_leaks_no_old_output(tmp_path: Path) -> None:
    dirs, replicas, front = _dispatch_over_two(tmp_path)
    out, work, rpc = _raw_client(dirs[2])
    try:
        _until_all_live(rpc)
        slow = SamplingParams(max_new_tokens=100_000)
        for n in range(4):
            work.send(TokenizedGenerateReqInput(rid=f"s{n}", input_ids=token_ids([1, 2]),
                                                sampling=slow, stream=True, dp_rank=0))
        seen: dict[str, list[Output]] = {}
        _collect(out, lambda s: all(f"s{n}" in s for n in range(4)), seen)
        os.kill(replicas[0].pid, signal.SIGSTOP)  # silent, not dead
        try:
            _collect(out, lambda s: all(_ended_with(s, f"s{n}") for n in range(4)), seen)
        finally:
            os.kill(replicas[0].pid, signal.SIGCONT)
        for n in range(4):
            end = _ended_with(seen, f"s{n}")
            assert isinstance(end, ErrorOut) and end.code == "replica_lost", end
        deadline = time.monotonic() + 30
        while not rpc.call("get_load", timeout=30).success:  # it rejoins
            assert time.monotonic() < deadline
        # A retry under the same rid, on the same replica: never the old stream's
        # tokens; refused as overloaded until the orphan's abort has ended it there.
        while True:
            seen.clear()
            work.send(TokenizedGenerateReqInput(rid="s0", input_ids=token_ids([1, 2]), dp_rank=0,
                                                sampling=SamplingParams(max_new_tokens=3)))
            _collect(out, lambda s: _ended_with(s, "s0") is not None, seen)
            end = _ended_with(seen, "s0")
            if isinstance(end, ErrorOut):
                assert end.code == "overloaded" and "still ending" in end.message, end
                assert time.monotonic() < deadline
                continue
            assert isinstance(end, BatchTokenIDOut)
            tokens = sum(len(ids) for m in seen["s0"] if isinstance(m, BatchTokenIDOut)
                         for rid, ids, _ in m.items() if rid == "s0")
            assert tokens == 3
            break
        while True:  # the orphans were aborted there: nothing left running
            load = rpc.call("get_load", timeout=30).result
            assert load is not None
            if load["replica0.running"] == 0 and load["replica0.queued"] == 0:
                break
            assert time.monotonic() < deadline, load
        assert rpc.call("shutdown", timeout=30).success
        front.wait(30)
    finally:
        for c in (out, work, rpc):
            c.close()
        for p in (*replicas, front):
            _stop(p)


def test_a_replica_whose_outputs_never_arrive_is_lost_not_waited_for(tmp_path: Path) -> None:
    replica, front = tmp_path / "r", tmp_path / "front"
    replica.mkdir(mode=0o700)
    front.mkdir(mode=0o700)
    stop = threading.Event()

    def black_hole() -> None:  # answers heartbeats, swallows work, never outputs
        with RpcServer(Codec(Request), f"ipc://{replica}/rpc") as srv, \
                PullInbox(Codec(Request), f"ipc://{replica}/work") as sink:
            reply: Codec[Message] = Codec(Message, types=[RpcReqOutput])
            while not stop.is_set():
                if srv.socket.poll(50):
                    for env in srv.drain(64):
                        if isinstance(env, Envelope):
                            load = {"running": 0, "queued": 0}
                            srv.reply(reply.encode(RpcReqOutput(
                                rid=env.message.rid, success=True,
                                result=dict(load.items()))), env.origin)
                sink.drain(64)

    hole = threading.Thread(target=black_hole)
    hole.start()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(front),
         "--replica", str(replica), "--heartbeat-timeout", "0.5"],
        stderr=subprocess.DEVNULL, text=True)
    out, work, rpc = _raw_client(front)
    try:
        assert rpc.call("get_load", timeout=60).success
        t0 = time.monotonic()
        for n in range(3):
            work.send(TokenizedGenerateReqInput(rid=f"h{n}", input_ids=token_ids([1, 2, 3])))
        seen: dict[str, list[Output]] = {}
        _collect(out, lambda s: all(_ended_with(s, f"h{n}") for n in range(3)), seen)
        for n in range(3):
            end = _ended_with(seen, f"h{n}")
            assert isinstance(end, ErrorOut) and end.code == "replica_lost", end
            assert "do not reach this dispatcher" in end.message
        assert time.monotonic() - t0 < 10
        rpc.call("shutdown", timeout=5)
        proc.wait(30)
    finally:
        stop.set()
        hole.join()
        for c in (out, work, rpc):
            c.close()
        _stop(proc)


def test_a_killed_local_replica_is_restarted_rejoins_and_stays() -> None:
    with Engine("zmq", STUB_MODEL, dp_size=2) as engine:
        old = engine.replica_pids[0]
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.replica_pids[0] == old:  # restarted in place, by the engine itself
            assert time.monotonic() < deadline
            time.sleep(0.02)  # sleep-ok: pacing a deadline poll
        while True:  # it rejoins (a new generation) and takes work pinned to it
            try:
                assert engine.generate([1, 2], SamplingParams(max_new_tokens=2),
                                       dp_rank=0).token_ids
                break
            except RequestFailed as exc:
                assert "replica 0, which is not live" in str(exc)
                assert time.monotonic() < deadline
        for _ in range(20):  # and stays: not lost again on every tick
            assert engine.generate([1, 2], SamplingParams(max_new_tokens=2),
                                   dp_rank=0).token_ids
        load = engine.collective_rpc("get_load")
        assert load.success and load.result is not None
        assert load.result["replica0.generation"] == 2 and load.result["dispatcher.lost"] == 1
        assert engine._core._scheduler.processes.supervisor is not None
        assert engine._core._scheduler.processes.supervisor.restarts == [1, 0]


def test_closing_a_dp_engine_stops_its_supervisor_first() -> None:
    # It went on watching processes close() had closed: its next look raised
    # "process object is closed" in its thread (seen at the end of benchmarks.dp).
    errors: list[threading.ExceptHookArgs] = []
    old_hook = threading.excepthook
    threading.excepthook = errors.append
    try:
        engine = Engine("zmq", STUB_MODEL, dp_size=2)
        sup = engine._core._scheduler.processes.supervisor
        assert sup is not None
        engine.close()
        assert sup._stop.is_set()  # told to stop, not left to notice the dispatcher gone
        assert not sup._thread.is_alive()
    finally:
        threading.excepthook = old_hook
    assert errors == []


def test_a_replica_that_keeps_dying_is_given_up_after_its_tries() -> None:
    from multiprocessing.process import BaseProcess

    from scheduler.launch.respawn import ReplicaSupervisor, RespawnPolicy

    class Dead(BaseProcess):
        exitcode = 1

        def kill(self) -> None: ...

        def join(self, timeout: float | None = None) -> None: ...

    starts: list[int] = []

    def start(i: int, attempt: int) -> list[BaseProcess]:
        starts.append(attempt)
        return [Dead()]

    sup = ReplicaSupervisor([[Dead()]], start,
                            policy=RespawnPolicy(1, tries=3, backoff=0.01, backoff_max=0.02))
    sup.start()
    deadline = time.monotonic() + 30
    while 0 not in sup.given_up:
        assert time.monotonic() < deadline
        time.sleep(0.02)  # sleep-ok: pacing a deadline poll
    sup.stop()
    assert starts == [1, 2, 3] and sup.restarts == [3]


def test_a_killed_frontend_takes_its_scheduler_processes_with_it(tmp_path: Path) -> None:
    serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                              "--endpoint", str(tmp_path / "ep")],
                             stderr=subprocess.DEVNULL, text=True)
    try:
        with RpcClient(f"ipc://{tmp_path}/ep/rpc") as rpc:
            assert rpc.call("get_load", timeout=60).success
        children = procs.descendants(serve.pid)  # the fork server too
        assert len(procs.started(serve.pid)) >= 2  # its two replicas (it dispatches itself)
    finally:
        serve.kill()
        serve.wait(30)
    deadline = time.monotonic() + 10
    while any(procs.alive(pid) for pid in children):
        assert time.monotonic() < deadline, [p for p in children if procs.alive(p)]
        time.sleep(0.05)  # sleep-ok: pacing of a deadline poll




# -- serve --dp: how it ends ----------------------------------------------------


def _serve_dp(tmp_path: Path, stderr: int = subprocess.DEVNULL
              ) -> tuple[subprocess.Popen[str], RpcClient]:
    serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                              "--endpoint", str(tmp_path / "ep")], stderr=stderr, text=True)
    rpc = RpcClient(f"ipc://{tmp_path}/ep/rpc")
    deadline = time.monotonic() + 120
    while not rpc.call("get_load", timeout=120).success:  # both replicas live
        assert time.monotonic() < deadline
    return serve, rpc


def test_serve_dp_shutdown_with_a_replica_down_exits_non_zero(tmp_path: Path) -> None:
    serve, rpc = _serve_dp(tmp_path, subprocess.PIPE)
    try:
        load = rpc.call("get_load", timeout=30).result
        assert load is not None and isinstance(load["replica0.pid"], int)
        os.kill(load["replica0.pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while rpc.call("get_load", timeout=30).success:  # seen lost (restarting)
            assert time.monotonic() < deadline
        reply = rpc.call("shutdown", timeout=30)
        assert not reply.success
        _, err = serve.communicate(timeout=60)
        assert serve.returncode == 1, err
    finally:
        rpc.close()
        if serve.poll() is None:
            serve.kill()
        serve.wait(30)


def test_serve_dp_stops_promptly_on_sigint_to_the_parent_alone(tmp_path: Path) -> None:
    serve, rpc = _serve_dp(tmp_path)
    try:
        children = procs.descendants(serve.pid)
        t0 = time.monotonic()
        serve.send_signal(signal.SIGINT)
        code = serve.wait(60)
        took = time.monotonic() - t0
        assert code == 0 and took < 5.0, (code, took)  # 10.5 s before: a grace per replica
        deadline = time.monotonic() + 10
        while any(procs.alive(pid) for pid in children):
            assert time.monotonic() < deadline
            time.sleep(0.05)  # sleep-ok: pacing of a deadline poll
    finally:
        rpc.close()
        if serve.poll() is None:
            serve.kill()
        serve.wait(30)


def test_serve_dp_does_not_restart_a_replica_a_shutdown_stopped(tmp_path: Path) -> None:
    # Its exit 0 is no death only because it left the mark of that shutdown.
    log = tmp_path / "serve.log"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with open(log, "w") as err:
        serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                                  "--endpoint", str(tmp_path / "ep")], stderr=err, text=True,
                                 env={**os.environ, "TMPDIR": str(tmp)})
    rpc = RpcClient(f"ipc://{tmp_path}/ep/rpc")
    try:
        deadline = time.monotonic() + 120
        while not (reply := rpc.call("get_load", timeout=120)).success:  # both live
            assert time.monotonic() < deadline
        assert reply.result is not None
        replica0 = reply.result["replica0.pid"]
        assert isinstance(replica0, int)
        (run_dir,) = tmp.glob(f"tsbrun-{serve.pid}-dp-*")
        with RpcClient(f"ipc://{run_dir}/r0/rpc") as own:  # replica 0's own door
            assert own.call("shutdown", timeout=30).success
        procs.wait_gone([replica0], 30)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # a restart would come within 0.1 s
            assert "replica0 exited" not in log.read_text()
            time.sleep(0.1)  # sleep-ok: pacing a watch that must stay quiet
    finally:
        rpc.close()
        serve.terminate()
        serve.wait(60)


def test_dispatch_pd_hands_off_between_replicas_reached_over_tcp(tmp_path: Path) -> None:
    """``dispatch --pd 1:1`` over two ``serve`` replicas that already run on ``tcp://``
    bases: the first reads each prompt and hands its state over the wire (frames, no
    shared memory) through the dispatcher to the second, which decodes; the greedy
    answers are a colocated engine's, token for token."""
    prompts = [[3 + (7 * k + n) % 200 for n in range(length)]
               for k, length in enumerate((1, 5, 40, 300))]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    with Engine("ring") as colocated:
        want = [colocated.generate(p, greedy, timeout=60).token_ids for p in prompts]
    bases = [procs.free_tcp_base() for _ in range(2)]
    replicas = [subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                                  f"tcp://127.0.0.1:{base}"], stderr=subprocess.DEVNULL)
                for base in bases]
    front_dir = tmp_path / "front"
    front_dir.mkdir(mode=0o700)
    front = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(front_dir), "--pd",
         "1:1", "--max-handoff-bytes", str(96 << 20), "--handoff-deadline", "30",
         *(a for base in bases for a in ("--replica", f"tcp://127.0.0.1:{base}"))],
        stderr=subprocess.DEVNULL)
    try:
        out, work, rpc = _raw_client(front_dir)
        with out, work, rpc:
            _until_all_live(rpc)
            for n, prompt in enumerate(prompts):
                work.send(TokenizedGenerateReqInput(rid=f"p{n}", input_ids=token_ids(prompt),
                                                    sampling=greedy))
            seen: dict[str, list[Output]] = {}
            _collect(out, lambda s: all(f"p{n}/end" in s for n in range(len(prompts))), seen,
                     timeout=60)
            got = []
            for n in range(len(prompts)):
                tokens: list[int] = []
                for msg in seen[f"p{n}"]:
                    assert isinstance(msg, BatchTokenIDOut), msg
                    tokens += [t for rid, ids, _ in msg.items() if rid == f"p{n}" for t in ids]
                got.append(tokens)
            assert got == want
            load = rpc.call("get_load", timeout=30).result or {}
            assert load["dispatcher.handed_off"] == len(prompts), load
            assert load["dispatcher.max_handoff_bytes"] == 96 << 20, load
            assert load["dispatcher.handoff_deadline"] == 30.0, load
    finally:
        for proc in (*replicas, front):
            proc.kill()
            proc.wait(30)


def test_dispatch_pd_needs_as_many_replicas_as_it_names(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from scheduler.__main__ import main
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a)
    os.mkdir(b)
    with pytest.raises(SystemExit):
        main(["dispatch", "--endpoint", "/tmp/unused", "--pd", "1:2", "--replica", a,
              "--replica", b])
    assert "--pd 1:2 needs 3 --replica (the prefill ones first), not 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (a zmq traceback before: its out socket's bind)
        main(["dispatch", "--endpoint", "/tmp/unused", "--replica", "/nonexistent/replica"])
    assert "--replica /nonexistent/replica: no such directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["dispatch", "--endpoint", "/tmp/unused", "--pd", "1:1", "--replica", a,
              "--replica", b, "--handoff-deadline", "0"])
    assert "handoff_deadline" in capsys.readouterr().err


def test_dispatch_refuses_one_scheduler_named_as_two_replicas(tmp_path: Path) -> None:
    """A replica named twice (``localhost`` and ``127.0.0.1``; a link to its
    directory) would get two consumers on its output endpoint, which its PUSH
    feeds by turns: each request's tokens that reached the other replica's inbox
    were dropped as stale, and its stream ended ``length`` with half its tokens.
    ``dispatch`` refuses it at start, naming both."""
    base = procs.free_tcp_base()
    (tmp_path / "r").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "r")
    for n, pair in enumerate(([f"tcp://127.0.0.1:{base}", f"tcp://localhost:{base}"],
                              [str(tmp_path / "r"), str(tmp_path / "link")])):
        front_dir = tmp_path / f"front{n}"
        front_dir.mkdir(mode=0o700)
        front = subprocess.Popen(
            [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(front_dir),
             "--pd", "1:1", *(a for r in pair for a in ("--replica", r))],
            stderr=subprocess.PIPE, text=True)
        try:
            _, err = front.communicate(timeout=60)
        finally:
            if front.poll() is None:
                front.kill()
                front.wait(30)
        assert front.returncode == 2, err
        assert f"replica0 ({Endpoints.parse(pair[0]).work}) and replica1 " \
               f"({Endpoints.parse(pair[1]).work}) are the same scheduler" in err, err


def test_dispatch_pd_without_a_live_prefill_replica_says_so(tmp_path: Path) -> None:
    """``dispatch --pd 1:1`` whose prefill replica died: a new request is answered
    ``replica_lost`` saying no prefill replica is live, not that no replica is (the
    decode replica is live, and takes hand-offs only)."""
    dirs = [tmp_path / "p", tmp_path / "d", tmp_path / "front"]
    for d in dirs:
        d.mkdir(mode=0o700)
    replicas = [_serve(dirs[0]), _serve(dirs[1])]
    front = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(dirs[2]), "--pd",
         "1:1", "--replica", str(dirs[0]), "--replica", str(dirs[1]),
         "--heartbeat-timeout", "1.0"], stderr=subprocess.DEVNULL, text=True)
    try:
        out, work, rpc = _raw_client(dirs[2])
        with out, work, rpc:
            _until_all_live(rpc)
            _stop(replicas[0])
            eventually(lambda: (_load(rpc).result or {}).get("replica0.live") is False, 30.0,
                       "the dispatcher to see the prefill replica gone")
            work.send(TokenizedGenerateReqInput(rid="r0", input_ids=token_ids([1, 2]),
                                                sampling=SamplingParams(max_new_tokens=2)))
            seen: dict[str, list[Output]] = {}
            _collect(out, lambda s: _ended_with(s, "r0") is not None, seen)
            end = _ended_with(seen, "r0")
            assert isinstance(end, ErrorOut) and end.code == "replica_lost", end
            assert "no prefill replica is live" in end.message, end.message
            assert (_load(rpc).result or {}).get("replica1.live") is True
    finally:
        for p in (*replicas, front):
            _stop(p)


def test_dispatch_pd_joins_no_replica_of_another_model(tmp_path: Path) -> None:
    """``dispatch --pd 1:1`` over a replica of the built-in model and one of a Hugging
    Face model: a hand-off between them would be refused request by request, each
    after its first token. The second to answer is not joined, and the log names
    both replicas and both models."""
    pytest.importorskip("transformers")
    from scheduler.models.tiny_hf import build_tiny_hf
    model = build_tiny_hf(tmp_path / "hf")
    dirs = [tmp_path / "gru", tmp_path / "llama", tmp_path / "front"]
    for d in dirs:
        d.mkdir(mode=0o700)
    replicas = [_serve(dirs[0]), subprocess.Popen(
        [sys.executable, "-m", "scheduler", "serve", "--endpoint", str(dirs[1]), "--model",
         str(model)], stderr=subprocess.DEVNULL, text=True)]
    log = tmp_path / "dispatch.log"
    with log.open("w") as err:
        front = subprocess.Popen(
            [sys.executable, "-m", "scheduler", "dispatch", "--endpoint", str(dirs[2]),
             "--pd", "1:1", "--replica", str(dirs[0]), "--replica", str(dirs[1])],
            stderr=err, text=True)
    try:
        eventually(lambda: "serves model" in log.read_text(), 90.0,
                   "the dispatcher to refuse one replica's model")
        line = next(x for x in log.read_text().splitlines() if "serves model" in x)
        assert "'tiny-gru:" in line and "'hf:" in line, line
        assert all(f"{r} (ipc://{d}/work)" in line for r, d in
                   (("replica0", dirs[0]), ("replica1", dirs[1]))), line
        with RpcClient(f"ipc://{dirs[2]}/rpc") as rpc:
            load = _load(rpc)
            assert not load.success and load.result is not None, load
            assert [load.result["replica0.live"], load.result["replica1.live"]].count(True) \
                == 1, load.result
    finally:
        for p in (*replicas, front):
            _stop(p)


#: ``python -m scheduler`` whose first stop signal is handled where Python cannot raise:
#: once the file ``argv[1]`` exists, the next step of the loop class ``argv[2]``
#: (``module:Class``) drops an object whose destructor raises SIGTERM, so the handler's
#: KeyboardInterrupt is discarded there, as it is when it lands in a zmq frame's
#: destructor under a flood of messages.
_STOP_IN_A_DESTRUCTOR = """
import importlib, os, signal, sys
from scheduler.__main__ import main
module, name = sys.argv[2].split(":")
loop = getattr(importlib.import_module(module), name)
class RaisesOnDrop:
    def __del__(self):
        signal.raise_signal(signal.SIGTERM)
raised = []
step = loop.step
def stepped(self):
    if not raised and os.path.exists(sys.argv[1]):
        raised.append(True)
        RaisesOnDrop()
    return step(self)
loop.step = stepped
sys.exit(main(sys.argv[3:]))
"""


def _stopped_in_a_destructor(tmp_path: Path, loop: str, args: list[str]
                             ) -> tuple[subprocess.Popen[str], Path]:
    """``python -m scheduler *args`` (stderr in ``tmp_path/command.err``) whose stop is
    discarded as :data:`_STOP_IN_A_DESTRUCTOR` says once the returned path exists."""
    trigger = tmp_path / "stop-now"
    with open(tmp_path / "command.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _STOP_IN_A_DESTRUCTOR, str(trigger),
                                 loop, *args], stderr=err, text=True)
    return proc, trigger


def _stream_then_stop(directory: Path, trigger: Path, proc: subprocess.Popen[str]) -> None:
    """Stream one long request through ``directory``'s endpoint; once it flows, stop it
    (``trigger``): its stream ends ``shutdown`` and ``proc`` exits 0, saying so."""
    out, work, rpc = _raw_client(directory)
    with out, work, rpc:
        _until_all_live(rpc)
        work.send(TokenizedGenerateReqInput(rid="t0", input_ids=token_ids([1, 2]),
                                            sampling=SamplingParams(max_new_tokens=100_000),
                                            stream=True))
        seen: dict[str, list[Output]] = {}
        _collect(out, lambda s: "t0" in s, seen)  # the flood is on
        trigger.touch()
        _collect(out, lambda s: _ended_with(s, "t0") is not None, seen)
        end = _ended_with(seen, "t0")
        assert isinstance(end, ErrorOut) and end.code == "shutdown", end
        assert proc.wait(30) == 0
    stderr = (trigger.parent / "command.err").read_text()
    assert "interrupted: stopping" in stderr and "Traceback" not in stderr, stderr


def test_a_stop_signal_discarded_where_python_cannot_raise_still_stops_dispatch(
        tmp_path: Path) -> None:
    # The stop must land even when its exception is discarded (a destructor, a gc
    # callback): the dispatcher answers the open stream with shutdown, has its replica
    # abort it, and exits 0, rather than forwarding the flood until it is killed.
    dirs = [tmp_path / "a", tmp_path / "front"]
    for d in dirs:
        d.mkdir(mode=0o700)
    replica = _serve(dirs[0])
    front, trigger = _stopped_in_a_destructor(
        tmp_path, "scheduler.dp:Dispatcher",
        ["dispatch", "--endpoint", str(dirs[1]), "--replica", str(dirs[0])])
    try:
        with RpcClient(f"ipc://{dirs[0]}/rpc") as rpc0:
            _stream_then_stop(dirs[1], trigger, front)
            eventually(lambda: _running(rpc0) == 0, 10.0, "the replica to abort it")
    finally:
        for p in (replica, front):
            _stop(p)


def test_a_stop_signal_discarded_where_python_cannot_raise_still_stops_serve(
        tmp_path: Path) -> None:
    # The same for one scheduler (``serve``): its loop reads a frame per request too.
    (tmp_path / "s").mkdir(mode=0o700)
    proc, trigger = _stopped_in_a_destructor(tmp_path, "scheduler.core.loop:Scheduler",
                                             ["serve", "--endpoint", str(tmp_path / "s")])
    try:
        _stream_then_stop(tmp_path / "s", trigger, proc)
    finally:
        _stop(proc)



@pytest.mark.parametrize("command", ["dispatch", "serve"])
def test_a_stopped_server_waits_for_a_client_behind_its_stream_to_take_the_end(
        tmp_path: Path, command: str) -> None:
    # A client with a small receive queue falls behind a stream, and the server
    # (``dispatch`` over a replica, or one ``serve``) is stopped: its shutdown answer
    # waits in its zmq queue (and backlog) behind the unread stream. The client reads
    # again 2 s later and must still get it: the process does not exit (which drops
    # zmq's queue) before it is out, and exits 0 within the bound.
    dirs = [tmp_path / "a", tmp_path / "front"]
    for d in dirs:
        d.mkdir(mode=0o700)
    replica = _serve(dirs[0]) if command == "dispatch" else None
    more = ["--replica", str(dirs[0])] if command == "dispatch" else []
    with open(tmp_path / "command.err", "w") as err:
        front = subprocess.Popen([sys.executable, "-m", "scheduler", command, "--endpoint",
                                  str(dirs[1]), *more], stderr=err, text=True)
    try:
        out = PullInbox(Codec(Output), f"ipc://{dirs[1]}/out", options=SocketOptions(hwm=8))
        work = PushOutbox(Codec(Request), f"ipc://{dirs[1]}/work")
        with out, work, RpcClient(f"ipc://{dirs[1]}/rpc") as rpc:
            _until_all_live(rpc)
            work.send(TokenizedGenerateReqInput(
                rid="t0", input_ids=token_ids([1, 2]), stream=True,
                sampling=SamplingParams(max_new_tokens=1_000_000)))
            seen: dict[str, list[Output]] = {}
            _collect(out, lambda s: "t0" in s, seen)  # the stream flows; now not read
            time.sleep(1.0)  # sleep-ok: the client falls behind (every buffer fills)
            front.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            time.sleep(2.0)  # sleep-ok: a client that reads again 2 s after the stop
            _collect(out, lambda s: _ended_with(s, "t0") is not None, seen, timeout=20)
            end = _ended_with(seen, "t0")
            assert isinstance(end, ErrorOut) and end.code == "shutdown", end
            assert front.wait(30) == 0
            took = time.monotonic() - stopped
            assert took < FINISH_FLUSH + 5.0, took  # bounded (slack for this 2-core box)
        if replica is not None:
            with RpcClient(f"ipc://{dirs[0]}/rpc") as rpc0:
                eventually(lambda: _running(rpc0) == 0, 10.0, "the replica to abort it")
        stderr = (tmp_path / "command.err").read_text()
        assert "not read within" not in stderr and "Traceback" not in stderr, stderr
    finally:
        for p in (replica, front):
            if p is not None:
                _stop(p)
