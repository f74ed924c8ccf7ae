"""Structured output in the scheduler: a guided request's answer obeys its guide, an
unguided one beside it is unchanged token for token, and what cannot be guided is
refused naming the request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("transformers")

from messages import Guide, SamplingParams
from scheduler import Engine, ModelConfig
from scheduler.errors import EngineError, RequestFailed
from scheduler.models.guided import Guides, check_guide

#: Bounded so that the largest answer fits the token budget (one byte a token at worst).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "size": {"enum": ["small", "large"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False},
    },
    "required": ["name", "tags", "size", "code", "inner"],
    "additionalProperties": False,
}
BUDGET = 160
PROMPTS = [[5, 17, 90], [200, 3, 4, 8, 9], [44], [7, 7, 7, 7, 120, 33]]


def _tokenizer(model_dir: Path) -> object:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_json_schema_and_choice_answers_obey_and_unguided_ones_are_unchanged(
        model_dir: Path) -> None:
    tok = _tokenizer(model_dir)
    schema = SamplingParams(max_new_tokens=BUDGET, temperature=1.0, seed=3,
                            guide=Guide(kind="json_schema", spec=json.dumps(SCHEMA)))
    choices = ["alpha beta", "gamma", "the queue"]
    choice = SamplingParams(max_new_tokens=BUDGET, temperature=0.0,
                            guide=Guide(kind="choice", spec=json.dumps(choices)))
    free = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine("ring", model_dir) as engine:
        alone = [engine.generate(p, free).token_ids for p in PROMPTS]
        guided = [engine.submit(p, s) for p in PROMPTS for s in (schema, choice)]
        beside = [engine.submit(p, free) for p in PROMPTS]  # in the same batches
        answers = [h.result(120) for h in guided]
        assert [h.result(120).token_ids for h in beside] == alone
        greedy = engine.generate(PROMPTS[0], SamplingParams(
            max_new_tokens=BUDGET, temperature=0.0,
            guide=Guide(kind="json_schema", spec=json.dumps(SCHEMA))), timeout=120)
    for a in [*answers[::2], greedy]:
        text = tok.decode(a.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        assert a.finish_reason == "stop", (a, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    for a in answers[1::2]:
        assert a.finish_reason == "stop"
        assert tok.decode(a.token_ids, skip_special_tokens=True) in choices  # type: ignore[attr-defined]


def test_a_spec_is_compiled_once_and_a_bad_one_is_refused_naming_the_request(
        model_dir: Path) -> None:
    class Dir:
        tokenizer_dir = model_dir
        name = "tiny"

    guides = Guides(Dir(), 384, [2], cache_size=2)
    spec = Guide(kind="regex", spec="[a-z]{3}-[0-9]{2}")
    first, again = guides.start("r1", spec), guides.start("r2", spec)
    assert guides.compiles == 1 and first is not again  # one compile, a matcher each
    for i in range(3):  # past the bound: the oldest is compiled again
        guides.start("r", Guide(kind="choice", spec=json.dumps([f"x{i}"])))
    guides.start("r3", spec)
    assert guides.compiles == 5
    regex = SamplingParams(max_new_tokens=32, temperature=0.0, guide=spec)
    with Engine("ring", model_dir) as engine:
        text = _tokenizer(model_dir).decode(  # type: ignore[attr-defined]
            engine.generate(PROMPTS[1], regex, timeout=120).token_ids)
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text
        with pytest.raises(EngineError, match=r"request 'bad-1'.*regex guide does not compile"):
            engine.generate([5], SamplingParams(guide=Guide(kind="regex", spec="[a-")),
                            rid="bad-1", timeout=60)


def test_a_model_without_a_tokenizer_refuses_a_guided_request_by_name() -> None:
    with Engine("ring", ModelConfig()) as engine, pytest.raises(
            EngineError, match=r"request 'g-1'.*has none \(no tokenizer.json\)"):
        engine.generate([1, 2], SamplingParams(guide=Guide(kind="json_object")), rid="g-1",
                        timeout=60)


def _chain(n: int) -> str:
    """A schema of ``n`` definitions, each referring to the next."""
    defs: dict[str, object] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def test_any_spec_that_cannot_be_served_is_refused_naming_the_request_and_the_scheduler_lives(
        model_dir: Path) -> None:
    """Through the Engine API (a scheduler process): a spec past llguidance's bounds (1000
    chained references overflowed its native stack: SIGSEGV), a GBNF grammar that
    nests past Python's recursion, one its translator cannot read: each an
    invalid_request naming the request; the scheduler answers on."""
    specs = {
        "chain": Guide(kind="json_schema", spec=_chain(1000)),
        "rules": Guide(kind="grammar", spec="start: r0\n" + "\n".join(
            f'r{i}: "x{i}" r{i + 1} | "y"' for i in range(3000)) + '\nr3000: "z"'),
        "gbnf-deep": Guide(kind="grammar", spec='root ::= ' + "(" * 5000 + '"a"' + ")" * 5000),
        "gbnf-bad": Guide(kind="grammar", spec='root ::= "a" | ::= ('),
    }
    with Engine("zmq", model_dir) as engine:
        for rid, guide in specs.items():
            with pytest.raises(RequestFailed) as failed:
                engine.generate([5, 6], SamplingParams(max_new_tokens=4, guide=guide), rid=rid,
                                timeout=60)
            assert failed.value.code == "invalid_request", (rid, failed.value)
            assert f"request {rid!r}" in str(failed.value), failed.value
            assert "Traceback" not in str(failed.value)
        assert engine.generate([5, 6], SamplingParams(max_new_tokens=2),
                               timeout=60).finish_reason in ("stop", "length")


def test_a_guide_that_fails_while_decoding_ends_with_an_error_not_stop(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A matcher in error (here, a row of 2500 alternatives: llguidance's limit is 2000,
    met after the first ``{``; a language with no answer) ends its request with an
    error naming it and the guide's error, never ``stop`` with output that breaks
    the guide; the log line is bounded. Another request in the batch is unharmed."""
    many = json.dumps({"anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}},
         "required": [f"k{i}"], "additionalProperties": False} for i in range(2500)]})
    free = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine("ring", model_dir) as engine:
        alone = engine.generate(PROMPTS[0], free, timeout=60).token_ids
        beside = engine.submit(PROMPTS[0], free)
        for rid, guide in (("many", Guide(kind="json_schema", spec=many)),
                           ("none", Guide(kind="regex", spec="[^\\x00-\\U0010FFFF]"))):
            for t in (0.0, 1.0):
                with pytest.raises(EngineError,
                                   match=rf"request {rid!r}: its structured output .* failed"):
                    engine.generate(PROMPTS[1], SamplingParams(
                        max_new_tokens=50, temperature=t, guide=guide), rid=rid, timeout=120)
        assert beside.result(60).token_ids == alone
    assert all(len(r.getMessage()) < 2000 for r in caplog.records)


