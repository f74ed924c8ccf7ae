"""A request in flight: its state, the chunks and result its caller gets, the handles.

:class:`RequestState` is what the engine's output reader fills, on the
engine's event loop, and its caller reads. Each face hands its caller one
thin handle over it: :class:`~scheduler.AsyncRequest` (awaitable, in
``async_engine``) and :class:`RequestHandle` (readable from any thread, its
outputs passed over a thread-safe queue), with :class:`Stream` for a blocking
stream that aborts its request when left early.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Self, TypeVar, cast

import msgspec
import numpy as np
import numpy.typing as npt

from messages import FinishReason
from scheduler.errors import EngineError

__all__ = ["GenerateResult", "Item", "RequestHandle", "RequestState", "Stream", "StreamChunk",
           "Tops", "ends", "joined"]

T = TypeVar("T")


#: Per token, the most likely ``(id, logprob)`` pairs at its position.
Tops = tuple[tuple[tuple[int, float], ...], ...]


class StreamChunk(msgspec.Struct, frozen=True, gc=False):
    """New tokens of one request (a streamed step, or the whole answer at the end).

    Immutable, and never tracked by the cycle collector (tuples of numbers
    and a str cannot form a cycle): a stream's chunks wait in its buffer
    while the consumer catches up, and 256 streams' buffered chunks and
    their id lists, tracked, made one full collection hold the event loop
    45 ms (measured with 256 HTTP streams).
    """

    rid: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: tuple[float, ...] | None
    #: Prompt tokens read from the prefix cache, on a request's first and last chunks
    #: (None on the others, and from a scheduler that predates it).
    cached_tokens: int | None = None
    #: Per token, its position's most likely ``(id, logprob)`` pairs, most likely first
    #: (``sampling.top_logprobs`` of them, with ``return_logprob``); None when not asked.
    top_logprobs: Tops | None = None
    #: On a request's first chunk, when it asked (``sampling.prompt_logprobs``): the
    #: logprob of each prompt token after the first, and each one's alternatives.
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: Tops | None = None


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """The finished answer to a generate request.

    ``cached_tokens``: how many prompt tokens the replica read from its prefix
    cache instead of computing them (0 with the cache off; None when the
    scheduler did not report it).
    """

    rid: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None
    cached_tokens: int | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: Tops | None = None


#: What a request receives: a chunk, an embedding, or the error that ends it.
Item = StreamChunk | npt.NDArray[np.float32] | EngineError


def ends(item: Item) -> bool:
    """Whether ``item`` is a request's last: an error, an embedding, a final chunk."""
    return not isinstance(item, StreamChunk) or item.finish_reason is not None


def joined(rid: str, items: Sequence[Item]) -> GenerateResult:
    """A generate request's chunks, the last one final, as its one answer: merged as a
    slow stream's buffer merges them (:class:`_Merged`), the prompt's logprobs the first
    chunk's (they travel once, with it)."""
    chunks = cast(Sequence[StreamChunk], items)
    merged = _Merged(chunks[0])
    for chunk in chunks[1:]:
        merged.add(chunk)
    final, first = merged.finish_reason, merged.first
    assert final is not None
    return GenerateResult(rid, merged.token_ids, final, merged.logprobs, merged.cached_tokens,
                          merged.top_logprobs, first.prompt_logprobs, first.prompt_top_logprobs)


