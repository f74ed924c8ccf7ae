"""Fuzz ``Codec(Request).decode``: only ``DecodeError`` may come out, and rejecting is cheap.

Run: ``python -m benchmarks._fuzz [n]``. The last line is one JSON object:

* ``fuzz_frames``: cases fed to ``decode`` (mutated valid messages, plus
  some purely random frames and frame lists);
* ``fuzz_non_decode_errors``: cases that raised anything but
  :class:`~messages.errors.DecodeError` (must be 0);
* ``fuzz_s``: seconds the whole run took;
* ``reject_us_p50``: median microseconds to reject a well-formed msgpack
  frame that breaks a type constraint (``top_p=2.0``, ...): the cost an
  attacker can impose per frame, field naming included;
* ``reject_random_us_p50``: the same for random bytes.

Seeded, so a run is reproducible: a failing case can be replayed from the
seed and the case number printed on stderr.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from messages import (
    AbortReq,
    Codec,
    DecodeError,
    Request,
    RpcReqInput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    concrete_types,
    token_ids,
)

Frames = list[bytes]

#: Bytes that mean something to a msgpack parser: the never-used 0xc1, the
#: 16/32-bit array and map headers, fixarrays, fixstrs, and the fixed-width
#: integer markers (whose length then reads the following bytes).
INTERESTING: bytes = bytes(
    [0xC1, 0xDC, 0xDD, 0xDE, 0xDF, *range(0x90, 0xA0), *range(0xA0, 0xC0),
     *range(0xCC, 0xD4), 0x00, 0x7F, 0x80, 0xFF, 0xC0, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6,
     0xC7, 0xC8, 0xC9, 0xCA, 0xCB, *range(0xD4, 0xD9), 0xD9, 0xDA, 0xDB]
)
#: Little-endian integers at the edges of their widths, written over a field.
EDGE_INTS: tuple[bytes, ...] = tuple(
    v.to_bytes(w, "little", signed=False)
    for w in (1, 2, 4, 8)
    for v in (0, 1, (1 << (8 * w - 1)) - 1, 1 << (8 * w - 1), (1 << (8 * w)) - 1)
)
#: Above ``inline_threshold``: this tensor travels as an out-of-band frame.
BIG_EMBEDS = torch.arange(16 * 128, dtype=torch.float32).reshape(16, 128)  # 8 KiB


def valid_messages() -> list[Request]:
    """A few valid messages of every concrete request type, big tensors included.

    Raises:
        RuntimeError: a concrete request type has no sample here (the
            catalogue grew; add one, or the fuzzer silently skips it).
    """
    msgs: list[Request] = [
        TokenizedGenerateReqInput(rid="gen-1", input_ids=token_ids([1, 2, 3])),
        TokenizedGenerateReqInput(
            rid="gen-2", input_ids=token_ids(range(40)), stream=True, return_logprob=True,
            sampling=SamplingParams(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=50,
                                    stop_token_ids=token_ids([2, 7]), seed=1234)),
        TokenizedGenerateReqInput(rid="gen-small-embeds", input_ids=token_ids([5]),
                                  input_embeds=torch.ones(2, 4)),
        TokenizedGenerateReqInput(rid="gen-big-embeds", input_ids=token_ids([5, 6]),
                                  input_embeds=BIG_EMBEDS),
        TokenizedGenerateReqInput(rid="gen-bf16", input_ids=token_ids([9]),
                                  input_embeds=torch.zeros(8, 512, dtype=torch.bfloat16)),
        TokenizedEmbeddingReqInput(rid="emb-1", input_ids=token_ids([4, 5, 6, 7])),
        TokenizedEmbeddingReqInput(rid="e", input_ids=token_ids([])),
        AbortReq(rid="gen-1"),
        RpcReqInput(rid="rpc-1", method="get_load"),
        RpcReqInput(rid="rpc-2", method="save_checkpoint",
                    parameters={"path": "/tmp/ck", "n": 3, "f": 0.5, "b": True, "z": None}),
    ]
    missing = set(concrete_types(Request)) - {type(m) for m in msgs}
    if missing:
        raise RuntimeError(f"no fuzz sample for {sorted(t.__name__ for t in missing)}")
    return msgs


def valid_frames(codec: Codec[Request]) -> list[Frames]:
    """The frames of :func:`valid_messages`, as bytes (a receive buffer's shape)."""
    return [[bytes(memoryview(f)) for f in codec.encode(m)] for m in valid_messages()]


def _mutate_frame(rng: random.Random, frame: bytes, other: bytes) -> bytes:
    """One byte-level mutation of ``frame``; ``other`` is a frame to splice with."""
    b = bytearray(frame)
    n = len(b)
    op = rng.randrange(9)
    i = rng.randrange(n) if n else 0
    if op == 0 and n:  # bit flip
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and n:  # a byte the parser reads as structure
        b[i] = rng.choice(INTERESTING)
    elif op == 2 and n:
        b[i] = rng.randrange(256)
    elif op == 3:  # truncation
        del b[i:]
    elif op == 4:  # insertion
        k = rng.randrange(1, 9)
        b[i:i] = bytes(rng.choice(INTERESTING) if rng.random() < 0.5 else rng.randrange(256)
                       for _ in range(k))
    elif op == 5 and n:  # deletion of a short run
        del b[i:i + rng.randrange(1, 9)]
    elif op == 6:  # splice: the head of this frame, the tail of another
        j = rng.randrange(len(other) + 1)
        return bytes(b[:i]) + other[j:]
    elif op == 7 and n:  # an integer at the edge of its width
        v = rng.choice(EDGE_INTS)
        b[i:i + len(v)] = v
    elif n:  # a length or count one off
        b[i] = (b[i] + rng.choice((-1, 1))) & 0xFF
    return bytes(b)


def mutate(rng: random.Random, pool: list[Frames]) -> Frames:
    """A mutation of a random valid message: 1 to 3 byte- or frame-level edits."""
    frames = list(rng.choice(pool))
    for _ in range(rng.randrange(1, 4)):
        op = rng.random()
        if not frames or 0.90 <= op < 0.95:
            frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randrange(64)))
        elif op < 0.80:
            # Mostly the header: that is where the parser and the naming run.
            k = 0 if rng.random() < 0.8 else rng.randrange(len(frames))
            frames[k] = _mutate_frame(rng, frames[k], rng.choice(rng.choice(pool)))
        elif op < 0.85:
            del frames[rng.randrange(len(frames))]
        elif op < 0.90:
            k = rng.randrange(len(frames))
            frames.insert(k, frames[k])
        else:  # the tensor frames of another message
            frames = frames[:1] + rng.choice(pool)[1:]
    return frames


