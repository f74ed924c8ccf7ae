"""The concrete requests and outputs a scheduler exchanges.

Names follow the serving engines our users come from (``BatchTokenIDOut``,
``RpcReqOutput``, ...). Constraints live in the types: a request that breaks
one fails at decode, with a :class:`~messages.errors.DecodeError` naming the
field, before any handler sees it.

Token-id sequences are packed uint32 memoryviews (:data:`~messages.base.TokenIds`),
not lists of Python ints: decoding 256 ids as a list builds 256 objects,
while msgspec reads a packed ``bin`` in C, as a view of the frame.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from messages.base import (
    MAX_BATCH,
    MAX_TOKENS,
    Output,
    PackedU32,
    PackingMeta,
    Request,
    Rid,
    Scalar,
    TokenIds,
    cast_u32,
    packed_u32,
)
from messages.rids import MAX_RID, RidColumn

__all__ = [
    "BatchEmbeddingOut",
    "BatchTokenIDOut",
    "ErrorCode",
    "ErrorOut",
    "FinishReason",
    "Guide",
    "GuideKind",
    "MAX_LOGIT_BIAS",
    "MAX_TOP_LOGPROBS",
    "AbortReq",
    "KVHandoff",
    "RpcReqInput",
    "RpcReqOutput",
    "RpcResult",
    "SamplingParams",
    "TokenizedEmbeddingReqInput",
    "TokenizedGenerateReqInput",
]

#: Why a request stopped producing tokens.
FinishReason = Literal["stop", "length", "abort"]
#: Why a request was answered with :class:`ErrorOut`.
ErrorCode = Literal[
    "invalid_request", "decode_error", "unknown_method", "overloaded", "internal", "shutdown",
    "replica_lost",
]
#: Which data-parallel replica serves a request: ``None`` lets the dispatcher
#: balance it; a number pins it (tests, cache affinity). Ignored by a lone scheduler.
DpRank = Annotated[int, msgspec.Meta(ge=0, le=1023)]
#: What an rpc method may return: a flat mapping of scalars or scalar lists.
RpcResult = dict[
    Annotated[str, msgspec.Meta(max_length=256)],
    Scalar | Annotated[list[Scalar], msgspec.Meta(max_length=1 << 16)],
]


_MAX_PACKED_BYTES = 4 * MAX_TOKENS
#: The most tokens one request's ``logit_bias`` may name.
MAX_LOGIT_BIAS = 1024
#: The most alternatives a request may ask for at each position (OpenAI's bound).
MAX_TOP_LOGPROBS = 20

if TYPE_CHECKING:
    # What a reader gets and a writer may pass: a column reads as a sequence
    # of str, and __post_init__ packs any sequence of str into a column.
    RidSeq = Sequence[str]
else:
    # What msgspec sees, which is what travels: one string (messages.rids).
    # msgspec reads it natively, with no hook; __post_init__ wraps it.
    RidSeq = Annotated[str, msgspec.Meta(max_length=(MAX_RID + 1) * MAX_BATCH)]


#: What a :class:`Guide`'s ``spec`` is.
GuideKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
#: The longest guide spec (a schema, a regex, a grammar, the choices as JSON).
MAX_GUIDE_SPEC = 1 << 20


class Guide(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """A constraint on a generate request's output (structured output).

    The scheduler compiles ``(kind, spec)`` once per distinct pair against its
    model's vocabulary (a bounded cache) and masks the request's logits every
    step so that only tokens the constraint allows can be sampled; the request
    ends ``stop`` when the constraint is complete. ``spec`` by ``kind``:

    * ``json_schema``: a JSON Schema, as JSON text (the answer is one JSON value
      it validates, written without optional whitespace);
    * ``json_object``: unused (any JSON object);
    * ``regex``: a regular expression the whole answer matches;
    * ``choice``: a JSON array of strings: the answer is exactly one of them;
    * ``grammar``: a Lark grammar (llguidance's dialect), or a GBNF one (``::=``).
    """

    kind: GuideKind
    spec: Annotated[str, msgspec.Meta(max_length=MAX_GUIDE_SPEC)] = ""


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True,
                     gc=False, metaclass=PackingMeta):
    """How to pick the next token.

    ``temperature == 0`` means greedy (and so does any below 1e-5, as in vLLM:
    float32 logits divided by less overflow); ``top_k == 0`` and ``top_p == 1``
    disable those filters; ``stop_token_ids=None`` adds no stop tokens to
    the model's own. ``seed`` makes sampling reproducible per request,
    whatever else shares the batch. ``ignore_eos`` runs past the model's own
    stop tokens (its end-of-sequence ids): only ``stop_token_ids`` and
    ``max_new_tokens`` end the request (a benchmark asking for exactly N
    tokens). ``guide`` constrains the output (:class:`Guide`).

    The penalties are vLLM's: ``presence_penalty`` is subtracted from the logit of
    every token the answer holds, ``frequency_penalty`` times its count in the
    answer; ``repetition_penalty`` divides the positive logits (multiplies the
    negative ones) of every token in the prompt or the answer (1: none).
    ``min_tokens``: the stop tokens (the model's and ``stop_token_ids``) cannot be
    sampled before that many tokens. ``logit_bias`` adds its value (-100..100) to
    its token's logit, at most :data:`MAX_LOGIT_BIAS` tokens. ``top_logprobs``:
    with ``return_logprob``, the ids and logprobs of that many most likely
    tokens at each position (:class:`BatchTokenIDOut`'s ``top_ids``).
    ``prompt_logprobs`` (None: not asked): the logprob of each prompt token
    after the first, and that many alternatives at each of those positions;
    the prompt is then read whole (its cached prefix is not reused), and with
    ``max_new_tokens=0`` the request ends ``length`` once it is read (a prompt
    scored, no token sampled).

    Fields travel by position: a new one is appended, never inserted, so a
    shorter (older) array still decodes, the missing items taking their
    defaults, and an older reader ignores the items past its last field.
    Every field is written, defaults included (``omit_defaults`` does not
    shorten an ``array_like`` struct).
    """

    max_new_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1e4)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    stop_token_ids: TokenIds | None = None
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] | None = None
    ignore_eos: bool = False
    guide: Guide | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 1.0
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0
    logit_bias: Annotated[dict[Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)],
                               Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]],
                          msgspec.Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def _pack(self) -> None:  # on construction (PackingMeta)
        if self.stop_token_ids is not None:
            self.stop_token_ids = packed_u32(self.stop_token_ids, field="stop_token_ids")

    def _unpack(self) -> None:  # after a decode, by the request that carries it
        if self.stop_token_ids is not None:
            self.stop_token_ids = cast_u32(self.stop_token_ids, "sampling.stop_token_ids")


class TokenizedGenerateReqInput(Request, metaclass=PackingMeta):
    """Generate tokens for an already-tokenized prompt."""

    input_ids: TokenIds
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    return_logprob: bool = False
    input_embeds: torch.Tensor | None = None
    dp_rank: DpRank | None = None
    #: Read the prompt, sample the first token, then hand the request's state
    #: off (:class:`KVHandoff`) instead of decoding it here: set by a
    #: dispatcher that runs prefill and decode apart (``--pd P:D``).
    prefill_only: bool = False

    def _pack(self) -> None:  # on construction (PackingMeta)
        self.input_ids = packed_u32(self.input_ids, field="input_ids")

    def _unpack(self) -> None:  # once per request received (PackingMeta)
        try:  # one C call: msgspec checked the type (a byte view) and bounded it
            self.input_ids = self.input_ids.cast("I")
        except TypeError:  # a length that is not whole uint32 values
            self.input_ids = cast_u32(self.input_ids, "input_ids")
        sampling = self.sampling
        if sampling.stop_token_ids is not None:
            sampling._unpack()


class TokenizedEmbeddingReqInput(Request, metaclass=PackingMeta):
    """Embed an already-tokenized text."""

    input_ids: TokenIds
    dp_rank: DpRank | None = None

    def _pack(self) -> None:  # on construction (PackingMeta)
        self.input_ids = packed_u32(self.input_ids, field="input_ids")

    def _unpack(self) -> None:  # once per request received (PackingMeta)
        self.input_ids = cast_u32(self.input_ids, "input_ids")


class AbortReq(Request):
    """Abort the request whose id is ``rid`` (queued or running)."""


class RpcReqInput(Request):
    """A control call (``save_checkpoint``, ``get_load``, ...) on the scheduler."""

    method: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z_]\w*$")]
    parameters: Annotated[
        dict[Annotated[str, msgspec.Meta(max_length=128)], Scalar], msgspec.Meta(max_length=64)
    ] = msgspec.field(default_factory=dict)


class RpcReqOutput(Output):
    """The one reply to an :class:`RpcReqInput` with the same ``rid``."""

    rid: Rid
    success: bool
    message: Annotated[str, msgspec.Meta(max_length=1 << 16)] = ""
    result: RpcResult | None = None


class BatchTokenIDOut(Output):
    """New tokens of every running request after one decode step, in columns.

    Request ``i`` (``rids[i]``) produced ``output_lens[i]`` tokens this step:
    its slice of the packed ``output_ids`` (and of ``logprobs``, when asked)
    starts where request ``i - 1``'s ended. ``finished_reasons[i]`` is
    ``None`` while it still runs. The columnar layout keeps a 64-request
    batch to a handful of packed arrays instead of an object per request;
    the lengths are unsigned, so no slice can be negative.

    ``cached_tokens[i]``, when the column is present, is how many of request
    ``i``'s prompt tokens were read from the replica's prefix cache instead of
    computed (OpenAI's ``usage.prompt_tokens_details.cached_tokens``). Senders
    fill it only in a batch where some request sends its first output or
    finishes, so it travels about once per request, not once per token; a
    reader keeps the latest value it saw for a request. ``None`` (the
    default, and what older senders write): not reported.

    ``top_ids`` and ``top_logprobs`` (both or neither, with ``logprobs``):
    the ``k`` most likely tokens at each output position and their logprobs,
    most likely first, ``k`` entries per output id (``k`` is the same for
    every request of the batch: ``len(top_ids) // len(output_ids)``), so the
    alternatives of output id ``j`` are ``top_ids[j * k : (j + 1) * k]``.

    ``prompt_lens`` (one per rid, when some request of the batch asked for
    ``prompt_logprobs`` and sends its first output here): how many prompt
    logprobs request ``i`` has in ``prompt_logprobs`` (its prompt's tokens
    after the first; 0 for the others), sliced as ``output_lens`` slices
    ``output_ids``; ``prompt_top_ids`` / ``prompt_top_logprobs`` hold ``k``
    alternatives per entry, as ``top_ids`` does (``k`` one per batch, 0: none).

    ``rids`` may be given as any sequence of ``str``; it is kept as a
    :class:`~messages.RidColumn` (it travels as one string, and a decoded
    one makes its ``str`` objects only when first read). A plain ``str``
    given as ``rids`` is read as that wire form, not as a list of letters.
    """

    rids: RidSeq
    output_ids: TokenIds
    output_lens: PackedU32
    finished_reasons: Annotated[list[FinishReason | None], msgspec.Meta(max_length=MAX_BATCH)]
    logprobs: npt.NDArray[np.float32] | None = None
    hidden_states: torch.Tensor | None = None
    cached_tokens: PackedU32 | None = None
    top_ids: PackedU32 | None = None
    top_logprobs: npt.NDArray[np.float64] | None = None
    prompt_lens: PackedU32 | None = None
    prompt_logprobs: npt.NDArray[np.float64] | None = None
    prompt_top_ids: PackedU32 | None = None
    prompt_top_logprobs: npt.NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        # Once per decode step of the whole batch: the checks stay cheap, and
        # the decode path (a str, two byte views) is tested first.
        rids = self.rids
        if type(rids) is str:  # the wire form: decoded, or given so
            self.rids = rids = RidColumn.from_wire(rids)
        elif type(rids) is not RidColumn:
            self.rids = rids = RidColumn(rids)
        ids = self.output_ids
        if (type(ids) is memoryview and ids.format == "B" and not ids.nbytes & 3
                and ids.nbytes <= _MAX_PACKED_BYTES):  # packed_u32's decode path, inline
            self.output_ids = ids = ids.cast("I")
        else:
            self.output_ids = ids = packed_u32(ids, field="output_ids")
        lens = self.output_lens
        if (type(lens) is memoryview and lens.format == "B" and not lens.nbytes & 3
                and lens.nbytes <= _MAX_PACKED_BYTES):
            self.output_lens = lens = lens.cast("I")
        else:
            self.output_lens = lens = packed_u32(lens, field="output_lens")
        n = len(rids)
        if n > MAX_BATCH:
            raise ValueError(f"{n} rids, more than {MAX_BATCH}")
        if len(lens) != n:
            raise ValueError(f"output_lens has {len(lens)} entries for {n} rids")
        if len(self.finished_reasons) != n:
            raise ValueError(f"finished_reasons has {len(self.finished_reasons)} entries "
                             f"for {n} rids")
        total = len(ids)
        if sum(lens) != total:
            raise ValueError(f"output_lens add up to {sum(lens)}, output_ids has {total}")
        lp = self.logprobs
        if lp is not None and (lp.dtype != np.float32 or lp.shape != (total,)):
            raise ValueError("logprobs must be float32 with one entry per output id")
        cached = self.cached_tokens
        if cached is not None:
            self.cached_tokens = cached = packed_u32(cached, field="cached_tokens")
            if len(cached) != n:
                raise ValueError(f"cached_tokens has {len(cached)} entries for {n} rids")
        tops = self.top_ids
        if tops is not None or self.top_logprobs is not None:
            if tops is None or self.top_logprobs is None or lp is None:
                raise ValueError("top_ids and top_logprobs come together, with logprobs")
            self.top_ids = tops = packed_u32(tops, field="top_ids")
            tlp = self.top_logprobs
            if (tlp.dtype != np.float64 or tlp.shape != (len(tops),)
                    or (total and len(tops) % total) or (not total and len(tops))):
                raise ValueError("top_ids and top_logprobs must be float64 with k entries "
                                 "each per output id")
        plens = self.prompt_lens
        if plens is not None:
            self.prompt_lens = plens = packed_u32(plens, field="prompt_lens")
            plp = self.prompt_logprobs
            if (len(plens) != n or plp is None or plp.dtype != np.float64
                    or plp.shape != (sum(plens),)):
                raise ValueError("prompt_lens (one per rid) and prompt_logprobs (float64, "
                                 "as many as they add up to) come together")
            ptops = self.prompt_top_ids
            if ptops is not None or self.prompt_top_logprobs is not None:
                ptlp = self.prompt_top_logprobs
                if ptops is None or ptlp is None:
                    raise ValueError("prompt_top_ids and prompt_top_logprobs come together")
                self.prompt_top_ids = ptops = packed_u32(ptops, field="prompt_top_ids")
                entries = len(plp)
                if ptlp.dtype != np.float64 or ptlp.shape != (len(ptops),) or (
                        entries and len(ptops) % entries) or (not entries and len(ptops)):
                    raise ValueError("prompt_top_ids and prompt_top_logprobs must be "
                                     "float64 with k entries each per prompt logprob")
        elif self.prompt_logprobs is not None or self.prompt_top_ids is not None:
            raise ValueError("prompt_logprobs come with prompt_lens")

    def prompt_top_k(self) -> int:
        """Alternatives per prompt logprob in ``prompt_top_ids`` (0: none)."""
        plp, ptops = self.prompt_logprobs, self.prompt_top_ids
        if plp is None or ptops is None or not len(plp):
            return 0
        return len(ptops) // len(plp)

    def top_k(self) -> int:
        """Alternatives per output id in ``top_ids`` (0: none)."""
        total = len(self.output_ids)
        return len(self.top_ids) // total if self.top_ids is not None and total else 0

    @classmethod
    def from_lists(
        cls,
        rids: Sequence[str],
        new_ids: list[list[int]],
        finished_reasons: list[FinishReason | None],
        logprobs: list[list[float]] | None = None,
        cached_tokens: list[int] | None = None,
    ) -> BatchTokenIDOut:
        """Build a batch from per-request lists (convenient, not the hot path)."""
        lens = packed_u32([len(x) for x in new_ids], field="output_lens")
        flat = packed_u32([t for ids in new_ids for t in ids], field="output_ids")
        lp = None
        if logprobs is not None:
            lp = np.asarray([v for row in logprobs for v in row], np.float32)
        cached = None if cached_tokens is None else packed_u32(cached_tokens,
                                                               field="cached_tokens")
        return cls(rids=rids, output_ids=flat, output_lens=lens,
                   finished_reasons=finished_reasons, logprobs=lp, cached_tokens=cached)

    def __len__(self) -> int:
        return len(self.rids)

    def offsets(self) -> list[int]:
        """Start of each request's slice, plus the end: ``len(self) + 1`` entries."""
        return list(itertools.accumulate(self.output_lens, initial=0))

    def items(self) -> Iterator[tuple[str, TokenIds, FinishReason | None]]:
        """Iterate ``(rid, new_ids, finished_reason)`` per request (views, no copy)."""
        bounds = self.offsets()
        for i, rid in enumerate(self.rids):
            yield rid, self.output_ids[bounds[i] : bounds[i + 1]], self.finished_reasons[i]

    def logprobs_items(self) -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
        """Iterate ``(rid, logprobs of its new tokens)``; empty if none were asked."""
        if self.logprobs is None:
            return
        bounds = self.offsets()
        for i, rid in enumerate(self.rids):
            yield rid, self.logprobs[bounds[i] : bounds[i + 1]]

    def select(self, keep: Sequence[bool]) -> BatchTokenIDOut:
        """A new batch of the requests marked in ``keep`` (one flag per request).

        ``hidden_states`` rows follow their tokens when it has one row per
        output id; otherwise it is left out.
        """
        bounds = self.offsets()
        spans = [(bounds[i], bounds[i + 1]) for i, k in enumerate(keep) if k]
        ids = np.frombuffer(self.output_ids, np.uint32)
        if spans:
            tokens = np.concatenate([np.arange(a, b) for a, b in spans])
        else:
            tokens = np.zeros(0, np.int64)
        hidden = self.hidden_states
        if hidden is not None and hidden.shape[0] == len(ids):
            hidden = hidden[torch.from_numpy(tokens)]
        else:
            hidden = None
        width = self.top_k()
        top_ids = top_lps = None
        if self.top_ids is not None and self.top_logprobs is not None:
            at = (tokens[:, None] * width + np.arange(width)).reshape(-1)
            top_ids = packed_u32(np.frombuffer(self.top_ids, np.uint32)[at], field="top_ids")
            top_lps = self.top_logprobs[at]
        plens = self.prompt_lens
        prompt_lens = prompt_lps = prompt_top_ids = prompt_top_lps = None
        if plens is not None and self.prompt_logprobs is not None:
            pb = list(itertools.accumulate(plens, initial=0))
            ents = [np.arange(pb[i], pb[i + 1]) for i, k in enumerate(keep) if k]
            sel = np.concatenate(ents) if ents else np.zeros(0, np.int64)
            prompt_lens = packed_u32([plens[i] for i, k in enumerate(keep) if k],
                                     field="prompt_lens")
            prompt_lps = self.prompt_logprobs[sel]
            pk = self.prompt_top_k()
            if self.prompt_top_ids is not None and self.prompt_top_logprobs is not None:
                at = (sel[:, None] * pk + np.arange(pk)).reshape(-1)
                prompt_top_ids = packed_u32(np.frombuffer(self.prompt_top_ids, np.uint32)[at],
                                            field="prompt_top_ids")
                prompt_top_lps = self.prompt_top_logprobs[at]
        return BatchTokenIDOut(
            rids=[self.rids[i] for i, k in enumerate(keep) if k],
            output_ids=packed_u32(ids[tokens], field="output_ids"),
            output_lens=packed_u32([b - a for a, b in spans], field="output_lens"),
            finished_reasons=[self.finished_reasons[i] for i, k in enumerate(keep) if k],
            logprobs=None if self.logprobs is None else self.logprobs[tokens],
            hidden_states=hidden,
            cached_tokens=None if self.cached_tokens is None else packed_u32(
                [self.cached_tokens[i] for i, k in enumerate(keep) if k],
                field="cached_tokens"),
            top_ids=top_ids, top_logprobs=top_lps, prompt_lens=prompt_lens,
            prompt_logprobs=prompt_lps, prompt_top_ids=prompt_top_ids,
            prompt_top_logprobs=prompt_top_lps)


class BatchEmbeddingOut(Output):
    """Embeddings of finished embedding requests: row ``i`` belongs to ``rids[i]``."""

    rids: Annotated[list[Rid], msgspec.Meta(max_length=MAX_BATCH)]
    embeddings: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.embeddings.shape)
        if len(shape) != 2 or shape[0] != len(self.rids):
            raise ValueError(f"embeddings must be ({len(self.rids)}, dim), got {shape}")

    def select(self, keep: Sequence[bool]) -> BatchEmbeddingOut:
        """A new batch of the rows marked in ``keep`` (one flag per row)."""
        rows = [i for i, k in enumerate(keep) if k]
        return BatchEmbeddingOut(rids=[self.rids[i] for i in rows],
                                 embeddings=self.embeddings[rows])


class ErrorOut(Output):
    """The terminal answer to a request that was rejected or failed.

    Sent when a request could not be decoded (and its ``rid`` could be
    read), broke a constraint, named an unknown rpc method, or could not be
    served. ``rid`` is the request it answers.
    """

    rid: Rid
    code: ErrorCode
    message: Annotated[str, msgspec.Meta(max_length=1 << 16)] = ""


#: A model's identity as a hand-off states it: its name, a digest of its
#: configuration and its dtype (``HFCausalLM.fingerprint``).
ModelFingerprint = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class KVHandoff(Request, Output, metaclass=PackingMeta):
    """A generate request's state once its prompt is read: from a prefill replica to a
    decode replica (prefill and decode apart, ``--pd P:D``).

    It is an :class:`Output` of the prefill replica (its router sends it on the
    ``out`` channel; a dispatcher's router sends it on to the decode replica it
    picks) and a :class:`Request` of the decode replica (on its ``work``
    channel), which adopts the state and streams the rest.

    ``kv`` is every layer's keys and values over the prompt's positions,
    ``(layers, 2, kv_heads, len(input_ids), head_dim)`` in the model's dtype;
    on one node it travels in a shared-memory slab (a view on receipt).
    ``output_ids`` are the tokens sampled so far (the last one not yet read
    by the model), the first ``sent`` of them already sent to the client.
    ``rng_state`` is the sampler's generator state (``None``: greedy).
    ``fingerprint`` names the model that made ``kv``: a replica whose
    model differs refuses the hand-off, naming both.
    """

    input_ids: TokenIds
    output_ids: TokenIds
    sent: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
    sampling: SamplingParams
    kv: torch.Tensor
    fingerprint: ModelFingerprint
    stream: bool = False
    return_logprob: bool = False
    logprobs: npt.NDArray[np.float32] | None = None
    rng_state: torch.Tensor | None = None
    cached_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0

    def _pack(self) -> None:  # on construction (PackingMeta)
        self.input_ids = packed_u32(self.input_ids, field="input_ids")
        self.output_ids = packed_u32(self.output_ids, field="output_ids")

    def _unpack(self) -> None:  # once per hand-off received (PackingMeta)
        self.input_ids = cast_u32(self.input_ids, "input_ids")
        self.output_ids = cast_u32(self.output_ids, "output_ids")
        sampling = self.sampling
        if sampling.stop_token_ids is not None:
            sampling._unpack()
