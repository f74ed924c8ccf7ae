"""Process helpers the tests share: who a process's children are, whether one still runs."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bus.shm.segment import SHM_DIR


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (read from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def started(pid: int) -> list[int]:
    """The scheduler processes ``pid`` started: ``multiprocessing``'s fork server (a child
    of ``pid``) forks them, so they are the children of ``pid``'s children."""
    return [grandchild for child in children(pid) for grandchild in children(child)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie or a dead process does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 60.0) -> None:
    """Poll until none of ``pids`` runs.

    Raises:
        TimeoutError: some still run after ``timeout`` seconds (naming them).
    """
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes still alive: {[p for p in pids if alive(p)]}")
        time.sleep(0.05)  # sleep-ok: pacing of a deadline poll


def left_by(pids: list[int]) -> list[str]:
    """``/dev/shm`` entries and run directories named for any of ``pids``."""
    names = set(map(str, pids))
    shm = [n for n in os.listdir(SHM_DIR)
           if (m := re.match(r"tsb-(\d+)-", n)) and m.group(1) in names]
    runs = [n for n in os.listdir(tempfile.gettempdir())
            if (m := re.match(r"tsbrun-(\d+)-", n)) and m.group(1) in names]
    return shm + runs


def stop(proc: subprocess.Popen[str] | subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """Ask ``proc`` to stop (SIGTERM), wait ``grace`` seconds, then kill it and reap it."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def free_tcp_base(ports: int = 3) -> int:
    """A port on 127.0.0.1 with the ``ports - 1`` after it free too (a scheduler's
    ``tcp://`` base binds three in a row)."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        socks: list[socket.socket] = []
        try:
            for i in range(ports):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def write_environ(path: str, name: str) -> None:
    """Write environment variable ``name`` (``unset`` if it is not) to ``path``: a target
    for a process, to see the environment it runs with."""
    Path(path).write_text(os.environ.get(name, "unset"))