def random_frames(rng: random.Random) -> Frames:
    """Random bytes: one frame, or (sometimes) a short list of them."""
    count = 1 if rng.random() < 0.7 else rng.randrange(0, 5)
    return [rng.randbytes(rng.randrange(0, 300)) for _ in range(count)]


def constraint_frames(count: int, rng: random.Random) -> list[tuple[Frames, str]]:
    """Well-formed msgpack that breaks a type constraint, with the field it must name."""
    ids = np.arange(8, dtype=np.uint32).tobytes()
    breaks: list[tuple[Callable[[str], list[object]], str]] = [
        (lambda rid: ["TokenizedGenerateReqInput", rid, ids, [5, 1.0, 2.0]], "sampling.top_p"),
        (lambda rid: ["TokenizedGenerateReqInput", rid, ids, [5, -1.0]], "sampling.temperature"),
        (lambda rid: ["TokenizedGenerateReqInput", rid, ids, [-5]], "sampling.max_new_tokens"),
        (lambda rid: ["RpcReqInput", rid, "1bad", {}], "method"),
        (lambda rid: ["TokenizedEmbeddingReqInput", rid, 7], "input_ids"),
        (lambda rid: ["AbortReq", "x" * 300], "rid"),
    ]
    out: list[tuple[Frames, str]] = []
    for i in range(count):
        build, field = breaks[i % len(breaks)]
        out.append(([msgspec.msgpack.encode(build(f"req-{rng.randrange(1 << 30)}"))], field))
    return out


def _reject_us(codec: Codec[Request], cases: list[Frames]) -> float:
    """Median microseconds for ``decode`` to reject each case (all must be rejected)."""
    samples: list[float] = []
    clock = time.perf_counter_ns
    for frames in cases:
        t0 = clock()
        try:
            codec.decode(frames)
        except DecodeError:
            samples.append((clock() - t0) / 1e3)
    return statistics.median(samples) if samples else float("nan")


def fuzz_codec(n: int = 200_000, seed: int = 0) -> dict[str, float]:
    """Feed ``Codec(Request).decode`` ``n`` malformed cases; time rejections.

    Raises:
        RuntimeError: a constraint-breaking frame decoded, or was rejected
            without naming its field (the timing would measure the wrong path).
    """
    rng = random.Random(seed)
    codec: Codec[Request] = Codec(Request)
    pool = valid_frames(codec)
    bad = 0
    t0 = time.perf_counter()
    for case in range(n):
        r = rng.random()
        frames = random_frames(rng) if r < 0.05 else mutate(rng, pool)
        try:
            codec.decode(frames)
        except DecodeError:
            pass
        except Exception as exc:  # the bug this fuzzer hunts: anything else escaping
            bad += 1
            if bad <= 5:
                print(f"case {case} (seed {seed}): {type(exc).__name__}: {exc}; "
                      f"frames[:1]={frames[:1]!r}", file=sys.stderr)
    fuzz_s = time.perf_counter() - t0

    named = constraint_frames(3000, rng)
    for frames, field in named[:12]:  # one of each kind, checked before timing
        try:
            codec.decode(frames)
        except DecodeError as exc:
            if not exc.reason.startswith(field):
                raise RuntimeError(
                    f"expected a reason naming {field}, got {exc.reason!r}") from exc
        else:
            raise RuntimeError(f"{frames!r} decoded; it breaks {field}")
    rand = [[rng.randbytes(rng.randrange(1, 200))] for _ in range(3000)]
    return {
        "fuzz_frames": n,
        "fuzz_non_decode_errors": bad,
        "fuzz_s": round(fuzz_s, 2),
        "reject_us_p50": round(_reject_us(codec, [f for f, _ in named]), 2),
        "reject_random_us_p50": round(_reject_us(codec, rand), 2),
    }


if __name__ == "__main__":
    print(json.dumps(fuzz_codec(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000)))
