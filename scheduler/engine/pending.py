"""The pending table: which handle waits on which rid, and what each output gives it.

Shared by both engine faces (through :class:`~scheduler.engine.core.SchedulerClient`):
a handle is registered before its request is sent; outputs are turned into
the *items* handles receive (a :class:`~scheduler.StreamChunk` per request
of a token batch, an embedding row, or the error that ends it); the
terminal one unregisters the rid. Thread-safe: the threaded face's reader
and its callers meet here.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from bus import Envelope, Rejected
from messages import BatchEmbeddingOut, BatchTokenIDOut, ErrorOut, Output
from scheduler.engine.handles import StreamChunk, Tops
from scheduler.errors import EngineError, InvalidRequest, Overloaded, RequestFailed

__all__ = ["Forgotten", "Item", "Pending", "PendingTable"]

log = logging.getLogger("scheduler.engine")

#: What a request's handle receives: a chunk, an embedding, or its error.
Item = StreamChunk | npt.NDArray[np.float32] | EngineError


class Pending(Protocol):
    """A request's handle as the table sees it: its rid, and something to hand outputs to."""

    @property
    def rid(self) -> str:
        """The request id the handle was registered under."""
        ...

    def put(self, item: Item) -> None:
        """Deliver one output (or the error that ends the request)."""
        ...


class Forgotten:
    """The entry of a request whose caller left: outputs go nowhere.

    It keeps the rid taken until the scheduler's terminal answer for it
    arrives. Its identity is what an abort for it is checked against: while
    :meth:`PendingTable.owns` it, the request has not ended and aborting
    ``rid`` aborts that request, not a later one that reuses the id.
    """

    __slots__ = ("rid",)

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def put(self, item: Item) -> None:
        """Drop ``item``."""


