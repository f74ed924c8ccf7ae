"""Load and failure: overload is a 503 with Retry-After, a client that leaves frees its slot,
200 streams finish while an rpc from another process is answered, a dead scheduler is a 503."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

import frontend.app
from bus import RpcClient
from frontend import ByteTokenizer, Settings
from scheduler import Limits, ModelConfig
from scheduler.__main__ import main as scheduler_main
from scheduler.cli.rpc import parse_params, rpc_endpoint
from tests.conftest import eventually
from tests.frontend.server import Server, raw_post
from tests.procs import started, wait_gone

TOK = ByteTokenizer()
STUB = ModelConfig(vocab_size=TOK.vocab_size, kind="stub")
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def load(rpc: RpcClient) -> tuple[int, int]:
    result = rpc.call("get_load", timeout=10.0).result
    assert result is not None
    running, queued = result["running"], result["queued"]
    assert isinstance(running, int) and isinstance(queued, int)
    return running, queued


@pytest.fixture
def small(tmp_path: Path) -> Iterator[tuple[Server, RpcClient]]:
    """One slot, one queued request at most; the rpc door in tmp_path."""
    s = Server(Settings(model=STUB, max_batch=1, limits=Limits(max_queued_requests=1),
                        rpc_endpoint=f"ipc://{tmp_path}/rpc"), TOK)
    rpc = RpcClient(f"ipc://{tmp_path}/rpc")
    yield s, rpc
    rpc.close()
    s.stop()


#: Greedy on the stub is token 0 for ever (no end-of-text): runs until aborted.
ENDLESS = {"model": "tiny", "prompt": "x", "max_tokens": 1_000_000, "temperature": 0,
           "ignore_eos": True}
LONG = {**ENDLESS, "stream": True}


def test_overloaded_is_503_with_retry_after(small: tuple[Server, RpcClient]) -> None:
    server, rpc = small
    asyncio.run(_overload(server, rpc))
    # Both streams were left early: their slots are freed.
    eventually(lambda: load(rpc) == (0, 0), 10.0, "the slots to be freed")


async def _overload(server: Server, rpc: RpcClient) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        leave = asyncio.Event()

        async def hold() -> None:  # a stream read until told to leave (closes it cleanly)
            async with client.stream("POST", "/v1/completions", json=LONG) as r:
                async for _ in r.aiter_lines():
                    if leave.is_set():
                        break

        loop = asyncio.get_running_loop()

        async def until(want: tuple[int, int]) -> None:
            deadline = time.monotonic() + 10
            seen = (-1, -1)
            while seen != want:
                assert time.monotonic() < deadline, f"load {seen}, not {want}"
                seen = await loop.run_in_executor(None, load, rpc)

        running = asyncio.ensure_future(hold())
        await until((1, 0))
        queued = asyncio.ensure_future(hold())  # no headers yet: it waits for the slot
        await until((1, 1))
        r = await client.post("/v1/completions",
                              json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        leave.set()  # the first leaves; the queued one starts, then leaves too
        await asyncio.wait_for(asyncio.gather(running, queued), 30)


def test_disconnect_mid_stream_frees_the_slot(small: tuple[Server, RpcClient]) -> None:
    server, rpc = small
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as r:
            lines = r.iter_lines()  # (dropping the iterator would close the connection)
            assert next(lines).startswith("data: ")
            assert load(rpc)[0] == 1
    t0 = time.monotonic()
    eventually(lambda: load(rpc) == (0, 0), 10.0, "the slot to be freed")
    assert time.monotonic() - t0 < 10.0
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_disconnect_while_waiting_frees_the_slot(small: tuple[Server, RpcClient]) -> None:
    server, rpc = small
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=ENDLESS, timeout=1.0)
    eventually(lambda: load(rpc) == (0, 0), 10.0, "the slot to be freed")


def test_a_client_that_leaves_before_its_whole_answer_is_watched_is_seen(
        small: tuple[Server, RpcClient], monkeypatch: pytest.MonkeyPatch) -> None:
    # A whole answer's connection is watched from WATCH_AFTER_S on (here 1 s): a client
    # that left before then is seen then, and its request aborted. Without it (a
    # watcher that never starts, or one that misses a disconnect told before it
    # asked): the endless request holds the slot for ever.
    monkeypatch.setattr(frontend.app, "WATCH_AFTER_S", 1.0)
    server, rpc = small
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(raw_post("/v1/completions", ENDLESS))
        eventually(lambda: load(rpc)[0] == 1, 30.0, "the request to run")
        t0 = time.monotonic()
    eventually(lambda: load(rpc) == (0, 0), 30.0, "the slot to be freed")
    assert time.monotonic() - t0 > 0.5  # seen by the watcher once it started, not before


def test_dead_scheduler_is_503(small: tuple[Server, RpcClient]) -> None:
    server, rpc = small
    assert httpx.get(f"{server.url}/health").status_code == 200
    with ThreadPoolExecutor(1) as pool:  # in flight when an operator shuts it down
        waiting = pool.submit(httpx.post, f"{server.url}/v1/completions", json=ENDLESS,
                              timeout=60.0)
        eventually(lambda: load(rpc)[0] == 1, 30.0, "the request to run")
        assert rpc.call("shutdown", timeout=10.0).success
        cut = waiting.result(timeout=60.0)
    # Without this: a 500, where the scheduler going away is a 503 every other way.
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutdown", cut.text
    eventually(lambda: httpx.get(f"{server.url}/health").status_code == 503, 10.0,
               "health to say 503")
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "scheduler_unavailable"


def test_the_rpc_door_fails_fast_once_the_scheduler_is_gone(tmp_path: Path) -> None:
    """A killed scheduler process: the call waiting at the door, and each one after it,
    is answered at once with a failure naming the scheduler as gone (without it: each
    waited out its whole timeout)."""
    before = set(started(os.getpid()))
    server = Server(Settings(mode="zmq", model=STUB, rpc_endpoint=f"ipc://{tmp_path}/rpc"),
                    TOK)
    rpc = RpcClient(f"ipc://{tmp_path}/rpc")
    try:
        load = rpc.call("get_load", timeout=60.0).result
        assert load is not None and isinstance(load["pid"], int)
        pid = load["pid"]
        assert pid in set(started(os.getpid())) - before  # the scheduler, started for us
        door = server.app.door
        assert door is not None and server.engine.gone is None
        os.kill(pid, signal.SIGSTOP)  # it reads no more: the next call waits at the door
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(rpc.call, "get_load", timeout=30.0)
            eventually(lambda: door.in_flight == 1, 30.0, "the call to be forwarded")
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            reply = waiting.result(timeout=60.0)
        took = time.monotonic() - t0
        wait_gone([pid])
        assert not reply.success and "scheduler is gone" in reply.message, reply
        assert took < 10.0, took  # not the call's 30 s
        for method in ("get_load", "flush_cache"):  # the next ones are not forwarded at all
            t0 = time.monotonic()
            reply = rpc.call(method, timeout=30.0)
            assert not reply.success and "scheduler is gone" in reply.message, reply
            assert time.monotonic() - t0 < 10.0
        assert door.in_flight == 0
    finally:
        rpc.close()
        server.stop()


def test_the_door_over_tensor_parallel_ranks() -> None:
    # model_info answers each rank's value as a list under tensor parallel: the door
    # must read that as one answer, or it would not start.
    server = Server(Settings(mode="zmq", tp_size=2, model=STUB), TOK)
    try:
        models = httpx.get(f"{server.url}/v1/models").json()
        assert models["data"][0]["max_model_len"] == 1 << 20  # the wire's bound on a prompt
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": "tiny", "prompt": "x", "max_tokens": 3, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    finally:
        server.stop()


def test_rpc_cli(small: tuple[Server, RpcClient], tmp_path: Path,
                 capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (the CLI's own main): the call from another process, and a
    # successful one, are the 200-streams test's.
    assert scheduler_main(["rpc", str(tmp_path), "no_such_method", "n=3"]) == 1
    reply = msgspec.json.decode(capsys.readouterr().out)
    assert reply["success"] is False and "no_such_method" in reply["message"]
    # A method name the wire refuses is answered at the door, not left to time out
    # (without it: silence for the whole timeout).
    t0 = time.monotonic()
    assert scheduler_main(["rpc", "--timeout", "30", str(tmp_path), "not-an-identifier"]) == 1
    assert msgspec.json.decode(capsys.readouterr().out)["success"] is False
    assert time.monotonic() - t0 < 25  # the reply, not the timeout


def test_rpc_cli_where_nothing_listens_says_so_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without this: 34 s of silence, then "no reply within 30 s", for a directory with
    # no socket and for a socket its server left behind.
    stale = tmp_path / "stale"
    stale.mkdir()
    with socket.socket(socket.AF_UNIX) as left:  # bound, never listening: refused
        left.bind(str(stale / "rpc"))
    for target in (tmp_path / "none", stale):
        t0 = time.monotonic()
        assert scheduler_main(["rpc", str(target), "get_load", "--timeout", "30"]) == 2
        assert time.monotonic() - t0 < 10
        assert "nothing listens at" in capsys.readouterr().err
    # Without this: a malformed endpoint was zmq's traceback, an empty one a wrong path.
    for bad in ("tcp://127.0.0.1:abc", "tcp://", "ipc://", ""):
        assert scheduler_main(["rpc", bad, "get_load", "--timeout", "30"]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("rpc: ") and "Traceback" not in err, err


def test_rpc_cli_parameters() -> None:
    assert parse_params(["path=/tmp/x", "n=3", "f=1.5", "b=true", "z=null", 's="3"']) == \
        {"path": "/tmp/x", "n": 3, "f": 1.5, "b": True, "z": None, "s": "3"}
    with pytest.raises(ValueError, match="key=value"):
        parse_params(["novalue"])
    assert rpc_endpoint("tcp://127.0.0.1:5551") == "tcp://127.0.0.1:5551"
    assert rpc_endpoint("/run/sched") == "ipc:///run/sched/rpc"


def test_200_streams_finish_while_an_rpc_from_another_process_is_answered(
        tmp_path: Path) -> None:
    # A keep-alive timeout far above the client's 1 s expiry: on a loaded box the client
    # may take seconds to reuse a connection, and a POST sent on one the server is closing
    # fails without a retry (a race between the two timers, not what this test is about).
    server = Server(Settings(model=STUB, max_batch=256, rpc_endpoint=f"ipc://{tmp_path}/rpc"),
                    TOK, timeout_keep_alive=60)
    try:
        asyncio.run(_streams_and_rpc(server, tmp_path))
    finally:
        server.stop()


async def _streams_and_rpc(server: Server, tmp_path: Path) -> None:
    """200 tasks each keep one stream open (a new one as soon as theirs ends) until the
    rpc process has its answer, then finish the one they hold: the rpc is answered while
    200 streams run, however long that process takes to start on a busy machine."""
    tokens = 30
    streams = 0
    in_flight = 0
    in_flight_at_reply = -1
    all_started = asyncio.Event()
    answered = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal streams, in_flight
        body = {"model": "tiny", "prompt": "hi", "max_tokens": tokens, "stream": True,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        usage = None
        in_flight += 1
        if in_flight == 200:
            all_started.set()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = msgspec.json.decode(line[6:]).get("usage") or usage
        in_flight -= 1
        assert usage is not None and usage["completion_tokens"] == tokens
        streams += 1

    async def keep_one_open(client: httpx.AsyncClient) -> None:
        while True:
            await one(client)
            if answered.is_set():
                return

    # Idle connections expire before the server's keep-alive timeout would close them
    # under a new request.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256,
                          keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
        tasks = asyncio.gather(*(keep_one_open(client) for _ in range(200)))
        await asyncio.wait_for(all_started.wait(), 60)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "scheduler", "rpc", str(tmp_path), "save_checkpoint",
            f"path={tmp_path}/ckpt", stdout=asyncio.subprocess.PIPE, env=ENV)
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
        in_flight_at_reply = in_flight
        answered.set()
        await asyncio.wait_for(tasks, 120)
    assert proc.returncode == 0
    assert msgspec.json.decode(out)["success"] is True
    assert (tmp_path / "ckpt").is_file()
    assert in_flight_at_reply > 0, "the rpc should be answered while streams run"
    assert streams >= 200 and in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_a_request_with_another_pipelined_behind_it(
        small: tuple[Server, RpcClient], stream: bool) -> None:
    """uvicorn tells only a connection's last pipelined request that its client left:
    the one answering before it held its slot to its end (not streamed), or failed on
    its writes and was counted a 500 (streamed). It is a 499."""
    server, rpc = small
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(raw_post("/v1/completions", {**ENDLESS, "stream": stream})
                     + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        eventually(lambda: load(rpc) == (1, 0), 10.0, "the request to run")
    eventually(lambda: load(rpc) == (0, 0), 10.0, "the slot to be freed")
    left = 'tsb_http_requests_total{endpoint="completions",status="499"} 1.0'
    eventually(lambda: left in httpx.get(f"{server.url}/metrics").text, 10.0,
               "the request counted as its client leaving")


def test_a_stream_cancelled_by_the_server_shutting_down_ends_with_an_error_event(
        small: tuple[Server, RpcClient]) -> None:
    """uvicorn cancels what still answers after its grace period: a stream then ends
    with an error event and [DONE] (it was cut mid-answer, and a traceback logged)."""
    server, rpc = small
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(raw_post("/v1/completions", LONG))
        got = sock.recv(1 << 16)
        assert got.startswith(b"HTTP/1.1 200")

        assert server.on_loop(server.cancel_answers) == 1  # as uvicorn's shutdown does
        while not got.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            data = sock.recv(1 << 16)
            assert data, got[-300:]
            got += data
    assert b'"code":"shutting_down"' in got and b"data: [DONE]" in got[-200:]
    eventually(lambda: load(rpc) == (0, 0), 10.0, "the slot to be freed")


def test_a_hung_scheduler_holds_the_server_s_exit_seconds_not_a_minute() -> None:
    # Without this: SIGTERM with a SIGSTOPped scheduler took ~70 s to exit (the engine's
    # close waited 30 s for its shutdown rpc, then 30 s more for the processes).
    s = Server(Settings(mode="zmq", model=STUB), TOK)
    pids = [p.pid for p in s.engine._scheduler.essential if p.pid is not None]
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        s.stop()
        # ENGINE_CLOSE_S (5 s) for all of it, then killed: not 5 s more for the
        # processes once the shutdown rpc went unanswered.
        assert time.monotonic() - t0 < 9
    finally:
        wait_gone(pids, 10.0)


def test_a_run_directory_made_for_the_server_is_removed_at_its_close(tmp_path: Path) -> None:
    # Without this: python -m frontend with no --endpoint left its run directory after
    # SIGTERM (uvicorn re-raises the signal after its shutdown, so no atexit runs).
    made = tmp_path / "run"
    made.mkdir(mode=0o700)
    s = Server(Settings(model=STUB, rpc_endpoint=f"ipc://{made}/rpc", run_dir=str(made)), TOK)
    assert (made / "rpc").exists()
    s.stop()
    assert not made.exists()


@contextlib.contextmanager
def _small_reader(tmp_path: Path, send_timeout: float, body: dict[str, object],
                  http: str = "auto") -> Iterator[tuple[Server, RpcClient, socket.socket]]:
    """A server with ``send_timeout`` (and ``http``), its rpc door, and a client with a
    4 KB receive buffer that has sent ``body`` (and read nothing yet)."""
    s = Server(Settings(model=STUB, max_batch=4, rpc_endpoint=f"ipc://{tmp_path}/rpc"), TOK,
               send_timeout=send_timeout, http=http)
    rpc = RpcClient(f"ipc://{tmp_path}/rpc")
    try:
        with _stalled(s.port, raw_post("/v1/completions", body)) as sock:
            yield s, rpc, sock
    finally:
        rpc.close()
        s.stop()


@contextlib.contextmanager
def _stalled(port: int, request: bytes) -> Iterator[socket.socket]:
    """A client with a 4 KB receive buffer that has sent ``request`` (and read nothing)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        sock.settimeout(30)
        yield sock


