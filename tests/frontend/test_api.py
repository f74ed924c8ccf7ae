"""The OpenAI surface through a real server, in both modes, with the official client."""

from __future__ import annotations

import base64
import json
import re
import socket
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bus import RpcClient
from frontend import ByteTokenizer, Settings, generate
from messages.checks import prompt_problem
from scheduler import Limits, ModelConfig
from tests.conftest import eventually
from tests.frontend.server import Server, openai_client, raw_post


def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


def test_completion_whole_and_streamed_agree(server: Server) -> None:
    c = client(server)
    whole = c.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(b"Hello")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    pieces, finishes, usage = [], [], None
    for chunk in c.completions.create(model="tiny", prompt="Hello", max_tokens=12,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
        else:
            usage = chunk.usage
    assert "".join(pieces) == choice.text  # greedy: the same answer, streamed or not
    assert finishes[-1] == choice.finish_reason and all(f is None for f in finishes[:-1])
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_continuous_usage_stats_count_each_step(server: Server) -> None:
    # stream_options.continuous_usage_stats (OpenAI's, vLLM's): every chunk carries the
    # usage so far; it was accepted and silently ignored before.
    c = client(server)
    options = {"include_usage": True, "continuous_usage_stats": True}
    counts = []
    for chunk in c.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                      temperature=0, stream=True,  # exactly 6 steps:
                                      extra_body={"stream_options": options,
                                                  "ignore_eos": True}):
        assert chunk.usage is not None, chunk
        assert chunk.usage.prompt_tokens == len(b"Hello")
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + \
            chunk.usage.completion_tokens
        counts.append(chunk.usage.completion_tokens)
    # One event per step (one token each), then the usage chunk with the total.
    assert counts == [1, 2, 3, 4, 5, 6, 6]
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    chat = [ch.usage.completion_tokens if ch.usage else None for ch in
            c.chat.completions.create(model="tiny", messages=hi, max_tokens=3, temperature=0,
                                      stream=True, extra_body={"stream_options": options})]
    assert chat[-1] is not None and chat[:-1] == list(range(1, len(chat)))


def _http_1_0(server: Server, body: dict[str, object]) -> tuple[bytes, bytes]:
    """POST ``body`` as HTTP/1.0; (head, body) of the answer, read until the close."""
    request = raw_post("/v1/completions", body).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        got = b""
        while data := sock.recv(65536):
            got += data
    head, _, rest = got.partition(b"\r\n\r\n")
    return head.lower(), rest


def test_http_1_0_answers_are_not_chunked(server: Server) -> None:
    # HTTP/1.0 has no chunked coding (nginx's proxy_pass speaks it by default): a
    # stream's body ends at the close. uvicorn chunked it, and the chunk sizes were
    # read as part of the events.
    # ignore_eos: exactly 3 tokens, whatever the untrained model samples.
    head, body = _http_1_0(server, {"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                    "ignore_eos": True, "stream": True})
    assert head.startswith(b"http/1.1 200") and b"transfer-encoding" not in head
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""], body
    assert all(e.startswith(b"data: {") for e in events[:-2]) and len(events) >= 3
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "length"
    head, body = _http_1_0(server, {"model": "tiny", "prompt": "Hi", "max_tokens": 3,
                                    "ignore_eos": True})
    assert b"transfer-encoding" not in head and b"content-length: %d" % len(body) in head
    assert json.loads(body)["usage"]["completion_tokens"] == 3


def test_chat_whole_and_streamed(server: Server) -> None:
    c = client(server)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                      temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens <= 10
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_greedy_is_deterministic_and_a_seed_reproduces(server: Server) -> None:
    c = client(server)
    greedy = [c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=16,
                                   temperature=0).choices[0].text for _ in range(2)]
    assert greedy[0] == greedy[1]
    seeded = [c.completions.create(model="tiny", prompt="x", max_tokens=16, temperature=1.0,
                                   seed=7).choices[0].text for _ in range(2)]
    other = c.completions.create(model="tiny", prompt="x", max_tokens=16, temperature=1.0,
                                 seed=8).choices[0].text
    assert seeded[0] == seeded[1]
    assert other != seeded[0]


