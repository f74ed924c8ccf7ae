"""An OpenAI request as what the scheduler is asked for: a token budget and
:class:`~messages.SamplingParams`.

:class:`SamplingTranslator` holds what the translation needs to know of the
served model (its tokenizer's vocabulary and EOS, its context length, whether
it can be guided) and turns each request into:

* its guide (structured output) and, on chat, its tool calls' plan, checked
  off the event loop (:func:`frontend.guides.prepare`): :meth:`guide`,
  :meth:`guide_and_tools`;
* its answer's ``max_tokens``: what was asked, else a default cut to the room
  the prompt leaves in the context; too little room is OpenAI's 400
  ``context_length_exceeded`` (:meth:`budget`);
* its :class:`~messages.SamplingParams` (:meth:`params`): temperature, top-p/k,
  penalties, ``logit_bias``, the stop ids (EOS and the chat template's unless
  ``ignore_eos``), the seed, the guide (a forced tool call's, or a
  ``guided_*`` / ``response_format`` one: not both), and the logprobs asked for.

Every refusal is an :class:`~frontend.errors.ApiError` (a 400 naming its field)
raised before anything reaches the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

from frontend.errors import ApiError, bad_request
from frontend.guides import guide_of, prepare
from frontend.schemas import ChatCompletionRequest, CompletionRequest, logit_bias, sampler_seed
from frontend.tokenizer import Tokenizer
from frontend.tools import ToolPlan, plan_of
from messages import Guide, SamplingParams, packed_u32

__all__ = ["SamplingTranslator"]


class SamplingTranslator:
    """Turns an OpenAI request into its guide, its token budget and its
    :class:`~messages.SamplingParams`, for one served model.

    Args:
        tokenizer: the served model's (its vocabulary bounds ``logit_bias``; its EOS
            id stops an answer).
        model_name: the name a refusal names.
        max_model_len: the most tokens a prompt and its answer may hold together;
            ``None``: no bound here.
        guided: the model has a tokenizer vocabulary, so structured output can be
            served (else a guide is a 400).
    """

    def __init__(self, tokenizer: Tokenizer, *, model_name: str, max_model_len: int | None,
                 guided: bool) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.guided = guided
        self._vocab = tokenizer.vocab_size

    def unguided(self) -> str | None:
        """The served model's name when it cannot be guided (no vocabulary), else ``None``."""
        return None if self.guided else self.model_name

    async def guide(self, req: CompletionRequest) -> Guide | None:
        """``req``'s guide (``guided_*``), checked off the event loop.

        Raises:
            ApiError: as :func:`frontend.guides.prepare`.
        """
        return await prepare(req, lambda: guide_of(req, self.unguided()))

    async def guide_and_tools(self, req: ChatCompletionRequest
                              ) -> tuple[Guide | None, ToolPlan | None]:
        """``req``'s guide (``response_format``, ``guided_*``) and its tool calls' plan,
        built and checked together off the event loop.

        Raises:
            ApiError: as :func:`frontend.guides.prepare`.
        """
        return await prepare(req, lambda: (guide_of(req, self.unguided()), plan_of(req)))

    def budget(self, prompt: int, asked: int | None, default: int, where: str,
               field: str = "max_tokens") -> int:
        """The answer's ``max_tokens``: what was asked, else ``default`` cut to the room
        the prompt (``prompt`` tokens, given as the request's ``where`` field) leaves
        in the model's context.

        Raises:
            ApiError: 400 ``context_length_exceeded`` (OpenAI's code) when the prompt
                leaves no room, or fewer tokens than were asked for (in ``field``).
        """
        limit = self.max_model_len
        if limit is None:
            return default if asked is None else asked
        room = limit - prompt
        if room > 0 and (asked is None or asked <= room):
            return min(default, room) if asked is None else asked
        raise self._past_context(prompt, asked, where, field, at_least=False)

    def refuse_past_context(self, fewest: int, asked: int | None, where: str,
                            field: str = "max_tokens") -> None:
        """Refuse, as :meth:`budget` would, a prompt of at least ``fewest`` tokens
        (before it is tokenized) when that many already leave too little room.

        Raises:
            ApiError: 400 ``context_length_exceeded``, the prompt's length given as
                "at least ``fewest``".
        """
        limit = self.max_model_len
        if limit is not None and (fewest >= limit or (asked is not None
                                                      and fewest + asked > limit)):
            raise self._past_context(fewest, asked, where, field, at_least=True)

    def _past_context(self, prompt: int, asked: int | None, where: str, field: str, *,
                      at_least: bool) -> ApiError:
        """The 400 for a prompt of ``prompt`` tokens (``at_least`` that many) and
        ``asked`` more, past the model's context (there is one: ``max_model_len``)."""
        limit = self.max_model_len or 0
        some = "at least " if at_least else ""
        wanted = f"{some}{prompt} in the {where}"
        if asked is not None:
            wanted += f", {asked} in the completion"
        shorten = where if asked is None else f"{where} or {field}"
        return bad_request(f"this model's maximum context length is {limit} tokens; this "
                           f"request asks for {some}{prompt + (asked or 0)} ({wanted}): "
                           f"shorten the {shorten}",
                           param=where if asked is None or prompt >= limit else field,
                           code="context_length_exceeded")

    def params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
               extra_stop_ids: Sequence[int], guide: Guide | None,
               tools: ToolPlan | None = None) -> SamplingParams:
        """What the scheduler is asked to sample for ``req``'s answer of at most
        ``max_tokens`` tokens; ``extra_stop_ids``: ids that end it besides EOS (a chat
        template's), unless ``ignore_eos``.

        Raises:
            ApiError: 400: ``min_tokens`` above ``max_tokens``; a forced tool call
                with a ``guided_*`` field too, or on a model that cannot be guided; a
                sampling field out of range.
        """
        # ignore_eos: no EOS added here (the tokenizer's, a chat template's), and the
        # scheduler leaves out the model's own stop ids (SamplingParams.ignore_eos).
        if req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) is more than the answer's "
                              f"max_tokens ({max_tokens})", param="min_tokens",
                              code="invalid_value")
        bias = logit_bias(req.logit_bias, self._vocab)
        stop_ids = list(req.stop_token_ids or ())
        if not req.ignore_eos:
            eos = self.tokenizer.eos_token_id
            stop_ids.extend(i for i in (eos, *extra_stop_ids) if i is not None)
        if tools is not None and tools.guide is not None:
            if guide is not None:
                raise bad_request("tool_choice: a forced tool call constrains the answer, and "
                                  "so does a guided_* field: give one", param="tool_choice",
                                  code="conflicting_values")
            if not self.guided:
                raise bad_request(f"tool_choice: a forced tool call needs the model's "
                                  f"tokenizer vocabulary, and model {self.model_name!r}"
                                  " has none", param="tool_choice", code="unsupported_value")
            guide = tools.guide
        # A completion's ``logprobs`` is its number of alternatives; a chat's is a flag,
        # its number in ``top_logprobs``. A completion's ``echo`` with ``logprobs``
        # asks for the prompt's logprobs too.
        if isinstance(req, CompletionRequest):
            top_logprobs = req.logprobs or 0
            prompt_logprobs = req.logprobs if req.echo else None
        else:
            top_logprobs = req.top_logprobs or 0
            prompt_logprobs = None
        try:
            packed = packed_u32(stop_ids, field="stop_token_ids") if stop_ids else None
            return SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, top_k=max(req.top_k, 0),
                                  stop_token_ids=packed, seed=sampler_seed(req.seed),
                                  ignore_eos=req.ignore_eos, guide=guide,
                                  presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty,
                                  min_tokens=req.min_tokens, logit_bias=bias,
                                  top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"sampling: {exc}") from None
