"""``AsyncEngine``: the engine client, on one asyncio event loop.

It starts the scheduler in one of two modes (a thread of this process, or
processes reached over ipc endpoints in a private run directory:
:class:`~scheduler.launch.started.StartedScheduler`, which also says whether
it still serves and stops it), fails what waits once it is gone, and stops
it at close. Every request takes one path.
:meth:`AsyncEngine._start` validates it, records its
:class:`~scheduler.engine.handles.RequestState` under its rid and queues
it; the requests queued in one turn of the loop leave at its end
together (over zmq as one burst: one zmq message, one msgspec call; on the
ring in one put). The loop reads outputs as they come (``loop.add_reader``
on the egress ring's eventfd, or the PULL socket's zmq FD, drained to empty
and re-checked, as its edge-triggered rules require) and hands each to its
request's state (:func:`deliver_rows`); :meth:`AsyncEngine._steps` hands a
state's outputs to its caller, which ``submit``, ``generate``, ``stream``,
``stream_steps`` and ``embed`` all wrap. Rpc replies are read on the same
loop, each handed to the call waiting on its rid, so rpc calls are in
flight together, with no thread and no lock held for one. ``Engine`` runs
this class on a private event-loop thread.

Cancellation aborts: cancelling a task awaiting a request, or leaving a
stream early (``break``, ``aclose()``, garbage collection), drops the
request's outputs and sends ``AbortReq`` for it, so the scheduler frees its
slot; one whose last answer is in already is left alone (its rid may be a
new request's by now).

Sending never blocks the loop. A work channel that is full (a scheduler not
reading) fails this turn's requests with :class:`~scheduler.Overloaded` when
awaited; an abort that finds it full waits in order and goes out as soon as
there is room (it is never dropped).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Sequence,
)
from itertools import count, pairwise, repeat
from typing import Literal, Self, TypeVar, cast

import numpy as np
import numpy.typing as npt
import zmq

from bus import (
    ChannelClosed,
    Envelope,
    LogSummary,
    PeerGone,
    PullInbox,
    PushOutbox,
    Receiver,
    Rejected,
    Ring,
    RingInbox,
    RpcClient,
    RpcTimeout,
    SocketOptions,
)
from bus.channels import Inbox
from messages import (
    SEND_BURST,
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    DecodeError,
    ErrorOut,
    Output,
    PackedU32,
    Request,
    RpcReqOutput,
    SamplingParams,
    Scalar,
    TokenIds,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from messages.channels import OUT, WORK
from scheduler.core.admission import Limits
from scheduler.core.metrics import metrics_text
from scheduler.dp import Policy
from scheduler.engine.handles import (
    GenerateResult,
    Item,
    RequestState,
    StreamChunk,
    Tops,
    ends,
    joined,
)
from scheduler.errors import (
    EngineClosed,
    EngineError,
    EngineForked,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    SchedulerGone,
)
from scheduler.handshake import HELLO_METHOD, hello_answer, hello_params
from scheduler.launch.leftovers import make_run_dir, remove_run_dir
from scheduler.launch.started import StartedScheduler, checked_layout
from scheduler.launch.wiring import Endpoints
from scheduler.models.loading import (
    HFModelSpec,
    ModelArg,
    ModelSpec,
    check_model_loads,
    load_model,
    model_spec,
)
from scheduler.models.protocol import Model

__all__ = ["EXIT_WAIT_S", "SEND_TIMEOUT", "AsyncEngine", "AsyncRequest", "close_on",
           "close_timeout", "deliver_rows"]

log = logging.getLogger("scheduler.engine")

R = TypeVar("R", bound=Request)
S = TypeVar("S", bound=RequestState)
T = TypeVar("T")

#: A generate or embedding request as a submit builds it, before it is validated.
_Tokenized = TokenizedGenerateReqInput | TokenizedEmbeddingReqInput

#: Seconds a submit waits for room on a full work channel before ``Overloaded``.
SEND_TIMEOUT = SocketOptions().send_timeout_ms / 1000
#: close(None) and close(inf): as long as it takes (11 days: a bound every join and
#: wait takes, poll(2)'s milliseconds included).
_FOREVER = 1e6

#: Sends between two opportunistic reads of the outputs (see ``AsyncEngine._send_nowait``).
_READ_EVERY = 32
#: Requests handed an output per loop callback (:func:`deliver_rows`).
_ROWS_PER_TURN = 512
#: Seconds between two tries to send aborts a full work channel refused.
_RETRY_S = 0.005
#: zmq's option and flag as plain ints: ``int & zmq.POLLIN`` runs the enum's Python
#: ``__rand__`` and makes a new member (three Python calls) on every read of outputs.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

#: This process's id, updated in a child that ``os.fork`` makes: the fork check every
#: call passes (``AsyncEngine._check_process``) reads it instead of asking the kernel
#: (``os.getpid`` is a system call each time).
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def close_timeout(timeout: float | None) -> float:
    """``close``'s ``timeout`` as seconds every wait takes: None or inf, as long as it
    takes; NaN or below 0, none. A timeout that is no number raises TypeError here,
    before anything is closed (raised once the engine is marked closed, every
    request would hang and the processes stay)."""
    if timeout is None or timeout > _FOREVER:
        return _FOREVER
    return timeout if timeout > 0 else 0.0


def _seconds(timeout: float | None) -> None:
    """Refuse a ``timeout`` that is no number of seconds (``TypeError``), before the
    request it bounds is sent: raised once it runs, the request would run on with
    nobody waiting for it."""
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, int | float)):
        raise TypeError(f"timeout must be a number of seconds or None, not "
                        f"{type(timeout).__name__}")


async def _within(rid: str, answer: Awaitable[T], timeout: float | None) -> T:
    """``answer`` awaited, at most ``timeout`` seconds (None: no bound); past it the wait
    is cancelled (which aborts request ``rid``) and the ``TimeoutError`` names the
    request and the seconds (asyncio's own says nothing: one of many concurrent calls
    could not be told apart)."""
    if timeout is None:  # no timer to make: the hot path of many short requests
        return await answer
    try:
        async with asyncio.timeout(timeout) as bound:
            return await answer
    except TimeoutError:
        if not bound.expired():  # (raised by what was awaited, not by the bound)
            raise
        raise TimeoutError(f"request {rid!r}: no answer within {timeout:g} s (the request "
                           f"was aborted)") from None


class AsyncRequest(RequestState):
    """A submitted generate request: ``await`` it for its :class:`~scheduler.GenerateResult`.

    The asyncio twin of :class:`~scheduler.RequestHandle`, with no task of its
    own: many can be awaited one after another, each once. Cancelling what awaits it
    aborts the request; one never awaited runs to its end (``await
    engine.abort(request.rid)`` stops it). One that fails and is collected
    without ever being awaited (fire and forget) is counted in
    :attr:`AsyncEngine.unawaited_failures`, never logged one by one.

    Raises (when awaited): as :meth:`AsyncEngine.generate`.
    """

    __slots__ = ("_awaited", "_engine")

    def __init__(self, rid: str, engine: AsyncEngine) -> None:
        super().__init__(rid)
        self._engine = engine
        self._awaited = False

    def __await__(self) -> Generator[object, None, GenerateResult]:
        if self._awaited:  # its outputs went to the first: a second would wait for ever
            raise RuntimeError(f"request {self.rid!r} is awaited a second time")
        self._awaited = True
        return self._engine._result(self).__await__()

    def __del__(self) -> None:
        last = self.items[-1] if self.items else None
        if not self._awaited and isinstance(last, EngineError):
            code = getattr(last, "code", type(last).__name__)
            self._engine.unawaited_failures += 1
            self._engine._unseen_log.add("submit", f"{code}: {last}")


class AsyncEngine:
    """The engine for asyncio code: one scheduler, in one of two modes.

    Use it as ``async with AsyncEngine(...) as engine:`` (or ``await
    engine.start()`` and ``await engine.close()``), from one event loop: a
    request or rpc from any other raises ``RuntimeError`` at once, naming both.

    Args:
        mode: ``"ring"`` (scheduler embedded in this process; requests and
            outputs by reference through rings; rpc over zmq) or ``"zmq"``
            (scheduler in its own process; everything over zmq ``ipc://``).
        model: the built-in model's :class:`~scheduler.ModelConfig` (default),
            or a Hugging Face model: a local directory (``str`` or ``Path``)
            or an :class:`~scheduler.HFModelSpec` (dtype, device). ``zmq``
            mode loads it in the scheduler's process, having checked here
            that it would load (:class:`~scheduler.ModelLoadError` otherwise,
            naming the file; with ``dp_size``, a dispatcher whose every
            replica was given up on is :class:`~scheduler.SchedulerGone`,
            saying so).
        max_batch: most requests decoding at once.
        start_timeout: seconds to wait for the scheduler to answer ``hello``,
            its first rpc (which also checks that it reads our wire layout:
            :class:`~messages.ProtocolMismatch` otherwise).
        tp_size: tensor-parallel ranks (``zmq`` mode): that many scheduler
            processes joined by ``torch.distributed``; rank 0 owns the
            channels and broadcasts every poll, outputs leave from rank 0,
            and an rpc runs on every rank and is answered once.
        dp_size: data-parallel replicas (``zmq`` mode): that many schedulers
            (each of ``tp_size`` ranks) behind one dispatcher
            (:mod:`scheduler.dp`). Requests go to the least-loaded live
            replica (or the one ``dp_rank=`` pins), an abort to its owner,
            an rpc to every replica (one merged reply). A replica that dies
            fails only the requests it had started (``replica_lost``).
        dp_policy: ``"least_loaded"`` (default) or ``"round_robin"``.
        limits: admission and output-backlog bounds of the scheduler
            (:class:`~scheduler.Limits`): past them a request fails with
            :class:`~scheduler.Overloaded`.
        metrics: record the scheduler's Prometheus metrics (:meth:`metrics`).
        pd: ``(P, D)``: prefill and decode apart (``zmq`` mode), ``P + D``
            replicas behind the dispatcher: a generate request is read on one
            of the first ``P``, which streams its first token and hands its KV
            cache (:class:`~messages.KVHandoff`) to one of the other ``D``,
            which streams the rest. ``None``: every replica does both.

    Every request is validated as the wire would validate it before it is
    sent (:class:`~scheduler.InvalidRequest` at submit), in both modes: a
    request is either refused at once or answered later, never lost.
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
    #: Requests that failed (``Overloaded`` above all) and were collected
    #: without ever being awaited: fire-and-forget submits.
    unawaited_failures: int

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelArg = None,
                 *, max_batch: int = 64, start_timeout: float = 60.0, tp_size: int = 1,
                 dp_size: int = 1, dp_policy: Policy = "least_loaded",
                 limits: Limits | None = None, metrics: bool = True,
                 pd: tuple[int, int] | None = None) -> None:
        dp_size = checked_layout(mode, max_batch, tp_size, dp_size, pd)
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
        # Tied to the engine's state, not to the engine: an engine collected unclosed
        # keeps its scheduler's sockets there until _abandoned has stopped it.
        self._state_alive = _StateAlive()
        self._remove_dir = weakref.finalize(self._state_alive, remove_run_dir, self._dir)
        self.endpoints = Endpoints.in_dir(self._dir)
        self._requests: dict[str, RequestState] = {}  # rid -> its state, on the loop
        self._owner = os.getpid()  # a forked child may not use it (_check_process)
        # Unique per engine (random prefix) and cheap per request (a counter).
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._rid_seq = count()
        self._closed = False
        self._ingress: Ring[Request] | None = None
        self._egress: Ring[Output] | None = None
        self._work_out: PushOutbox[Request] | None = None
        out_inbox: Inbox[Output]
        if mode == "ring":
            self._ingress = Ring(1 << 16, name="work")
            self._egress = Ring(1 << 16, name="out")
            assert self._loaded is not None
            self._scheduler = StartedScheduler.embedded(
                self._ingress, self._egress, self.endpoints.rpc, self._loaded,
                max_batch=max_batch, limits=self.limits, metrics=metrics)
            out_inbox = RingInbox(self._egress, name="out")
        else:
            out_inbox = PullInbox(OUT.outbound_codec(), self.endpoints.out, name="out")
            self._work_out = PushOutbox(WORK.inbound_codec(), self.endpoints.work, name="work")
            self._scheduler = StartedScheduler.forked(
                self.endpoints, self._dir, self.model, max_batch=max_batch, tp_size=tp_size,
                dp_size=dp_size, limits=self.limits, metrics=metrics, dp_policy=dp_policy,
                pd=pd)
        self._out_inbox = out_inbox
        self._rpc = RpcClient(self.endpoints.rpc, name="rpc")
        self._start_timeout = start_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0  # the loop's thread, once started
        self._watchdog: asyncio.Task[None] | None = None
        pollable = self._out_inbox.pollable()
        self._fd = pollable if isinstance(pollable, int) else int(pollable.get(zmq.FD))
        self._reader = _Reader(self._requests, Receiver([out_inbox], budget=1024),
                               pollable if isinstance(pollable, zmq.Socket) else None,
                               self._rpc)
        # Sent at the end of this turn of the loop, as one burst: requests, and the
        # states of requests to abort (an abort is made, or not, at the last moment).
        self._outq: list[Request | RequestState] = []
        # Aborts waiting for room on the work channel, in order, as their requests' states.
        self._unsent_aborts: deque[RequestState] = deque()
        # Requests a blocking submit holds while it waits for room, by their states: an
        # abort of one takes it out (it is never sent) and answers it at once.
        self._unsent: dict[RequestState, Request] = {}
        self._shut: asyncio.Future[None] | None = None  # done once close() begins
        self.unawaited_failures = 0
        self._unseen_log = LogSummary(log, "requests failed with nobody awaiting them")
        # An engine dropped without a close (an exception path, a notebook cell run
        # again) is collected, as nothing it started holds it (the loop holds its
        # _Reader, its watchdog holds it weakly, its scheduler thread not at all):
        # this closes what it started then. It holds the engine's state, not the
        # engine. Not at exit (_close_at_exit closes every engine still open then),
        # nothing in a forked child.
        self._abandoned = weakref.finalize(self, _close_abandoned, self.__dict__)
        self._abandoned.atexit = False
        _open.add(self)

    async def start(self) -> Self:
        """Start reading outputs on the running loop; wait for the scheduler to answer.

        Raises:
            RpcTimeout: the scheduler did not answer within ``start_timeout``.
            SchedulerGone: it died while starting.
        """
        self._check_process()
        loop = self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._shut = loop.create_future()
        reader = self._reader
        reader.loop = loop
        loop.add_reader(self._fd, reader.on_readable)
        loop.add_reader(self._rpc.fileno(), reader.on_rpc_readable)
        reader.reading = True
        self._watchdog = loop.create_task(_watch(weakref.ref(self)))
        try:
            hello_answer(await self.collective_rpc(HELLO_METHOD, timeout=self._start_timeout,
                                                   **hello_params()),
                         f"scheduler at {self._rpc.endpoint}")
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

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
            return self._scheduler.gone or "the engine is closed"
        self._scheduler.alive()
        return self._scheduler.gone

    @property
    def replica_pids(self) -> list[tuple[int, ...]]:
        """The process ids of each data-parallel replica (every tp rank), when
        ``dp_size > 1``: what a test or an operator kills to see a replica lost."""
        return self._scheduler.replica_pids

    # -- requests -------------------------------------------------------------

    async def generate(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None,
                       *, return_logprob: bool = False, rid: str | None = None,
                       dp_rank: int | None = None, timeout: float | None = None
                       ) -> GenerateResult:
        """Generate and return the whole answer; cancelling the task aborts the request.

        Raises:
            RequestFailed: the scheduler answered with an error
                (:class:`~scheduler.Overloaded` when it was too busy).
            InvalidRequest: refused before sending.
            SchedulerGone: the scheduler died meanwhile.
            EngineClosed: the engine is closed.
            TimeoutError: no answer within ``timeout`` seconds (the request is aborted).
        """
        _seconds(timeout)
        request = self.submit(input_ids, sampling, return_logprob=return_logprob, rid=rid,
                              dp_rank=dp_rank)
        return await _within(request.rid, request, timeout)

    def submit(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               stream: bool = False, return_logprob: bool = False, rid: str | None = None,
               dp_rank: int | None = None) -> AsyncRequest:
        """Send a generate request now; ``await`` what it returns for the answer.

        ``stream=True`` has the scheduler send each step's tokens as it makes
        them (the answer awaited is still the whole one: iterate
        :meth:`stream` for the steps). ``dp_rank`` pins the request to one
        data-parallel replica.

        Raises:
            InvalidRequest: refused before sending.
            Overloaded: the scheduler's work channel is full (nothing was sent;
                this surfaces when the request is awaited).
            EngineClosed: the engine is closed (or not started).
            SchedulerGone: the scheduler died.
        """
        req = self._generate_req(input_ids, sampling, stream, return_logprob, rid, dp_rank)
        return self._start([req], self._request)[0]

    def submit_many(self, inputs: Sequence[npt.ArrayLike],
                    sampling: SamplingParams | None = None, *, stream: bool = False,
                    return_logprob: bool = False, dp_rank: int | None = None
                    ) -> list[AsyncRequest]:
        """Send several generate requests at once (one burst); ``await`` each answer.

        All are validated before any is sent.

        Raises:
            InvalidRequest: one of them is refused (none was sent).
            EngineClosed, SchedulerGone: as :meth:`submit`.
        """
        return self._start([self._generate_req(ids, sampling, stream, return_logprob, None,
                                               dp_rank) for ids in inputs], self._request)

    async def stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None,
                     *, return_logprob: bool = False, rid: str | None = None,
                     dp_rank: int | None = None) -> AsyncIterator[StreamChunk]:
        """Yield new tokens as each step produces them; leaving early aborts the request.

        Raises (while iterating): as :meth:`generate`.
        """
        steps = self._stream(input_ids, sampling, return_logprob, rid, dp_rank, True)
        async with contextlib.aclosing(steps):  # leaving early closes (aborts) it
            async for chunks in steps:
                for chunk in chunks:
                    yield chunk

    def stream_steps(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None,
                     *, return_logprob: bool = False, rid: str | None = None,
                     dp_rank: int | None = None) -> AsyncIterator[list[StreamChunk]]:
        """As :meth:`stream`, but yield every chunk that has arrived, oldest first, as one
        list (never empty; one chunk per scheduler step in it).

        For a consumer that writes to a socket: what arrived while it was busy
        is written at once, one write for many steps, not one a step. The
        request is sent at the first iteration. Leaving early aborts it.

        Raises (while iterating): as :meth:`generate`; chunks that arrived
        before an error are yielded first.
        """
        return self._stream(input_ids, sampling, return_logprob, rid, dp_rank, False)

    def _stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None,
                return_logprob: bool, rid: str | None, dp_rank: int | None, one: bool
                ) -> AsyncGenerator[list[StreamChunk], None]:
        """A stream's chunks (``one``: one at a time); its request is sent at the first
        iteration (not before)."""
        return cast(AsyncGenerator[list[StreamChunk], None], self._steps(lambda: self._start(
            [self._generate_req(input_ids, sampling, True, return_logprob, rid, dp_rank)],
            RequestState)[0], one))

    async def embed(self, input_ids: npt.ArrayLike, *, rid: str | None = None,
                    dp_rank: int | None = None, timeout: float | None = None
                    ) -> npt.NDArray[np.float32]:
        """Embed a tokenized text; returns a unit-norm float32 vector.

        Raises: as :meth:`generate`.
        """
        _seconds(timeout)
        rid, ids = self._prompt(input_ids, rid, dp_rank)
        req = TokenizedEmbeddingReqInput(rid=rid, input_ids=ids, dp_rank=dp_rank)
        state = self._start([req], RequestState)[0]
        items = await _within(state.rid, self._items(state), timeout)
        assert isinstance(items[0], np.ndarray)
        return items[0]

    async def _items(self, state: RequestState) -> list[Item]:
        """Every item of ``state``'s answer, to its end."""
        return [item async for got in self._steps(state) for item in got]

    def _check_process(self) -> None:
        """Refuse a call from a child made by ``os.fork`` (:class:`EngineForked`).

        Every public call of both faces passes here before it takes a lock or
        touches a channel: the engine's threads are not in the child (a call
        would wait for an answer nobody reads), a lock another thread held at
        the fork stays held there, and its sockets and rings are the parent's.
        """
        if _pid != self._owner:
            raise EngineForked(self._owner, _pid)

    def _check_loop(self) -> None:
        """Refuse a call before :meth:`start` (``EngineClosed``), or from any event loop but
        the engine's own, naming both (``RuntimeError``): its state lives there, and a
        call from another would wait for ever, or for its timeout."""
        self._check_process()  # (a forked child's loop is not the engine's either)
        loop = self._loop
        if loop is None:
            raise EngineClosed("the engine is not started (use 'async with' or start())")
        if threading.get_ident() == self._loop_thread and loop.is_running():
            # One loop runs on a thread at a time: code on the thread of the engine's
            # running loop runs in it. Told without asking for the running loop, which
            # in Python 3.11 is a getpid system call (twice a request).
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop:
            where = "outside any event loop" if running is None else f"event loop {running!r}"
            raise RuntimeError(f"the engine was started on event loop {loop!r}; it was "
                               f"called from {where} (an AsyncEngine serves the one loop it "
                               "was started on)")

    def _check_open(self) -> None:
        """Refuse a request or rpc: as :meth:`_check_loop`, or the engine is closed
        (``EngineClosed``), or the scheduler is gone (``SchedulerGone``)."""
        self._check_loop()
        if self._closed:
            raise EngineClosed("the engine is closed")
        if self._scheduler.gone is not None:
            raise SchedulerGone(self._scheduler.gone)

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
        rid, ids = self._prompt(input_ids, rid, dp_rank)
        return TokenizedGenerateReqInput(
            rid=rid, input_ids=ids, sampling=sampling or SamplingParams(), stream=stream,
            return_logprob=return_logprob, dp_rank=dp_rank)

    def _prompt(self, input_ids: npt.ArrayLike, rid: str | None, dp_rank: int | None
                ) -> tuple[str, TokenIds]:
        """A request's rid (a new one unless given: unique per engine by its random
        prefix, cheap per request by its counter) and ``input_ids`` packed for the wire;
        ``InvalidRequest`` for a prompt that is not token ids (too many, negative, not
        integers) or a ``dp_rank`` this engine does not have."""
        rid = rid if rid is not None else f"{self._rid_prefix}-{next(self._rid_seq)}"
        try:
            ids = token_ids(input_ids, field="input_ids")
        except (ValueError, TypeError, OverflowError) as exc:
            raise InvalidRequest(rid, str(exc)) from exc
        if dp_rank is not None and not 0 <= dp_rank < self.dp_size:
            raise InvalidRequest(rid, f"dp_rank={dp_rank} is out of range: this engine has "
                                      f"{self.dp_size} replica(s)")
        return rid, ids

    def _request(self, rid: str) -> AsyncRequest:
        return AsyncRequest(rid, self)

    def _start(self, reqs: Sequence[_Tokenized], make: Callable[[str], S]) -> list[S]:
        """Validate ``reqs``, record the state ``make(rid)`` builds for each, and queue them
        for this turn's burst: the way in of every request. All or none.

        Raises:
            InvalidRequest: one is refused, or its rid is in flight (none was sent).
            EngineClosed, SchedulerGone: as :meth:`submit`.
        """
        checked, states = self._register(reqs, make)
        for req in checked:
            self._send(req)
        return states

    async def _start_waiting(self, reqs: Sequence[_Tokenized], make: Callable[[str], S]
                             ) -> list[S]:
        """As :meth:`_start`, but sent at once, waiting for room while the work channel
        is full (the blocking face's backpressure).

        Raises:
            Overloaded: no room for the channel's send timeout in a row (says how
                many were sent; those not sent are forgotten).
            InvalidRequest, EngineClosed, SchedulerGone: as :meth:`_start`.
        """
        checked, states = self._register(reqs, make)
        self._flush_sends()  # what this turn queued goes first
        held = self._unsent
        held.update(zip(states, checked, strict=True))
        shut = self._shut
        assert shut is not None
        sent, since = 0, time.monotonic()
        try:
            while True:
                # (one aborted meanwhile was taken out of held and answered)
                todo = [state for state in states if state in held]
                if not todo:
                    return states
                n = self._send_nowait([held[state] for state in todo])
                for state in todo[:n]:
                    del held[state]
                sent += n
                if n == len(todo):
                    return states
                if n:
                    since = time.monotonic()
                elif time.monotonic() - since > SEND_TIMEOUT:
                    raise Overloaded(todo[0].rid, "overloaded", "the scheduler is not "
                                     "taking requests (its work channel stayed full for "
                                     f"{SEND_TIMEOUT:g} s): {sent} of {len(checked)} were sent")
                await asyncio.wait([shut], timeout=_RETRY_S)  # a close wakes it at once
                self._check_open()
        except BaseException:
            for state in states:  # those not sent are forgotten
                if held.pop(state, None) is not None and self._requests.get(state.rid) is state:
                    del self._requests[state.rid]
            raise

    def _register(self, reqs: Sequence[_Tokenized], make: Callable[[str], S]
                  ) -> tuple[list[Request], list[S]]:
        checked: list[Request] = [self._validated(r) for r in reqs]
        self._check_open()
        table = self._requests
        for req in checked:
            if req.rid in table:
                raise InvalidRequest(req.rid, "this request id is still in flight (pending, "
                                              "or cancelled and not yet ended by the scheduler)")
        states = [make(r.rid) for r in checked]
        table.update(zip([r.rid for r in checked], states, strict=True))
        return checked, states

    async def _steps(self, start: RequestState | Callable[[], RequestState],
                     one: bool = False) -> AsyncIterator[list[Item]]:
        """A request's outputs, those that have arrived (``one``: the oldest) as one list,
        until its last; an error is raised after the outputs that came before it.
        ``start``: its state, or what sends it at the first iteration. Leaving before
        its end aborts it."""
        self._check_loop()
        loop = self._loop
        assert loop is not None
        state = start if isinstance(start, RequestState) else start()
        finished = False
        try:
            while not finished:
                # What is buffered is taken without a coroutine; a bare future is
                # awaited only when nothing waits (the per-token hot path).
                items = state.take(one)
                if not items:
                    await state.arrival(loop)
                    continue
                last = items[-1]  # (an error or a final output is the last one)
                finished = ends(last)
                if isinstance(last, EngineError):
                    if len(items) > 1:
                        yield items[:-1]
                    raise last
                yield items
        finally:
            if not finished:  # cancelled, broken out of, or collected: free the slot
                self._cancel(state)

    async def _result(self, request: AsyncRequest) -> GenerateResult:
        return joined(request.rid, await self._items(request))

    async def abort(self, rid: str) -> None:
        """Abort a queued or running request (idempotent).

        Aborts the request that holds ``rid`` now; one that already ended is
        left alone, and so is a later request that reuses the rid while this
        abort waits for room on the work channel.

        Raises:
            InvalidRequest: ``rid`` is not a valid request id.
            EngineClosed, SchedulerGone: as :meth:`generate`.
        """
        self._check_open()
        self._validated(AbortReq(rid=rid))
        state = self._requests.get(rid)
        if state is not None:  # none: it ended (its answer is in): nothing to abort
            self._abort(state)

    def _cancel(self, state: RequestState) -> None:
        """The caller of ``state`` left: drop its outputs, and abort its request unless it
        ended (by identity: its rid may be a new request's by now)."""
        state.left = True
        if (self._requests.get(state.rid) is state and not self.closed
                and self._scheduler.gone is None):
            self._abort(state)

    def _abort(self, state: RequestState) -> None:
        """Abort ``state``'s request at the end of this turn, or as soon as the work channel
        has room, in order: only while it still holds its rid. One a blocking submit
        still holds, waiting for room, is never sent: it ends here with ``abort``."""
        req = self._unsent.pop(state, None)
        if req is not None:
            logprobs: tuple[float, ...] | None = None
            if isinstance(req, TokenizedGenerateReqInput) and req.return_logprob:
                logprobs = ()
            self._end(state.rid, StreamChunk(state.rid, (), "abort", logprobs))
            return
        if self._unsent_aborts:  # keep order behind those already waiting
            self._unsent_aborts.append(state)
        else:
            self._send(state)

    def _retry_aborts(self) -> None:
        """Queue the aborts that waited for room again, in order (each still sent only
        while its state holds its rid)."""
        waiting, self._unsent_aborts = self._unsent_aborts, deque()
        if not self.closed and self._scheduler.gone is None:
            for state in waiting:
                self._send(state)

    def _send(self, item: Request | RequestState) -> None:
        """Queue a request, or the abort of a request's state, for this turn's burst.

        The lone request of an idle engine leaves as soon as its task awaits.
        """
        assert self._loop is not None
        queue = self._outq
        queue.append(item)
        if len(queue) == 1:
            self._loop.call_soon(self._flush_sends)
        elif len(queue) >= SEND_BURST:
            self._flush_sends()

    def _flush_sends(self) -> None:
        """Send what this turn of the loop queued, as bursts; a request the channel does
        not take fails with Overloaded, an abort waits for room."""
        queued, self._outq = self._outq, []
        reqs: list[Request] = []
        aborting: list[RequestState | None] = []  # beside each: the state an abort is for
        for item in queued:
            if isinstance(item, RequestState):
                if self._requests.get(item.rid) is not item:
                    continue  # its request ended: nothing to abort
                reqs.append(AbortReq(rid=item.rid))
                aborting.append(item)
            else:
                reqs.append(item)
                aborting.append(None)
        error: EngineError | None = None
        sent = 0
        while sent < len(reqs):
            try:
                n = self._send_nowait(reqs[sent:])
            except Exception as exc:  # closed under us (or, validated, not expected: one
                # that cannot be encoded): nothing more will be sent
                error = exc if isinstance(exc, EngineError) else EngineError(
                    f"request {reqs[sent].rid!r} could not be sent: {exc}")
                break
            if n == 0:
                break
            sent += n
        for req, state in zip(reqs[sent:], aborting[sent:], strict=True):
            if state is None:
                self._end(req.rid, error or Overloaded(
                    req.rid, "overloaded", "the scheduler is not taking requests (its work "
                                           "channel is full)"))
            elif error is None:  # an abort waits for room, in order
                self._unsent_aborts.append(state)
                if len(self._unsent_aborts) == 1:
                    assert self._loop is not None
                    self._loop.call_later(_RETRY_S, self._retry_aborts)

    def _send_nowait(self, reqs: Sequence[Request]) -> int:
        """Send what of ``reqs`` the work channel takes now, in order (over zmq as
        bursts, on the ring in one put); returns how many. Never blocks.

        Raises:
            EngineClosed: the channel is closed.
            EncodeError: ``reqs[0]`` cannot be encoded (nothing was sent).
        """
        try:
            if self._ingress is not None:
                n = self._ingress.put_many_nowait(reqs)
            else:
                assert self._work_out is not None
                n = self._work_out.send_many_nowait(reqs)
        except ChannelClosed as exc:
            raise EngineClosed("the engine is closed") from exc
        # A burst of submits runs in one turn of the loop, before it polls again: the
        # outputs are read every so often meanwhile, so their delivery overlaps it.
        reader = self._reader
        reader.sent_unread += n
        if reader.sent_unread >= _READ_EVERY and reader.reading:
            reader.on_readable()
        return n

    def _end(self, rid: str, item: Item) -> None:
        state = self._requests.pop(rid, None)
        if state is not None:
            state.put(item)

    def _fail_all(self, error: EngineError) -> None:
        """End every waiting request with ``error``."""
        states = list(self._requests.values())
        self._requests.clear()
        for state in states:
            state.put(error)

    # -- rpc --------------------------------------------------------------------

    async def collective_rpc(self, /, method: str, *, timeout: float = 30.0,
                             **params: Scalar) -> RpcReqOutput:
        """Call an rpc method on the scheduler without blocking the loop.

        Sent and answered on the event loop: the rpc socket is one of the
        loop's readers, and its reply is matched to this call by rid. No
        thread and no lock is held while it waits, so any number of calls are
        in flight at once; once the scheduler is found gone, every one of
        them fails at once (:class:`~scheduler.SchedulerGone`).

        Raises:
            RpcTimeout: no reply in time.
            SchedulerGone: the scheduler died (reported promptly, not at the timeout).
            EngineClosed: the engine is closed.
            DecodeError: the scheduler's reply could not be decoded.
            EncodeError: a parameter is not a plain scalar (nothing was sent).
        """
        self._check_open()
        loop = self._loop
        assert loop is not None
        rpc = self._rpc
        answer: asyncio.Future[RpcReqOutput | Exception] = loop.create_future()
        on_loop = self._loop_thread

        def settle(reply: RpcReqOutput | Exception) -> None:
            if not answer.done():  # (its caller left)
                answer.set_result(reply)

        def on_reply(reply: RpcReqOutput | Exception) -> None:
            if threading.get_ident() == on_loop:
                settle(reply)
            else:  # read by a blocking call (the shutdown rpc) on another thread
                loop.call_soon_threadsafe(settle, reply)

        try:
            call = rpc.start(method, on_reply, **params)
            try:
                async with asyncio.timeout(timeout):
                    # A DEALER takes nothing until the scheduler's socket is connected.
                    while not rpc.try_send(call):
                        await asyncio.sleep(_RETRY_S)
                    reply = await answer
            except TimeoutError:
                raise RpcTimeout(f"{rpc.name} ({rpc.endpoint})", method, call.rid,
                                 timeout) from None
            finally:
                rpc.forget(call)
            if isinstance(reply, Exception):
                raise reply
        except ChannelClosed as exc:  # (closed by this engine's close)
            raise EngineClosed(f"rpc {method!r}: the engine closed before the reply") from exc
        except PeerGone as exc:
            if self._scheduler.load_error is not None:  # what it said over its report pipe
                raise self._scheduler.load_error from exc
            raise SchedulerGone(f"rpc {method!r}: {self._scheduler.gone or exc}") from exc
        return reply

    async def metrics(self, timeout: float = 30.0) -> str:
        """The scheduler's Prometheus metrics, in the text exposition format.

        Read over rpc, so it is consistent with the scheduler's own step (in
        either mode) and parses with ``prometheus_client.parser``. With
        ``dp_size > 1``, every sample carries a ``replica`` label (replicas
        that did not answer are left out).

        Raises:
            RequestFailed: the engine was built with ``metrics=False``.
            EngineClosed, SchedulerGone, RpcTimeout: as :meth:`collective_rpc`.
        """
        reply = await self.collective_rpc("metrics", timeout=timeout)
        text = metrics_text(reply.result or {}, self.dp_size)
        if not reply.success or text is None:
            raise RequestFailed(reply.rid, "metrics", reply.message)
        return text

    # -- lifecycle --------------------------------------------------------------

    async def close(self, timeout: float | None = 30.0) -> None:
        """Finish every accepted request with a terminal answer, then stop. Idempotent.

        ``timeout`` bounds the whole close (``None``: as long as it takes): a
        scheduler process still running at its end (hung, stopped) is killed. An
        embedded (ring mode) scheduler is a thread, which cannot be: the close
        waits for the step it is in."""
        self._check_process()  # a forked child's close would shut the parent's down
        seconds = close_timeout(timeout)  # (refused before anything is stopped)
        if self.closed:
            return
        self._closed = True
        self._abandoned.detach()
        _open.discard(self)
        if self._shut is not None:  # (made by start)
            self._shut.set_result(None)  # wakes every submit waiting for room
        if self._watchdog is not None and not self._watchdog.get_loop().is_closed():
            self._watchdog.cancel()
        self._flush_sends()  # what this turn submitted goes before the shutdown
        # The shutdown rpc and the joins block: run them off the loop, which keeps
        # delivering the terminal answers meanwhile.
        await _in_own_thread(functools.partial(self._scheduler.stop, self._rpc), seconds)
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop.remove_reader(self._rpc.fileno())
        reader = self._reader
        reader.reading = False
        while True:  # read last what arrived last, after what was read before
            got = reader.outputs.poll()
            reader.backlog.extend(got)
            if len(got) < reader.outputs.budget:
                break
        deliver_rows(self._requests, reader.backlog, len(reader.backlog))
        self._fail_all(EngineClosed("the engine closed before the request finished"))
        self._rpc.close()  # the channels, once the outputs are read
        self._out_inbox.close()
        if self._work_out is not None:
            self._work_out.close()
        for ring in (self._ingress, self._egress):
            if ring is not None:
                ring.release()
        self._remove_dir()
        self._unseen_log.flush()  # the last ones counted, not left unsaid


