"""Structured output at the door: a request's ``response_format`` or vLLM's ``guided_*``
field as the :class:`~messages.Guide` the scheduler compiles, checked here first.

One guide per request: ``response_format`` (``json_object``, ``json_schema``) on
chat, or one of ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` (vLLM's extra fields, on chat and completions). A guide that
cannot compile is a 400 naming its field before anything reaches the scheduler:
the door *validates* it with the scheduler's own translation
(:func:`scheduler.models.guided.check_guide`: the grammar llguidance would
build, checked without a vocabulary, which changes no verdict), and keeps the
verdicts of recent specs (a client sends the same schema again and again). The
scheduler compiles against the vocabulary (a compiled grammar is bound to it),
once per distinct spec.
"""

from __future__ import annotations

import functools
import json

from frontend.errors import bad_request
from frontend.schemas import ChatCompletionRequest, CompletionRequest
from messages import Guide, GuideKind
from scheduler.models.guided import check_guide

__all__ = ["guide_of"]

#: Distinct specs whose verdict the door remembers.
_CHECKED = 1024


@functools.lru_cache(maxsize=_CHECKED)
def _problem(kind: GuideKind, spec: str) -> str:
    return check_guide(Guide(kind=kind, spec=spec))


def checked(kind: GuideKind, spec: str, field: str) -> Guide:
    """``Guide(kind, spec)`` once it compiles.

    Raises:
        ApiError: 400 naming ``field`` when it does not (code ``invalid_guide``).
    """
    problem = _problem(kind, spec)
    if problem:
        raise bad_request(f"{field}: the {kind.replace('_', ' ')} cannot be compiled for "
                          f"constrained decoding: {problem[:2000]}", param=field,
                          code="invalid_guide")
    return Guide(kind=kind, spec=spec)


def _json_text(value: object, field: str) -> str:
    """A schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{field}: not a JSON schema ({exc})", param=field,
                              code="invalid_guide") from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"{field}: a JSON schema must be an object", param=field,
                          code="invalid_guide")
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def guide_of(req: CompletionRequest | ChatCompletionRequest, model: str | None
             ) -> Guide | None:
    """The guide ``req`` asks for (``None``: none): its ``response_format`` (chat) or
    one of its ``guided_*`` fields.

    ``model`` names a served model that has no tokenizer vocabulary to guide
    (``None``: it has one).

    Raises:
        ApiError: 400 naming the field: two guides at once, a ``json_schema``
            response format without its schema, a guide that cannot compile, or
            any guide for a model with no vocabulary.
    """
    given: list[tuple[str, GuideKind, str]] = []
    fmt = req.response_format if isinstance(req, ChatCompletionRequest) else None
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", "json_object", ""))
    elif fmt is not None and fmt.type == "json_schema":
        where = "response_format.json_schema.schema"
        wrapper = fmt.json_schema
        schema = wrapper.get("schema") if wrapper is not None else None
        if schema is None:
            raise bad_request(f"{where}: response_format 'json_schema' needs "
                              "json_schema.schema", param=where, code="invalid_guide")
        given.append((where, "json_schema", _json_text(schema, where)))
    if req.guided_json is not None:
        given.append(("guided_json", "json_schema", _json_text(req.guided_json, "guided_json")))
    if req.guided_regex is not None:
        given.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        given.append(("guided_choice", "choice", json.dumps(req.guided_choice)))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", "grammar", req.guided_grammar))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"{given[1][0]}: only one guide per request ({given[0][0]} is "
                          f"given too)", param=given[1][0], code="conflicting_values")
    field, kind, spec = given[0]
    if model is not None:
        raise bad_request(f"{field}: structured output needs the model's tokenizer "
                          f"vocabulary, and model {model!r} has none (the built-in models' "
                          "is synthetic): serve a Hugging Face model directory",
                          param=field, code="unsupported_value")
    return checked(kind, spec, field)
