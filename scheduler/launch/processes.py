"""Starting the scheduler processes of ``zmq`` mode: one scheduler, or N replicas
behind a dispatcher, each of ``tp_size`` ranks.

The frontend always talks to one set of endpoints: the scheduler's, or the
dispatcher's, which looks the same. Only the *essential* processes (those
the frontend's channels reach) decide whether the engine is alive: a lost
replica is the dispatcher's business, which fails or re-runs its requests
and goes on with the others, and a local replica that dies is restarted
in place (:mod:`scheduler.launch.respawn`).

Each process is forked from multiprocessing's fork server, which imported
what they run once (:func:`_context`): a start costs a fork, about 10 ms,
where a spawned interpreter took 1.5-2 s of a core to import torch. A
process so started is the fork server's child, not its starter's: it
watches its starter by pid and start time (:func:`_watch_parent`), and is
given its starter's environment as it is when the process starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.reduction
import multiprocessing.spawn
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from bus.fdwait import wait_readable
from bus.shm.segment import pid_alive, start_time
from scheduler.core.admission import Limits
from scheduler.dp import Policy, ReplicaSpec, serve_dispatch
from scheduler.launch.leftovers import leave_files
from scheduler.launch.respawn import ReplicaSupervisor
from scheduler.launch.tp import TPConfig
from scheduler.launch.wiring import Endpoints, serve_follower, serve_zmq
from scheduler.models.loading import ModelLoadError, ModelSpec

__all__ = ["SchedulerProcesses", "exit_text", "load_failure", "start_processes",
           "start_replicas", "supervise"]

log = logging.getLogger("scheduler.launch")

#: A local replica's death is seen at once through its pids; silence means a
#: hang (or a stopped process), and a busy 2-core machine can starve a
#: healthy one for a second or so.
LOCAL_HEARTBEAT_TIMEOUT = 3.0

#: Seconds within which a local replica stops once its dispatcher (its *upstream*:
#: the one process that sends it work and reads its answers) exited. Each of its
#: processes parks a thread on the dispatcher's pidfd (:func:`_watch_upstream`) and
#: exits as an orphan does, in tens of milliseconds; the supervisor reaps them and
#: SIGKILLs whichever is still there this long after it saw the dispatcher gone
#: (:meth:`~scheduler.launch.respawn.ReplicaSupervisor.upstream_gone`): a replica
#: stuck in a long step, or starved on a busy host, still stops within the bound.
UPSTREAM_BOUND = 1.0


@dataclass(slots=True)
class SchedulerProcesses:
    """What :func:`start_processes` started."""

    essential: list[BaseProcess] = field(default_factory=list)
    replicas: list[list[BaseProcess]] = field(default_factory=list)
    #: Restarts the replicas that die (data parallel only).
    supervisor: ReplicaSupervisor | None = None

    def all(self) -> list[BaseProcess]:
        """Every process, essential first."""
        return [*self.essential, *(p for ranks in self.replicas for p in ranks)]


def _orphaned() -> None:
    """The parent died: remove what it and we made (no finalizer runs), then exit."""
    leave_files()
    os._exit(1)


def _when_gone(pid: int, started: int, then: Callable[[], None], name: str) -> None:
    """Call ``then`` in a daemon thread ``name`` as soon as process ``pid``, which started
    at ``started`` (:func:`~bus.shm.segment.start_time`), exits (at once, here, when
    it is gone already).

    A pidfd becomes readable when the process exits, whoever its parent is
    and whoever reaps it (unlike ``PR_SET_PDEATHSIG``, which fires when the
    *thread* that started the child ends); a thread parked on it costs
    nothing until then. Where there is no pidfd, the process is looked at
    twice a second instead. It is also looked at once the pidfd is open: a
    pid names whichever process has it now, and the one watched may have
    exited and its pid been given to another (of another start time) before
    the pidfd was made.
    """
    def alive() -> bool:
        return pid_alive(pid) and start_time(pid) == started

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        then()
        return
    except OSError:  # no pidfd here (an old kernel, a seccomp filter): look twice a second
        def poll() -> None:
            while alive():
                time.sleep(0.5)  # a liveness poll: there is no fd to park on
            then()

        threading.Thread(target=poll, name=name, daemon=True).start()
        return

    if not alive():  # ``pid`` is another process's already: ours exited, its pid reused
        os.close(fd)
        then()
        return

    def wait() -> None:
        wait_readable([fd], None)
        then()

    threading.Thread(target=wait, name=name, daemon=True).start()


def _watch_parent(parent: int, started: int) -> None:
    """Exit as soon as ``parent`` (the process that started this one, which started at
    ``started``: :func:`~bus.shm.segment.start_time`) does, removing the files both of
    them made.

    A parent that is SIGKILLed runs no clean-up, and its children would go on
    serving endpoints nobody owns, and leave its run directory and their
    shared memory behind (:mod:`scheduler.launch.leftovers`). (It is not this
    process's parent in the kernel's sense, which is the fork server.)
    """
    _when_gone(parent, started, _orphaned, "parent-watch")


def _watch_upstream(upstream: Connection) -> None:
    """Exit as soon as the process that feeds this one exits (a replica's dispatcher).

    The dispatcher is the replicas' sibling, not their parent, and it starts
    after them (it watches their pids), so its pid comes later, on
    ``upstream``, from whoever started both; a pipe closed without one means
    the parent is the upstream (``serve --dp`` dispatches in-process), and
    :func:`_watch_parent` covers it. Once the dispatcher is gone nothing reads
    this process's answers and nothing can send it work again (its endpoints
    are private to the run), so decoding on would be for nobody: it exits as
    an orphan does, its own shared memory unlinked and the dead dispatcher's
    swept, its slots and cache with the process. The supervisor restarts
    nothing then (the dispatcher is what its ``keep_going`` asks about) and
    reaps it (:meth:`~scheduler.launch.respawn.ReplicaSupervisor.upstream_gone`).
    """
    def wait_for_pid() -> None:
        try:
            pid, started = map(int, upstream.recv_bytes().split())
        except (EOFError, OSError, ValueError):
            return  # no upstream apart from the parent
        finally:
            upstream.close()

        def gone() -> None:
            log.warning("%s (pid %d): its dispatcher (pid %d) exited, nothing reads its "
                        "answers: stopping", multiprocessing.current_process().name,
                        os.getpid(), pid)
            _orphaned()

        _when_gone(pid, started, gone, "upstream-watch")

    threading.Thread(target=wait_for_pid, name="upstream-pid", daemon=True).start()


#: Every scheduler process this process started (see _forget_in_fork).
_STARTED: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


def _forget_in_fork() -> None:
    """In a child made by ``os.fork``: these processes are the parent's, not ours.

    multiprocessing's exit handler terminates the daemonic children it knows
    of; a forked child inherits that list, so without this its exit would
    SIGTERM the parent's schedulers.
    """
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.difference_update(_STARTED)
    # The parent's fork server is not this child's to use (its pid is no child of ours,
    # and its lock may have been held at the fork): the child starts its own when it
    # starts a process. (In a process the fork server forked, nothing is set yet.)
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive, int) and getattr(server, "_forkserver_pid", None) is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        fresh = {"_forkserver_pid": None, "_forkserver_address": None,
                 "_forkserver_alive_fd": None, "_lock": threading.Lock()}
        for name, value in fresh.items():  # (set by name: typeshed has none of them)
            setattr(server, name, value)


os.register_at_fork(after_in_child=_forget_in_fork)


def _child(parent: tuple[int, int, dict[str, str]], target: Callable[..., None],
           *args: object, _report: Connection | None = None,
           _upstream: Connection | None = None, **kwargs: object) -> None:
    """A scheduler process's body: take the ``parent``'s environment, watch the parent
    (:func:`_parent` made the three), and the upstream when ``_upstream`` will name
    it (:func:`_watch_upstream`), then run ``target``.

    A model that does not load ends the process with exit code 1 and no
    traceback: its one-line reason goes to the parent through ``_report``
    (:func:`load_failure`), which raises it (a ``ModelLoadError`` in the parent
    too), where a traceback here would bury it among the parent's lines.
    """
    # A terminal's Ctrl-C (and ``kill -INT`` to the process group) reaches every process
    # of the foreground group, this one too. The process that started this one stops it
    # (a ``shutdown``, then a kill) once its own drain is done: dying here first would
    # cut the streams that drain is for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (blocked by _start)
    pid, started, environ = parent
    # The fork server's environment is the one its starter had when it started; a
    # spawned process had the one its starter has now.
    os.environ.clear()
    os.environ.update(environ)
    _watch_parent(pid, started)
    if _upstream is not None:
        _watch_upstream(_upstream)
    try:
        target(*args, **kwargs)
    except ModelLoadError as exc:
        if _report is None:
            raise
        _report.send_bytes(json.dumps([exc.path, exc.reason]).encode())
        sys.exit(1)


#: What the fork server imports before it forks a scheduler process: all the processes
#: run (torch with it), so that each starts with it imported.
_PRELOAD = ["scheduler.launch.processes"]


class _Popen(multiprocessing.popen_forkserver.Popen):
    """A process forked by the fork server, told apart from its server.

    * Its main module is not imported first (``spawn``'s way, kept by the
      fork server's): what it runs and is given is the scheduler's, so the
      starter's script (its side effects, and the environment it reads as it
      is imported) never runs in a scheduler process.
    * Whether it runs is its pidfd's to say: multiprocessing reads that from
      the fork server, so a fork server that died (killed, say) made every
      process it forked look exited (code 255) while it ran on; it could then
      be neither killed nor told apart from a dead one. The exit code is still
      read from the fork server: where it is gone the code is lost, and
      :func:`exit_text` says so.
    """

    sentinel: int

    def _launch(self, process_obj: BaseProcess) -> None:
        # As multiprocessing.popen_forkserver.Popen._launch, the main module left out.
        self._process = weakref.ref(process_obj)
        prep_data = multiprocessing.spawn.get_preparation_data(process_obj.name)
        prep_data.pop("init_main_from_name", None)
        prep_data.pop("init_main_from_path", None)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            multiprocessing.reduction.dump(prep_data, buf)
            multiprocessing.reduction.dump(process_obj, buf)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        fds: list[int] = self._fds  # type: ignore[attr-defined]  # (its __init__'s)
        status, w = multiprocessing.forkserver.connect_to_new_process(fds)
        parent_w = os.dup(w)  # (the child's sentinel of its parent, as there)
        self.finalizer = multiprocessing.util.Finalize(self, _close_fds, (parent_w, status))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = multiprocessing.forkserver.read_signed(status)
        self._status = status
        self.sentinel = status
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:  # it exited already, or no pidfd here: the fork server says
            return
        self.sentinel = pidfd
        self._close_pidfd = multiprocessing.util.Finalize(self, os.close, (pidfd,))

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            if not wait_readable([self.sentinel], 0 if flag == os.WNOHANG else None):
                return None
            # It exited: its code comes from the fork server once it reaped it (at once).
            if not wait_readable([self._status], _STATUS_WAIT):
                return self._code_lost()
            try:
                self.returncode = multiprocessing.forkserver.read_signed(self._status)
            except (OSError, EOFError):  # the fork server is gone
                return self._code_lost()
        return self.returncode

    def _code_lost(self) -> int:
        """The exit code of a process whose fork server is gone (it alone could read it):
        255, as multiprocessing says then, noted in :data:`_CODE_LOST`."""
        self.returncode = 255
        proc = self._process()
        if proc is not None:
            _CODE_LOST.add(proc)
        return self.returncode

    def close(self) -> None:
        super().close()
        close_pidfd = getattr(self, "_close_pidfd", None)
        if close_pidfd is not None:
            close_pidfd()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _Popen:
        return _Popen(process_obj)


class _Context(multiprocessing.context.ForkServerContext):
    Process = _Process


#: Seconds an exited process's code is waited for from the fork server (it reaps at once).
_STATUS_WAIT = 5.0
#: The processes that exited after their fork server did: their exit code (255) says
#: nothing (:func:`exit_text`).
_CODE_LOST: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


def exit_text(proc: BaseProcess) -> str:
    """``proc``'s exit code as a message quotes it: ``exit code N``, or that it is unknown
    (its fork server, which alone could read it, is gone)."""
    if proc in _CODE_LOST:
        return "exit code unknown: the fork server that started it is gone"
    return f"exit code {proc.exitcode}"


def _context() -> _Context:
    """multiprocessing's fork server context, its processes :class:`_Process`, its preload
    :data:`_PRELOAD` added and ``__main__`` taken out (read when the server starts: at
    the first process started, unless another module of this process started it
    first). multiprocessing preloads ``__main__`` by default: the starting script, run
    again in the fork server (where CPython reads the key it looks for, 3.13's later
    releases and 3.14), and inherited by every scheduler process forked there."""
    ctx = _Context()
    server = multiprocessing.forkserver._forkserver
    preload = [m for m in getattr(server, "_preload_modules", []) if m != "__main__"]
    ctx.set_forkserver_preload([*preload, *(m for m in _PRELOAD if m not in preload)])
    return ctx


def _parent() -> tuple[int, int, dict[str, str]]:
    """What :func:`_child` is told of the process that starts it: its pid, its start time
    and its environment now."""
    me = os.getpid()
    return me, start_time(me), dict(os.environ)


def _start(proc: BaseProcess) -> None:
    """Start ``proc`` (its target :func:`_child`) with SIGINT blocked, as CPython starts its
    resource tracker: the blocked mask passes through fork and exec, so a Ctrl-C while
    the fork server imports (torch: seconds; it is started by the first process
    started) waits, pending, until it ignores it, and one while a process starts waits
    until :func:`_child` ignores it, instead of a ``KeyboardInterrupt`` traceback from
    each. (SIGTERM needs nothing: it ends an importing process without a word.)

    The resource tracker is started first: starting it unblocks SIGINT (CPython's
    ``ensure_running`` unblocks rather than restoring the mask it found), which would
    undo the block for ``proc``, the first process a run starts."""
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


#: The read end of each started scheduler process's report pipe (see _child).
_REPORTS: weakref.WeakKeyDictionary[BaseProcess, Connection] = weakref.WeakKeyDictionary()


def load_failure(proc: BaseProcess) -> ModelLoadError | None:
    """Why ``proc`` (a scheduler process that exited) failed to load its model, if it did."""
    report = _REPORTS.get(proc)
    try:
        if report is None or not report.poll(0):
            return None
        path, reason = json.loads(report.recv_bytes())
    except (OSError, EOFError, ValueError):
        return None
    return ModelLoadError(str(path), str(reason))


def _shutdown_mark(directory: str, pid: int | None) -> str:
    """The file a replica's rank 0 (``pid``) leaves in its directory once a ``shutdown``
    stopped it: the supervisor's evidence that its exit is no death."""
    return os.path.join(directory, f"shutdown-{pid}")


