"""Build a tiny random Hugging Face causal LM, with its tokenizer, in a local directory.

For tests, benchmarks and trying ``--model DIR`` without downloading anything:
a byte-level BPE trained with ``tokenizers`` on a few KB of generated text, a
:class:`transformers.LlamaConfig` whose vocabulary matches it, random weights
(seeded), all written with ``save_pretrained``. Needs the ``[hf]`` extra.

Build in float64 when answers are compared token for token: a random model's
logits are near ties, and float32 rounding between a batched and a single
matmul would flip some.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Literal

import torch

__all__ = ["build_tiny_hf", "corpus"]

_WORDS = ("the scheduler reads a prompt and writes tokens while another request waits "
          "in the queue so every batch step decodes one token for each running stream "
          "a model loads its weights from a local directory never from the network "
          "chunks of a long prompt interleave with short ones and the cache of keys and "
          "values lives with the adapter until the request ends or is aborted").split()


def corpus(n_bytes: int = 8192, seed: int = 0) -> list[str]:
    """A few KB of sentences drawn (seeded) from a small vocabulary."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < n_bytes:
        line = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."
        lines.append(line)
        size += len(line) + 1
    return lines


def build_tiny_hf(directory: str | os.PathLike[str], *, vocab_size: int = 384,
                  hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                  max_positions: int = 4096, seed: int = 0,
                  dtype: torch.dtype = torch.float64,
                  arch: Literal["llama", "gpt2"] = "llama") -> Path:
    """Write a tokenizer and a random Llama model into ``directory``; returns it.

    ``arch="gpt2"`` writes a GPT-2 instead (``kv_heads`` unused): its positions
    are a learned table of ``max_positions`` rows, so reading past its context
    fails where a Llama's rotary positions would go on.

    ``<pad>``, ``<s>`` and ``</s>`` are ids 0, 1 and 2; ``</s>`` is the
    end-of-sequence id in ``config.json`` and ``generation_config.json``.

    Raises:
        ImportError: ``transformers`` or ``tokenizers`` is not installed
            (``pip install -e '.[hf]'``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerFast,
    )

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed=seed), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    model: PreTrainedModel
    if arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=tok.get_vocab_size(), n_embd=hidden, n_layer=layers, n_head=heads,
            n_positions=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False))
    torch.nn.Module.to(model, dtype)  # in place
    with torch.no_grad():  # wider than the default init, so greedy does not just repeat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    return out
