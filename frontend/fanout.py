"""One OpenAI request answered by several requests to the engine, as one response.

A completion may give several prompts (``prompt`` as a list), and either
endpoint may ask for several answers of each (``n``; a completion's
``best_of``): each answer is then its own request to the engine, with its
own state (:class:`~frontend.request_state.RequestState`), answered by the
request path's ``answer`` it is given (this module does not import
:mod:`frontend.generate`). Decided here: how many answers of each prompt
(:func:`answers_per_prompt`, bounded by :data:`MAX_ANSWERS` and
:data:`MAX_PROMPTS`), each answer's seed (:func:`nth_answer`), and how their
answers become one response (:func:`answer_several`: the choices in vLLM's
order, the usage summed, each prompt counted once; ``best_of`` keeps the
answers of highest cumulative logprob). All run at once; one refused before
anything was sent aborts the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from frontend.asgi import JSON, Answer, Headers
from frontend.errors import bad_request
from frontend.request_state import RequestState
from frontend.responses import DONE
from frontend.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
    encode,
)

__all__ = ["MAX_ANSWERS", "MAX_PROMPTS", "answer_several", "answers_per_prompt",
           "nth_answer"]

#: The most prompts one completion request may hold (each is a request to the engine).
MAX_PROMPTS = 256
#: The most answers of one prompt a request may ask for (``n``, ``best_of``).
MAX_ANSWERS = 128
#: Read back one answer of several (:func:`answer_several`).
_COMPLETION = msgspec.json.Decoder(Completion)
_CHAT = msgspec.json.Decoder(ChatCompletion)


def answers_per_prompt(req: CompletionRequest | ChatCompletionRequest, prompts: int) -> int:
    """How many answers of each prompt to generate: ``best_of`` (completions), else ``n``.

    Raises:
        ApiError: 400 naming ``best_of`` (below ``n``, or above it while streaming, as
            vLLM refuses it) or the field that asks for too many answers (more than
            :data:`MAX_ANSWERS` of one prompt, or :data:`MAX_PROMPTS` in all).
    """
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    copies = _copies(req)
    if copies < req.n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})",
                          param="best_of", code="invalid_value")
    if copies > req.n and req.stream:
        raise bad_request("best_of above n cannot be streamed (the best answers are known "
                          "only at the end)", param="best_of", code="invalid_value")
    field = "best_of" if best_of else "n"
    if copies > MAX_ANSWERS:
        raise bad_request(f"{field} is {copies}: at most {MAX_ANSWERS} answers of one prompt",
                          param=field, code="invalid_value")
    if copies * prompts > MAX_PROMPTS:
        raise bad_request(f"{copies} answers of each of {prompts} prompts make "
                          f"{copies * prompts}: at most {MAX_PROMPTS} answers in one request",
                          param=field, code="invalid_value")
    return copies


def nth_answer(state: RequestState, copy: int) -> RequestState:
    """``state`` as the ``copy``-th answer of its prompt: a seeded request's answers each
    get their own seed (the seed + ``copy``), so they differ and each reproduces; an
    unseeded one's differ by their rids."""
    seed = state.sampling.seed
    if copy and seed is not None:
        state.sampling = msgspec.structs.replace(state.sampling,
                                                 seed=(seed + copy) % (1 << 63))
    return state


async def answer_several(req: CompletionRequest | ChatCompletionRequest,
                         states: list[RequestState], out: Answer,
                         answer: Callable[[RequestState], Awaitable[int]]) -> int:
    """Answer one or several requests to the engine as one answer: several prompts, or
    several answers of each prompt (``n``; a completion's ``best_of``, in the order of
    :func:`answers_per_prompt`), all at once, each by ``answer`` (the request path's);
    their answers become the choices, ``index`` = prompt's index * ``n`` + answer's
    (vLLM's order), and the usage is their sum (each prompt counted once). With
    ``best_of`` above ``n`` each prompt keeps its ``n`` answers of highest cumulative
    logprob (without ``logprobs``, asked only to rank them and left out of the
    answer). One refused (before anything was sent) aborts the others. Returns the
    HTTP status sent.

    Raises:
        ApiError: what one answer raises.
    """
    if len(states) == 1:  # one answer: the request path's own response, as it is
        return await answer(states[0])
    if req.stream:
        return await _answer_several_streamed(req, states, out, answer)
    copies = _copies(req)
    keep = req.n
    # best_of ranks by logprobs, asked or not (not asked: left out of the answer).
    hide_logprobs = (copies != keep and isinstance(req, CompletionRequest)
                     and req.logprobs is None)
    if hide_logprobs:
        for state in states:
            state.logprobs = True
    chat = states[0].response.chat
    kept = [_Kept() for _ in states]
    for state, body in zip(states, kept, strict=True):
        state.answer = body
    tasks = [asyncio.ensure_future(answer(state)) for state in states]
    try:
        await asyncio.gather(*tasks)
    finally:
        await _cancel_all(tasks)
    parts = [(_CHAT if chat else _COMPLETION).decode(body.body) for body in kept]
    choices: list[CompletionChoice | ChatChoice] = []
    prompt_tokens = answer_tokens = cached = 0
    for at in range(0, len(parts), copies):
        group = parts[at:at + copies]
        first_usage = group[0].usage
        assert first_usage is not None
        prompt_tokens += first_usage.prompt_tokens
        cached += first_usage.prompt_tokens_details.cached_tokens
        if copies == keep:
            picked = group
        else:
            picked = sorted(group, key=_cumulative_logprob, reverse=True)[:keep]
        for part in picked:
            choice = part.choices[0]
            choice.index = len(choices)
            if hide_logprobs:
                choice.logprobs = None
            choices.append(choice)
            assert part.usage is not None
        answer_tokens += sum(p.usage.completion_tokens for p in group if p.usage)
    first = parts[0]
    usage = Usage(prompt_tokens, answer_tokens, prompt_tokens + answer_tokens,
                  PromptTokensDetails(cached))
    body_out: bytes
    if chat:
        body_out = encode(ChatCompletion(first.id, first.created, first.model, [
            c for c in choices if isinstance(c, ChatChoice)], usage))
    else:
        body_out = encode(Completion(first.id, first.created, first.model, [
            c for c in choices if isinstance(c, CompletionChoice)], usage=usage))
    await out.whole(200, JSON, body_out)
    return 200


