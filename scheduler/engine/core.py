"""``SchedulerClient``: the wiring under the engine client, and what each request needs of it.

Wiring a mode (the embedded scheduler thread, or the scheduler processes and
their ipc endpoints), rid allocation, validation at submit, sending on the
work channel, liveness, and stopping. :class:`~scheduler.AsyncEngine` is
the client built on it (its event loop sends, reads outputs and rpc
replies, and holds each request's state).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Literal, TypeVar

import numpy.typing as npt

from bus import (
    ChannelClosed,
    PeerGone,
    PullInbox,
    PushOutbox,
    Receiver,
    Ring,
    RingInbox,
    RpcClient,
    SocketOptions,
    sweep_shm,
)
from bus.channels import Inbox
from messages import (
    Codec,
    DecodeError,
    Output,
    Request,
    SamplingParams,
    TokenIds,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from messages.channels import OUT, WORK
from scheduler.core.admission import Limits
from scheduler.dp import Policy
from scheduler.engine.handles import RequestState
from scheduler.engine.stopping import SEND_AT_LEAST, stop_processes, stop_thread
from scheduler.errors import (
    EngineClosed,
    EngineError,
    EngineForked,
    InvalidRequest,
    SchedulerGone,
)
from scheduler.launch.leftovers import make_run_dir, remove_run_dir
from scheduler.launch.processes import SchedulerProcesses, load_failure, start_processes
from scheduler.launch.tp import check_tp_room
from scheduler.launch.wiring import Endpoints, serve_ring
from scheduler.models.loading import (
    HFModelSpec,
    ModelArg,
    ModelLoadError,
    ModelSpec,
    check_model_loads,
    load_model,
    model_spec,
)
from scheduler.models.protocol import Model

__all__ = ["SEND_TIMEOUT", "SchedulerClient"]

R = TypeVar("R", bound=Request)

log = logging.getLogger("scheduler.engine")

#: Seconds a submit waits for room on a full work channel before ``Overloaded``.
SEND_TIMEOUT = SocketOptions().send_timeout_ms / 1000

#: This process's id, updated in a child that ``os.fork`` makes: the fork check every
#: call passes (``_check_process``, three a request) reads it instead of asking the
#: kernel (``os.getpid`` is a system call each time).
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class SchedulerClient:
    """The client side of a scheduler it starts in one of two modes (not the scheduler's
    loop, which is :class:`~scheduler.Scheduler`); see :class:`~scheduler.AsyncEngine`
    for the arguments. It reads no outputs itself: the ``AsyncEngine`` does, on its loop.
    """

    #: ``"ring"`` (scheduler embedded in this process) or ``"zmq"`` (in its own).
    mode: Literal["ring", "zmq"]
    #: The model the scheduler serves (as given, resolved).
    model: ModelSpec
    #: Tensor-parallel ranks per replica, and data-parallel replicas.
    tp_size: int
    dp_size: int
    #: The scheduler's admission and backlog bounds.
    limits: Limits
    #: The scheduler's endpoints (in a private run directory).
    endpoints: Endpoints

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelArg = None,
                 *, max_batch: int = 64, tp_size: int = 1, dp_size: int = 1,
                 dp_policy: Policy = "least_loaded", limits: Limits | None = None,
                 metrics: bool = True, pd: tuple[int, int] | None = None) -> None:
        if mode not in ("ring", "zmq"):
            raise ValueError(f"mode must be 'ring' or 'zmq', not {mode!r}")
        if pd is not None:  # prefill and decode apart: P + D replicas behind a dispatcher
            if not (isinstance(pd, tuple) and len(pd) == 2
                    and all(type(n) is int and n >= 1 for n in pd)):
                raise ValueError(f"pd must be a pair of ints (P, D), each at least 1, "
                                 f"not {pd!r}")
            if dp_size not in (1, sum(pd)):
                raise ValueError(f"pd={pd!r} makes {sum(pd)} replicas: dp_size={dp_size} "
                                 f"says otherwise (leave it out)")
            if mode != "zmq":
                raise ValueError(f"pd={pd!r} needs mode='zmq' (each replica is a process)")
            dp_size = sum(pd)
        if max_batch < 1:  # here, not in a scheduler process that would die at start
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        for name, size in (("tp_size", tp_size), ("dp_size", dp_size)):
            if size < 1:
                raise ValueError(f"{name} must be at least 1, not {size}")
        if tp_size > 1 and mode != "zmq":
            raise ValueError("tp_size > 1 needs mode='zmq' (each rank is a process)")
        if tp_size > 1:
            check_tp_room()  # a clear error now, rather than a rank that fails to start
        if dp_size > 1 and mode != "zmq":
            raise ValueError("dp_size > 1 needs mode='zmq' (each replica is a process)")
        self.model = model_spec(model)
        if mode == "zmq":  # that it would load, before a process starts that could not
            check_model_loads(self.model)
        if tp_size > 1 and isinstance(self.model, HFModelSpec):
            raise ValueError(f"tp_size={tp_size}: a Hugging Face model runs on one rank "
                             f"(use dp_size for more replicas)")
        # Ring mode loads here, so a failure raises at once (and before any resource).
        self._loaded: Model | None = load_model(self.model) if mode == "ring" else None
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.mode = mode
        self.limits = limits or Limits()
        self._metrics = metrics
        self._codec: Codec[Request] = WORK.inbound_codec()  # what the work channel carries
        self._dir = make_run_dir("engine")  # named for us: swept if we are killed
        # Removed by this one finalizer: at close, when a constructor that failed
        # leaves the engine to the collector, or at exit for an engine never closed.
        self._remove_dir = weakref.finalize(self, remove_run_dir, self._dir)
        self.endpoints = Endpoints.in_dir(self._dir)
        self._requests: dict[str, RequestState] = {}  # rid -> its state, on the loop
        self._owner = os.getpid()  # a forked child may not use it (_check_process)
        # Unique per engine (random prefix) and cheap per request (a counter).
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._rid_seq = itertools.count()
        self._closed = False
        self._gone: str | None = None
        self._load_error: ModelLoadError | None = None  # why a scheduler process did not start
        self._thread: threading.Thread | None = None
        self._procs: list[BaseProcess] = []  # those whose death ends the engine
        self._started = SchedulerProcesses()
        self._ingress: Ring[Request] | None = None
        self._egress: Ring[Output] | None = None
        self._work_out: PushOutbox[Request] | None = None
        out_inbox: Inbox[Output]
        if mode == "ring":
            self._ingress = Ring(1 << 16, name="work")
            self._egress = Ring(1 << 16, name="out")
            ingress, egress = self._ingress, self._egress
            self._thread = threading.Thread(
                target=self._run_embedded, args=(ingress, egress, max_batch),
                name="scheduler", daemon=True)
            self._thread.start()
            out_inbox = RingInbox(egress, name="out")
        else:
            out_inbox = PullInbox(OUT.outbound_codec(), self.endpoints.out, name="out")
            self._work_out = PushOutbox(WORK.inbound_codec(), self.endpoints.work, name="work")
            self._started = start_processes(self.endpoints, self._dir, self.model,
                                            max_batch=max_batch, tp_size=tp_size,
                                            dp_size=dp_size, limits=self.limits,
                                            metrics=metrics, dp_policy=dp_policy, pd=pd)
            self._procs = self._started.essential
        self._out_inbox = out_inbox
        self._rpc = RpcClient(self.endpoints.rpc, name="rpc")
        self._outputs: Receiver[Output] = Receiver([out_inbox], budget=1024)

    @property
    def pending(self) -> int:
        """Requests sent and not yet answered (their handles wait)."""
        return len(self._requests)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has begun."""
        return self._closed

    @property
    def gone(self) -> str | None:
        """Why the scheduler is gone (a process exited, the embedded thread stopped, the
        engine closed), or None while it runs: what ``SchedulerGone`` would say.

        Checked when asked (a ``waitpid`` per process, no rpc), from any thread:
        for whoever forwards to the scheduler on its own (the frontend's rpc
        door) and must fail fast rather than wait out a timeout.
        """
        self._check_process()
        if self._closed:
            return self._gone or "the engine is closed"
        self._alive()
        return self._gone

    def _rpc_error(self, method: str, exc: PeerGone | ChannelClosed) -> EngineError:
        """The engine's error for an rpc the bus failed: the scheduler is gone
        (``PeerGone``; its own ``ModelLoadError`` when it told us over its report
        pipe that its model did not load), or the engine closed its rpc client
        (``ChannelClosed``)."""
        if isinstance(exc, PeerGone) and self._load_error is not None:
            return self._load_error
        if isinstance(exc, PeerGone):
            return SchedulerGone(f"rpc {method!r}: {self._gone or exc}")
        return EngineClosed(f"rpc {method!r}: the engine closed before the reply")

    def _stop_scheduler(self, timeout: float) -> None:
        """Shut the scheduler down and wait for it to stop, within ``timeout`` (from
        :func:`~scheduler.engine.stopping.close_timeout`): blocks. Its last answers
        are still read meanwhile by whoever reads the outputs."""
        deadline = time.monotonic() + timeout  # one for all of it (scheduler.engine.stopping)
        supervisor = self._started.supervisor
        if supervisor is not None:  # restart nothing that is being shut down
            supervisor.stop()
        if self._alive():
            try:  # sent whatever the timeout (a call with none left sends nothing)
                self._rpc.call("shutdown", timeout=max(timeout, SEND_AT_LEAST),
                               alive=self._alive)
            except Exception as exc:  # still tear down
                log.warning("shutdown rpc failed: %s", exc)
        if self._thread is not None:
            stop_thread(self._thread, deadline)
        killed = stop_processes(self._started.all(), set(self._procs), deadline,
                                kill_now=self._gone is not None)
        if killed:  # a killed process left its shared-memory segments: unlink them now
            sweep_shm()
        for proc in self._started.all():  # their pipes (two each) now, not at GC
            if proc.exitcode is not None:  # joined (or killed and joined) just before
                proc.close()
        self._started = SchedulerProcesses()
        self._procs = []

    def _release(self) -> None:
        """Close the channels and remove the run directory (once the outputs are read)."""
        self._rpc.close()
        self._out_inbox.close()
        if self._work_out is not None:
            self._work_out.close()
        for ring in (self._ingress, self._egress):
            if ring is not None:
                ring.release()
        self._remove_dir()

    # -- internals --------------------------------------------------------------

    def _new_rid(self) -> str:
        return f"{self._rid_prefix}-{next(self._rid_seq)}"

    def _run_embedded(self, ingress: Ring[Request], egress: Ring[Output], max_batch: int
                      ) -> None:
        try:
            # Requests are validated at submit (_validated), so the ring need
            # not check them again.
            assert self._loaded is not None
            serve_ring(ingress, egress, self.endpoints.rpc, self._loaded, max_batch=max_batch,
                       limits=self.limits, validate=False, metrics=self._metrics)
        except BaseException as exc:
            self._gone = f"the embedded scheduler crashed: {exc!r}"
            log.exception("embedded scheduler crashed")

    def _alive(self) -> bool:
        supervisor = self._started.supervisor
        if supervisor is not None and supervisor.none_left is not None:
            if self._gone is None:  # every replica given up on: nothing serves
                self._gone = supervisor.none_left
                self._load_error = supervisor.load_error  # (what a start then raises)
                if self._load_error is None:  # (else the supervisor said it, once)
                    log.error("%s: requests in flight fail, new ones are refused", self._gone)
            return False
        dead = next((p for p in self._procs if not p.is_alive()), None)
        if dead is not None:
            if self._gone is None:
                self._load_error = load_failure(dead)
                if self._load_error is not None:  # raised by the start: no log line
                    self._gone = (f"scheduler process {dead.name} did not start: "
                                  f"{self._load_error}")
                    return False
                self._gone = f"scheduler process {dead.name} exited (exit code {dead.exitcode})"
                # Said once, and not at this engine's own close. Exit code 0: it was
                # told to stop, as by an operator's rpc shutdown.
                if not self.closed:
                    log.log(logging.WARNING if dead.exitcode == 0 else logging.ERROR,
                            "%s: requests in flight fail, new ones are refused", self._gone)
            return False
        if self._thread is not None and not self._thread.is_alive():
            self._gone = self._gone or "the embedded scheduler thread stopped"
            return False
        return True

    def _validated(self, req: R) -> R:
        """``req`` as a decoder would hand it over (both modes), or InvalidRequest.

        The result is what the embedded scheduler receives: its token ids are
        its own bytes, not a view of the caller's buffer, which the caller
        may reuse as soon as submit returns.
        """
        try:
            checked = self._codec.validate(req)
        except DecodeError as exc:
            raise InvalidRequest(req.rid, exc.reason) from exc
        assert type(checked) is type(req)
        return checked

    def _generate_req(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None,
                      stream: bool, return_logprob: bool, rid: str | None,
                      dp_rank: int | None) -> TokenizedGenerateReqInput:
        self._check_process()
        rid = rid if rid is not None else self._new_rid()
        return TokenizedGenerateReqInput(
            rid=rid, input_ids=_packed(rid, input_ids),
            sampling=sampling or SamplingParams(), stream=stream, return_logprob=return_logprob,
            dp_rank=self._check_dp_rank(rid, dp_rank))

    def _embed_req(self, input_ids: npt.ArrayLike, rid: str | None, dp_rank: int | None
                   ) -> TokenizedEmbeddingReqInput:
        self._check_process()
        rid = rid if rid is not None else self._new_rid()
        return TokenizedEmbeddingReqInput(rid=rid, input_ids=_packed(rid, input_ids),
                                          dp_rank=self._check_dp_rank(rid, dp_rank))

    def _check_dp_rank(self, rid: str, dp_rank: int | None) -> int | None:
        if dp_rank is not None and not 0 <= dp_rank < self.dp_size:
            raise InvalidRequest(rid, f"dp_rank={dp_rank} is out of range: this engine has "
                                      f"{self.dp_size} replica(s)")
        return dp_rank

    @property
    def replica_pids(self) -> list[tuple[int, ...]]:
        """The process ids of each data-parallel replica (every tp rank), when
        ``dp_size > 1``: what a test or an operator kills to see a replica lost."""
        return [tuple(p.pid for p in ranks if p.pid is not None)
                for ranks in self._started.replicas]

    def _check_process(self) -> None:
        """Refuse a call from a child made by ``os.fork`` (:class:`EngineForked`).

        Every public call of both faces passes here first, before it takes a
        lock, makes a rid or touches a channel: the engine's threads are not
        in the child (a call would wait for an answer nobody reads), a lock
        another thread held at the fork stays held there, and its sockets,
        rings and rid counter are the parent's (a request sent from the child
        would take a rid the parent is about to use).
        """
        if _pid != self._owner:
            raise EngineForked(self._owner, _pid)

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise EngineClosed("the engine is closed")
        if self._gone is not None:
            raise SchedulerGone(self._gone)

    def _send_nowait(self, reqs: Sequence[Request]) -> int:
        """Send what of ``reqs`` the work channel takes now, in order (over zmq as
        bursts, on the ring in one put); returns how many. Never blocks.

        Raises:
            EngineClosed: the channel is closed.
            EncodeError: ``reqs[0]`` cannot be encoded (nothing was sent).
        """
        try:
            if self._ingress is not None:
                return self._ingress.put_many_nowait(reqs)
            assert self._work_out is not None
            return self._work_out.send_many_nowait(reqs)
        except ChannelClosed as exc:
            raise EngineClosed("the engine is closed") from exc


def _packed(rid: str, input_ids: npt.ArrayLike) -> TokenIds:
    """``input_ids`` packed for the wire, or ``InvalidRequest`` naming why not (too many,
    negative, not integers): a caller's bad prompt, like any other field's."""
    try:
        return token_ids(input_ids, field="input_ids")
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidRequest(rid, str(exc)) from exc
