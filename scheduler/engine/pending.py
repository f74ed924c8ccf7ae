"""The pending table: which handle waits on which rid, and what each output gives it.

Shared by both engine faces (through :class:`~scheduler.engine.core.EngineCore`):
a handle is registered before its request is sent; outputs are turned into
the *items* handles receive (a :class:`~scheduler.StreamChunk` per request
of a token batch, an embedding row, or the error that ends it); the
terminal one unregisters the rid. Thread-safe: the threaded face's reader
and its callers meet here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from messages import BatchEmbeddingOut, BatchTokenIDOut, ErrorOut, Output
from scheduler.engine.handles import StreamChunk
from scheduler.errors import EngineError, InvalidRequest, Overloaded, RequestFailed

__all__ = ["Item", "Pending", "PendingTable"]

log = logging.getLogger("scheduler.engine")

#: What a request's handle receives: a chunk, an embedding, or its error.
Item = StreamChunk | npt.NDArray[np.float32] | EngineError


class Pending(Protocol):
    """A request's handle as the table sees it: something to hand outputs to."""

    def put(self, item: Item) -> None:
        """Deliver one output (or the error that ends the request)."""
        ...


class _Discard:
    """The entry of a request whose caller left: outputs go nowhere."""

    def put(self, item: Item) -> None:
        """Drop ``item``."""


_DISCARD = _Discard()


class PendingTable:
    """rid -> the handle waiting for its outputs."""

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

    def unregister(self, rids: Sequence[str]) -> None:
        """Forget these rids (their requests were never sent)."""
        with self._lock:
            for rid in rids:
                self._handles.pop(rid, None)

    def forget(self, rid: str) -> None:
        """The caller left: ignore the request's outputs, but keep its rid taken.

        The rid stays reserved (an entry that drops everything) until the
        scheduler's terminal answer for it arrives: a new request reusing it
        before then would receive the old one's outputs, or be refused by the
        scheduler as a duplicate and never answered.
        """
        with self._lock:
            if rid in self._handles:
                self._handles[rid] = _DISCARD

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

    def deliver(self, out: Output) -> None:
        """Turn one output into its requests' items."""
        if isinstance(out, BatchTokenIDOut):
            bounds = out.offsets()
            ids = out.output_ids.tolist()  # one conversion for the whole batch
            lps = out.logprobs.tolist() if out.logprobs is not None else None
            for i, (rid, fin) in enumerate(zip(out.rids, out.finished_reasons, strict=True)):
                a, b = bounds[i], bounds[i + 1]
                self.put(rid, StreamChunk(rid, ids[a:b], fin, None if lps is None else lps[a:b]),
                         final=fin is not None)
        elif isinstance(out, BatchEmbeddingOut):
            rows = out.embeddings.float().numpy()
            for i, rid in enumerate(out.rids):
                self.put(rid, rows[i].copy(), final=True)
        elif isinstance(out, ErrorOut):
            error = Overloaded if out.code == "overloaded" else RequestFailed
            self.put(out.rid, error(out.rid, out.code, out.message), final=True)
        else:
            log.error("unexpected output %s on the transport", type(out).__name__)
