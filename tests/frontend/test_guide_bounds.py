"""What a client's guide may cost the door: a spec past llguidance's safe bounds, one
that allows no answer, or a body nested past what a decoder recurses through is a 400
naming its field (the door stays up); the check runs off the event loop; the door
remembers verdicts by a hash of the spec; tools are checked whatever ``tool_choice``."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("transformers")

from frontend.__main__ import parse, settings_from
from scheduler.models.tiny_hf import build_tiny_hf
from tests.frontend.server import Server

MESSAGES: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = build_tiny_hf(tmp_path_factory.mktemp("hf") / "tiny")
    settings, app = settings_from(parse([
        "--model", str(model_dir), "--served-model-name", "tiny", "--mode", "ring"]))
    s = Server(settings, app.tokenizer)
    try:
        yield s
    finally:
        s.stop()


def _chain(n: int) -> dict[str, object]:
    """A schema of ``n`` definitions, each referring to the next."""
    defs: dict[str, object] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _post(server: Server, body: dict[str, object] | bytes, path: str = "chat/completions"
          ) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}/v1/{path}", content=body, timeout=120,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{server.url}/v1/{path}", json={
        "model": "tiny", "max_tokens": 4, **({"messages": MESSAGES} if path.startswith("chat")
                                             else {"prompt": "hi"}), **body}, timeout=120)


def _nested(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + "}}" * depth


@pytest.mark.parametrize(("body", "param", "says"), [
    # 1000 chained references (about 950 overflowed llguidance's 8 MiB stack: SIGSEGV)
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": _chain(1000)}}}, "response_format.json_schema.schema", "$ref"),
    ({"guided_grammar": "start: r0\n" + "\n".join(
        f'r{i}: "x{i}" r{i + 1} | "y"' for i in range(3000)) + '\nr3000: "z"'},
     "guided_grammar", "rules"),
    # No answer at all (an empty language, a reference to itself): refused here, not
    # failing midway through decoding.
    # $ref spelled with a JSON escape in a Lark %json block (the text reaches llguidance
    # as written): 300 is past the bound, and short of what overflows a stack.
    ({"guided_grammar": "start: %json " + json.dumps(_chain(300)).replace(
        '"$ref"', '"$r\\u0065f"')}, "guided_grammar", "$ref"),
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex", "no answer"),
    ({"guided_json": {"$ref": "#"}}, "guided_json", "no answer"),
    ({"guided_json": _nested(3000)},  # (a schema given as JSON text)
     "guided_json", "nested too deeply"),
])
def test_a_guide_past_the_bounds_is_a_400_naming_its_field_and_the_door_stays_up(
        server: Server, body: dict[str, object], param: str, says: str) -> None:
    r = _post(server, body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.text[:300]
    assert says in r.json()["error"]["message"], r.text[:300]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_a_body_nested_past_the_decoder_is_a_400_not_a_500(server: Server) -> None:
    head = b'{"model":"tiny","prompt":"hi","max_tokens":4,"guided_json":'
    r = _post(server, head + _nested(5000).encode() + b"}", "completions")
    assert r.status_code == 400, r.text[:300]
    assert "nested too deeply" in r.json()["error"]["message"]


def test_the_check_runs_off_the_event_loop(server: Server) -> None:
    """A big schema's check (seconds) leaves the door answering others meanwhile."""
    schema = {"type": "object", "properties": {f"p{i}_z": {"type": "integer"}
                                               for i in range(10000)},
              "required": [f"p{i}_z" for i in range(10000)]}
    done = threading.Event()
    status: list[int] = []

    def guided() -> None:
        try:
            status.append(_post(server, {"guided_json": schema}, "completions").status_code)
        finally:
            done.set()

    t = threading.Thread(target=guided)
    t0 = time.monotonic()
    t.start()
    answered = 0  # /health answers begun and ended while the guided request was out
    try:
        while not done.is_set() and time.monotonic() - t0 < 120:
            httpx.get(f"{server.url}/health", timeout=120)
            answered += not done.is_set()
    finally:
        t.join()
    assert status == [200]
    assert answered >= 15, answered  # (39 here; with the check on the loop: 4)


def test_the_door_remembers_verdicts_by_a_hash_not_the_spec() -> None:
    from frontend import guides

    spec = json.dumps({"type": "object", "description": "x" * (1 << 20)})
    assert guides.checked("json_schema", spec, "guided_json").spec == spec
    held = sum(len(k[1]) + len(k[0]) + len(v) for k, v in guides._verdicts.items())
    assert held < 4096 * len(guides._verdicts)  # (a verdict is a bounded error message)


TOOL: dict[str, object] = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
@pytest.mark.parametrize(("tools", "param"), [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([TOOL, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}],
     "tools[1].function.parameters"),
    ([TOOL, TOOL], "tools[1].function.name"),
])
def test_tools_are_checked_whatever_the_tool_choice(
        server: Server, choice: str, tools: list[object], param: str) -> None:
    r = _post(server, {"tools": tools, "tool_choice": choice})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.text[:300]


def test_auto_leaves_a_call_of_no_tool_or_without_object_arguments_as_content() -> None:
    from frontend.tools import ToolPlan

    plan = ToolPlan("auto", [TOOL])
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": "3"}</tool_call>'):
        assert plan.parse(text) == (text, [])
    content, calls = plan.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}'
                                "</tool_call>")
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("add", '{"a":1}')]


def test_a_request_with_no_guide_never_waits_for_the_checkers(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both checker threads held by others' checks: a plain request is answered at
    once, and a guided one whose check never began is a 503 to retry, not a 400."""
    from frontend import guides
    monkeypatch.setattr(guides, "CHECK_SECONDS", 0.5)
    release = threading.Event()
    held = [guides._off_loop(lambda: release.wait(120)) for _ in range(guides._CHECKERS)]
    try:
        assert _post(server, {}, "completions").status_code == 200
        r = _post(server, {"guided_regex": "[ab]+"}, "completions")
        assert r.status_code == 503, r.text[:300]
        assert r.headers["retry-after"] and r.json()["error"]["code"] == "overloaded"
        # (in the client's words: the fields it sent, not the server's "guide")
        said = r.json()["error"]["message"]
        assert "response_format" in said and not re.search(r"\bguides?\b", said), said
    finally:
        release.set()
        for f in held:
            f.result(60)
    assert _post(server, {"guided_regex": "[ab]+"}, "completions").status_code == 200


def test_required_serves_tools_whose_parameters_have_local_defs(server: Server) -> None:
    """Pydantic writes ``$defs`` inside ``parameters``; under ``required`` each tool's
    schema sits inside a larger one, where a ``$ref`` resolves from that one's root."""
    def tool(name: str, kind: str) -> dict[str, object]:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
            "$defs": {"A": {"type": kind}}}}}

    r = _post(server, {"tools": [tool("s", "string"), tool("b", "boolean")],
                       "tool_choice": "required", "max_tokens": 60})
    assert r.status_code == 200, r.text[:300]
    message = r.json()["choices"][0]["message"]
    if r.json()["choices"][0]["finish_reason"] == "tool_calls":  # (not cut by max_tokens)
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            kind = {"s": str, "b": bool}[call["function"]["name"]]
            assert isinstance(args["a"], kind), call
