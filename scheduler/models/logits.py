"""Penalties and biases on next-token logits, before sampling (vLLM's semantics), and
the top alternatives a request asks to see (:func:`note_top_logprobs`, and
:func:`score_prompt` for its prompt's tokens).

For the rows whose request asks (:func:`asks`), in vLLM's order:

1. ``logit_bias``: each value added to its token's logit (ids past the
   vocabulary ignored);
2. ``min_tokens``: while the answer holds fewer tokens, the request's stop
   tokens (the model's unless ``ignore_eos``, and its ``stop_token_ids``) are
   set to ``-inf``, so they cannot be sampled;
3. ``repetition_penalty``: the logit of every token seen in the prompt or the
   answer is divided by it when positive, multiplied by it when negative;
4. ``frequency_penalty`` times the token's count in the answer, and
   ``presence_penalty`` once for a token the answer holds, are subtracted.

A batch where no request asks pays one pass over its parameters and nothing
else (the logits are returned as they are). Otherwise the logits are copied
once (the caller keeps the model's own, for logprobs) and each step touches
only the entries it changes: the (row, token) positions of the biases, the
stop tokens, and the tokens each asking request has seen, for all the
asking rows together (a gather and a scatter; a numpy ``unique`` of the
answers' positions for presence), never a whole ``(B, vocab)`` array per
step beyond that copy. The positions are built again at each step from the
prompt and the answer so far (``benchmarks/penalties.py`` measures a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from messages import SamplingParams, TokenIds

__all__ = ["Noted", "Penalized", "asks", "note_top_logprobs", "penalize", "score_prompt"]


class _Prompt(Protocol):
    @property
    def input_ids(self) -> TokenIds: ...


class Penalized(Protocol):
    """What :func:`penalize` reads of a running request (the batch's ``Seq``)."""

    @property
    def req(self) -> _Prompt: ...

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def out(self) -> list[int]: ...

    @property
    def stop(self) -> frozenset[int]: ...


def asks(sp: SamplingParams) -> bool:
    """Whether ``sp`` asks for any penalty, bias or ``min_tokens``."""
    return bool(sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or sp.min_tokens or sp.logit_bias)


def penalize(logits: torch.Tensor, seqs: Sequence[Penalized]) -> torch.Tensor:
    """``logits`` (``(B, vocab)``, row ``i`` for ``seqs[i]``) with each request's
    penalties and biases applied; the same tensor when no request asks for any
    (otherwise a new one: the caller's stays the model's own). A ``-inf`` logit
    stays ``-inf`` (every step adds, scales by a positive factor or fills with
    ``-inf``): the batch masks a guided request's logits before, and relies on it."""
    picked = [i for i, s in enumerate(seqs) if asks(s.sampling)]
    if not picked:
        return logits
    out = logits.clone()
    vocab = out.shape[-1]
    flat = out.view(-1)  # (row, token) is flat[row * vocab + token]: every step below
    # touches only the entries it changes, never a whole (B, vocab) array (and by
    # index_select / index_copy_ / index_add_: torch's ``flat[pos]`` is ~100x slower
    # on CPU)
    # 1. logit_bias (its ids are distinct: a dict's keys)
    at: list[int] = []
    bias: list[float] = []
    for i in picked:
        lb = seqs[i].sampling.logit_bias
        if lb:
            base = i * vocab
            for t, v in lb.items():
                if t < vocab:
                    at.append(base + t)
                    bias.append(v)
    if at:
        flat.index_add_(0, torch.tensor(at), torch.tensor(bias, dtype=out.dtype))
    # 2. min_tokens: no stop token before the answer holds that many
    stops = [i * vocab + t for i in picked if len(seqs[i].out) < seqs[i].sampling.min_tokens
             for t in seqs[i].stop if t < vocab]
    if stops:
        flat.index_fill_(0, torch.tensor(stops), float("-inf"))
    # 3. repetition_penalty, over the prompt's and the answer's tokens
    rep = [i for i in picked if seqs[i].sampling.repetition_penalty != 1.0]
    if rep:
        # (a position met twice is written twice with the same value: no unique needed)
        upos = np.concatenate([_positions(i, seqs[i], vocab, prompt=True) for i in rep])
        factor = np.zeros(len(seqs))
        factor[rep] = [seqs[i].sampling.repetition_penalty for i in rep]
        by = torch.from_numpy(factor[upos // vocab]).to(out.dtype)
        pos = torch.from_numpy(upos)
        seen = flat.index_select(0, pos)
        flat.index_copy_(0, pos, torch.where(seen > 0, seen / by, seen * by))
    # 4. frequency and presence, over the answer's tokens
    fp = [i for i in picked if (seqs[i].sampling.frequency_penalty
                                or seqs[i].sampling.presence_penalty) and seqs[i].out]
    if fp:
        every = np.concatenate([_positions(i, seqs[i], vocab, prompt=False) for i in fp])
        freq = np.zeros(len(seqs))
        pres = np.zeros(len(seqs))
        freq[fp] = [seqs[i].sampling.frequency_penalty for i in fp]
        pres[fp] = [seqs[i].sampling.presence_penalty for i in fp]
        # frequency: once per occurrence (index_add_ adds up a position met twice)
        if freq.any():
            flat.index_add_(0, torch.from_numpy(every),
                            torch.from_numpy(-freq[every // vocab]).to(out.dtype))
        if pres.any():  # presence: once per token
            once = np.unique(every)
            flat.index_add_(0, torch.from_numpy(once),
                            torch.from_numpy(-pres[once // vocab]).to(out.dtype))
    return out


def _positions(i: int, seq: Penalized, vocab: int, *, prompt: bool) -> npt.NDArray[np.int64]:
    """Flat positions (``i * vocab + token``) of ``seq``'s answer tokens, and of its
    prompt's too when ``prompt``; ids past the vocabulary left out. (numpy: its
    ``unique`` is several times faster than torch's on CPU.)"""
    ids = np.array(seq.out, dtype=np.int64)
    if prompt:
        ids = np.concatenate([np.frombuffer(seq.req.input_ids, np.uint32).astype(np.int64),
                              ids])
    return ids[ids < vocab] + i * vocab


class Noted(Protocol):
    """What :func:`note_top_logprobs` reads and writes of a running request."""

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def logprobs(self) -> bool: ...

    @property
    def top_ids(self) -> list[int]: ...

    @property
    def top_lps(self) -> list[float]: ...


def _scoring(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in the dtype their logprobs are computed in: at least float32 (a
    half-precision model's), float64 for a float64 model (its prompt and top logprobs
    travel as float64, equal to its own forward pass's within 1e-9)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def note_top_logprobs(raw: torch.Tensor, seqs: Sequence[Noted]) -> None:
    """Append to each asking request's ``top_ids`` / ``top_lps`` its ``top_logprobs``
    most likely tokens at this position and their logprobs (of the model's own
    distribution ``raw``, most likely first). One ``log_softmax`` and one ``topk``
    over the asking rows together; nothing when none asks."""
    picked = [i for i, s in enumerate(seqs) if s.logprobs and s.sampling.top_logprobs]
    if not picked:
        return
    k = max(seqs[i].sampling.top_logprobs for i in picked)
    rows = _scoring(raw.index_select(0, torch.tensor(picked)))
    lps, ids = torch.log_softmax(rows, dim=-1).topk(min(k, rows.shape[-1]), dim=-1)
    for r, i in enumerate(picked):
        s = seqs[i]
        want = s.sampling.top_logprobs
        s.top_ids.extend(ids[r, :want].tolist())
        s.top_lps.extend(lps[r, :want].tolist())


def score_prompt(scores: torch.Tensor, prompt: TokenIds, k: int
                 ) -> tuple[list[float], list[int], list[float]]:
    """A prompt's logprobs from the model's logits after each of its positions
    (``scores`` ``(T, vocab)``, :meth:`~scheduler.models.protocol.Model.prompt_scores`):
    the logprob of each token after the first, and ``k`` alternatives (ids, logprobs,
    most likely first) at each of those positions."""
    ids = torch.from_numpy(np.frombuffer(prompt, np.uint32).astype(np.int64))[1:]
    rows = _scoring(scores[:len(ids)])
    if not len(ids):
        return [], [], []
    logp = torch.log_softmax(rows, dim=-1)
    lps = logp.gather(1, ids.clamp(max=logp.shape[-1] - 1).unsqueeze(1))[:, 0].tolist()
    if not k:
        return lps, [], []
    top_lps, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return lps, top_ids.reshape(-1).tolist(), top_lps.reshape(-1).tolist()
