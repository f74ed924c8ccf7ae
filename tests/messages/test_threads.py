"""A codec shared by threads keeps every message's tensor frames its own."""

from __future__ import annotations

import threading

import torch

from messages import BatchEmbeddingOut, Codec, Message


def test_shared_codec_across_threads() -> None:
    codec: Codec[Message] = Codec(Message)
    errors: list[str] = []

    def work(k: int) -> None:
        # An exception in a thread is only a warning to pytest: record it, so a
        # crashing encode or decode fails the test like a wrong tensor does.
        try:
            for i in range(200):
                t = torch.full((2, 2048), float(k * 1000 + i))
                frames = codec.encode(BatchEmbeddingOut(rids=["a", "b"], embeddings=t))
                back = codec.decode([bytes(memoryview(f)) for f in frames])
                assert isinstance(back, BatchEmbeddingOut)
                if not torch.equal(back.embeddings, t):
                    errors.append(f"thread {k} message {i} got someone else's tensor")
        except BaseException as exc:  # every failure is the test's
            errors.append(f"thread {k} crashed: {exc!r}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
