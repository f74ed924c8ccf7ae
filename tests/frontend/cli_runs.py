"""Runs of a real ``python -m frontend`` (or ``python -m scheduler serve``) process, for the
tests and the soak: a start that must fail in one line, and a double Ctrl-C with open streams.

Each run gets a temp directory of its own as ``TMPDIR``, so what it leaves
there (``tsbrun-*`` run directories) is its own and can be counted.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BREAKS", "DoubleStop", "Failed", "GroupStop", "StartStop", "broken_copy",
           "broken_tiny_hf", "ctrl_c_while_starting", "double_ctrl_c", "failed_start",
           "free_port", "group_ctrl_c"]

ROOT = Path(__file__).resolve().parents[2]


def _truncate(d: Path) -> None:
    weights = d / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)


def _unknown_type(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))


def _invalid_json(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "llama",')


#: How a model directory is broken, by name: each names the file a one-line error must
#: name (``tokenizer.json`` only matters to the frontend).
BREAKS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "truncated_weights": ("model.safetensors", _truncate),
    "unknown_model_type": ("config.json", _unknown_type),
    "missing_config": ("config.json", lambda d: (d / "config.json").unlink()),
    "invalid_config_json": ("config.json", _invalid_json),
    "missing_weights": ("model.safetensors", lambda d: (d / "model.safetensors").unlink()),
    "missing_tokenizer": ("tokenizer.json", lambda d: (d / "tokenizer.json").unlink()),
}


def broken_copy(good: Path, dest: Path, how: str) -> Path:
    """A copy of the model directory ``good`` at ``dest``, broken as :data:`BREAKS` says."""
    shutil.copytree(good, dest)
    BREAKS[how][1](dest)
    return dest


def broken_tiny_hf(dest: Path, how: str) -> Path:
    """A tiny random Llama built at ``dest``, then broken as :data:`BREAKS` says."""
    from scheduler.models.tiny_hf import build_tiny_hf  # (needs the [hf] extra)

    root = build_tiny_hf(dest)
    BREAKS[how][1](root)
    return root


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env(tmp: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": tmp}


def _run_dirs(tmp: str) -> list[str]:
    return sorted(n for n in os.listdir(tmp) if n.startswith("tsbrun-"))


@dataclass(frozen=True, slots=True)
class Failed:
    """A start that failed: its exit status, its stderr's lines, the run directories left."""

    returncode: int
    lines: list[str]
    leftovers: list[str]


def failed_start(argv: list[str], timeout: float = 240.0) -> Failed:
    """Run ``python ARGV`` (a start expected to fail) in a TMPDIR of its own."""
    with tempfile.TemporaryDirectory(prefix="tsb-start-") as tmp:
        proc = subprocess.run([sys.executable, *argv], env=_env(tmp), cwd=tmp,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=timeout, check=False)
        lines = proc.stderr.decode(errors="replace").splitlines()
        return Failed(proc.returncode, [ln for ln in lines if ln.strip()], _run_dirs(tmp))


@dataclass(frozen=True, slots=True)
class DoubleStop:
    """A frontend stopped by two SIGINTs with streams open."""

    returncode: int
    stderr: str
    leftovers: list[str]
    streams: int

    @property
    def aborted(self) -> bool:
        """Whether the process died of a signal (SIGABRT, or the SIGINT itself)."""
        return self.returncode < 0 or "terminate called" in self.stderr


def _open_stream(port: int) -> socket.socket:
    body = (b'{"model": "tiny", "prompt": "hi", "max_tokens": 50000, "ignore_eos": true, '
            b'"stream": true}')
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the frontend exited while starting ({proc.returncode})")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.1)  # sleep-ok: pacing a deadline poll
    raise TimeoutError("the frontend did not become healthy")


def _frontend(tmp: str, port: int, mode: str, extra: tuple[str, ...], *,
              new_session: bool = False) -> subprocess.Popen[bytes]:
    """``python -m frontend --mode MODE`` on ``port``, run in ``tmp`` (its TMPDIR), its
    stderr piped (``new_session``: as the leader of a process group of its own)."""
    return subprocess.Popen(
        [sys.executable, "-m", "frontend", "--port", str(port), "--mode", mode,
         "--log-level", "warning", *extra],
        env=_env(tmp), cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=new_session)


