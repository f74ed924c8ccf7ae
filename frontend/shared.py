"""One call in flight at a time: callers that arrive while it runs share its answer.

``/health`` and ``/metrics`` each ask the scheduler over its one rpc socket,
where calls are served one after another, each on a thread of the loop's
executor. While the scheduler is stopped or busy, every such call waits out
its timeout: four load balancers polling ``/health`` waited 5, 10, 15 and
20 s, and each held an executor thread meanwhile (outside probe). Through a
:class:`SharedCall` they wait for the same call, and its answer (or its
error) is everyone's; a caller that leaves (its client gone) does not cancel
it for the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["SharedCall"]

T = TypeVar("T")


class SharedCall(Generic[T]):
    """Awaiting it runs ``call``, unless a run is already in flight: then its result.

    A caller waits at most ``wait_s`` seconds, however long the call is queued
    behind others on the socket (``/health`` behind a ``/metrics`` call to a
    stopped scheduler waited 10 s, outside probe); the call itself goes on.

    Raises (on await): what ``call`` raises, or ``TimeoutError`` past ``wait_s``.
    """

    def __init__(self, call: Callable[[], Awaitable[T]], wait_s: float) -> None:
        self._call = call
        self._wait_s = wait_s
        self._task: asyncio.Task[T] | None = None

    async def __call__(self) -> T:
        task = self._task
        if task is None or task.done():
            task = self._task = asyncio.ensure_future(self._call())
            task.add_done_callback(_retrieved)
        try:
            # shield: one caller cancelled (its client left, or its wait ran
            # out) leaves the call to the others
            async with asyncio.timeout(self._wait_s):
                return await asyncio.shield(task)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self._wait_s:g} s") from None


def _retrieved(task: asyncio.Task[T]) -> None:
    """Reads the outcome, so that a call whose every caller left logs no 'never retrieved'."""
    if not task.cancelled():
        task.exception()
