"""``Tokenizer.fewest_tokens`` against tokenizer files whose model may give a character
no id, or one id for a run of them: the bound must never pass ``encode``'s count."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from frontend import HFTokenizer
from frontend.__main__ import parse, settings_from
from tests.frontend.bpe import CORPUS, train_byte_level
from tests.frontend.server import Server

#: Texts a lossy model shrinks most: no script, control bytes, characters no
#: small vocabulary holds.
TEXTS = [" " * 3000, "1234567890" * 300, ".,;!" * 750, "\x01" * 3000, "€" * 1000,
         "Ωλ" * 750, "zz€" * 600]
_BYTES = {f"<0x{b:02X}>": b for b in range(256)}


def _unicode_scripts(d: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(train_byte_level(d / "base") / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.UnicodeScripts(),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


def _partial_alphabet(d: Path) -> Tokenizer:
    # tokenizers' default: a byte-level BPE trained without ByteLevel's alphabet
    # has no id for a byte its corpus lacked, and drops it.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400))
    return tok


def _metaspace_on_byte_level(d: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(train_byte_level(d / "base") / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    return tok


def _byte_level_decoder_alone(d: Path) -> Tokenizer:
    # The model is fed raw text (no ByteLevel pre-tokenizer), so a piece spelled
    # 'æľº' covers its 6 bytes of text, not the 3 it decodes to.
    spec = json.loads((train_byte_level(d / "base") / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = None
    spec["model"]["vocab"]["<unk>"] = len(spec["model"]["vocab"])
    spec["model"]["unk_token"] = "<unk>"
    return Tokenizer.from_str(json.dumps(spec))


def _fallback_missing_bytes(d: Path) -> Tokenizer:
    # byte_fallback without the <0xXX> pieces falls back to a fused unk: one id a run.
    return Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1, "b": 2, "ab": 3},
                                merges=[("a", "b")], unk_token="<unk>", fuse_unk=True,
                                byte_fallback=True))


def _unigram_missing_bytes(d: Path) -> Tokenizer:
    return Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -1.0)], unk_id=0,
                                    byte_fallback=True))


def _llama_style(d: Path) -> Tokenizer:
    # The file that keeps a bound: byte fallback with every byte, a fused unk unused.
    vocab = {"<unk>": 0, **{p: 1 + b for p, b in _BYTES.items()}, "▁": 257, "a": 258,
             "▁a": 259}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    return tok


BUILDS: dict[str, Callable[[Path], Tokenizer]] = {
    "unicode_scripts": _unicode_scripts, "partial_alphabet": _partial_alphabet,
    "metaspace_on_byte_level": _metaspace_on_byte_level,
    "byte_level_decoder_alone": _byte_level_decoder_alone,
    "fallback_missing_bytes": _fallback_missing_bytes,
    "unigram_missing_bytes": _unigram_missing_bytes, "llama_style": _llama_style}


class _Built:
    """Each tokenizer built once for the module (hypothesis calls a test many times)."""

    def __init__(self) -> None:
        self._toks: dict[str, HFTokenizer] = {}

    def get(self, factory: pytest.TempPathFactory) -> dict[str, HFTokenizer]:
        if not self._toks:
            for name, build in BUILDS.items():
                where = factory.mktemp(name)
                build(where).save(str(where / "tokenizer.json"))
                self._toks[name] = HFTokenizer(str(where))
        return self._toks


_TOKENIZERS = _Built()


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_model_that_may_drop_or_fuse_text_never_bounds_above_its_ids(
        tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    # Without this: 3,000 spaces gave no id through UnicodeScripts, 1,000 '€' one
    # fused <unk>, and the bound said at least 152 and 600: a prompt that fits
    # refused 400 context_length_exceeded; and a ByteLevel decoder was taken to mean
    # a byte-level input: a piece's decoded bytes, half its text, the most per id.
    tok = _TOKENIZERS.get(tmp_path_factory)[name]
    longest = max((tok.piece(i) for i in range(tok.vocab_size)), key=lambda p: len(p.encode()))
    for text in [*TEXTS, longest * 100]:  # the longest piece, as the vocabulary spells it
        assert tok.fewest_tokens(text) <= len(tok.encode(text)), (name, text[:12])


def test_a_lossless_file_keeps_its_bound(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The early refusal stays where it is sound: every byte has an id.
    tok = _TOKENIZERS.get(tmp_path_factory)["llama_style"]
    assert tok.fewest_tokens("€" * 1000) >= 3000 // 6


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([*"ab ,.\n\t1é世🎉\x01\x7fΩ", "€€€", "ab", "      "]))
       .map("".join))
def test_the_bound_never_passes_the_ids(tmp_path_factory: pytest.TempPathFactory,
                                        text: str) -> None:
    for name, tok in _TOKENIZERS.get(tmp_path_factory).items():
        assert tok.fewest_tokens(text) <= len(tok.encode(text)), (name, text)


def test_a_prompt_a_lossy_tokenizer_shrinks_is_served_over_http(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    # Without this: 20,000 digits, which a BPE trained on no digit drops, were refused
    # 400 context_length_exceeded ('at least 953' of a 512-token context) untokenized.
    where = tmp_path / "tok"
    where.mkdir()
    _partial_alphabet(where).save(str(where / "tokenizer.json"))
    settings, _ = settings_from(parse(["--tokenizer", str(where), "--max-queued-tokens", "512",
                                       "--endpoint", str(tmp_path / "ep"), "--no-metrics"]))
    server = Server(settings, HFTokenizer(str(where)))
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "the fox " + "1" * 20_000, "max_tokens": 1})
        assert r.status_code == 200, r.text[:300]
    finally:
        server.stop()
