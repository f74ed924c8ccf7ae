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
* a clean exit (code 0: the ``shutdown`` rpc reached it) is not restarted,
  nor anything once :meth:`stop` was called or ``keep_going()`` says no
  (the dispatcher is gone: the engine is closing).

The new process answers the dispatcher's next probe with its pid and
rejoins under a new generation (:mod:`scheduler.dp.replica`), so outputs
of the old incarnation can never be taken for the new one's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

__all__ = ["BACKOFF", "BACKOFF_MAX", "STABLE", "TRIES", "ReplicaSupervisor"]

log = logging.getLogger("scheduler.launch")

#: Tries in a row before a replica is given up on.
TRIES = 5
#: Seconds before the first restart; doubles with each try.
BACKOFF = 0.1
#: The longest wait between two tries.
BACKOFF_MAX = 5.0
#: Seconds a restarted replica must stay up for its tries to be counted from 0 again.
STABLE = 60.0
#: Seconds between two looks at the processes (an exit is restarted this late at most).
_LOOK = 0.05


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
                 stable: float = STABLE) -> None:
        self.replicas = replicas
        self._start = start
        self._keep_going = keep_going
        self.tries, self.backoff, self.backoff_max, self.stable = tries, backoff, backoff_max, \
            stable
        self.restarts = [0] * len(replicas)  #: restarts done, per replica
        self.given_up: set[int] = set()
        self._failures = [0] * len(replicas)  # exits in a row
        self._started_at = [time.monotonic()] * len(replicas)
        self._due: dict[int, float] = {}  # replica -> when to restart it
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

    def _run(self) -> None:
        while not self._stop.wait(_LOOK):
            if not self._keep_going():
                return
            now = time.monotonic()
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

    def _restart(self, i: int) -> None:
        if self._stop.is_set() or not self._keep_going():
            return
        try:
            new = self._start(i, self.restarts[i] + 1)
        except Exception as exc:  # a failed start is a failed try
            log.warning("replica%d could not be restarted: %s", i, exc)
            self._exited(i, [], [-1], time.monotonic())
            return
        self.restarts[i] += 1
        self._started_at[i] = time.monotonic()
        self.replicas[i][:] = new
        log.warning("replica%d restarted (pid %s, restart %d)", i,
                    ", ".join(str(p.pid) for p in new), self.restarts[i])
