"""Structured output through the front door, driven by the official ``openai`` client
against a real server on the float64 tiny Llama (ring, zmq, and zmq with two replicas):
every answer obeys its guide, a guide that cannot compile is a 400 naming its field, an
unguided answer is unchanged, and forced tool calls are valid calls."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("transformers")

from tests.frontend.server import Server, openai_client

#: Nested object, array, enum, string pattern; bounded (maxLength, maxItems) so that the
#: largest answer fits BUDGET tokens (at worst one byte a token).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "size": {"enum": ["small", "medium", "large"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "owner": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "admin": {"type": "boolean"}},
            "required": ["id", "admin"], "additionalProperties": False},
    },
    "required": ["name", "tags", "size", "code", "owner"],
    "additionalProperties": False,
}
BUDGET = 200
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                 "strict": True}}
MESSAGES: Any = [{"role": "user", "content": "the scheduler reads a prompt"}]


@pytest.fixture(scope="module")
def server(hf_door: Server) -> Server:
    """The shared door in each mode (``tests/frontend/conftest.py``): ``dp2`` is zmq with
    two data-parallel replicas (each compiles the guides it is sent)."""
    return hf_door


def _client(server: Server) -> openai.OpenAI:
    return openai_client(server, timeout=120)


def test_json_schema_answers_parse_and_validate(server: Server) -> None:
    client = _client(server)

    def ask(seed: int) -> str:
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES,
            response_format=FORMAT,
            max_tokens=BUDGET, temperature=1.0, seed=seed)
        assert out.choices[0].finish_reason == "stop", out
        return out.choices[0].message.content or ""

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(20)))
    greedy = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=FORMAT,
        max_tokens=BUDGET, temperature=0.0).choices[0].message.content
    for text in [*answers, greedy]:
        jsonschema.validate(json.loads(text or ""), SCHEMA)
    assert len(set(answers)) > 1  # sampled, not one answer


def test_streamed_json_schema_answer_reassembles_to_a_valid_one(server: Server) -> None:
    stream = _client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=FORMAT,
        max_tokens=BUDGET, temperature=1.0, seed=7, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_regex_and_json_object(server: Server) -> None:
    client = _client(server)
    choices = ["yes please", "no thanks", "the queue waits"]
    for seed in range(5):
        out = client.chat.completions.create(
            model="tiny", messages=MESSAGES,
            max_tokens=BUDGET, temperature=1.0, seed=seed,
            extra_body={"guided_choice": choices})
        assert out.choices[0].message.content in choices
    done = client.completions.create(model="tiny", prompt="a model loads", max_tokens=BUDGET,
                                     temperature=0.0,
                                     extra_body={"guided_regex": "[a-z]{2,5}-[0-9]{2}"})
    assert done.choices[0].finish_reason == "stop"
    assert len(done.choices[0].text.split("-")) == 2
    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES,
        response_format={"type": "json_object"}, max_tokens=BUDGET, temperature=0.0)
    if obj.choices[0].finish_reason == "stop":  # (an object's strings are unbounded)
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    schema = client.completions.create(model="tiny", prompt="x", max_tokens=BUDGET,
                                       temperature=0.0, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema"),
    ({"guided_json": {"type": "string", "pattern": "[a-"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
])
def test_a_guide_that_cannot_compile_is_a_400_naming_its_field(
        server: Server, extra: dict[str, object], param: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_unguided_answer_is_unchanged_beside_guided_ones(server: Server) -> None:
    client = _client(server)

    def plain() -> str:
        return client.completions.create(model="tiny", prompt="the cache of keys",
                                         max_tokens=24, temperature=0.0).choices[0].text

    def guided(seed: int) -> object:
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, response_format=FORMAT, max_tokens=BUDGET,
            temperature=1.0, seed=seed)

    alone = plain()
    with ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(guided, i) for i in range(4)]
        beside = [pool.submit(plain) for _ in range(2)]
        assert [f.result() for f in beside] == [alone, alone]
        for f in answers:
            f.result()


# -- tool calls -------------------------------------------------------------------

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99},
    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def _check_calls(calls: Any) -> list[tuple[str, str]]:
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


def _reassembled(chunks: list[Any]) -> list[tuple[str, str]]:
    """Streamed tool-call deltas put together, as a client does (by ``index``)."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name, args = calls.setdefault(d.index, ["", ""])
            calls[d.index] = [name + (d.function.name or ""), args + (d.function.arguments or "")]
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def test_required_tool_choice_answers_are_valid_calls_streamed_or_not(server: Server) -> None:
    client = _client(server)
    for seed in range(6):
        ask: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                    "tool_choice": "required", "max_tokens": BUDGET, "temperature": 1.0,
                    "seed": seed}
        out = client.chat.completions.create(**ask)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = _check_calls(choice.message.tool_calls)
        chunks = list(client.chat.completions.create(**ask, stream=True))
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert _reassembled(chunks) == calls
        # The name first, then the arguments as the model writes them, as OpenAI's.
        args = [c for c in chunks if c.choices and any(
            d.function and d.function.arguments for d in c.choices[0].delta.tool_calls or [])]
        assert len(args) > 1
    one = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=BUDGET, temperature=1.0, seed=3)
    assert len(_check_calls(one.choices[0].message.tool_calls)) == 1


