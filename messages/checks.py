"""The checks a request meets after it decodes: those the field tables cannot state.

Decoding enforces each field's own constraints (``docs/PROTOCOL.md``, the
tables). These depend on the server that receives the request (its
vocabulary, its replicas), so they run there, and a request that fails one
is answered ``ErrorOut(code="invalid_request")`` naming the check. The
document lists them all (section "Checks beyond the tables"), and a test
holds this module and that list together. Each returns ``""`` when the
request passes, else the text of the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from messages.base import TokenIds

__all__ = ["dp_rank_problem", "input_ids_problem", "prompt_problem"]


def prompt_problem(ids: TokenIds | Sequence[int], vocab_size: int,
                   max_prompt_tokens: int | None = None) -> str:
    """Why a model of ``vocab_size`` ids, reading at most ``max_prompt_tokens``, cannot
    read prompt ``ids`` (``""``: it can): none at all, an id outside the vocabulary,
    or more of them than the model reads.

    The one check of a prompt's tokens: the scheduler runs it on every request it
    receives (:func:`input_ids_problem`), and the HTTP front door on token ids a
    client gives, to answer 400 naming the field before anything is sent.
    ``ids`` is the wire's packed ``uint32`` ids or a list of ints.
    """
    if len(ids) == 0:
        return "no input tokens"
    if isinstance(ids, memoryview):  # the wire's packed ids: one vectorized scan
        top = int(np.frombuffer(ids, np.uint32).max())
    else:
        top = max(ids)
    if top >= vocab_size:
        return (f"token id {top} is outside the vocabulary "
                f"(size {vocab_size}: ids 0..{vocab_size - 1})")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        return f"{len(ids)} prompt tokens, the model reads at most {max_prompt_tokens}"
    return ""


def input_ids_problem(rid: str, ids: TokenIds, vocab_size: int,
                      max_prompt_tokens: int | None = None) -> str:
    """``input_ids`` must hold at least one id, every id must be below ``vocab_size``,
    and there must be at most ``max_prompt_tokens`` of them (the model's context, when it
    has one): :func:`prompt_problem`, its answer naming request ``rid``."""
    problem = prompt_problem(ids, vocab_size, max_prompt_tokens)
    return f"request {rid!r}: {problem}" if problem else ""


def dp_rank_problem(rid: str, dp_rank: int | None, replicas: int) -> str:
    """``dp_rank`` must be ``None`` or name one of the server's ``replicas`` (0-based).

    A lone scheduler is one replica: only ``0`` or ``None`` pass. A rank the
    server does not have is refused rather than ignored: the caller pinned
    the request for a reason (a cache, a test) that a silent reroute breaks.
    """
    if dp_rank is None or 0 <= dp_rank < replicas:
        return ""
    return (f"request {rid!r}: dp_rank={dp_rank} is outside this server's replicas "
            f"(valid: 0..{replicas - 1}, or null to let the server choose)")
