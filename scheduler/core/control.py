"""The scheduler's rpc methods: checkpoints, cache, load and the token digest.

A mixin of :class:`~scheduler.core.loop.Scheduler`, kept apart so the loop file
holds the loop. Each method runs inside a scheduler step, so each must end
in bounded time: checkpoints read regular files of bounded size only
(:func:`scheduler.core.checkpoint.load_state`).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from messages import RpcResult
from scheduler.core.checkpoint import MAX_INDEX_BYTES, load_state, save_state
from scheduler.core.metrics import chunks, exposition
from scheduler.models.protocol import Model

__all__ = ["ControlMethods"]


class ControlMethods:
    """The rpc methods every scheduler registers (see :class:`~scheduler.core.loop.Scheduler`)."""

    model: Model
    rank: int
    world_size: int
    _digest: hashlib.blake2b
    _steps: int
    _tokens: int
    _rate_t0: float
    _rate_tokens: int
    _rate: float
    registry: CollectorRegistry | None

    def _queue_sizes(self) -> tuple[int, int]:
        """(running, queued)."""
        raise NotImplementedError

    def _shard(self, path: str) -> Path:
        p = Path(path)
        return p if self.world_size == 1 else p.with_name(
            f"{p.name}.rank{self.rank}-of-{self.world_size}")

    def save_checkpoint(self, path: str) -> RpcResult:
        """Write the model weights atomically to ``path`` (temp file, then rename).

        With several ranks, each writes its own shard ``path.rank<r>-of-<n>``.
        """
        target = self._shard(path)
        size = save_state(dict(self.model.weights()), target)
        return {"path": str(target), "bytes": size}

    def load_checkpoint(self, path: str) -> RpcResult:
        """Load model weights written by :meth:`save_checkpoint` (this rank's shard).

        Only a regular file is read, and no bigger than this model's weights
        plus an index: a FIFO or a device would block the loop or fill
        memory, and a huge file would stall it for seconds.
        """
        target = self._shard(path)
        weights = sum(t.numel() * t.element_size() for t in self.model.weights().values())
        self.model.load_weights(load_state(target, max_bytes=weights + MAX_INDEX_BYTES))
        return {"path": str(target)}

    def token_digest(self) -> RpcResult:
        """A digest of every token this scheduler sampled, in order (ranks must agree)."""
        return {"digest": self._digest.hexdigest(), "tokens": self._tokens, "rank": self.rank}

    def flush_cache(self) -> RpcResult:
        """Drop cached state; refused while requests are in flight."""
        running, queued = self._queue_sizes()
        if running or queued:
            raise RuntimeError(f"cannot flush while {running} requests run and "
                               f"{queued} wait")
        return {"flushed": True}

    def metrics_text(self) -> RpcResult:
        """The Prometheus exposition text, in pieces that fit an rpc string (join them)."""
        if self.registry is None:
            raise RuntimeError("this scheduler records no metrics (metrics=False)")
        return {"text": list(chunks(exposition(self.registry)))}

    def get_load(self) -> RpcResult:
        """Running and queued requests, the recent token rate, and this process's pid
        (which incarnation answers: a dispatcher tells a restart from a return)."""
        now = time.monotonic()
        if now - self._rate_t0 >= 1.0:
            self._rate = self._rate_tokens / (now - self._rate_t0)
            self._rate_t0, self._rate_tokens = now, 0
        running, queued = self._queue_sizes()
        return {"running": running, "queued": queued,
                "tokens_per_s": round(self._rate, 1), "steps": self._steps,
                "pid": os.getpid()}
