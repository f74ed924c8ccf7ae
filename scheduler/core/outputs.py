"""The outputs of one step: requests in flight turned into columnar batches, one per origin;
and the terminal answer everything in flight gets when a loop stops on an exception."""

from __future__ import annotations

import numpy as np
import torch

from bus import Origin
from messages import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    ErrorCode,
    FinishReason,
    TokenizedGenerateReqInput,
    packed_u32,
    token_ids,
)
from scheduler.core.batch import Seq

__all__ = ["embedding_outputs", "stopped_by", "token_outputs"]


def stopped_by(exc: BaseException, who: str) -> tuple[ErrorCode, str]:
    """The code and message that answer what ``who`` (a scheduler, a dispatcher) had in
    flight when ``exc`` ended its loop: a signal (KeyboardInterrupt: serve's SIGTERM,
    Ctrl-C) is a ``shutdown``, anything else its failure (a stopped serve must not
    answer ``internal``, nor a stopped dispatch stay silent)."""
    if isinstance(exc, KeyboardInterrupt):
        return "shutdown", f"the {who} was stopped before the request finished"
    return "internal", f"the {who} failed: {type(exc).__name__}: {exc}"


def token_outputs(seqs: list[Seq]) -> list[tuple[BatchTokenIDOut, Origin]]:
    """One BatchTokenIDOut per origin and kind: streamed news, and every finished request.

    Requests that asked for logprobs and those that did not travel in
    separate batches (at most two per origin): a batch's ``logprobs`` column
    covers every output id in it, so sharing one would hand logprobs to a
    request that never asked; so do requests asking for different numbers of
    ``top_logprobs`` or ``prompt_logprobs`` (a batch has one ``k`` of each). A
    request's prompt logprobs go with its first output, once. A batch in which
    some request sends its first output or finishes carries every request's
    ``cached_tokens`` (prompt tokens read from the prefix cache): at most twice
    per request, not once per step. Marks what each request has sent. Requests
    silenced by backpressure (their terminal error already waits in the
    backlog) produce nothing.
    """
    groups: dict[tuple[Origin, bool, int, int], list[Seq]] = {}
    for s in seqs:
        # A request read here for another scheduler to decode sends what it has before
        # it leaves, streamed or not: the hand-off then carries nothing unsent, and the
        # per-position extras (top alternatives, the prompt's logprobs) never travel in it.
        if not s.silenced and (s.stream or s.finished is not None or _leaving(s)):
            # (a prompt's logprobs go once: later outputs group with their peers)
            pk = s.sampling.prompt_logprobs if s.prompt_lps is not None else None
            groups.setdefault((s.origin, s.logprobs, s.sampling.top_logprobs if s.logprobs
                               else 0, -1 if pk is None else pk), []).append(s)
    out: list[tuple[BatchTokenIDOut, Origin]] = []
    for (origin, with_lp, k, pk), group in groups.items():
        rids: list[str] = []
        ids: list[int] = []
        lens: list[int] = []
        lps: list[float] = []
        top_ids: list[int] = []
        top_lps: list[float] = []
        plens: list[int] = []
        plps: list[float] = []
        ptop_ids: list[int] = []
        ptop_lps: list[float] = []
        fins: list[FinishReason | None] = []
        any_scored = False  # some request sends its prompt's logprobs here
        telling = False
        for s in group:
            new = s.out[s.sent :]
            rids.append(s.req.rid)
            ids.extend(new)
            lens.append(len(new))
            if with_lp:
                lps.extend(s.lps[s.sent :])
            if k:  # (a stop token's alternatives, past the answer, stay out)
                top_ids.extend(s.top_ids[s.sent * k : len(s.out) * k])
                top_lps.extend(s.top_lps[s.sent * k : len(s.out) * k])
            fins.append(s.finished)
            scored = s.prompt_lps  # sent once, with its first output
            plens.append(0 if scored is None else len(scored))
            if scored is not None:
                any_scored = True
                plps.extend(scored)
                ptop_ids.extend(s.prompt_top_ids)
                ptop_lps.extend(s.prompt_top_lps)
                s.prompt_lps = None
            telling = telling or s.sent == 0 or s.finished is not None
            s.sent = len(s.out)
        out.append((BatchTokenIDOut(
            rids=rids, output_ids=token_ids(ids), output_lens=packed_u32(lens),
            finished_reasons=fins,
            logprobs=np.asarray(lps, np.float32) if with_lp else None,
            cached_tokens=packed_u32([max(s.cached, 0) for s in group],
                                     field="cached_tokens") if telling else None,
            top_ids=packed_u32(top_ids, field="top_ids") if k else None,
            top_logprobs=np.asarray(top_lps, np.float64) if k else None,
            prompt_lens=packed_u32(plens, field="prompt_lens") if any_scored else None,
            prompt_logprobs=np.asarray(plps, np.float64) if any_scored else None,
            prompt_top_ids=packed_u32(ptop_ids, field="prompt_top_ids")
            if any_scored and pk > 0 else None,
            prompt_top_logprobs=np.asarray(ptop_lps, np.float64)
            if any_scored and pk > 0 else None), origin))
    return out


def _leaving(s: Seq) -> bool:
    """Whether ``s`` is to be handed off after this step (prefill and decode apart)."""
    req = s.req
    return isinstance(req, TokenizedGenerateReqInput) and req.prefill_only


def embedding_outputs(seqs: list[Seq]) -> list[tuple[BatchEmbeddingOut, Origin]]:
    """One BatchEmbeddingOut per origin, for embedding requests whose prompt was read."""
    groups: dict[Origin, list[Seq]] = {}
    for s in seqs:
        groups.setdefault(s.origin, []).append(s)
    return [(BatchEmbeddingOut(rids=[s.req.rid for s in group],
                               embeddings=torch.stack([s.embedding for s in group])),  # type: ignore[misc]
             origin) for origin, group in groups.items()]
