"""Shared fixtures: temp-dir ipc endpoints, one torch thread in the test process, the
session's tiny Hugging Face model, and a deadline poller instead of sleeps."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import zmq

_n = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Torch runs one intra-op thread in the test process and in every process the
    tests start, for the whole session.

    The schedulers of ``ring`` mode run in this process, on its thread pool,
    as do the tests' reference forward passes. Their operations are far too
    small to split, and on a 2-core host an idle OpenMP worker spin-waits
    after every parallel region on the core the test's client needs: 1000
    generates in ring mode took 13-17 s with torch's default of two threads,
    1.5-2 s with one. A spawned process does not inherit this process's pool
    size, but reads ``OMP_NUM_THREADS``: the schedulers of a Hugging Face
    model keep torch's default otherwise (the built-in models size their own),
    and a module-scoped engine starts before any function-scoped fixture
    could set it. What a test checks does not depend on it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # read by every process a test starts
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``build_tiny_hf``'s default model (a float64 random Llama and its tokenizer),
    built once for the session.

    Every test that asks for it reads it; one that changes a model directory copies
    this one first. It is the same model whichever test builds it (seeded), so one
    build serves the frontend's and the scheduler's tests alike.
    """
    from scheduler.models.tiny_hf import build_tiny_hf  # (needs the [hf] extra)
    return build_tiny_hf(tmp_path_factory.mktemp("tiny-llama"))


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
