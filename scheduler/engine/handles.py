"""What a caller holds for a submitted request: its handle, its chunks, its result.

Shared by every engine face: a handle is fed by whichever thread reads the
scheduler's outputs, and read by the caller.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Self, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt

from messages import FinishReason
from scheduler.errors import EngineError

__all__ = ["GenerateResult", "RequestHandle", "Stream", "StreamChunk"]

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


_Item = StreamChunk | npt.NDArray[np.float32] | EngineError


class RequestHandle:
    """A submitted request: iterate its chunks, or wait for its result."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._done = False

    def put(self, item: _Item) -> None:
        """Hand this request an output (called by the engine's reader)."""
        self._queue.put(item)

    @property
    def done(self) -> bool:
        """Whether the caller has taken the request's last answer (or its error)."""
        return self._done

    def _next(self, timeout: float | None) -> _Item:
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"request {self.rid!r}: no output within {timeout} s") from None
        if isinstance(item, EngineError):
            self._done = True
            raise item
        return item

    def __iter__(self) -> Iterator[StreamChunk]:
        """Yield chunks until the request finishes.

        Raises:
            RequestFailed: the scheduler answered with an error.
            SchedulerGone: the scheduler died.
        """
        while not self._done:
            item = self._next(None)
            assert isinstance(item, StreamChunk)
            if item.finish_reason is not None:
                self._done = True
            yield item

    def steps(self) -> Iterator[list[StreamChunk]]:
        """As iterating, but every chunk that has arrived, oldest first, as one list.

        Raises: as iterating; chunks that arrived before an error are yielded first.
        """
        while not self._done:
            got: list[StreamChunk] = []
            item: _Item | None = self._queue.get()
            while item is not None:
                if isinstance(item, EngineError):
                    self._done = True
                    if got:
                        yield got
                    raise item
                assert isinstance(item, StreamChunk)
                got.append(item)
                if item.finish_reason is not None:
                    self._done = True
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            yield got

    def result(self, timeout: float | None = None) -> GenerateResult:
        """Wait for the whole answer (all chunks joined)."""
        ids: list[int] = []
        lps: list[float] | None = None
        tops: list[tuple[tuple[int, float], ...]] | None = None
        cached: int | None = None
        first: StreamChunk | None = None
        while True:
            item = self._next(timeout)
            assert isinstance(item, StreamChunk)
            first = first or item
            ids.extend(item.token_ids)
            if item.top_logprobs is not None:
                tops = [] if tops is None else tops
                tops.extend(item.top_logprobs)
            if item.cached_tokens is not None:
                cached = item.cached_tokens
            if item.logprobs is not None:
                lps = [] if lps is None else lps
                lps.extend(item.logprobs)
            if item.finish_reason is not None:
                self._done = True
                return GenerateResult(self.rid, ids, item.finish_reason, lps, cached, tops,
                                      first.prompt_logprobs, first.prompt_top_logprobs)

    def embedding(self, timeout: float | None = None) -> npt.NDArray[np.float32]:
        """Wait for an embedding request's vector."""
        item = self._next(timeout)
        assert isinstance(item, np.ndarray)
        self._done = True
        return item


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
        return next(self._items)

    def close(self) -> None:
        """Stop reading: abort the request unless it has ended. Idempotent; never
        blocks (the abort is sent by the engine's loop)."""
        cancel, self._cancel = self._cancel, None
        if cancel is None:
            return
        if not self._handle.done:
            cancel(self._handle)
        close = getattr(self._items, "close", None)
        if close is not None:  # later calls end at once
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit, or a broken engine: nothing left to free
            pass
