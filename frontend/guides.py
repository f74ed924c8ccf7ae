"""Structured output at the door: a request's ``response_format`` or vLLM's ``guided_*``
field as the :class:`~messages.Guide` the scheduler compiles, checked here first.

One guide per request: ``response_format`` (``json_object``, ``json_schema``) on
chat, or one of ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar`` (vLLM's extra fields, on chat and completions). A guide that
cannot compile is a 400 naming its field before anything reaches the scheduler:
the door *validates* it with the scheduler's own translation
(:func:`scheduler.models.guided.check_guide`: the grammar llguidance would
build, checked without a vocabulary, which changes no verdict), and keeps the
verdicts of recent specs (a client sends the same schema again and again), keyed
by a hash of the spec (not the spec: up to a MiB each). The scheduler compiles
against the vocabulary (a compiled grammar is bound to it), once per distinct
spec.

The check runs llguidance's native code, which recurses: it runs on
:data:`_CHECKERS` threads of their own with a :data:`STACK` stack, never on the
event loop. A request handler first awaits :func:`prepare` (the request's specs
checked there, their verdicts cached, the loop free meanwhile, at most
:data:`CHECK_SECONDS`); the synchronous :func:`guide_of` and :func:`checked`
then find the verdicts (one evicted meanwhile is checked again on a checker
thread, the caller waiting).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from frontend.errors import RETRY_AFTER_S, ApiError, bad_request
from frontend.schemas import ChatCompletionRequest, CompletionRequest
from messages import Guide, GuideKind
from scheduler.models.guided import check_guide

__all__ = ["CHECK_SECONDS", "STACK", "asks_for_guide", "guide_of", "prepare"]

#: Distinct specs whose verdict the door remembers.
_CHECKED = 1024
T = TypeVar("T")

#: Checker threads, and each one's stack: llguidance recurses natively (the
#: scheduler's bounds on a spec keep it under 2 MiB); 256 MiB of address space,
#: touched only as deep as it goes.
_CHECKERS = 2
STACK = 256 << 20
#: Longest a request waits for its specs' check before its answer is a 400.
CHECK_SECONDS = 30.0

_verdicts: OrderedDict[tuple[str, bytes], str] = OrderedDict()
_lock = threading.Lock()
_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_threads: list[threading.Thread] = []


def _key(kind: GuideKind, spec: str) -> tuple[str, bytes]:
    return kind, hashlib.blake2b(spec.encode(), digest_size=32).digest()


def _serve() -> None:
    while True:
        job, done = _jobs.get()
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(job())
            except BaseException as exc:  # handed to the waiter
                done.set_exception(exc)


def _off_loop(job: Callable[[], T]) -> Future[T]:
    """``job`` run on a checker thread (started on first use, with a :data:`STACK`
    stack; daemons: a check in native code cannot be interrupted)."""
    with _lock:
        if not _threads:
            was = threading.stack_size(STACK)
            try:
                for i in range(_CHECKERS):
                    t = threading.Thread(target=_serve, name=f"guide-check-{i}", daemon=True)
                    t.start()
                    _threads.append(t)
            finally:
                threading.stack_size(was)
    done: Future[T] = Future()
    _jobs.put((job, done))
    return done


def _problem(kind: GuideKind, spec: str) -> str:
    """Why ``(kind, spec)`` cannot compile (``""``: it can), remembered; checked on a
    checker thread (the caller waits)."""
    key = _key(kind, spec)
    with _lock:
        verdict = _verdicts.get(key)
        if verdict is not None:
            _verdicts.move_to_end(key)
            return verdict
    if threading.current_thread() in _threads:  # (already on one: no waiting on a peer)
        verdict = check_guide(Guide(kind=kind, spec=spec))
    else:
        verdict = str(_off_loop(lambda: check_guide(Guide(kind=kind, spec=spec))).result())
    with _lock:
        _verdicts[key] = verdict
        while len(_verdicts) > _CHECKED:
            _verdicts.popitem(last=False)
    return verdict


def asks_for_guide(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether ``req`` asks for anything a checker thread must check: a ``guided_*``
    field, a ``response_format`` other than ``text``, or tools."""
    if (req.guided_json is not None or req.guided_regex is not None
            or req.guided_choice is not None or req.guided_grammar is not None):
        return True
    if isinstance(req, ChatCompletionRequest):
        fmt = req.response_format
        return bool(req.tools) or (fmt is not None and fmt.type != "text")
    return False


async def prepare(req: CompletionRequest | ChatCompletionRequest, job: Callable[[], T]) -> T:
    """What ``job`` (building ``req``'s guide: :func:`guide_of`, the tools' plan)
    returns, run on a checker thread, the event loop free meanwhile; the verdicts it
    finds are remembered. A request that asks for no guide (:func:`asks_for_guide`)
    runs it here at once (it finds nothing to check) and never waits behind another's
    check.

    Raises:
        ApiError: what ``job`` raises (a 400 naming a field); a 400 naming no field
            when its check ran longer than :data:`CHECK_SECONDS`; a 503 with
            Retry-After when the checkers were busy with others' that long and its
            check never began.
    """
    if not asks_for_guide(req):
        return job()
    done = _off_loop(job)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(done), CHECK_SECONDS)
    except TimeoutError:
        if done.cancelled():  # (the wait's cancel reached it before a checker did)
            raise ApiError(503, f"the server was busy for {CHECK_SECONDS:g} s checking other "
                                "requests' structured output (response_format, guided_*, "
                                "tools); retry later",
                           type="server_overloaded", code="overloaded",
                           retry_after=RETRY_AFTER_S) from None
        raise bad_request(f"the request's structured output (response_format, guided_*, "
                          f"tools) took longer than {CHECK_SECONDS:g} s to check",
                          code="invalid_guide") from None


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
        except RecursionError:
            raise bad_request(f"{field}: the JSON schema is nested too deeply", param=field,
                              code="invalid_guide") from None
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