def test_options_that_ask_for_nothing_are_served(server: Server) -> None:
    # Without this: each was a 400 (an unknown field, or seed below 0), though none asks
    # for anything; LangChain and agent frameworks send them.
    c = client(server)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                      temperature=0).choices[0].message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    served: list[dict[str, object]] = [
        {"response_format": {"type": "text"}}, {"tools": []}, {"tool_choice": "none"},
        {"tools": [tool], "tool_choice": "none"}, {"parallel_tool_calls": False},
        {"tools": [], "parallel_tool_calls": True}]
    for options in served:
        out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                        temperature=0, extra_body=options)
        assert out.choices[0].message.content == plain, options  # the tools are not shown
    # Any int64 seed: a negative one reproduces too, and is not another seed's answer.
    def sampled(seed: int) -> str:
        return c.completions.create(model="tiny", prompt="x", max_tokens=16, temperature=1.0,
                                    seed=seed).choices[0].text

    for seed in (-1, -(1 << 63), (1 << 63) - 1):
        assert sampled(seed) == sampled(seed), seed
    assert sampled(-1) != sampled(1)


def test_logprobs(server: Server) -> None:
    c = client(server)
    out = c.completions.create(model="tiny", prompt="a", max_tokens=5, temperature=0,
                               logprobs=0)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert out.usage is not None and len(lp.token_logprobs) == out.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    offsets = lp.text_offset  # where each token's text begins in the answer
    assert offsets is not None and len(offsets) == len(lp.token_logprobs)
    assert offsets == sorted(offsets) and offsets[-1] <= len(out.choices[0].text)


def test_chat_logprobs_carry_each_tokens_own_bytes(server: Server) -> None:
    out = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=32, seed=3,
        temperature=1.0, logprobs=True, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None
    entries = [(e.token, e.bytes) for e in lp.content]
    assert any(b and b[0] >= 128 for _, b in entries)  # some bytes are not ASCII
    for token, raw in entries:
        if token.startswith("<|"):  # a special token: its name
            continue
        assert raw is not None and len(raw) == 1, (token, raw)  # a byte token is one byte
    # Each token's text is what it adds to the answer (frontend.token_text), and its
    # bytes joined decode to the answer.
    content = out.choices[0].message.content
    assert "".join(t for t, _ in entries if not t.startswith("<|")) == content
    assert bytes(b for _, raw in entries for b in raw or ()).decode(errors="replace") \
        .startswith(content or "")