async def _answer_several_streamed(req: CompletionRequest | ChatCompletionRequest,
                                   states: list[RequestState], out: Answer,
                                   answer: Callable[[RequestState], Awaitable[int]]) -> int:
    """Stream several answers as one: each one's events carry its choice ``index``
    and the one answer id, interleaved as they come (:class:`_Interleaved`); one
    ``[DONE]`` ends them all, after the summed usage (``include_usage``). The response
    starts with the first answer's first event. The first error of any aborts the
    others and is raised: before that first event the app answers with it, after it
    the app ends the stream with it as one error event
    (:func:`frontend.asgi.send_failure`).

    Raises:
        ApiError: one answer's refusal or error.
    """
    shared = _Interleaved(out)
    # Each answer its choice index, under the first one's answer id.
    first = states[0].response
    for i, state in enumerate(states):
        state.answer = shared
        state.response = first.for_choice(i)
        state.include_usage = False  # the summed usage goes last, once
    tasks = [asyncio.ensure_future(answer(state)) for state in states]
    try:
        await asyncio.gather(*tasks)
    finally:  # one failed: the others end before its error ends the stream (the app's)
        await _cancel_all(tasks)
    tail = [DONE]
    opts = req.stream_options
    if opts is not None and opts.include_usage:
        seen: set[int] = set()
        prompt = answer_tokens = cached = 0
        for state in states:
            u = state.usage()
            if id(state.prompt_ids) not in seen:  # each prompt once (n answers of one)
                seen.add(id(state.prompt_ids))
                prompt += u.prompt_tokens
                cached += u.prompt_tokens_details.cached_tokens
            answer_tokens += u.completion_tokens
        tail.insert(0, states[0].response.usage_event(Usage(
            prompt, answer_tokens, prompt + answer_tokens, PromptTokensDetails(cached))))
    await out.piece(b"".join(tail), False)
    return 200


def _copies(req: CompletionRequest | ChatCompletionRequest) -> int:
    """How many answers of each prompt ``req`` asks for: ``best_of`` (completions), else
    ``n``."""
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    return req.n if best_of is None else best_of


def _cumulative_logprob(part: Completion | ChatCompletion) -> float:
    """The sum of an answer's token logprobs (``best_of``'s ranking)."""
    lp = part.choices[0].logprobs
    if isinstance(lp, CompletionLogprobs):
        return sum(v for v in lp.token_logprobs if v is not None)
    return sum(e.logprob for e in lp.content) if lp is not None else 0.0


async def _cancel_all(tasks: Sequence[asyncio.Future[int]]) -> None:
    """Cancel ``tasks`` (a finished one: nothing; the others abort their request) and
    wait for them to end."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Kept:
    """One answer of several, not streamed: its body kept (:func:`answer_several` merges
    them). An answer not streamed is sent whole, never in pieces."""

    __slots__ = ("body",)

    def __init__(self) -> None:
        self.body = b""

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        self.body = body

    async def begin(self, status: int, headers: Headers) -> None:
        raise AssertionError("an answer not streamed is never sent in pieces")

    async def piece(self, body: bytes, more: bool) -> None:
        raise AssertionError("an answer not streamed is never sent in pieces")


class _Interleaved:
    """Several streamed answers sent as one, onto ``out``: the first answer's start
    begins it, then every piece of each goes on but its ``[DONE]`` (one ends them all).

    One piece at a time, the start first: the answers take turns (a lock), so that
    when a slow client's connection pauses writing, one resume lets one of them
    write, not all of them at once. A server that checks for a pause once before it
    writes (uvicorn's ``send``) would let them all write while paused, and the stall
    timer would take a client that reads for one that reads nothing
    (:mod:`frontend.serving`)."""

    __slots__ = ("_out", "_started", "_turn")

    def __init__(self, out: Answer) -> None:
        self._out = out
        self._started = False
        self._turn = asyncio.Lock()

    async def whole(self, status: int, headers: Headers, body: bytes) -> None:
        raise AssertionError("a streamed answer is never sent whole")

    async def begin(self, status: int, headers: Headers) -> None:
        async with self._turn:  # (no piece of another answer before the start)
            if not self._started:
                self._started = True
                await self._out.begin(status, headers)

    async def piece(self, body: bytes, more: bool) -> None:
        if body.endswith(DONE):
            body = body[:-len(DONE)]
        if body:
            async with self._turn:
                await self._out.piece(body, True)
