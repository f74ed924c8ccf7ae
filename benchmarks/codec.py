"""Codec: ours vs pickle vs the copy-into-extension codec vs raw bytes, side by side.

Run: ``python -m benchmarks.codec``. The last line is one JSON object.
Every figure is encode+decode time per message (median of repeated runs);
ratios are speeds (> 1: ours is faster). For tensors, "raw" is the bytes
alone (out as bytes and back into a tensor, one copy each way) and "wrap"
the zero-copy floor (a view of the same memory, no message at all).
"""

from __future__ import annotations

import dataclasses
import json
import pickle  # the contestant we compare against, never in the packages
import sys

import msgspec
import numpy as np
import torch

from benchmarks._timing import per_call_us
from messages import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    Message,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)

CODEC = Codec(Message)


# -- the SGLang-style contestants ---------------------------------------------

class ListSampling(msgspec.Struct, array_like=True, omit_defaults=True):
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    seed: int | None = None


class ListGenerate(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    """Our request with ids as list[int]: the tagged-struct style SGLang uses."""

    rid: str
    input_ids: list[int]
    sampling: ListSampling
    stream: bool = False
    return_logprob: bool = False


@dataclasses.dataclass
class PickledSampling:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: np.ndarray | None = None  # type: ignore[type-arg]
    seed: int | None = None


@dataclasses.dataclass
class PickledGenerate:
    """The same request as pickle would carry it (ids as a uint32 array).

    Our messages refuse pickle (a memoryview cannot be pickled), so the
    pickle contestant carries the same fields in a plain dataclass.
    """

    rid: str
    input_ids: np.ndarray  # type: ignore[type-arg]
    sampling: PickledSampling
    stream: bool = False
    return_logprob: bool = False
    input_embeds: torch.Tensor | None = None


def pickled_twin(req: TokenizedGenerateReqInput) -> PickledGenerate:
    s = req.sampling
    return PickledGenerate(req.rid, np.frombuffer(req.input_ids, np.uint32).copy(),
                           PickledSampling(s.max_new_tokens, s.temperature, s.top_p, s.top_k,
                                           None, s.seed))


@dataclasses.dataclass
class PickledColumns:
    """Our batch's columns, as pickle would carry them."""

    rids: list[str]
    output_ids: np.ndarray  # type: ignore[type-arg]
    output_lens: np.ndarray  # type: ignore[type-arg]
    finished_reasons: list[str | None]


@dataclasses.dataclass
class PickledBatch:
    """A batch output as an engine without a columnar codec keeps it."""

    rids: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[str | None]


def _copy_ext_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder[object]]:
    """Tensor bytes copied into a msgpack extension (the SGLang 0.5 approach)."""

    def enc(obj: object) -> object:
        assert isinstance(obj, torch.Tensor)
        t = obj.contiguous()
        return msgspec.msgpack.Ext(
            1, msgspec.msgpack.encode([str(t.dtype)[6:], list(t.shape),
                                       t.view(torch.uint8).numpy().tobytes()]))

    def ext(code: int, data: memoryview) -> object:
        dtype, shape, raw = msgspec.msgpack.decode(data)
        return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)

    return msgspec.msgpack.Encoder(enc_hook=enc), msgspec.msgpack.Decoder(ext_hook=ext)


def bench_small() -> dict[str, float]:
    ids = list(range(256))
    ours = TokenizedGenerateReqInput(rid="req-0001", input_ids=token_ids(ids),
                                     sampling=SamplingParams(max_new_tokens=64))
    listy = ListGenerate(rid="req-0001", input_ids=ids, sampling=ListSampling(max_new_tokens=64))
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ListGenerate)
    raw = np.asarray(ids, np.uint32)
    twin = pickled_twin(ours)
    return {
        "ours": per_call_us(lambda: CODEC.decode(CODEC.encode(ours))),
        "pickle": per_call_us(lambda: pickle.loads(pickle.dumps(twin, protocol=5))),
        "listint": per_call_us(lambda: dec.decode(enc.encode(listy))),
        "raw": per_call_us(lambda: np.frombuffer(raw.tobytes(), np.uint32)),
    }


