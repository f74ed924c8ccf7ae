"""Fixtures the scheduler tests share (the rig: ``tests/scheduler/rig.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from scheduler import Engine
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


@pytest.fixture(scope="module")
def model_dir(tiny_hf: Path) -> Path:
    """A float64-ready tiny random Llama and its tokenizer: the session's (read only)."""
    return tiny_hf


class HFEngines:
    """``zmq`` engines over the session's tiny Hugging Face model, one per ``dp_size``,
    started when a test first asks and shared by every module that asks for them
    (``hf_engines``): their tests only send requests, and each ends what it sends (none
    stops, breaks or reconfigures an engine). A ``dp_size=2`` start costs three
    processes (a dispatcher, two replicas), each a fork and a model build.

    They stop when the last module that uses them is done (``users``: those modules).
    """

    def __init__(self, model: Path, users: set[str]) -> None:
        self._model = model
        self._users = users
        self._engines: dict[int, Engine] = {}

    def get(self, dp_size: int = 1) -> Engine:
        """The engine of ``dp_size`` replicas, idle (nothing pending), started on first use.

        Its schedulers run one intra-op torch thread, as every process the tests
        start does (``one_torch_thread``)."""
        if dp_size not in self._engines:
            self._engines[dp_size] = Engine("zmq", self._model, dp_size=dp_size)
        engine = self._engines[dp_size]
        assert engine.pending == 0, f"the shared dp_size={dp_size} engine was left busy"
        return engine

    def release(self, module: str) -> None:
        """``module`` is done with them: stop them all once no other module needs them."""
        self._users.discard(module)
        if not self._users:
            self.close()

    def close(self) -> None:
        """Stop every engine still running."""
        while self._engines:
            self._engines.popitem()[1].close()


@pytest.fixture(scope="session")
def _hf_engines(request: pytest.FixtureRequest, tiny_hf: Path) -> Iterator[HFEngines]:
    users = {item.nodeid.split("::")[0] for item in request.session.items
             if "hf_engines" in getattr(item, "fixturenames", ())}
    engines = HFEngines(tiny_hf, users)
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def hf_engines(request: pytest.FixtureRequest, _hf_engines: HFEngines) -> Iterator[HFEngines]:
    """The shared Hugging Face ``zmq`` engines (:class:`HFEngines`): a test may send them
    anything and must end what it sends; never close or reconfigure one."""
    yield _hf_engines
    _hf_engines.release(request.node.nodeid)
