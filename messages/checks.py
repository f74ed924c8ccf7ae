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

import numpy as np

from messages.base import TokenIds

__all__ = ["dp_rank_problem", "input_ids_problem"]


def input_ids_problem(rid: str, ids: TokenIds, vocab_size: int) -> str:
    """``input_ids`` must hold at least one id, and every id must be below ``vocab_size``."""
    if len(ids) == 0:
        return f"request {rid!r} has no input tokens"
    top = int(np.frombuffer(ids, np.uint32).max())
    if top >= vocab_size:
        return (f"request {rid!r}: token id {top} is outside the vocabulary "
                f"(size {vocab_size}: ids 0..{vocab_size - 1})")
    return ""


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
