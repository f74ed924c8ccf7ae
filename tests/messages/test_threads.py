"""A codec shared by threads keeps every message's tensor frames its own."""

from __future__ import annotations

import threading

import torch

from messages import BatchEmbeddingOut, Codec, Message


def test_shared_codec_across_threads() -> None:
    codec: Codec[Message] = Codec(Message)
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(200):
            t = torch.full((2, 2048), float(k * 1000 + i))
            frames = codec.encode(BatchEmbeddingOut(rids=["a", "b"], embeddings=t))
            back = codec.decode([bytes(memoryview(f)) for f in frames])
            assert isinstance(back, BatchEmbeddingOut)
            if not torch.equal(back.embeddings, t):
                errors.append(f"thread {k} message {i} got someone else's tensor")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
