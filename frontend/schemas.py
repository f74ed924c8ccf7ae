"""OpenAI's request and response bodies as ``msgspec`` structs, validated at the door.

A request body decodes in one call (:func:`decode`) into its struct; every
constraint (ranges, lengths, enums) lives in the type, as it does for the
bus's messages, so a bad body fails there with a 400 naming the field
(:func:`decode` converts msgspec's error at one place). Unknown fields are
refused, not ignored: an option this server does not implement (``suffix``
with text, ``tools`` on completions, ...) is a clear 400 naming it. The options OpenAI
clients may send but this server does not serve (``suffix``) are accepted
at their defaults and refused otherwise (:func:`check_supported`).

Response bodies are structs too, encoded by one module-level encoder.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, TypeVar

import msgspec

from frontend.errors import ApiError, bad_request
from messages import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from messages.catalogue import MAX_GUIDE_SPEC

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatMessageOut",
    "CalledFunction",
    "ChosenFunction",
    "FunctionDef",
    "FunctionOut",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallIn",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "ContentPart",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "ModelCard",
    "ModelList",
    "NamedTool",
    "ResponseFormat",
    "StreamOptions",
    "TokenLogprob",
    "TopLogprob",
    "PromptTokensDetails",
    "Usage",
    "check_supported",
    "decode",
    "encode",
    "encode_str",
    "logit_bias",
    "sampler_seed",
    "sse_safe",
]

#: The most tokens one answer may ask for (the scheduler's own bound).
MAX_NEW_TOKENS = 1 << 20
TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Stop = StopString | Annotated[list[StopString], msgspec.Meta(max_length=16)] | None
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
#: ``-1`` (vLLM's spelling) and ``0`` both mean no top-k filter.
TopK = Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)]
#: Any int64, as vLLM takes it (``-1`` too); :func:`sampler_seed` maps it to the sampler's.
Seed = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
#: The sampler's seeds (``SamplingParams.seed``): the non-negative int64s.
_SAMPLER_SEEDS = 1 << 63
MaxTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
#: The longest model name a request may give (a served name is a path as given).
MAX_MODEL_NAME = 1024
ModelName = Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME)]
#: A regex, a grammar or a schema as text (the wire's bound on a guide's spec).
GuideText = Annotated[str, msgspec.Meta(max_length=MAX_GUIDE_SPEC)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A request body: unknown fields are refused, never silently ignored."""


class StreamOptions(_Body, kw_only=True):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage;
    with ``continuous_usage_stats`` too, every chunk carries the usage so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def sampler_seed(seed: int | None) -> int | None:
    """A request's int64 ``seed`` as the sampler's (``0 <= seed < 2**63``): the same
    seed always maps to the same one (a negative one to ``seed + 2**63``)."""
    return None if seed is None else seed % _SAMPLER_SEEDS


class ResponseFormat(_Body, kw_only=True):
    """``response_format``: ``text`` (the default: asks for nothing), ``json_object``
    (the answer is a JSON object) or ``json_schema`` (``json_schema.schema`` is the
    schema the answer validates; ``name``, ``description`` and ``strict`` are read as
    OpenAI's, the answer always obeys the schema). See :mod:`frontend.guides`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, object] | None = None


#: A function's name, as OpenAI allows it.
FunctionName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDef(_Body, kw_only=True):
    """A tool's function: its name, what it does, and its arguments' JSON schema."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class Tool(_Body, kw_only=True):
    """One of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Body, kw_only=True):
    """The function a named ``tool_choice`` picks."""

    name: FunctionName


class NamedTool(_Body, kw_only=True):
    """``tool_choice`` naming one function (``{"type": "function", "function": {"name": ...}}``)."""

    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(_Body, kw_only=True):
    """A call's function: its name and its arguments (JSON text)."""

    name: FunctionName
    arguments: str


