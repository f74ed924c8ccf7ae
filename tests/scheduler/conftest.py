"""Fixtures the scheduler tests share (the rig: ``tests/scheduler/rig.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
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


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One intra-op thread here and in the scheduler processes: on a busy 2-core box,
    torch's spinning threads made a tiny model's step 70x slower (0.5 s, not 7 ms),
    long enough for a data-parallel replica to look lost. A module that builds
    Hugging Face models uses it with ``pytestmark = pytest.mark.usefixtures(...)``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_hf: Path) -> Path:
    """A float64-ready tiny random Llama and its tokenizer: the session's (read only)."""
    return tiny_hf
