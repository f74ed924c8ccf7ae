"""``AsyncEngine``: the asyncio face of the engine core, for asyncio frontends.

Outputs are read on the event loop itself: ``loop.add_reader`` on the
output inbox's fd (the egress ring's eventfd, or the PULL socket's zmq FD,
drained to empty and re-checked, as its edge-triggered rules require) hands
each output straight to its request's handle. No thread hop per message.
Rpc replies are read the same way (the rpc socket's fd), each handed to the
call waiting on its rid: rpc calls are in flight together, with no thread
and no lock held for one. ``Engine`` runs this class on a private event-loop
thread: it is the one client core under both faces.

Cancellation aborts: cancelling a task awaiting :meth:`AsyncEngine.generate`
or :meth:`AsyncEngine.embed`, or leaving :meth:`AsyncEngine.stream` early
(``break``, ``aclose()``, garbage collection), forgets the request's handle
and sends ``AbortReq`` for it, so the scheduler frees its slot.

Sending never blocks the loop. The requests submitted in one turn of the
loop leave at its end together: over zmq as one burst (one zmq message, one
msgspec call: ``messages.burst``), on the ring in one put; a lone request
leaves as soon as its task awaits. A work channel that is full (a scheduler
not reading) fails them with :class:`~scheduler.Overloaded` when awaited,
and an abort that finds it full waits in order and goes out as soon as
there is room (it is never dropped).

Buffering policy: each request buffers what its consumer has not taken yet.
Past :attr:`AsyncHandle.max_buffered` items, a new token chunk is merged
into the last buffered one instead of queued: a slow consumer of one stream
holds at most that many objects (plus its tokens, which are never dropped),
and delivery to the other streams never waits for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Literal, Self, cast

import numpy as np
import numpy.typing as npt
import zmq

from bus import ChannelClosed, Envelope, LogSummary, PeerGone, Rejected, RpcTimeout
from messages import (
    SEND_BURST,
    AbortReq,
    EncodeError,
    Output,
    Request,
    RpcReqOutput,
    SamplingParams,
    Scalar,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from scheduler.core.admission import Limits
from scheduler.dp import Policy
from scheduler.engine.async_handles import Answer, AsyncHandle, AsyncRequest, chunks, steps
from scheduler.engine.core import SEND_TIMEOUT, P, SchedulerClient
from scheduler.engine.handles import GenerateResult, StreamChunk
from scheduler.engine.pending import Forgotten, Pending
from scheduler.engine.stopping import close_timeout
from scheduler.errors import EngineClosed, EngineError, Overloaded, RequestFailed
from scheduler.handshake import HELLO_METHOD, hello_answer, hello_params
from scheduler.models.loading import ModelArg

__all__ = ["AsyncEngine", "AsyncHandle", "AsyncRequest"]

log = logging.getLogger("scheduler.engine")

#: Sends between two opportunistic reads of the outputs (see ``AsyncEngine._send``).
_READ_EVERY = 32
#: Requests handed an output per loop callback (PendingTable.deliver_rows).
_ROWS_PER_TURN = 512
#: Seconds between two tries to send aborts a full work channel refused.
_RETRY_S = 0.005



class _AbortOf:
    """An abort waiting in this turn's sends for the entry it is for (a cancelled
    request's token, or the handle an explicit abort was for): it becomes an
    ``AbortReq`` at the last moment, and only while that entry holds its rid."""

    __slots__ = ("entry",)

    def __init__(self, entry: Pending) -> None:
        self.entry = entry


class AsyncEngine(SchedulerClient):
    """The engine for asyncio code: the same modes, options and errors as ``Engine``.

    Use it as ``async with AsyncEngine(...) as engine:`` (or ``await
    engine.start()`` and ``await engine.close()``), from one event loop.
    Arguments are :class:`~scheduler.Engine`'s.
    """

    #: Requests that failed (``Overloaded`` above all) and were collected
    #: without ever being awaited: fire-and-forget submits.
    unawaited_failures: int

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelArg = None,
                 *, max_batch: int = 64, start_timeout: float = 60.0, tp_size: int = 1,
                 dp_size: int = 1, dp_policy: Policy = "least_loaded",
                 limits: Limits | None = None, metrics: bool = True,
                 pd: tuple[int, int] | None = None) -> None:
        super().__init__(mode, model, max_batch=max_batch, tp_size=tp_size, dp_size=dp_size,
                         dp_policy=dp_policy, limits=limits, metrics=metrics, pd=pd)
        self._start_timeout = start_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0  # the loop's thread, once started
        self._watchdog: asyncio.Task[None] | None = None
        self._fd = self._outputs_fd
        pollable = self._out_inbox.pollable()
        self._zmq_out = pollable if isinstance(pollable, zmq.Socket) else None
        self._reading = False  # the loop's reader is registered
        self._sent_unread = 0  # sends since outputs were last read
        self._backlog: deque[Envelope[Output] | Rejected] = deque()  # read, not yet delivered
        # Aborts waiting for room on the channel; a cancelled request's as its
        # Forgotten token, turned into an AbortReq only while it holds its rid.
        self._unsent_aborts: deque[Pending | AbortReq] = deque()
        # Sent in this turn of the loop: one burst at its end.
        self._outq: list[Request | _AbortOf] = []
        self._outq_cancels = 0  # _AbortOf items in _outq
        self.unawaited_failures = 0
        self._unseen_log = LogSummary(log, "requests failed with nobody awaiting them")

    async def start(self) -> Self:
        """Start reading outputs on the running loop; wait for the scheduler to answer.

        Raises:
            RpcTimeout: the scheduler did not answer within ``start_timeout``.
            SchedulerGone: it died while starting.
        """
        self._check_process()
        loop = self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        loop.add_reader(self._fd, self._on_readable)
        loop.add_reader(self._rpc.fileno(), self._on_rpc_readable)
        self._reading = True
        self._watchdog = loop.create_task(self._watch())
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

    # -- requests -------------------------------------------------------------

    def _on_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise EngineClosed("the engine is not started (use 'async with' or start())")
        return self._loop

    def _handle(self, rid: str) -> AsyncHandle:
        return AsyncHandle(rid, self._on_loop())

    def _request(self, rid: str) -> AsyncRequest:
        return AsyncRequest(rid, self._on_loop(), self._cancel, self._unseen_failure)

    def _unseen_failure(self, error: EngineError) -> None:
        """A request failed and was collected without ever being awaited: counted,
        and summarized in the log (never a traceback per request)."""
        self.unawaited_failures += 1
        code = getattr(error, "code", type(error).__name__)
        self._unseen_log.add("submit", f"{code}: {error}")

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
        # An awaitable with no frame of its own, not the stream's async
        # generator: the hot path of many short requests.
        request = self.submit(input_ids, sampling, return_logprob=return_logprob, rid=rid,
                              dp_rank=dp_rank)
        if timeout is None:
            return await request
        async with asyncio.timeout(timeout):
            return await request

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
            ValueError: ``input_ids`` are not valid token ids.
        """
        return self._submit(self._generate_req(input_ids, sampling, stream, return_logprob,
                                               rid, dp_rank), self._request)

    def submit_many(self, inputs: Sequence[npt.ArrayLike],
                    sampling: SamplingParams | None = None, *, stream: bool = False,
                    return_logprob: bool = False, dp_rank: int | None = None
                    ) -> list[AsyncRequest]:
        """Send several generate requests at once (one burst); ``await`` each answer.

        All are validated before any is sent.

        Raises:
            InvalidRequest, ValueError: one of them is refused (none was sent).
            EngineClosed, SchedulerGone: as :meth:`submit`.
        """
        reqs = [self._validated(self._generate_req(ids, sampling, stream, return_logprob,
                                                   None, dp_rank)) for ids in inputs]
        requests = [self._request(r.rid) for r in reqs]
        self._register(reqs, requests)
        for req in reqs:  # queued in this turn of the loop: they leave as one burst
            self._send(req)
        return requests

    def stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               return_logprob: bool = False, rid: str | None = None,
               dp_rank: int | None = None) -> AsyncIterator[StreamChunk]:
        """Yield new tokens as each step produces them; leaving early aborts the request.

        Raises (while iterating): as :meth:`generate`.
        """
        return chunks(self._stream_start(input_ids, sampling, return_logprob, rid, dp_rank),
                      self._cancel)

    def stream_steps(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None,
                     *, return_logprob: bool = False, rid: str | None = None,
                     dp_rank: int | None = None) -> AsyncIterator[list[StreamChunk]]:
        """As :meth:`stream`, but yield every chunk that has arrived, oldest first, as one
        list (never empty; one chunk per scheduler step in it).

        For a consumer that writes to a socket: what arrived while it was busy
        is written at once, one write for many steps, not one a step. Leaving
        early aborts the request.

        Raises (while iterating): as :meth:`generate`; chunks that arrived
        before an error are yielded first.
        """
        return steps(self._stream_start(input_ids, sampling, return_logprob, rid, dp_rank),
                     self._cancel)

    def _stream_start(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None,
                      return_logprob: bool, rid: str | None, dp_rank: int | None
                      ) -> Callable[[], AsyncHandle]:
        """Sends the stream's request when called (at its first iteration, not before)."""
        return lambda: self._submit(self._generate_req(input_ids, sampling, True,
                                                       return_logprob, rid, dp_rank),
                                    self._handle)

    async def embed(self, input_ids: npt.ArrayLike, *, rid: str | None = None,
                    dp_rank: int | None = None, timeout: float | None = None
                    ) -> npt.NDArray[np.float32]:
        """Embed a tokenized text; returns a unit-norm float32 vector.

        Raises: as :meth:`generate`.
        """
        answer = self._submit(self._embed_req(input_ids, dp_rank, rid),
                              lambda rid: Answer(rid, self._on_loop()))
        try:
            async with asyncio.timeout(timeout):
                item = await answer.future
        except asyncio.CancelledError:
            answer.cancelled()
            self._cancel(answer)
            raise
        except TimeoutError:
            answer.cancelled()
            self._cancel(answer)
            raise
        assert isinstance(item, np.ndarray)
        return item

    def _submit_now(self, reqs: Sequence[TokenizedGenerateReqInput
                                          | TokenizedEmbeddingReqInput],
                    make: Callable[[str], P], *, on_loop: bool = True
                    ) -> tuple[list[Request], list[P], int]:
        """Validate and register ``reqs`` with the handles ``make`` builds, and send what
        the work channel takes now, in order (the threaded face's submit: what is left
        goes with :meth:`_send_rest`). Returns (the requests, their handles, how many
        were sent).

        Safe from another thread than the loop's with ``on_loop=False`` (the
        table and the sends take their locks; what the loop queued this turn,
        and its opportunistic read, are left to the loop): a blocking caller
        submits with no hop to the loop.

        Raises:
            InvalidRequest: one is refused (none was sent).
            EngineClosed, SchedulerGone: as :meth:`submit`.
        """
        checked: list[Request] = [self._validated(r) for r in reqs]
        handles = [make(r.rid) for r in checked]
        self._register(checked, handles)
        if on_loop:
            self._flush_sends()  # what this turn queued goes first
        try:
            self._check_open()
            sent = self._send_nowait(checked)
        except BaseException:
            self._table.unregister(handles)
            raise
        if on_loop:
            self._after_sends(sent)
        return checked, handles, sent

    async def _send_rest(self, reqs: list[Request], handles: Sequence[Pending],
                         sent: int) -> None:
        """Send ``reqs[sent:]``, waiting for room on a full work channel (the threaded
        face's backpressure); those not sent when it fails are unregistered.

        Raises:
            Overloaded: no room for the channel's send timeout in a row (says how
                many were sent).
            EngineClosed, SchedulerGone: promptly, while waiting.
        """
        since = time.monotonic()
        try:
            while sent < len(reqs):
                await asyncio.sleep(_RETRY_S)
                self._check_open()
                n = self._send_nowait(reqs[sent:])
                if n:
                    sent, since = sent + n, time.monotonic()
                    self._after_sends(n)
                elif time.monotonic() - since > SEND_TIMEOUT:
                    raise Overloaded(reqs[sent].rid, "overloaded", "the scheduler is not "
                                     "taking requests (its work channel stayed full for "
                                     f"{SEND_TIMEOUT:g} s): {sent} of {len(reqs)} were sent")
                elif not self._alive():
                    self._check_open()
        except BaseException:
            self._table.unregister(handles[sent:])
            raise

    async def abort(self, rid: str) -> None:
        """Abort a queued or running request (idempotent).

        Aborts the request that holds ``rid`` now; one that already ended is
        left alone, and so is a later request that reuses the rid while this
        abort waits for room on the work channel.

        Raises:
            InvalidRequest: ``rid`` is not a valid request id.
            EngineClosed, SchedulerGone: as :meth:`generate`.
        """
        req = self._abort_req(rid)
        self._check_open()
        holder = self._table.holder(rid)
        if holder is not None:  # none: it ended (its answer is in): nothing to abort
            self._send_abort(req, holder)

    def _cancel(self, handle: Pending) -> None:
        """The caller of ``handle`` left: forget it and abort its request, best effort.

        By identity: a request that already ended (its final answer is in,
        perhaps not yet consumed) is not aborted, and its rid, which a new
        request may hold by now, is left alone. The abort goes out only while
        the request it is for still holds the rid (:meth:`_abort_now`).
        """
        token = self._forget(handle)
        if token is None or self.closed or self._gone is not None:
            return
        try:
            self._send_abort(token)
        except EngineError:
            pass  # closing or gone: nothing left to free

    def _abort_now(self, item: Pending | AbortReq) -> AbortReq | None:
        """The abort to send for ``item`` (a cancelled request's token, or the handle
        an explicit abort was for) now: only while it still holds its rid (else
        its request ended, and the rid may be a new request's)."""
        if isinstance(item, AbortReq):
            return item
        return AbortReq(rid=item.rid) if self._table.owns(item) else None

    def _send_abort(self, req: AbortReq | Forgotten, holder: Pending | None = None) -> None:
        """Send an abort now, or as soon as the work channel has room: never lost,
        never blocking the loop. One that must wait is kept as the entry it is for
        (``req`` itself for a cancelled request, else ``holder``) and is sent
        only while that entry still holds the rid."""
        entry: Pending | AbortReq = req if isinstance(req, Forgotten) else holder or req
        if self._unsent_aborts:  # keep order behind those already waiting
            self._unsent_aborts.append(entry)
            return
        try:
            self._send(entry if isinstance(entry, AbortReq) else _AbortOf(entry))
        except Overloaded:
            self._queue_abort(entry)

    def _queue_abort(self, entry: Pending | AbortReq) -> None:
        self._unsent_aborts.append(entry)
        if len(self._unsent_aborts) == 1:
            assert self._loop is not None
            self._loop.call_later(_RETRY_S, self._retry_aborts)

    def _retry_aborts(self) -> None:
        waiting = self._unsent_aborts
        while waiting and not self.closed and self._gone is None:
            req = self._abort_now(waiting[0])
            if req is None:  # its request ended meanwhile: nothing to abort
                waiting.popleft()
                continue
            try:
                SchedulerClient._send(self, req)  # now, not at the turn's end
            except Overloaded:
                assert self._loop is not None
                self._loop.call_later(_RETRY_S, self._retry_aborts)
                return
            except EngineError:
                break
            waiting.popleft()
        waiting.clear()

    # -- rpc --------------------------------------------------------------------

    async def collective_rpc(self, method: str, *, timeout: float = 30.0,
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
        """
        self._check_process()
        loop = self._loop
        if loop is None:
            raise EngineClosed("the engine is not started (use 'async with' or start())")
        self._check_open()
        rpc = self._rpc
        answer: asyncio.Future[RpcReqOutput | Exception] = loop.create_future()
        on_loop = self._loop_thread

        def on_reply(reply: RpcReqOutput | Exception) -> None:
            if threading.get_ident() == on_loop:
                _settle(answer, reply)
            else:  # read by a blocking call (the shutdown rpc) on another thread
                loop.call_soon_threadsafe(_settle, answer, reply)

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
        except (PeerGone, ChannelClosed) as exc:
            raise self._rpc_error(method, exc) from exc
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
        return self._metrics_of(await self.collective_rpc("metrics", timeout=timeout))

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
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._flush_sends()  # what this turn submitted goes before the shutdown
        loop = asyncio.get_running_loop()
        # The shutdown rpc and joins block: run them off the loop, which keeps
        # delivering the terminal answers meanwhile.
        await loop.run_in_executor(None, self._shutdown, seconds,
                                   functools.partial(self._stop_reading, loop))
        self._unseen_log.flush()  # the last ones counted, not left unsaid

    def _stop_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._remove_reader(), loop).result()

    async def _remove_reader(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._fd)
        self._loop.remove_reader(self._rpc.fileno())
        self._reading = False
        self._table.deliver_all(self._backlog)  # read but not yet delivered: first, in order
        self._backlog.clear()
        self._read_outputs()  # then what arrived last

    def _send(self, req: Request | _AbortOf) -> None:
        # Never blocks the loop. What is sent in one turn of the loop leaves at
        # its end, together: over zmq as one burst, on the ring in one put (one
        # lock, one wake-up of the scheduler). The lone request of an idle
        # frontend leaves as soon as its task awaits.
        if self._loop is None:
            assert not isinstance(req, _AbortOf)  # nothing is cancelled before start()
            super()._send(req)  # a full work channel: Overloaded at once
            self._after_sends(1)
            return
        self._check_open()
        queue = self._outq
        if isinstance(req, _AbortOf):
            self._outq_cancels += 1
        queue.append(req)
        if len(queue) == 1:
            self._loop.call_soon(self._flush_sends)
        elif len(queue) >= SEND_BURST:
            self._flush_sends()

    def _flush_sends(self) -> None:
        """Send what this turn of the loop submitted, as bursts; what the channel
        does not take fails with Overloaded (an abort waits for room instead)."""
        pending, self._outq = self._outq, []
        if not pending:
            return
        queue: list[Request]
        tokens: dict[int, Pending] = {}  # id(abort) -> the entry it is for
        if self._outq_cancels:  # decided now, at the last moment before sending
            self._outq_cancels = 0
            queue = []
            for item in pending:
                if isinstance(item, _AbortOf):
                    abort = self._abort_now(item.entry)
                    if abort is None:
                        continue  # its request ended: nothing to abort
                    tokens[id(abort)] = item.entry
                    item = abort
                queue.append(item)
        else:
            queue = cast(list[Request], pending)
        error: EngineError | None = None
        rest, sent = queue, 0
        while rest:
            try:
                n = self._send_nowait(rest)
            except EncodeError as exc:  # rest[0] alone cannot go (validated: not expected)
                self._put(rest[0].rid, RequestFailed(rest[0].rid, "invalid_request", str(exc)),
                          final=True)
                rest = rest[1:]
                continue
            except Exception as exc:  # closed under us: nothing more will be sent
                error = EngineClosed(f"the engine closed before sending: {exc}")
                break
            if n == 0:
                break
            sent += n
            rest = rest[n:]
        for req in rest:
            if isinstance(req, AbortReq) and error is None:
                # An abort waits as the entry it is for: checked again then.
                self._queue_abort(tokens.get(id(req), req))
            else:
                self._put(req.rid, error or Overloaded(
                    req.rid, "overloaded", "the scheduler is not taking requests (its work "
                                           "channel is full)"), final=True)
        self._after_sends(sent)

    def _after_sends(self, n: int) -> None:
        # A burst of submits runs in one loop iteration, before the loop polls
        # again: read outputs every so often meanwhile, so delivery overlaps
        # the burst as the threaded face's reader does (one non-blocking poll
        # per _READ_EVERY sends).
        self._sent_unread += n
        if self._sent_unread >= _READ_EVERY and self._reading:
            self._on_readable()

    def _on_readable(self) -> None:
        if not self._reading:  # a call scheduled before the reader was removed
            return
        self._sent_unread = 0
        # A poll at a time, delivered a share of rows at a time: the requests
        # woken run before the next share, and a flood of outputs never holds
        # the loop for longer than one share (PendingTable.deliver_rows).
        backlog, more = self._backlog, False
        if not backlog:
            got = self._outputs.poll()
            backlog.extend(got)
            more = len(got) >= self._outputs.budget
        self._table.deliver_rows(backlog, _ROWS_PER_TURN)
        if backlog or more:
            assert self._loop is not None
            self._loop.call_soon(self._on_readable)
            return
        sock = self._zmq_out
        # zmq's FD is edge-triggered: it fires again only after EVENTS is read
        # with nothing left; if messages slipped in meanwhile, go again.
        if sock is not None and cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
            assert self._loop is not None
            self._loop.call_soon(self._on_readable)

    def _on_rpc_readable(self) -> None:
        # Outputs waiting now are delivered before the rpc replies: a reply the
        # scheduler sent after a request's last tokens finds them delivered (a
        # caller that waits for get_load to say idle, then reads its stream).
        if self._reading:
            self._on_readable()
        self._rpc.read_replies()

    async def _watch(self) -> None:
        """Fail every waiting request promptly once the scheduler is gone."""
        while not self.closed:
            await asyncio.sleep(0.1)  # a liveness poll, not a wait for a condition
            self._check_alive()


def _settle(future: asyncio.Future[RpcReqOutput | Exception],
            reply: RpcReqOutput | Exception) -> None:
    """Hand an rpc's reply (or the error that ends it) to its caller, unless it left."""
    if not future.done():
        future.set_result(reply)
