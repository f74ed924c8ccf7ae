"""Servers shared by a module's tests (each start costs a scheduler), stopped at its end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from frontend import ByteTokenizer, Settings
from scheduler import ModelConfig
from tests.frontend.server import Server

BYTES = ByteTokenizer()


@pytest.fixture(scope="module", params=["ring", "zmq"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """A frontend in each mode, byte-level tokenizer, the tiny GRU sized to it."""
    s = Server(Settings(mode=request.param, model=ModelConfig(vocab_size=BYTES.vocab_size)),
               BYTES)
    yield s
    s.stop()