class _StateAlive:
    """Alive while an engine's state is: with the engine, or, once it is collected
    unclosed, until the close its finalizer runs (on that state) ends."""

    __slots__ = ("__weakref__",)


class _Reader:
    """What the event loop's readers call: outputs read and handed to their requests'
    states, rpc replies to their calls. An object of its own, holding what reading
    needs and not the engine, so that the loop does not hold the engine (one dropped
    without a close is collected); it delivers until the close removes the readers."""

    __slots__ = ("backlog", "loop", "outputs", "reading", "requests", "rpc", "sent_unread",
                 "sock")

    def __init__(self, requests: dict[str, RequestState], outputs: Receiver[Output],
                 sock: zmq.Socket[bytes] | None, rpc: RpcClient) -> None:
        self.requests = requests  # the engine's own table (rid -> state)
        self.outputs = outputs
        self.sock = sock  # the PULL socket (zmq mode), whose FD is edge-triggered
        self.rpc = rpc
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start
        self.reading = False  # the loop's readers are registered
        self.sent_unread = 0  # sends since outputs were last read
        self.backlog: deque[Envelope[Output] | Rejected] = deque()  # read, not yet delivered

    def on_readable(self) -> None:
        if not self.reading:  # a call scheduled before the reader was removed
            return
        self.sent_unread = 0
        # A poll at a time, delivered a share of rows at a time: the requests
        # woken run before the next share, and a flood of outputs never holds
        # the loop for longer than one share (deliver_rows).
        backlog, more = self.backlog, False
        if not backlog:
            got = self.outputs.poll()
            backlog.extend(got)
            more = len(got) >= self.outputs.budget
        deliver_rows(self.requests, backlog, _ROWS_PER_TURN)
        assert self.loop is not None
        sock = self.sock
        # zmq's FD is edge-triggered: it fires again only after EVENTS is read
        # with nothing left; if messages slipped in meanwhile, go again.
        if backlog or more or (sock is not None
                               and cast(int, sock.getsockopt(_EVENTS)) & _POLLIN):
            self.loop.call_soon(self.on_readable)

    def on_rpc_readable(self) -> None:
        # Outputs waiting now are delivered before the rpc replies: a reply the
        # scheduler sent after a request's last tokens finds them delivered (a
        # caller that waits for get_load to say idle, then reads its stream).
        if self.reading:
            self.on_readable()
        self.rpc.read_replies()


