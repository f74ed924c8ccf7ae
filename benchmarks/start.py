"""How long an engine in ``zmq`` mode takes to start: ``python -m benchmarks.start``.

A start is ``Engine("zmq", ...)`` until it returns: its scheduler processes
started and ``hello`` answered (the stub model: no weights to build). Each
way of starting runs in a fresh interpreter of its own, one first start then
:data:`LATER` more, in turns over :data:`ROUNDS` rounds (the median round):

* ours: the processes are forked from multiprocessing's fork server, which
  imported the scheduler's modules (torch among them) when the first start
  made it; later starts in the process are forks.
* ``spawn``: each process a new interpreter that imports them itself (how
  the engine started its processes before; SGLang's way).
* ``fork``: each process forked from the engine's own process (vLLM's default
  while CUDA is not initialised). As fast as ours, but it forks a process
  that runs threads (the engine's loop, zmq's I/O, torch's pool): a lock one of
  them held at the fork stays held in the child, and the child inherits the
  engine's sockets. The fork server forks a process that runs none.

The last line is one JSON object:

* ``zmq_start_ms_first``: ours, the first start in a process (the fork server
  imports then); ``zmq_start_ms_p50``: ours, the later starts' median;
  ``zmq_start_ms_p50_spawn``: spawn's starts' median (each alike);
  ``zmq_start_ratio_spawn_vs_ours``: the second over the first (> 1: ours
  sooner).
* ``zmq_start_ms_p50_fork``, ``zmq_start_ratio_fork_vs_ours``: the same for
  a plain fork (about 1: the fork server's gain is safety, not speed, over it).
* ``dp2_start_ms_p50``, ``dp2_start_ms_p50_spawn``,
  ``dp2_start_ratio_spawn_vs_ours``, ``dp2_start_ms_p50_fork``,
  ``dp2_start_ratio_fork_vs_ours``: the same for ``dp_size=2`` (a dispatcher
  and two replicas: three processes; spawned, three interpreters importing
  torch at once on the box's cores).
* ``load_avg_1m``: the box's load as the run ended.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from benchmarks._timing import print_checked

__all__ = ["KEYS", "main"]

#: Starts after the first, per interpreter and layout.
LATER = 4
#: Interpreters per way of starting, in turns.
ROUNDS = 3

KEYS = ["zmq_start_ms_first", "zmq_start_ms_p50", "zmq_start_ms_p50_spawn",
        "zmq_start_ratio_spawn_vs_ours", "zmq_start_ms_p50_fork", "zmq_start_ratio_fork_vs_ours",
        "dp2_start_ms_p50", "dp2_start_ms_p50_spawn", "dp2_start_ratio_spawn_vs_ours",
        "dp2_start_ms_p50_fork", "dp2_start_ratio_fork_vs_ours", "load_avg_1m"]


def _starts(dp_size: int, n: int) -> list[float]:
    """``n`` engine starts in a row, each in milliseconds (each engine closed untimed)."""
    from scheduler import Engine, ModelConfig

    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine = Engine("zmq", ModelConfig(vocab_size=259, kind="stub"), dp_size=dp_size)
        took.append((time.perf_counter() - t0) * 1e3)
        engine.close()
    return took


def one(way: str) -> dict[str, list[float]]:
    """One interpreter's starts, ``way`` ``ours``, ``spawn`` or ``fork``: zmq mode's first
    start and :data:`LATER` more, then :data:`LATER` of ``dp_size=2``."""
    if way != "ours":
        from scheduler.launch import processes

        processes._context = lambda: multiprocessing.get_context(way)  # type: ignore[assignment,return-value]
    zmq = _starts(1, 1 + LATER)
    return {"first": zmq[:1], "zmq": zmq[1:], "dp2": _starts(2, LATER)}


def run() -> dict[str, object]:
    got: dict[str, list[dict[str, list[float]]]] = {"ours": [], "spawn": [], "fork": []}
    for _ in range(ROUNDS):
        for way in got:
            out = subprocess.run([sys.executable, "-m", "benchmarks.start", "one", way],
                                 capture_output=True, text=True, timeout=600, check=True)
            got[way].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def p50(way: str, part: str) -> float:
        return statistics.median(statistics.median(r[part]) for r in got[way])

    ours, spawn, fork = (p50(way, "zmq") for way in ("ours", "spawn", "fork"))
    ours2, spawn2, fork2 = (p50(way, "dp2") for way in ("ours", "spawn", "fork"))
    return {"zmq_start_ms_first": round(p50("ours", "first"), 1),
            "zmq_start_ms_p50": round(ours, 1), "zmq_start_ms_p50_spawn": round(spawn, 1),
            "zmq_start_ratio_spawn_vs_ours": round(spawn / ours, 2),
            "zmq_start_ms_p50_fork": round(fork, 1),
            "zmq_start_ratio_fork_vs_ours": round(fork / ours, 2),
            "dp2_start_ms_p50": round(ours2, 1), "dp2_start_ms_p50_spawn": round(spawn2, 1),
            "dp2_start_ratio_spawn_vs_ours": round(spawn2 / ours2, 2),
            "dp2_start_ms_p50_fork": round(fork2, 1),
            "dp2_start_ratio_fork_vs_ours": round(fork2 / ours2, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "one":
        print(json.dumps(one(sys.argv[2])))
        return
    print_checked(run(), KEYS, "benchmarks.start")


if __name__ == "__main__":
    main()
