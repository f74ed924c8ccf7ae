"""Each answer token's text, as logprobs report it: the decoded text, not the vocabulary's piece.

vLLM reports the text a token adds to the answer (``' café'``, not
``'ĠcafÃ©'``), so ``"".join(tokens) == text``. A token that ends inside a
UTF-8 character (a byte-level BPE may split ``é`` in two) adds no text yet:
its string is ``""``, and the token that completes the character carries the
whole character (vLLM's ``LogprobsProcessor._correct_decoded_token`` gives
the same: the incomplete token ``""``, the completing one the character).
Bytes that can never form a character are U+FFFD, as in the answer's text.

With a tokenizer that knows each token's bytes
(:meth:`~frontend.tokenizer.Tokenizer.token_bytes`) the answer's bytes go
through one incremental UTF-8 decoder, exactly as the
:class:`~frontend.detokenizer.Detokenizer` builds the text; an alternative
(``top_logprobs``) at a position is decoded from the same state, without
moving it. A special token (no bytes) is shown by its name. Other
tokenizers give ``tokenizer.decode([id])`` (vLLM's own fallback).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from frontend.tokenizer import Tokenizer

__all__ = ["TokenTexts"]

_UTF8 = codecs.getincrementaldecoder("utf-8")


class TokenTexts:
    """One answer's token texts, position by position (:meth:`take`, :meth:`peek`)."""

    __slots__ = ("_dec", "_table", "_tok")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._table = tokenizer.token_bytes()
        self._dec = _UTF8("replace")

    def _bytes(self, token_id: int) -> bytes | None:
        table = self._table
        if table is None:
            return None
        raw = table[token_id] if token_id < len(table) else b""
        return raw or None

    def take(self, token_id: int) -> str:
        """The text the answer's next token ``token_id`` adds (the position moves on)."""
        raw = self._bytes(token_id)
        if raw is None:
            return self._other(token_id)
        return self._dec.decode(raw)

    def take_all(self, ids: Sequence[int]) -> list[str]:
        """:meth:`take` of each id in turn."""
        return [self.take(i) for i in ids]

    def peek(self, token_id: int) -> str:
        """The text ``token_id`` would add at the current position (nothing moves)."""
        raw = self._bytes(token_id)
        if raw is None:
            return self._other(token_id)
        dec = _UTF8("replace")
        dec.setstate(self._dec.getstate())
        return dec.decode(raw)

    def in_text(self, token_id: int) -> bool:
        """Whether ``token_id``'s string is part of the answer's text (a special token's
        name is not: the text leaves special tokens out)."""
        return self._table is None or self._bytes(token_id) is not None

    def _other(self, token_id: int) -> str:
        if self._table is not None:  # a special token, or an id past the vocabulary
            return self._tok.piece(token_id)
        return self._tok.decode([token_id])
