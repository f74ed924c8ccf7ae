"""Every request and output as a msgspec struct, and the zero-copy ``Codec``.

Must not import zmq, ``bus``, ``router`` or ``scheduler``.
"""

from messages.base import (
    MAX_BATCH,
    MAX_TEXT,
    MAX_TOKENS,
    Message,
    Output,
    PackedU32,
    Request,
    Rid,
    Scalar,
    TokenIds,
    fit_text,
    packed_u32,
    token_ids,
)
from messages.catalogue import (
    AbortReq,
    BatchEmbeddingOut,
    BatchTokenIDOut,
    ErrorCode,
    ErrorOut,
    FinishReason,
    RpcReqInput,
    RpcReqOutput,
    RpcResult,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from messages.codec import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_MESSAGE_BYTES,
    Codec,
    Frame,
    concrete_types,
)
from messages.errors import BusError, CodecError, DecodeError, EncodeError
from messages.rids import MAX_RID, RidColumn

__all__ = [
    "DEFAULT_INLINE_THRESHOLD",
    "DEFAULT_MAX_FRAMES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MAX_BATCH",
    "MAX_RID",
    "MAX_TEXT",
    "MAX_TOKENS",
    "AbortReq",
    "BatchEmbeddingOut",
    "BatchTokenIDOut",
    "BusError",
    "Codec",
    "CodecError",
    "DecodeError",
    "EncodeError",
    "ErrorCode",
    "ErrorOut",
    "FinishReason",
    "Frame",
    "Message",
    "Output",
    "PackedU32",
    "Request",
    "Rid",
    "RidColumn",
    "RpcReqInput",
    "RpcReqOutput",
    "RpcResult",
    "SamplingParams",
    "Scalar",
    "TokenIds",
    "TokenizedEmbeddingReqInput",
    "TokenizedGenerateReqInput",
    "concrete_types",
    "fit_text",
    "packed_u32",
    "token_ids",
]
