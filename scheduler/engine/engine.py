"""``Engine``: the blocking face of :class:`~scheduler.AsyncEngine`. One API, two modes.

As SGLang's ``Engine`` and vLLM's ``LLM`` are of their async cores: it runs
an ``AsyncEngine`` on an event loop of its own (a private thread), and each
call runs the asyncio face's on that loop and waits for it. A request's
outputs reach its :class:`~scheduler.RequestHandle` over a thread-safe
queue. So both faces offer the same methods with the same parameters, and
behave alike, by construction (``tests/scheduler/test_parity.py`` checks the
first); a submit here waits for room on a full work channel.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Self, TypeVar, cast

import numpy.typing as npt

from messages import SamplingParams
from scheduler.core.admission import Limits
from scheduler.dp import Policy
from scheduler.engine.async_engine import EXIT_WAIT_S, AsyncEngine, close_on, close_timeout
from scheduler.engine.handles import RequestHandle, Stream, StreamChunk
from scheduler.errors import EngineClosed
from scheduler.launch.wiring import Endpoints
from scheduler.models.loading import ModelArg, ModelSpec

__all__ = ["Engine"]

P = ParamSpec("P")
T = TypeVar("T")


class _Same(Generic[T]):
    """An attribute of the engine that is its ``AsyncEngine``'s, read from it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Engine, owner: type | None = None) -> T:
        value: T = getattr(engine._core, self.name)
        return value


def _blocking(method: Callable[Concatenate[AsyncEngine, P], Coroutine[Any, Any, T]]
              ) -> Callable[Concatenate[Engine, P], T]:
    """The blocking face of an ``AsyncEngine`` method: the engine's ``AsyncEngine``'s
    (looked up by name at each call, so an override on it is the one run), run on the
    engine's loop and waited for. The same parameters, docstring and errors by
    construction (``inspect.signature`` reads the parameters through ``__wrapped__``)."""
    name = method.__name__

    @functools.wraps(method)
    def call(engine: Engine, /, *args: P.args, **kwargs: P.kwargs) -> T:
        run = cast(Callable[P, Coroutine[Any, Any, T]], getattr(engine._core, name))
        return engine._run(run(*args, **kwargs))

    return call


