"""The scheduler an engine started: an embedded thread, or processes; whether it still
serves; its stop.

:class:`~scheduler.AsyncEngine` is a client: it sends requests and reads
outputs over channels, and fails what waits once :attr:`StartedScheduler.gone`
says why nothing will answer. What serves those channels, and how it is
started, looked at and stopped, is this module's (as vLLM keeps its engine
core's processes apart from its ``EngineCoreClient``).
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.process import BaseProcess

from bus import Ring, RpcClient, sweep_shm
from messages import Output, Request
from scheduler.core.admission import Limits
from scheduler.dp import Policy
from scheduler.launch.processes import (
    SchedulerProcesses,
    exit_text,
    load_failure,
    start_processes,
)
from scheduler.launch.tp import check_tp_room
from scheduler.launch.wiring import Endpoints, serve_ring
from scheduler.models.loading import ModelLoadError, ModelSpec
from scheduler.models.protocol import Model

__all__ = ["StartedScheduler", "checked_layout"]

log = logging.getLogger("scheduler.engine")

#: The shutdown rpc's least wait, so that it is sent even by a stop with no time left.
_SEND_AT_LEAST = 0.1
#: Seconds a data-parallel replica gets to exit after its dispatcher did.
_REPLICA_GRACE = 2.0


def checked_layout(mode: str, max_batch: int, tp_size: int, dp_size: int,
                   pd: tuple[int, int] | None) -> int:
    """Refuse a layout the mode cannot start (``ValueError``, naming the argument) before
    anything is started; returns the data-parallel replicas (``P + D`` with ``pd``)."""
    if mode not in ("ring", "zmq"):
        raise ValueError(f"mode must be 'ring' or 'zmq', not {mode!r}")
    if pd is not None:  # prefill and decode apart: P + D replicas behind a dispatcher
        if not (isinstance(pd, tuple) and len(pd) == 2
                and all(type(n) is int and n >= 1 for n in pd)):
            raise ValueError(f"pd must be a pair of ints (P, D), each at least 1, not {pd!r}")
        if dp_size not in (1, sum(pd)):
            raise ValueError(f"pd={pd!r} makes {sum(pd)} replicas: dp_size={dp_size} "
                             f"says otherwise (leave it out)")
        if mode != "zmq":
            raise ValueError(f"pd={pd!r} needs mode='zmq' (each replica is a process)")
        dp_size = sum(pd)
    if max_batch < 1:  # here, not in a scheduler process that would die at start
        raise ValueError(f"max_batch must be at least 1, not {max_batch}")
    for name, size, each in (("tp_size", tp_size, "rank"), ("dp_size", dp_size, "replica")):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, not {size}")
        if size > 1 and mode != "zmq":
            raise ValueError(f"{name} > 1 needs mode='zmq' (each {each} is a process)")
    if tp_size > 1:
        check_tp_room()  # a clear error now, rather than a rank that fails to start
    return dp_size


class StartedScheduler:
    """One engine's scheduler: a thread of this process (:meth:`embedded`, ring mode) or
    processes reached over ipc endpoints (:meth:`forked`, zmq mode)."""

    #: Why the scheduler no longer serves (a process exited, the thread stopped, every
    #: replica was given up on), once :meth:`alive` saw it; None while it serves.
    gone: str | None
    #: Why a scheduler process did not start, as it told (what a start raises).
    load_error: ModelLoadError | None

    def __init__(self, thread: threading.Thread | None = None,
                 processes: SchedulerProcesses | None = None) -> None:
        self.gone = None
        self.load_error = None
        self.thread = thread
        self.processes = processes or SchedulerProcesses()

    @classmethod
    def embedded(cls, ingress: Ring[Request], egress: Ring[Output], rpc: str, model: Model,
                 *, max_batch: int, limits: Limits, metrics: bool) -> StartedScheduler:
        """Serve the rings on a daemon thread of this process (requests are validated
        at submit: the ring does not check them again)."""
        started = cls()

        def run() -> None:
            try:
                serve_ring(ingress, egress, rpc, model, max_batch=max_batch, limits=limits,
                           validate=False, metrics=metrics)
            except BaseException as exc:  # told to the engine as why it is gone
                started.gone = f"the embedded scheduler crashed: {exc!r}"
                log.exception("embedded scheduler crashed")

        started.thread = threading.Thread(target=run, name="scheduler", daemon=True)
        started.thread.start()
        return started

    @classmethod
    def forked(cls, endpoints: Endpoints, directory: str, model: ModelSpec, *,
               max_batch: int, tp_size: int, dp_size: int, limits: Limits, metrics: bool,
               dp_policy: Policy, pd: tuple[int, int] | None) -> StartedScheduler:
        """Start the scheduler's processes, forked from the fork server
        (:func:`~scheduler.launch.processes.start_processes`), on ``endpoints``, their
        files in ``directory``."""
        return cls(processes=start_processes(
            endpoints, directory, model, max_batch=max_batch, tp_size=tp_size,
            dp_size=dp_size, limits=limits, metrics=metrics, dp_policy=dp_policy, pd=pd))

    @property
    def essential(self) -> list[BaseProcess]:
        """The processes whose death ends the engine (the dispatcher, or the scheduler's
        ranks): a data-parallel replica's is the dispatcher's to handle."""
        return self.processes.essential

    @property
    def replica_pids(self) -> list[tuple[int, ...]]:
        """The process ids of each data-parallel replica (every tp rank)."""
        return [tuple(p.pid for p in ranks if p.pid is not None)
                for ranks in self.processes.replicas]

    def alive(self, closing: bool = False) -> bool:
        """Whether it still serves, checked now (a pidfd poll per process, no rpc); the
        first time it does not, :attr:`gone` says why, logged once (not while the
        engine is ``closing``, nor for a process that did not start: the engine's
        start raises that)."""
        supervisor = self.processes.supervisor
        if supervisor is not None and supervisor.none_left is not None:
            if self.gone is None:  # every replica given up on: nothing serves
                self.gone = supervisor.none_left
                self.load_error = supervisor.load_error  # (what a start then raises)
                if self.load_error is None:  # (else the supervisor said it, once)
                    log.error("%s: requests in flight fail, new ones are refused", self.gone)
            return False
        dead = next((p for p in self.essential if not p.is_alive()), None)
        if dead is not None:
            if self.gone is None:
                self.load_error = load_failure(dead)
                if self.load_error is not None:
                    self.gone = (f"scheduler process {dead.name} did not start: "
                                 f"{self.load_error}")
                    return False
                self.gone = f"scheduler process {dead.name} exited ({exit_text(dead)})"
                # Exit code 0: it was told to stop, as by an operator's rpc shutdown.
                if not closing:
                    log.log(logging.WARNING if dead.exitcode == 0 else logging.ERROR,
                            "%s: requests in flight fail, new ones are refused", self.gone)
            return False
        if self.thread is not None and not self.thread.is_alive():
            self.gone = self.gone or "the embedded scheduler thread stopped"
            return False
        return True

    def stop(self, rpc: RpcClient, timeout: float) -> None:
        """Shut the scheduler down over ``rpc`` and wait for it to stop (blocks), the
        shutdown rpc and the exits within one deadline ``timeout`` seconds away.

        A scheduler process still running at the deadline (hung, stopped) is
        killed, else it would hold a frontend's exit past its close timeout. An
        embedded scheduler is a thread, which cannot be: it gets the step it is
        in (its rings must outlive it: released under a running thread, they
        abort the process at exit). Its last answers are still read meanwhile
        by whoever reads the outputs.
        """
        deadline = time.monotonic() + timeout
        supervisor = self.processes.supervisor
        if supervisor is not None:  # restart nothing that is being shut down
            supervisor.stop()
        if self.alive(closing=True):
            try:  # sent whatever the timeout (a call with none left sends nothing)
                rpc.call("shutdown", timeout=max(timeout, _SEND_AT_LEAST),
                         alive=lambda: self.alive(closing=True))
            except Exception as exc:  # still tear down
                log.warning("shutdown rpc failed: %s", exc)
        if self.thread is not None:
            self.thread.join(max(0.1, deadline - time.monotonic()))
            if self.thread.is_alive():
                log.warning("the embedded scheduler is still in a step at the close's "
                            "deadline: waiting for it to end")
                self.thread.join()
        self._end_processes(deadline)

    def _end_processes(self, deadline: float) -> None:
        """Join every process by ``deadline``, killing those still running then (at once,
        all of them, when one is gone: the others may wait on it for ever), and
        release them."""
        kill_now = self.gone is not None
        killed = False
        for proc in self.processes.all():
            if kill_now:
                proc.kill()
                killed = True
            # A replica the dispatcher could not shut down (lost, stopped) gets a short
            # grace once the dispatcher is gone, not what is left of the deadline.
            left = deadline - time.monotonic()
            proc.join(max(0.1, left if proc in self.essential else min(left, _REPLICA_GRACE)))
            if proc.is_alive():
                proc.kill()
                proc.join()
                killed = True
        if killed:  # a killed process left its shared-memory segments: unlink them now
            sweep_shm()
        for proc in self.processes.all():  # their pipes (two each) now, not at GC
            if proc.exitcode is not None:  # joined (or killed and joined) just before
                proc.close()
        self.processes = SchedulerProcesses()
