"""Completions and chat completions: the request path, from the HTTP handler to the
engine and back.

Follow one request (each step names the module that does it):

1. :mod:`frontend.app` routes ``POST /v1/completions`` or
   ``/v1/chat/completions``, decodes the body (:mod:`frontend.schemas`: a bad
   one is a 400 naming its field), checks that it names a model served (else a
   404) and calls :meth:`OpenAIServing.completion` or
   :meth:`OpenAIServing.chat` with the connection's
   :class:`~frontend.asgi.Reply` (an :class:`~frontend.asgi.Answer`).
2. The handler has the request's guide (and a chat's tool
   plan) built and checked off the event loop, and tokenizes the prompt (a
   chat's rendered by its template, :mod:`frontend.chat`; a long one off the
   loop). :class:`~frontend.sampling.SamplingTranslator` turns the request into
   its answer's token budget and :class:`~messages.SamplingParams`.
3. Each answer gets one :class:`~frontend.request_state.RequestState`: its
   prompt ids, sampling, detokenizer and stop strings, the
   :class:`~frontend.responses.ResponseShaper` that spells its bytes, and the
   ``answer`` they go to. :func:`frontend.fanout.answer_several` answers them
   through ``_answer``: one as it is, several (a prompt list, ``n``,
   ``best_of``) at once, joined into one response.
4. ``_answer`` asks the :class:`~scheduler.AsyncEngine`: ``_whole`` awaits its
   one answer (not streamed and no stop strings to watch: the cheap path);
   ``_stream`` reads its steps (every step that arrived while the task waited,
   in one write).
5. Each step's token ids are detokenized (:class:`~frontend.detokenizer.Detokenizer`:
   UTF-8 safe, stop strings held back) and shaped into a body or Server-Sent
   Events (``data: {...}``, ending ``data: [DONE]``), sent through ``answer``.

The first step is awaited before the response starts, so a refusal
(``Overloaded``: 503 with ``Retry-After``) is still an HTTP error, not an event
inside a 200. Leaving the engine's stream early (a stop string, a client gone)
aborts the request, so the scheduler frees its slot.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import cast

from frontend.asgi import JSON, SSE, Answer
from frontend.chat import ChatTemplate
from frontend.detokenizer import Detokenizer
from frontend.errors import bad_request, from_engine
from frontend.fanout import MAX_PROMPTS, answer_several, answers_per_prompt, nth_answer
from frontend.metrics import HttpMetrics
from frontend.request_state import RequestState
from frontend.responses import DONE, ResponseShaper
from frontend.sampling import SamplingTranslator
from frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
)
from frontend.tools import ToolPlan
from frontend.turns import loop_turns
from messages import Guide
from messages.checks import prompt_problem
from scheduler import AsyncEngine, EngineError, StreamChunk

__all__ = ["OpenAIServing", "RequestState"]

#: Prompts longer than this (characters) are tokenized off the event loop.
_TOKENIZE_INLINE = 16384
#: Chunks a stream turns into events per turn on the loop (frontend.turns).
_CHUNKS_A_TURN = 16


def _push(state: RequestState, ids: Sequence[int]) -> tuple[str, list[int] | None]:
    """``ids`` pushed to ``state``'s detokenizer: their text, and each one's
    ``text_offset`` where a completion's logprobs are asked for."""
    if state.logprobs and not state.response.chat:
        return state.detok.push_offsets(ids)
    return state.detok.push(ids), None


