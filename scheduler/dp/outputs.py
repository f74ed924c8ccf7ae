"""Which of a replica's outputs go upstream, and what they tell the ledger.

A replica's output is accepted only for rids the ledger says that replica,
in its current generation, owns; the rest are *stale* (an earlier
incarnation, an orphan still being ended, a confused peer): dropped and
counted, and an orphan whose end arrives is done. Accepted outputs move the
ledger: the first one marks a request started (it can no longer run
elsewhere), a terminal one releases it.

:class:`OutputThrottle` stops reading the replicas' outputs while the
upstream consumer of work outputs is not reading.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bus import Receiver
from messages import BatchEmbeddingOut, BatchTokenIDOut, ErrorOut, KVHandoff, Message, Output
from scheduler.dp.ledger import Ledger
from scheduler.dp.replica import Replica

__all__ = ["OutputGate", "OutputThrottle"]

log = logging.getLogger("scheduler.dp")


class OutputGate:
    """Filters replica outputs by ownership; counts what it drops in ``stats``."""

    def __init__(self, ledger: Ledger, stats: dict[str, int]) -> None:
        self.ledger = ledger
        self.stats = stats

    def accept(self, rep: Replica, out: Message) -> Output | None:
        """What of ``out`` (from ``rep``) goes upstream, or ``None``; the ledger follows."""
        ledger = self.ledger
        if isinstance(out, BatchTokenIDOut):
            keep = [self._owned(rep, rid) for rid in out.rids]
            if not all(keep):
                self._stale(rep, out.rids, out.finished_reasons, keep)
                if not any(keep):
                    return None
                out = out.select(keep)
            for rid, fin in zip(out.rids, out.finished_reasons, strict=True):
                if fin is not None:
                    ledger.finish(rid)
                else:
                    entry = ledger.get(rid)
                    if entry is not None and not entry.started:
                        ledger.start(entry)
            return out
        if isinstance(out, BatchEmbeddingOut):
            keep = [self._owned(rep, rid) for rid in out.rids]
            if not all(keep):
                self._stale(rep, out.rids, ["stop"] * len(keep), keep)
                if not any(keep):
                    return None
                out = out.select(keep)
            for rid in out.rids:
                ledger.finish(rid)
            return out
        if isinstance(out, KVHandoff):  # goes on to a decode replica (Dispatcher._hand_over)
            if not self._owned(rep, out.rid):
                self._stale(rep, [out.rid], [None], [False])
                return None
            return out
        if isinstance(out, ErrorOut):
            if not self._owned(rep, out.rid):
                self._stale(rep, [out.rid], ["error"], [False])
                return None
            ledger.finish(out.rid)
            return out
        self.stats["stale_outputs"] += 1
        log.error("%s sent a %s on its output channel: dropped", rep.name, type(out).__name__)
        return None

    def _owned(self, rep: Replica, rid: str) -> bool:
        entry = self.ledger.get(rid)
        return (entry is not None and entry.replica == rep.index
                and entry.generation == rep.generation)

    def _stale(self, rep: Replica, rids: Sequence[str], ends: Sequence[str | None],
               keep: Sequence[bool]) -> None:
        """Count outputs for rids ``rep`` does not own now; an orphan that ended is done."""
        for rid, end, k in zip(rids, ends, keep, strict=True):
            if not k:
                self.stats["stale_outputs"] += 1
                if end is not None:
                    rep.orphans.discard(rid)


class OutputThrottle:
    """Pauses every replica's output inbox while upstream's *work* consumer is not
    reading; their outputs back up into each replica's own bounded backlog.

    It is given the work backlog only: rpc replies waiting for a caller that
    does not read them are left out, as in the single scheduler's
    :class:`~scheduler.core.backpressure.InboxThrottle`, so one stuck rpc
    client never stops everyone's streams (its replies are dropped by the
    backlog's overflow instead). Paused at ``limit`` outputs waiting, resumed
    once none waits.
    """

    def __init__(self, receiver: Receiver[Message], replicas: Sequence[Replica], limit: int
                 ) -> None:
        self.receiver = receiver
        self.replicas = replicas
        self.limit = max(1, limit)
        self.paused = False

    def update(self, work_backlog: int) -> None:
        """Pause or resume given the work outputs waiting upstream now."""
        if self.paused:  # we hold their outputs back: a replica's quiet says nothing
            for rep in self.replicas:
                rep.health.output()
        if not self.paused and work_backlog >= self.limit:
            self.paused = True
            for rep in self.replicas:
                self.receiver.pause(rep.out.name)
        elif self.paused and work_backlog == 0:
            self.paused = False
            for rep in self.replicas:
                if rep.out.name in self.receiver.paused:
                    self.receiver.resume(rep.out.name)
