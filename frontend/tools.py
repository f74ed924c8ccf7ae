"""Tool calls: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` on chat completions.

How each ``tool_choice`` is served (``tools`` given; with none, only ``none`` is
accepted):

* ``none``: the tools are neither shown to the model nor called.
* a named function: the answer is constrained (a :class:`~messages.Guide`) to
  that function's ``parameters`` schema and returned as one ``tool_calls`` entry
  whose ``arguments`` are the answer; streamed, the arguments arrive as deltas as
  the model writes them. ``finish_reason`` is ``stop``, as OpenAI gives it.
* ``required``: the answer is constrained to a JSON array of calls, each
  ``{"name": one of the tools, "arguments": that tool's schema}`` (``anyOf`` over
  the tools; one call at most when ``parallel_tool_calls`` is false), returned as
  ``tool_calls`` with ``finish_reason`` ``tool_calls``.
* ``auto`` (the default with tools): the tools are rendered into the prompt by the
  chat template (a tokenizer's own gets them as ``tools=``, as ``transformers``'
  ``apply_chat_template``; the default ChatML template shows them Hermes-style in a
  system turn), and the answer is parsed by the Hermes / Qwen parser: each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a call, the
  rest of the text the content.

Streamed, ``auto`` sends the content as it comes, but for a tail that may begin
``<tool_call>`` (held until the next step tells); from a ``<tool_call>`` on, the
rest waits for the answer's end. With ``required`` and ``auto`` the calls are sent
once the answer is whole (a call is known only when its JSON is): one delta per
call, with its name and all its arguments. An assistant message's ``tool_calls`` and ``tool``
messages (a round trip) are rendered by the template.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Literal

from frontend.errors import bad_request
from frontend.guides import checked
from frontend.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionOut,
    NamedTool,
    ToolCall,
    ToolCallDelta,
)
from messages import Guide

__all__ = ["ToolPlan", "plan_of", "template_messages"]

#: The Hermes / Qwen tool-call format.
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_OPEN = "<tool_call>"


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolPlan:
    """How one request's tools are served (see the module docstring).

    Attributes:
        mode: ``auto``, ``named`` or ``required``.
        tools: the tools as a chat template takes them (OpenAI's shape, as dicts).
        guide: the constraint on the answer (``named`` and ``required``).
        name: the function a ``named`` choice calls.
    """

    mode: Literal["auto", "named", "required"]
    tools: list[dict[str, object]]
    guide: Guide | None = None
    name: str | None = None
    _id: str = field(default_factory=_call_id)
    _text: list[str] = field(default_factory=list)  # what waits for the answer's end
    _started: bool = False  # (named) the first delta went out
    _held: bool = False  # (auto) a <tool_call> began: the rest waits for the end
    _pending: str = ""  # (auto) a tail that may begin <tool_call>

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and its tool calls."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self._id, FunctionOut(self.name, text))]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut short (max_tokens): the text as it is
                return text, []
            return None, [ToolCall(_call_id(), FunctionOut(c["name"], _compact(c["arguments"])))
                          for c in calls]
        found: list[ToolCall] = []
        for body in _HERMES.findall(text):
            try:
                call = json.loads(body)
                name, args = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError, AttributeError):
                return text, []  # not a call after all: all of it is content
            if isinstance(args, str):  # (some models write the arguments as JSON text)
                try:
                    args = json.loads(args)
                except ValueError:
                    return text, []
            if name not in self._names() or not isinstance(args, dict):
                return text, []  # not a call of one of the tools: all of it is content
            found.append(ToolCall(_call_id(), FunctionOut(name, _compact(args))))
        if not found:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, found

    def _names(self) -> set[str]:
        return {str(f.get("name")) for t in self.tools
                if isinstance(f := t.get("function"), dict)}

    def finish(self, reason: str, calls: list[ToolCall]) -> str:
        """The answer's ``finish_reason``: ``tool_calls`` when it made calls, but for a
        named function's (``stop``, as OpenAI gives it)."""
        if calls and self.mode != "named" and reason == "stop":
            return "tool_calls"
        return reason

    def stream(self, text: str, finish: str | None
               ) -> tuple[str | None, list[ToolCallDelta], str | None]:
        """A streamed step's text as ``(content, tool call deltas, finish_reason)``."""
        if self.mode == "named":
            assert self.name is not None
            if not text and self._started:
                return None, [], finish
            first, self._started = not self._started, True
            delta = ToolCallDelta(0, FunctionOut(self.name if first else None, text),
                                  self._id if first else None, "function" if first else None)
            return None, [delta], finish
        shown = ""
        if self.mode == "auto" and not self._held:
            shown, text = self._content(text)
        if self.mode == "required" or self._held:
            self._text.append(text)
        if finish is None:
            return shown or None, [], None
        content, calls = self.parse("".join(self._text)) if self._text else (text, [])
        deltas = [ToolCallDelta(i, c.function, c.id, "function") for i, c in enumerate(calls)]
        return (shown + (content or "")) or None, deltas, self.finish(finish, calls)

    def _content(self, text: str) -> tuple[str, str]:
        """``auto``: the part of a step's text that is content for sure, and the rest:
        from ``<tool_call>`` on (held from then on), or a tail that may begin one."""
        text = self._pending + text
        at = text.find(_OPEN)
        if at >= 0:
            self._held, self._pending = True, ""
            return text[:at], text[at:]
        keep = next((k for k in range(min(len(_OPEN) - 1, len(text)), 0, -1)
                     if text.endswith(_OPEN[:k])), 0)
        self._pending = text[len(text) - keep:]
        return text[:len(text) - keep], self._pending


def plan_of(req: ChatCompletionRequest) -> ToolPlan | None:
    """How ``req``'s tools are served; ``None``: no tools, or ``tool_choice`` ``none``.

    Raises:
        ApiError: 400 naming the tool at fault (whatever ``tool_choice``): a name
            given twice, ``parameters`` that are not an object schema or cannot
            compile.
    """
    _check_tools(req)
    if not req.tools or req.tool_choice == "none":
        return None
    tools: list[dict[str, object]] = [
        {"type": "function", "function": {k: v for k, v in (
            ("name", t.function.name), ("description", t.function.description),
            ("parameters", t.function.parameters)) if v is not None}} for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedTool):
        i, tool = next((i, t) for i, t in enumerate(req.tools)
                       if t.function.name == choice.function.name)
        return ToolPlan("named", tools, checked(
            "json_schema", _compact(tool.function.parameters or {"type": "object"}),
            f"tools[{i}].function.parameters"),
            choice.function.name)
    if choice == "required":
        each = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}
            for t in req.tools]
        schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": each}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, checked("json_schema", _compact(schema), "tools"))
    return ToolPlan("auto", tools)


