"""When a replica is lost: only on evidence about the replica itself.

Pure bookkeeping, no sockets, and a clock the caller passes in, so every
rule is tested deterministically (``tests/scheduler/test_dp_liveness.py``).

Three kinds of evidence, and what is *not* evidence:

* **Its process exited** (a local replica's pidfd): lost at once. The
  dispatcher checks that itself; it needs no clock.
* **Its silence, measured while we were awake.** Every probe (heartbeat)
  is sent by the dispatcher while it runs; silence is counted from the
  oldest probe still unanswered, on an :class:`AwakeClock` that advances
  by at most ``max_gap`` per tick. A dispatcher that was stopped (Ctrl-Z,
  SIGSTOP), paused by a long GC or swapped out for seconds counts those
  seconds as ``max_gap``: its own stall is not the replicas' silence, and
  the replies that arrived meanwhile are read before anyone is judged. For
  a local replica, the time its process spent *runnable but waiting for a
  CPU* (``/proc/<pid>/schedstat``) is taken off too: a host so busy that a
  healthy replica gets no CPU is not that replica falling silent, while a
  hung (sleeping) or stopped replica accrues no such time and is lost.
* **Its outputs never arrive** (a second consumer on its output endpoint,
  or a peer that swallows work): it reports itself *idle* (nothing running,
  nothing queued) in every heartbeat for a whole timeout of awake time,
  while requests we sent it before that window began are still unanswered,
  and not one output of it arrived in that window, and we were not holding
  its outputs back (throttled).

Not evidence: a reported count lower than ours. Requests still queued in
the replica's inbound socket (not read yet) and outputs still on their way
back (not drained yet, or held by the replica's own backpressure) are in
flight but in nobody's report; a busy replica is never idle with work
waiting, and a replica with work produces outputs, so neither can look like
the third kind (the old rule compared the counts and lost healthy replicas
under load).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AwakeClock", "Health"]


class AwakeClock:
    """Time that passes only while the dispatcher runs.

    :meth:`tick` advances it by the real time since the last tick, but by at
    most ``max_gap``: a longer gap means the dispatcher itself did not run
    (stopped, stalled), and that is not time in which a replica could have
    answered us.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_gap: float = 0.25
                 ) -> None:
        self.clock = clock
        self.max_gap = max_gap
        self._real = clock()
        self.now = 0.0  #: awake seconds since this clock began
        self.stalls = 0  #: gaps longer than ``max_gap`` (our own stalls)

    def tick(self) -> float:
        """Advance to the real clock's now (a long gap counts as ``max_gap``); the awake time."""
        real = self.clock()
        gap = real - self._real
        self._real = real
        if gap > self.max_gap:
            self.stalls += 1
            gap = self.max_gap
        self.now += max(0.0, gap)
        return self.now


@dataclass(slots=True)
class Health:
    """What one replica has shown us, in awake time (see the module docstring)."""

    #: Awake time of the oldest probe not answered yet (``None``: none waits).
    probe_since: float | None = None
    #: Its CPU wait (seconds runnable, not running) when that probe went out.
    wait_since: float = 0.0
    #: Awake time from which every report said idle while ours were in flight.
    idle_since: float | None = None

    def reset(self) -> None:
        """A new incarnation (or a lost one): nothing is known of it yet."""
        self.probe_since = self.idle_since = None

    def probed(self, now: float, cpu_wait: Callable[[], float] = lambda: 0.0) -> None:
        """A probe went out at ``now``; ``cpu_wait()``: its CPU wait so far (seconds)."""
        if self.probe_since is None:
            self.probe_since = now
            self.wait_since = cpu_wait()

    def answered(self) -> None:
        """It answered an rpc (a probe or a broadcast): not silent."""
        self.probe_since = None

    def reported(self, now: float, idle: bool, ours: int) -> None:
        """A heartbeat said it is ``idle`` (or not); ``ours``: our requests there that
        were sent before ``now`` and are unanswered."""
        if not idle or not ours:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now

    def output(self) -> None:
        """An output of it arrived (or we held its outputs back): not a black hole."""
        self.idle_since = None

    def verdict(self, now: float, timeout: float, sent_before: Callable[[float], int],
                cpu_wait: Callable[[], float] = lambda: 0.0) -> str | None:
        """Why it is lost at awake time ``now``, or ``None``.

        ``sent_before(t)``: how many of our requests on it, still unanswered,
        were sent before awake time ``t``; ``cpu_wait()``: its CPU wait so far.
        """
        if self.probe_since is not None and now - self.probe_since > timeout:
            starved = max(0.0, cpu_wait() - self.wait_since)  # read only when needed
            silent = now - self.probe_since - starved
            if silent > timeout:
                return (f"silent for {silent:.2f} s while this dispatcher ran and it could "
                        f"have (heartbeat timeout {timeout} s)")
        if self.idle_since is not None and now - self.idle_since > timeout:
            n = sent_before(self.idle_since)
            if n:
                return (f"it reported itself idle for {now - self.idle_since:.2f} s while "
                        f"{n} requests we sent it before then got no answer, and none of its "
                        "outputs arrived: its outputs do not reach this dispatcher (another "
                        "consumer on its output endpoint?)")
        return None
