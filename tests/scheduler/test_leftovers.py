"""Whoever dies, what it created is removed: run directories and /dev/shm files.

A killed frontend's children remove its run directory and their own shared
memory before they exit; a new run directory sweeps dead creators' ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bus import Envelope, PullInbox, PushOutbox, RpcClient
from messages import (
    Codec,
    ErrorOut,
    Output,
    Request,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler.launch.leftovers import make_run_dir, sweep_run_dirs
from tests.procs import children, left_by, wait_gone

ROOT = Path(__file__).resolve().parents[2]




def _family(pid: int) -> list[int]:
    pids = [pid, *children(pid)]
    return pids + [k for p in pids[1:] for k in children(p)]




def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_a_new_run_dir_sweeps_those_of_dead_creators() -> None:
    dead = _dead_pid()
    stale = Path(tempfile.gettempdir()) / f"tsbrun-{dead}-engine-abc123"
    stale.mkdir()
    (stale / "work").write_text("")
    mine = make_run_dir("test")
    try:
        assert not stale.exists()
        assert os.path.basename(mine).startswith(f"tsbrun-{os.getpid()}-test-")
        assert mine not in sweep_run_dirs()  # its creator lives
    finally:
        os.rmdir(mine)


_FRONTEND = """
import time
from messages import SamplingParams
from scheduler import Engine, ModelConfig
engine = Engine("zmq", ModelConfig(vocab_size=128, hidden=32, layers=1), tp_size=2)
engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
print("READY", flush=True)
time.sleep(600)  # sleep-ok: killed by the test
"""


def test_a_sigkilled_tp_frontend_leaves_no_ring_and_no_run_dir() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _FRONTEND], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert "READY" in proc.stdout.readline()
        pids = _family(proc.pid)
        assert len(pids) >= 3 and left_by(pids)  # the ring, its doorbells, the run dir
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    wait_gone(pids)
    assert left_by(pids) == []  # before: the 64 MiB ring, 2 doorbells and the run dir


def test_serve_dp_stopped_with_sigterm_leaves_no_run_dir(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                              "--endpoint", str(tmp_path / "ep")], env=env,
                             stderr=subprocess.DEVNULL)
    try:
        with RpcClient(f"ipc://{tmp_path}/ep/rpc") as rpc:
            assert rpc.call("get_load", timeout=120).success
        pids = _family(serve.pid)
        assert left_by(pids)  # its run dir, while it runs
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(30)
    wait_gone(pids)
    assert left_by(pids) == []


def test_serve_stopped_with_sigterm_removes_its_socket_files(tmp_path: Path) -> None:
    # Plain serve (no --dp) stopped with SIGTERM removes DIR/rpc and DIR/work; a second
    # serve on a live directory is refused in one line, with no traceback.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "scheduler", "serve", "--endpoint", str(tmp_path / "ep")]
    serve = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        with RpcClient(f"ipc://{tmp_path}/ep/rpc") as rpc:
            assert rpc.call("get_load", timeout=120).success
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stderr
        assert "Traceback" not in second.stderr and "ep/" in second.stderr, second.stderr
        assert (tmp_path / "ep" / "rpc").exists()  # the refused one left the first's alone
        with PullInbox(Codec(Output), f"ipc://{tmp_path}/ep/out") as out, \
                PushOutbox(Codec(Request), f"ipc://{tmp_path}/ep/work") as work:
            work.send(TokenizedGenerateReqInput(rid="r", input_ids=token_ids([1]), stream=True,
                                                sampling=SamplingParams(max_new_tokens=10**5)))
            assert out.socket.poll(60_000)  # it runs
            serve.send_signal(signal.SIGTERM)
            serve.send_signal(signal.SIGINT)  # a second signal does not cut the clean-up
            # Its request ends as a shutdown, not as the scheduler's failure ("internal").
            end = _error_for(out, "r")
            assert end.code == "shutdown", end
        # Nor do more, up to its last instant (without it: the interpreter's exit put
        # the handlers back to the default, and a signal then was status -15).
        deadline = time.monotonic() + 60
        while serve.poll() is None and time.monotonic() < deadline:
            serve.send_signal(signal.SIGTERM)
            time.sleep(0.01)  # sleep-ok: the pace of the signals is what is tested
        _, err = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.communicate(timeout=30)
    assert serve.returncode == 0 and "Traceback" not in err, err
    assert sorted(p.name for p in (tmp_path / "ep").iterdir()) == []


def _error_for(out: PullInbox[Output], rid: str) -> ErrorOut:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if out.socket.poll(100):
            for env in out.drain(256):
                assert isinstance(env, Envelope), env
                if isinstance(env.message, ErrorOut) and env.message.rid == rid:
                    return env.message
    raise AssertionError(f"no ErrorOut for {rid!r}")