def _reset_soon(sock: socket.socket, what: str) -> None:
    """``sock``'s connection is reset (not ended, not left open) within seconds, while
    it reads nothing: its TCP state goes from ESTABLISHED (1) to CLOSE (7) (a close
    would be CLOSE_WAIT, 8, once its FIN got past the unread answer)."""
    def state() -> int:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]

    eventually(lambda: state() != 1, 20.0, f"{what} to be given up")
    assert state() == 7, f"{what}: TCP state {state()}, not a reset"
    with pytest.raises(ConnectionResetError):  # after what its buffer still holds
        while sock.recv(1 << 16):
            pass


def test_a_stream_nobody_reads_is_aborted_after_the_send_timeout(tmp_path: Path) -> None:
    # Without this: streams never read kept their tokens (~45 bytes each) for as long as
    # their connections stayed open, while the scheduler generated them at full speed.
    # (Logprobs keep ~40 bytes a token when a stalled stream's steps merge into one event,
    # so the answer outgrows any kernel's buffers long before it could finish: CI's took
    # a whole merged answer, which then finished, and the test read it for minutes.)
    with _small_reader(tmp_path, 0.5, {**LONG, "logprobs": 0}) as (s, rpc, stalled):
        eventually(lambda: load(rpc)[0] == 1, 10.0, "the stream to run")
        # A client that reads meanwhile is served whole, however long it takes.
        with httpx.Client(base_url=s.url, timeout=30) as c:
            r = c.post("/v1/completions", json={**LONG, "max_tokens": 5_000})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        eventually(lambda: load(rpc) == (0, 0), 30.0, "the unread stream to be aborted")
        # Aborted, not finished, with a reset: what the kernel held for the client is
        # dropped (a plain close left it to an orphaned socket, offered for minutes).
        _reset_soon(stalled, "the unread stream")
        # Without this: an answer the server had begun to close (connection: close, a
        # keep-alive expiry, a client's half-close) was exempt, and held for ever: a
        # closing transport waits for its buffer to drain, which never happens.
        big = {"model": "tiny", "input": ["a"] * 2000}  # ~5 MB of embeddings
        with _stalled(s.port, raw_post("/v1/embeddings", big, close=True)) as closing:
            _reset_soon(closing, "the unread answer")