async def _watch(engine_ref: weakref.ref[AsyncEngine]) -> None:
    """Fail every waiting request and rpc call of the engine promptly once its scheduler
    is gone. Holds the engine only between two looks (its finalizer stops this task's
    reason to run: it ends once the engine is closed or collected)."""
    while True:
        await asyncio.sleep(0.1)  # a liveness poll, not a wait for a condition
        engine = engine_ref()
        if engine is None or engine.closed:
            return
        if not engine._scheduler.alive(engine.closed):
            why = engine._scheduler.gone or "the scheduler is gone"
            engine._fail_all(SchedulerGone(why))
            engine._rpc.fail_all(PeerGone(f"{engine._rpc.name} ({engine._rpc.endpoint})", why))
        del engine


#: The closes of engines collected unclosed, held until they end (a task only the loop
#: holds may be collected before it ends).
_abandoned_closes: set[asyncio.Task[None]] = set()


def close_on(loop: asyncio.AbstractEventLoop, close: Callable[[], Awaitable[None]]
             ) -> threading.Event | None:
    """Run ``close()`` as a task on ``loop``, held until it ends, without waiting for it
    (from any thread, the loop's own included: the collector may run a finalizer
    anywhere). Returns an event set once it has ended (the task holds it until then),
    or None, having done nothing, when ``loop`` is closed."""
    ended = threading.Event()

    async def run() -> None:
        try:
            await close()
        finally:
            ended.set()

    def begin() -> None:
        task = loop.create_task(run())
        _abandoned_closes.add(task)
        task.add_done_callback(_abandoned_closes.discard)

    try:
        loop.call_soon_threadsafe(begin)
    except RuntimeError:  # the loop is closed
        return None
    return ended