def _ready_mark(directory: str, pid: int | None) -> str:
    """The file a replica's rank 0 (``pid``) leaves in its directory once its model is
    loaded: from then on it serves (the supervisor's evidence that it became ready)."""
    return os.path.join(directory, f"ready-{pid}")


def _leave_mark(path: str) -> None:
    with contextlib.suppress(OSError), open(path, "x"):
        pass  # (no directory: whoever started us is gone or cleaning up; nobody asks)


def _serve_replica(directory: str, endpoints: Endpoints, model: ModelSpec, *,
                   max_batch: int, limits: Limits, metrics: bool,
                   tp: TPConfig | None = None) -> None:
    """A replica's rank 0: say in ``directory`` when its model is loaded, serve until a
    ``shutdown``, then say that too."""
    serve_zmq(endpoints, model, max_batch=max_batch, tp=tp, limits=limits, metrics=metrics,
              loaded=lambda: _leave_mark(_ready_mark(directory, os.getpid())))
    _leave_mark(_shutdown_mark(directory, os.getpid()))


def _start_scheduler(endpoints: Endpoints, directory: str, model: ModelSpec, *,
                     max_batch: int, tp_size: int, limits: Limits, metrics: bool,
                     name: str, attempt: int = 0, replica: bool = False) -> list[BaseProcess]:
    """A scheduler of ``tp_size`` ranks serving ``endpoints``; rank 0 first.

    ``attempt``: how many times it was restarted (each start rendezvouses its
    ranks in a file of its own: a dead incarnation's is not reused).
    ``replica``: rank 0 leaves :func:`_shutdown_mark` in ``directory`` when a
    shutdown stops it."""
    ctx = _context()
    init = f"{directory}/tp-init" + (f"-{attempt}" if attempt else "")
    tp = TPConfig(tp_size, init) if tp_size > 1 else None
    me = _parent()
    body: tuple[object, ...] = (_serve_replica, directory) if replica else (serve_zmq,)
    reports = [ctx.Pipe(duplex=False) for _ in range(tp_size)]
    # A replica's every rank is told its dispatcher's pid (_tell_upstream).
    upstreams = [ctx.Pipe(duplex=False) if replica else None for _ in range(tp_size)]
    procs: list[BaseProcess] = [ctx.Process(target=_child, args=(me, *body, endpoints, model),
                         kwargs={"max_batch": max_batch, "tp": tp, "limits": limits,
                                 "metrics": metrics, "_report": reports[0][1],
                                 "_upstream": _read_end(upstreams[0])},
                         name=name, daemon=True)]
    for rank in range(1, tp_size):
        procs.append(ctx.Process(target=_child, args=(me, serve_follower, rank, tp, model),
                                 kwargs={"max_batch": max_batch, "limits": limits,
                                         "_report": reports[rank][1],
                                         "_upstream": _read_end(upstreams[rank])},
                                 name=f"{name}-rank{rank}", daemon=True))
    for proc, (read, write), upstream in zip(procs, reports, upstreams, strict=True):
        _start(proc)
        write.close()  # the child's end: ours would keep the pipe open past its exit
        _REPORTS[proc] = read
        _STARTED.add(proc)
        if upstream is not None:
            upstream[0].close()  # the child's end, as above
            _UPSTREAMS[proc] = upstream[1]
    return procs


