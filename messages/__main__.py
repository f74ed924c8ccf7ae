"""``python -m messages``: ``demo``, ``schema`` and ``check OLD.json``.

* ``demo``: encode and decode a few messages, showing frames and timings;
* ``schema``: print the catalogue as JSON Schema (stdout), with its wire
  layout and fingerprint, the types each channel carries (``x-channels``) and
  every rpc method's parameters and result (``x-rpc``); the fingerprint goes
  to stderr too;
* ``check OLD.json``: compare a saved schema with the current catalogue, one
  line per difference; exit status 1 if any is breaking (2: OLD.json
  unreadable).
"""

from __future__ import annotations

import json
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
from messages.schema import (
    PROTOCOL_VERSION,
    catalogue_schema,
    compare_layouts,
    layout_from_schema,
    wire_layout,
)

USAGE = "usage: python -m messages demo | schema | check OLD.json"


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


def schema() -> int:
    """Print the catalogue's JSON Schema on stdout and its fingerprint on stderr."""
    doc = catalogue_schema()
    print(json.dumps(doc, indent=2))
    print(f"fingerprint: {doc['x-fingerprint']}", file=sys.stderr)
    return 0


def check(path: str) -> int:
    """Compare the schema saved at ``path`` with the current catalogue; 1 if breaking."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        old = layout_from_schema(doc)
    except (OSError, ValueError, RecursionError) as exc:  # a nest too deep to parse
        print(f"cannot read {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    lines = [(str(d), d.breaking) for d in compare_layouts(old, wire_layout())]
    version = doc.get("x-protocol-version")
    if version != PROTOCOL_VERSION:  # the framing itself changed: hello refuses it
        lines.insert(0, (f"breaking: protocol version {version!r} (saved) vs "
                         f"{PROTOCOL_VERSION} (now): the framing differs (docs/PROTOCOL.md)",
                         True))
    for line, _ in lines:
        print(line)
    breaking = sum(b for _, b in lines)
    if not lines:
        print("no difference: the wire layout is the same")
    else:
        print(f"{len(lines)} difference(s), {breaking} breaking")
    return 1 if breaking else 0


def main(argv: list[str]) -> int:
    """Run the subcommand in ``argv``; return the exit status."""
    if argv == ["demo"]:
        demo()
        return 0
    if argv == ["schema"]:
        return schema()
    if len(argv) == 2 and argv[0] == "check":
        return check(argv[1])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