def _close_abandoned(state: dict[str, object]) -> None:
    """An engine collected without a close: close what it started (its scheduler thread
    or processes, its channels, the loop's readers and its watchdog, its run
    directory) as its :meth:`AsyncEngine.close` does, run by a stand-in that has its
    ``state``; then warn (``ResourceWarning``, as asyncio does for an unclosed
    transport). Never waits: the close runs as a task on the engine's loop, which
    keeps serving (the blocking steps run off it), or, for an engine never started or
    whose loop is closed, on a loop of its own in a daemon thread. Nothing in a forked
    child (what the engine started is the parent's)."""
    if _pid != state["_owner"]:
        return
    stand_in = AsyncEngine.__new__(AsyncEngine)
    stand_in.__dict__.update(state)
    loop = stand_in._loop
    if loop is None or close_on(loop, stand_in.close) is None:
        stand_in._reader.reading = False  # (the loop's readers went with the loop)
        threading.Thread(target=asyncio.run, args=(stand_in.close(),), daemon=True,
                         name="engine-close").start()
    warnings.warn(f"an AsyncEngine ({stand_in.mode} mode, run directory {stand_in._dir}) was "
                  f"collected without close(): its scheduler is stopped now (use 'async with "
                  f"AsyncEngine(...)', or 'await engine.close()')", ResourceWarning,
                  stacklevel=1)


