"""``Engine``: the facade a serving engine imports. One API, two modes.

``Engine(mode="ring")`` embeds the scheduler in this process (its own
thread); ``Engine(mode="zmq")`` runs it in its own process. Either way::

    with Engine() as engine:
        result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
        for chunk in engine.stream([4, 5], SamplingParams(max_new_tokens=8)):
            ...
        engine.collective_rpc("save_checkpoint", path="/tmp/model.ckpt")

The threaded face of :class:`~scheduler.engine.core.EngineCore`: a reader
thread hands outputs to each request's queue. ``AsyncEngine`` is the asyncio
face of the same core.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Literal, Self

import numpy as np
import numpy.typing as npt

from messages import RpcReqOutput, SamplingParams, Scalar
from scheduler.core.admission import Limits
from scheduler.dp import Policy
from scheduler.engine.core import EngineCore
from scheduler.engine.handles import GenerateResult, RequestHandle, StreamChunk
from scheduler.engine.stopping import close_timeout
from scheduler.models.loading import ModelArg

__all__ = ["Engine", "GenerateResult", "RequestHandle", "StreamChunk"]


class Engine(EngineCore):
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

    Every request is validated as the wire would validate it before it is
    sent (:class:`~scheduler.InvalidRequest` at submit), in both modes: a
    request is either refused at once or answered later, never lost.
    """

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelArg = None,
                 *, max_batch: int = 64, start_timeout: float = 60.0,
                 tp_size: int = 1, dp_size: int = 1, dp_policy: Policy = "least_loaded",
                 limits: Limits | None = None, metrics: bool = True) -> None:
        super().__init__(mode, model, max_batch=max_batch, tp_size=tp_size, dp_size=dp_size,
                         dp_policy=dp_policy, limits=limits, metrics=metrics)
        self._reader_stop = threading.Event()
        self._reader = threading.Thread(target=self._read_outputs, name="engine-reader",
                                        daemon=True)
        self._reader.start()
        try:
            self._handshake(start_timeout)
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------

    def submit(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               stream: bool = False, return_logprob: bool = False,
               rid: str | None = None, dp_rank: int | None = None) -> RequestHandle:
        """Send a generate request; returns its handle at once.

        ``dp_rank`` pins the request to one data-parallel replica.

        Raises:
            EngineClosed: the engine is closed.
            SchedulerGone: the scheduler died.
            InvalidRequest: the request breaks the wire's rules (a rid over
                256 characters or not valid text, sampling out of range).
            Overloaded: the scheduler's work channel stayed full for the
                channel's send timeout (nothing was sent).
            ValueError: ``input_ids`` are not valid token ids.
        """
        req = self._generate_req(input_ids, sampling, stream, return_logprob, rid, dp_rank)
        return self._submit(req, RequestHandle)

    def submit_many(self, inputs: Sequence[npt.ArrayLike],
                    sampling: SamplingParams | None = None, *, stream: bool = False,
                    return_logprob: bool = False) -> list[RequestHandle]:
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
        reqs = [self._generate_req(ids, sampling, stream, return_logprob, None)
                for ids in inputs]
        return self._submit_many(reqs, RequestHandle)

    def generate(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
                 return_logprob: bool = False, timeout: float | None = None,
                 dp_rank: int | None = None) -> GenerateResult:
        """Generate and wait for the whole answer.

        Raises:
            RequestFailed: the scheduler rejected the request
                (:class:`~scheduler.Overloaded` when it was too busy).
            InvalidRequest: refused before sending.
            SchedulerGone: the scheduler died meanwhile.
        """
        return self.submit(input_ids, sampling, return_logprob=return_logprob,
                           dp_rank=dp_rank).result(timeout)

    def stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               return_logprob: bool = False) -> Iterator[StreamChunk]:
        """Generate, yielding new tokens as each step produces them."""
        return iter(self.submit(input_ids, sampling, stream=True, return_logprob=return_logprob))

    def embed(self, input_ids: npt.ArrayLike, *, timeout: float | None = None,
              dp_rank: int | None = None) -> npt.NDArray[np.float32]:
        """Embed a tokenized text; returns a unit-norm float32 vector."""
        return self._submit(self._embed_req(input_ids, dp_rank),
                            RequestHandle).embedding(timeout)

    def abort(self, rid: str) -> None:
        """Abort a queued or running request; it ends with finish reason ``abort``.

        Idempotent: aborting a finished, unknown or already aborted request
        does nothing.

        Raises:
            InvalidRequest: ``rid`` is not a valid request id.
            EngineClosed: the engine is closed.
            SchedulerGone: the scheduler died.
        """
        self._send(self._abort_req(rid))

    def collective_rpc(self, method: str, *, timeout: float = 30.0,
                       **params: Scalar) -> RpcReqOutput:
        """Call an rpc method on the scheduler and return its reply.

        Raises:
            RpcTimeout: no reply in time.
            SchedulerGone: the scheduler died (reported promptly, not at the timeout).
            EngineClosed: the engine is closed.
            DecodeError: the scheduler's reply could not be decoded.
        """
        return self._call_rpc(method, timeout=timeout, **params)

    def metrics(self, timeout: float = 30.0) -> str:
        """The scheduler's Prometheus metrics, in the text exposition format.

        Raises:
            RequestFailed: the engine was built with ``metrics=False``.
            EngineClosed, SchedulerGone, RpcTimeout: as :meth:`collective_rpc`.
        """
        return self._read_metrics(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish every accepted request with a terminal answer, then stop. Idempotent.

        ``timeout`` bounds the whole close (``None``: as long as it takes): a
        scheduler process still running at its end (hung, stopped) is killed. An
        embedded (ring mode) scheduler is a thread, which cannot be: the close
        waits for the step it is in."""
        self._shutdown(close_timeout(timeout), self._stop_reading)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop_reading(self) -> None:
        self._reader_stop.set()
        self._reader.join()

    def _read_outputs(self) -> None:
        while True:
            if not self.wait_outputs(0.1):
                if self._reader_stop.is_set():
                    return
                self._check_alive()
                continue
            self.read_outputs()