def bench_batch64() -> dict[str, float]:
    rids = [f"req-{i:04d}" for i in range(64)]
    new = [[1000 + i] for i in range(64)]
    fin: list[str | None] = [None] * 64
    ours = BatchTokenIDOut.from_lists(rids, new, [None] * 64)
    columns = PickledColumns(rids, np.frombuffer(ours.output_ids, np.uint32).copy(),
                             np.frombuffer(ours.output_lens, np.uint32).copy(), fin)
    plain = PickledBatch(rids, new, fin)
    def ours_read_rids() -> object:  # the rids are a column: str objects made on first read
        return list(CODEC.decode(CODEC.encode(ours)).rids)  # type: ignore[attr-defined]

    return {
        "ours": per_call_us(lambda: CODEC.decode(CODEC.encode(ours))),
        "ours_read_rids": per_call_us(ours_read_rids),
        "pickle": per_call_us(lambda: pickle.loads(pickle.dumps(columns, protocol=5))),
        "pickle_lists": per_call_us(lambda: pickle.loads(pickle.dumps(plain, protocol=5))),
    }


def bench_tensor(t: torch.Tensor) -> dict[str, float]:
    msg = BatchEmbeddingOut(rids=["r"], embeddings=t.reshape(1, -1))
    enc, dec = _copy_ext_codec()

    def ours() -> object:
        frames = CODEC.encode(msg)
        return CODEC.decode(frames)

    def wrap() -> object:  # the zero-copy floor: wrap the same memory, no header, no checks
        view = t.view(torch.uint8).numpy().data
        return torch.frombuffer(view, dtype=torch.uint8).view(t.dtype)

    def raw() -> object:  # the bytes alone: out as bytes, back into a tensor
        data = t.view(torch.uint8).numpy().tobytes()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype)

    return {
        "ours": per_call_us(ours),
        "wrap": per_call_us(wrap),
        "raw": per_call_us(raw, repeats=5),
        "copy_ext": per_call_us(lambda: dec.decode(enc.encode(t)), repeats=5),
        "pickle": per_call_us(lambda: pickle.loads(pickle.dumps(t, protocol=5)), repeats=5),
    }


def main() -> None:
    results: dict[str, object] = {}
    small = bench_small()
    batch = bench_batch64()
    tensors = {
        "64k": bench_tensor(torch.randn(16 * 1024)),
        "4m": bench_tensor(torch.randn(1024 * 1024)),
        "64m": bench_tensor(torch.randn(16 * 1024 * 1024)),
        "4m_bf16": bench_tensor(torch.randn(2 * 1024 * 1024).to(torch.bfloat16)),
    }
    print("small generate request (256 ids), encode+decode us:", file=sys.stderr)
    for k, v in small.items():
        print(f"  {k:14s} {v:9.2f}", file=sys.stderr)
    print("BatchTokenIDOut, 64 requests x 1 token, encode+decode us:", file=sys.stderr)
    for k, v in batch.items():
        print(f"  {k:14s} {v:9.2f}", file=sys.stderr)
    sizes = {"64k": 1 << 16, "4m": 1 << 22, "64m": 1 << 26, "4m_bf16": 1 << 22}
    for name, row in tensors.items():
        print(f"tensor {name}: encode+decode us (MB/s)", file=sys.stderr)
        for k, v in row.items():
            print(f"  {k:14s} {v:11.2f} ({sizes[name] / v:,.0f} MB/s)", file=sys.stderr)
        for k, v in row.items():
            results[f"tensor{name}_{k}_us"] = round(v, 2)
    results.update({
        "small_ours_us": round(small["ours"], 2),
        "small_pickle_us": round(small["pickle"], 2),
        "small_listint_us": round(small["listint"], 2),
        "ratio_small_ours_vs_pickle": round(small["pickle"] / small["ours"], 2),
        "ratio_small_ours_vs_listint": round(small["listint"] / small["ours"], 2),
        "batch64_encdec_us": round(batch["ours"], 2),
        "ratio_batch64_ours_vs_pickle": round(batch["pickle"] / batch["ours"], 2),
        # The same, reading every rid after decoding (pickle built them all already).
        "batch64_encdec_read_rids_us": round(batch["ours_read_rids"], 2),
        "ratio_batch64_read_rids_ours_vs_pickle": round(
            batch["pickle"] / batch["ours_read_rids"], 2),
        "ratio_batch64_ours_vs_pickle_lists": round(batch["pickle_lists"] / batch["ours"], 2),
        "ratio_tensor4m_ours_vs_raw": round(tensors["4m"]["raw"] / tensors["4m"]["ours"], 2),
        "ratio_tensor4m_ours_vs_wrap": round(tensors["4m"]["wrap"] / tensors["4m"]["ours"], 2),
        "ratio_tensor64m_ours_vs_copy_ext": round(
            tensors["64m"]["copy_ext"] / tensors["64m"]["ours"], 2),
        "ratio_tensor64m_ours_vs_pickle": round(
            tensors["64m"]["pickle"] / tensors["64m"]["ours"], 2),
        "inline_threshold": CODEC.inline_threshold,
    })
    print(json.dumps(results))


if __name__ == "__main__":
    main()