#: Engines made in this process and not closed (nor collected).
_open: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()
#: Seconds the exit waits, at most, for the closes it waits for (of an engine whose loop
#: still runs, or one collected unclosed).
EXIT_WAIT_S = 60.0


@atexit.register
def _close_at_exit() -> None:
    """As the interpreter exits, close every engine still open (an ``Engine``'s are
    closed before this runs, by its own exit handler). Else an embedded scheduler,
    a daemon thread, could still be in a step as the interpreter was torn down, and
    the process aborted (``terminate called without an active exception``). An
    engine whose loop has stopped (``asyncio.run`` returned) is closed on a loop of
    its own, as a collected one is; one whose loop still runs, in a daemon thread,
    is closed there and waited for (at most :data:`EXIT_WAIT_S`). Engines of the
    parent of a forked child are its parent's to close."""
    for engine in list(_open):
        if engine._owner != _pid or engine.closed:
            continue
        try:
            loop = engine._loop
            if loop is not None and loop.is_running():
                ended = close_on(loop, engine.close)
                if ended is not None and not ended.wait(EXIT_WAIT_S):
                    log.error("an engine was still closing at exit (%.0f s)", EXIT_WAIT_S)
                continue
            engine._reader.reading = False  # (the loop's readers went with the loop)
            asyncio.run(engine.close())
        except Exception as exc:  # the next engine is closed still
            log.error("closing an engine at exit failed: %s: %s", type(exc).__name__, exc)


