"""Text to token ids and back: a byte-level tokenizer built in, or a Hugging Face one.

:class:`ByteTokenizer` needs no file: ids 0-255 are the UTF-8 bytes, then a
few special tokens (:data:`BYTE_SPECIALS`), so ``python -m frontend`` runs on
a fresh machine with the model's vocabulary sized to it (259 ids).

:class:`HFTokenizer` loads a ``tokenizer.json`` with the ``tokenizers``
library, and the chat template and special tokens of a
``tokenizer_config.json`` beside it when there is one. Nothing is ever
downloaded: :func:`load_tokenizer` takes a file or a directory.

Both tell the detokenizer each token's exact bytes when they know them
(:meth:`Tokenizer.token_bytes`: always for the byte-level one, and for a
byte-level BPE), so text is rebuilt byte by byte; other tokenizers are
decoded by windows (:mod:`frontend.detokenizer`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from functools import cache
from typing import Protocol

import tokenizers

from frontend.errors import TokenizerError

__all__ = ["BYTE_SPECIALS", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

#: The byte-level tokenizer's special tokens, from id 256 on.
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class Tokenizer(Protocol):
    """What the frontend needs of a tokenizer."""

    @property
    def name(self) -> str:
        """Where it came from (for logs)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to ``vocab_size - 1`` (the model's vocabulary is sized to it)."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-text id, a stop token unless a request says ``ignore_eos``."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (Jinja), when it has one."""
        ...

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token text -> id (``bos_token``, ``eos_token``, ``<|im_end|>``, ...)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; special token texts inside it become their ids."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        ...

    def token_bytes(self) -> Sequence[bytes] | None:
        """Each id's exact bytes (special tokens: ``b""``), or None if unknown."""
        ...

    def piece(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens by name)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus :data:`BYTE_SPECIALS` (256 on). No file, no download."""

    def __init__(self) -> None:
        self.special_tokens = {t: 256 + i for i, t in enumerate(BYTE_SPECIALS)}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in BYTE_SPECIALS) + ")")
        self._table = [bytes([i]) for i in range(256)] + [b""] * len(BYTE_SPECIALS)

    name = "byte-level"
    vocab_size = 256 + len(BYTE_SPECIALS)
    eos_token_id: int | None = 256
    chat_template: str | None = None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes; special token texts become their ids."""
        if "<|" not in text:
            return list(text.encode())
        ids: list[int] = []
        for part in self._split.split(text):
            special = self.special_tokens.get(part)
            if special is not None:
                ids.append(special)
            elif part:
                ids.extend(part.encode())
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes decoded as UTF-8 (invalid sequences replaced), specials left out."""
        table = self._table
        return b"".join(table[i] if i < len(table) else b"" for i in ids).decode(
            errors="replace")

    def token_bytes(self) -> Sequence[bytes]:
        """Ids 0-255 are their byte; specials are empty."""
        return self._table

    def piece(self, token_id: int) -> str:
        """A byte as text (``\\x..`` when not ASCII), a special by name."""
        if token_id >= 256:
            names = BYTE_SPECIALS
            i = token_id - 256
            return names[i] if i < len(names) else f"<|{token_id}|>"
        return bytes([token_id]).decode("latin-1") if token_id < 128 else f"\\x{token_id:02x}"


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted (ByteLevel BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


#: Texts up to this many characters are encoded holding the GIL (``tokenizers``'
#: ``encode`` never releases it: a 1M-character prompt held every other thread,
#: the event loop included, for seconds); longer ones go through ``encode_batch``,
#: which releases it and gives the same ids. Under the bound the hold is a few
#: milliseconds at most (7 ms for 4,096 characters with a 384-id BPE).
_HOLD_GIL_CHARS = 4096


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (and its ``tokenizer_config.json``), local files only.

    Raises (at construction):
        TokenizerError: the file is missing or cannot be read.
    """

    def __init__(self, path: str) -> None:
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise TokenizerError(path, "no tokenizer.json there (nothing is downloaded: give "
                                       "a local file or a directory holding one)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(file)
            with open(file, encoding="utf-8") as f:
                spec = json.load(f)
        except Exception as exc:
            raise TokenizerError(path, f"cannot read {file}: {exc}") from exc
        # A tokenizer.json may carry the truncation and padding it was last used with
        # (max_length 512, pad to 32...): a prompt would be cut or padded without a
        # word. transformers resets both on every call unless asked; so does this.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = path
        config = _read_config(os.path.join(os.path.dirname(file), "tokenizer_config.json"))
        self.chat_template = _template(config.get("chat_template"))
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: i for i, t in added.items() if t.special}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(key))
            if text is not None and (tid := self._tok.token_to_id(text)) is not None:
                self.special_tokens[key] = tid
                self.special_tokens.setdefault(text, tid)
        eos = self.special_tokens.get("eos_token")
        if eos is None:
            eos = next((self.special_tokens[t] for t in ("<|endoftext|>", "</s>", "<eos>")
                        if t in self.special_tokens), None)
        self.eos_token_id = eos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        decoder = spec.get("decoder") or {}
        self._table = self._byte_table() if decoder.get("type") == "ByteLevel" else None

    def _byte_table(self) -> list[bytes] | None:
        """Each id's bytes, when every token is in ByteLevel's alphabet (else None)."""
        inv = _byte_decoder()
        table: list[bytes] = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is None or i in self._special_ids:
                table.append(b"")
            elif all(c in inv for c in piece):
                table.append(bytes(inv[c] for c in piece))
            else:  # an added (not special) token is kept as its text
                table.append(piece.encode())
        return table

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens`` adds what the post-processor adds (BOS).

        A text past :data:`_HOLD_GIL_CHARS` is encoded without the GIL, so a thread
        encoding it (the door's, off its event loop) lets the loop run meanwhile.
        """
        if len(text) <= _HOLD_GIL_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self) -> Sequence[bytes] | None:
        """Exact bytes per id for a byte-level BPE; None for others."""
        return self._table

    def piece(self, token_id: int) -> str:
        """The token's text as the vocabulary spells it."""
        return self._tok.id_to_token(token_id) or f"<|{token_id}|>"


def _read_config(path: str) -> dict[str, object]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerError(path, f"cannot read tokenizer_config.json: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: object) -> str | None:
    """``"</s>"`` or ``{"content": "</s>", ...}`` (both spellings occur)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template(value: object) -> str | None:
    """A template string, or the ``default`` of a list of named ones."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def load_tokenizer(path: str | None) -> Tokenizer:
    """The byte-level tokenizer (``path`` None), or the Hugging Face one at ``path``.

    Raises:
        TokenizerError: nothing readable at ``path``.
    """
    return ByteTokenizer() if path is None else HFTokenizer(path)