#: The write end of each replica process's upstream pipe, until its dispatcher's pid
#: is sent on it (:func:`_tell_upstream`).
_UPSTREAMS: weakref.WeakKeyDictionary[BaseProcess, Connection] = weakref.WeakKeyDictionary()


def _read_end(pipe: tuple[Connection, Connection] | None) -> Connection | None:
    return None if pipe is None else pipe[0]


def _tell_upstream(procs: list[BaseProcess], upstream: int | None) -> None:
    """Tell ``procs`` (replica processes) the pid of the dispatcher that feeds them
    (``None``: none apart from their parent), so they stop when it exits
    (:func:`_watch_upstream`). Each is told once; one gone already is skipped."""
    # With its start time: a pid alone may name another process by the time a replica
    # watches it (the dispatcher exited and its pid was reused).
    started = None if upstream is None else start_time(upstream)
    for proc in procs:
        pipe = _UPSTREAMS.pop(proc, None)
        if pipe is None:
            continue
        with contextlib.suppress(OSError):  # it exited: nothing to tell
            if upstream is not None:
                pipe.send_bytes(f"{upstream} {started}".encode())
        pipe.close()


def start_replicas(directory: str, n: int, model: ModelSpec, *, max_batch: int,
                   tp_size: int = 1, limits: Limits | None = None, metrics: bool = True
                   ) -> tuple[list[list[BaseProcess]], list[ReplicaSpec]]:
    """Start ``n`` local replicas, replica ``i`` on ``ipc://`` endpoints in
    ``directory/r<i>`` (made 0700); returns their processes and the specs a
    dispatcher needs (pids included, so their exit is seen at once).
    :func:`supervise` restarts them when they die."""
    procs: list[list[BaseProcess]] = []
    specs: list[ReplicaSpec] = []
    for i in range(n):
        os.mkdir(os.path.join(directory, f"r{i}"), 0o700)
        ranks = _start_replica(directory, model, max_batch, tp_size, limits, metrics, i, 0)
        procs.append(ranks)
        specs.append(ReplicaSpec(Endpoints.in_dir(os.path.join(directory, f"r{i}")),
                                 tuple(p.pid for p in ranks if p.pid is not None)))
    return procs, specs


