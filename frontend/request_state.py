"""One completion or chat completion being answered, as one named object.

A request handler (:class:`~frontend.generate.OpenAIServing`) makes a
:class:`RequestState` once the request is checked and tokenized; the request
path (``_answer``, ``_whole``, ``_stream``) reads the engine's answer into it
and writes what its :class:`~frontend.responses.ResponseShaper` makes of it;
fan-out (:mod:`frontend.fanout`) gives each of several answers its own state,
and rewrites where its events go. It lives in a module of its own so that both
import it and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from frontend.asgi import Answer
from frontend.detokenizer import Detokenizer
from frontend.responses import ResponseShaper
from frontend.schemas import PromptTokensDetails, Usage
from frontend.tools import ToolPlan
from messages import SamplingParams
from scheduler.engine.handles import Tops

__all__ = ["RequestState"]


@dataclass(slots=True, kw_only=True)
class RequestState:
    """One completion or chat completion being answered: what its answer is made from.

    Attributes:
        endpoint: ``"completions"`` or ``"chat"`` (the metrics' label).
        response: builds its bodies and events, as its endpoint spells them.
        prompt_ids: the tokenized prompt.
        sampling: what the scheduler is asked for.
        detok: its text so far (incremental, UTF-8 safe) and its stop strings.
        has_stops: whether stop strings were given (the answer is then read as a
            stream, step by step, even when it is sent whole).
        logprobs: whether each token's log-probability is asked for.
        stream: answered as Server-Sent Events (else as one body).
        include_usage: a last event carries the usage (``stream_options``).
        continuous_usage: every event carries the usage so far.
        answer: where its answer goes (its connection's :class:`~frontend.asgi.Reply`).
        tools: its tool calls' plan (:mod:`frontend.tools`); ``None``: none.
        t0: when the request arrived (``time.perf_counter``), for time to first token.
        cached_tokens: how many of the prompt's tokens the prefix cache held (known
            once the request finishes).
        echo: a completion's ``echo``, until the prompt is in the answer.
    """

    endpoint: str
    response: ResponseShaper
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: Detokenizer
    has_stops: bool
    logprobs: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    answer: Answer
    t0: float

    cached_tokens: int = 0
    tools: ToolPlan | None = None  # how its tool calls are made and read (chat)
    #: ``echo`` (completions): the answer begins with the prompt (its logprobs too, when
    #: ``logprobs`` is given: ``sampling.prompt_logprobs`` asks the scheduler for them).
    echo: bool = False

    def echo_prompt(self, lps: Sequence[float] | None, tops: Tops | None) -> None:
        """Have the answer begin with the prompt, once its logprobs (if asked) are in."""
        if self.echo:
            self.echo = False
            self.response.echo(self.prompt_ids, lps, tops, self.logprobs)

    def usage(self) -> Usage:
        """The usage so far: the prompt's tokens (and how many of them the prefix cache
        held, known once the request finishes) and the answer's."""
        prompt, answer = len(self.prompt_ids), self.detok.tokens
        return Usage(prompt, answer, prompt + answer,
                     PromptTokensDetails(self.cached_tokens))
