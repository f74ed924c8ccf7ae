"""Every rpc method a scheduler serves: its parameters and its result, as structs.

``RpcReqInput.parameters`` and ``RpcReqOutput.result`` travel as flat maps
(``docs/PROTOCOL.md``, section 4); these structs say which keys each method
takes and returns, so the published schema (``python -m messages schema``,
key ``x-rpc``) can tell a client in another language what to send and what
it gets. A test calls every method a scheduler registers and checks its
result against these (unknown keys refused), and its signature against the
parameters, so the declarations cannot drift from the code.

Rules every method keeps: a parameter the method does not take, or a
required one missing, fails the call (``success=false``, the message naming
it); nothing is ignored. A method that raises answers ``success=false``
with the error. A scheduler behind a data-parallel dispatcher answers with
the dispatcher's merge (per replica), not these shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

__all__ = [
    "RPC_METHODS",
    "CheckpointParams",
    "FlushCacheResult",
    "GetLoadResult",
    "HelloParams",
    "HelloResult",
    "LoadCheckpointResult",
    "MetricsResult",
    "ModelInfoResult",
    "NoParams",
    "RpcMethodSpec",
    "SaveCheckpointResult",
    "ShutdownResult",
    "TokenDigestResult",
]



class NoParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The method takes no parameter: send an empty map."""


class HelloParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``hello``: the client's side of the handshake.

    ``protocol_version`` and ``fingerprint`` are required; ``layout`` (the
    JSON of the client's ``x-layout``) is needed only when the fingerprints
    differ, and a call without it then fails. A client that cannot compute a
    fingerprint sends the ``x-fingerprint`` and ``x-layout`` of the schema it
    was written against.
    """

    protocol_version: int
    fingerprint: str
    layout: str = ""


class CheckpointParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``save_checkpoint`` / ``load_checkpoint``: a file path on the scheduler's host."""

    path: str


class HelloResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True,
                  omit_defaults=True):
    """``hello``'s answer (``success=true`` even when refused: read ``accepted``)."""

    protocol_version: int
    fingerprint: str
    accepted: bool
    differences: list[str] = []
    layout: str = ""


class SaveCheckpointResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where the weights went (one shard per rank under tensor parallelism) and its size."""

    path: str
    bytes: int


class LoadCheckpointResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The file the weights were read from."""

    path: str


class FlushCacheResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Always ``flushed=true``: a flush refused while requests run fails the call.

    ``freed_bytes``: what the model's prefix cache held (0 for a model that caches
    nothing; absent from a scheduler older than the prefix cache).
    """

    flushed: bool
    freed_bytes: int = 0


class GetLoadResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Requests running and waiting, the recent token rate, steps run, the process id,
    the model's fingerprint (``""`` from a scheduler that predates it): a
    dispatcher with prefill and decode apart joins replicas of one model only; and
    ``prefix_cache_tokens``, the most tokens the prefix cache holds (its byte bound
    over one token's state; 0: no cache, or a scheduler that predates it): a
    ``cache_aware`` dispatcher bounds its guess of that cache by it;
    ``upstream_aborts`` and ``upstream_dropped``, the requests dropped unanswered and
    the outputs dropped because the reader of their outputs went away (0 from a
    scheduler that predates them)."""

    running: int
    queued: int
    tokens_per_s: float
    steps: int
    pid: int
    model: str = ""
    prefix_cache_tokens: int = 0
    upstream_aborts: int = 0
    upstream_dropped: int = 0


class TokenDigestResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A digest (hex) of every token sampled, in order, the count, and the rank."""

    digest: str
    tokens: int
    rank: int


class MetricsResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The Prometheus text exposition, cut in pieces that fit: join them with ``""``."""

    text: list[str]


class ShutdownResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What was running and waiting when the shutdown was asked (each gets ``shutdown``)."""

    running: int
    queued: int


class ModelInfoResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a client may send: the model's name, vocabulary and limits.

    Attributes:
        model: the model's name.
        vocab_size: token ids run from 0 to ``vocab_size - 1``.
        stop_token_ids: ids that end a request by themselves (never in
            ``output_ids``); a request adds its own in ``sampling``.
        max_prompt_tokens: the longest ``input_ids`` the server accepts.
    """

    model: str
    vocab_size: int
    stop_token_ids: list[int]
    max_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RpcMethodSpec:
    """One rpc method: its name, what it takes, what it returns, one line on what it does."""

    name: str
    params: type[msgspec.Struct]
    result: type[msgspec.Struct]
    summary: str


#: Every method a scheduler registers, in the document's order.
RPC_METHODS: Final[tuple[RpcMethodSpec, ...]] = (
    RpcMethodSpec("hello", HelloParams, HelloResult,
                  "compare wire layouts before the first request"),
    RpcMethodSpec("model_info", NoParams, ModelInfoResult,
                  "the model's name, vocabulary size, stop ids and longest prompt"),
    RpcMethodSpec("get_load", NoParams, GetLoadResult, "queue sizes and token rate"),
    RpcMethodSpec("save_checkpoint", CheckpointParams, SaveCheckpointResult,
                  "write the weights to path (atomically)"),
    RpcMethodSpec("load_checkpoint", CheckpointParams, LoadCheckpointResult,
                  "read the weights back from path"),
    RpcMethodSpec("flush_cache", NoParams, FlushCacheResult,
                  "empty the prefix cache; fails while requests are in flight"),
    RpcMethodSpec("token_digest", NoParams, TokenDigestResult,
                  "a digest of every sampled token (ranks must agree)"),
    RpcMethodSpec("metrics", NoParams, MetricsResult, "the Prometheus text, in pieces"),
    RpcMethodSpec("shutdown", NoParams, ShutdownResult,
                  "stop after this step, answering everything in flight"),
)
