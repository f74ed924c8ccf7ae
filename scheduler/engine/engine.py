"""``Engine``: the facade a serving engine imports. One API, two modes.

``Engine(mode="ring")`` embeds the scheduler in this process (its own
thread); ``Engine(mode="zmq")`` runs it in its own process. Either way::

    with Engine() as engine:
        result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
        for chunk in engine.stream([4, 5], SamplingParams(max_new_tokens=8)):
            ...
        engine.collective_rpc("save_checkpoint", path="/tmp/model.ckpt")

The blocking face of :class:`~scheduler.AsyncEngine`, as SGLang's ``Engine``
and vLLM's ``LLM`` are of their async cores: it runs an ``AsyncEngine`` on
an event loop of its own (a private thread), and each call hands its work
to that loop and waits for the answer. Outputs and rpc replies are read by
that one loop, as in the asyncio face; a request's outputs reach its
:class:`~scheduler.RequestHandle` (a thread-safe queue). So both faces offer
the same methods with the same parameters, and behave alike, by
construction (``tests/scheduler/test_parity.py`` checks the first).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Sequence
from typing import Literal, Self, TypeVar

import numpy as np
import numpy.typing as npt

from messages import (
    RpcReqOutput,
    SamplingParams,
    Scalar,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from scheduler.core.admission import Limits
from scheduler.dp import Policy
from scheduler.engine.async_engine import AsyncEngine
from scheduler.engine.handles import GenerateResult, RequestHandle, Stream, StreamChunk
from scheduler.engine.stopping import close_timeout
from scheduler.errors import EngineClosed
from scheduler.launch.wiring import Endpoints
from scheduler.models.loading import ModelArg, ModelSpec

__all__ = ["Engine", "GenerateResult", "RequestHandle", "Stream", "StreamChunk"]

T = TypeVar("T")


class Engine:
    """Wires a scheduler in one of two modes and offers the calls a frontend needs.

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
        limits: admission and output-backlog bounds of the scheduler
            (:class:`~scheduler.Limits`): past them a request fails with
            :class:`~scheduler.Overloaded`.
        metrics: record the scheduler's Prometheus metrics (:meth:`metrics`).
        dp_size: data-parallel replicas (``zmq`` mode): that many schedulers
            (each of ``tp_size`` ranks) behind one dispatcher
            (:mod:`scheduler.dp`). Requests go to the least-loaded live
            replica (or the one ``dp_rank=`` pins), an abort to its owner,
            an rpc to every replica (one merged reply). A replica that dies
            fails only the requests it had started (``replica_lost``).
        dp_policy: ``"least_loaded"`` (default) or ``"round_robin"``.
        pd: ``(P, D)``: prefill and decode apart (``zmq`` mode), ``P + D``
            replicas behind the dispatcher: a generate request is read on one
            of the first ``P``, which streams its first token and hands its KV
            cache (:class:`~messages.KVHandoff`) to one of the other ``D``,
            which streams the rest. ``None``: every replica does both.

    Every request is validated as the wire would validate it before it is
    sent (:class:`~scheduler.InvalidRequest` at submit), in both modes: a
    request is either refused at once or answered later, never lost.
    """

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelArg = None,
                 *, max_batch: int = 64, start_timeout: float = 60.0,
                 tp_size: int = 1, dp_size: int = 1, dp_policy: Policy = "least_loaded",
                 limits: Limits | None = None, metrics: bool = True,
                 pd: tuple[int, int] | None = None) -> None:
        self._core = AsyncEngine(mode, model, max_batch=max_batch, start_timeout=start_timeout,
                                 tp_size=tp_size, dp_size=dp_size, dp_policy=dp_policy,
                                 limits=limits, metrics=metrics, pd=pd)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever,
                                             name="engine-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._run(self._core.start())
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, work: Coroutine[object, object, T]) -> T:
        """Run ``work`` on the engine's loop and wait for its outcome (from any thread
        but the loop's own)."""
        try:
            self._core._check_process()  # a forked child has no loop thread to answer
        except BaseException:
            work.close()
            raise
        if threading.get_ident() == self._loop_thread.ident:
            work.close()
            raise RuntimeError("a blocking Engine call from its own event loop's thread")
        if self._loop.is_closed():
            work.close()
            raise EngineClosed("the engine is closed")
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def _submit(self, reqs: Sequence[TokenizedGenerateReqInput | TokenizedEmbeddingReqInput]
                ) -> list[RequestHandle]:
        """Submit ``reqs``: what the work channel takes at once from this thread (no hop
        to the loop), the rest on the loop, waiting for room
        (:meth:`AsyncEngine._send_rest`)."""
        self._core._check_process()
        if self._loop.is_closed():
            raise EngineClosed("the engine is closed")
        core = self._core
        checked, handles, sent = core._submit_now(reqs, RequestHandle, on_loop=False)
        if sent < len(checked):
            self._run(core._send_rest(checked, handles, sent))
        return handles

    # -- what the engine is ---------------------------------------------------------

    @property
    def mode(self) -> Literal["ring", "zmq"]:
        """``"ring"`` (scheduler embedded in this process) or ``"zmq"`` (in its own)."""
        return self._core.mode

    @property
    def model(self) -> ModelSpec:
        """The model the scheduler serves (as given, resolved)."""
        return self._core.model

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per replica."""
        return self._core.tp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas."""
        return self._core.dp_size

    @property
    def limits(self) -> Limits:
        """The scheduler's admission and backlog bounds."""
        return self._core.limits

    @property
    def endpoints(self) -> Endpoints:
        """The scheduler's endpoints (in a private run directory)."""
        return self._core.endpoints

    @property
    def pending(self) -> int:
        """Requests sent and not yet answered (their handles wait)."""
        return self._core.pending

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has begun."""
        return self._core.closed

    @property
    def gone(self) -> str | None:
        """Why the scheduler is gone, or None while it runs (see ``AsyncEngine.gone``)."""
        return self._core.gone

    @property
    def replica_pids(self) -> list[tuple[int, ...]]:
        """The process ids of each data-parallel replica (see ``AsyncEngine``)."""
        return self._core.replica_pids

    # -- requests ---------------------------------------------------------------------

    def submit(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               stream: bool = False, return_logprob: bool = False,
               rid: str | None = None, dp_rank: int | None = None) -> RequestHandle:
        """Send a generate request; returns its handle at once.

        ``stream=True`` has the scheduler send each step's tokens as it makes
        them (iterate the handle). ``dp_rank`` pins the request to one
        data-parallel replica.

        Raises:
            Overloaded: the scheduler's work channel stayed full for the
                channel's send timeout (nothing was sent).
            InvalidRequest, ValueError, EngineClosed, SchedulerGone: as
                :meth:`AsyncEngine.submit <scheduler.AsyncEngine.submit>`.
        """
        req = self._core._generate_req(input_ids, sampling, stream, return_logprob, rid,
                                       dp_rank)
        return self._submit([req])[0]

    def submit_many(self, inputs: Sequence[npt.ArrayLike],
                    sampling: SamplingParams | None = None, *, stream: bool = False,
                    return_logprob: bool = False, dp_rank: int | None = None
                    ) -> list[RequestHandle]:
        """Send several generate requests at once; returns their handles, in order.

        Over zmq they travel as bursts (one message and one encode per up to
        256): much cheaper per request than as many :meth:`submit` calls.
        All are validated before any is sent.

        Raises:
            InvalidRequest, ValueError: one of them is refused (none was sent).
            Overloaded: the work channel stayed full (the message says how
                many were sent; the others have no handle).
            EngineClosed, SchedulerGone: as :meth:`submit`.
        """
        reqs = [self._core._generate_req(ids, sampling, stream, return_logprob, None, dp_rank)
                for ids in inputs]
        return self._submit(reqs)

    def generate(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
                 return_logprob: bool = False, rid: str | None = None,
                 dp_rank: int | None = None, timeout: float | None = None) -> GenerateResult:
        """Generate and wait for the whole answer.

        Raises:
            EngineError: no output within ``timeout`` seconds (the request goes on).
            RequestFailed, InvalidRequest, SchedulerGone: as
                :meth:`AsyncEngine.generate <scheduler.AsyncEngine.generate>`.
        """
        return self.submit(input_ids, sampling, return_logprob=return_logprob, rid=rid,
                           dp_rank=dp_rank).result(timeout)

    def stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               return_logprob: bool = False, rid: str | None = None,
               dp_rank: int | None = None) -> Stream[StreamChunk]:
        """Send the request now; iterate what this returns for new tokens as each step
        produces them.

        Leaving early aborts the request (``break``, :meth:`Stream.close
        <scheduler.Stream.close>`, a ``with`` block's end, garbage collection).

        Raises: as :meth:`submit`; while iterating, as :meth:`generate`.
        """
        handle = self.submit(input_ids, sampling, stream=True,
                             return_logprob=return_logprob, rid=rid, dp_rank=dp_rank)
        return Stream(handle, iter(handle), self._cancel)

    def stream_steps(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None,
                     *, return_logprob: bool = False, rid: str | None = None,
                     dp_rank: int | None = None) -> Stream[list[StreamChunk]]:
        """As :meth:`stream`, but yield every chunk that has arrived, oldest first, as one
        list (never empty). Leaving early aborts the request."""
        handle = self.submit(input_ids, sampling, stream=True, return_logprob=return_logprob,
                             rid=rid, dp_rank=dp_rank)
        return Stream(handle, handle.steps(), self._cancel)

    def _cancel(self, handle: RequestHandle) -> None:
        """The caller left ``handle``'s stream: have the loop forget it and abort its
        request (:meth:`AsyncEngine._cancel`). Never blocks, from any thread (the
        collector may run it on the loop's own); nothing in a forked child, whose
        engine is its parent's, or once the loop is closed."""
        if os.getpid() != self._core._owner:
            return
        try:
            self._loop.call_soon_threadsafe(self._core._cancel, handle)
        except RuntimeError:  # the loop is closed: the close ended every request
            pass

    def embed(self, input_ids: npt.ArrayLike, *, rid: str | None = None,
              dp_rank: int | None = None, timeout: float | None = None
              ) -> npt.NDArray[np.float32]:
        """Embed a tokenized text; returns a unit-norm float32 vector.

        Raises: as :meth:`generate`.
        """
        req = self._core._embed_req(input_ids, dp_rank, rid)
        handle = self._submit([req])[0]
        return handle.embedding(timeout)

    def abort(self, rid: str) -> None:
        """Abort a queued or running request; it ends with finish reason ``abort``.

        Idempotent: aborting a finished, unknown or already aborted request
        does nothing.

        Raises: as :meth:`AsyncEngine.abort <scheduler.AsyncEngine.abort>`.
        """
        self._run(self._core.abort(rid))

    def collective_rpc(self, method: str, *, timeout: float = 30.0,
                       **params: Scalar) -> RpcReqOutput:
        """Call an rpc method on the scheduler and return its reply (calls from several
        threads are in flight at once).

        Raises: as :meth:`AsyncEngine.collective_rpc <scheduler.AsyncEngine.collective_rpc>`.
        """
        return self._run(self._core.collective_rpc(method, timeout=timeout, **params))

    def metrics(self, timeout: float = 30.0) -> str:
        """The scheduler's Prometheus metrics, in the text exposition format.

        Raises: as :meth:`AsyncEngine.metrics <scheduler.AsyncEngine.metrics>`.
        """
        return self._run(self._core.metrics(timeout))

    # -- lifetime ---------------------------------------------------------------------

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish every accepted request with a terminal answer, then stop. Idempotent.

        ``timeout`` bounds the whole close (``None``: as long as it takes): a
        scheduler process still running at its end (hung, stopped) is killed. An
        embedded (ring mode) scheduler is a thread, which cannot be: the close
        waits for the step it is in."""
        self._core._check_process()  # a forked child's close would be the parent's
        close_timeout(timeout)  # (refused before anything is closed)
        if not self._loop_thread.is_alive():
            return
        try:
            self._run(self._core.close(timeout))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop_thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
