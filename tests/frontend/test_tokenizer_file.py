"""What a ``tokenizer.json`` may hold besides its vocabulary, against the prompt's ids."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from frontend import ByteTokenizer, HFTokenizer, Tokenizer
from frontend.__main__ import parse, settings_from
from tests.frontend.bpe import train_byte_level, train_metaspace
from tests.frontend.server import Server

PROMPT = "The quick brown fox jumps over the lazy dog, and the scheduler reads it whole."


def test_a_saved_truncation_or_padding_never_cuts_or_pads_a_prompt(tmp_path: Path) -> None:
    # Without this: a tokenizer.json saved with truncation (max_length 8) and padding
    # (to 32, with EOS) turned every prompt into its first 8 ids and 24 EOS ids, silently.
    plain = train_byte_level(tmp_path / "plain")
    expected = HFTokenizer(str(plain)).encode(PROMPT)
    saved = tokenizers.Tokenizer.from_file(str(plain / "tokenizer.json"))
    saved.enable_truncation(max_length=8)
    saved.enable_padding(length=32, pad_id=0, pad_token="<|endoftext|>")
    (tmp_path / "saved").mkdir()
    saved.save(str(tmp_path / "saved" / "tokenizer.json"))
    tok = HFTokenizer(str(tmp_path / "saved"))
    assert len(expected) > 8
    assert tok.encode(PROMPT) == expected
    long = PROMPT * 200  # the long path (encode_batch, off the GIL) too
    assert tok.encode(long) == HFTokenizer(str(plain)).encode(long)


class _Counted(HFTokenizer):
    """A real tokenizer, noting the length of each text it tokenizes."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.lengths: list[int] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.lengths.append(len(text))
        return super().encode(text, add_special_tokens=add_special_tokens)


def test_a_prompt_sure_to_pass_the_context_is_refused_untokenized(tiny_hf: Path,
                                                                   tmp_path: Path) -> None:
    # Without this: a 2 MB prompt was tokenized whole (seconds of a core; 9 s for
    # 4 MB with this BPE) before the context check refused it. It is refused on its
    # UTF-8 length alone, with the context check's own 400.
    settings, _ = settings_from(parse(["--model", str(tiny_hf), "--served-model-name", "tiny",
                                       "--endpoint", str(tmp_path / "ep"), "--no-metrics"]))
    tok = _Counted(str(tiny_hf))
    server = Server(settings, tok)
    text = "the scheduler reads a prompt " * 70_000  # 2 MB, ~400k tokens; context 4096
    cases: list[tuple[str, dict[str, object], str]] = [
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", text]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
         "messages"),
        ("/v1/embeddings", {"input": [text]}, "input")]
    try:
        for path, body, param in cases:
            r = httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=60)
            assert r.status_code == 400, (path, r.text[:300])
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
            assert "4096 tokens" in error["message"] and "at least" in error["message"], error
        assert max(tok.lengths, default=0) < 1000, "a text past the context was tokenized"
        # A long text that fits is still tokenized and served (the bound refuses none).
        fits = "the scheduler reads a prompt " * 600  # 17,400 characters: off the loop
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": fits, "max_tokens": 1})
        assert r.status_code == 200, r.text[:300]
        assert max(tok.lengths) == len(fits)
    finally:
        server.stop()


class _Built:
    """The tokenizers the bound is checked on, trained once for the module's examples."""

    def __init__(self) -> None:
        self._toks: list[Tokenizer] = []

    def get(self, factory: pytest.TempPathFactory) -> list[Tokenizer]:
        if not self._toks:
            where = factory.mktemp("toks")
            self._toks = [ByteTokenizer(), HFTokenizer(str(train_byte_level(where / "bpe"))),
                          HFTokenizer(str(train_metaspace(where / "meta")))]
        return self._toks


_TOKENIZERS = _Built()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*"ab ,.\n\té世🎉", "<|im_end|>", "<|endoftext|>", "</s>",
                                 "<unk>", "the ", "quick", "      "])).map("".join))
def test_the_fewest_tokens_never_exceed_the_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                   text: str) -> None:
    # The bound refuses a prompt only if tokenizing it would have: it is never above
    # the ids a tokenizer gives, specials and multi-byte characters included.
    for tok in _TOKENIZERS.get(tmp_path_factory):
        assert tok.fewest_tokens(text) <= len(tok.encode(text)), (tok.name, text)


def test_no_bound_is_claimed_where_a_tokenizer_may_drop_text(tmp_path: Path) -> None:
    # A pre-tokenizer that drops whitespace yields no token for a megabyte of spaces:
    # no bound may be claimed for it (nor for a fused unknown token, a Strip).
    base = tokenizers.Tokenizer.from_file(
        str(train_byte_level(tmp_path / "bpe") / "tokenizer.json"))
    base.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                   pre_tokenizers.ByteLevel()])
    (tmp_path / "drops").mkdir()
    base.save(str(tmp_path / "drops" / "tokenizer.json"))
    tok = HFTokenizer(str(tmp_path / "drops"))
    assert tok.encode(" " * 5000) == [] and tok.fewest_tokens(" " * 5000) == 0