def test_named_tool_choice_streams_its_arguments_and_a_round_trip_renders(
        server: Server) -> None:
    client = _client(server)
    ask: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "add"}},
                "max_tokens": BUDGET, "temperature": 1.0, "seed": 5}
    out = client.chat.completions.create(**ask)
    assert out.choices[0].finish_reason == "stop"  # (as OpenAI gives a named call)
    calls = _check_calls(out.choices[0].message.tool_calls)
    assert [name for name, _ in calls] == ["add"]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 1  # the arguments arrive as the model writes them
    assert _reassembled(chunks) == calls
    call: Any = out.choices[0].message.tool_calls[0]
    history: Any = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    again = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           max_tokens=4, temperature=0.0)
    assert again.usage is not None and out.usage is not None
    # The call and its answer are in the prompt (the tools too: auto shows them).
    assert again.usage.prompt_tokens > out.usage.prompt_tokens + 10


def test_auto_shows_the_tools_and_reads_hermes_calls(server: Server) -> None:
    from frontend.tools import ToolPlan

    client = _client(server)
    usage = [client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=2,
        temperature=0.0).usage for choice in ("none", "auto")]
    assert usage[0] is not None and usage[1] is not None
    assert usage[1].prompt_tokens > usage[0].prompt_tokens + 50  # the tools, rendered
    plan = ToolPlan("auto", TOOLS)
    content, calls = plan.parse('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, '
                                '"b": 2}}\n</tool_call><tool_call>{"name": "get_weather", '
                                '"arguments": {"city": "Oslo", "unit": "c"}}</tool_call>')
    assert content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("add", '{"a":1,"b":2}'), ("get_weather", '{"city":"Oslo","unit":"c"}')]
    assert plan.finish("stop", calls) == "tool_calls"
    assert plan.parse("no calls <tool_call>not json</tool_call>") == (
        "no calls <tool_call>not json</tool_call>", [])


def test_auto_streams_content_and_holds_back_what_may_begin_a_call() -> None:
    from frontend.tools import ToolPlan

    plan = ToolPlan("auto", TOOLS)
    steps = [plan.stream(t, f) for t, f in (
        ("Hello <to", None), ('ol_call>{"name": "ad', None), ('d", "arguments": {"a": 1', None),
        (', "b": 2}}</tool', None), ("_call> bye", "stop"))]
    assert [(c, len(d), f) for c, d, f in steps] == [
        ("Hello ", 0, None), (None, 0, None), (None, 2, None), (None, 1, None),
        ("bye", 0, "tool_calls")]
    # Its id and name once the name is read, then the arguments as they grow.
    first, *pieces = [d for _, ds, _ in steps for d in ds]
    assert (first.index, first.function.name, first.type) == (0, "add", "function")
    assert first.id and all(d.index == 0 and d.id is None for d in pieces)
    assert [d.function.arguments for d in pieces] == ['{"a":1', ',"b":2}']
    whole = ToolPlan("auto", TOOLS).parse('Hello <tool_call>{"name": "add", "arguments": '
                                          '{"a": 1, "b": 2}}</tool_call> bye')[1]
    assert [(c.function.name, c.function.arguments) for c in whole] == [
        ("add", "".join(d.function.arguments for d in pieces))]
    plain = ToolPlan("auto", TOOLS)
    assert [plain.stream(t, f)[0] for t, f in (("a <b", None), ("c <", None), ("", "stop"))] \
        == ["a <b", "c ", "<"]  # ("<b" cannot begin a call; a last "<" can)


