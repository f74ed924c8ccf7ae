"""Restarting local data-parallel replicas that die, with backoff and a bounded number of tries.

The dispatcher fails or re-runs a lost replica's requests and serves on
with the others; without a restart its capacity would stay reduced for
ever. :class:`ReplicaSupervisor` runs in the process that started the
replicas (``Engine(dp_size=N)``, ``serve --dp``), watches their processes,
and starts a replica again in place (the same ``ipc://`` endpoints) when
one exits abnormally:

* after :data:`BACKOFF` seconds, doubling with each try up to
  :data:`BACKOFF_MAX`; at most :data:`TRIES` tries in a row; a replica
  that then stays up :data:`STABLE` seconds has its count reset;
* each exit and restart is logged (``scheduler.launch``), and a replica
  given up on is logged as an error;
* where a *standby* can be had (one rank per replica), a process started
  ahead, imported and waiting, takes the dead replica's place at once and
  a new standby is started behind it; the first standby is started
  :data:`STANDBY_AFTER` seconds after every replica has started
  (``started()``): it must not slow their start, and a process that is
  still importing cannot yet see its parent die;
* a clean exit (code 0: the ``shutdown`` rpc reached it) is not restarted,
  nor anything once :meth:`stop` was called or ``keep_going()`` says no
  (the dispatcher is gone: the engine is closing).

The new process answers the dispatcher's next probe with its pid and
rejoins under a new generation (:mod:`scheduler.dp.replica`), so outputs
of the old incarnation can never be taken for the new one's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

__all__ = ["BACKOFF", "BACKOFF_MAX", "STABLE", "STANDBY_AFTER", "TRIES", "ReplicaSupervisor",
           "Standby"]

log = logging.getLogger("scheduler.launch")

#: Tries in a row before a replica is given up on.
TRIES = 5
#: Seconds before the first restart; doubles with each try.
BACKOFF = 0.1
#: The longest wait between two tries.
BACKOFF_MAX = 5.0
#: Seconds a restarted replica must stay up for its tries to be counted from 0 again.
STABLE = 60.0
#: Seconds after every replica started before the first standby is started.
STANDBY_AFTER = 10.0
#: Seconds between two looks at the processes (an exit is restarted this late at most).
_LOOK = 0.05


@dataclass(slots=True)
class Standby:
    """A replica process started ahead, waiting on ``wake`` for the index to serve."""

    process: BaseProcess
    wake: Connection
    _ready: bool = False

    @property
    def ready(self) -> bool:
        """Whether it has started and imported everything (a take-over is then immediate)."""
        if not self._ready and not self.wake.closed:
            with contextlib.suppress(OSError, EOFError):
                self._ready = self.wake.poll() and self.wake.recv_bytes() == b"ready"
        return self._ready

    def take_over(self, i: int) -> list[BaseProcess]:
        """Make it serve replica ``i`` now; its processes.

        Raises:
            OSError: it is gone (its end of the pipe closed).
        """
        self.wake.send_bytes(str(i).encode())
        self.wake.close()
        return [self.process]

    def stand_down(self) -> None:
        """Let it exit (it serves nothing)."""
        with contextlib.suppress(OSError):
            self.wake.send_bytes(b"")
        self.wake.close()


class ReplicaSupervisor:
    """Restarts replica ``i`` with ``start(i, attempt)`` when its processes exit abnormally.

    ``replicas[i]`` is replica ``i``'s list of processes (every tp rank); it
    is replaced *in place* by the new ones, so whoever holds the list (the
    engine's process table, ``serve --dp``'s clean-up) sees them.
    """

    def __init__(self, replicas: list[list[BaseProcess]],
                 start: Callable[[int, int], list[BaseProcess]], *,
                 keep_going: Callable[[], bool] = lambda: True, tries: int = TRIES,
                 backoff: float = BACKOFF, backoff_max: float = BACKOFF_MAX,
                 stable: float = STABLE, standby: Callable[[], Standby] | None = None,
                 started: Callable[[], bool] = lambda: True) -> None:
        self.replicas = replicas
        self._start = start
        self._keep_going = keep_going
        self.tries, self.backoff, self.backoff_max, self.stable = tries, backoff, backoff_max, \
            stable
        self.restarts = [0] * len(replicas)  #: restarts done, per replica
        self.standby_used = 0  #: restarts that took over a standby
        self.given_up: set[int] = set()
        self._failures = [0] * len(replicas)  # exits in a row
        self._started_at = [time.monotonic()] * len(replicas)
        self._due: dict[int, float] = {}  # replica -> when to restart it
        self._make_standby = standby
        self._all_started = started
        self._standby: Standby | None = None
        self._up_since: float | None = None  # when every replica had started
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-supervisor",
                                        daemon=True)

    def start(self) -> None:
        """Start watching (a daemon thread)."""
        self._thread.start()

    def stop(self) -> None:
        """Restart nothing more; returns once the watcher has stopped. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._stand_down()

    def _stand_down(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.stand_down()
            standby.process.join(5.0)
            if standby.process.is_alive():
                standby.process.kill()

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            self._stand_down()

    def _watch(self) -> None:
        while not self._stop.wait(_LOOK):
            if not self._keep_going():
                return
            now = time.monotonic()
            if self._up_since is None and self._all_started():
                self._up_since = now
            if self._make_standby is not None and self._up_since is not None and (
                    self._standby is None or self._standby.process.exitcode is not None) \
                    and now - self._up_since >= STANDBY_AFTER:
                self._standby = self._make_standby()
            for i, ranks in enumerate(self.replicas):
                if i in self.given_up:
                    continue
                if i in self._due:
                    if now >= self._due[i]:
                        del self._due[i]
                        self._restart(i)
                    continue
                codes = [p.exitcode for p in ranks]
                if all(c is None for c in codes):
                    continue
                if all(c == 0 for c in codes if c is not None):
                    self.given_up.add(i)  # stopped cleanly (shutdown): nothing to restart
                    continue
                self._exited(i, ranks, [c for c in codes if c is not None], now)

    def _exited(self, i: int, ranks: list[BaseProcess], codes: list[int], now: float) -> None:
        for p in ranks:  # a rank left alone would wait for its dead peer for ever
            if p.exitcode is None:
                p.kill()
            p.join(5.0)
        if now - self._started_at[i] >= self.stable:
            self._failures[i] = 0
        self._failures[i] += 1
        n = self._failures[i]
        if n > self.tries:
            self.given_up.add(i)
            log.error("replica%d exited (exit code %s) after %d restarts in a row: not "
                      "restarting it again; the others serve on", i, codes[0], self.tries)
            return
        delay = min(self.backoff_max, self.backoff * 2 ** (n - 1))
        self._due[i] = now + delay
        log.warning("replica%d exited (exit code %s): restarting it in %.2f s (try %d of %d)",
                    i, codes[0], delay, n, self.tries)

    def _take_standby(self, i: int) -> list[BaseProcess] | None:
        """The standby's processes, now serving replica ``i`` (``None``: no standby ready)."""
        standby, self._standby = self._standby, None
        if standby is None or standby.process.exitcode is not None:
            return None
        try:
            new = standby.take_over(i)
        except OSError:
            return None
        self.standby_used += 1
        return new

    @property
    def standby_ready(self) -> bool:
        """Whether a standby waits, ready to take over."""
        standby = self._standby
        return standby is not None and standby.process.exitcode is None and standby.ready

    def _restart(self, i: int) -> None:
        if self._stop.is_set() or not self._keep_going():
            return
        try:
            new = self._take_standby(i) or self._start(i, self.restarts[i] + 1)
        except Exception as exc:  # a failed start is a failed try
            log.warning("replica%d could not be restarted: %s", i, exc)
            self._exited(i, [], [-1], time.monotonic())
            return
        self.restarts[i] += 1
        self._started_at[i] = time.monotonic()
        self.replicas[i][:] = new
        log.warning("replica%d restarted (pid %s, restart %d)", i,
                    ", ".join(str(p.pid) for p in new), self.restarts[i])
