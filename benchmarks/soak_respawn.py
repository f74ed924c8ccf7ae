"""Soak: ``serve --dp`` replicas that die at the wrong moment, and replicas that can never start.

Run: ``python -m benchmarks.soak_respawn`` (or ``python -m benchmarks.soak
respawn_twice serve_dp_no_replica``). The last line is one JSON object:

* ``respawn_twice_ok`` (must be 1): replica 0 of a ``python -m scheduler
  serve --dp 2`` is SIGKILLed, and its restart SIGKILLed again as soon as
  ``get_load`` shows it live; ``get_load`` must show every replica live again,
  replica 0 under a third pid, within 120 s, and still live 2 s later.
  ``respawn_twice_s``: from the first kill to the second restart live.
* ``serve_dp_no_replica_exit_s`` (must be <= 10): ``serve --dp 2
  --max-batch 0`` and ``serve --dp 2 --model DIR`` with its
  ``model.safetensors`` cut in half: each must exit non-zero (it used to run
  for ever, answering nothing); the larger of the two times, from the
  command's start (an interpreter and torch import included), and each one
  (``serve_dp_max_batch_0_exit_s``, ``serve_dp_truncated_model_exit_s``).
  A command that exits 0, or still runs after 120 s, counts as 999.

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
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from bus import RpcClient
from tests.procs import alive, stop

__all__ = ["main", "respawn_twice", "serve_dp_no_replica"]

ROOT = Path(__file__).resolve().parents[1]
#: What a command that never exits, or exits 0, counts as (seconds).
NEVER = 999.0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _live_load(rpc: RpcClient) -> dict[str, object] | None:
    """``get_load``'s result when every replica answered it, else None."""
    reply = rpc.call("get_load", timeout=60)
    return dict(reply.result) if reply.success and reply.result is not None else None


def respawn_twice() -> dict[str, object]:
    """Replica 0 of ``serve --dp 2`` SIGKILLed, and again as soon as its restart is live."""
    with tempfile.TemporaryDirectory(prefix="tsb-soak-respawn-") as d:
        serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve", "--dp", "2",
                                  "--endpoint", f"{d}/ep"], env=_env(),
                                 stderr=subprocess.DEVNULL)
        rpc = RpcClient(f"ipc://{d}/ep/rpc")
        ok, took = 0, float(NEVER)
        try:
            deadline = time.monotonic() + 180
            while (load := _live_load(rpc)) is None and time.monotonic() < deadline:
                time.sleep(0.1)  # sleep-ok: pacing a deadline poll
            if load is None:
                raise RuntimeError("serve --dp 2 never had both replicas live")
            pids = [load["replica0.pid"]]
            t0 = time.monotonic()
            for _ in range(2):
                old = pids[-1]
                assert isinstance(old, int)
                os.kill(old, signal.SIGKILL)
                while time.monotonic() - t0 < 120:
                    load = _live_load(rpc)
                    if load is not None and load["replica0.pid"] != old:
                        pids.append(load["replica0.pid"])
                        break
                    time.sleep(0.01)  # sleep-ok: pacing a deadline poll
            if len(pids) == 3:
                took = time.monotonic() - t0
                time.sleep(2.0)  # sleep-ok: it must stay live, not only come back
                again = _live_load(rpc)
                pid = pids[-1]
                ok = int(again is not None and again["replica0.pid"] == pid
                         and isinstance(pid, int) and alive(pid))
            print(f"replica0 pids {pids}", file=sys.stderr)
        finally:
            rpc.close()
            stop(serve, 60)
    return {"respawn_twice_ok": ok, "respawn_twice_s": round(took, 2)}


def _exit_s(args: list[str]) -> float:
    """Seconds ``serve`` with ``args`` took to exit non-zero (:data:`NEVER`: it did not)."""
    with tempfile.TemporaryDirectory(prefix="tsb-soak-noreplica-") as d:
        t0 = time.monotonic()
        serve = subprocess.Popen([sys.executable, "-m", "scheduler", "serve",
                                  "--endpoint", f"{d}/ep", *args], env=_env(),
                                 stderr=subprocess.PIPE, text=True)
        try:
            _, err = serve.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.communicate(timeout=30)
            return NEVER
        took = time.monotonic() - t0
        last = err.strip().splitlines()[-1] if err.strip() else ""
        print(f"serve {' '.join(args)}: exit {serve.returncode} in {took:.1f} s: {last}",
              file=sys.stderr)
        return took if serve.returncode != 0 else NEVER


def serve_dp_no_replica() -> dict[str, object]:
    """``serve --dp 2`` with an argument or a model no replica can start with."""
    from scheduler.models.tiny_hf import build_tiny_hf

    zero = _exit_s(["--dp", "2", "--max-batch", "0"])
    with tempfile.TemporaryDirectory(prefix="tsb-soak-cut-") as d:
        root = build_tiny_hf(Path(d) / "cut")
        weights = root / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
        cut = _exit_s(["--dp", "2", "--model", str(root)])
    return {"serve_dp_no_replica_exit_s": round(max(zero, cut), 2),
            "serve_dp_max_batch_0_exit_s": round(zero, 2),
            "serve_dp_truncated_model_exit_s": round(cut, 2)}


SCENARIOS: list[Callable[[], Mapping[str, object]]] = [respawn_twice, serve_dp_no_replica]

#: key -> (comparison, bound), merged into :data:`benchmarks.soak.BOUNDS`.
BOUNDS: dict[str, tuple[str, float]] = {
    "respawn_twice_ok": ("==", 1),
    "serve_dp_no_replica_exit_s": ("<=", 10),
}


def main() -> None:
    """Run both scenarios; print their keys as one JSON object on the last line."""
    result: dict[str, object] = {}
    for scenario in SCENARIOS:
        result.update(scenario())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