def test_every_choice_the_door_takes_is_served(model_dir: Path) -> None:
    """The door takes up to 4096 ``guided_choice`` values; each is an answer the guide
    can give (as alternatives of one rule, 2000 or more failed every answer after
    its first token: llguidance's 2000 items a row)."""
    choices = [f"choice number {i} here" for i in range(4096)]
    guide = Guide(kind="choice", spec=json.dumps(choices))
    assert check_guide(guide) == ""
    with Engine("ring", model_dir) as engine:
        for t in (0.0, 1.0):
            out = engine.generate(PROMPTS[2], SamplingParams(
                max_new_tokens=BUDGET, temperature=t, seed=5, guide=guide), timeout=120)
            text = _tokenizer(model_dir).decode(  # type: ignore[attr-defined]
                out.token_ids, skip_special_tokens=True)
            assert out.finish_reason == "stop" and text in choices, (out, text)


@pytest.mark.parametrize("spec", [
    {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                "required": [f"k{i}"], "additionalProperties": False} for i in range(2500)]},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)},
     "additionalProperties": False},
], ids=["anyOf-2500", "optional-properties-3000"])
def test_the_door_s_check_refuses_a_guide_that_fails_after_its_first_bytes(
        spec: dict[str, object]) -> None:
    """Such a guide passes its first step and then fails every answer (the row
    limit, met after the ``{``): the door's check walks on and refuses it, so it is a
    400 naming the field instead of a request that is prefilled and then fails."""
    verdict = check_guide(Guide(kind="json_schema", spec=json.dumps(spec)))
    assert "fails after its first bytes" in verdict and "max is 2000" in verdict, verdict


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 2**62 + 600, "maximum": 2**62 + 1000},
    {"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer",
                                                       "exclusiveMaximum": -2**62 - 600,
                                                       "minimum": -2**62 - 1000}]}}},
], ids=["rounded", "saturated", "nested"])
def test_a_bound_llguidance_cannot_keep_exactly_is_refused(schema: dict[str, object]) -> None:
    """llguidance holds bounds as 64-bit floats: without this, the first schema's
    answer was 2^62 + 1024 (past its maximum) and the second's 2^63 - 1 (under its
    minimum), both served as obeying the schema."""
    verdict = check_guide(Guide(kind="json_schema", spec=json.dumps(schema)))
    assert "cannot be kept exactly" in verdict, verdict


def test_bounds_within_2_53_and_properties_named_like_bounds_are_served() -> None:
    for schema in [{"type": "integer", "minimum": -2**53, "maximum": 2**53},
                   {"type": "object", "properties": {"minimum": {"type": "integer"}},
                    "required": ["minimum"]}]:
        assert check_guide(Guide(kind="json_schema", spec=json.dumps(schema))) == "", schema
