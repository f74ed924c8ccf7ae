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
  ``tool_calls`` with ``finish_reason`` ``tool_calls``. Cut short (``length``), the
  calls whose arguments began are returned with their arguments as far as they
  went, streamed or not; before any began, the text is the content.
* ``auto`` (the default with tools): the tools are rendered into the prompt by the
  chat template (a tokenizer's own gets them as ``tools=``, as ``transformers``'
  ``apply_chat_template``; the default ChatML template shows them Hermes-style in a
  system turn), and the answer is parsed by the Hermes / Qwen parser: each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` becomes a call, the
  rest of the text the content.

Streamed, ``auto`` sends the content as it comes, but for a tail that may begin
``<tool_call>`` (held until the next step tells); from a ``<tool_call>`` on, the
rest is read as calls. With ``required`` and ``auto`` each call streams as OpenAI's
do: a first delta with its id and name once the name's JSON string is complete, then
its arguments as the model writes them (a call whose ``arguments`` is not a JSON
object or array, or whose name comes after them, waits: the rest at the end). A
call's ``arguments`` are the model's own JSON text without the whitespace outside
strings, streamed or not, so the deltas put together are the whole answer's. An
``auto`` block that turns out not to be a call (its JSON broken) is content at the
end, but what of it went out as a call stays sent. An assistant message's
``tool_calls`` and ``tool`` messages (a round trip) are rendered by the template.
"""

from __future__ import annotations

import itertools
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


_CLOSE = "</tool_call>"


@dataclass(slots=True)
class _Call:
    """A call as far as its JSON is read: its name (once its string is complete) and
    its arguments' text (without whitespace outside strings) so far."""

    name: str | None = None
    args: list[str] = field(default_factory=list)
    args_done: bool = False
    args_begun: bool = False  # ``arguments`` began as an object or array


class _CallReader:
    """Reads calls out of JSON text fed a piece at a time: each object opened at depth
    ``level - 1`` is a call (``required``'s array of calls: 2; an ``auto`` block's
    object: 1), whose ``name`` string and ``arguments`` (or ``parameters``) value
    are kept as they are read. Only a valid JSON prefix is read right; what it makes
    of broken text is checked by the whole-answer parse at the end."""

    __slots__ = ("_depth", "_esc", "_in_str", "_key", "_level", "_str", "_want", "calls")

    def __init__(self, level: int) -> None:
        self.calls: list[_Call] = []
        self._level = level
        self._depth = 0
        self._in_str = self._esc = False
        self._str: list[str] | None = None  # a string at the call's level, being read
        self._key: str | None = None  # the key whose value comes next (after its colon)
        self._want = False  # the next string at the call's level is a key

    def reset(self) -> None:
        """Forget any unfinished structure (a new ``auto`` block starts at depth 0)."""
        self._depth, self._in_str, self._esc, self._str, self._key = 0, False, False, None, None

    def feed(self, text: str) -> None:
        level = self._level
        for ch in text:
            call = self.calls[-1] if self.calls else None
            inside = call is not None and call.args_begun and not call.args_done
            if self._in_str:
                if inside:
                    call.args.append(ch)  # type: ignore[union-attr]
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._str is not None:
                        self._string_read("".join(self._str))
                        self._str = None
                    continue
                if self._str is not None:
                    self._str.append(ch)
                continue
            if ch in " \t\r\n":
                continue
            if inside:
                call.args.append(ch)  # type: ignore[union-attr]
            if ch == '"':
                self._in_str = True
                if self._depth == level:
                    self._str = []
            elif ch in "{[":
                if self._depth == level - 1 and ch == "{":
                    self.calls.append(_Call())
                    self._want, self._key = True, None
                elif self._depth == level and call is not None and self._key in (
                        "arguments", "parameters") and not call.args_begun:
                    call.args_begun = True
                    call.args.append(ch)
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if inside and self._depth == level:
                    call.args_done = True  # type: ignore[union-attr]
            elif self._depth == level:
                if ch == ",":
                    self._want, self._key = True, None
                elif ch == ":":
                    self._want = False

    def _string_read(self, raw: str) -> None:
        """A string at a call's level ended: a key, or the value of ``name``."""
        if self._want:
            try:
                self._key = json.loads(f'"{raw}"')
            except ValueError:
                self._key = None
        elif self._key == "name" and self.calls and self.calls[-1].name is None:
            try:
                self.calls[-1].name = json.loads(f'"{raw}"')
            except ValueError:
                pass


def _arguments(reader: _CallReader, i: int, value: object) -> str:
    """Call ``i``'s arguments as the model spelled them (``reader`` read them), or
    ``value`` in compact JSON (a string as it is) where it did not."""
    call = reader.calls[i] if i < len(reader.calls) else None
    if call is not None and call.args_done:
        return "".join(call.args)
    return value if isinstance(value, str) else _compact(value)


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
    _reader: _CallReader | None = None  # (required, auto) the calls read while streamed
    _sent: list[tuple[str, int]] = field(default_factory=list)  # each call's id, args sent
    _fed: int = 0  # (auto) how much of the held text the reader has seen
    _in_block: bool = False  # (auto) the reader is inside a <tool_call> block

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and its tool calls."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self._id, FunctionOut(self.name, text))]
        if self.mode == "required":
            try:
                calls = json.loads(text)
            except ValueError:  # cut short (max_tokens): the calls begun, as streamed
                return self._cut_short(text)
            reader = _CallReader(2)
            reader.feed(text)
            return None, [ToolCall(_call_id(), FunctionOut(
                c["name"], _arguments(reader, i, c["arguments"]))) for i, c in enumerate(calls)]
        found: list[ToolCall] = []
        for body in _HERMES.findall(text):
            try:
                call = json.loads(body)
                name, args = call["name"], call.get("arguments", call.get("parameters", {}))
            except (ValueError, KeyError, TypeError, AttributeError):
                return text, []  # not a call after all: all of it is content
            as_text = isinstance(args, str)  # (some models write the arguments as JSON text)
            if as_text:
                try:
                    args = json.loads(args)
                except ValueError:
                    return text, []
            if name not in self._names() or not isinstance(args, dict):
                return text, []  # not a call of one of the tools: all of it is content
            reader = _CallReader(1)
            reader.feed(body)
            found.append(ToolCall(_call_id(), FunctionOut(
                name, _compact(args) if as_text else _arguments(reader, 0, args))))
        if not found:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, found

    def _cut_short(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``required``'s answer cut short (its guide keeps the JSON valid otherwise):
        each call whose name was read and whose arguments began, its arguments as far
        as they went (as a named call's cut short is, and as OpenAI's are), the calls
        a stream sent; with none begun, the text is the content."""
        reader = _CallReader(2)
        reader.feed(text)
        begun = [ToolCall(_call_id(), FunctionOut(c.name, "".join(c.args)))
                 for c in itertools.takewhile(
                     lambda c: c.name is not None and c.args_begun, reader.calls)
                 if c.name is not None]
        return (None, begun) if begun else (text, [])

    def another(self) -> ToolPlan:
        """The same plan for another answer of the request (``n``): its own call id and
        streaming state, the tools and guide already built and checked."""
        return ToolPlan(self.mode, self.tools, self.guide, self.name)

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
            self._read(text)
        if finish is None:
            return shown or None, self._deltas(), None
        content, calls = self.parse("".join(self._text)) if self._text else (text, [])
        deltas = self._deltas(calls)
        return (shown + (content or "")) or None, deltas, self.finish(finish, calls)

    def _read(self, text: str) -> None:
        """Feed a streamed step's held text to the call reader (``auto``: only what is
        inside ``<tool_call>`` blocks)."""
        if self._reader is None:
            self._reader = _CallReader(2 if self.mode == "required" else 1)
        reader = self._reader
        if self.mode == "required":
            reader.feed(text)
            return
        held = "".join(self._text)
        while True:
            if not self._in_block:
                at = held.find(_OPEN, self._fed)
                if at < 0:
                    self._fed = max(self._fed, len(held) - len(_OPEN) + 1)
                    return
                self._in_block, self._fed = True, at + len(_OPEN)
                reader.reset()
            end = held.find(_CLOSE, max(self._fed - len(_CLOSE), 0))
            stop = len(held) if end < 0 else end
            reader.feed(held[self._fed:stop])
            self._fed = max(self._fed, stop)
            if end < 0:
                return
            self._in_block, self._fed = False, end + len(_CLOSE)

    def _deltas(self, calls: list[ToolCall] | None = None) -> list[ToolCallDelta]:
        """The tool-call deltas not sent yet: each call's first (id and name) once its
        name is read, its arguments as they grow; with the answer's ``calls`` (at its
        end), what of them is still to send."""
        out: list[ToolCallDelta] = []
        read = self._reader.calls if self._reader is not None else []
        sent = self._sent
        for i, c in enumerate(read):
            if i > len(sent) or c.name is None or not c.args_begun:
                break  # in order: a call waits for the one before
            if i == len(sent):
                sent.append((_call_id(), 0))
                out.append(ToolCallDelta(i, FunctionOut(c.name, ""), sent[i][0], "function"))
            done = sent[i][1]  # (``args`` holds one character an item)
            if len(c.args) > done:
                out.append(ToolCallDelta(i, FunctionOut(None, "".join(c.args[done:]))))
                sent[i] = (sent[i][0], len(c.args))
        if calls is None:
            return out
        for i, whole in enumerate(calls):
            if i >= len(sent):
                out.append(ToolCallDelta(i, whole.function, whole.id, "function"))
                continue
            whole.id, args = sent[i][0], whole.function.arguments
            if len(args) > sent[i][1]:
                out.append(ToolCallDelta(i, FunctionOut(None, args[sent[i][1]:])))
        return out

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
        defs: dict[str, object] = {}
        each = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": _rooted(t.function.parameters or {"type": "object"}, i, defs)},
            "required": ["name", "arguments"], "additionalProperties": False}
            for i, t in enumerate(req.tools)]
        schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": each}}
        if defs:
            schema["$defs"] = defs
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, checked("json_schema", _compact(schema), "tools"))
    return ToolPlan("auto", tools)


def _rooted(params: dict[str, object], i: int, defs: dict[str, object]) -> object:
    """Tool ``i``'s ``parameters`` as part of a larger schema: its ``$defs`` (or
    ``definitions``) moved into ``defs``, the root's, named ``t{i}.{name}``, and its
    local references (``#/$defs/...``) rewritten to them, since a ``$ref`` resolves
    from the root of the schema it is in (pydantic's schemas use these)."""
    prefixes = ("#/$defs/", "#/definitions/")

    def moved(node: object) -> object:
        if isinstance(node, dict):
            out = {k: moved(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str):
                for prefix in prefixes:
                    if ref.startswith(prefix):
                        out["$ref"] = f"#/$defs/t{i}.{ref[len(prefix):]}"
            return out
        if isinstance(node, list):
            return [moved(v) for v in node]
        return node

    body = dict(params)
    for key in ("$defs", "definitions"):
        local = body.pop(key, None)
        if isinstance(local, dict):
            for name, value in local.items():
                defs[f"t{i}.{name}"] = moved(value)
    return moved(body)


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