def test_a_guide_holds_against_the_sampling_fields_and_each_of_n_answers_is_guided(
        server: Server) -> None:
    """A guide's mask stands whatever a logit_bias, penalty or min_tokens asks (a token
    it forbids stays forbidden); each of n answers is guided; the top alternatives a
    guide forbids are reported at vLLM's floor (-9999), not as a -inf JSON cannot hold."""
    choices = ["yes please", "no thanks"]
    bang = server.app.tokenizer.encode("!", add_special_tokens=False)
    assert len(bang) == 1
    client = _client(server)
    unguided = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.0,
        logit_bias={str(bang[0]): 100})
    assert unguided.choices[0].message.content == "!!!!"  # the bias wins, unguided
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3, n=4,
        logit_bias={str(bang[0]): 100}, presence_penalty=2.0, frequency_penalty=2.0,
        extra_body={"guided_choice": choices, "repetition_penalty": 3.0, "min_tokens": 2},
        logprobs=True, top_logprobs=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.message.content in choices and c.finish_reason == "stop", c
        assert c.logprobs is not None and c.logprobs.content is not None
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
        for e in c.logprobs.content:
            assert len(e.top_logprobs) == 5
            assert all(t.logprob == -9999.0 or t.token[:1] in "yesplanothk " for t in
                       e.top_logprobs), e
    streamed = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3, n=2,
        logit_bias={str(bang[0]): 100}, extra_body={"guided_choice": choices},
        stream=True))
    texts = ["", ""]
    for chunk in streamed:
        for part in chunk.choices:
            texts[part.index] += part.delta.content or ""
    assert all(t in choices for t in texts), texts


def test_each_of_n_forced_tool_calls_is_its_own_call(server: Server) -> None:
    """n answers with a forced tool call: each a valid call with its own id, streamed
    under its own choice index."""
    client = _client(server)
    ask: Any = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "add"}},
                "max_tokens": BUDGET, "temperature": 1.0, "seed": 5, "n": 2}
    out = client.chat.completions.create(**ask)
    ids = set()
    for c in out.choices:
        assert [name for name, _ in _check_calls(c.message.tool_calls)] == ["add"]
        ids.add(c.message.tool_calls[0].id if c.message.tool_calls else None)
    assert len(ids) == 2
    chunks = list(client.chat.completions.create(**ask, stream=True))
    for index in (0, 1):
        mine = [c for c in chunks if c.choices and c.choices[0].index == index]
        assert mine and mine[-1].choices[0].finish_reason == "stop"
        assert [name for name, _ in _reassembled(mine)] == ["add"]
        json.loads(_reassembled(mine)[0][1])


def test_a_required_call_cut_short_is_the_same_call_streamed_or_not(server: Server) -> None:
    # Without this: cut short inside its arguments, the whole answer was the guide's raw
    # JSON array as content (no tool_calls), and the streamed one sent the call's
    # deltas and then that same text as content too.
    client = _client(server)
    long_city: Any = {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 500}}, "required": ["city"]}
    ask: Any = {"model": "tiny", "messages": MESSAGES, "tool_choice": "required",
                "tools": [{"type": "function", "function": {"name": "where",
                                                             "parameters": long_city}}],
                "max_tokens": 60, "temperature": 0.0}
    out = client.chat.completions.create(**ask).choices[0]
    assert out.finish_reason == "length" and out.message.content is None, out
    calls: Any = out.message.tool_calls
    assert [c.function.name for c in calls] == ["where"], calls
    assert calls[0].function.arguments.startswith('{"city":"'), calls
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _reassembled(chunks) == [(c.function.name, c.function.arguments) for c in calls]
