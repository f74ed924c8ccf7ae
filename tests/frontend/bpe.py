"""Small tokenizers the tests train themselves with ``tokenizers`` (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

#: A few KB of mixed text: ASCII, accents, CJK, emoji.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Voilà, déjà vu: naïve café crème brûlée. ",
    "世界你好，今天天气很好。我们一起去公园散步吧。机器学习与自然语言处理。",  # noqa: RUF001
    "こんにちは世界、日本語のテキストです。カタカナとひらがな。",
    "안녕하세요 세계, 한국어 문장입니다.",
    "Emoji time 🎉🚀🔥 party 🎉 rocket 🚀 fire 🔥 family 👨‍👩‍👧 flag 🇫🇷",
    "STOP words and stopping: the model stops at the stop string. " * 2,
] * 20
#: A text to stream: every kind of character above.
TEXT = "Hello 世界! naïve café 🎉🚀 こんにちは 안녕 👨‍👩‍👧 end."


def train_byte_level(directory: Path, vocab_size: int = 600,
                     chat_template: str | None = None) -> Path:
    """A byte-level BPE (GPT-2 style) in ``directory``; returns the directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>",
                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"eos_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def train_metaspace(directory: Path) -> Path:
    """A character BPE with Metaspace (sentencepiece style): decoded by windows."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory
