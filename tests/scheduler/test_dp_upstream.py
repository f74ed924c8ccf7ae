"""A replica outlives no dispatcher: SIGKILL the dispatcher (the replicas' sibling, not
their parent) while they decode long answers, and they stop within the documented bound
(:data:`scheduler.launch.processes.UPSTREAM_BOUND`), are reaped, and leave no shared
memory; the engine says who is gone."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bus.shm.segment import SHM_DIR
from messages import SamplingParams
from scheduler import Engine, SchedulerGone
from scheduler.launch.processes import UPSTREAM_BOUND

#: Slack on the bound for this shared 2-core machine (spawn, torch, GIL).
SLACK = 2.0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _reaped(pid: int) -> bool:
    """Whether ``pid`` is gone entirely (exited *and* waited for: no zombie)."""
    return not os.path.exists(f"/proc/{pid}")


def _segments_of(pids: list[int]) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if any(n.startswith(f"tsb-{p}-") for p in pids)]


@pytest.mark.parametrize("pd", [None, (1, 1)], ids=["dp", "pd"])
def test_a_killed_dispatcher_stops_its_replicas_within_the_bound(
        pd: tuple[int, int] | None, model_dir: Path) -> None:
    # Under pd, prompts long enough that each hand-off (the prefill replica's state,
    # then the dispatcher's copy for the decode replica) travels in shared memory.
    engine = Engine("zmq", model_dir if pd else None, dp_size=2, max_batch=64, pd=pd)
    prompt = 300 if pd else 8
    try:
        dispatcher = engine._core._scheduler.essential[0].pid
        assert dispatcher is not None
        replicas = [pid for ranks in engine.replica_pids for pid in ranks]
        ranks = [p for r in engine._core._scheduler.processes.replicas for p in r]
        long = SamplingParams(max_new_tokens=100_000, ignore_eos=True)  # decodes for long
        streams = [engine.submit([1 + n % 5] * prompt, long, stream=True) for n in range(8)]
        for h in streams:  # every one decodes (under pd: handed off to the decode replica)
            next(iter(h))
        if pd:  # (what the assertion on leftovers below is about)
            assert _segments_of([dispatcher]), "no hand-off went through shared memory"
        busy = {pid: _cpu_seconds(pid) for pid in replicas}
        os.kill(dispatcher, signal.SIGKILL)
        killed_at = time.monotonic()
        deadline = killed_at + UPSTREAM_BOUND + SLACK
        while not all(_reaped(pid) for pid in replicas):
            assert time.monotonic() < deadline, (
                f"replicas still there {time.monotonic() - killed_at:.1f} s after their "
                f"dispatcher died: {[p for p in replicas if not _reaped(p)]} "
                f"(CPU seconds before: {busy})")
            time.sleep(0.02)  # sleep-ok: pacing of a deadline poll
        # Each stopped by itself (an orphan's exit), not by the supervisor's SIGKILL. The
        # supervisor's thread reaps them: a process it has waited for but whose exit code
        # it has not stored yet reads as None here (our own waitpid finds no child).
        while any(p.exitcode is None for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.02)  # sleep-ok: pacing of a deadline poll
        assert [p.exitcode for p in ranks] == [1] * len(ranks)
        # Their shared memory and the dead dispatcher's is gone now, not at the close
        # (a door answers 503 for as long as it runs).
        while left := _segments_of([dispatcher, *replicas]):
            assert time.monotonic() < deadline, f"left in {SHM_DIR}: {left}"
            time.sleep(0.02)  # sleep-ok: pacing of a deadline poll
        for h in streams:  # every pending request ends, naming the dispatcher
            with pytest.raises(SchedulerGone, match="dispatcher"):
                for _ in h:
                    pass
        with pytest.raises(SchedulerGone, match="dispatcher"):
            engine.generate([1, 2], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()
    assert _segments_of([dispatcher, *replicas]) == []


def test_a_killed_replicas_shared_memory_goes_when_it_is_reaped(model_dir: Path) -> None:
    # Prefill and decode apart, long prompts: the prefill replica's hand-offs sit in
    # slabs of its own; killed, it unlinks none of them.
    with Engine("zmq", model_dir, pd=(1, 1), max_batch=64) as engine:
        long = SamplingParams(max_new_tokens=100_000, ignore_eos=True)
        streams = [engine.submit([1 + n % 5] * 300, long, stream=True) for n in range(4)]
        for h in streams:
            next(iter(h))
        (prefill,) = engine.replica_pids[0]
        assert _segments_of([prefill]), "no hand-off went through shared memory"
        os.kill(prefill, signal.SIGKILL)
        deadline = time.monotonic() + 1.0 + SLACK  # a look (every 50 ms), a join, a sweep
        while left := _segments_of([prefill]):  # while the engine serves on
            assert time.monotonic() < deadline, f"left in {SHM_DIR}: {left}"
            time.sleep(0.02)  # sleep-ok: pacing of a deadline poll
        for h in streams:
            engine.abort(h.rid)