def double_ctrl_c(mode: str = "ring", streams: int = 60, gap: float = 0.3,
                  extra: tuple[str, ...] = ()) -> DoubleStop:
    """Start ``python -m frontend --mode MODE``, open ``streams`` streams (each answering),
    send SIGINT, wait ``gap`` seconds, send SIGINT again; wait for the exit."""
    with tempfile.TemporaryDirectory(prefix="tsb-stop-") as tmp:
        port = free_port()
        proc = _frontend(tmp, port, mode, extra)
        socks: list[socket.socket] = []
        try:
            _wait_healthy(proc, port, time.monotonic() + 180)
            socks = [_open_stream(port) for _ in range(streams)]
            for s in socks:  # each has its status line: the stream runs
                if not s.recv(64).startswith(b"HTTP/1.1 200"):
                    raise RuntimeError("a stream was not answered 200")
            proc.send_signal(signal.SIGINT)
            time.sleep(gap)  # sleep-ok: the gap between the two Ctrl-Cs is what is tested
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            for s in socks:
                s.close()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return DoubleStop(proc.returncode, err.decode(errors="replace"), _run_dirs(tmp),
                          len(socks))


@dataclass(frozen=True, slots=True)
class GroupStop:
    """A frontend whose process group got one SIGINT (a terminal's Ctrl-C) mid-stream."""

    returncode: int
    stderr: str
    at_signal: int  # the stream's events read when the signal was sent
    events: list[dict[str, object]]  # every event of the stream, the signal's time included


def group_ctrl_c(mode: str, tokens: int, extra: tuple[str, ...] = ()) -> GroupStop:
    """Start ``python -m frontend --mode MODE`` as a process group's leader, open one stream
    of ``tokens`` tokens, and at its first event send SIGINT to the whole group, as a
    terminal's Ctrl-C does; read the stream to its end, then wait for the exit."""
    with tempfile.TemporaryDirectory(prefix="tsb-group-") as tmp:
        port = free_port()
        proc = _frontend(tmp, port, mode, extra, new_session=True)
        events: list[dict[str, object]] = []
        at_signal = -1
        try:
            _wait_healthy(proc, port, time.monotonic() + 180)
            body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": tokens,
                               "ignore_eos": True, "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s, \
                    s.makefile("rb") as answer:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
                for line in answer:
                    if line.strip() == b"data: [DONE]":
                        break
                    if line.startswith(b"data: "):
                        events.append(json.loads(line[6:]))
                        if at_signal < 0:
                            os.killpg(proc.pid, signal.SIGINT)
                            at_signal = len(events)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        return GroupStop(proc.returncode, err.decode(errors="replace"), at_signal, events)


@dataclass(frozen=True, slots=True)
class StartStop:
    """A frontend whose process group got one SIGINT while its scheduler process started."""

    returncode: int
    stderr: str
    children: list[int]  # the spawned processes seen when the signal was sent
    left: list[int]  # ... those still running 30 s after the frontend's exit


def _spawned(parent: int) -> list[int]:
    """The interpreters ``parent`` started through ``multiprocessing``: its fork server (it
    imports what the scheduler processes run, then forks them), or a spawned process
    (Linux /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                line = f.read()
            spawned = b"spawn_main" in line or b"multiprocessing.forkserver" in line
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and spawned:
            found.append(int(name))
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _catches_sigint(pid: int) -> bool:
    """Whether ``pid`` has a handler for SIGINT (its interpreter set Python's up)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def ctrl_c_while_starting(extra: tuple[str, ...] = ()) -> StartStop:
    """Start ``python -m frontend --mode zmq`` as a process group's leader and, as soon as
    the interpreter that imports for its scheduler processes (its fork server) has
    Python's SIGINT handler (it is then importing: torch takes seconds), send SIGINT to
    the whole group, as a terminal's Ctrl-C does; wait for the exit. (Sooner, the
    signal's default action ends the child without a word.)"""
    with tempfile.TemporaryDirectory(prefix="tsb-starting-") as tmp:
        proc = _frontend(tmp, free_port(), "zmq", extra, new_session=True)
        children: list[int] = []
        try:
            deadline = time.monotonic() + 120
            while not children and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)  # sleep-ok: pacing a deadline poll
                children = [c for c in _spawned(proc.pid) if _catches_sigint(c)]
            if not children:
                raise RuntimeError("the frontend started no scheduler process")
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        deadline = time.monotonic() + 30
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.05)  # sleep-ok: pacing a deadline poll
        return StartStop(proc.returncode, err.decode(errors="replace"), children,
                         [c for c in children if _running(c)])
