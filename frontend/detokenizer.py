"""Incremental detokenization, one per request: new tokens in, new text out.

Two rules hold whatever the tokenizer:

* **Only whole characters leave.** A character split across tokens (a CJK
  character or an emoji is 3-4 UTF-8 bytes; a byte-level tokenizer emits
  one byte a token) is held until its last byte arrives, so a client never
  sees a replacement character for it. With a tokenizer that knows each
  token's bytes (:meth:`~frontend.tokenizer.Tokenizer.token_bytes`) the
  bytes go through Python's incremental UTF-8 decoder; otherwise the last
  few tokens are decoded as a window and new text is taken only when it
  does not end in U+FFFD (the technique of vLLM's ``detokenize_incrementally``:
  a prefix window and a read offset, so a token's text is read in context,
  leading spaces included). Bytes that can never form a character (a model
  may sample any byte) are replaced as any decoder would.
* **A stop string never leaks.** Text that could be the start of a stop
  string is held back until the next tokens show it is not; a match (which
  may span any number of tokens) cuts the text where the stop string begins
  and ends the request.

It runs on the event loop, in the handler of its request: one table lookup
and one C-level decode per token (see ``benchmarks/http.py`` for what a
stream costs with it).
"""

from __future__ import annotations

import encodings.utf_8
from collections.abc import Sequence

from frontend.tokenizer import Tokenizer

__all__ = ["Detokenizer"]

#: Prompt tokens that seed the decoding window (leading-space context).
_WINDOW_SEED = 5


#: The UTF-8 incremental decoder class, imported once (a codec registry lookup per
#: request was 1.5% of a non-streamed request's time, py-spy under load). Its
#: ``buffer`` holds the bytes of a character not whole yet.
_UTF8 = encodings.utf_8.IncrementalDecoder


def _continues(held: bytes, raw: bytes) -> bool:
    """Whether ``raw``'s first byte goes on the UTF-8 sequence ``held`` begins."""
    try:
        _UTF8("strict").decode(held + raw[:1])
    except UnicodeDecodeError:
        return False
    return True


class Detokenizer:
    """One request's text so far. :meth:`push` new ids, send what it returns.

    Attributes:
        stopped: a stop string matched; nothing more will be returned.
        tokens: ids pushed before the stop (what the answer's usage counts).
        chars: characters decoded so far, before any stop string's cut (where the
            next id's text begins in the answer: :meth:`push_offsets`).
    """

    __slots__ = ("_dec", "_held", "_ids", "_max_stop", "_out", "_prefix", "_read", "_stops",
                 "_table", "_tok", "chars", "stopped", "tokens")

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = (),
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._table = tokenizer.token_bytes()
        self._dec = _UTF8("replace")
        self._stops = tuple(s for s in stops if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._held = ""
        seed = list(prompt_ids[-_WINDOW_SEED:]) if self._table is None else []
        self._ids = seed
        self._prefix = 0
        self._read = len(seed)
        self.stopped = False
        self.tokens = 0
        self.chars = 0
        self._out = 0  # characters push_offsets returned

    def push(self, ids: Sequence[int]) -> str:
        """Take one step's new ids; return the text that may be sent now (maybe "")."""
        if self.stopped:
            return ""
        self.tokens += len(ids)
        table = self._table
        if table is not None:
            n = len(table)
            if len(ids) == 1:  # (a stream's usual step: no list built)
                i = ids[0]
                data = table[i] if i < n else b""
            else:
                data = b"".join([table[i] if i < n else b"" for i in ids])
            # ASCII with no bytes held from before is its own text: decoded in C, not
            # through the incremental decoder's Python-level ``decode`` (a quarter of
            # a streamed token's detokenizing).
            dec = self._dec
            if data.isascii() and not dec.buffer:
                text = data.decode("ascii")
            else:
                text = dec.decode(data)
        else:
            text = self._window(ids)
        self.chars += len(text)
        if not self._stops:
            return text
        return self._cut(text)

    def push_offsets(self, ids: Sequence[int]) -> tuple[str, list[int]]:
        """:meth:`push`, one id at a time; also where each id's text begins in the
        answer, in characters (OpenAI's ``text_offset``). An id that ends no character
        yet (the first bytes of one) begins where that character will; an id after
        bytes that its own show invalid begins after their U+FFFD; an id whose text a
        stop string cut begins at the answer's end."""
        tokens = self.tokens
        table = self._table
        offsets: list[int] = []
        parts: list[str] = []
        for i in ids:
            own = 0
            if table is not None:  # bytes held from earlier ids that this one shows invalid
                held = self._dec.getstate()[0]
                if held and i < len(table) and table[i] and not _continues(held, table[i]):
                    own = len(held.decode("utf-8", "replace"))
            offsets.append(self.chars + own)
            parts.append(self.push((i,)))
        if not self.stopped or tokens < self.tokens:  # counted as push(ids) counts a step
            self.tokens = tokens + len(ids)
        text = "".join(parts)
        self._out += len(text)
        if self.stopped:  # nothing past the cut: the answer ends at _out
            offsets = [min(o, self._out) for o in offsets]
        return text, offsets

    def finish(self) -> str:
        """The text still held at the end (no stop matched): send it last.

        An incomplete character at the very end (the answer was cut by
        ``max_tokens`` inside it) is dropped, not sent as U+FFFD.
        """
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held

    def _window(self, ids: Sequence[int]) -> str:
        all_ids = self._ids
        all_ids.extend(ids)
        decode = self._tok.decode
        prefix = decode(all_ids[self._prefix:self._read])
        full = decode(all_ids[self._prefix:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its next bytes
        self._prefix = self._read
        self._read = len(all_ids)
        if self._prefix > 64:  # keep the list short: only the window matters
            del all_ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return full[len(prefix):]

    def _cut(self, text: str) -> str:
        """Emit what cannot be part of a stop string; end at the first one found."""
        buf = self._held + text
        first = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self.stopped = True
            self._held = ""
            return buf[:first]
        # Hold the longest tail that begins some stop string.
        keep = 0
        for k in range(min(self._max_stop - 1, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                keep = k
                break
        if keep:
            self._held = buf[-keep:]
            return buf[:-keep]
        self._held = ""
        return buf