def _start_replica(directory: str, model: ModelSpec, max_batch: int, tp_size: int,
                   limits: Limits | None, metrics: bool, i: int, attempt: int
                   ) -> list[BaseProcess]:
    sub = os.path.join(directory, f"r{i}")
    return _start_scheduler(Endpoints.in_dir(sub), sub, model, max_batch=max_batch,
                            tp_size=tp_size, limits=limits or Limits(), metrics=metrics,
                            name=f"replica{i}", attempt=attempt, replica=True)


def supervise(procs: list[list[BaseProcess]], directory: str, model: ModelSpec, *,
              max_batch: int, tp_size: int = 1, limits: Limits | None = None,
              metrics: bool = True, keep_going: Callable[[], bool] = lambda: True,
              none_left: Callable[[str], None] | None = None,
              upstream: int | None = None) -> ReplicaSupervisor:
    """Restart the replicas :func:`start_replicas` started, in place, when they die
    (see :mod:`scheduler.launch.respawn`); started already, ``stop()`` it to end.

    ``upstream``: the pid of their dispatcher when it is not this process (the
    engine's): every replica process, started or restarted, stops within
    :data:`UPSTREAM_BOUND` of its exit, and the supervisor then reaps them
    and restarts none (``keep_going`` should say the dispatcher is gone).

    Any exit of a replica's processes is a death, unless its rank 0 left the
    mark of a ``shutdown`` that stopped it. ``none_left`` is called (once, with
    one line) when every replica has been given up on: at once when one of them
    reported that its model does not load (a restart would load it no better).
    A restart is forked from the fork server: a fork and a model build."""
    def restart(i: int, attempt: int) -> list[BaseProcess]:
        ranks = _start_replica(directory, model, max_batch, tp_size, limits, metrics, i,
                               attempt)
        _tell_upstream(ranks, upstream)
        return ranks

    def shut_down(i: int, ranks: list[BaseProcess]) -> bool:
        return bool(ranks) and os.path.exists(
            _shutdown_mark(os.path.join(directory, f"r{i}"), ranks[0].pid))

    def ready(i: int, ranks: list[BaseProcess]) -> bool:
        return bool(ranks) and os.path.exists(
            _ready_mark(os.path.join(directory, f"r{i}"), ranks[0].pid))

    for ranks in procs:
        _tell_upstream(ranks, upstream)
    sup = ReplicaSupervisor(
        procs, restart, keep_going=keep_going, grace=UPSTREAM_BOUND,
        shut_down=shut_down, ready=ready, load_failure=load_failure, none_left=none_left,
        exit_text=exit_text)
    sup.start()
    return sup


