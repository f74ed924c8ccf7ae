"""Prompt tokens read from the prefix cache reach OpenAI's
``usage.prompt_tokens_details.cached_tokens``: through a real front door over the
float64 tiny Llama (completions and chat, whole and streamed with
``include_usage``), and in the Python API's :class:`~scheduler.GenerateResult`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")

from frontend.__main__ import parse, settings_from
from messages import SamplingParams
from scheduler import Engine, Limits
from tests.frontend.server import Server

SYSTEM = [(7 * i) % 300 + 3 for i in range(200)]  # a shared system prompt, 200 tokens
# Three turns after it, each starting with a different token: each shares exactly SYSTEM.
FIRST, SECOND, THIRD = [*SYSTEM, 5, 6, 7], [*SYSTEM, 8, 9], [*SYSTEM, 10, 11, 12, 13]
CHAT = {"model": "tiny", "max_tokens": 3, "temperature": 0.0,
        "messages": [{"role": "system", "content": "you answer briefly " * 20},
                     {"role": "user", "content": "what is a prefix cache?"}]}


@pytest.fixture(scope="module")
def model_dir(tiny_hf: Path) -> Path:
    return tiny_hf


def _server(model_dir: Path, ep: Path, *flags: str) -> Server:
    settings, app = settings_from(parse(["--model", str(model_dir), "--served-model-name",
                                         "tiny", "--endpoint", str(ep),
                                         *flags]))
    return Server(settings, app.tokenizer)


def _post(server: Server, path: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def _streamed_usage(server: Server, path: str, body: dict[str, object]) -> dict[str, object]:
    """The usage of the last event with one (``stream_options.include_usage``)."""
    usage: dict[str, object] | None = None
    with httpx.stream("POST", f"{server.url}/v1/{path}", timeout=120, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                usage = event.get("usage") or usage
    assert usage is not None, "no event carried the usage"
    return usage


def _cached(usage: object) -> int:
    assert isinstance(usage, dict)
    details = usage["prompt_tokens_details"]
    assert isinstance(details, dict)
    n = details["cached_tokens"]
    assert isinstance(n, int)
    return n


def _completion(prompt: list[int]) -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def cached_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Server]:
    s = _server(model_dir, tmp_path_factory.mktemp("ep") / "ep")
    yield s
    s.stop()


def test_usage_reports_the_reused_prefix(cached_server: Server) -> None:
    first = _post(cached_server, "completions", _completion(FIRST))["usage"]
    assert _cached(first) == 0  # nothing cached yet
    second = _post(cached_server, "completions", _completion(SECOND))["usage"]
    assert isinstance(second, dict) and second["prompt_tokens"] == len(SECOND)
    assert _cached(second) == len(SYSTEM)  # the shared system prompt, read from the cache
    streamed = _streamed_usage(cached_server, "completions", _completion(THIRD))
    assert _cached(streamed) == len(SYSTEM)
    # The same chat twice: the second reuses all of its prompt but the last token
    # (the one whose logits start the answer).
    whole = _post(cached_server, "chat/completions", CHAT)["usage"]
    again = _streamed_usage(cached_server, "chat/completions", CHAT)
    assert isinstance(whole, dict) and again["prompt_tokens"] == whole["prompt_tokens"]
    prompt = again["prompt_tokens"]
    assert isinstance(prompt, int)
    assert _cached(again) == prompt - 1
    assert _cached(_post(cached_server, "chat/completions", CHAT)["usage"]) == prompt - 1


def test_usage_reports_zero_with_the_cache_off(model_dir: Path, tmp_path: Path) -> None:
    server = _server(model_dir, tmp_path / "ep", "--prefix-cache-bytes", "0")
    try:
        for prompt in (FIRST, SECOND):
            assert _cached(_post(server, "completions", _completion(prompt))["usage"]) == 0
        assert _cached(_streamed_usage(server, "completions", _completion(THIRD))) == 0
    finally:
        server.stop()


def test_generate_result_reports_cached_tokens(model_dir: Path) -> None:
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    with Engine("ring", model_dir) as engine:
        assert engine.generate(FIRST, greedy, timeout=120).cached_tokens == 0
        assert engine.generate(SECOND, greedy, timeout=120).cached_tokens == len(SYSTEM)
        streamed = list(engine.stream(THIRD, greedy))
        assert [c.cached_tokens for c in streamed if c.cached_tokens is not None][-1] \
            == len(SYSTEM)
    with Engine("ring", model_dir, limits=Limits(prefix_cache_bytes=0)) as engine:
        for prompt in (FIRST, SECOND):
            assert engine.generate(prompt, greedy, timeout=120).cached_tokens == 0
