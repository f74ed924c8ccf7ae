"""Prefill and decode apart behind the front door (``python -m frontend --mode zmq
--pd 1:1``), driven by the ``openai`` client: streamed and whole answers, completions
and chat, are a colocated door's, token for token (the float64 tiny Llama), with the
first token from the prefill replica and the rest from the decode replica."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("transformers")

from bus import RpcClient
from frontend.__main__ import parse, settings_from
from tests.frontend.server import Server, openai_client

MAX_TOKENS = 12
_RPC_DIRS: list[Path] = []  # each server's --endpoint, the pd door's first
#: Prompts of 1 to 2,000 tokens (ids: the tiny Llama's tokenizer reads them as given).
PROMPTS = [[3 + (11 * k + 5 * n) % 300 for n in range(length)]
           for k, length in enumerate((1, 9, 130, 2000))]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path
            ) -> Iterator[tuple[Server, Server]]:
    """(a --pd 1:1 door, a colocated door) over the session's tiny model (read only); the
    pd door's rpc endpoint is ``server.rpc_dir``."""
    model = tiny_hf
    made: list[Server] = []
    try:
        # The colocated door embeds its scheduler (ring): its answers are any mode's.
        for flags in (["--mode", "zmq", "--pd", "1:1"], ["--mode", "ring"]):
            ep = tmp_path_factory.mktemp("ep") / "ep"
            _RPC_DIRS.append(ep)
            settings, app = settings_from(parse(["--model", str(model), "--served-model-name",
                                                 "tiny", "--endpoint", str(ep), *flags]))
            made.append(Server(settings, app.tokenizer))
        yield made[0], made[1]
    finally:
        for server in made:
            server.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai_client(server, timeout=120)


def _streamed(server: Server, prompt: list[int]) -> list[str]:
    """Each streamed event's text (one token each: logprobs name them)."""
    texts: list[str] = []
    with _client(server) as client:
        for event in client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                stream=True, logprobs=0):
            for choice in event.choices:
                assert choice.logprobs is not None and choice.logprobs.tokens is not None
                texts += choice.logprobs.tokens
    return texts


def _handed_off() -> int:
    """The pd door's dispatcher's count of hand-offs (through its rpc door)."""
    with RpcClient(f"ipc://{_RPC_DIRS[0]}/rpc") as rpc:
        load = rpc.call("get_load", timeout=60).result or {}
    n = load["dispatcher.handed_off"]
    assert isinstance(n, int), load
    return n


def test_streamed_answers_under_pd_are_a_colocated_doors_with_no_gap_or_duplicate(
        servers: tuple[Server, Server]) -> None:
    pd, colocated = servers
    before = _handed_off()
    for prompt in PROMPTS:
        want = _streamed(colocated, prompt)
        got = _streamed(pd, prompt)
        assert len(got) == MAX_TOKENS and got == want, (len(prompt), got, want)
    assert _handed_off() - before == len(PROMPTS)  # each answer's rest came from decode


def test_whole_completions_and_chat_under_pd_are_a_colocated_doors(
        servers: tuple[Server, Server]) -> None:
    pd, colocated = servers
    answers = []
    for server in (pd, colocated):
        with _client(server) as client:
            whole = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                               temperature=0.0).choices[0].text
                     for p in PROMPTS]
            chat = client.chat.completions.create(
                model="tiny", max_tokens=MAX_TOKENS, temperature=0.0,
                messages=[{"role": "user", "content": "hand it over " * 50}])
        answers.append((whole, chat.choices[0].message.content, chat.usage))
    assert answers[0] == answers[1]