class OpenAIServing:
    """Answers ``/v1/completions`` and ``/v1/chat/completions`` over one engine.

    ``translator`` knows the served model (its tokenizer, name and context);
    ``default_max_tokens`` is a chat's ``max_tokens`` when it gives none (a
    completion's is OpenAI's 16), cut to the room the prompt leaves in the context.
    """

    def __init__(self, engine: AsyncEngine, translator: SamplingTranslator,
                 template: ChatTemplate, metrics: HttpMetrics | None, *,
                 default_max_tokens: int = 256) -> None:
        self.engine = engine
        self.translator = translator
        self.tokenizer = translator.tokenizer
        self.template = template
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        # Answer ids: this server's run, then a count (ids do not repeat across restarts
        # or replicas, as cmpl-0, cmpl-1, ... did).
        self._ids = map(f"{secrets.token_hex(4)}-{{}}".format, itertools.count())
        self.turns = loop_turns()  # the protocol, each request and each stream take turns

    async def prompt_ids(self, given: str | Sequence[int | str | list[int]], field: str, *,
                         refuse: Callable[[int, int], None], special: bool = True,
                         most: int | None = None) -> list[list[int]]:
        """The ids of each prompt a request's ``field`` gives: a text, a list of ids, or
        several of either (at most ``most``, each named ``field[i]`` in a refusal).
        Texts are tokenized; ids are checked against the vocabulary. Prompts long
        together (in characters or ids) are done off the event loop, in one call
        (inline, one at a time, 153 embedding inputs each under the bound would hold
        the loop over a second; ~1M ids take 150-240 ms to check).

        Texts long enough to go off the loop are first shown to ``refuse`` (each
        text's index, the fewest tokens it can yield: ``Tokenizer.fewest_tokens``),
        which raises to refuse the request: a 4 MB prompt sure to pass the model's
        context costs no seconds of tokenizing before its 400.

        Raises:
            ApiError: 400 on ``field``: a list mixing kinds, more than ``most`` prompts,
                a prompt with no ids, or an id outside the vocabulary; what ``refuse``
                raises.
        """
        prompts: Sequence[str | list[int]]
        several = False
        if isinstance(given, str):
            prompts = [given]
        elif all(isinstance(t, int) for t in given):
            prompts = [[t for t in given if isinstance(t, int)]]
        else:
            several = True
            if most is not None and len(given) > most:
                raise bad_request(f"{field}: {len(given)} prompts in one request; at most "
                                  f"{most}", param=field, code="unsupported_value")
            texts = [p for p in given if isinstance(p, str)]
            lists = [p for p in given if isinstance(p, list)]
            if len(texts) != len(given) and len(lists) != len(given):
                raise bad_request(f"{field}: mixes strings, token ids and lists of token "
                                  "ids; give one kind", param=field)
            prompts = texts or lists
        tok = self.tokenizer
        inline = sum(map(len, prompts)) <= _TOKENIZE_INLINE

        def run() -> list[list[int]]:
            if not inline:
                for i, prompt in enumerate(prompts):
                    if isinstance(prompt, str):
                        refuse(i, tok.fewest_tokens(prompt))
            out: list[list[int]] = []
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    ids = tok.encode(prompt, add_special_tokens=special)
                    problem = "" if ids else "no input tokens"
                else:
                    ids, problem = prompt, prompt_problem(prompt, tok.vocab_size)
                if problem:
                    where = f"{field}[{i}]" if several else field
                    raise bad_request(f"{where}: {problem}", param=field)
                out.append(ids)
            return out

        if inline:
            return run()
        return await asyncio.get_running_loop().run_in_executor(None, run)

    async def completion(self, req: CompletionRequest, answer: Answer, t0: float) -> int:
        """Answer a completion, of one prompt or several (one choice each, ``index`` in
        the prompts' order); returns the HTTP status sent.

        Raises:
            ApiError: a refusal (400, 503, ...); once a stream has begun, the engine's
                error, which the app sends as the stream's last event.
        """
        check_supported(req)
        guide = await self.translator.guide(req)

        def refuse(index: int, fewest: int) -> None:
            self.translator.refuse_past_context(fewest, req.max_tokens, "prompt")

        prompts = await self.prompt_ids(req.prompt, "prompt", refuse=refuse, most=MAX_PROMPTS)
        copies = answers_per_prompt(req, len(prompts))
        # Every answer is checked (its budget, its sampling) before any runs.
        states: list[RequestState] = []
        for ids in prompts:
            max_tokens = self.translator.budget(len(ids), req.max_tokens, 16, "prompt")
            states += [nth_answer(self._state(req, ids, max_tokens, answer, t0, guide), i)
                       for i in range(copies)]
        return await answer_several(req, states, answer, self._answer)

    async def chat(self, req: ChatCompletionRequest, answer: Answer, t0: float) -> int:
        """Answer a chat completion; returns the HTTP status sent.

        Raises:
            ApiError: a refusal (400, 503, ...); once a stream has begun, the engine's
                error, which the app sends as the stream's last event.
        """
        check_supported(req)
        asked = req.max_new_tokens()
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        if asked == 0:  # (a completion's 0 is legitimate: it will score a prompt, with echo)
            raise bad_request(f"{field} must be at least 1 on a chat completion, not 0 (as "
                              "vLLM answers)", param=field, code="invalid_value")
        guide, tools = await self.translator.guide_and_tools(req)
        text = self.template.render(req.messages, req.add_generation_prompt,
                                    None if tools is None else tools.tools)

        def refuse(index: int, fewest: int) -> None:
            self.translator.refuse_past_context(fewest, asked, "messages", field)

        [ids] = await self.prompt_ids(text, "messages", refuse=refuse, special=False)
        max_tokens = self.translator.budget(len(ids), asked, self.default_max_tokens,
                                            "messages", field)
        # Each answer its own state, guide and tool plan (a plan holds its answer's
        # streaming state and call id): n answers are n requests, each constrained.
        states = [nth_answer(self._state(req, ids, max_tokens, answer, t0, guide, tools=(
            tools if not i or tools is None else tools.another())), i)
            for i in range(answers_per_prompt(req, 1))]
        return await answer_several(req, states, answer, self._answer)

    def _state(self, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
               max_tokens: int, answer: Answer, t0: float, guide: Guide | None, *,
               tools: ToolPlan | None = None) -> RequestState:
        """The state of ``req``'s answer to ``prompt_ids`` (a chat's stop strings and stop
        ids are its own and its template's).

        Raises:
            ApiError: 400: sampling out of range.
        """
        chat = isinstance(req, ChatCompletionRequest)
        stops = req.stops()
        if isinstance(req, ChatCompletionRequest):
            stops += self.template.stops
            stop_ids: Sequence[int] = self.template.stop_ids
            logprobs = req.logprobs
        else:
            stop_ids = ()
            logprobs = req.logprobs is not None
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        return RequestState(
            endpoint="chat" if chat else "completions",
            response=ResponseShaper(chat, next(self._ids), self.translator.model_name,
                                    self.tokenizer),
            prompt_ids=prompt_ids,
            sampling=self.translator.params(req, max_tokens, stop_ids, guide, tools),
            tools=tools,
            detok=Detokenizer(self.tokenizer, stops, prompt_ids), has_stops=bool(stops),
            logprobs=logprobs, stream=req.stream, include_usage=include_usage,
            # OpenAI's (and vLLM's) continuous_usage_stats: every event carries the usage
            # so far.
            continuous_usage=include_usage and opts is not None and opts.continuous_usage_stats,
            answer=answer, t0=t0, echo=isinstance(req, CompletionRequest) and req.echo)

    async def _answer(self, state: RequestState) -> int:
        """Answer one request to the engine, as ``state`` says; returns the HTTP status
        sent.

        Raises:
            ApiError: the engine's refusal or error (:func:`frontend.errors.from_engine`),
                before or after a stream began (the app ends a begun one with it:
                :func:`frontend.asgi.send_failure`).
        """
        try:
            if not state.stream and not state.has_stops:
                return await self._whole(state)  # one awaitable, no stream: the cheap path
            return await self._stream(state)
        except EngineError as exc:
            raise from_engine(exc) from None

    async def _whole(self, state: RequestState) -> int:
        """Answer with one body, from the engine's one answer (no stop strings to watch)."""
        result = await self.engine.submit(state.prompt_ids, state.sampling,
                                          return_logprob=state.logprobs)
        state.echo_prompt(result.prompt_logprobs, result.prompt_top_logprobs)
        text, offsets = _push(state, result.token_ids)
        text += state.detok.finish()
        state.cached_tokens = result.cached_tokens or 0
        tops = None if result.top_logprobs is None else tuple(result.top_logprobs)
        body = state.response.whole(text, result.finish_reason, result.token_ids, result.logprobs,
                              state.usage(), offsets, tops, state.tools)
        self._first_token(state)
        await state.answer.whole(200, JSON, body)
        return 200

    def _first_token(self, state: RequestState) -> None:
        """Count the time to ``state``'s first token (the metrics, when served)."""
        if self.metrics is not None:
            self.metrics.first_token(state.endpoint, time.perf_counter() - state.t0)

    async def _stream(self, state: RequestState) -> int:
        """Answer from the engine's stream: as events (``stream``), or as one body where
        stop strings must be watched step by step."""
        # Steps, not chunks: what arrived while this task waited for the loop
        # goes out in one write (one event per step in it), and the loop gets
        # a turn between two writes.
        steps = cast(AsyncGenerator[list[StreamChunk], None],
                     self.engine.stream_steps(state.prompt_ids, state.sampling,
                                              return_logprob=state.logprobs))
        detok, response, answer, turns = state.detok, state.response, state.answer, self.turns
        started = False
        got: list[StreamChunk] = []  # the chunks of an answer sent whole (not streamed)
        pieces: list[str] = []  # ... their text
        offsets_wanted = state.logprobs and not response.chat  # (a completion's text_offset)
        out_offsets: list[int] = []  # ... and its offsets
        finish: str | None = None
        try:
            # (The first step comes before anything is sent: a refusal is an HTTP error.)
            async for chunks in steps:
                state.echo_prompt(chunks[0].prompt_logprobs, chunks[0].prompt_top_logprobs)
                if not turns.ready():
                    await turns.wait()
                events: list[bytes] = []
                for n, chunk in enumerate(chunks, 1):
                    if not n % _CHUNKS_A_TURN:  # a long backlog: another turn for the rest
                        await turns.take()
                    text, offsets = _push(state, chunk.token_ids)
                    finish = "stop" if detok.stopped else chunk.finish_reason
                    if chunk.cached_tokens is not None:
                        state.cached_tokens = chunk.cached_tokens
                    if finish is not None:
                        text += detok.finish()
                    if not state.stream:
                        got.append(chunk)
                        pieces.append(text)
                        out_offsets += offsets or ()
                    elif state.tools is not None:
                        usage = state.usage() if state.continuous_usage else None
                        events.extend(response.tool_event(state.tools, text, finish, usage))
                    elif text or finish is not None or chunk.logprobs or state.continuous_usage:
                        usage = state.usage() if state.continuous_usage else None
                        events.append(response.event(text, finish, chunk.token_ids,
                                                     chunk.logprobs, usage, offsets,
                                                     chunk.top_logprobs))
                    if finish is not None:
                        break
                if events:
                    if finish is not None:
                        if state.include_usage:
                            events.append(response.usage_event(state.usage()))
                        events.append(DONE)
                    if not started:
                        started = True
                        self._first_token(state)
                        await answer.begin(200, SSE)
                    await answer.piece(b"".join(events), finish is None)
                if finish is not None:
                    break
        finally:
            await steps.aclose()  # not finished (a stop string, a client gone): abort
        if not state.stream:
            assert finish is not None
            self._first_token(state)
            kept = detok.tokens  # (a stop string's cut)
            lps = [lp for c in got for lp in c.logprobs or ()] if state.logprobs else None
            tops = [t for c in got for t in c.top_logprobs or ()]
            await answer.whole(200, JSON, response.whole(
                "".join(pieces), finish, [i for c in got for i in c.token_ids][:kept],
                None if lps is None else lps[:kept], state.usage(),
                out_offsets[:kept] if offsets_wanted else None,
                tuple(tops[:kept]) if state.sampling.top_logprobs else None, state.tools))
        return 200