def deliver_rows(requests: dict[str, RequestState],
                 backlog: deque[Envelope[Output] | Rejected], rows: int) -> None:
    """Deliver outputs from the front of ``backlog`` to their requests' states until about
    ``rows`` requests were handed an item (at least one output; a batch is never split).

    An event loop's share of a poll: one poll can hold a thousand step
    outputs of 256 requests each when the loop fell behind, and delivering
    them in one callback held the loop (and every timer, socket and health
    check on it) for 100 ms (measured with 256 HTTP streams). The rest
    waits in ``backlog`` for the next callback. A request's last output
    removes it from ``requests``; one for no request of ours is dropped.
    """
    done = 0
    while backlog and done < rows:
        env = backlog.popleft()
        if isinstance(env, Rejected):
            log.error("undecodable output from the scheduler: %s", env.error)
            done += 1
            continue
        out = env.message
        if isinstance(out, BatchTokenIDOut):
            bounds = out.offsets()
            spans = list(pairwise(bounds))  # each row's [a, b) in the id columns
            ids = tuple(out.output_ids)  # one conversion for the whole batch; sliced below
            n = len(spans)
            # Each optional column as one value a row (None for all when absent), so the
            # row loop below builds each chunk without a test per column.
            lps = None if out.logprobs is None else tuple(out.logprobs.tolist())
            tops = _alternatives(out.top_ids, out.top_logprobs, out.top_k())
            prompts = _prompts(out)
            for rid, fin, (a, b), lp, cached, top, (plp, ptop) in zip(
                    out.rids, out.finished_reasons, spans,
                    repeat(None, n) if lps is None else [lps[a:b] for a, b in spans],
                    repeat(None, n) if out.cached_tokens is None else out.cached_tokens,
                    repeat(None, n) if tops is None else [tops[a:b] for a, b in spans],
                    repeat((None, None), n) if prompts is None else prompts, strict=True):
                state = requests.pop(rid, None) if fin is not None else requests.get(rid)
                if state is not None:
                    state.put(StreamChunk(rid, ids[a:b], fin, lp, cached, top, plp, ptop))
            done += n
        elif isinstance(out, BatchEmbeddingOut):
            vectors = out.embeddings.float().numpy()
            for i, rid in enumerate(out.rids):
                state = requests.pop(rid, None)
                if state is not None:
                    state.put(vectors[i].copy())
            done += len(out.rids)
        elif isinstance(out, ErrorOut):
            error = Overloaded if out.code == "overloaded" else RequestFailed
            state = requests.pop(out.rid, None)
            if state is not None:
                state.put(error(out.rid, out.code, out.message))
            done += 1
        else:
            log.error("unexpected output %s on the transport", type(out).__name__)
            done += 1


