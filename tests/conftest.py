"""Shared fixtures: temp-dir ipc endpoints, and a deadline poller instead of sleeps."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

_n = itertools.count()


@pytest.fixture
def ipc(tmp_path: Path) -> Callable[[str], str]:
    """Make ``ipc://`` endpoints inside the test's temp dir."""

    def make(name: str) -> str:
        return f"ipc://{tmp_path}/{name}-{next(_n)}"

    return make


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A private zmq context, terminated (not hung) at teardown."""
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def eventually(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` until true or fail after ``timeout`` (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)  # sleep-ok: pacing of a deadline poll
