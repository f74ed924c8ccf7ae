"""Chat messages to prompt text: the tokenizer's own template, or a documented default.

The default template is ChatML, the format most open chat models use (a
message's ``name`` as ChatML spells it: ``<|im_start|>user name=alice``)::

    <|im_start|>system
    You are helpful.<|im_end|>
    <|im_start|>user
    Hello!<|im_end|>
    <|im_start|>assistant
    (the answer is generated from here; it ends at <|im_end|> or end-of-text)

The byte-level tokenizer has ``<|im_start|>`` and ``<|im_end|>`` as special
tokens. A Hugging Face tokenizer that has a ``chat_template`` in its
``tokenizer_config.json`` gets its own template, rendered with ``jinja2`` in
a sandbox (as ``transformers`` does) when ``jinja2`` is installed; without
``jinja2``, the default is used and the start-up log says so. A rendered
prompt's special token texts become their ids (``encode`` matches them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from frontend.errors import ApiError, TokenizerError
from frontend.schemas import ChatMessage
from frontend.tokenizer import Tokenizer
from frontend.tools import hermes_calls, hermes_system, template_messages

__all__ = ["ChatTemplate"]

log = logging.getLogger("frontend.chat")

#: Where a turn ends in the default template (a stop for chat answers).
END_OF_TURN = "<|im_end|>"


#: A template: the messages, whether to open the assistant's turn, the tools to show.
Render = Callable[[Sequence[ChatMessage], bool, "list[dict[str, object]] | None"], str]


def _default(messages: Sequence[ChatMessage], add_generation_prompt: bool,
             tools: list[dict[str, object]] | None = None) -> str:
    parts = [f"<|im_start|>system\n{hermes_system(tools)}{END_OF_TURN}\n"] if tools else []
    parts += [f"<|im_start|>{m['role']}{'' if m.get('name') is None else ' name=' + str(m['name'])}"
              f"\n{m['content']}{hermes_calls(m)}{END_OF_TURN}\n"
              for m in template_messages(list(messages))]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class ChatTemplate:
    """Renders a conversation for one tokenizer (see the module docstring).

    Attributes:
        source: ``"default"`` or ``"tokenizer"``: which template renders.
        stop_ids: token ids that end a chat answer (end of turn, end of text).
        stops: stop strings that end one (the end of turn, when it is not one token).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._render: Render = _default
        self.source = "default"
        own = tokenizer.chat_template
        if own is not None:
            jinja = _jinja(own, tokenizer)
            if jinja is not None:
                self._render, self.source = jinja, "tokenizer"
            else:
                log.warning("the tokenizer has a chat template, but jinja2 is not installed: "
                            "rendering chats with the default (ChatML) template instead")
        specials = tokenizer.special_tokens
        ids = [i for i in (tokenizer.eos_token_id, specials.get(END_OF_TURN)) if i is not None]
        self.stop_ids = sorted(set(ids))
        self.stops = [] if END_OF_TURN in specials or self.source != "default" else [END_OF_TURN]

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
               tools: list[dict[str, object]] | None = None) -> str:
        """The prompt text of ``messages`` (and of ``tools``, the functions the model may
        call, in OpenAI's shape: :mod:`frontend.tools`).

        Raises:
            ApiError: 400: the tokenizer's template refused the conversation
                (it raised, e.g. "roles must alternate").
        """
        try:
            return self._render(messages, add_generation_prompt, tools)
        except ApiError:
            raise
        except Exception as exc:
            raise ApiError(400, f"the chat template refused these messages: {exc}",
                           param="messages", code="chat_template") from None


def _jinja(source: str, tokenizer: Tokenizer) -> Render | None:
    """The tokenizer's Jinja template in a sandbox, or None without jinja2."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    def raise_exception(message: str) -> None:
        raise ApiError(400, f"the chat template refused these messages: {message}",
                       param="messages", code="chat_template")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
    except TemplateError as exc:  # found at start-up, not by the first chat
        raise TokenizerError(tokenizer.name, f"its chat template does not compile: {exc}"
                             ) from None
    specials = tokenizer.special_tokens

    def text_of(key: str) -> str:  # special_tokens maps "eos_token" and "</s>" to one id
        tid = specials.get(key)
        return next((t for t, i in specials.items() if i == tid and t != key), "")

    bos, eos = text_of("bos_token"), text_of("eos_token")

    def render(messages: Sequence[ChatMessage], add_generation_prompt: bool,
               tools: list[dict[str, object]] | None) -> str:
        return template.render(
            messages=template_messages(list(messages)), tools=tools,
            add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)

    return render