def _alternatives(ids: PackedU32 | None, logprobs: npt.NDArray[np.float64] | None, k: int
                  ) -> Tops | None:
    """Each position's ``k`` ``(id, logprob)`` alternatives, from a batch's flat columns
    (``top_ids`` or ``prompt_top_ids``), or None where there are none."""
    if not k or ids is None or logprobs is None:
        return None
    pairs = list(zip(ids, logprobs.tolist(), strict=True))
    return tuple(tuple(pairs[j:j + k]) for j in range(0, len(pairs), k))


def _prompts(out: BatchTokenIDOut) -> list[tuple[tuple[float, ...] | None, Tops | None]] | None:
    """Each request's prompt logprobs and their alternatives (``prompt_lens``), or None:
    a one-token prompt has none (``()``)."""
    plens, plp = out.prompt_lens, out.prompt_logprobs
    if plens is None or plp is None:
        return None
    values = plp.tolist()
    tops = _alternatives(out.prompt_top_ids, out.prompt_top_logprobs, out.prompt_top_k())
    got: list[tuple[tuple[float, ...] | None, Tops | None]] = []
    at = 0
    for n in plens:
        got.append((tuple(values[at:at + n]), None if tops is None else tops[at:at + n]))
        at += n
    return got


async def _in_own_thread(blocking: Callable[[float], None], timeout: float) -> None:
    """``blocking(timeout)``, run on a thread of its own and waited for (its exception
    raised here). Not on the loop's default executor: that one refuses work once the
    interpreter begins to exit (``RuntimeError: cannot schedule new futures after
    interpreter shutdown``), when a close from an ``atexit`` handler, or an engine's
    finalizer, still has to stop its scheduler."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():  # (the close was cancelled meanwhile)
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            blocking(timeout)
        except BaseException as exc:  # raised in the awaiting close, as the executor did
            error = exc
        with contextlib.suppress(RuntimeError):  # (the loop is closed: nobody awaits)
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="engine-close", daemon=True).start()
    await done
