"""Golden vectors: the wire pinned in a file, and read back by an independent decoder.

The decoder below uses the ``msgpack`` package and struct/numpy for bytes,
and *nothing* from ``messages`` but the vectors file: it follows
docs/PROTOCOL.md, whose field tables are themselves checked against the
code here. If the codec changes what it writes, ``test_vectors_are_current``
fails: regenerate with ``python -m tests.messages.golden.make_golden`` only
for a deliberate change, and update PROTOCOL.md with it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from tests.messages.golden.make_golden import PATH, build

ROOT = Path(__file__).resolve().parents[2]
VECTORS: list[dict[str, Any]] = json.loads(PATH.read_text())

# -- what PROTOCOL.md says, written down once for the decoder --------------------------
# (type name, field, wire type, default) per item after the tag, from its tables.
NO_DEFAULT = object()
SAMPLING: list[tuple[str, str, object]] = [
    ("max_new_tokens", "int", 16), ("temperature", "float", 1.0), ("top_p", "float", 1.0),
    ("top_k", "int", 0), ("stop_token_ids", "packed_u32", None), ("seed", "int", None),
    ("ignore_eos", "bool", False), ("guide", "Guide", None),
    ("presence_penalty", "float", 0.0), ("frequency_penalty", "float", 0.0),
    ("repetition_penalty", "float", 1.0), ("min_tokens", "int", 0), ("logit_bias", "map", None),
    ("top_logprobs", "int", 0), ("prompt_logprobs", "int", None)]
GUIDE: list[tuple[str, str, object]] = [("kind", "str", NO_DEFAULT), ("spec", "str", "")]
FIELDS: dict[str, list[tuple[str, str, object]]] = {
    "TokenizedGenerateReqInput": [
        ("rid", "str", NO_DEFAULT), ("input_ids", "packed_u32", NO_DEFAULT),
        ("sampling", "SamplingParams", []), ("stream", "bool", False),
        ("return_logprob", "bool", False), ("input_embeds", "tensor", None),
        ("dp_rank", "int", None), ("prefill_only", "bool", False)],
    "TokenizedEmbeddingReqInput": [
        ("rid", "str", NO_DEFAULT), ("input_ids", "packed_u32", NO_DEFAULT),
        ("dp_rank", "int", None)],
    "AbortReq": [("rid", "str", NO_DEFAULT)],
    "RpcReqInput": [("rid", "str", NO_DEFAULT), ("method", "str", NO_DEFAULT),
                    ("parameters", "map", {})],
    "RpcReqOutput": [("rid", "str", NO_DEFAULT), ("success", "bool", NO_DEFAULT),
                     ("message", "str", ""), ("result", "map", None)],
    "BatchTokenIDOut": [
        ("rids", "rid_column", NO_DEFAULT), ("output_ids", "packed_u32", NO_DEFAULT),
        ("output_lens", "packed_u32", NO_DEFAULT), ("finished_reasons", "list", NO_DEFAULT),
        ("logprobs", "ndarray", None), ("hidden_states", "tensor", None),
        ("cached_tokens", "packed_u32", None), ("top_ids", "packed_u32", None),
        ("top_logprobs", "ndarray", None), ("prompt_lens", "packed_u32", None),
        ("prompt_logprobs", "ndarray", None), ("prompt_top_ids", "packed_u32", None),
        ("prompt_top_logprobs", "ndarray", None)],
    "BatchEmbeddingOut": [("rids", "list", NO_DEFAULT), ("embeddings", "tensor", NO_DEFAULT)],
    "ErrorOut": [("rid", "str", NO_DEFAULT), ("code", "str", NO_DEFAULT),
                 ("message", "str", "")],
    "KVHandoff": [
        ("rid", "str", NO_DEFAULT), ("input_ids", "packed_u32", NO_DEFAULT),
        ("output_ids", "packed_u32", NO_DEFAULT), ("sent", "int", NO_DEFAULT),
        ("sampling", "SamplingParams", NO_DEFAULT), ("kv", "tensor", NO_DEFAULT),
        ("fingerprint", "str", NO_DEFAULT), ("stream", "bool", False),
        ("return_logprob", "bool", False), ("logprobs", "ndarray", None),
        ("rng_state", "tensor", None), ("cached_tokens", "int", 0)],
}
DTYPES = {1: "bool", 2: "uint8", 3: "int8", 4: "int16", 5: "int32", 6: "int64",
          7: "uint16", 8: "uint32", 9: "uint64", 10: "float16", 11: "bfloat16",
          12: "float32", 13: "float64", 15: "complex64", 16: "complex128"}


class _Ext:
    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


def _u32s(data: bytes) -> list[int]:
    assert len(data) % 4 == 0
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def _elements(dtype: str, raw: bytes) -> list[float]:
    if dtype == "bfloat16":  # the upper half of a float32
        halves = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return [float(v) for v in halves.view(np.float32)]
    return [float(v) for v in np.frombuffer(raw, np.dtype(dtype).newbyteorder("<"))]


def _array(value: object, frames: list[bytes], used: list[int]) -> dict[str, object]:
    if isinstance(value, bytes):  # compact 1-D numpy: elements, then one dtype byte
        dtype = DTYPES[value[-1]]
        return {"dtype": dtype, "shape": [(len(value) - 1) // np.dtype(dtype).itemsize],
                "values": _elements(dtype, value[:-1])}
    assert isinstance(value, _Ext) and value.code in (1, 2, 3, 4)
    data = value.data
    code, ndim = data[0], data[1]
    shape = list(struct.unpack_from(f"<{ndim}q", data, 2))
    rest = data[2 + 8 * ndim:]
    dtype = DTYPES[code]
    if value.code in (2, 4):  # out of band: a u32 frame index, in order
        (index,) = struct.unpack("<I", rest)
        assert index == len(used) + 1, "frames are referenced in order"
        used.append(index)
        rest = frames[index]
    size = int(np.prod(shape)) * np.dtype(dtype if dtype != "bfloat16" else "u2").itemsize
    assert len(rest) == size
    return {"dtype": dtype, "shape": shape, "values": _elements(dtype, rest)}


def _field(kind: str, value: object, frames: list[bytes], used: list[int]) -> object:
    if value is None:
        return None
    if kind == "packed_u32":
        assert isinstance(value, bytes)
        return _u32s(value)
    if kind == "rid_column":
        assert isinstance(value, str)
        return value[1:].split(value[0]) if value else []
    if kind in ("tensor", "ndarray"):
        return _array(value, frames, used)
    if kind == "SamplingParams":
        assert isinstance(value, list)
        return _struct(SAMPLING, value, frames, used)
    if kind == "Guide":
        assert isinstance(value, list)
        return _struct(GUIDE, value, frames, used)
    return value


def _struct(table: list[tuple[str, str, object]], items: list[object],
            frames: list[bytes], used: list[int]) -> dict[str, object]:
    out: dict[str, object] = {}
    for i, (name, kind, default) in enumerate(table):
        if i < len(items):
            out[name] = _field(kind, items[i], frames, used)
        else:  # trailing defaults may be left out
            assert default is not NO_DEFAULT, f"{name} is required"
            out[name] = _field(kind, default, frames, used)
    return out  # items past the table: ignored


def independent_decode(frames: list[bytes]) -> tuple[str, dict[str, object]]:
    """Decode a message with msgpack alone, as docs/PROTOCOL.md describes."""
    items = msgpack.unpackb(frames[0], raw=False, ext_hook=_Ext, strict_map_key=False)
    assert isinstance(items, list) and isinstance(items[0], str)
    used: list[int] = []
    plain = _struct(FIELDS[items[0]], items[1:], frames, used)
    assert len(used) == len(frames) - 1, "every out-of-band frame is referenced"
    return items[0], plain


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_independent_msgpack_decodes_every_vector(vector: dict[str, Any]) -> None:
    frames = [bytes.fromhex(f) for f in vector["frames"]]
    tag, plain = independent_decode(frames)
    assert tag == vector["type"]
    assert json.loads(json.dumps(plain)) == vector["plain"]


def test_vectors_are_current() -> None:
    """What the codec writes today is what the file pins (a wire change is deliberate)."""
    assert build() == json.loads(PATH.read_text()), (
        "the wire changed: if deliberate, run `python -m tests.messages.golden.make_golden` "
        "and update docs/PROTOCOL.md")


def test_vectors_cover_every_type_and_array_path() -> None:
    assert {v["type"] for v in VECTORS} == set(FIELDS)
    heads = "".join(v["frames"][0] for v in VECTORS)
    for ext in ("c7", "c8"):  # ext 8 / ext 16 forms appear
        assert ext in heads
    assert any(len(v["frames"]) > 1 for v in VECTORS if v["type"] == "BatchTokenIDOut")
    assert any(len(v["frames"]) > 1 for v in VECTORS
               if v["type"] == "TokenizedGenerateReqInput")


def test_protocol_md_tables_match_the_layout() -> None:
    """PROTOCOL.md's field tables are the code's: name and type, item by item."""
    from messages import wire_layout

    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    layout = wire_layout()
    for name, t in layout.items():
        section = text.split(f"\n### {name}\n", 1)[1].split("\n### ", 1)[0]
        rows = re.findall(r"^\| (\d+) \| `(\w+)` \| `(.+?)` \|", section, re.M)
        got = [(f, ty.replace("\\|", "|")) for _, f, ty in rows]
        assert got == [(f.name, f.type) for f in t.fields], name
        if t.tag:
            assert f"Tag: `{t.tag}`" in section
    for name, table in FIELDS.items():  # and the decoder above reads them in that order
        assert [f for f, _, _ in table] == [f.name for f in layout[name].fields], name
