"""``python -m scheduler serve`` in a temp dir, driven over raw sockets (tests share it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import zmq

from bus import RpcClient


class Served:
    """A ``serve`` process (``extra`` arguments appended), with a work PUSH, an out PULL
    and an rpc client; :meth:`close` stops all of it."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.dir = tmp / "sched"
        self.proc = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--endpoint",
                                      str(self.dir), *extra], stderr=subprocess.DEVNULL)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        deadline = time.monotonic() + 120
        while not (self.dir / "rpc").exists():
            assert time.monotonic() < deadline and self.proc.poll() is None, "serve did not start"
            time.sleep(0.01)  # sleep-ok: pacing of a deadline poll
        self.out = self.ctx.socket(zmq.PULL)
        self.out.bind(f"ipc://{self.dir}/out")
        self.work = self.ctx.socket(zmq.PUSH)
        self.work.connect(f"ipc://{self.dir}/work")
        self.rpc = RpcClient(f"ipc://{self.dir}/rpc", ctx=self.ctx)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self.rpc.close()
        self.out.close(0)
        self.work.close(0)
        self.ctx.term()