class ToolCallIn(_Body, kw_only=True):
    """A tool call of an earlier assistant message (a round trip's history)."""

    id: Annotated[str, msgspec.Meta(max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


class _Sampling(_Body, kw_only=True):
    """The sampling fields completions and chat share."""

    model: ModelName
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=256)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    #: vLLM's extra: > 1 makes the prompt's and the answer's tokens less likely.
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    #: vLLM's extra: the stop tokens cannot end the answer before it holds this many.
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)] = 0
    #: Token id (as a string, OpenAI's form) -> bias added to its logit; values are
    #: clamped to -100..100, as vLLM does (:func:`logit_bias`).
    logit_bias: Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    #: vLLM's structured-output fields (:mod:`frontend.guides`): at most one per request.
    guided_json: dict[str, object] | GuideText | None = None
    guided_regex: GuideText | None = None
    guided_choice: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]],
                             msgspec.Meta(min_length=1, max_length=4096)] | None = None
    guided_grammar: GuideText | None = None

    def stops(self) -> list[str]:
        """The stop strings, as a list (empty when none)."""
        stop = self.stop
        return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids, or
    several prompts: a list of strings or of token-id lists (one choice each)."""

    prompt: Annotated[str, msgspec.Meta(max_length=1 << 24)] | Annotated[
        list[TokenId | str | list[TokenId]], msgspec.Meta(max_length=1 << 20)]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=128)] | None = None


class ContentPart(_Body, kw_only=True):
    """One part of a message's content (text only: no images here)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body, kw_only=True):
    """One message of a conversation.

    ``content`` is required in every message and is never null, but in an
    assistant message with ``tool_calls`` (as OpenAI has it). Missing or null
    elsewhere is a 400 naming ``messages[i].content``, not a turn rendered as
    empty text.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: Required (a missing or null one is a 400), but in an assistant message that
    #: makes tool calls (:func:`check_supported` checks it).
    content: str | Annotated[list[ContentPart], msgspec.Meta(max_length=1024)] | None = None
    #: The participant's name (OpenAI's pattern): rendered into the turn by the default
    #: template (ChatML's ``name=``) and handed to a tokenizer's own as ``message.name``.
    name: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")] | None = None
    #: An assistant message's calls (a round trip's history), rendered by the template.
    tool_calls: Annotated[list[ToolCallIn], msgspec.Meta(max_length=128)] | None = None
    #: A ``tool`` message's answer names the call it answers.
    tool_call_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; none: empty)."""
        content = self.content
        if content is None:
            return ""
        return content if isinstance(content, str) else "".join(p.text for p in content)


class ChatCompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``: ``messages`` rendered by the chat template."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=4096)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    #: Structured output (:mod:`frontend.guides`) and tool calls (:mod:`frontend.tools`).
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=1024)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None

    def max_new_tokens(self) -> int | None:
        """The answer's token budget: ``max_completion_tokens`` (OpenAI's name now) or
        ``max_tokens`` (its deprecated one); None when neither is given.

        Both may be given when they agree (a client that fills both from one setting).

        Raises:
            ApiError: 400 naming both fields when both are given and differ: which
                one the client meant is not ours to guess.
        """
        new, old = self.max_completion_tokens, self.max_tokens
        if new is not None and old is not None and new != old:
            raise bad_request(f"max_tokens ({old}) and max_completion_tokens ({new}) "
                              "disagree: give one (max_tokens is its deprecated name)",
                              param="max_completion_tokens", code="conflicting_values")
        return new if new is not None else old


