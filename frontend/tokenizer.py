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

    def fewest_tokens(self, text: str) -> int:
        """The fewest ids ``encode(text)`` can give, found without tokenizing it: a
        prompt sure to pass the context is refused before its seconds of tokenizing."""
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

    def fewest_tokens(self, text: str) -> int:
        """One id a byte, but a special token's text is one id for all its bytes."""
        if "<|" not in text:
            return utf8_length(text)
        return -(-utf8_length(text) // max(len(t) for t in BYTE_SPECIALS))


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
        self._most_bytes = _most_bytes_per_token(spec, self._table, self._tok)

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

    def fewest_tokens(self, text: str) -> int:
        """The text's UTF-8 length over the most bytes one token stands for (0 where
        the file allows no such bound: :func:`_most_bytes_per_token`)."""
        most = self._most_bytes
        return 0 if most is None else -(-utf8_length(text) // most)


def utf8_length(text: str) -> int:
    """``len(text.encode())``, without encoding an ASCII text (``isascii`` is O(1))."""
    return len(text) if text.isascii() else len(text.encode())


#: Normalizers that never drop text, each with the most it can shrink it: one code
#: point of up to 4 UTF-8 bytes becomes one of a single byte at worst (NFKC's
#: U+1D400 to "A", Lowercase's Kelvin sign to "k"; composing NFC's marks and
#: Hangul jamo shrinks less). Prepend and a growing Replace only add bytes.
_SHRINKS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
#: Pre-tokenizers that only split text, never respell or drop any (Split and
#: Punctuation unless their behavior is "removed").
_SPLITS_ONLY = {"Digits", "Split", "Punctuation"}
#: Pre-tokenizers that never drop text. Not UnicodeScripts: it drops a text made
#: only of characters of no script (spaces, digits, punctuation) and any such run
#: before the first letter.
_KEEPS_TEXT = {"ByteLevel", "Metaspace", *_SPLITS_ONLY}


def _shrink(normalizer: object) -> int | None:
    """How many times fewer bytes ``normalizer`` can leave of a text (None: unbounded)."""
    if normalizer is None:
        return 1
    if not isinstance(normalizer, dict):
        return None
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers") or ():
            one = _shrink(step)
            if one is None:
                return None
            factor *= one
        return factor
    if kind == "Replace":
        pattern, content = normalizer.get("pattern"), normalizer.get("content")
        fixed = pattern.get("String") if isinstance(pattern, dict) else None
        grows = (isinstance(fixed, str) and isinstance(content, str)
                 and len(content.encode()) >= len(fixed.encode()) > 0)
        return 1 if grows else None
    return _SHRINKS.get(str(kind))


def _keeps_text(pre: object) -> bool:
    """Whether the pre-tokenizer ``pre`` hands the model every byte it was given."""
    if pre is None:
        return True
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers") or ())
    return pre.get("type") in _KEEPS_TEXT and str(pre.get("behavior")).lower() != "removed"


def _byte_level_input(pre: object) -> bool:
    """Whether the model is given only ByteLevel's 256 characters: ``pre`` respells
    last with ByteLevel (what follows it may only split)."""
    if not isinstance(pre, dict):
        return False
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    for step in reversed(steps if isinstance(steps, list) else []):
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "ByteLevel":
            return True
        if kind not in _SPLITS_ONLY:
            return False
    return False


def _most_bytes_of_an_unknown(model: dict[str, object], byte_level: bool) -> int | None:
    """The most bytes of text one id stands for where ``model`` (BPE or Unigram) meets
    a character its vocabulary lacks, or None where it may give none or one for a run.

    A byte fallback gives one id a byte, but only with all 256 ``<0xXX>`` pieces
    (without one it falls back to ``unk``); a byte-level BPE whose vocabulary holds
    ByteLevel's whole alphabet never meets an unknown character; a BPE's unfused
    ``unk`` is one id a character. Otherwise no bound: a BPE with no ``unk`` drops
    the character, a fused ``unk`` (Unigram's always is) is one id for a run.
    """
    kind = model.get("type")
    vocab = model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        pieces: set[object] = set(vocab)
    elif kind == "Unigram" and isinstance(vocab, list):
        pieces = {p[0] for p in vocab if isinstance(p, list) and p}
    else:
        return None
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in pieces for b in range(256)):
        return 1
    if kind == "Unigram":
        return None
    if byte_level and pieces.issuperset(_byte_decoder()):
        return 1
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return 4  # an unknown character, one id each
    return None


def _most_bytes_per_token(spec: dict[str, object], table: Sequence[bytes] | None,
                          tok: tokenizers.Tokenizer) -> int | None:
    """The most UTF-8 bytes of a text that one of ``spec``'s tokens can stand for,
    or None where the file allows no bound.

    A token stands for its own bytes: its exact ones (``table``, a byte-level BPE
    fed ByteLevel's characters; a ByteLevel decoder alone says nothing of what the
    model is fed) or its spelling in the vocabulary, never fewer than the text it covers (a
    byte-level BPE's, a Metaspace ``▁``, a byte-fallback ``<0x41>`` all spell more).
    An added token stands for its content. Unbounded: a normalizer or
    pre-tokenizer that may drop text (Strip, StripAccents, Whitespace, ...), an
    added token that swallows the whitespace beside it (``lstrip``/``rstrip``), or
    a model that may give no id for a character or one for a run of them
    (:func:`_most_bytes_of_an_unknown`).
    """
    shrink = _shrink(spec.get("normalizer"))
    model = spec.get("model")
    pre = spec.get("pre_tokenizer")
    if shrink is None or not _keeps_text(pre) or not isinstance(model, dict):
        return None
    byte_level = _byte_level_input(pre)
    most = _most_bytes_of_an_unknown(model, byte_level)
    if most is None:
        return None
    added = spec.get("added_tokens") or []
    if not isinstance(added, list):
        return None
    for token in added:
        if not isinstance(token, dict) or token.get("lstrip") or token.get("rstrip"):
            return None
        most = max(most, len(str(token.get("content", "")).encode()))
    if table is not None and byte_level:  # a piece's characters are the bytes it covers
        most = max(most, max(map(len, table), default=0))
    else:  # each character of a piece covers at most its own bytes (a decoder aside)
        most = max(most, max((len(p.encode()) for p in tok.get_vocab()), default=0))
    return most * shrink


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
