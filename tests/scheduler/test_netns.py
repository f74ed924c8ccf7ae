"""Across two network namespaces (our own test hosts, joined by a veth pair).

The scheduler serves on one "host" with CURVE; a client on the other host
with an admitted key is served, a stranger is not. Skipped where network
namespaces cannot be made (not root, no iproute2, a restricted sandbox).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus import CurveKeys

SERVER_IP, CLIENT_IP = "10.231.7.1", "10.231.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2")
    a, b = f"tsb-a-{os.getpid()}", f"tsb-b-{os.getpid()}"
    try:
        _ip("netns", "add", a)
    except (subprocess.CalledProcessError, OSError):
        pytest.skip("this machine does not permit network namespaces")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"va{os.getpid() % 10000}", "type", "veth", "peer", "name",
            f"vb{os.getpid() % 10000}")
        _ip("link", "set", f"va{os.getpid() % 10000}", "netns", a)
        _ip("link", "set", f"vb{os.getpid() % 10000}", "netns", b)
        for ns, dev, addr in ((a, f"va{os.getpid() % 10000}", SERVER_IP),
                              (b, f"vb{os.getpid() % 10000}", CLIENT_IP)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


_CLIENT = """
import sys
from bus import CurveKeys, RpcClient, RpcTimeout, SocketOptions
server = CurveKeys.public_of(sys.argv[2])
keys = CurveKeys.load(sys.argv[3]) if sys.argv[3] != "-" else CurveKeys.generate()
opts = SocketOptions(curve_keys=keys, curve_server_public=server)
with RpcClient(sys.argv[1], options=opts) as c:
    try:
        reply = c.call(sys.argv[4], timeout=float(sys.argv[5]))
        print("served", reply.success)
    except RpcTimeout:
        print("nothing")
"""


def test_curve_across_two_hosts(hosts: tuple[str, str], tmp_path: Path) -> None:
    a, b = hosts
    server_public, server_secret = CurveKeys.create_files(tmp_path, "server")
    client_public, client_secret = CurveKeys.create_files(tmp_path, "client")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    server = subprocess.Popen(
        ["ip", "netns", "exec", a, sys.executable, "-m", "scheduler", "serve",
         "--endpoint", f"tcp://{SERVER_IP}:5550", "--allow-remote",
         "--curve-keys", server_secret, "--curve-allow", client_public],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    rpc = f"tcp://{SERVER_IP}:5551"

    def client(keys: str, method: str, timeout: float) -> str:
        out = subprocess.run(
            ["ip", "netns", "exec", b, sys.executable, "-c", _CLIENT, rpc, server_public,
             keys, method, str(timeout)],
            capture_output=True, text=True, timeout=120, env=env)
        return out.stdout.strip() or out.stderr.strip()

    try:
        assert client(client_secret, "get_load", 60) == "served True"
        assert client("-", "get_load", 1) == "nothing"  # a stranger gets nothing
        assert client(client_secret, "shutdown", 30) == "served True"  # still serving
        server.wait(60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)


_DP_CLIENT = """
import sys
import time
from bus import PullInbox, PushOutbox, RpcClient
from messages import BatchTokenIDOut, Codec, Output, Request, SamplingParams
from messages import TokenizedGenerateReqInput
d = sys.argv[1]
with RpcClient(f"ipc://{d}/rpc") as rpc, PullInbox(Codec(Output), f"ipc://{d}/out") as out, \\
        PushOutbox(Codec(Request), f"ipc://{d}/work") as work:
    deadline = time.monotonic() + 60
    while not (load := rpc.call("get_load", timeout=60)).success:  # the dispatcher serves
        assert time.monotonic() < deadline, load.message  # once one replica is live
    print("load", load.success, load.result["replicas"])
    for rank in (0, 1):
        work.send(TokenizedGenerateReqInput(rid=f"g{rank}", input_ids=[1, 2, 3], dp_rank=rank,
                                            sampling=SamplingParams(max_new_tokens=2)))
    done = set()
    while len(done) < 2 and out.socket.poll(30_000):
        for env in out.drain(16):
            msg = env.message
            if isinstance(msg, BatchTokenIDOut):
                done |= {r for r, f in zip(msg.rids, msg.finished_reasons) if f}
            else:
                print("unexpected", msg)
    print("finished", sorted(done))
    print("shutdown", rpc.call("shutdown", timeout=60).success)
"""


def test_dispatcher_over_replicas_on_another_host_with_curve(
        hosts: tuple[str, str], tmp_path: Path) -> None:
    a, b = hosts
    server_public, server_secret = CurveKeys.create_files(tmp_path, "replica")
    disp_public, disp_secret = CurveKeys.create_files(tmp_path, "dispatcher")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    replicas = [subprocess.Popen(
        ["ip", "netns", "exec", a, sys.executable, "-m", "scheduler", "serve",
         "--endpoint", f"tcp://{SERVER_IP}:{port}", "--allow-remote",
         "--curve-keys", server_secret, "--curve-allow", disp_public],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for port in (5550, 5560)]
    front = tmp_path / "front"
    front.mkdir(mode=0o700)
    dispatcher = subprocess.Popen(
        ["ip", "netns", "exec", b, sys.executable, "-m", "scheduler", "dispatch",
         "--endpoint", str(front), "--replica", f"tcp://{SERVER_IP}:5550",
         "--replica", f"tcp://{SERVER_IP}:5560", "--replica-key", server_public,
         "--replica-curve-keys", disp_secret, "--heartbeat-timeout", "3"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out = subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", _DP_CLIENT,
                              str(front)], capture_output=True, text=True, timeout=180, env=env)
        assert out.stdout.split("\n")[:3] == [
            "load True ['replica0', 'replica1']", "finished ['g0', 'g1']", "shutdown True"], \
            out.stdout + out.stderr
        dispatcher.wait(60)
        for replica in replicas:  # the shutdown reached every replica
            replica.wait(60)
    finally:
        for replica in replicas:
            if replica.poll() is None:
                replica.kill()
                replica.wait(30)
        if dispatcher.poll() is None:
            dispatcher.kill()
            dispatcher.wait(30)
        if dispatcher.stderr is not None:
            dispatcher.stderr.close()