def test_a_slow_reader_is_not_taken_for_a_gone_one(tmp_path: Path) -> None:
    # Steady readers at 6-34 KB/s were aborted as if they read nothing: the timer waited
    # for the transport's buffer to drain, which moves only once the kernel's buffers
    # for the connection have. Here the reader takes ~10 KB/s, so the transport's buffer
    # (paused above its high mark, resumed at its low one) drains for seconds: writing
    # must stay paused for several send timeouts, with the stream still running.
    send_timeout = 1.0
    with _small_reader(tmp_path, send_timeout, {**LONG, "logprobs": 0}) as (s, rpc, slow):
        transport = _small_send_buffer(s, slow)
        low, high = transport.get_write_buffer_limits()
        got = 0
        paused_since: float | None = None
        paused_for = 0.0
        t0 = time.monotonic()
        while paused_for < 2.5 * send_timeout:  # paused past two stall timers
            elapsed = time.monotonic() - t0
            assert elapsed < 30, (f"writing was never paused for {2.5 * send_timeout} s "
                                  f"(at most {paused_for:.1f} s; {got} B read)")
            got += len(slow.recv(512))
            time.sleep(0.05)  # sleep-ok: the client's reading pace is what is tested
            assert load(rpc)[0] == 1, (f"cut after {elapsed:.1f} s, {got} B read, writing "
                                       f"paused for {paused_for:.1f} s")
            size = transport.get_write_buffer_size()
            if size > high or (paused_since is not None and size > low):  # paused
                paused_since = paused_since or time.monotonic()
                paused_for = time.monotonic() - paused_since
            else:
                paused_since = None
        assert got > 0  # it read all along: slow, not gone


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_slow_reader_of_several_answers_is_not_taken_for_a_gone_one(
        tmp_path: Path, http: str) -> None:
    # Several answers streamed as one (n) each wait for the paused connection: one
    # resume wakes them all. Each one wrote at once, its piece grown meanwhile, after
    # the first one's write had paused the connection again and armed the stall timer:
    # what was unread grew past the mark the timer compares, and a client that read
    # ~80 KB/s all along was reset as one that read nothing. Each now waits again.
    send_timeout = 0.5
    body = {**LONG, "logprobs": 0, "n": 4}
    with _small_reader(tmp_path, send_timeout, body, http) as (s, rpc, slow):
        transport = _small_send_buffer(s, slow)
        resumed = _count_resumes(transport)
        got = 0
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < 10 * send_timeout or len(resumed) < 2:
            assert elapsed < 60, f"writing was resumed {len(resumed)} times; {got} B read"
            try:
                got += len(slow.recv(4096))
            except ConnectionResetError:
                pytest.fail(f"reset after {elapsed:.1f} s, {got} B read, as if gone")
            time.sleep(0.05)  # sleep-ok: the client's reading pace is what is tested
        assert load(rpc)[0] == 4  # every answer still streaming


def _count_resumes(transport: asyncio.WriteTransport) -> list[None]:
    """A list that grows by one each time ``transport``'s protocol is told that writing
    may resume (every answer waiting for it is woken then)."""
    protocol = transport.get_protocol()
    resume = protocol.resume_writing
    resumed: list[None] = []

    def counted() -> None:
        resumed.append(None)
        resume()

    protocol.resume_writing = counted  # type: ignore[method-assign]
    return resumed


def _small_send_buffer(s: Server, client: socket.socket) -> asyncio.WriteTransport:
    """The transport of ``client``'s connection in ``s``, its kernel send buffer kept
    small (no autotuning), so that writing pauses within a moment whatever the host's
    tcp_wmem: the pause is what is tested."""
    transport = s.transport_of(client)
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return transport


def test_the_door_s_socket_file_is_removed_at_the_server_s_close(tmp_path: Path) -> None:
    # Without this: DIR/rpc stayed after a clean Ctrl-C (an operator's --endpoint DIR).
    s = Server(Settings(model=STUB, rpc_endpoint=f"ipc://{tmp_path}/rpc"), TOK)
    assert (tmp_path / "rpc").exists()
    s.stop()
    assert not (tmp_path / "rpc").exists() and tmp_path.exists()