def start_processes(endpoints: Endpoints, directory: str, model: ModelSpec, *,
                    max_batch: int, tp_size: int = 1, dp_size: int = 1,
                    limits: Limits | None = None, metrics: bool = True,
                    dp_policy: Policy = "least_loaded",
                    dispatch: bool | None = None,
                    pd: tuple[int, int] | None = None) -> SchedulerProcesses:
    """Start what serves ``endpoints``: a scheduler, or ``dp_size`` replicas and a dispatcher.

    Replica ``i`` serves ``ipc://`` endpoints in ``directory/r<i>`` (0700).
    ``dispatch``: put a dispatcher in front even of one replica (default:
    only when ``dp_size > 1``); what ``benchmarks/dp`` measures the hop with.
    ``pd``: prefill and decode apart over the ``dp_size`` replicas (the dispatcher's).
    """
    limits = limits or Limits()
    started = SchedulerProcesses()
    if not (dp_size > 1 if dispatch is None else dispatch):
        started.essential = _start_scheduler(endpoints, directory, model, max_batch=max_batch,
                                             tp_size=tp_size, limits=limits, metrics=metrics,
                                             name="scheduler")
        return started
    started.replicas, specs = start_replicas(directory, dp_size, model, max_batch=max_batch,
                                             tp_size=tp_size, limits=limits, metrics=metrics)
    ctx = _context()
    dispatcher = ctx.Process(target=_child, args=(_parent(), serve_dispatch, endpoints, specs),
                             kwargs={"policy": dp_policy, "max_backlog": limits.max_backlog,
                                     "pd": pd, "handoff_deadline": limits.handoff_deadline,
                                     "max_handoff_bytes": limits.max_handoff_bytes,
                                     "heartbeat_timeout": LOCAL_HEARTBEAT_TIMEOUT},
                             name="dispatcher", daemon=True)
    _start(dispatcher)
    _STARTED.add(dispatcher)
    started.essential = [dispatcher]
    started.supervisor = supervise(started.replicas, directory, model, max_batch=max_batch,
                                   tp_size=tp_size, limits=limits, metrics=metrics,
                                   keep_going=dispatcher.is_alive, upstream=dispatcher.pid)
    return started
