"""What a ``tokenizer.json`` may hold besides its vocabulary, against the prompt's ids."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from frontend import HFTokenizer
from tests.frontend.bpe import train_byte_level

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
