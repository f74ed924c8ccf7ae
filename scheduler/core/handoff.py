"""Prefill and decode apart: a request's state handed from one scheduler to another.

A request the dispatcher marks ``prefill_only`` is read here as any other;
once its first token is sampled (and streamed, as always), its state leaves
as a :class:`~messages.KVHandoff` (:func:`handoff_of`) and the request
leaves this scheduler. A scheduler that receives a hand-off builds the
request back (:func:`seq_of`) and adopts its state
(:meth:`~scheduler.core.batch.Batch.adopt`): it decodes from the next step,
streaming from the first token not yet sent, so the client sees no gap and
no duplicate. A guided request (structured output) carries its guide in its
sampling parameters, not its parser state: the adopting scheduler compiles
the guide again (cached per spec) and feeds the new matcher the tokens
already answered (:func:`resume_guide`), so the rest of the answer obeys
the same grammar.
"""

from __future__ import annotations

import numpy as np

from bus import Origin
from messages import KVHandoff, TokenizedGenerateReqInput, token_ids
from scheduler.core.batch import Seq
from scheduler.models.guided import GuideError, Guides
from scheduler.models.protocol import Empty, Model, RequestState

__all__ = ["handoff_of", "resume_guide", "seq_of", "state_of"]


def handoff_of(seq: Seq, model: Model, empty: Empty | None = None) -> KVHandoff:
    """The hand-off of ``seq``, whose prompt is read and first token sampled; its state
    is written into a tensor ``empty`` makes (the outbox's slab: no copy on the way).

    Raises:
        KeyError, NotImplementedError: the model cannot export this request's state.
    """
    req = seq.req
    assert isinstance(req, TokenizedGenerateReqInput)
    state = model.export_state(seq.key, empty)
    return KVHandoff(
        rid=req.rid, input_ids=req.input_ids, output_ids=token_ids(seq.out), sent=seq.sent,
        sampling=req.sampling, kv=state.kv, fingerprint=state.fingerprint,
        stream=seq.stream, return_logprob=seq.logprobs,
        logprobs=np.asarray(seq.lps, np.float32) if seq.logprobs else None,
        rng_state=seq.generator.get_state() if seq.generator is not None else None,
        cached_tokens=max(seq.cached, 0))


def seq_of(h: KVHandoff, origin: Origin, now: float) -> Seq:
    """The request ``h`` carries, as this scheduler runs it (its state not adopted yet)."""
    req = TokenizedGenerateReqInput(rid=h.rid, input_ids=h.input_ids, sampling=h.sampling,
                                    stream=h.stream, return_logprob=h.return_logprob)
    out = list(h.output_ids)
    seq = Seq(req, origin, len(req.input_ids) + h.sampling.max_new_tokens, h.sampling,
              h.stream, h.return_logprob, t_arrival=now)
    seq.out = out
    seq.lps = h.logprobs.tolist() if h.logprobs is not None else [0.0] * len(out)
    seq.last = out[-1]
    seq.sent = h.sent
    # Alternatives are kept per position from the first; the sent ones are never read
    # again (a hand-off with unsent tokens and alternatives asked is refused before).
    k = h.sampling.top_logprobs if h.return_logprob else 0
    seq.top_ids = [0] * (h.sent * k)
    seq.top_lps = [0.0] * (h.sent * k)
    seq.prefilled = len(req.input_ids)
    seq.cached = h.cached_tokens
    seq.t_admit = seq.t_last = now
    return seq


def state_of(h: KVHandoff) -> RequestState:
    """The model state ``h`` carries."""
    return RequestState(h.kv, h.fingerprint)


def resume_guide(seq: Seq, guides: Guides) -> None:
    """Give a handed-off guided request its parser state here: a fresh matcher for its
    guide, advanced over the tokens it has answered (nothing for an unguided one).

    Raises:
        GuideError: the guide cannot be compiled here, or its grammar refuses the
            tokens already answered (naming the request).
    """
    guide = seq.sampling.guide
    if guide is None:
        return
    rid = seq.req.rid
    matcher = guides.start(rid, guide)
    if not matcher.consume_tokens(seq.out):
        raise GuideError(rid, f"its {guide.kind} guide refuses the {len(seq.out)} tokens "
                              f"already answered: {matcher.get_error()}")
    seq.matcher = matcher
