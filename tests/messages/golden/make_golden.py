"""Build the golden vectors: each message, its frames (hex) and its plain meaning.

Run ``python -m tests.messages.golden.make_golden`` to rewrite
``vectors.json`` after a *deliberate* wire change (and say so in
docs/PROTOCOL.md). ``tests/messages/test_golden.py`` checks that the file
still matches what the codec writes, and decodes every vector with the
independent ``msgpack`` package, following docs/PROTOCOL.md alone.

``plain`` is what a client in another language should read out of the
frames: token ids as integer lists, a rid column as a list of strings,
arrays as dtype, shape and values (all exactly representable), every field
by name, defaults filled in.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import torch

from messages import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    ErrorOut,
    Guide,
    KVHandoff,
    Message,
    RpcReqInput,
    RpcReqOutput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    catalogue_types,
    token_ids,
)

PATH = Path(__file__).with_name("vectors.json")
CODEC: Codec[Message] = Codec(Message, types=catalogue_types())


def samples() -> dict[str, Message]:
    """The messages the vectors pin, by name: every type, every array path."""
    return {
        "generate": TokenizedGenerateReqInput(
            rid="g-1", input_ids=token_ids([1, 2, 300, 70000]),
            sampling=SamplingParams(max_new_tokens=8, temperature=0.0, top_k=5,
                                    stop_token_ids=token_ids([2]), seed=7,
                                    ignore_eos=True, presence_penalty=0.5,
                                    frequency_penalty=-0.25, repetition_penalty=1.25,
                                    min_tokens=3, logit_bias={7: 100.0, 300: -5.5},
                                    top_logprobs=2, prompt_logprobs=1),
            stream=True),
        "generate_defaults": TokenizedGenerateReqInput(rid="g-2", input_ids=token_ids([5])),
        "generate_guided": TokenizedGenerateReqInput(
            rid="g-5", input_ids=token_ids([3]),
            sampling=SamplingParams(guide=Guide(kind="choice", spec='["yes","no"]'))),
        "generate_embeds_inline": TokenizedGenerateReqInput(
            rid="g-3", input_ids=token_ids([1, 2]),
            input_embeds=torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.25, -0.125]]),
            dp_rank=1),
        "generate_embeds_out_of_band": TokenizedGenerateReqInput(
            rid="g-4", input_ids=token_ids([9]),
            input_embeds=(torch.arange(2050, dtype=torch.float32) % 64 - 32)
            .to(torch.bfloat16).reshape(2, 1025)),
        "embedding": TokenizedEmbeddingReqInput(rid="e-1", input_ids=token_ids([4, 5, 6])),
        "abort": AbortReq(rid="g-1"),
        "rpc": RpcReqInput(rid="c-1", method="save_checkpoint",
                           parameters={"path": "/tmp/ck", "keep": 3, "fast": True}),
        "rpc_reply": RpcReqOutput(rid="c-1", success=True, message="ok",
                                  result={"bytes": 1024, "path": "/tmp/ck",
                                          "ranks": [0, 1, None]}),
        "batch": BatchTokenIDOut.from_lists(["a", "bb", "ccc"], [[7], [9, 10], []],
                                            [None, "stop", "abort"],
                                            logprobs=[[-0.5], [-1.0, -0.25], []]),
        "batch_rid_with_nul": BatchTokenIDOut.from_lists(["x\x00y", "z"], [[1], [2]],
                                                         [None, "length"]),
        "batch_cached_tokens": BatchTokenIDOut.from_lists(["p", "q"], [[4], [5, 6]],
                                                          [None, "length"],
                                                          cached_tokens=[0, 48]),
        "batch_top_logprobs": BatchTokenIDOut(
            rids=["t"], output_ids=token_ids([4, 5]), output_lens=token_ids([2]),
            finished_reasons=[None], logprobs=np.asarray([-0.5, -1.0], np.float32),
            top_ids=token_ids([4, 9, 5, 4]),
            top_logprobs=np.asarray([-0.5, -1.5, -1.0, -2.0], np.float64)),
        "batch_prompt_logprobs": BatchTokenIDOut(
            rids=["s", "u"], output_ids=token_ids([]), output_lens=token_ids([0, 0]),
            finished_reasons=["length", "length"],
            logprobs=np.asarray([], np.float32), prompt_lens=token_ids([2, 1]),
            prompt_logprobs=np.asarray([-1.5, -0.5, -3.0], np.float64),
            prompt_top_ids=token_ids([8, 9, 7]),
            prompt_top_logprobs=np.asarray([-1.0, -0.5, -0.25], np.float64)),
        "batch_logprobs_out_of_band": BatchTokenIDOut.from_lists(
            ["long"], [list(range(1100))], ["length"],
            logprobs=[[-(i % 8) / 4 for i in range(1100)]]),
        "embedding_out": BatchEmbeddingOut(rids=["e-1", "e-2"],
                                           embeddings=torch.tensor([[1.0, 0.0], [0.0, -1.0]])),
        "error": ErrorOut(rid="g-9", code="overloaded", message="queue full"),
        "handoff": KVHandoff(
            rid="g-1", input_ids=token_ids([1, 2, 300]), output_ids=token_ids([17]), sent=1,
            sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
            kv=(torch.arange(24, dtype=torch.float64) / 8).reshape(2, 2, 1, 3, 2),
            fingerprint="tiny-llama:0123456789abcdef:float64", stream=True),
    }


def _array(value: object) -> dict[str, object]:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        dtype = str(t.dtype).removeprefix("torch.")
        return {"dtype": dtype, "shape": list(t.shape), "values": t.float().reshape(-1).tolist()}
    assert isinstance(value, np.ndarray)
    return {"dtype": value.dtype.name, "shape": list(value.shape),
            "values": value.astype(np.float64).reshape(-1).tolist()}


def plain(msg: msgspec.Struct) -> dict[str, object]:
    """Every field by name, as plain JSON values (the meaning the frames carry)."""
    out: dict[str, object] = {}
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, memoryview):
            out[name] = value.tolist()
        elif isinstance(value, torch.Tensor | np.ndarray):
            out[name] = _array(value)
        elif isinstance(value, msgspec.Struct):
            out[name] = plain(value)
        elif name == "rids" and isinstance(msg, BatchTokenIDOut):
            out[name] = list(value)
        else:
            out[name] = value
    return out


def build() -> list[dict[str, object]]:
    """The vectors, in a stable order, as JSON reads them back (a map's int keys
    become strings)."""
    vectors: list[dict[str, object]] = []
    for name, msg in samples().items():
        frames = CODEC.encode(msg)
        vectors.append({
            "name": name,
            "type": type(msg).__name__,
            "frames": [bytes(memoryview(f).cast("B")).hex() for f in frames],
            "plain": json.loads(json.dumps(plain(msg))),
        })
    return vectors


def main() -> None:
    PATH.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