def _check_tools(req: ChatCompletionRequest) -> None:
    """Each tool's name is its own and its ``parameters`` an object schema that compiles.

    Raises:
        ApiError: 400 naming ``tools[i].function.name`` or ``.parameters``.
    """
    seen: set[str] = set()
    for i, tool in enumerate(req.tools or ()):
        name, params = tool.function.name, tool.function.parameters
        if name in seen:
            raise bad_request(f"tools[{i}].function.name: {name!r} names two tools",
                              param=f"tools[{i}].function.name", code="invalid_value")
        seen.add(name)
        if params is None:
            continue
        where = f"tools[{i}].function.parameters"
        if params.get("type", "object") != "object":
            raise bad_request(f"{where}: a function's parameters are an object schema "
                              f"(\"type\": \"object\"), not {_compact(params.get('type'))}",
                              param=where, code="invalid_value")
        checked("json_schema", _compact(params), where)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, object]]:
    """The messages as a chat template takes them: a call's ``arguments`` as an object
    where they parse (what ``transformers``' templates expect), ``tool_call_id``."""
    out: list[dict[str, object]] = []
    for m in messages:
        d: dict[str, object] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls: list[dict[str, object]] = []
            for c in m.tool_calls:
                try:
                    args: object = json.loads(c.function.arguments)
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def hermes_system(tools: list[dict[str, object]]) -> str:
    """The tools shown Hermes-style (the default template's system turn)."""
    listed = "\n".join(_compact(t) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object "
            "with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")


def hermes_calls(message: dict[str, object]) -> str:
    """An assistant message's calls as Hermes writes them (the default template)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return ""
    return "".join(f"<tool_call>\n{_compact(c['function'])}\n</tool_call>" for c in calls)
