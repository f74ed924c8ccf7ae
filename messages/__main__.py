"""``python -m messages demo``: encode and decode a few messages, showing frames and timings."""

from __future__ import annotations

import sys
import time

import torch

from messages import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    DecodeError,
    Message,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)


def demo() -> None:
    codec = Codec(Message)
    samples: list[Message] = [
        TokenizedGenerateReqInput(rid="req-1", input_ids=token_ids(range(256)),
                                  sampling=SamplingParams(max_new_tokens=32)),
        BatchTokenIDOut.from_lists([f"req-{i}" for i in range(64)], [[i] for i in range(64)],
                                   [None] * 64),
        BatchEmbeddingOut(rids=["emb-1"], embeddings=torch.randn(1, 1 << 20)),
    ]
    for msg in samples:
        frames = codec.encode(msg)
        t0 = time.perf_counter()
        for _ in range(1000):
            codec.decode(codec.encode(msg))
        us = (time.perf_counter() - t0) * 1000
        sizes = ", ".join(f"{memoryview(f).nbytes} B" for f in frames)
        print(f"{type(msg).__name__:28s} frames: [{sizes}]  encode+decode {us:.1f} us")
    try:
        codec.decode([b"\x93\xb9TokenizedGenerateReqInput\xa5req-9\xc0"])
    except DecodeError as exc:
        print(f"malformed frame -> {exc}")


if __name__ == "__main__":
    if sys.argv[1:] != ["demo"]:
        sys.exit("usage: python -m messages demo")
    demo()
