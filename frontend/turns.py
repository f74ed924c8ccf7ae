"""Turns on the event loop: many requests' work spread over loop iterations, not one.

asyncio runs, in one iteration, every callback and task step that became
ready in the previous one. When 256 streams are woken by one read of the
scheduler's outputs, or 256 requests arrive in one burst, all of their
work runs back to back, and a timer, a new connection, a health check wait
behind all of it: the loop lags by the sum (~100 ms measured with 256
streams, while no single callback took more than a few).

:class:`Turns` bounds that sum. A handler calls :meth:`Turns.take` before
each unit of its work (a request's tokenize-and-submit, a stream's batch of
events). Within a slice of the loop's time (:data:`SLICE_S`) a take returns
at once; past it, takers queue, first come first served, and each later
iteration lets :data:`RELEASE` of them through, so the loop comes back to
its timers and sockets between slices. Total work is unchanged; what
changes is that nobody waits for everybody.

How many are let through adapts to what their turns cost: a batch whose
turns took longer than a slice halves the next one, a batch that took less
than half a slice grows the next by one, between 1 and :data:`RELEASE`. A
fixed 16 let 16 streams' turns of 16 events each run in one iteration:
10-12 ms of loop time, the lag's p99 (measured with 256 HTTP streams).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import Callable

__all__ = ["RELEASE", "SLICE_S", "Turns", "loop_turns"]

#: Seconds of the loop's time one slice may take before takers queue.
SLICE_S = 0.002
#: Most queued takers let through per later loop iteration.
RELEASE = 16


class Turns:
    """Takers of the event loop's time, in slices (see the module docstring).

    Bound to the loop that first calls :meth:`take`; used only from it.
    """

    __slots__ = ("_batch", "_let_at", "_loop", "_queue", "_release", "_slice", "_start",
                 "_ticking")

    def __init__(self, slice_s: float = SLICE_S, release: int = RELEASE) -> None:
        if slice_s <= 0 or release < 1:
            raise ValueError("slice_s must be > 0 and release >= 1")
        self._slice = slice_s
        self._release = release
        self._start: float | None = None  # when the open slice began (None: none open)
        self._queue: deque[asyncio.Future[None] | Callable[[], None]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ticking = False
        self._batch = release  # takers the next tick lets through (adapts; see the module)
        self._let_at: float | None = None  # when the last batch was let through

    @property
    def waiting(self) -> int:
        """Takers queued now."""
        return len(self._queue)

    async def take(self) -> None:
        """Return when this task may do its next unit of work (at once, mostly)."""
        if self._now():
            return
        await self.wait()

    def ready(self) -> bool:
        """Whether this task may do its next unit of work now (it is then taken); else
        ``await`` :meth:`wait`. :meth:`take` without a coroutine made each time: a
        stream takes a turn every step."""
        return self._now()

    async def wait(self) -> None:
        """Wait for this task's turn, in line (only after :meth:`ready` said no)."""
        loop = self._loop
        assert loop is not None
        turn = loop.create_future()
        self._queue.append(turn)
        self._tick_soon()
        await turn  # (cancelled with its task: the tick skips it)

    def call(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` now if the slice allows, else in its turn (a callback's
        :meth:`take`: a protocol's ``data_received`` has no task to await in).
        Returns whether it ran now."""
        if self._now():
            fn()
            return True
        self._queue.append(fn)
        self._tick_soon()
        return False

    def _now(self) -> bool:
        """Whether the next unit of work may run now (opening a slice if none is open)."""
        start = self._start
        if start is None:  # the first taker of an iteration opens a slice
            self._start = time.perf_counter()
            self._tick_soon()
            return True
        return not self._queue and time.perf_counter() - start < self._slice

    def _tick_soon(self) -> None:
        if not self._ticking:
            self._ticking = True
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        """A new loop iteration: close the slice, let the next few takers through."""
        self._ticking = False
        self._start = None
        let_at = self._let_at
        if let_at is not None:  # the last batch ran since: fit the next one to the slice
            spent = time.perf_counter() - let_at
            if spent > self._slice:
                self._batch = max(1, self._batch // 2)
            elif spent < self._slice / 2:
                self._batch = min(self._release, self._batch + 1)
            self._let_at = None
        queue, loop = self._queue, self._loop
        assert loop is not None
        n = 0
        while queue and n < self._batch:
            turn = queue.popleft()
            if not isinstance(turn, asyncio.Future):
                # A callback runs in the next iteration, in order with the tasks let
                # through: its time is counted in the batch's, and what it raises
                # goes to the loop's exception handler, not through this tick.
                loop.call_soon(turn)
                n += 1
            elif not turn.done():
                turn.set_result(None)
                n += 1
        if n:
            # Those just let through run in the next iteration: they are its slice.
            self._start = self._let_at = time.perf_counter()
            self._tick_soon()


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Turns] = \
    weakref.WeakKeyDictionary()


def loop_turns() -> Turns:
    """The running loop's one :class:`Turns`: the server's protocol (a request's bytes)
    and the app (its work, its stream's events) take turns in one line."""
    loop = asyncio.get_running_loop()
    turns = _BY_LOOP.get(loop)
    if turns is None:
        turns = _BY_LOOP[loop] = Turns()
    return turns
