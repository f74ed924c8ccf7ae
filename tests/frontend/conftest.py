"""Servers shared by a module's tests (each start costs a scheduler), stopped at its end,
and the Hugging Face doors shared by every module that only asks them questions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from frontend import ByteTokenizer, Settings
from frontend.__main__ import parse, settings_from
from scheduler import ModelConfig
from tests.frontend.server import Server, close_clients

BYTES = ByteTokenizer()


@pytest.fixture(autouse=True)
def _openai_clients_closed() -> Iterator[None]:
    """Every ``openai`` client a test made (``openai_client``) is closed when it ends."""
    yield
    close_clients()


@pytest.fixture(scope="module", params=["ring", "zmq"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A frontend in each mode, byte-level tokenizer, the tiny GRU sized to it."""
    s = Server(Settings(mode=request.param, model=ModelConfig(vocab_size=BYTES.vocab_size)),
               BYTES)
    yield s
    s.stop()


#: The engine's modes behind a Hugging Face door: ``dp2`` is zmq with two data-parallel
#: replicas (requests, guides, logprobs travel through the dispatcher too).
HF_MODES = {"ring": ["--mode", "ring"], "zmq": ["--mode", "zmq"],
            "dp2": ["--mode", "zmq", "--dp-size", "2"]}


class HFDoors:
    """One door per mode over the session's tiny Hugging Face model, started when a
    module first asks for it and stopped when the last module that uses it is done.

    A ``zmq`` door costs a scheduler process, ``dp2`` three (a dispatcher, two
    replicas), each building the model (transformers imported in each: seconds of CPU
    apiece on a 2-core host). Modules whose tests only send requests (none stops,
    breaks or reconfigures its server) share them. ``users`` maps each mode to
    the modules of this session's tests that use it.
    """

    def __init__(self, model: Path, endpoints: pytest.TempPathFactory,
                 users: dict[str, set[str]]) -> None:
        self._model = model
        self._endpoints = endpoints
        self._users = users
        self._doors: dict[str, Server] = {}

    def get(self, mode: str) -> Server:
        """The door of ``mode``, started on first use.

        Its schedulers run one intra-op torch thread, as every process the tests
        start does (``one_torch_thread``): on a busy 2-core host torch's spinning
        threads made 20 guided answers take 27 s instead of 1.
        """
        if mode not in self._doors:
            settings, app = settings_from(parse([
                "--model", str(self._model), "--served-model-name", "tiny",
                *HF_MODES[mode], "--endpoint", str(self._endpoints.mktemp("ep") / "ep")]))
            self._doors[mode] = Server(settings, app.tokenizer)
        return self._doors[mode]

    def release(self, mode: str, module: str) -> None:
        """``module`` is done with ``mode``'s door: stop it once no other module needs it."""
        users = self._users.get(mode, set())
        users.discard(module)
        if not users and mode in self._doors:
            self._doors.pop(mode).stop()

    def close(self) -> None:
        """Stop every door still running."""
        while self._doors:
            self._doors.popitem()[1].stop()


@pytest.fixture(scope="session")
def hf_doors(request: pytest.FixtureRequest, tiny_hf: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[HFDoors]:
    """The shared Hugging Face doors (:class:`HFDoors`); whatever still runs stops at the
    session's end."""
    users: dict[str, set[str]] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "hf_door" in callspec.params:
            users.setdefault(callspec.params["hf_door"], set()).add(
                item.nodeid.split("::")[0])
    doors = HFDoors(tiny_hf, tmp_path_factory, users)
    yield doors
    doors.close()


@pytest.fixture(scope="module", params=list(HF_MODES))
def hf_door(request: pytest.FixtureRequest, hf_doors: HFDoors) -> Iterator[Server]:
    """A Hugging Face door in each mode (``--served-model-name tiny``), shared across
    modules: a test may send it anything, never stop or reconfigure it."""
    yield hf_doors.get(request.param)
    hf_doors.release(request.param, request.node.nodeid)