class EmbeddingRequest(_Body, kw_only=True):
    """``POST /v1/embeddings``: one text, a batch of texts, or token ids."""

    model: ModelName
    input: Annotated[str, msgspec.Meta(max_length=1 << 24)] | Annotated[
        list[TokenId | str | list[TokenId]], msgspec.Meta(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None


# -- responses ------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    """What the prompt's tokens cost: ``cached_tokens`` were read from the replica's
    prefix cache instead of computed."""

    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """Token counts of one answer.

    ``prompt_tokens_details`` is always present (``cached_tokens`` 0 with the
    prefix cache off), so a client reads one shape whatever the server's flags.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(
        default_factory=PromptTokensDetails)


class CompletionLogprobs(msgspec.Struct):
    """The sampled tokens' log-probabilities, each position's ``logprobs`` most likely
    tokens (``top_logprobs``: text -> logprob, the sampled token's included; null when
    ``logprobs`` is 0), and where each token's text begins in the answer
    (``text_offset``, in characters)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] | None = None


class CompletionChoice(msgspec.Struct):
    """One answer (or one streamed piece of it) of a completion."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    """A completion, or one chunk of a streamed one (same object type, as OpenAI's)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class FunctionOut(msgspec.Struct, omit_defaults=True):
    """A tool call's function (``arguments``: JSON text); in a streamed delta, the
    name comes once and the arguments in pieces."""

    name: str | None = None
    arguments: str = ""


class ToolCall(msgspec.Struct):
    """One tool call of the assistant's message."""

    id: str
    function: FunctionOut
    type: str = "function"


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed piece of a tool call: its ``index``; ``id``, ``type`` and the name
    in its first piece, pieces of the arguments after."""

    index: int
    function: FunctionOut
    id: str | None = None
    type: str | None = None


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    """The assistant's message: text, or tool calls (``content`` null then)."""

    content: str | None
    role: str
    tool_calls: list[ToolCall] | None = None


class TopLogprob(msgspec.Struct):
    """One of the most likely tokens at a position of a chat answer."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    """One sampled token of a chat answer, its log-probability, and its position's
    ``top_logprobs`` most likely tokens (most likely first)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct):
    """``choices[i].logprobs`` of a chat answer."""

    content: list[TokenLogprob]


class ChatChoice(msgspec.Struct):
    """One answer of a chat completion."""

    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    """A chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chat chunk adds to the message."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    """One Server-Sent Event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class EmbeddingData(msgspec.Struct):
    """One embedding (a list of floats, or base64 of float32 little-endian)."""

    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    """Token counts of an embedding request."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    """The answer to ``POST /v1/embeddings``."""

    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class ModelCard(msgspec.Struct):
    """One served model."""

    id: str
    created: int
    owned_by: str = "typed-sched-bus"
    object: str = "model"
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    """The answer to ``GET /v1/models``."""

    data: list[ModelCard]
    object: str = "list"


# -- the door ---------------------------------------------------------------------

B = TypeVar("B", bound=_Body)

_DECODERS: dict[type[_Body], msgspec.json.Decoder[_Body]] = {}
_ENCODER = msgspec.json.Encoder()
#: ``... - at `$.messages[0].content` `` -> ``messages[0].content``
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"field `([^`]+)`")


#: Each body type's required fields (a null anywhere else means "not given").
_REQUIRED: dict[type, frozenset[str]] = {}


def decode(body: bytes, kind: type[B]) -> B:
    """Decode and validate a request body as ``kind``.

    Raises:
        ApiError: 400: the body is not JSON (code ``invalid_json``), or a
            field is missing, unknown, of the wrong type or out of range
            (``param`` names it, as a path like ``messages[0].role``).
    """
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        try:
            value = decoder.decode(body)
        except msgspec.ValidationError as exc:
            value = _without_nulls(body, kind, exc)
        except msgspec.DecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}",
                              code="invalid_json") from None
    except RecursionError:  # msgspec decodes an untyped value (a schema) by recursion
        raise bad_request("the body is nested too deeply to decode",
                          code="invalid_json") from None
    assert isinstance(value, kind)
    return value


def _without_nulls(body: bytes, kind: type[B], failed: msgspec.ValidationError) -> B:
    """The body again, its top-level ``null`` members left out, but for required fields.

    OpenAI reads ``null`` as "not given" for optional fields (``"temperature":
    null``, ``"tool_choice": null``); clients other than its Python one send
    it. A null asks for nothing, so one for a field this server does not
    implement is left out too (a value there is still a 400). Only a body
    that failed the typed decode comes here, so the common path pays nothing.
    The members are split as raw JSON, not parsed: what is left is decoded
    by the same typed decoder, so its errors name the same fields (a deep
    or out-of-range value is its 400, never a parse of our own).

    Raises:
        ApiError: 400 as :func:`decode`.
    """
    try:
        members = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:  # not an object: the typed decode said so
        raise _field_error(str(failed)) from None
    except msgspec.DecodeError as exc:  # (it met a null before the JSON broke)
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's own bound on nesting, met splitting a member
        raise bad_request("the body nests arrays or objects too deeply to be read",
                          code="invalid_json") from None
    required = _REQUIRED.get(kind)
    if required is None:
        required = _REQUIRED[kind] = frozenset(
            f.encode_name for f in msgspec.structs.fields(kind) if f.required)
    # (Decoded again even with no null left out: a duplicate key's last value is the
    # one kept, so its error, not an earlier null's, is the one to name.)
    kept = {k: v for k, v in members.items() if k in required or bytes(v) != b"null"}
    decoder = _DECODERS[kind]
    try:
        value = decoder.decode(msgspec.json.encode(kept))
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None
    except RecursionError:  # (not met: a typed field refuses a deep value at its top)
        raise _field_error(str(failed)) from None
    assert isinstance(value, kind)
    return value


def _field_error(text: str) -> ApiError:
    """A 400 from msgspec's message: flat, one regex each (a cold path attackers reach)."""
    text = text[:1000]
    at = _AT.search(text)
    path = at.group(1) if at else ""
    field = _FIELD.search(text)
    if field and ("unknown field" in text or "missing required field" in text):
        path = f"{path}.{field.group(1)}" if path else field.group(1)
        if "unknown field" in text:
            return bad_request(f"unsupported field {path!r}: this server does not implement "
                               f"it (remove it from the request)", param=path,
                               code="unsupported_field")
    message = _AT.sub("", text)
    return bad_request(f"{path or 'body'}: {message}", param=path or None)


def encode(body: msgspec.Struct) -> bytes:
    """A response body as JSON."""
    return _ENCODER.encode(body)


def encode_str(text: str) -> bytes:
    """A string as a JSON string."""
    return _ENCODER.encode(text)


#: Characters JSON may carry raw that line readers (``str.splitlines``: httpx's
#: ``iter_lines``) take for line ends, each with its escape.
_LINE_ENDS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"),
              (b"\xc2\x85", b"\\u0085"))


