"""Restarting local data-parallel replicas that die, with backoff and a bounded number of tries.

The dispatcher fails or re-runs a lost replica's requests and serves on
with the others; without a restart its capacity would stay reduced for
ever. :class:`ReplicaSupervisor` runs in the process that started the
replicas (``Engine(dp_size=N)``, ``serve --dp``), watches their processes,
and starts a replica again in place (the same ``ipc://`` endpoints) when
one exits while it is meant to be serving:

* when is decided by a :class:`RespawnPolicy`: after :data:`BACKOFF`
  seconds, doubling with each try up to :data:`BACKOFF_MAX`; at most
  :data:`TRIES` tries in a row; a replica that then serves
  :data:`STABLE` seconds (counted from when it became ready, its model
  loaded: ``ready(i, ranks)``, not from its start) has its count reset (the
  policy reads an injected clock, so all of this is tested on a fake one);
* a replica that a signal ended unlinked none of its shared memory: the
  segments of dead creators are swept as soon as it is reaped, not left in
  ``/dev/shm`` until the engine closes;
* a replica whose model does not load (``load_failure`` of one of its
  processes: the one line it reported) is not restarted: that is
  deterministic, so every replica is given up on at once, with that line as
  the reason (:attr:`ReplicaSupervisor.load_error` keeps the error);
* each exit and restart is logged (``scheduler.launch``), and a replica
  given up on is logged as an error; once every replica is given up,
  ``none_left`` is called with one line saying so (``serve --dp`` exits
  non-zero with it);
* a restart is a new process forked from the fork server, which imported
  everything already (:mod:`scheduler.launch.processes`): it costs a fork
  and a model build, not an interpreter and torch start;
* an exit is a clean stop, not restarted, only when ``shut_down(i, ranks)``
  says a ``shutdown`` reached that replica (its processes leave that
  evidence themselves): an exit code of 0 alone proves nothing (a process
  whose body merely returned exits 0 too). Nothing is restarted once
  :meth:`stop` was called or ``keep_going()`` says no (the dispatcher is
  gone: the engine is closing, or the dispatcher died);
* when ``keep_going()`` says no by itself (the dispatcher died: nothing will
  feed the replicas again, and each of their processes exits on its own
  within the launcher's bound), :meth:`upstream_gone` reaps them, SIGKILLs
  any still there ``grace`` seconds later, and sweeps the shared memory the
  dead left: no process decodes for nobody, none stays a zombie.

The new process answers the dispatcher's next probe with its pid and
rejoins under a new generation (:mod:`scheduler.dp.replica`), so outputs
of the old incarnation can never be taken for the new one's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from bus import sweep_shm
from scheduler.errors import EngineError
from scheduler.models.files import ModelLoadError

__all__ = ["BACKOFF", "BACKOFF_MAX", "STABLE", "TRIES", "NoReplicaLeft", "ReplicaSupervisor",
           "RespawnPolicy"]

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


class NoReplicaLeft(EngineError):
    """Every replica was given up on: nothing is left to serve (the message says why,
    on one line: :attr:`ReplicaSupervisor.none_left`)."""


@dataclass(slots=True)
class RespawnPolicy:
    """When replica ``i`` is started again after an exit, and when it is given up on.

    Per replica it counts the exits in a row: the ``n``-th is followed by a
    wait of ``backoff * 2 ** (n - 1)`` seconds (at most ``backoff_max``), and
    the one past ``tries`` gives the replica up. An exit that comes
    ``stable`` seconds or more after the replica became :meth:`ready` (since
    its last start) counts as the first again: one that fails before it ever
    served, however slowly, counts on. Time is read from ``clock`` only.
    """

    replicas: int
    tries: int = TRIES
    backoff: float = BACKOFF
    backoff_max: float = BACKOFF_MAX
    stable: float = STABLE
    clock: Callable[[], float] = time.monotonic
    _failures: list[int] = field(init=False)
    _ready_at: list[float | None] = field(init=False)

    def __post_init__(self) -> None:
        self._failures = [0] * self.replicas
        self._ready_at = [None] * self.replicas

    def started(self, i: int) -> None:
        """Replica ``i`` was (re)started now (it is not ready until :meth:`ready`)."""
        self._ready_at[i] = None

    def ready(self, i: int) -> None:
        """Replica ``i`` became ready now (its model loaded: it serves)."""
        if self._ready_at[i] is None:
            self._ready_at[i] = self.clock()

    def exited(self, i: int) -> float | None:
        """Replica ``i`` exited now: seconds to wait before starting it again, or
        ``None`` when it has used up its tries (give it up)."""
        ready_at = self._ready_at[i]
        if ready_at is not None and self.clock() - ready_at >= self.stable:
            self._failures[i] = 0  # it had served a while: this is a new bout
        self._failures[i] += 1
        n = self._failures[i]
        if n > self.tries:
            return None
        return float(min(self.backoff_max, self.backoff * 2 ** (n - 1)))

    def failures(self, i: int) -> int:
        """Replica ``i``'s exits in a row."""
        return self._failures[i]


