"""The asyncio face's handles: what a request's outputs are delivered to, on the loop.

:class:`AsyncHandle` buffers a stream's chunks, bounded (past
``max_buffered`` items a new chunk is merged into the last one: a slow
consumer holds a bounded number of objects and loses no token).
:class:`AsyncRequest` is a generate request's one answer as an awaitable
with no task of its own; cancelling what awaits it aborts the request.
Both take outputs from any thread (``put``) and resolve on their loop.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator

import numpy as np
import numpy.typing as npt

from messages import FinishReason
from scheduler.engine.handles import GenerateResult, StreamChunk
from scheduler.engine.pending import Item
from scheduler.errors import EngineError

__all__ = ["AsyncHandle", "AsyncRequest", "Answer", "chunks", "steps"]


class _Merged:
    """Chunks merged past the buffer bound: lists extended in place (O(1) a token)."""

    __slots__ = ("cached_tokens", "finish_reason", "logprobs", "prompt", "token_ids",
                 "top_logprobs")

    def __init__(self, token_ids: list[int], logprobs: list[float] | None) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason: FinishReason | None = None
        self.cached_tokens: int | None = None
        self.top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
        self.prompt: StreamChunk | None = None  # the first chunk merged (its prompt's)

    def chunk(self, rid: str) -> StreamChunk:
        """The merged chunks as one."""
        lps, tops = self.logprobs, self.top_logprobs
        first = self.prompt
        return StreamChunk(rid, tuple(self.token_ids), self.finish_reason,
                           None if lps is None else tuple(lps), self.cached_tokens,
                           None if tops is None else tuple(tops),
                           None if first is None else first.prompt_logprobs,
                           None if first is None else first.prompt_top_logprobs)


class AsyncHandle:
    """A request's outputs on the event loop, bounded (see the module docstring)."""

    max_buffered = 64

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.rid = rid
        self._loop = loop
        self._thread = threading.get_ident()
        self._items: deque[Item | _Merged] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        """Hand over one output; safe from any thread."""
        if threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(self._put, item)
        else:
            self._put(item)

    def _put(self, item: Item) -> None:
        items = self._items
        last = items[-1] if items else None
        if (len(items) >= self.max_buffered and isinstance(item, StreamChunk)
                and isinstance(last, StreamChunk | _Merged) and last.finish_reason is None):
            if isinstance(last, StreamChunk):  # copied once, then extended in place
                merged = _Merged(list(last.token_ids), None if last.logprobs is None
                                 else list(last.logprobs))
                merged.cached_tokens = last.cached_tokens
                if last.top_logprobs is not None:
                    merged.top_logprobs = list(last.top_logprobs)
                merged.prompt = last
                last = items[-1] = merged
            last.token_ids.extend(item.token_ids)
            if last.logprobs is not None and item.logprobs is not None:
                last.logprobs.extend(item.logprobs)
            if last.top_logprobs is not None and item.top_logprobs is not None:
                last.top_logprobs.extend(item.top_logprobs)
            last.finish_reason = item.finish_reason
            if item.cached_tokens is not None:
                last.cached_tokens = item.cached_tokens
        else:
            items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (cancelled if its consumer left)
                waiter.set_result(None)

    @property
    def buffered(self) -> int:
        """Outputs waiting for the consumer."""
        return len(self._items)

    def get_nowait(self) -> Item | None:
        """The next output if one waits, else None (an error arrives as an item)."""
        if not self._items:
            return None
        item = self._items.popleft()
        if isinstance(item, _Merged):
            return item.chunk(self.rid)
        return item

    def take(self) -> list[Item]:
        """Every output waiting now, oldest first (at most :attr:`max_buffered` and what
        merged past it); empty if none."""
        items = self._items
        if not items:
            return []
        out = [item.chunk(self.rid) if isinstance(item, _Merged) else item for item in items]
        items.clear()
        return out

    def arrival(self) -> asyncio.Future[None]:
        """A future done when the next output arrives (await it only while empty)."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = self._loop.create_future()
        return waiter

    async def next(self) -> Item:
        """The next output (raises nothing itself: an error arrives as an item)."""
        while (item := self.get_nowait()) is None:
            await self.arrival()
        return item


class Answer:
    """A generate or embed request's one answer: a future on the loop, resolved once.

    ``generate`` needs no queue: a non-streamed request gets one chunk (all its
    tokens) or one error, so awaiting a future costs one wake-up and no frames.
    """

    __slots__ = ("_cached", "_first", "_ids", "_loop", "_lps", "_thread", "_tops", "future",
                 "rid")

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop) -> None:
        self.rid = rid
        self.future: asyncio.Future[StreamChunk | npt.NDArray[np.float32]] = loop.create_future()
        self._loop = loop
        self._thread = threading.get_ident()
        self._ids: list[int] | None = None  # tokens of unfinished chunks, if any came
        self._lps: list[float] | None = None
        self._tops: list[tuple[tuple[int, float], ...]] | None = None
        self._first: StreamChunk | None = None  # (its prompt logprobs, when asked)
        self._cached: int | None = None  # the latest cached_tokens of those chunks

    def put(self, item: Item) -> None:
        """Hand over one output; safe from any thread."""
        if threading.get_ident() != self._thread:
            self._loop.call_soon_threadsafe(self.put, item)
            return
        future = self.future
        if future.done():  # its caller left
            return
        if isinstance(item, EngineError):
            future.set_exception(item)
            self._failed(item)
        elif isinstance(item, StreamChunk) and (self._ids is not None
                                                or item.finish_reason is None):
            if self._ids is None:
                self._ids = []
                self._first = item
            self._ids.extend(item.token_ids)
            if item.cached_tokens is not None:
                self._cached = item.cached_tokens
            if item.logprobs is not None:
                if self._lps is None:
                    self._lps = []
                self._lps.extend(item.logprobs)
            if item.top_logprobs is not None:
                if self._tops is None:
                    self._tops = []
                self._tops.extend(item.top_logprobs)
            if item.finish_reason is not None:
                lps, tops, first = self._lps, self._tops, self._first
                future.set_result(StreamChunk(self.rid, tuple(self._ids), item.finish_reason,
                                              None if lps is None else tuple(lps),
                                              self._cached,
                                              None if tops is None else tuple(tops),
                                              None if first is None else first.prompt_logprobs,
                                              None if first is None
                                              else first.prompt_top_logprobs))
        else:
            future.set_result(item)

    def _failed(self, error: EngineError) -> None:
        """The answer is an error (a hook: see :class:`AsyncRequest`)."""

    def cancelled(self) -> None:
        """Whoever awaited this left: an error already set is seen (never logged
        by asyncio as "never retrieved")."""
        future = self.future
        if future.done() and not future.cancelled():
            future.exception()


class AsyncRequest(Answer):
    """A submitted generate request: ``await`` it for its :class:`~scheduler.GenerateResult`.

    The asyncio twin of :class:`~scheduler.RequestHandle`, with no task of its
    own: many can be awaited one after another, as the threaded face's
    handles are. Cancelling what awaits it aborts the request; one never
    awaited runs to its end (``await engine.abort(request.rid)`` stops it).

    A request that fails while nobody awaits it (fire and forget: ``submit``
    and drop) is not logged by asyncio as "Future exception was never
    retrieved": if it is collected without ever being awaited, ``unseen``
    is called with its error (the engine counts them). Awaited later, it
    raises as usual.

    Raises (when awaited): as :meth:`AsyncEngine.generate`.
    """

    __slots__ = ("__weakref__", "_awaited", "_on_cancel", "_unseen", "_watch")

    def __init__(self, rid: str, loop: asyncio.AbstractEventLoop,
                 on_cancel: Callable[[AsyncRequest], None],
                 unseen: Callable[[EngineError], None] | None = None) -> None:
        super().__init__(rid, loop)
        self._on_cancel = on_cancel
        self._unseen = unseen
        self._awaited = False
        self._watch: weakref.finalize[[EngineError], AsyncRequest] | None = None

    def _failed(self, error: EngineError) -> None:
        if self._awaited:
            return  # whoever awaits it gets the error
        self.future.exception()  # asyncio must not log it; we count it if never awaited
        if self._unseen is not None:
            self._watch = weakref.finalize(self, self._unseen, error)
            self._watch.atexit = False  # counted when collected, not at interpreter exit

    def __await__(self) -> Generator[object, None, GenerateResult]:
        self._awaited = True
        if self._watch is not None:
            self._watch.detach()  # awaited after all: its error is seen
            self._watch = None
        try:
            item = yield from self.future.__await__()
        except asyncio.CancelledError:
            self.cancelled()
            self._on_cancel(self)  # its caller left: free its slot (unless it ended)
            raise
        assert isinstance(item, StreamChunk) and item.finish_reason is not None
        return GenerateResult(item.rid, list(item.token_ids), item.finish_reason,
                              None if item.logprobs is None else list(item.logprobs),
                              item.cached_tokens, None if item.top_logprobs is None
                              else list(item.top_logprobs), item.prompt_logprobs,
                              item.prompt_top_logprobs)


async def chunks(start: Callable[[], AsyncHandle], cancel: Callable[[AsyncHandle], None]
                 ) -> AsyncIterator[StreamChunk]:
    """A stream's chunks, one at a time: ``start()`` sends the request (at the first
    iteration) and returns its handle; leaving before the end calls ``cancel``."""
    handle = start()
    finished = False
    try:
        while not finished:
            # What is buffered is taken without a coroutine; a bare future
            # is awaited only when nothing waits (the per-token hot path).
            item = handle.get_nowait()
            if item is None:
                await handle.arrival()
                continue
            if isinstance(item, EngineError):
                finished = True
                raise item
            assert isinstance(item, StreamChunk)
            finished = item.finish_reason is not None
            yield item
    finally:
        if not finished:  # cancelled, broken out of, or collected: free the slot
            cancel(handle)

async def steps(start: Callable[[], AsyncHandle], cancel: Callable[[AsyncHandle], None]
                ) -> AsyncIterator[list[StreamChunk]]:
    """As :func:`chunks`, but every chunk that has arrived, as one list."""
    handle = start()
    finished = False
    try:
        while not finished:
            items = handle.take()
            if not items:
                await handle.arrival()
                continue
            chunks: list[StreamChunk] = []
            for item in items:  # (an error or a final chunk is the last item)
                if isinstance(item, EngineError):
                    finished = True
                    if chunks:
                        yield chunks
                    raise item
                assert isinstance(item, StreamChunk)
                chunks.append(item)
                finished = item.finish_reason is not None
            yield chunks
    finally:
        if not finished:  # cancelled, broken out of, or collected: free the slot
            cancel(handle)
