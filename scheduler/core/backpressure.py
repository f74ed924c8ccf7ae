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

Meanwhile :class:`InboxThrottle` stops taking new requests from the inbox
whose outputs pile up, so the backlog stops growing at its source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from bus import Origin, PushOutbox
from messages import BatchEmbeddingOut, BatchTokenIDOut, ErrorOut, Output, RpcReqOutput, fit_text
from router import Router

__all__ = ["FINISH_FLUSH", "InboxThrottle", "collapse", "flush_last"]

#: Seconds a stopping process waits for its consumer to take the last outputs (those in
#: the router's backlog, and those zmq queues: a process that exits drops them).
FINISH_FLUSH = 5.0

log = logging.getLogger("scheduler")


class Pausable(Protocol):
    """A request source whose inboxes can be paused by name (a :class:`~bus.Receiver`)."""

    def pause(self, name: str) -> None: ...

    def resume(self, name: str) -> None: ...


class InboxThrottle:
    """Pauses the inboxes whose requesters' outputs pile up unread; resumes them once read.

    ``limit`` outputs waiting for one inbox's requesters pause it: its new
    requests wait in it (bounded by its high-water mark or ring capacity,
    where the sender sees it), while the requests already taken finish or
    are aborted by the backlog's overflow (:func:`collapse`). It resumes when
    its consumer has taken every waiting output. Rpc inboxes (a peer
    identity per origin) are never paused: one client not reading must not
    silence the others.
    """

    def __init__(self, source: Pausable, limit: int) -> None:
        self.source = source
        self.limit = max(1, limit)
        self.paused: set[str] = set()

    def update(self, waiting_by_origin: Mapping[Origin, int]) -> None:
        """Pause or resume inboxes given the outputs waiting per origin now."""
        waiting: dict[str, int] = {}
        for o, n in waiting_by_origin.items():
            if o.identity is None:
                waiting[o.inbox] = waiting.get(o.inbox, 0) + n
        for name, n in waiting.items():
            if n >= self.limit and name not in self.paused:
                log.warning("inbox %r paused: %d outputs wait for a consumer that is not "
                            "reading", name, n)
                self.source.pause(name)
                self.paused.add(name)
        for name in [p for p in self.paused if p not in waiting]:
            log.info("inbox %r resumed: its consumer reads again", name)
            self.source.resume(name)
            self.paused.discard(name)


def collapse(items: list[tuple[Output, Origin]], abort: Callable[[str], None],
             dropped_rpc: Callable[[RpcReqOutput], None]) -> list[tuple[Output, Origin]]:
    """Shrink an overflowing output queue (see the module docstring).

    Each request ends at most once: its first terminal item in the queue (an
    ``ErrorOut`` already there, or the one made for its stuck stream) is
    kept, and anything of it after that is dropped. So collapsing a queue
    twice, or a queue that holds a stream's tokens behind its error, never
    answers a request twice or after its end.

    Args:
        items: the queue, oldest first.
        abort: called once per stuck request id, to free its slot silently.
        dropped_rpc: called for each rpc reply dropped.
    """
    kept: list[tuple[Output, Origin]] = []
    ended: set[str] = set()  # rids whose terminal answer is kept
    stuck: list[str] = []
    why = fit_text(f"the consumer of this request's outputs stopped reading: {len(items)} "
                   "outputs waited, so its stream was dropped and it was aborted")
    for output, origin in items:
        if isinstance(output, BatchTokenIDOut):
            for rid in output.rids:
                if rid not in ended:
                    ended.add(rid)
                    stuck.append(rid)
                    kept.append((ErrorOut(rid=rid, code="overloaded", message=why), origin))
        elif isinstance(output, RpcReqOutput):
            dropped_rpc(output)
        elif isinstance(output, ErrorOut):
            if output.rid not in ended:
                ended.add(output.rid)
                kept.append((output, origin))
        elif isinstance(output, BatchEmbeddingOut):  # terminal rows
            keep = [rid not in ended for rid in output.rids]
            if not all(keep):  # a row after its request's end: dropped
                if not any(keep):
                    continue
                output = output.select(keep)
            ended.update(output.rids)
            kept.append((output, origin))
        else:
            kept.append((output, origin))
    for rid in stuck:
        abort(rid)
    return kept


def flush_last(router: Router[Output], out: PushOutbox[Output], origin: Origin,
               timeout: float = FINISH_FLUSH) -> int:
    """Give the consumer of ``origin``'s outputs ``timeout`` seconds to take the last ones
    of a stopping process; returns how many it has not taken by then (dropped at exit).

    First the router's backlog is flushed into ``out``, then
    :meth:`~bus.PushOutbox.wait_written` (``out``'s writes tracked from before the
    last outputs were routed) waits, in what is left of ``timeout``, for zmq to
    write them out: zmq drops what it still queues when the process exits. An
    ``out`` that watches its peers and has none connected is not waited for.
    """
    peers = out.peers
    if peers is not None:
        peers.last_left()  # (reads the connections' events)
        if not peers.peers:
            timeout = 0.0
    deadline = time.monotonic() + timeout
    while router.flush() and time.monotonic() < deadline:
        time.sleep(0.001)  # sleep-ok: pacing the last flush to a slow consumer
    left = router.backlog_by_origin().get(origin, 0) if router.backlog else 0
    return left + out.wait_written(max(0.0, deadline - time.monotonic()))