def test_a_long_id_prompt_takes_the_threaded_check_and_is_answered_as_a_short_one(
        server: Server) -> None:
    # Past the inline bound (checked in a thread): the same answers as inline. That it
    # keeps the loop free is measured by hand (1M ids: 150-240 ms of lag before), not here.
    long = [i % 250 for i in range(20_000)]
    ok = httpx.post(f"{server.url}/v1/completions", timeout=60,
                    json={"model": "tiny", "prompt": long, "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 20_000
    bad = httpx.post(f"{server.url}/v1/completions", timeout=60,
                     json={"model": "tiny", "prompt": [*long, 100_000], "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert "100000 is outside the vocabulary" in bad.json()["error"]["message"]


def test_embeddings_float_and_base64(server: Server) -> None:
    c = client(server)
    out = c.embeddings.create(model="tiny", input=["hello", "world"])  # base64 by default
    assert [d.index for d in out.data] == [0, 1]
    v = np.asarray(out.data[0].embedding)
    assert v.shape == (128,) and abs(float(np.linalg.norm(v)) - 1.0) < 1e-4
    assert out.usage.prompt_tokens == 10
    raw = httpx.post(f"{server.url}/v1/embeddings",
                     json={"model": "tiny", "input": "hello", "encoding_format": "float"})
    assert raw.status_code == 200
    floats = raw.json()["data"][0]["embedding"]
    assert np.allclose(floats, v, atol=1e-6)
    b64 = httpx.post(f"{server.url}/v1/embeddings",
                     json={"model": "tiny", "input": [104, 105], "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), "<f4")
    assert vec.shape == (128,)


def test_models_health_metrics(server: Server) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with client(server) as c:
        assert c.models.retrieve("tiny").id == "tiny"
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("other")
    assert httpx.get(f"{server.url}/health").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    assert "tsb_http_requests_total" in text and "tsb_running_requests" in text
    assert "tsb_http_ttft_seconds_bucket" in text


def test_every_served_name_is_accepted_and_answers_report_the_first() -> None:
    # Without this: one name only (--served-model-name took one), a path's basename.
    tok = ByteTokenizer()
    s = Server(Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"),
                        metrics=False, model_name="org/m", model_aliases=("m", "/srv/m")), tok)
    try:
        c = client(s)
        assert [m.id for m in c.models.list().data] == ["org/m", "m", "/srv/m"]
        for name in ("org/m", "m", "/srv/m"):
            out = c.completions.create(model=name, prompt="x", max_tokens=2)
            assert out.model == "org/m"
            chat = c.chat.completions.create(model=name, max_tokens=2,
                                             messages=[{"role": "user", "content": "x"}])
            assert chat.model == "org/m"
            assert httpx.get(f"{s.url}/v1/models/{name}").json()["id"] == name
        with pytest.raises(openai.NotFoundError, match="'org/m', 'm', '/srv/m'"):
            c.completions.create(model="tiny", prompt="x", max_tokens=2)
    finally:
        s.stop()


def test_every_answer_carries_an_x_request_id(server: Server) -> None:
    # Without this: no x-request-id header (the openai client's request_id was None).
    c = client(server)
    made = c.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=2)
    assert re.fullmatch("[0-9a-f]{32}", made.headers["x-request-id"])
    assert made.request_id == made.headers["x-request-id"]
    mine = {"x-request-id": "trace-1 / span:2"}
    out = c.chat.completions.create(model="tiny", max_tokens=2, extra_headers=mine,
                                    messages=[{"role": "user", "content": "x"}])
    assert out._request_id == "trace-1 / span:2"
    with c.chat.completions.with_streaming_response.create(
            model="tiny", max_tokens=2, stream=True, extra_headers=mine,
            messages=[{"role": "user", "content": "x"}]) as streamed:
        assert streamed.headers["x-request-id"] == "trace-1 / span:2"
        assert "[DONE]" in streamed.read().decode()
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="gpt-9", prompt="x", extra_headers=mine)
    assert info.value.request_id == "trace-1 / span:2"
    # Made anew when the client's cannot be echoed safely (too long, not printable
    # ASCII); errors and other routes carry one too.
    for sent in (b"x" * 257, "caf\u00e9".encode(), b"a\tb"):
        r = httpx.post(f"{server.url}/v1/completions", headers={b"x-request-id": sent},
                       json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"])
    for r in (httpx.post(f"{server.url}/v1/completions", content=b"{", headers=mine),
              httpx.get(f"{server.url}/nowhere", headers=mine),
              httpx.get(f"{server.url}/v1/models", headers=mine),
              httpx.head(f"{server.url}/health", headers=mine)):
        assert r.headers["x-request-id"] == "trace-1 / span:2", r


def test_unknown_model_is_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(server).completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert info.value.status_code == 404
    body = httpx.post(f"{server.url}/v1/completions",
                      json={"model": "gpt-9", "prompt": "x"}).json()
    assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"
    # ... and so is GET /v1/models/gpt-9 (without it: "not_found", "no route")
    body = httpx.get(f"{server.url}/v1/models/gpt-9").json()
    assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"


def test_a_prompt_past_the_wire_s_token_bound_is_400_not_500(server: Server) -> None:
    # Without this: 1.1 MB of text within the 4 MiB body limit tokenized past the
    # wire's 2^20 tokens, and the packing's ValueError became a 500 and a traceback.
    # (Both meet the model's context first: max_model_len is that bound.)
    for path, body in [("/v1/completions", {"model": "tiny", "prompt": "a" * 1_100_000}),
                       ("/v1/embeddings", {"model": "tiny", "input": "a" * 1_100_000})]:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        assert r.status_code == 400, (path, r.text[:300])
        assert r.json()["error"]["code"] == "context_length_exceeded" and "1048576" in r.text


class _Threads(ByteTokenizer):
    """The byte tokenizer, noting the thread each text is tokenized on."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens=add_special_tokens)


def test_embedding_inputs_long_together_are_tokenized_off_the_loop() -> None:
    # Without this: 153 inputs, each under the bound a text is tokenized inline to,
    # held the event loop 1.2-1.5 s (with a BPE tokenizer) one after another.
    tok = _Threads()
    s = Server(Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"),
                        metrics=False), tok)
    try:
        for inputs, inline in ((["a" * 1000] * 40, False), (["a" * 100] * 4, True)):
            tok.threads.clear()
            r = httpx.post(f"{s.url}/v1/embeddings", timeout=60,
                           json={"model": "tiny", "input": inputs})
            assert r.status_code == 200 and len(r.json()["data"]) == len(inputs)
            on_loop = [t == "frontend-test-server" for t in tok.threads]
            assert on_loop == [inline] * len(inputs), tok.threads
    finally:
        s.stop()


def test_many_token_ids_are_checked_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without this: an embedding's ids were checked against the vocabulary on the event
    # loop however many there were (a completion's went to a thread past the bound, as
    # ~1M ids take 150-240 ms to check).
    threads: list[str] = []

    def noting(ids: Sequence[int], vocab_size: int) -> str:
        threads.append(threading.current_thread().name)
        return prompt_problem(ids, vocab_size)

    monkeypatch.setattr(generate, "prompt_problem", noting)
    tok = ByteTokenizer()
    s = Server(Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"),
                        metrics=False), tok)
    try:
        ids = [i % 250 for i in range(2000)]  # (an embedding's list holds 2048 at most)
        for path, field, more in (("/v1/completions", "prompt", {"max_tokens": 1}),
                                  ("/v1/embeddings", "input", {})):
            for prompts, inline in (([ids] * 10, False), ([ids[:100]], True)):
                threads.clear()
                r = httpx.post(f"{s.url}{path}", timeout=60,
                               json={"model": "tiny", field: prompts, **more})
                assert r.status_code == 200, r.text
                on_loop = [t == "frontend-test-server" for t in threads]
                assert on_loop == [inline] * len(prompts), threads
    finally:
        s.stop()


def test_a_batch_of_one_prompt_and_an_empty_suffix_are_served(server: Server) -> None:
    # Without this: LangChain's OpenAI LLM sends prompt=[text]; "suffix": "" asks nothing.
    def post(**body: object) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0, **body})

    plain = post().json()["choices"][0]["text"]
    assert post(prompt=["hi"]).json()["choices"][0]["text"] == plain
    assert post(suffix="").json()["choices"][0]["text"] == plain
    refused = post(suffix="x")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"


def test_several_prompts_are_one_choice_each_in_order(server: Server) -> None:
    # Without this: prompt ["a", "b"] was a 400 and [[1, 2]] a type error (LangChain's
    # OpenAI(...).batch() and .generate([p1, p2]) send them).
    c = client(server)
    texts = ["Hello", "a", "the scheduler", "zz"]
    ids = [[1, 2, 3], [7], [40, 41, 42, 43, 44], [9, 9]]
    for prompts, stop in ((texts, None), (ids, None), (texts, ["q"])):
        alone = [c.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                      stop=stop) for p in prompts]
        out = c.completions.create(model="tiny", prompt=prompts, max_tokens=8,
                                   temperature=0, stop=stop)
        assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
        assert [ch.text for ch in out.choices] == [a.choices[0].text for a in alone]
        assert [ch.finish_reason for ch in out.choices] == [
            a.choices[0].finish_reason for a in alone]
        assert out.usage is not None
        for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert getattr(out.usage, field) == sum(getattr(a.usage, field) for a in alone
                                                    if a.usage is not None), field


def test_several_prompts_streamed_interleave_by_index(server: Server) -> None:
    c = client(server)
    prompts = ["Hello", "a", "the scheduler", "zz"]
    whole = c.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    texts, finishes, ids = ["" for _ in prompts], [None for _ in prompts], set()
    usage = None
    with c.completions.with_streaming_response.create(
            model="tiny", prompt=prompts, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    for line in lines[:-1]:
        event = json.loads(line.removeprefix("data: "))
        ids.add(event["id"])
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            finishes[choice["index"]] = choice["finish_reason"]
        if event.get("usage"):
            usage = event["usage"]
    assert texts == [ch.text for ch in whole.choices]
    assert finishes == [ch.finish_reason for ch in whole.choices]
    assert len(ids) == 1
    assert whole.usage is not None and usage is not None
    assert usage["completion_tokens"] == whole.usage.completion_tokens
    assert usage["total_tokens"] == whole.usage.total_tokens


def test_several_prompts_abort_together(tmp_path: Path) -> None:
    # A client that leaves, or one prompt refused, aborts every prompt's request: none
    # keeps a slot (greedy on the stub never ends by itself).
    tok = ByteTokenizer()
    s = Server(Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"),
                        max_batch=2, limits=Limits(max_queued_requests=2), metrics=False,
                        rpc_endpoint=f"ipc://{tmp_path}/rpc"), tok)
    rpc = RpcClient(f"ipc://{tmp_path}/rpc")

    def load() -> tuple[object, object]:
        result = rpc.call("get_load", timeout=10.0).result
        assert result is not None
        return result["running"], result["queued"]

    endless = {"model": "tiny", "max_tokens": 1_000_000, "temperature": 0,
               "ignore_eos": True}
    try:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(raw_post("/v1/completions", {**endless, "prompt": ["a", "b"]}))
            eventually(lambda: load() == (2, 0), 30.0, "both prompts to run")
        eventually(lambda: load() == (0, 0), 30.0, "both prompts' slots to be freed")
        # Four at once: past the two the queue holds, one is refused (503), and so is
        # the whole request.
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={**endless, "prompt": ["a", "b", "c", "d"]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        eventually(lambda: load() == (0, 0), 30.0, "the others' slots to be freed")
        # Streamed: a 503, or (once another prompt's events began) an error event.
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={**endless, "prompt": ["a", "b", "c", "d"], "stream": True})
        assert r.status_code in (200, 503) and "overloaded" in r.text, r.text
        assert r.status_code == 503 or r.text.endswith("data: [DONE]\n\n")
        eventually(lambda: load() == (0, 0), 30.0, "the streamed ones' slots to be freed")
    finally:
        rpc.close()
        s.stop()


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_whose_scheduler_stops_ends_with_one_error_event(tmp_path: Path,
                                                                  n: int) -> None:
    """The scheduler shuts down under a stream of ``n`` answers, all begun: the stream
    ends with one error event and one [DONE] (without it, for ``n: 2``: one error
    event per answer, each naming no choice)."""
    tok = ByteTokenizer()
    s = Server(Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"),
                        max_batch=2, metrics=False, rpc_endpoint=f"ipc://{tmp_path}/rpc"), tok)
    rpc = RpcClient(f"ipc://{tmp_path}/rpc")
    endless = {"model": "tiny", "prompt": "a", "max_tokens": 1_000_000, "temperature": 1.0,
               "ignore_eos": True, "n": n, "stream": True}

    def running() -> object:
        result = rpc.call("get_load", timeout=10.0).result
        assert result is not None
        return result["running"]

    try:
        with httpx.stream("POST", f"{s.url}/v1/completions", json=endless, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen: set[int] = set()
            while seen != set(range(n)):  # every answer's events have begun
                line = next(lines)
                if line.startswith("data: {"):
                    seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            eventually(lambda: running() == n, 30.0, "every answer to run")
            assert rpc.call("shutdown", timeout=10.0).success
            rest = [line for line in lines if line]
        errors = [line for line in rest if '"error"' in line]
        assert len(errors) == 1 and "shutdown" in errors[0], rest[-5:]
        assert rest[-1] == "data: [DONE]" and rest.count("data: [DONE]") == 1, rest[-5:]
    finally:
        rpc.close()
        s.stop()


def test_answer_ids_carry_the_server_s_run() -> None:
    # Without this: ids restarted at cmpl-0 with each start, and repeated across replicas.
    tok = ByteTokenizer()
    settings = Settings(model=ModelConfig(vocab_size=tok.vocab_size, kind="stub"), metrics=False)
    runs = []
    for _ in range(2):
        s = Server(settings, tok)
        try:
            ids = [httpx.post(f"{s.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "x", "max_tokens": 1}).json()["id"] for _ in range(2)]
        finally:
            s.stop()
        assert all(re.fullmatch(r"cmpl-[0-9a-f]{8}-\d+", i) for i in ids), ids
        assert ids[0] != ids[1] and ids[0].rsplit("-", 1)[0] == ids[1].rsplit("-", 1)[0]
        runs.append(ids[0].rsplit("-", 1)[0])
    assert runs[0] != runs[1]