class PendingTable:
    """rid -> the handle waiting for its outputs.

    An entry is removed by its owner only, *by identity*: the handle (or
    :class:`Forgotten` token) that was put there, never whatever happens to
    sit under the rid now. A rid may be reused as soon as its request ended,
    so a caller that acts late on a rid (a cancelled stream, a failed send)
    would otherwise remove or abort the new request that reuses it. The
    scheduler's answers are the one thing addressed by rid: they are for
    whichever request holds it, and only its terminal answer frees it.
    """

    def __init__(self) -> None:
        self._handles: dict[str, Pending] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._handles)

    def register(self, rids: Sequence[str], handles: Sequence[Pending],
                 check: Callable[[], None]) -> None:
        """Register each rid's handle, all or none; ``check()`` runs under the lock first.

        Raises:
            InvalidRequest: a rid is still in flight, or two of them are equal.
            whatever ``check`` raises (the engine closed, the scheduler gone).
        """
        with self._lock:
            check()
            for rid in rids:
                if rid in self._handles:
                    raise InvalidRequest(rid, "this request id is still in flight (pending, "
                                              "or cancelled and not yet ended by the "
                                              "scheduler)")
            if len(rids) > 1 and len(set(rids)) != len(rids):
                raise InvalidRequest(rids[0], "two requests of one batch share an id")
            for rid, handle in zip(rids, handles, strict=True):
                self._handles[rid] = handle

    def unregister(self, handles: Sequence[Pending]) -> None:
        """Remove these handles (their requests were never sent); an entry that is
        no longer one of them (answered, failed, the rid reused) is left alone."""
        with self._lock:
            table = self._handles
            for handle in handles:
                if table.get(handle.rid) is handle:
                    del table[handle.rid]

    def forget(self, handle: Pending) -> Forgotten | None:
        """The caller of ``handle`` left: ignore its outputs, but keep its rid taken.

        The rid stays reserved (a :class:`Forgotten` entry that drops
        everything) until the scheduler's terminal answer for it arrives: a
        new request reusing it before then would receive the old one's
        outputs, or be refused by the scheduler as a duplicate and never
        answered.

        Returns:
            The token now holding the rid, to abort the request by (send the
            abort only while :meth:`owns` it); ``None`` when ``handle`` is no
            longer in the table: its request already ended (final answer,
            error, the engine closed), so there is nothing to abort, and the
            rid may already belong to a new request.
        """
        with self._lock:
            if self._handles.get(handle.rid) is not handle:
                return None
            token = self._handles[handle.rid] = Forgotten(handle.rid)
            return token

    def holder(self, rid: str) -> Pending | None:
        """The entry that holds ``rid`` now (``None``: no request of ours has it)."""
        return self._handles.get(rid)

    def owns(self, entry: Pending) -> bool:
        """Whether ``entry`` still holds its rid (its request has not ended)."""
        return self._handles.get(entry.rid) is entry

    def put(self, rid: str, item: Item, *, final: bool) -> None:
        """Hand ``item`` to ``rid``'s handle (``final``: and unregister it)."""
        with self._lock:
            handle = self._handles.pop(rid, None) if final else self._handles.get(rid)
        if handle is None:
            log.debug("output for unknown request %r dropped", rid)
            return
        handle.put(item)

    def fail_all(self, error: EngineError) -> None:
        """End every waiting request with ``error``."""
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            h.put(error)

    def deliver_all(self, got: Sequence[Envelope[Output] | Rejected]) -> None:
        """Deliver a poll's outputs; one that did not decode is logged (no rid to fail)."""
        for env in got:
            self._deliver_envelope(env)

    def deliver_rows(self, backlog: deque[Envelope[Output] | Rejected], rows: int) -> None:
        """Deliver outputs from the front of ``backlog`` until about ``rows`` requests
        were handed an item (at least one output; a batch is never split).

        An event loop's share of a poll: one poll can hold a thousand step
        outputs of 256 requests each when the loop fell behind, and
        delivering them in one callback held the loop (and every timer,
        socket and health check on it) for 100 ms (measured with 256 HTTP
        streams). The rest waits in ``backlog`` for the next callback.
        """
        done = 0
        while backlog and done < rows:
            done += self._deliver_envelope(backlog.popleft())

    def _deliver_envelope(self, env: Envelope[Output] | Rejected) -> int:
        """Deliver one received output; returns how many requests it was for."""
        if isinstance(env, Rejected):
            log.error("undecodable output from the scheduler: %s", env.error)
            return 1
        out = env.message
        self.deliver(out)
        return len(out.rids) if isinstance(out, BatchTokenIDOut | BatchEmbeddingOut) else 1

    def deliver(self, out: Output) -> None:
        """Turn one output into its requests' items."""
        if isinstance(out, BatchTokenIDOut):
            bounds = out.offsets()
            ids = tuple(out.output_ids)  # one conversion for the whole batch; sliced below
            lps = tuple(out.logprobs.tolist()) if out.logprobs is not None else None
            tops = _tops(out)
            prompts = _prompts(out)
            cached = out.cached_tokens
            rids, fins = list(out.rids), out.finished_reasons
            with self._lock:  # once for the batch, not once a request
                table = self._handles
                handles = [table.pop(rid, None) if fin is not None else table.get(rid)
                           for rid, fin in zip(rids, fins, strict=True)]
            for i, handle in enumerate(handles):
                if handle is None:
                    log.debug("output for unknown request %r dropped", rids[i])
                    continue
                a, b = bounds[i], bounds[i + 1]
                handle.put(StreamChunk(rids[i], ids[a:b], fins[i],
                                       None if lps is None else lps[a:b],
                                       None if cached is None else cached[i],
                                       None if tops is None else tops[a:b],
                                       *(prompts[i] if prompts is not None else (None, None))))
        elif isinstance(out, BatchEmbeddingOut):
            rows = out.embeddings.float().numpy()
            for i, rid in enumerate(out.rids):
                self.put(rid, rows[i].copy(), final=True)
        elif isinstance(out, ErrorOut):
            error = Overloaded if out.code == "overloaded" else RequestFailed
            self.put(out.rid, error(out.rid, out.code, out.message), final=True)
        else:
            log.error("unexpected output %s on the transport", type(out).__name__)


def _tops(out: BatchTokenIDOut) -> Tops | None:
    """Each output id's ``(id, logprob)`` alternatives (``top_ids``), or None."""
    k = out.top_k()
    if not k or out.top_ids is None or out.top_logprobs is None:
        return None
    pairs = list(zip(out.top_ids, out.top_logprobs.tolist(), strict=True))
    return tuple(tuple(pairs[j:j + k]) for j in range(0, len(pairs), k))


def _prompts(out: BatchTokenIDOut) -> list[tuple[tuple[float, ...] | None, Tops | None]] | None:
    """Each request's prompt logprobs and their alternatives (``prompt_lens``), or None:
    a request that sends none here gets ``(None, None)``."""
    plens, plp = out.prompt_lens, out.prompt_logprobs
    if plens is None or plp is None:
        return None
    k = out.prompt_top_k()
    values = plp.tolist()
    pairs = list(zip(out.prompt_top_ids, out.prompt_top_logprobs.tolist(), strict=True)) \
        if k and out.prompt_top_ids is not None and out.prompt_top_logprobs is not None else []
    got: list[tuple[tuple[float, ...] | None, Tops | None]] = []
    at = 0
    for n in plens:
        if not n:  # (a one-token prompt has no entry: told apart by its first output)
            got.append(((), () if k else None))
            continue
        tops = tuple(tuple(pairs[j * k:(j + 1) * k]) for j in range(at, at + n)) if k else None
        got.append((tuple(values[at:at + n]), tops))
        at += n
    return got
