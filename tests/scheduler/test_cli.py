"""The command line: the demo (the README's first command) and serve with CURVE."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from bus import CurveKeys, RpcClient, RpcTimeout, SocketOptions
from scheduler.__main__ import _until_stopped, main
from tests import procs


def test_demo_runs_and_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--requests", "6", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "tokens generated                    18" in out
    assert "rpc save_checkpoint busy" in out


@pytest.fixture
def curve_server(tmp_path: Path) -> Iterator[tuple[str, CurveKeys, CurveKeys]]:
    _, server_secret = CurveKeys.create_files(tmp_path, "server")
    client_public, client_secret = CurveKeys.create_files(tmp_path, "client")
    base = procs.free_tcp_base()
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler", "serve", "--endpoint", f"tcp://127.0.0.1:{base}",
         "--curve-keys", server_secret, "--curve-allow", client_public],
        stderr=subprocess.PIPE, text=True)
    try:
        yield (f"tcp://127.0.0.1:{base + 1}", CurveKeys.load(server_secret),
               CurveKeys.load(client_secret))
    finally:
        proc.kill()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


def test_serve_with_curve_serves_only_admitted_clients(
        curve_server: tuple[str, CurveKeys, CurveKeys],
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    rpc, server, client = curve_server
    good = SocketOptions(curve_keys=client, curve_server_public=server.public)
    with RpcClient(rpc, ctx=ctx, options=good) as c:
        assert c.call("get_load", timeout=60).success
    bad = SocketOptions(curve_keys=CurveKeys.generate(), curve_server_public=server.public)
    with RpcClient(rpc, ctx=ctx, options=bad) as c:
        with pytest.raises(RpcTimeout):
            c.call("get_load", timeout=0.5)
    with RpcClient(rpc, ctx=ctx, options=good) as c:  # still serving
        assert c.call("get_load", timeout=10).success
        assert c.call("shutdown", timeout=10).success


def test_serve_refuses_a_directory_too_deep_for_its_sockets_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without this: a ValueError traceback once the directory was made (and left).
    deep = tmp_path / ("d" * (102 - len(str(tmp_path))))  # rpc fits; work does not
    with pytest.raises(SystemExit) as info:
        main(["serve", "--endpoint", str(deep)])
    assert info.value.code == 2
    assert "/work': its path is 108 bytes, more than the 107" in capsys.readouterr().err
    assert not deep.exists()


@pytest.mark.parametrize(("endpoint", "said"), [
    ("tcp://0.0.0.0:5999", "refusing to bind 'tcp://0.0.0.0:5999' beyond loopback"),
    ("tcp://127.0.0.1:65535", "'tcp://127.0.0.1:65536' needs a port (1-65535)"),
    ("tcp://127.0.0.1", "'tcp://127.0.0.1' needs a port (1-65535)"),
], ids=["remote", "rpc-port-past-65535", "no-port"])
def test_serve_refuses_a_tcp_endpoint_it_cannot_bind_in_one_line(
        endpoint: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Without this: serve loaded its model, bound the work socket, and then died with a
    # ValueError traceback from the socket layer (the frontend already said one line).
    with pytest.raises(SystemExit) as info:
        main(["serve", "--endpoint", endpoint])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


@pytest.mark.parametrize("replica", ["tcp://127.0.0.1", "tcp://127.0.0.1:65535"])
def test_dispatch_refuses_a_tcp_replica_it_cannot_reach_in_one_line(
        replica: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without this: a ValueError traceback from parsing the base, or from the socket
    # layer once the replica's work socket was connected.
    with pytest.raises(SystemExit) as info:
        main(["dispatch", "--endpoint", str(tmp_path / "ep"), "--replica", replica])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--replica {replica}: " in err and "needs a port (1-65535)" in err, err


def test_a_second_signal_does_not_cut_the_clean_up() -> None:
    # A second SIGTERM or SIGINT while serve unwinds from the first must not cut its
    # clean-up short (no traceback from the channels' close, no status -15).
    cleaned: list[bool] = []

    def serve() -> bool:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # handled before kill returns to here
            raise AssertionError("SIGTERM did not stop serve")
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # during the clean-up
            cleaned.append(True)

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert _until_stopped(serve) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert cleaned == [True]
