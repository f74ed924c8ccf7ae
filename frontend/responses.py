"""An answer as OpenAI spells it: the whole body of a completion or chat completion,
or its Server-Sent Events one by one.

:class:`ResponseShaper` is the only place that builds these bytes: a request
handler (:mod:`frontend.generate`) feeds it the text, token ids, logprobs and
finish reason of each step the engine sent, and writes out what it returns.
It knows the endpoint's spelling (``text_completion`` choices or chat deltas),
a completion's ``echo`` (the answer begins with its prompt, and its logprobs),
the logprobs' shapes (a completion's token lists and ``text_offset``, a chat's
entries with their bytes), tool calls (through the request's
:class:`~frontend.tools.ToolPlan`), and the usage events. Every event is one
``data: {...}`` line (:func:`~frontend.schemas.sse_safe`); :data:`DONE` ends a
stream.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from frontend.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
    encode,
    encode_str,
    sse_safe,
)
from frontend.token_text import TokenTexts
from frontend.tokenizer import Tokenizer
from frontend.tools import ToolPlan
from scheduler.engine.handles import Tops

__all__ = ["DONE", "LOGPROB_FLOOR", "ResponseShaper"]

#: The event that ends a stream.
DONE = b"data: [DONE]\n\n"
#: The least logprob an answer reports (vLLM's): a top alternative a guide forbids is
#: -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0
#: Stands for an event's text while the bytes around it are encoded.
_MARK = "\x00text\x00"
_MARK_JSON = msgspec.json.encode(_MARK)


class ResponseShaper:
    """Shapes one answer as its endpoint spells it (a completion or a chat completion):
    the whole body (:meth:`whole`), or its Server-Sent Events one by one
    (:meth:`event`, :meth:`tool_event`, :meth:`usage_event`).

    One shaper per answer: it remembers what the answer's events so far have said
    (the first one carries the chat role; an echoed prompt goes before the first
    text; each token's text depends on the tokens before it).

    Attributes:
        chat: a chat completion (else a completion).
        index: its choice's index (one answer of several in one response).
        id: the answer's id (``cmpl-...`` or ``chatcmpl-...``).
        created: when it was made (Unix seconds).
        model: the model name it reports.
    """

    def __init__(self, chat: bool, rid: str, model: str, tok: Tokenizer,
                 index: int = 0) -> None:
        self.chat = chat
        self.index = index
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        self.created = int(time.time())
        self.model = model
        self._tok = tok
        # Made when logprobs are first reported.
        self._texts: TokenTexts | None = None
        #: ``echo``: the prompt's text (and logprobs) the answer's first event or body
        #: begins with (:meth:`echo`); ``_shift``: where the answer's text begins.
        self._prefix: tuple[str, CompletionLogprobs | None] | None = None
        self._shift = 0
        self._first = True
        self._around: tuple[bytes, bytes] | None = None

    def for_choice(self, index: int) -> ResponseShaper:
        """A new shaper of the same answer id, model and tokenizer for choice ``index``
        (one answer of several streamed as one response)."""
        rid = self.id.split("-", 1)[1]
        return ResponseShaper(self.chat, rid, self.model, self._tok, index=index)

    def echo(self, prompt_ids: Sequence[int], lps: Sequence[float] | None,
             tops: Tops | None, with_logprobs: bool) -> None:
        """Begin the answer with its prompt (a completion's ``echo``): its text (decoded,
        special tokens left out, as vLLM echoes ids), and with ``with_logprobs`` each
        prompt token's text and logprob (the first's null, as OpenAI and vLLM give it;
        ``lps`` the others', ``tops`` their alternatives)."""
        text = self._tok.decode(prompt_ids)
        self._shift = len(text)
        if not with_logprobs:
            self._prefix = (text, None)
            return
        texts = TokenTexts(self._tok)
        tokens: list[str] = []
        values: list[float | None] = [None, *(lps or ())]
        top: list[dict[str, float] | None] | None = [None] if tops is not None else None
        offsets: list[int] = []
        at = 0
        for j, i in enumerate(prompt_ids):
            if top is not None and tops is not None and j:
                d: dict[str, float] = {}
                for t, lp in tops[j - 1]:
                    d.setdefault(texts.peek(t), lp)
                top.append(d)
            offsets.append(at)
            piece = texts.take(i)
            if top is not None and j and lps is not None:
                d.setdefault(piece, lps[j - 1])
            tokens.append(piece)
            at += len(piece) if texts.in_text(i) else 0
        self._prefix = (text, CompletionLogprobs(tokens, values[:len(tokens)], top,
                                                 text_offset=offsets))

    def _echoed(self, text: str, lp: CompletionLogprobs | None) -> tuple[
            str, CompletionLogprobs | None]:
        """``text`` and ``lp`` after the prompt, when it is still to be sent."""
        prefix, self._prefix = self._prefix, None
        if prefix is None:
            return text, lp
        head, head_lp = prefix
        if head_lp is None or lp is None:
            return head + text, lp
        top: list[dict[str, float] | None] | None
        if lp.top_logprobs is None and lp.tokens:
            top = None
        elif head_lp.top_logprobs is None:
            # A one-token prompt scores nothing, so no alternatives came for it (None
            # when no prompt in its batch had any): the answer's alternatives stay.
            nulls: list[dict[str, float] | None] = [None] * len(head_lp.tokens)
            top = None if lp.top_logprobs is None else nulls + lp.top_logprobs
        else:
            top = head_lp.top_logprobs + (lp.top_logprobs or [])
        offsets: list[int] | None
        if lp.text_offset is None or head_lp.text_offset is None:
            offsets = None
        else:
            offsets = head_lp.text_offset + lp.text_offset
        return head + text, CompletionLogprobs(
            head_lp.tokens + lp.tokens, head_lp.token_logprobs + lp.token_logprobs, top,
            text_offset=offsets)

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float] | None,
                  offsets: Sequence[int] | None, tops: Tops | None = None
                  ) -> CompletionLogprobs | ChatLogprobs | None:
        if lps is None:
            return None
        if offsets is not None and self._shift:  # after an echoed prompt
            offsets = [o + self._shift for o in offsets]
        # Each token's decoded text (frontend.token_text): "".join(tokens) is the answer;
        # an alternative's text is what it would have added at its position.
        texts = self._texts
        if texts is None:
            texts = self._texts = TokenTexts(self._tok)
        alts: list[list[tuple[str, int, float]]] | None = None
        if tops is None:
            pieces = texts.take_all(ids)
        else:
            pieces, alts = [], []
            for i, here in zip(ids, tops, strict=True):
                # (a guide's forbidden tokens are -inf: JSON has no -inf, vLLM's floor)
                alts.append([(texts.peek(t), t, max(lp, LOGPROB_FLOOR)) for t, lp in here])
                pieces.append(texts.take(i))
        if self.chat:
            # ``bytes`` is the token's own bytes where the tokenizer knows them (a
            # token that ends inside a character has text "" but its bytes), as
            # OpenAI's: the bytes of the tokens joined decode to the answer.
            table = self._tok.token_bytes()

            def own(i: int, text: str) -> list[int]:
                if table is not None and i < len(table) and table[i]:
                    return list(table[i])
                return list(text.encode())

            raw = [own(i, p) for i, p in zip(ids, pieces, strict=True)]
            entries = [TokenLogprob(p, lp, b) for p, lp, b in zip(pieces, lps, raw, strict=True)]
            if alts is not None:
                for entry, alt in zip(entries, alts, strict=True):
                    entry.top_logprobs = [TopLogprob(a, lp, own(t, a)) for a, t, lp in alt]
            return ChatLogprobs(entries)
        top: list[dict[str, float] | None] | None = None
        if alts is not None:
            # The top ones and the sampled one, as OpenAI and vLLM give; two ids of one
            # text (both "": each ends inside a character) keep the likelier.
            top = []
            for alt, p, lp in zip(alts, pieces, lps, strict=True):
                d: dict[str, float] = {}
                for a, _, alp in alt:
                    d.setdefault(a, alp)
                d.setdefault(p, lp)
                top.append(d)
        return CompletionLogprobs(pieces, list[float | None](lps), top,
                                  text_offset=None if offsets is None else list(offsets))

    def event(self, text: str, finish: str | None, ids: Sequence[int],
              lps: Sequence[float] | None, usage: Usage | None,
              offsets: Sequence[int] | None = None, tops: Tops | None = None) -> bytes:
        """One streamed step of the answer: its text, and its finish reason, logprobs
        and usage so far where given."""
        first, self._first = self._first, False
        role = "assistant" if first and self.chat else None
        only_text = (finish is None and lps is None and usage is None and role is None
                     and self._prefix is None)
        if only_text:
            # Most events differ only in their text: the bytes around it are
            # encoded once per request (a tenth of building and encoding it all).
            around = self._around
            if around is None:
                head, mark, tail = self._event(_MARK, None, None, None, None).partition(_MARK_JSON)
                assert mark and _MARK_JSON not in tail  # (the id and model are ours)
                around = self._around = (head, tail)
            return around[0] + sse_safe(encode_str(text)) + around[1]
        return self._event(text, finish, self._logprobs(ids, lps, offsets, tops), usage, role)

    def _event(self, text: str, finish: str | None, lp: CompletionLogprobs | ChatLogprobs | None,
               usage: Usage | None, role: str | None) -> bytes:
        body: msgspec.Struct
        if self.chat:
            assert lp is None or isinstance(lp, ChatLogprobs)
            body = ChatCompletionChunk(self.id, self.created, self.model, [ChatChunkChoice(
                self.index, ChatDelta(role, text if text or role is None else ""), finish, lp)],
                usage=usage)
        else:
            assert lp is None or isinstance(lp, CompletionLogprobs)
            text, lp = self._echoed(text, lp)
            body = Completion(self.id, self.created, self.model,
                              [CompletionChoice(self.index, text, finish, lp)], usage=usage)
        return b"data: " + sse_safe(encode(body)) + b"\n\n"

    def tool_event(self, plan: ToolPlan, text: str, finish: str | None,
                   usage: Usage | None) -> list[bytes]:
        """A streamed step of an answer that may call tools (``plan.stream``)."""
        content, calls, finish = plan.stream(text, finish)
        first, self._first = self._first, False
        if not (first or content or calls or finish is not None or usage is not None):
            return []
        delta = ChatDelta("assistant" if first else None, content, calls or None)
        body = ChatCompletionChunk(self.id, self.created, self.model,
                                   [ChatChunkChoice(self.index, delta, finish)], usage=usage)
        return [b"data: " + sse_safe(encode(body)) + b"\n\n"]

    def usage_event(self, usage: Usage) -> bytes:
        """The event that carries the answer's usage, with no choice (``include_usage``)."""
        body: msgspec.Struct
        if self.chat:
            body = ChatCompletionChunk(self.id, self.created, self.model, [], usage=usage)
        else:
            body = Completion(self.id, self.created, self.model, [], usage=usage)
        return b"data: " + sse_safe(encode(body)) + b"\n\n"

    def whole(self, text: str, finish: str, ids: Sequence[int], lps: Sequence[float] | None,
              usage: Usage, offsets: Sequence[int] | None = None,
              tops: Tops | None = None, tools: ToolPlan | None = None) -> bytes:
        """The whole answer as one body (not streamed); ``tools``: the tool calls are
        read out of ``text``."""
        if offsets is not None:  # (a stop string may have cut text an earlier step began)
            offsets = [min(o, len(text)) for o in offsets]
        lp = self._logprobs(ids, lps, offsets, tops)
        if not self.chat:
            assert lp is None or isinstance(lp, CompletionLogprobs)
            text, lp = self._echoed(text, lp)
        if self.chat:
            assert lp is None or isinstance(lp, ChatLogprobs)
            message = ChatMessageOut(text, "assistant")
            if tools is not None:
                content, calls = tools.parse(text)
                message = ChatMessageOut(content, "assistant", calls or None)
                finish = tools.finish(finish, calls)
            return encode(ChatCompletion(self.id, self.created, self.model,
                                         [ChatChoice(self.index, message, finish, lp)],
                                         usage))
        assert lp is None or isinstance(lp, CompletionLogprobs)
        return encode(Completion(self.id, self.created, self.model,
                                 [CompletionChoice(self.index, text, finish, lp)], usage=usage))