class Engine:
    """The blocking face of :class:`~scheduler.AsyncEngine`: the same arguments, methods,
    parameters and errors; each call waits for its answer. Safe from any thread."""

    #: As :class:`~scheduler.AsyncEngine`'s (what the engine is, and its state).
    mode: _Same[Literal["ring", "zmq"]] = _Same()
    model: _Same[ModelSpec] = _Same()
    tp_size: _Same[int] = _Same()
    dp_size: _Same[int] = _Same()
    limits: _Same[Limits] = _Same()
    endpoints: _Same[Endpoints] = _Same()
    pending: _Same[int] = _Same()
    closed: _Same[bool] = _Same()
    gone: _Same[str | None] = _Same()
    replica_pids: _Same[list[tuple[int, ...]]] = _Same()

    #: As :class:`~scheduler.AsyncEngine`'s, each run on the loop and waited for (calls
    #: from several threads are in flight at once).
    generate = _blocking(AsyncEngine.generate)
    embed = _blocking(AsyncEngine.embed)
    abort = _blocking(AsyncEngine.abort)
    collective_rpc = _blocking(AsyncEngine.collective_rpc)
    metrics = _blocking(AsyncEngine.metrics)

    def __init__(self, mode: Literal["ring", "zmq"] = "ring", model: ModelArg = None,
                 *, max_batch: int = 64, start_timeout: float = 60.0, tp_size: int = 1,
                 dp_size: int = 1, dp_policy: Policy = "least_loaded",
                 limits: Limits | None = None, metrics: bool = True,
                 pd: tuple[int, int] | None = None) -> None:
        self._core = AsyncEngine(mode, model, max_batch=max_batch, start_timeout=start_timeout,
                                 tp_size=tp_size, dp_size=dp_size, dp_policy=dp_policy,
                                 limits=limits, metrics=metrics, pd=pd)
        self._loop = asyncio.new_event_loop()
        # _lock orders every call's scheduling against the close: once _closing is
        # set (under it), no call reaches the loop, and each call scheduled before
        # is in _calls until it has its answer.
        self._lock = threading.Lock()
        self._closing = False
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self._closed_done = threading.Event()  # the owning close has finished
        # The loop thread holds the loop, not the engine: an engine dropped unclosed is
        # collected, and its finalizer closes it (else its loop thread and scheduler
        # ran for the life of the process).
        self._loop_thread = threading.Thread(target=_serve, args=(self._loop,),
                                             name="engine-loop", daemon=True)
        self._loop_thread.start()
        try:
            self._run(self._core.start())
        except BaseException:
            with self._lock:
                self._closing = True
            self._stop_loop()
            raise
        self._abandoned = weakref.finalize(self, _close_abandoned, self._core, self._loop)
        # Not at exit: an engine still open then is closed by _close_at_exit, waited for.
        self._abandoned.atexit = False
        _open.add(self)

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` on the engine's loop and wait for its outcome (from any thread
        but the loop's own).

        Raises:
            EngineClosed: the engine is closing or closed (refused at once), or it
                closed while ``work`` was running and ``work`` was cancelled.
        """
        try:
            self._core._check_process()  # a forked child has no loop thread to answer
            if threading.get_ident() == self._loop_thread.ident:
                raise RuntimeError("a blocking Engine call from its own event loop's thread")
            with self._lock:
                if self._closing:
                    raise EngineClosed("the engine is closed")
                future = asyncio.run_coroutine_threadsafe(work, self._loop)
                self._calls.add(future)
        except BaseException:
            work.close()
            raise
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._closing:  # its task was cancelled as the loop stopped
                raise EngineClosed("the engine closed before the call finished") from None
            raise
        except BaseException:
            # The wait itself was interrupted (KeyboardInterrupt, or what a signal
            # handler raised, in the caller's thread): the work is cancelled on the
            # loop, as an asyncio caller's cancellation would cancel it (a generate's
            # request is aborted). Nothing, for work that raised (it is done).
            future.cancel()
            raise
        finally:
            with self._lock:
                self._calls.discard(future)

    def submit(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               stream: bool = False, return_logprob: bool = False,
               rid: str | None = None, dp_rank: int | None = None) -> RequestHandle:
        """Send a generate request; returns its handle (iterate it, or wait for its result).

        Raises:
            Overloaded: the scheduler's work channel stayed full for the
                channel's send timeout (nothing was sent).
            InvalidRequest, EngineClosed, SchedulerGone: as
                :meth:`AsyncEngine.submit <scheduler.AsyncEngine.submit>`.
        """
        req = self._core._generate_req(input_ids, sampling, stream, return_logprob, rid,
                                       dp_rank)
        return self._run(self._core._start_waiting([req], RequestHandle))[0]

    def submit_many(self, inputs: Sequence[npt.ArrayLike],
                    sampling: SamplingParams | None = None, *, stream: bool = False,
                    return_logprob: bool = False, dp_rank: int | None = None
                    ) -> list[RequestHandle]:
        """Send several generate requests at once (as bursts); returns their handles.

        Raises: as :meth:`submit` (an ``Overloaded`` says how many were sent; the
        others have no handle).
        """
        reqs = [self._core._generate_req(ids, sampling, stream, return_logprob, None, dp_rank)
                for ids in inputs]
        return self._run(self._core._start_waiting(reqs, RequestHandle))

    def stream(self, input_ids: npt.ArrayLike, sampling: SamplingParams | None = None, *,
               return_logprob: bool = False, rid: str | None = None,
               dp_rank: int | None = None) -> Stream[StreamChunk]:
        """Send the request now; iterate what this returns for new tokens as each step
        produces them. Leaving early aborts the request (``break``, :meth:`Stream.close
        <scheduler.Stream.close>`, a ``with`` block's end, garbage collection).

        Raises: as :meth:`submit`; while iterating, as :meth:`generate`.
        """
        handle = self.submit(input_ids, sampling, stream=True, return_logprob=return_logprob,
                             rid=rid, dp_rank=dp_rank)
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
        """The caller left ``handle``'s stream: have the loop drop it and abort its
        request. Never blocks, from any thread (the collector may run it on the loop's
        own); nothing in a forked child, whose engine is its parent's, or once the loop
        is closed (the close ended every request)."""
        if os.getpid() == self._core._owner:
            with contextlib.suppress(RuntimeError):  # (raised once the loop is closed)
                self._loop.call_soon_threadsafe(self._core._cancel, handle)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish every accepted request with a terminal answer, then stop. Idempotent,
        from any thread: a call made while another thread's close runs waits for that
        close to finish (for at most its own ``timeout``: ``TimeoutError`` past it).
        Every call on other threads ends: one made once the close began raises
        ``EngineClosed`` at once. ``timeout``: as :meth:`AsyncEngine.close
        <scheduler.AsyncEngine.close>`."""
        self._core._check_process()  # a forked child's close would be the parent's
        close_timeout(timeout)  # (refused before anything is closed)
        if threading.get_ident() == self._loop_thread.ident:
            raise RuntimeError("a blocking Engine call from its own event loop's thread")
        with self._lock:
            owner = not self._closing
            self._closing = True  # from here on _run refuses every call
            self._abandoned.detach()
            _open.discard(self)
            if owner and self._loop_thread.is_alive():
                closing = asyncio.run_coroutine_threadsafe(self._core.close(timeout),
                                                           self._loop)
                self._calls.add(closing)
            else:
                closing = None
        if not owner:
            if not self._closed_done.wait(timeout):
                raise TimeoutError(f"the engine's close, begun on another thread, did not "
                                   f"finish within {timeout} s")
            return
        try:
            if closing is not None:
                closing.result()
        finally:
            try:
                self._stop_loop()
            finally:
                self._closed_done.set()

    def _stop_loop(self) -> None:
        """Stop the loop (its thread cancels what is pending and closes it), then fail
        every call still waiting with EngineClosed. Only once ``_closing`` is set."""
        if self._loop_thread.is_alive():
            with contextlib.suppress(RuntimeError):  # (closed already)
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()
        with self._lock:
            left = list(self._calls)
        for future in left:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(EngineClosed("the engine closed before the call "
                                                  "finished"))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """An engine's loop thread: run ``loop`` until stopped, then close it as
    ``asyncio.run`` does (every task still pending cancelled and run to its end)."""
    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.get_loop().run_forever()


log = logging.getLogger("scheduler.engine")

#: Set as each close of an engine collected unclosed ends (what the exit waits for); held
#: by its close until then.
_abandoned_ends: weakref.WeakSet[threading.Event] = weakref.WeakSet()
#: Engines started and not closed (nor collected).
_open: weakref.WeakSet[Engine] = weakref.WeakSet()
# A forked child has no loop thread to end those closes: its exit waits for none.
os.register_at_fork(after_in_child=_abandoned_ends.clear)


def _close_abandoned(core: AsyncEngine, loop: asyncio.AbstractEventLoop) -> None:
    """An engine collected without a close: close its ``core`` on its ``loop``, then stop
    the loop (its thread ends), and warn (``ResourceWarning``, as for an unclosed
    AsyncEngine). Never waits: the collector may run this on any thread, the loop's
    own included. Nothing in a forked child (the loop is the parent's)."""
    if os.getpid() != core._owner:
        return

    async def close() -> None:
        try:
            await core.close()
        finally:
            loop.stop()

    ended = close_on(loop, close)
    if ended is None:  # the loop thread closed it already
        return
    _abandoned_ends.add(ended)
    warnings.warn(f"an Engine ({core.mode} mode, run directory {core._dir}) was collected "
                  f"without close(): its scheduler is stopped now (use 'with "
                  f"Engine(...)', or 'engine.close()')", ResourceWarning,
                  stacklevel=1)


@atexit.register
def _close_at_exit() -> None:
    """As the interpreter exits, close every engine still open (each with its close's
    default timeout) and wait for the closes of engines collected unclosed. Else
    their schedulers ran on as the interpreter was torn down: an embedded one in
    mid-step aborted the process (``terminate called without an active
    exception``), a scheduler process was left to see its parent die. Engines of
    the parent of a forked child are its parent's to close."""
    for engine in list(_open):
        if os.getpid() != engine._core._owner:
            continue
        try:
            engine.close()
        except Exception as exc:  # the next engine is closed still
            log.error("closing an engine at exit failed: %s: %s", type(exc).__name__, exc)
    deadline = time.monotonic() + EXIT_WAIT_S
    for ended in list(_abandoned_ends):
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            log.error("an engine collected unclosed was still closing at exit (%.0f s)",
                      EXIT_WAIT_S)
            break

