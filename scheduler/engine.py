"""``Engine``: the facade a serving engine imports. One API, two modes.

``Engine(mode="ring")`` embeds the scheduler in this process (its own
thread); ``Engine(mode="zmq")`` runs it in its own process. Either way::

    with Engine() as engine:
        result = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
        for chunk in engine.stream([4, 5], SamplingParams(max_new_tokens=8)):
            ...
        engine.collective_rpc("save_checkpoint", path="/tmp/model.ckpt")
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from typing import Literal, Self, TypeVar

import numpy as np
import numpy.typing as npt

from bus import (
    ChannelClosed,
    Envelope,
    PeerGone,
    PullInbox,
    PushOutbox,
    Receiver,
    Ring,
    RingInbox,
    RpcClient,
)
from bus.channels import Inbox
from messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    DecodeError,
    ErrorOut,
    Output,
    Request,
    RpcReqOutput,
    SamplingParams,
    Scalar,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    token_ids,
)
from scheduler.admission import Limits
from scheduler.errors import (
    EngineClosed,
    EngineError,
    InvalidRequest,
    Overloaded,
    RequestFailed,
    SchedulerGone,
)
from scheduler.handles import GenerateResult, RequestHandle, StreamChunk
from scheduler.model import ModelConfig
from scheduler.tp import TPConfig
from scheduler.wiring import Endpoints, serve_follower, serve_ring, serve_zmq

__all__ = ["Engine", "GenerateResult", "RequestHandle", "StreamChunk"]

R = TypeVar("R", bound=Request)

_Item = StreamChunk | npt.NDArray[np.float32] | EngineError

log = logging.getLogger("scheduler.engine")


class Engine:
    """Wires a scheduler in one of two modes and offers the calls a frontend needs.

    Args:
        mode: ``"ring"`` (scheduler embedded in this process; requests and
            outputs by reference through rings; rpc over zmq) or ``"zmq"``
            (scheduler in its own process; everything over zmq ``ipc://``).
        model: the model's shape and seed.
        max_batch: most requests decoding at once.
        start_timeout: seconds to wait for the scheduler to answer its first rpc.
        tp_size: tensor-parallel ranks (``zmq`` mode): that many scheduler
            processes joined by ``torch.distributed``; rank 0 owns the
            channels and broadcasts every poll, outputs leave from rank 0,
            and an rpc runs on every rank and is answered once.
        limits: admission and output-backlog bounds of the scheduler
            (:class:`~scheduler.Limits`): past them a request fails with
            :class:`~scheduler.Overloaded`.
        metrics: record the scheduler's Prometheus metrics (:meth:`metrics`).

    Every request is validated as the wire would validate it before it is
    sent (:class:`~scheduler.InvalidRequest` at submit), in both modes: a
    request is either refused at once or answered later, never lost.
    """

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelConfig | None = None,
                 *, max_batch: int = 64, start_timeout: float = 60.0,
                 tp_size: int = 1, limits: Limits | None = None,
                 metrics: bool = True) -> None:
        if mode not in ("ring", "zmq"):
            raise ValueError(f"mode must be 'ring' or 'zmq', not {mode!r}")
        if tp_size < 1 or (tp_size > 1 and mode != "zmq"):
            raise ValueError("tp_size > 1 needs mode='zmq' (each rank is a process)")
        self.tp_size = tp_size
        self.mode = mode
        self.model = model or ModelConfig()
        self.limits = limits or Limits()
        self._metrics = metrics
        self._codec: Codec[Request] = Codec(Request)
        self._dir = tempfile.mkdtemp(prefix="tsb-")
        self.endpoints = Endpoints.in_dir(self._dir)
        self._pending: dict[str, RequestHandle] = {}
        # Unique per engine (random prefix) and cheap per request (a counter).
        self._rid_prefix = uuid.uuid4().hex[:12]
        self._rid_seq = itertools.count()
        self._lock = threading.Lock()  # guards _pending
        self._send_lock = threading.Lock()  # serializes sends on the work socket
        self._closed = False
        self._gone: str | None = None
        self._thread: threading.Thread | None = None
        self._procs: list[BaseProcess] = []
        self._ingress: Ring[Request] | None = None
        self._egress: Ring[Output] | None = None
        self._work_out: PushOutbox[Request] | None = None
        out_inbox: Inbox[Output]
        if mode == "ring":
            self._ingress = Ring(1 << 16, name="work")
            self._egress = Ring(1 << 16, name="out")
            ready = threading.Event()
            ingress, egress = self._ingress, self._egress
            self._thread = threading.Thread(
                target=self._run_embedded, args=(ingress, egress, max_batch, ready),
                name="scheduler", daemon=True)
            self._thread.start()
            out_inbox = RingInbox(egress, name="out")
        else:
            out_inbox = PullInbox(Codec(Output), self.endpoints.out, name="out")
            self._work_out = PushOutbox(Codec(Request), self.endpoints.work, name="work")
            ctx = multiprocessing.get_context("spawn")
            tp = TPConfig(tp_size, f"{self._dir}/tp-init") if tp_size > 1 else None
            self._procs.append(ctx.Process(
                target=serve_zmq, args=(self.endpoints, self.model),
                kwargs={"max_batch": max_batch, "tp": tp, "limits": self.limits,
                        "metrics": metrics},
                name="scheduler", daemon=True))
            for rank in range(1, tp_size):
                self._procs.append(ctx.Process(
                    target=serve_follower, args=(rank, tp, self.model),
                    kwargs={"max_batch": max_batch, "limits": self.limits},
                    name=f"scheduler-rank{rank}",
                    daemon=True))
            for proc in self._procs:
                proc.start()
        self._out_inbox = out_inbox
        self._rpc = RpcClient(self.endpoints.rpc, name="rpc")
        self._reader_stop = threading.Event()
        self._reader = threading.Thread(target=self._read_outputs, name="engine-reader",
                                        daemon=True)
        self._reader.start()
        try:
            self.collective_rpc("get_load", timeout=start_timeout)
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------

    def submit(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               stream: bool = False, return_logprob: bool = False,
               rid: str | None = None) -> RequestHandle:
        """Send a generate request; returns its handle at once.

        Raises:
            EngineClosed: the engine is closed.
            SchedulerGone: the scheduler died.
            InvalidRequest: the request breaks the wire's rules (a rid over
                256 characters or not valid text, sampling out of range).
            ValueError: ``input_ids`` are not valid token ids.
        """
        req = TokenizedGenerateReqInput(
            rid=rid if rid is not None else self._new_rid(),
            input_ids=token_ids(input_ids, field="input_ids"),
            sampling=sampling or SamplingParams(), stream=stream, return_logprob=return_logprob)
        return self._submit(req)

    def generate(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
                 return_logprob: bool = False, timeout: float | None = None) -> GenerateResult:
        """Generate and wait for the whole answer.

        Raises:
            RequestFailed: the scheduler rejected the request
                (:class:`~scheduler.Overloaded` when it was too busy).
            InvalidRequest: refused before sending.
            SchedulerGone: the scheduler died meanwhile.
        """
        return self.submit(input_ids, sampling, return_logprob=return_logprob).result(timeout)

    def stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               return_logprob: bool = False) -> Iterator[StreamChunk]:
        """Generate, yielding new tokens as each step produces them."""
        return iter(self.submit(input_ids, sampling, stream=True, return_logprob=return_logprob))

    def embed(self, input_ids: npt.ArrayLike, *, timeout: float | None = None
              ) -> npt.NDArray[np.float32]:
        """Embed a tokenized text; returns a unit-norm float32 vector."""
        req = TokenizedEmbeddingReqInput(rid=self._new_rid(),
                                         input_ids=token_ids(input_ids, field="input_ids"))
        return self._submit(req).embedding(timeout)

    def abort(self, rid: str) -> None:
        """Abort a queued or running request; it ends with finish reason ``abort``.

        Idempotent: aborting a finished, unknown or already aborted request
        does nothing.

        Raises:
            InvalidRequest: ``rid`` is not a valid request id.
            EngineClosed: the engine is closed.
            SchedulerGone: the scheduler died.
        """
        self._send(self._validated(AbortReq(rid=rid)))

    def collective_rpc(self, method: str, *, timeout: float = 30.0,
                       **params: Scalar) -> RpcReqOutput:
        """Call an rpc method on the scheduler and return its reply.

        Raises:
            RpcTimeout: no reply in time.
            SchedulerGone: the scheduler died (reported promptly, not at the timeout).
            EngineClosed: the engine is closed.
            DecodeError: the scheduler's reply could not be decoded.
        """
        if self._closed:
            raise EngineClosed(f"rpc {method!r}: the engine is closed")
        try:
            return self._rpc.call(method, timeout=timeout, alive=self._alive, **params)
        except PeerGone as exc:
            raise SchedulerGone(f"rpc {method!r}: {self._gone or exc}") from exc

    def metrics(self, timeout: float = 30.0) -> str:
        """The scheduler's Prometheus metrics, in the text exposition format.

        Read over rpc, so it is consistent with the scheduler's own step (in
        either mode) and parses with ``prometheus_client.parser``.

        Raises:
            RequestFailed: the engine was built with ``metrics=False``.
            EngineClosed, SchedulerGone, RpcTimeout: as :meth:`collective_rpc`.
        """
        reply = self.collective_rpc("metrics", timeout=timeout)
        if not reply.success or reply.result is None:
            raise RequestFailed(reply.rid, "metrics", reply.message)
        pieces = reply.result.get("text")
        return "".join(str(p) for p in pieces) if isinstance(pieces, list) else ""

    def close(self, timeout: float = 30.0) -> None:
        """Finish every accepted request with a terminal answer, then stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._alive():
            try:
                self._rpc.call("shutdown", timeout=timeout, alive=self._alive)
            except Exception as exc:  # still tear down
                log.warning("shutdown rpc failed: %s", exc)
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            if self._gone is not None:  # a rank died: the others may wait on it forever
                proc.kill()
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._reader_stop.set()
        self._reader.join(timeout)
        self._fail_all(EngineClosed("the engine closed before the request finished"))
        self._rpc.close()
        self._out_inbox.close()
        if self._work_out is not None:
            self._work_out.close()
        for ring in (self._ingress, self._egress):
            if ring is not None:
                ring.release()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------

    def _new_rid(self) -> str:
        return f"{self._rid_prefix}-{next(self._rid_seq)}"

    def _run_embedded(self, ingress: Ring[Request], egress: Ring[Output], max_batch: int,
                      ready: threading.Event) -> None:
        try:
            # Requests are validated at submit (_validated), so the ring need
            # not check them again.
            serve_ring(ingress, egress, self.endpoints.rpc, self.model, max_batch=max_batch,
                       limits=self.limits, validate=False, metrics=self._metrics,
                       ready=ready)
        except BaseException as exc:
            self._gone = f"the embedded scheduler crashed: {exc!r}"
            log.exception("embedded scheduler crashed")

    def _alive(self) -> bool:
        if self._procs:
            for proc in self._procs:
                if not proc.is_alive():
                    self._gone = self._gone or (f"scheduler process {proc.name} exited "
                                                f"(exit code {proc.exitcode})")
                    return False
            return True
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

    def _submit(self, req: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
                ) -> RequestHandle:
        req = self._validated(req)
        handle = RequestHandle(req.rid)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if self._gone is not None:
                raise SchedulerGone(self._gone)
            if req.rid in self._pending:
                raise ValueError(f"request id {req.rid!r} is already pending")
            self._pending[req.rid] = handle
        try:
            self._send(req)
        except BaseException:
            with self._lock:
                self._pending.pop(req.rid, None)
            raise
        return handle

    def _send(self, req: Request) -> None:
        if self._closed:
            raise EngineClosed("the engine is closed")
        if self._gone is not None:
            raise SchedulerGone(self._gone)
        if self._ingress is not None:
            try:
                self._ingress.put(req, timeout=30.0)
            except ChannelClosed as exc:
                raise EngineClosed("the engine is closed") from exc
            return
        assert self._work_out is not None
        with self._send_lock:  # a zmq socket is not thread-safe
            self._work_out.send(req)

    def _read_outputs(self) -> None:
        receiver: Receiver[Output] = Receiver([self._out_inbox], budget=1024)
        while True:
            if not receiver.wait(0.1):
                if self._reader_stop.is_set():
                    return
                if not self._alive():
                    self._fail_all(SchedulerGone(self._gone or "the scheduler is gone"))
                continue
            for env in receiver.poll():
                if isinstance(env, Envelope):
                    self._deliver(env.message)
                else:
                    log.error("undecodable output from the scheduler: %s", env.error)

    def _deliver(self, out: Output) -> None:
        if isinstance(out, BatchTokenIDOut):
            bounds = out.offsets()
            ids = out.output_ids.tolist()  # one conversion for the whole batch
            lps = out.logprobs.tolist() if out.logprobs is not None else None
            for i, (rid, fin) in enumerate(zip(out.rids, out.finished_reasons, strict=True)):
                a, b = bounds[i], bounds[i + 1]
                self._put(rid, StreamChunk(rid, ids[a:b], fin, None if lps is None else lps[a:b]),
                          final=fin is not None)
        elif isinstance(out, BatchEmbeddingOut):
            rows = out.embeddings.float().numpy()
            for i, rid in enumerate(out.rids):
                self._put(rid, rows[i].copy(), final=True)
        elif isinstance(out, ErrorOut):
            error = Overloaded if out.code == "overloaded" else RequestFailed
            self._put(out.rid, error(out.rid, out.code, out.message), final=True)
        else:
            log.error("unexpected output %s on the transport", type(out).__name__)

    def _put(self, rid: str, item: _Item, *, final: bool) -> None:
        with self._lock:
            handle = self._pending.pop(rid, None) if final else self._pending.get(rid)
        if handle is None:
            log.debug("output for unknown request %r dropped", rid)
            return
        handle._queue.put(item)

    def _fail_all(self, error: EngineError) -> None:
        with self._lock:
            handles = list(self._pending.values())
            self._pending.clear()
        for h in handles:
            h._queue.put(error)

