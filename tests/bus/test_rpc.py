from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

import bus.rpc
from bus import (
    ChannelClosed,
    EndpointInUse,
    Envelope,
    PullInbox,
    PushOutbox,
    Receiver,
    RpcClient,
    RpcServer,
    RpcTimeout,
    check_endpoint,
)
from messages import (
    AbortReq,
    Codec,
    DecodeError,
    Message,
    Output,
    Request,
    RpcReqInput,
    RpcReqOutput,
)

REQ: Codec[Request] = Codec(Request)
OUT: Codec[Output] = Codec(Output)


def _serve(server: RpcServer[Request], stop: threading.Event, *, delay_first: threading.Event
           | None = None) -> threading.Thread:
    """Answer every rpc with its method name and the caller's origin."""

    def loop() -> None:
        receiver = Receiver([server])
        while not stop.is_set():
            if not receiver.wait(0.05):
                continue
            for env in receiver.poll():
                assert isinstance(env, Envelope) and isinstance(env.message, RpcReqInput)
                if delay_first is not None and not delay_first.is_set():
                    delay_first.wait(10)
                reply = RpcReqOutput(rid=env.message.rid, success=True,
                                     message=env.message.method,
                                     result={"x": env.message.parameters.get("x")})
                server.reply(OUT.encode(reply), env.origin)

    t = threading.Thread(target=loop)
    t.start()
    return t


@pytest.mark.parametrize("kind", ["dealer", "router"])
def test_call_round_trip(kind: str, ctx: zmq.Context[zmq.Socket[bytes]],
                         ipc: Callable[[str], str]) -> None:
    ep = ipc("rpc")
    stop = threading.Event()
    with RpcServer(REQ, ep, kind=kind, ctx=ctx) as server:  # type: ignore[arg-type]
        t = _serve(server, stop)
        try:
            with RpcClient(ep, ctx=ctx) as client:
                out = client.call("save_checkpoint", x=3, timeout=10)
                assert out.success and out.message == "save_checkpoint"
                assert out.result == {"x": 3}
        finally:
            stop.set()
            t.join()


def test_router_replies_go_to_the_identity_that_asked(ctx: zmq.Context[zmq.Socket[bytes]],
                                                      ipc: Callable[[str], str]) -> None:
    ep = ipc("rpc")
    stop = threading.Event()
    with RpcServer(REQ, ep, kind="router", ctx=ctx) as server:
        t = _serve(server, stop)
        clients = [RpcClient(ep, ctx=ctx, name=f"c{i}") for i in range(4)]
        try:
            results: dict[int, int | None] = {}

            def call(i: int) -> None:
                out = clients[i].call("echo", x=i, timeout=10)
                results[i] = out.result["x"] if out.result else None  # type: ignore[assignment]

            threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert results == {0: 0, 1: 1, 2: 2, 3: 3}
        finally:
            for c in clients:
                c.close()
            stop.set()
            t.join()