def sse_safe(data: bytes) -> bytes:
    """JSON ``data`` for one Server-Sent Event's line: U+2028, U+2029 and U+0085
    escaped (a model's U+2028 would split an event in two for an httpx reader).
    Only ever a character there: their bytes begin with a lead byte. ASCII data (most
    events) holds none of them: one C scan (``isascii``, ~30 ns here), not three
    searches (~0.35 us each on a 4-byte event text, measured under load)."""
    if data.isascii():
        return data
    if b"\xe2\x80\xa8" in data or b"\xe2\x80\xa9" in data or b"\xc2\x85" in data:
        for raw, escaped in _LINE_ENDS:
            data = data.replace(raw, escaped)
    return data


def check_supported(req: _Sampling) -> None:
    """Refuse what is declared but not implemented, at a non-default value.

    Raises:
        ApiError: 400 naming the option (``suffix``,
            ``top_logprobs`` without ``logprobs``, and ``stream_options`` without
            ``stream``, as OpenAI and vLLM refuse them).
    """
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed with stream=true",
                          param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:  # ("" asks for nothing)
            raise _unsupported("suffix", "suffix is not supported")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:  # (OpenAI's and vLLM's rule)
            raise bad_request("top_logprobs: only allowed with logprobs=true",
                              param="top_logprobs", code="invalid_value")
        _check_chat_options(req)


def _check_chat_options(req: ChatCompletionRequest) -> None:
    """Check the messages' content and the tool options (served: :mod:`frontend.tools`).

    Raises:
        ApiError: 400 naming ``messages[i].content`` (missing or null, but in an
            assistant message with tool calls), ``tool_choice`` (a choice other than
            ``none`` with no tools to choose from, as OpenAI refuses it, or naming a
            function not in ``tools``), or ``response_format`` beside tool calls
            (two constraints on one answer).
    """
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise bad_request(f"messages[{i}].content: required (null only in an assistant "
                              "message with tool_calls)", param=f"messages[{i}].content")
    choice = req.tool_choice
    if req.tools:
        if isinstance(choice, NamedTool) and choice.function.name not in {
                t.function.name for t in req.tools}:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is "
                              "not in tools", param="tool_choice", code="invalid_value")
        fmt = req.response_format
        if choice != "none" and fmt is not None and fmt.type != "text":
            raise bad_request("response_format: not with tool calls (tool_choice "
                              "'none' to use it)", param="response_format",
                              code="conflicting_values")
    elif choice is not None and choice != "none":
        shown = choice.type if isinstance(choice, NamedTool) else choice
        raise bad_request(f"tool_choice {shown!r} is only allowed when tools are given",
                          param="tool_choice", code="unsupported_value")


def logit_bias(bias: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """``logit_bias`` as the scheduler takes it: int ids, values clamped to -100..100
    (vLLM's; OpenAI's range). None when empty.

    Raises:
        ApiError: 400 naming ``logit_bias``: a key that is not a token id below ``vocab``.
    """
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab:
            raise bad_request(f"logit_bias: {key[:32]!r} is not a token id of this model "
                              f"(0 to {vocab - 1})", param="logit_bias", code="invalid_value")
        out[token] = min(100.0, max(-100.0, value))
    return out


def _unsupported(param: str, message: str) -> ApiError:
    return bad_request(message, param=param, code="unsupported_value")