class ReplicaSupervisor:
    """Restarts replica ``i`` with ``start(i, attempt)`` when its processes exit while
    it is meant to be serving.

    ``replicas[i]`` is replica ``i``'s list of processes (every tp rank); it
    is replaced *in place* by the new ones, so whoever holds the list (the
    engine's process table, ``serve --dp``'s clean-up) sees them.

    Args:
        replicas: each replica's processes.
        start: starts replica ``i`` afresh (``attempt``: its restarts so far + 1).
        keep_going: ``False`` once nothing should be restarted any more.
        policy: backoff, tries and reset (its clock is the supervisor's too).
        shut_down: whether replica ``i``'s exited processes ``ranks`` stopped
            because a ``shutdown`` reached them (the only exit not restarted).
        ready: whether replica ``i``'s processes ``ranks`` have loaded their
            model (the policy's stable time counts from then).
        load_failure: why an exited process did not load its model, if that
            is why it exited (every replica is then given up on at once).
        none_left: called once, with one line, when every replica is given up.
        exit_text: how an exited process's exit is said (``exit code N``).
        grace: seconds the replicas have to exit once ``keep_going()`` says no
            by itself (:meth:`upstream_gone`).
    """

    def __init__(self, replicas: list[list[BaseProcess]],
                 start: Callable[[int, int], list[BaseProcess]], *,
                 keep_going: Callable[[], bool] = lambda: True,
                 policy: RespawnPolicy | None = None,
                 shut_down: Callable[[int, list[BaseProcess]], bool] = lambda i, ranks: False,
                 ready: Callable[[int, list[BaseProcess]], bool] = lambda i, ranks: True,
                 load_failure: Callable[[BaseProcess], ModelLoadError | None] = (
                     lambda proc: None),
                 none_left: Callable[[str], None] | None = None,
                 grace: float = 1.0,
                 exit_text: Callable[[BaseProcess], str] = (
                     lambda proc: f"exit code {proc.exitcode}")) -> None:
        self.replicas = replicas
        #: Seconds :meth:`upstream_gone` waits for the replicas to exit by themselves.
        self.grace = grace
        self._start = start
        self._keep_going = keep_going
        self.policy = policy or RespawnPolicy(len(replicas))
        self.clock = self.policy.clock
        self.restarts = [0] * len(replicas)  #: restarts done, per replica
        self.given_up: set[int] = set()  #: replicas that used up their tries
        self.stopped: set[int] = set()  #: replicas a shutdown stopped
        self._exits: dict[int, str] = {}  # replica -> its last exit, as exit_text says it
        self._due: dict[int, float] = {}  # replica -> when to restart it
        self._shut_down = shut_down
        self._ready = ready
        self._load_failure = load_failure
        self._on_none_left = none_left
        self._exit_text = exit_text
        #: Once every replica is given up on: one line saying so (else ``None``).
        self.none_left: str | None = None
        #: The error that gave every replica up, when it was a model that does not load.
        self.load_error: ModelLoadError | None = None
        self._served = False  # some replica loaded its model once (its start is over)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-supervisor",
                                        daemon=True)

    def start(self) -> None:
        """Start watching (a daemon thread that calls :meth:`look` every 50 ms)."""
        self._thread.start()

    def stop(self) -> None:
        """Restart nothing more; returns once the watcher has stopped. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(_LOOK) and self._keep_going():
            self.look()
        if not self._stop.is_set():  # keep_going() said no: the dispatcher is gone
            self.upstream_gone()

    def upstream_gone(self) -> None:
        """The dispatcher is gone: wait up to ``grace`` seconds for every replica process
        to exit (each does by itself once its dispatcher is gone), SIGKILL the rest, reap
        them all, and unlink the shared memory of dead creators (the dispatcher's among
        them: a SIGKILLed process unlinks nothing). Restarts nothing."""
        self._due.clear()
        deadline = self.clock() + self.grace
        stragglers = []
        for i, ranks in enumerate(self.replicas):
            for p in ranks:
                p.join(max(0.0, deadline - self.clock()))
                if p.exitcode is None:
                    stragglers.append(f"replica{i} (pid {p.pid})")
                    p.kill()
                    p.join(5.0)
        if stragglers:
            log.warning("%s still ran %.1f s after the dispatcher exited: killed",
                        ", ".join(stragglers), self.grace)
        sweep_shm()

    def look(self) -> None:
        """Look at every replica's processes once, at the policy's clock's now: restart
        those due, note those that exited."""
        now = self.clock()
        if self.none_left is not None:
            return  # nothing is restarted
        for i, ranks in enumerate(self.replicas):
            if i in self.given_up or i in self.stopped:
                continue
            if i in self._due:
                if now >= self._due[i]:
                    del self._due[i]
                    self._restart(i)
                continue
            codes = [p.exitcode for p in ranks]
            if all(c is None for c in codes):
                if self._ready(i, ranks):
                    self.policy.ready(i)
                    self._served = True
                continue
            if all(c == 0 for c in codes) and self._shut_down(i, ranks):
                self.stopped.add(i)  # a shutdown reached it: nothing to restart
                log.info("replica%d stopped (shutdown)", i)
                continue
            self._exited(i, ranks, self._exit_text(next(p for p in ranks
                                                        if p.exitcode is not None)))

    def _exited(self, i: int, ranks: list[BaseProcess], how: str) -> None:
        """Replica ``i`` (its processes ``ranks``) exited, ``how`` (``exit code N``), or its
        restart failed (``ranks`` empty, ``how`` says so: ``could not be restarted (...)``)."""
        for p in ranks:  # a rank left alone would wait for its dead peer for ever
            if p.exitcode is None:
                p.kill()
            p.join(5.0)
        if any(p.exitcode is not None and p.exitcode < 0 for p in ranks):
            sweep_shm()  # a process a signal ended unlinked nothing: its segments go now
        self._exits[i] = how
        what = f"exited ({how})" if ranks else how  # (as logged: "replica0 " + what)
        failure = next((f for f in map(self._load_failure, ranks) if f is not None), None)
        if failure is not None:
            self._give_up_all(i, failure)
            return
        delay = self.policy.exited(i)
        if delay is None:
            self.given_up.add(i)
            serving = self._serving()
            log.error("replica%d %s after %d restarts in a row: not "
                      "restarting it again%s", i, what, self.policy.tries,
                      "; the others serve on" if serving else "")
            if not serving:
                self.none_left = self._none_left_line()
                if self._on_none_left is not None:
                    self._on_none_left(self.none_left)
            return
        self._due[i] = self.clock() + delay
        log.warning("replica%d %s: restarting it in %.2f s (try %d of %d)",
                    i, what, delay, self.policy.failures(i), self.policy.tries)

    def _give_up_all(self, i: int, failure: ModelLoadError) -> None:
        """Replica ``i`` did not load its model: no replica will (the same model, the
        same code), so every one is given up on now, with that as the reason."""
        self.load_error = failure
        self.given_up.update(range(len(self.replicas)))
        self._due.clear()
        # Before any replica served, whoever started them reports this error as the
        # start's own one line (serve's exit, the engine's ModelLoadError): a log line
        # here would be a second. After, it is the only record of a failed restart.
        log.log(logging.ERROR if self._served else logging.DEBUG,
                "replica%d did not load its model: %s: restarting no replica", i, failure)
        self.none_left = f"no replica can serve: {failure}"
        if self._on_none_left is not None:
            self._on_none_left(self.none_left)

    def _serving(self) -> bool:
        """Whether a replica may still serve (one not given up on)."""
        return len(self.given_up) < len(self.replicas)

    def _none_left_line(self) -> str:
        """One line: no replica can serve, and each one's last exit code."""
        codes = ", ".join(f"replica{i} {self._exits.get(i, 'never seen exiting')}"
                          for i in range(len(self.replicas)))
        return (f"no replica can serve: each exited {self.policy.tries + 1} times in a row "
                f"({codes}; the log above has their errors)")

    def _restart(self, i: int) -> None:
        """Start replica ``i`` again."""
        if self._stop.is_set() or not self._keep_going():
            return
        try:
            new = self._start(i, self.restarts[i] + 1)
        except Exception as exc:  # a failed start is a failed try
            self._exited(i, [], f"could not be restarted ({type(exc).__name__}: {exc})")
            return
        self.restarts[i] += 1
        self.policy.started(i)
        self.replicas[i][:] = new
        log.warning("replica%d restarted (pid %s, restart %d)", i,
                    ", ".join(str(p.pid) for p in new), self.restarts[i])