def test_timeout_names_endpoint_and_method_and_late_reply_is_discarded(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    ep = ipc("rpc")
    stop, release = threading.Event(), threading.Event()
    with RpcServer(REQ, ep, ctx=ctx) as server:
        t = _serve(server, stop, delay_first=release)
        try:
            with RpcClient(ep, ctx=ctx) as client:
                with pytest.raises(RpcTimeout) as info:
                    client.call("slow_method", timeout=0.05)
                assert "slow_method" in str(info.value) and ep in str(info.value)
                release.set()  # the late reply to the first call now arrives
                out = client.call("second", timeout=10)
                assert out.message == "second"  # never the late reply
                assert client.discarded == 1
        finally:
            stop.set()
            t.join()


def test_closed_client_refuses_calls(ctx: zmq.Context[zmq.Socket[bytes]],
                                     ipc: Callable[[str], str]) -> None:
    client = RpcClient(ipc("nobody"), ctx=ctx)
    client.close()
    with pytest.raises(ChannelClosed):
        client.call("x")


# IPv6: zmq refuses the literal ("No such device") unless the socket is told; a tcp
# address in use must be named, not zmq's bare "Address already in use".
@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_push_pull_over_tcp_loopback_and_an_address_in_use_is_named(
        ctx: zmq.Context[zmq.Socket[bytes]], host: str) -> None:
    with PullInbox(REQ, f"tcp://{host}:0", ctx=ctx) as inbox:
        ep = inbox.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        assert ep.startswith(f"tcp://{host}:")
        with PushOutbox(REQ, ep, ctx=ctx) as out:
            out.send(AbortReq(rid="a"))
            r: Receiver[Request] = Receiver([inbox])
            assert r.wait(10)
            got = r.poll()
            assert isinstance(got[0], Envelope) and got[0].message == AbortReq(rid="a")
        with pytest.raises(EndpointInUse, match="another process listens"):
            RpcServer(REQ, ep, ctx=ctx)


def test_loopback_policy() -> None:
    with pytest.raises(ValueError, match="loopback"):
        check_endpoint("tcp://*:5555", bind=True, allow_remote=False)
    with pytest.raises(ValueError, match="loopback"):
        check_endpoint("tcp://10.1.2.3:5555", bind=True, allow_remote=False)
    check_endpoint("tcp://10.1.2.3:5555", bind=False, allow_remote=False)
    with pytest.raises(ValueError, match="unsupported"):
        check_endpoint("udp://x", bind=True, allow_remote=False)
    for bad in ("tcp://127.0.0.1:abc", "tcp://127.0.0.1", "tcp://", "tcp://127.0.0.1:70000"):
        with pytest.raises(ValueError, match="needs a port"):  # (zmq's EINVAL, unnamed)
            check_endpoint(bad, bind=False, allow_remote=False)
    with pytest.raises(ValueError, match="needs a port"):
        check_endpoint("tcp://127.0.0.1:*", bind=False, allow_remote=False)
    check_endpoint("tcp://127.0.0.1:*", bind=True, allow_remote=False)  # any free port
    check_endpoint("tcp://[::1]:5555", bind=True, allow_remote=False)
    with pytest.raises(ValueError, match="more than the 107"):  # (was "another live process")
        check_endpoint("ipc:///tmp/" + "d" * 120 + "/rpc", bind=True, allow_remote=False)
    check_endpoint("ipc:///tmp/" + "d" * 96, bind=True, allow_remote=False)


def test_unclosed_channel_warns(ctx: zmq.Context[zmq.Socket[bytes]],
                                ipc: Callable[[str], str]) -> None:
    inbox: PullInbox[Message] = PullInbox(Codec(Message), ipc("w"), ctx=ctx)
    with pytest.warns(ResourceWarning, match="never closed"):
        inbox.__del__()


def test_call_to_nobody_keeps_to_its_timeout(ctx: zmq.Context[zmq.Socket[bytes]],
                                             ipc: Callable[[str], str]) -> None:
    import time

    with RpcClient(ipc("nobody"), ctx=ctx) as client:
        t0 = time.monotonic()
        with pytest.raises(RpcTimeout, match="'get_load'"):
            client.call("get_load", timeout=0.2)
        assert time.monotonic() - t0 < 5


# -- undecodable replies ---------------------------------------------------------

CALL: Codec[Message] = Codec(Message, types=[RpcReqInput])


def _bad_reply(rid: str) -> bytes:
    """An RpcReqOutput whose message breaks its 64 KiB bound: readable rid, undecodable."""
    # Same layout a real reply has: ["RpcReqOutput", rid, success, message, result].
    real = msgspec.msgpack.decode(OUT.encode(RpcReqOutput(rid=rid, success=False))[0])
    assert real[:3] == ["RpcReqOutput", rid, False]
    return msgspec.msgpack.encode(["RpcReqOutput", rid, False, "e" * 70_000, None])


@pytest.fixture
def router(ctx: zmq.Context[zmq.Socket[bytes]],
           ipc: Callable[[str], str]) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    """A hand-made rpc server: a bare ROUTER, so a test can answer with any bytes."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    ep = ipc("raw-rpc")
    sock.bind(ep)
    yield sock, ep
    sock.close(linger=0)


def _answer_once(sock: zmq.Socket[bytes], make: Callable[[str], list[bytes]]) -> threading.Thread:
    """Receive one call on ``sock`` and send back ``make(rid)`` to its caller."""

    def run() -> None:
        if not sock.poll(10_000, zmq.POLLIN):
            return  # the test fails on its own assertion
        identity, *frames = sock.recv_multipart()
        req = CALL.decode(frames)
        assert isinstance(req, RpcReqInput)
        for reply in make(req.rid):
            sock.send_multipart([identity, reply])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_undecodable_reply_to_the_call_raises_at_once(
        ctx: zmq.Context[zmq.Socket[bytes]], router: tuple[zmq.Socket[bytes], str]) -> None:
    sock, ep = router
    t = _answer_once(sock, lambda rid: [_bad_reply(rid)])
    try:
        with RpcClient(ep, ctx=ctx) as client:
            t0 = time.monotonic()
            with pytest.raises(DecodeError) as info:
                client.call("save_checkpoint", path="p", timeout=30)
            assert time.monotonic() - t0 < 10  # not the 30 s timeout
            err = info.value
            assert err.rid is not None and err.rid.startswith(client._prefix)
            assert err.message_type == "RpcReqOutput" and "message" in err.reason
            assert client.discarded == 0
    finally:
        t.join()


def test_undecodable_reply_for_another_rid_is_counted_and_logged(
        ctx: zmq.Context[zmq.Socket[bytes]], router: tuple[zmq.Socket[bytes], str],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    sock, ep = router
    monkeypatch.setattr(bus.rpc, "_LOG_EVERY", 3600.0)  # however slow the host: one window

    def replies(rid: str) -> list[bytes]:
        ok = OUT.encode(RpcReqOutput(rid=rid, success=True, message="real"))
        assert len(ok) == 1
        # Three bad replies first: a flood logs once, with a count.
        return [_bad_reply("someone-else"), _bad_reply("someone-else"), b"\xc1garbage",
                bytes(ok[0])]

    t = _answer_once(sock, replies)
    try:
        with RpcClient(ep, ctx=ctx) as client, caplog.at_level(logging.WARNING, "bus.rpc"):
            out = client.call("get_load", timeout=30)
            assert out.success and out.message == "real"
            assert client.discarded == 3
    finally:
        t.join()
    warnings = [r for r in caplog.records if r.name == "bus.rpc"]
    assert len(warnings) == 1  # one line per window, not one per reply
    assert "discarded 1 undecodable" in warnings[0].getMessage()  # the first one, at once


def test_rebinding_a_path_this_process_just_closed_is_not_refused(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/w"
    for _ in range(50):  # zmq closes a listener asynchronously
        PullInbox(REQ, ep).close()


def test_a_listener_with_a_full_backlog_is_still_a_listener(tmp_path: Path) -> None:
    path = str(tmp_path / "w")
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(path)
    hung.listen(0)  # a process that stopped accepting
    waiting = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            waiting.append(s)
            try:
                s.connect(path)
            except OSError:
                break  # the backlog is full
        with pytest.raises(EndpointInUse):
            PullInbox(REQ, f"ipc://{path}")
    finally:
        for s in waiting:
            s.close()
        hung.close()


def test_a_bound_ipc_socket_s_file_is_removed_at_its_close(
        ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    # Without this: libzmq leaves the file, and an operator's --endpoint DIR kept DIR/rpc
    # after a clean exit. Each channel that binds removes it; one that connects does not.
    server = RpcServer(Codec(RpcReqInput), f"ipc://{tmp_path}/rpc", ctx=ctx)
    inbox = PullInbox(REQ, f"ipc://{tmp_path}/work", ctx=ctx)
    client = RpcClient(f"ipc://{tmp_path}/rpc", ctx=ctx)
    outbox = PushOutbox(REQ, f"ipc://{tmp_path}/work", ctx=ctx)
    client.close()
    outbox.close()
    assert {p.name for p in tmp_path.iterdir()} == {"rpc", "work"}
    server.close()
    inbox.close()
    assert list(tmp_path.iterdir()) == []


def test_a_closing_socket_leaves_a_newer_listener_s_file_alone(
        ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    # A live server's directory is moved away and a new server starts there: the old
    # one's clean exit must not remove the new one's socket file.
    live = tmp_path / "d"
    live.mkdir()
    old = RpcServer(Codec(RpcReqInput), f"ipc://{live}/rpc", ctx=ctx)
    live.rename(tmp_path / "d.old")
    live.mkdir()
    new = RpcServer(Codec(RpcReqInput), f"ipc://{live}/rpc", ctx=ctx)
    try:
        old.close()  # (its own file, moved away with its directory, is the operator's)
        assert (live / "rpc").exists()
    finally:
        new.close()
    assert not (live / "rpc").exists()


def _answer_once_all_arrived(server: RpcServer[Request], n: int, stop: threading.Event
                             ) -> threading.Thread:
    """Answer nothing until ``n`` calls are in, then every one of them, last first."""

    def loop() -> None:
        receiver = Receiver([server])
        held: list[Envelope[Request]] = []
        while not stop.is_set() and len(held) < n:
            if receiver.wait(0.05):
                held.extend(env for env in receiver.poll() if isinstance(env, Envelope))
        for env in reversed(held):
            assert isinstance(env.message, RpcReqInput)
            server.reply(OUT.encode(RpcReqOutput(rid=env.message.rid, success=True,
                                                 message=env.message.method)), env.origin)

    t = threading.Thread(target=loop)
    t.start()
    return t


def test_calls_from_several_threads_are_in_flight_together(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    # The server answers only once all 4 calls have arrived: calls serialized on the
    # client (a lock held for a whole call) never get there, and every one times out.
    ep = ipc("rpc")
    stop = threading.Event()
    with RpcServer(REQ, ep, ctx=ctx) as server, RpcClient(ep, ctx=ctx) as client:
        t = _answer_once_all_arrived(server, 4, stop)
        got: dict[int, str] = {}

        def call(i: int) -> None:
            got[i] = client.call(f"m{i}", timeout=10).message

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            stop.set()
            t.join()
        assert got == {i: f"m{i}" for i in range(4)}
        assert client.in_flight == 0


def test_fail_all_ends_every_waiting_call_at_once(
        ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]) -> None:
    ep = ipc("rpc")
    with RpcServer(REQ, ep, ctx=ctx), RpcClient(ep, ctx=ctx) as client:
        errors: list[Exception] = []

        def call() -> None:
            try:
                client.call("never_answered", timeout=30)
            except ChannelClosed as exc:
                errors.append(exc)

        threads = [threading.Thread(target=call) for _ in range(4)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 10
        while client.in_flight < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)  # sleep-ok: pacing of a deadline poll
        t0 = time.monotonic()
        client.fail_all(ChannelClosed("rpc", "the server is gone"))
        for th in threads:
            th.join()
        assert len(errors) == 4 and time.monotonic() - t0 < 2
