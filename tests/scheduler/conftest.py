"""Fixtures the scheduler tests share (the rig: ``tests/scheduler/rig.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq

from tests.scheduler.rig import Loop


@pytest.fixture
def make_loop(ctx: zmq.Context[zmq.Socket[bytes]], ipc: Callable[[str], str]
              ) -> Iterator[Callable[..., Loop]]:
    """Build :class:`Loop` rigs (``make_loop("ring", **kw)``); each is closed at teardown."""
    loops: list[Loop] = []

    def make(kind: str, **kw: object) -> Loop:
        loop = Loop(kind, ctx, ipc, **kw)  # type: ignore[arg-type]
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.close()
