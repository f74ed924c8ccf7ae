"""What a scheduler does when a consumer stops reading its outputs.

The router queues what a sink cannot take (:mod:`router.backlog`). When one
queue passes its bound, :func:`collapse` decides what to keep:

* every request that had token outputs in the queue is *stuck*: its queued
  tokens are dropped and replaced by one terminal
  ``ErrorOut(code="overloaded")`` at the place of its first dropped output,
  and the scheduler aborts it (its slot is freed, it produces nothing more);
* errors and embeddings (each already a complete answer) are kept, unless
  their request is stuck (it already has its terminal error);
* rpc replies to a client that does not read them are dropped and counted:
  that client's calls have long timed out.

So the queue shrinks to at most one small item per request in flight, each
request is told, and the terminal errors go out once the consumer reads
again. Nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable

from bus import Origin
from messages import BatchTokenIDOut, ErrorOut, Output, RpcReqOutput, fit_text

__all__ = ["collapse"]


def collapse(items: list[tuple[Output, Origin]], abort: Callable[[str], None],
             dropped_rpc: Callable[[RpcReqOutput], None]) -> list[tuple[Output, Origin]]:
    """Shrink an overflowing output queue (see the module docstring).

    Args:
        items: the queue, oldest first.
        abort: called once per stuck request id, to free its slot silently.
        dropped_rpc: called for each rpc reply dropped.
    """
    kept: list[tuple[Output, Origin]] = []
    stuck: set[str] = set()
    why = fit_text(f"the consumer of this request's outputs stopped reading: {len(items)} "
                   "outputs waited, so its stream was dropped and it was aborted")
    for output, origin in items:
        if isinstance(output, BatchTokenIDOut):
            for rid in output.rids:
                if rid not in stuck:
                    stuck.add(rid)
                    kept.append((ErrorOut(rid=rid, code="overloaded", message=why), origin))
        elif isinstance(output, RpcReqOutput):
            dropped_rpc(output)
        elif isinstance(output, ErrorOut) and output.rid in stuck:
            continue
        else:
            kept.append((output, origin))
    for rid in stuck:
        abort(rid)
    return kept
