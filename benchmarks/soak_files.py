"""Soak: shared memory and files under abuse (a full ``/dev/shm``; kills that skip clean-up).

Run: ``python -m benchmarks.soak_files``. The last line is one JSON object:

* ``shm_full_sender_alive`` (must be 1): a process sends 4 MiB tensor frames
  through a ``PushOutbox`` whose shared-memory directory is a 1 MiB tmpfs
  (``TSB_SHM_DIR``); it must keep running and every frame must arrive (over
  the socket). ``shm_full_method`` says how the directory was made full:
  ``"tmpfs"`` (a real mount), or ``"injected"`` where mounting is not
  allowed (the allocation seam fails with ENOSPC instead).
* ``leaked_files_after_kills`` (must be 0): ``/dev/shm`` entries and run
  (endpoint) directories left behind, once every process has exited, by a
  frontend holding ``Engine("zmq", tp_size=2)`` that is SIGKILLed, plus a
  ``python -m scheduler serve --dp 2`` that is SIGTERMed; and the two
  parts, ``leaked_after_tp_frontend_kill`` and ``leaked_after_dp_sigterm``.

The functions return their keys as a dict, so a larger soak can run them.
Every socket is ``ipc://`` in a temp dir; every process is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from bus import RpcClient
from tests.procs import children, left_by, wait_gone

__all__ = ["leaked_files_after_kills", "main", "shm_full_sender_alive"]

ROOT = Path(__file__).resolve().parents[1]

_SENDER = """
import errno, sys, torch
from bus.shm import segment
if sys.argv[1] == "inject":
    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    segment._reserve = full
from bus import PullInbox, PushOutbox
from messages import BatchEmbeddingOut, Codec, Output
codec = Codec(Output)
inbox = PullInbox(codec, f"ipc://{sys.argv[2]}/t")
out = PushOutbox(codec, f"ipc://{sys.argv[2]}/t")
n = 8
for i in range(n):
    out.send(BatchEmbeddingOut(rids=[str(i)], embeddings=torch.full((1, 1 << 20), float(i))))
got = []
while len(got) < n:
    got.extend(inbox.drain(n))
ok = [float(e.message.embeddings[0, -1]) for e in got] == [float(i) for i in range(n)]
print("ARRIVED" if ok else "WRONG", out.shm_frames.fallbacks, flush=True)
out.close()
inbox.close()
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def shm_full_sender_alive() -> dict[str, object]:
    """A sender on a full shared-memory directory lives and its frames arrive."""
    with tempfile.TemporaryDirectory(prefix="tsb-soak-shm-") as d:
        mnt = Path(d) / "shm"
        mnt.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                 capture_output=True).returncode == 0
        try:
            env = _env(TSB_SHM_DIR=str(mnt)) if mounted else _env()
            proc = subprocess.run([sys.executable, "-c", _SENDER,
                                   "real" if mounted else "inject", d],
                                  env=env, capture_output=True, text=True, timeout=300)
        finally:
            if mounted:
                subprocess.run(["umount", str(mnt)], check=False)
    alive = proc.returncode == 0 and "ARRIVED 8" in proc.stdout
    if not alive:
        print(f"shm_full sender: rc={proc.returncode} {proc.stdout!r} "
              f"{proc.stderr[-500:]!r}", file=sys.stderr)
    return {"shm_full_sender_alive": int(alive),
            "shm_full_method": "tmpfs" if mounted else "injected",
            "shm_full_sender_rc": proc.returncode}






_FRONTEND = """
import os, sys, time
from messages import SamplingParams
from scheduler import Engine, ModelConfig
engine = Engine("zmq", ModelConfig(vocab_size=128, hidden=32, layers=1), tp_size=2)
engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
print("READY", flush=True)
time.sleep(600)  # sleep-ok: killed by the soak
"""


def _tp_frontend_kill() -> list[str]:
    proc = subprocess.Popen([sys.executable, "-c", _FRONTEND], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "READY" not in line:
            raise RuntimeError(f"the TP frontend did not start: {line!r}")
        pids = [proc.pid, *children(proc.pid)]
        pids += [k for p in pids[1:] for k in children(p)]
    finally:
        proc.kill()
        proc.wait(30)
    wait_gone(pids)
    return left_by(pids)


def _dp_sigterm() -> list[str]:
    with tempfile.TemporaryDirectory(prefix="tsb-soak-dp-") as d:
        serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                                  "--endpoint", f"{d}/ep"], env=_env(),
                                 stderr=subprocess.DEVNULL)
        try:
            with RpcClient(f"ipc://{d}/ep/rpc") as rpc:
                if not rpc.call("get_load", timeout=120).success:
                    raise RuntimeError("serve --dp did not answer")
            pids = [serve.pid, *children(serve.pid)]
            pids += [k for p in pids[1:] for k in children(p)]
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
        finally:
            if serve.poll() is None:
                serve.kill()
                serve.wait(30)
        wait_gone(pids)
        return left_by(pids)


def leaked_files_after_kills() -> dict[str, object]:
    """What a SIGKILLed TP frontend and a SIGTERMed ``serve --dp`` leave behind."""
    tp = _tp_frontend_kill()
    dp = _dp_sigterm()
    if tp or dp:
        print(f"left behind: {tp + dp}", file=sys.stderr)
    return {"leaked_files_after_kills": len(tp) + len(dp),
            "leaked_after_tp_frontend_kill": len(tp), "leaked_after_dp_sigterm": len(dp)}


#: The scenarios :mod:`benchmarks.soak` runs from here (its bounds are there).
SCENARIOS: list[Callable[[], Mapping[str, object]]] = [shm_full_sender_alive,
                                                     leaked_files_after_kills]


def main() -> None:
    """Run both scenarios; print their keys as one JSON object on the last line."""
    result: dict[str, object] = {}
    result.update(shm_full_sender_alive())
    result.update(leaked_files_after_kills())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