class _Merged:
    """Chunks of one request merged (past the buffer bound, or into its answer): lists
    extended in place (O(1) a token). A request's chunks all carry logprobs (and top
    alternatives), or none do: the scheduler groups its outputs by what they carry."""

    __slots__ = ("cached_tokens", "finish_reason", "first", "logprobs", "token_ids",
                 "top_logprobs")

    def __init__(self, first: StreamChunk) -> None:
        self.token_ids = list(first.token_ids)
        self.logprobs = None if first.logprobs is None else list(first.logprobs)
        self.top_logprobs = None if first.top_logprobs is None else list(first.top_logprobs)
        self.finish_reason = first.finish_reason
        self.cached_tokens = first.cached_tokens
        self.first = first  # the first chunk merged: its prompt logprobs, if any

    def add(self, chunk: StreamChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        if self.logprobs is not None and chunk.logprobs is not None:
            self.logprobs.extend(chunk.logprobs)
        if self.top_logprobs is not None and chunk.top_logprobs is not None:
            self.top_logprobs.extend(chunk.top_logprobs)
        self.finish_reason = chunk.finish_reason
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens

    def chunk(self, rid: str) -> StreamChunk:
        lps, tops, first = self.logprobs, self.top_logprobs, self.first
        return StreamChunk(rid, tuple(self.token_ids), self.finish_reason,
                           None if lps is None else tuple(lps), self.cached_tokens,
                           None if tops is None else tuple(tops),
                           first.prompt_logprobs, first.prompt_top_logprobs)


class RequestState:
    """One request in flight: what the engine's output reader fills and its caller reads.

    Lives on the engine's event loop: the reader hands it each output
    (:meth:`put`); its caller takes what arrived (:meth:`take`), awaiting
    :meth:`arrival` while nothing waits. Past :attr:`max_buffered` items a new
    token chunk is merged into the last buffered one: a slow consumer holds a
    bounded number of objects and loses no token, and delivery to the other
    requests never waits for it.

    ``left``: its caller left; its outputs are dropped. The engine keeps it
    under its rid until the scheduler's last answer for it: a request
    reusing the rid before then would receive the old one's outputs.
    """

    max_buffered = 64

    __slots__ = ("items", "left", "rid", "waiter")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.items: deque[Item | _Merged] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.left = False

    def put(self, item: Item) -> None:
        """Hand over one output (on the loop)."""
        if self.left:
            return
        items = self.items
        if len(items) < self.max_buffered or not self._merged(item):
            items.append(item)
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():  # (cancelled if its consumer left)
                waiter.set_result(None)

    def _merged(self, item: Item) -> bool:
        """Merge token chunk ``item`` into the last one buffered (the buffer is full);
        ``False`` where either is not a token chunk or the last ends its request."""
        last = self.items[-1]
        if not isinstance(item, StreamChunk):
            return False
        if isinstance(last, StreamChunk):
            if last.finish_reason is not None:
                return False
            last = self.items[-1] = _Merged(last)  # copied once, then extended in place
        elif not isinstance(last, _Merged) or last.finish_reason is not None:
            return False
        last.add(item)
        return True

    def take(self, one: bool = False) -> list[Item]:
        """The outputs waiting now (``one``: the oldest alone), oldest first; empty if none."""
        items = self.items
        if len(items) == 1 or (one and items):  # (a stream's usual step: one)
            item = items.popleft()
            return [item.chunk(self.rid) if isinstance(item, _Merged) else item]
        out = [i.chunk(self.rid) if isinstance(i, _Merged) else i for i in items]
        items.clear()
        return out

    def arrival(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future on ``loop`` (the engine's: a running-loop lookup is a system call
        in Python 3.11), done when the next output arrives (await it only while empty)."""
        waiter = self.waiter
        if waiter is None or waiter.done():
            waiter = self.waiter = loop.create_future()
        return waiter


class RequestHandle(RequestState):
    """A request submitted from the blocking face: iterate its chunks, or wait for its result.

    Read from any thread: the engine's loop passes each output over a
    thread-safe queue instead of buffering it.
    """

    __slots__ = ("_done", "_got", "_queue")

    def __init__(self, rid: str) -> None:
        super().__init__(rid)
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._done = False
        self._got: list[Item] = []  # what result() took before its timeout

    def put(self, item: Item) -> None:
        if not self.left:
            self._queue.put(item)

    @property
    def done(self) -> bool:
        """Whether the caller has taken the request's last answer (or its error)."""
        return self._done

    def _items(self, timeout: float | None) -> Iterator[list[Item]]:
        """What arrived, a list at a time, until the last; an error is raised after the
        items that came before it. ``timeout``: seconds for the whole, then
        ``TimeoutError`` (the request goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            try:
                items = [self._queue.get(timeout=None if deadline is None
                                         else max(0.0, deadline - time.monotonic()))]
            except queue.Empty:
                raise TimeoutError(f"request {self.rid!r}: no whole answer within {timeout} s "
                                   "(it is still running: wait again, or abort it)") from None
            while not ends(items[-1]):
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._done = ends(items[-1])
            last = items[-1]
            if isinstance(last, EngineError):
                if len(items) > 1:
                    yield items[:-1]
                raise last
            yield items

    def __iter__(self) -> Iterator[StreamChunk]:
        """Yield chunks until the request finishes.

        Raises:
            RequestFailed: the scheduler answered with an error.
            SchedulerGone: the scheduler died.
        """
        for items in self._items(None):
            yield from cast(list[StreamChunk], items)

    def steps(self) -> Iterator[list[StreamChunk]]:
        """As iterating, but every chunk that has arrived, oldest first, as one list.

        Raises: as iterating; chunks that arrived before an error are yielded first.
        """
        return cast(Iterator[list[StreamChunk]], self._items(None))

    def result(self, timeout: float | None = None) -> GenerateResult:
        """Wait for the whole answer (all chunks joined).

        Raises: as iterating; ``TimeoutError`` with no whole answer within ``timeout``
        seconds. The request is the caller's to keep: it is not aborted (call
        ``result`` again for the answer, what arrived so far kept, or abort it).
        """
        for items in self._items(timeout):
            self._got.extend(items)
        return joined(self.rid, self._got)


class Stream(Generic[T]):
    """A blocking stream's items (``Engine.stream``, ``Engine.stream_steps``).

    Leaving it before its end aborts the request, so the scheduler frees its
    slot (as leaving ``AsyncEngine.stream`` early does): :meth:`close`, the
    end of a ``with`` block, or garbage collection (``break`` out of a ``for``
    loop over ``engine.stream(...)`` drops the last reference). After the
    request's last item, or its error, there is nothing to abort.
    """

    def __init__(self, handle: RequestHandle, items: Iterator[T],
                 cancel: Callable[[RequestHandle], None]) -> None:
        self._handle = handle
        self._items = items
        self._cancel: Callable[[RequestHandle], None] | None = cancel

    @property
    def rid(self) -> str:
        """The request's id."""
        return self._handle.rid

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        try:
            return next(self._items)
        except StopIteration:
            raise
        except BaseException:
            # Its items end here (an error ended the request, or the wait was
            # interrupted: Ctrl-C). An interrupted one is aborted now: the traceback
            # holds this stream (an interactive session keeps it), so waiting for its
            # collection left the request running to its last token.
            self.close()
            raise

    def close(self) -> None:
        """Stop reading: abort the request unless it has ended. Idempotent; never
        blocks (the abort is sent by the engine's loop)."""
        cancel, self._cancel = self._cancel, None
        if cancel is None:
            return
        if not self._handle.done:
            cancel(self._handle)
        self._items = iter(())  # later calls end at once

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit, or a broken engine
            self.close()
